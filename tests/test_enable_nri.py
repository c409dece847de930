"""`python -m shim.tools.enable_nri` (the enable-nri overlay's init container) on fake /etc
trees: containerd 1.7 files get disable = false in the NRI table (rewritten, added or
appended), 2.x files and CRI-O files already on are left alone, what it cannot edit safely is
refused untouched, and it never restarts anything."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from shim.tools.enable_nri import containerd_text, main

V2_OFF = """version = 2
root = "/var/lib/containerd"

[plugins."io.containerd.nri.v1.nri"]
  disable = true
  socket_path = "/var/run/nri/nri.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
"""


def nri_disable(text: str):
    return tomllib.loads(text).get("plugins", {}).get("io.containerd.nri.v1.nri", {}).get("disable")


def test_rewrites_disable_true_in_its_own_table_only():
    new, how = containerd_text(V2_OFF)
    assert nri_disable(new) is False and "rewrote" in how
    doc = tomllib.loads(new)
    assert doc["plugins"]["io.containerd.nri.v1.nri"]["socket_path"] == "/var/run/nri/nri.sock"
    assert doc["plugins"]["io.containerd.grpc.v1.cri"] == {"sandbox_image": "registry.k8s.io/pause:3.9"}
    assert new.replace("disable = false", "disable = true") == V2_OFF  # one line changed, nothing else


def test_adds_the_line_or_the_table_on_a_1_7_file():
    new, how = containerd_text('version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  socket_path = "/x"\n')
    assert nri_disable(new) is False and "added" in how
    new, how = containerd_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  x = 1')
    assert nri_disable(new) is False and "appended" in how
    assert tomllib.loads(new)["plugins"]["io.containerd.grpc.v1.cri"] == {"x": 1}


def test_2x_file_is_already_on_and_a_2x_file_that_disables_it_is_switched():
    assert containerd_text('version = 3\n[plugins."io.containerd.grpc.v1.cri"]\n')[0] is None
    assert containerd_text(V2_OFF.replace("disable = true", "disable = false"))[0] is None
    new, _ = containerd_text(V2_OFF.replace("version = 2", "version = 3"))
    assert nri_disable(new) is False


@pytest.mark.parametrize("text, needle", [
    ("[plugins]\n", "version 1"),  # no version key: the 1.x schema
    ("version = 2\n[plugins\n", "not valid TOML"),
    ('version = 2\n[plugins]\n"io.containerd.nri.v1.nri" = { disable = true }\n', "by hand"),
])
def test_refuses_what_it_cannot_edit_safely(text, needle):
    with pytest.raises(ValueError, match=needle):
        containerd_text(text)


def etc(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_containerd_file_edited_in_place_with_a_backup_and_idempotent(tmp_path, capsys):
    root = etc(tmp_path, {"etc/containerd/config.toml": V2_OFF})
    cfg = root / "etc/containerd/config.toml"
    os.chmod(cfg, 0o600)
    assert main(["--root", str(root), "--nri-socket", str(root / "nri.sock")]) == 0
    out = capsys.readouterr().out
    assert "restart" in out and "nothing was restarted" in out and "absent" in out
    assert nri_disable(cfg.read_text()) is False
    assert (root / "etc/containerd/config.toml.memqos-shim.bak").read_text() == V2_OFF
    assert oct(cfg.stat().st_mode & 0o777) == oct(0o600)
    first = cfg.read_text()
    assert main(["--root", str(root)]) == 0 and cfg.read_text() == first
    assert "already on" in capsys.readouterr().out
    assert not (root / "etc/crio").exists()


def test_refused_file_is_left_untouched_and_exit_code_says_so(tmp_path, capsys):
    text = "version = 2\n[plugins\n"
    root = etc(tmp_path, {"etc/containerd/config.toml": text})
    assert main(["--root", str(root)]) == 2
    assert main(["--root", str(root), "--exit-zero"]) == 0
    assert (root / "etc/containerd/config.toml").read_text() == text
    assert not (root / "etc/containerd/config.toml.memqos-shim.bak").exists()
    assert "left unchanged" in capsys.readouterr().out


def test_crio_dropin_written_unless_already_on(tmp_path):
    root = etc(tmp_path, {"etc/crio/crio.conf": "[crio.nri]\nenable_nri = false\n",
                          "etc/crio/crio.conf.d/10-x.conf": "[crio.runtime]\nx = 1\n"})
    assert main(["--root", str(root)]) == 0
    drop = root / "etc/crio/crio.conf.d/99-memqos-shim-nri.conf"
    assert tomllib.loads(drop.read_text())["crio"]["nri"]["enable_nri"] is True
    root2 = etc(tmp_path / "b", {"etc/crio/crio.conf.d/20-nri.conf": "[crio.nri]\nenable_nri = true\n"})
    assert main(["--root", str(root2)]) == 0
    assert sorted(os.listdir(root2 / "etc/crio/crio.conf.d")) == ["20-nri.conf"]


def test_no_runtime_configuration_is_reported(tmp_path):
    (tmp_path / "etc/crio").mkdir(parents=True)  # an empty dir a hostPath DirectoryOrCreate leaves
    r = subprocess.run([sys.executable, "-m", "shim.tools.enable_nri", "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nothing to do" in r.stdout
    assert os.listdir(tmp_path / "etc/crio") == []


def test_the_edit_writes_through_no_symlink_and_over_no_file_beside_the_config(tmp_path, capsys):
    """A dangling symlink where the backup goes, and files under the names an older edit used
    for its temporary file, are left as they are; the config is still switched on."""
    root = etc(tmp_path, {"etc/containerd/config.toml": V2_OFF})
    cfg = root / "etc/containerd/config.toml"
    outside = tmp_path / "outside.txt"
    (root / "etc/containerd/config.toml.memqos-shim.bak").symlink_to(outside)
    (root / "etc/containerd/config.toml.memqos-shim.tmp").write_text("someone's\n")
    assert main(["--root", str(root), "--nri-socket", str(root / "nri.sock")]) == 0
    assert nri_disable(cfg.read_text()) is False
    assert not outside.exists()
    assert (root / "etc/containerd/config.toml.memqos-shim.tmp").read_text() == "someone's\n"
    assert sorted(os.listdir(root / "etc/containerd")) == [
        "config.toml", "config.toml.memqos-shim.bak", "config.toml.memqos-shim.tmp"]
