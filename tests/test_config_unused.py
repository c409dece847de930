"""A config file's known settings that a command does not use are named in a note, never
dropped silently (shim.app.config_unused); the settings it uses are applied. `replay`'s case,
with a real recording, is in tests/test_replay_settings.py."""
from __future__ import annotations

import subprocess
import sys

from shim.app.cli import front_end_options
from shim.app.config_unused import unused_note, unused_settings
from tests.reconciler_support import FakeCgroupTree, write_kubelet_config

MI = 2**20


def test_reset_applies_the_settings_it_uses_and_names_the_others(tmp_path):
    t = FakeCgroupTree(tmp_path / "cgroup", "cgroupfs")
    g = t.make_pod("guaranteed", "0a")
    t.set(g, "memory.min", 64 * MI)
    kc = write_kubelet_config(tmp_path / "kubelet.json")
    cfg = tmp_path / "node.yaml"
    # cgroup-root: used by reset (the only place it is given); factor, listen: serve's, not reset's
    cfg.write_text(f"cgroup-root: {t.root}\nfactor: 0.5\nlisten: unix:///run/x.sock\n")
    out = subprocess.run([sys.executable, "-m", "shim", "reset", "--dry-run", "--config", str(cfg),
                          "--kubelet-config", str(kc), "--audit-log", "none"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "would set 1 value(s) to 0" in out.stderr  # the cgroup root of the file
    note = next(line for line in out.stderr.splitlines() if "does not use" in line)
    assert f"{cfg}:2: factor" in note and f"{cfg}:3: listen" in note and "cgroup-root" not in note


def test_serve_and_nri_name_the_other_front_ends_settings_at_start(tmp_path):
    cfg = tmp_path / "both.yaml"
    cfg.write_text("nri-socket: /run/nri/nri.sock\nlisten: unix:///run/x.sock\npolicy: Soft\n")
    serve = unused_note("serve", str(cfg), front_end_options("serve"))
    nri = unused_note("nri", str(cfg), front_end_options("nri"))
    assert serve is not None and f"{cfg}:1: nri-socket" in serve and "listen" not in serve and "policy" not in serve
    assert nri is not None and f"{cfg}:2: listen" in nri and "nri-socket" not in nri and "policy" not in nri
    assert unused_note("serve", None, front_end_options("serve")) is None
    # serve says it in its log before it starts anything (here it stops at the audit log: a directory)
    out = subprocess.run([sys.executable, "-m", "shim", "serve", "--config", str(cfg),
                          "--listen", f"unix://{tmp_path}/s.sock", "--upstream", f"unix://{tmp_path}/rt.sock",
                          "--kubelet-config", "none", "--audit-log", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"serve does not use these settings of its config file, left as they are: {cfg}:1: nri-socket" \
        in out.stderr


def test_a_file_every_setting_of_which_is_used_gets_no_note(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: Soft\n")
    assert unused_settings(str(cfg), front_end_options("serve")) == []
