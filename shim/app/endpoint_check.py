"""The socket settings of `serve` checked before anything starts: ``listen``, ``upstream``,
``socket-group`` and ``socket-mode``. A bad one is a ConfigError naming the setting as the
operator gave it (the flag, or the config file's path, line and key: "c.yaml:3: listen"), so
that it ends as every bad setting does: one line and exit code 2, before a file is opened or a
socket bound.

What is checked here is what can be known before binding: the endpoint's form (only unix
sockets), the listening socket and the runtime's being different, nothing but a socket at the
listening path (a regular file, a symlink or a directory there is never replaced), a directory
for it on a file system that takes sockets and that this process may write to, a group that
exists, a mode that gives nobody but the group access.
"""
from __future__ import annotations

import os
import stat

from shim.app.config import ConfigError
from shim.app.settings import Config
from shim.transport.endpoints import MAX_UNIX_PATH_BYTES, socket_path
from shim.transport.unixsock import check_socket_mode, resolve_gid

#: file systems of the kernel's own objects: a socket cannot be created there
PSEUDO_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                                 "configfs", "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc"})
#: what bind_staged adds to the socket's directory while it binds: "/.shim-XXXXXXXX/s"
STAGING_SUFFIX_BYTES = len("/.shim-xxxxxxxx/s")


def setting_name(cfg: Config, name: str) -> str:
    """The setting as the operator gave it: the flag, or the config file's path, line and key
    as written ("c.yaml:3: listen"); a default by its name."""
    return cfg.setting(name)


def check_endpoints(cfg: Config, mountinfo: str = "/proc/self/mountinfo") -> None:
    """Raise ConfigError, naming the setting, for a socket setting `serve` cannot start with."""
    try:
        upstream = socket_path(cfg.upstream)
    except ValueError as e:
        raise ConfigError(f"{setting_name(cfg, 'upstream')}: {e}") from None
    listen_name = setting_name(cfg, "listen")
    try:
        listen = socket_path(cfg.listen)
    except ValueError as e:
        raise ConfigError(f"{listen_name}: {e}") from None
    if os.path.normpath(listen) == os.path.normpath(upstream):
        raise ConfigError(f"{listen_name}: {listen} is also the upstream (the runtime's socket); "
                          "the shim listens on a socket of its own")
    problem = listen_path_problem(listen, mountinfo)
    if problem:
        raise ConfigError(f"{listen_name}: {problem}")
    gid_name = setting_name(cfg, "socket-group")
    if cfg.socket_group is not None:
        try:
            resolve_gid(cfg.socket_group)
        except ValueError as e:
            raise ConfigError(f"{gid_name}: {str(e).removeprefix('socket_group: ')}") from None
    if cfg.socket_mode is not None:
        try:
            check_socket_mode(cfg.socket_mode, cfg.socket_group)
        except ValueError as e:
            if cfg.socket_mode & ~0o777:
                why = f"{cfg.socket_mode:04o} is not a permission mode (0000..0777)"
            elif cfg.socket_group is None and cfg.socket_mode & 0o070:
                why = f"{cfg.socket_mode:04o} gives the group access but no socket group is set (socket-group)"
            else:
                why = str(e)
            raise ConfigError(f"{setting_name(cfg, 'socket-mode')}: {why}") from None


def listen_path_problem(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Why a listening socket cannot be put at ``path`` (None: it can be tried)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"cannot look at {path}: {e.strerror}"
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
            "a directory" if stat.S_ISDIR(st.st_mode) else "a file that is not a socket"
        return (f"{path} is {what}; the shim replaces only a socket there (a stale one of its own), "
                "never anything else: remove it yourself or choose another path")
    parent = os.path.dirname(path)
    if len(parent.encode()) + STAGING_SUFFIX_BYTES > MAX_UNIX_PATH_BYTES:
        return (f"{path}: its directory's path is too long to bind the socket in it "
                f"(unix socket paths have at most {MAX_UNIX_PATH_BYTES} bytes)")
    existing = parent
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{path}: {existing} is not a directory"
    fstype = file_system_type(os.path.realpath(existing), mountinfo)
    if fstype in PSEUDO_FILE_SYSTEMS:
        return f"{path}: {existing} is on a {fstype} file system, where no socket can be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path}: no permission to create it in {existing}"
    return None


def file_system_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` (absolute, without symlinks) is on, from
    mountinfo; None when it cannot be read."""
    best, fstype = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields or len(fields) < 5:
                    continue
                point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                after = fields[fields.index("-") + 1:]
                if not after:
                    continue
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, after[0]
    except OSError:
        return None
    return fstype
