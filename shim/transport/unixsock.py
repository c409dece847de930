"""The listening unix socket, as the CRI transport creates it, and small shared helpers.

Used by the relay (``relay/aio.py``). The socket is bound in a fresh 0700
directory, its mode (0600, or 0660 with a group) and group are set there, then it is renamed into
place, so it is never reachable by other users, whatever the umask; a stale socket (nobody
listening) is replaced atomically; a non-socket file or a live socket at that path is refused.
"""
from __future__ import annotations

import grp
import logging
import os
import socket
import stat
import tempfile
import time
from typing import Callable

from shim.transport.endpoints import MAX_UNIX_PATH_BYTES, socket_path

log = logging.getLogger("shim.transport")


def check_socket_mode(socket_mode: int, socket_group) -> int:
    """The effective mode; ValueError for a mode that would open the socket to other users."""
    if not isinstance(socket_mode, int) or isinstance(socket_mode, bool) or socket_mode & ~0o777:
        raise ValueError(f"socket_mode must be permission bits (0o000-0o777), not {socket_mode!r}")
    if socket_mode & 0o007:
        raise ValueError(
            f"socket_mode {socket_mode:#o} gives other users access to the CRI socket; "
            "use a group (socket_group) instead"
        )
    if socket_group is None:
        if socket_mode & 0o070:
            raise ValueError(f"socket_mode {socket_mode:#o} grants group access but no socket_group is set")
    elif socket_mode == 0o600:
        socket_mode = 0o660
    return socket_mode


def resolve_gid(group: str | int) -> int:
    if isinstance(group, bool):
        raise ValueError(f"socket_group must be a group name or gid, not {group!r}")
    if isinstance(group, int):
        if group < 0:
            raise ValueError(f"socket_group: invalid gid {group}")
        return group
    if isinstance(group, str) and group.strip():
        name = group.strip()
        if name.isdigit():
            return int(name)
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise ValueError(f"socket_group: no such group {name!r}") from None
    raise ValueError(f"socket_group must be a group name or gid, not {group!r}")


def check_replaceable(path: str) -> None:
    """Nothing at path, or a stale socket. Refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            f"{path} exists and is not a socket; refusing to replace it (remove it "
            "yourself if it is really meant to be the CRI socket)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return  # stale: nobody listens
    except FileNotFoundError:
        return
    except OSError as e:
        raise OSError(
            f"{path}: cannot tell whether another process serves on this socket ({e}); "
            "refusing to replace it"
        ) from e
    finally:
        probe.close()
    raise OSError(
        f"{path}: another process is serving on this socket; refusing to replace it "
        "(is another memqos-shim running?)"
    )


def transport_endpoints(listen: str, upstream: str, socket_mode: int, socket_group) -> tuple[str, str, int]:
    """A transport's listening socket path, its upstream socket path and the listening socket's
    effective mode; ValueError for a bad endpoint, one socket for both, or a mode open to others."""
    listen_path = socket_path(listen)
    upstream_path = socket_path(upstream)
    if listen_path == upstream_path:
        raise ValueError(f"listen and upstream are the same socket: {listen_path}")
    return listen_path, upstream_path, check_socket_mode(socket_mode, socket_group)


def bind_staged(path: str, mode: int, gid: int | None, bind: Callable[[str], None]) -> tuple[int, int]:
    """Put a socket at ``path`` with its final mode and group; returns its (st_dev, st_ino).

    ``bind(tmp_path)`` binds the listening socket at a path inside a fresh 0700 directory beside
    ``path``; mode and group are set there, then the socket is renamed into place. It is
    reachable only through the private directory until its permissions are final, so it is never
    open to other users, whatever the umask; rename() atomically replaces a stale socket, so the
    path never goes missing.
    """
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    check_replaceable(path)
    tmpdir = tempfile.mkdtemp(prefix=".shim-", dir=parent)  # mode 0700
    tmp_sock = os.path.join(tmpdir, "s")
    try:
        if len(tmp_sock.encode()) > MAX_UNIX_PATH_BYTES:
            raise ValueError(
                f"listen socket path {path!r} is too long: binding it needs "
                f"{len(tmp_sock.encode())} bytes ({tmp_sock!r}), unix sockets allow "
                f"{MAX_UNIX_PATH_BYTES}"
            )
        bind(tmp_sock)
        os.chmod(tmp_sock, mode)
        if gid is not None:
            os.chown(tmp_sock, -1, gid)
        check_replaceable(path)
        os.rename(tmp_sock, path)
        st = os.lstat(path)
    finally:
        try:
            os.unlink(tmp_sock)
        except FileNotFoundError:
            pass
        os.rmdir(tmpdir)
    return st.st_dev, st.st_ino


def bind_private(path: str, mode: int, gid: int | None, backlog: int = 128) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` with its final mode; returns it and (st_dev, st_ino)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        def bind_and_listen(tmp_path: str) -> None:
            # listening before the rename: a client that finds the path is never refused
            sock.bind(tmp_path)
            sock.listen(backlog)

        socket_id = bind_staged(path, mode, gid, bind_and_listen)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, socket_id


def remove_if_ours(path: str, socket_id: tuple[int, int] | None) -> None:
    if socket_id is None:
        return
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == socket_id:
            os.unlink(path)
        else:
            log.warning("%s was replaced by someone else; leaving it", path)
    except FileNotFoundError:
        pass
    except OSError:
        log.exception("could not remove %s", path)


class ThrottledLog:
    """Log a problem (with its traceback when called from an except block) at most once per
    interval, counting the rest."""

    def __init__(self, what: str, interval: float = 10.0, level: int = logging.ERROR,
                 outcome: str = "the call goes on unaffected") -> None:
        self._what = what
        self._outcome = outcome
        self._interval = interval
        self._next = 0.0
        self._suppressed = 0
        self._level = level

    def __call__(self, method: str, problem: str | None = None) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        suppressed, self._suppressed = self._suppressed, 0
        self._next = now + self._interval
        log.log(
            self._level,
            "%s for %s%s; %s%s",
            self._what,
            method,
            f": {problem}" if problem else "",
            self._outcome,
            f" ({suppressed} more in the last {self._interval:.0f} s)" if suppressed else "",
            exc_info=problem is None,
        )
