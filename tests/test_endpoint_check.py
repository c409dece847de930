"""serve's socket settings checked before anything starts (shim.app.endpoint_check): a bad one
is a ConfigError naming the setting as given, and nothing at the listening path but a socket is
ever taken for one."""
import dataclasses
import socket
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

from shim.app.config import ConfigError
from shim.app.endpoint_check import check_endpoints, file_system_type, listen_path_problem
from shim.app.settings import FIELDS, Config

ROOT = Path(__file__).resolve().parents[1]


def cfg(tmp_path, origin="flag", **kw):
    """A Config whose every setting was given as ``origin`` says: by flag, or on line 7 of c.yaml."""
    base = Config(listen=str(tmp_path / "shim.sock"), upstream=str(tmp_path / "rt.sock"))
    given_as = {f: f"--{f.replace('_', '-')}" if origin == "flag" else f"c.yaml:7: {f.replace('_', '-')}"
                for f in FIELDS}
    return dataclasses.replace(base, **kw, origin=MappingProxyType(dict.fromkeys(FIELDS, origin)),
                               given_as=MappingProxyType(given_as))


def test_good_settings_pass(tmp_path):
    check_endpoints(cfg(tmp_path))
    check_endpoints(cfg(tmp_path, socket_group="0", socket_mode=0o660))


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling symlink", "directory"])
def test_anything_but_a_socket_at_the_listening_path_is_refused(tmp_path, kind):
    path = tmp_path / "shim.sock"
    if kind == "file":
        path.write_text("x")
    elif kind == "symlink":
        (tmp_path / "target").write_text("x")
        path.symlink_to(tmp_path / "target")
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
    else:
        path.mkdir()
    with pytest.raises(ConfigError, match=r"^--listen: .*never anything else"):
        check_endpoints(cfg(tmp_path))
    assert path.is_symlink() or path.exists()


def test_a_stale_socket_at_the_listening_path_may_be_replaced(tmp_path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "shim.sock"))
    s.close()
    assert listen_path_problem(str(tmp_path / "shim.sock")) is None


def test_the_setting_is_named_as_given(tmp_path):
    with pytest.raises(ConfigError, match=r"^c\.yaml:7: upstream: .*scheme 'tcp'"):
        check_endpoints(cfg(tmp_path, origin="file", upstream="tcp://1.2.3.4:5"))
    with pytest.raises(ConfigError, match=r"^--upstream: "):
        check_endpoints(cfg(tmp_path, upstream="unix://"))
    with pytest.raises(ConfigError, match=r"^c\.yaml:7: socket-mode: 0660 gives the group access but no socket group"):
        check_endpoints(cfg(tmp_path, origin="file", socket_mode=0o660))
    with pytest.raises(ConfigError, match=r"^--socket-group: no such group"):
        check_endpoints(cfg(tmp_path, socket_group="nosuchgroup-memqos"))
    with pytest.raises(ConfigError, match=r"^--listen: .* also the upstream"):
        check_endpoints(cfg(tmp_path, listen="unix://" + str(tmp_path / "rt.sock")))


def test_a_pseudo_file_system_is_refused(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
        "23 22 0:5 / /proc rw,nosuid - proc proc rw\n"
        "24 22 0:6 / /run/my\\040dir rw - tmpfs tmpfs rw\n")
    assert file_system_type("/proc/1/fd", str(mountinfo)) == "proc"
    assert file_system_type("/procfoo", str(mountinfo)) == "ext4"
    assert file_system_type("/run/my dir/x", str(mountinfo)) == "tmpfs"
    assert "proc file system" in listen_path_problem("/proc/x.sock", str(mountinfo))
    assert "proc file system" in listen_path_problem("/proc/self/a/b/x.sock")


def serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", "serve", "--kubelet-config", "none",
                           "--audit-log", str(tmp_path / "audit.jsonl"), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("text, named", [
    ("mode: observe\n# the runtime\nupstream: tcp://1.2.3.4:5\n", "c.yaml:3: upstream: "),
    ("listen: /proc/memqos-shim-test.sock\n", "c.yaml:1: listen: "),
    ("policy: Soft\nsocket_mode: '0660'\n", "c.yaml:2: socket_mode: 0660 gives the group access"),
    ("\n\nsocket-group: nosuchgroup-memqos\n", "c.yaml:3: socket-group: no such group"),
])
def test_serve_names_a_bad_endpoint_from_the_file_by_file_line_and_key(tmp_path, text, named):
    (tmp_path / "c.yaml").write_text(text)
    args = ["--config", str(tmp_path / "c.yaml")]
    if "listen" not in text:
        args += ["--listen", str(tmp_path / "shim.sock")]
    r = serve(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"memqos-shim: {tmp_path / named}"), r.stderr


def test_serve_names_a_bad_endpoint_from_a_flag_by_the_flag_even_with_a_file(tmp_path):
    (tmp_path / "c.yaml").write_text("upstream: unix:///run/containerd/containerd.sock\n")
    r = serve(tmp_path, "--config", str(tmp_path / "c.yaml"), "--upstream", "tcp://1.2.3.4:5",
              "--listen", str(tmp_path / "shim.sock"))
    assert r.returncode == 2 and r.stderr.startswith("memqos-shim: --upstream: "), r.stderr
