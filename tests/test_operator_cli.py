"""What an operator meets first: `serve --help` (each default said once, the tuning knobs in the
config file only), `doctor --help` (no copy of serve's flags), doctor's SKIP for a check whose
precondition failed, `explain` refusing what the API server refuses, and the start-up log (each
thing said once; a missing runtime socket named)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shim.app.config import FILE, FLAG, OPTIONS, ConfigError, resolve
from shim.tools.doctor import FAIL, PASS, SKIP, WARN, Doctor, Result, format_results, skip_without_preconditions

REPO = Path(__file__).resolve().parents[1]


def shim(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, check=check)


def option_blocks(help_text: str) -> dict[str, str]:
    """--flag -> its help text, from argparse's output."""
    body = help_text.split("options:", 1)[1]
    blocks, name = {}, None
    for line in body.splitlines():
        m = re.match(r"^  (--[a-z0-9-]+)", line)
        if m:
            name = m.group(1)
            blocks[name] = line
        elif name and line.startswith("    "):
            blocks[name] += " " + line.strip()
        elif not line.strip():
            name = None
    return blocks


# -- serve --help ------------------------------------------------------------------------------
@pytest.mark.parametrize("front", ["serve", "nri"])
def test_serve_help_says_each_default_once_and_lists_only_the_flags(front):
    from shim.app.cli import front_end_options

    options = front_end_options(front)  # each front end: the settings it uses
    out = shim(front, "--help", check=True).stdout
    blocks = option_blocks(out)
    assert all(b.count("default:") <= 1 for b in blocks.values()), \
        [f for f, b in blocks.items() if b.count("default:") > 1]
    assert "(default: None)" not in out
    flags = {f"--{o.name}" for o in options if o.where == FLAG}
    assert set(blocks) == flags | {"--config", "--help-settings"}
    assert len(blocks) < len(options)
    said = re.sub(r"-\s+", "-", " ".join(out.split()))  # argparse may break a line at a hyphen
    epilog = said.split("in the config file (--config FILE) only: ", 1)[1]
    assert {o.name for o in options if o.where == FILE} == set(epilog.split(". ", 1)[0].split(", "))


def test_the_tuning_knobs_are_config_keys_and_not_flags(tmp_path):
    file_only = {o.name for o in OPTIONS if o.where == FILE}
    assert {"guard-window", "guard-threshold", "reclaim-step", "record-keep", "h2-reset-rate",
            "max-connections"} <= file_only
    assert {"listen", "upstream", "kubelet-config", "policy", "audit-log", "metrics-address",
            "log-level", "record", "reclaim"}.isdisjoint(file_only)
    r = shim("serve", "--guard-window", "5")
    assert r.returncode == 2 and "unrecognized arguments: --guard-window" in r.stderr
    from shim.cli.main import build_parser

    (tmp_path / "c.yaml").write_text("guard-window: 5\nreclaim-step: 1Mi\n")
    cfg = resolve(build_parser().parse_args(["serve", "--config", str(tmp_path / "c.yaml"), "--policy", "Soft"]))
    assert (cfg.guard_window, cfg.reclaim_step, cfg.policy.value) == (5.0, 2**20, "Soft")
    assert cfg.origin["guard_window"] == "file"
    (tmp_path / "bad.yaml").write_text("guard-window: -1\n")
    with pytest.raises(ConfigError, match="guard-window"):
        resolve(build_parser().parse_args(["serve", "--config", str(tmp_path / "bad.yaml")]))


def test_help_settings_describes_every_setting_and_marks_the_flags():
    out = shim("serve", "--help-settings", check=True).stdout
    for o in OPTIONS:
        line = next(x for x in out.splitlines() if x.startswith(f"{o.name}: "))
        assert line.endswith("(flag)") == (o.where == FLAG), line


def test_settings_module_says_which_settings_are_file_only():
    text = (REPO / "shim" / "app" / "settings.py").read_text()
    assert "#: guard-window (config file only): " in text and "#: --listen: " in text


