"""serve's socket settings checked before anything starts (shim.app.endpoint_check): a bad one
is a ConfigError naming the setting as given, and nothing at the listening path but a socket is
ever taken for one."""
import dataclasses
import socket
from types import MappingProxyType

import pytest

from shim.app.config import ConfigError
from shim.app.endpoint_check import check_endpoints, file_system_type, listen_path_problem
from shim.app.settings import FIELDS, Config


def cfg(tmp_path, origin="flag", **kw):
    base = Config(listen=str(tmp_path / "shim.sock"), upstream=str(tmp_path / "rt.sock"))
    return dataclasses.replace(base, **kw, origin=MappingProxyType(dict.fromkeys(FIELDS, origin)))


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
    with pytest.raises(ConfigError, match=r"^upstream: .*scheme 'tcp'"):
        check_endpoints(cfg(tmp_path, origin="file", upstream="tcp://1.2.3.4:5"))
    with pytest.raises(ConfigError, match=r"^--upstream: "):
        check_endpoints(cfg(tmp_path, upstream="unix://"))
    with pytest.raises(ConfigError, match=r"^socket-mode: 0660 gives the group access but no socket group"):
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
