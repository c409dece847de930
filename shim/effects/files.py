"""The shim's own files (the audit log, the trace recorder's files, the guard's state file):
opened for writing without ever following a symbolic link.

A symlink planted at one of these paths must not make the shim (usually root) append to or
create the file it points at. So the last component is opened with ``O_NOFOLLOW`` (a symlink
there fails with ELOOP and is reported as ``UnsafeFile``), the descriptor must be a regular file
(``O_NONBLOCK`` while opening, so a FIFO without a reader fails instead of hanging the start),
and ``O_CLOEXEC`` keeps it out of the child processes the shim runs (``systemctl``,
``kubelet --version``). Directories above the file are the operator's (a ``/var/log`` that is a
symlink is followed as usual). New files get the mode the caller asks for (0600 for traces and
state, 0640 for the audit log); an existing file keeps its mode.

Files written by rename (the guard's state) create their temporary file with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and rename it over the path: a rename replaces a symlink
at the destination, it never writes through it.
"""
from __future__ import annotations

import errno
import os
import stat


class UnsafeFile(OSError):
    """A path the shim writes is a symlink or not a regular file: refused, never followed."""


def open_append(path: str, mode: int = 0o600) -> int:
    """A descriptor for appending to ``path`` (created with ``mode`` if missing). Raises
    UnsafeFile when the path is a symlink or not a regular file, OSError otherwise."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, f"{path} is a symbolic link; refusing to write through it "
                                          "(remove it, or point the setting at a regular file)") from None
        if e.errno == errno.EISDIR:
            raise UnsafeFile(errno.EISDIR, f"{path} is a directory, not a regular file") from None
        if e.errno == errno.ENXIO:
            raise UnsafeFile(errno.ENXIO, f"{path} is not a regular file (a FIFO or socket?); "
                                          "refusing to write to it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{path} is not a regular file; refusing to write to it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_not_symlink(path: str) -> None:
    """Raise UnsafeFile when ``path`` exists and is a symlink (or not a regular file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(errno.ELOOP, f"{path} is a symbolic link; refusing to write through it "
                                      "(remove it, or point the setting at a regular file)")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(errno.EINVAL, f"{path} is not a regular file; refusing to write to it")