def test_doctor_help_does_not_repeat_serve_flags_and_takes_them():
    out = shim("doctor", "--help", check=True).stdout
    assert set(option_blocks(out)) == {"--config", "--help-settings"}
    assert "memqos-shim serve --help" in out
    from shim.cli.main import build_parser

    args = build_parser().parse_args(["doctor", "--cgroup-root", "/x", "--upstream", "/run/y.sock"])
    assert resolve(args).cgroup_root == "/x"


# -- doctor: no PASS without its precondition -----------------------------------------------
def test_a_pass_whose_precondition_failed_is_a_skip():
    results = [Result("cgroup v2", FAIL, "no cgroup v2"), Result("memory controller", FAIL, "none"),
               Result("memory.high guard", PASS, "relax"), Result("proactive reclaim", WARN, "no memory.reclaim"),
               Result("metrics", PASS, "off")]
    out = {r.name: r for r in skip_without_preconditions(results, Doctor.PRECONDITIONS)}
    assert out["memory.high guard"].verdict == SKIP
    assert out["memory.high guard"].summary == "not checked: cgroup v2 and memory controller failed (above)"
    assert out["proactive reclaim"].verdict == WARN  # what it warns about holds anyway
    assert out["metrics"].verdict == PASS
    assert format_results(list(out.values())).splitlines()[-1] == "1 pass, 1 warn, 1 skip, 2 fail"


def test_doctor_on_a_cgroup_v1_node_passes_nothing_that_needs_cgroup_v2(tmp_path):
    from tests.test_doctor import cfg, env, fake_proc

    (tmp_path / "v1").mkdir()
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    results = {r.name: r for r in Doctor(cfg(cgroup_root=str(tmp_path / "v1"), meminfo=str(tmp_path / "meminfo"),
                                             kubelet_config="none"), env(fake_proc(tmp_path))).run()}
    assert results["cgroup v2"].verdict == FAIL
    for name in Doctor.PRECONDITIONS:
        assert results[name].verdict != PASS, (name, results[name])
    assert results["proactive reclaim"].verdict == SKIP  # reclaim off passes on a cgroup v2 node
    assert results["memory.high guard"].verdict == SKIP


# -- explain ------------------------------------------------------------------------------------
def test_explain_refuses_a_request_above_the_limit():
    r = shim("explain", "--request", "1.5Gi", "--limit", "1Gi")
    assert r.returncode == 2 and r.stdout == ""
    assert "request 1.5Gi is above limit 1Gi" in r.stderr and "API server" in r.stderr
    assert shim("explain", "--request", "1Gi", "--limit", "1Gi", "--json").returncode == 0
    assert shim("explain", "--request", "1.5Gi", "--json").returncode == 0  # no limit: any request


# -- the start-up log ---------------------------------------------------------------------------
def start_log(base: Path, *, cgroup_v2: bool) -> str:
    from tests.test_serve import Shim

    s = Shim(base, f"unix://{base}/no-runtime.sock", cgroup_v2=cgroup_v2, extra=("--kubelet-version", "1.34"))
    try:
        deadline = time.monotonic() + 30
        while "does not exist" not in (base / "shim.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        s.stop()
    return (base / "shim.log").read_text()


def messages(log: str) -> list[str]:
    """The log's messages without the timestamp, start-up only."""
    return [line.split(" ", 2)[2] for line in log.splitlines() if re.match(r"^\d{4}-\d\d-\d\d ", line)]


@pytest.mark.parametrize("cgroup_v2", [True, False])
def test_start_up_log_says_each_thing_once_and_names_a_missing_runtime_socket(cgroup_v2):
    from tests.test_serve import short_dir

    base = short_dir()
    log = start_log(base, cgroup_v2=cgroup_v2)
    lines = messages(log)
    assert len(lines) == len(set(lines)), log
    gate = [x for x in lines if "the kubelet's MemoryQoS gate is off" in x]
    assert len(gate) == (1 if cgroup_v2 else 0), log
    assert sum("serving on" in x for x in lines) == 1, log
    [missing] = [x for x in lines if "does not exist" in x]
    assert missing.startswith("WARNING") and f"{base}/no-runtime.sock" in missing and "--upstream" in missing
    if not cgroup_v2:
        assert any(x.startswith("WARNING") and "not a cgroup v2 hierarchy" in x and "forwarded unchanged" in x
                   for x in lines), log
