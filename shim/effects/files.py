"""The shim's own files (the audit log, the trace recorder's files, the guard's state file):
opened for writing without ever following a symbolic link.

A symlink planted at one of these paths must not make the shim (usually root) append to or
create the file it points at. So the last component is opened with ``O_NOFOLLOW`` (a symlink
there fails with ELOOP and is reported as ``UnsafeFile``), the descriptor must be a regular file
(``O_NONBLOCK`` while opening, so a FIFO without a reader fails instead of hanging the start),
and ``O_CLOEXEC`` keeps it out of the child processes the shim runs (``kubelet --version``).
Directories above the file are the operator's (a ``/var/log`` that is a symlink is followed as
usual). New files get the mode the caller asks for (0600 for traces and
state, 0640 for the audit log); an existing file keeps its mode.

Files written by rename (the guard's state) create their temporary file with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and rename it over the path: a rename replaces a symlink
at the destination, it never writes through it.

``RotatingFile`` (the audit log, the recorder's files) appends whole lines and rotates by size
with a bounded number of files, ``FILE`` -> ``FILE.1`` -> ... -> ``FILE.<keep>`` (the oldest is
deleted): renames only, so a symlink planted at ``FILE.<n>`` is replaced, never followed, and the
new ``FILE`` is opened by ``open_append`` like the first. ``reopen()`` closes the file and opens
``FILE`` again (after logrotate renamed it away).
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Callable


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


class RotatingFile:
    """Lines appended to ``path`` by one writer thread, rotated by size before a line would push
    the file past ``max_bytes`` (0: never by size). A line is always written whole into one
    file, so a file is above ``max_bytes`` only when it holds one line that alone is. ``keep``
    rotated files are kept (0: ``path`` starts over). ``header()`` gives the bytes every new or
    empty file starts with (the recorder's trace header), none by default.

    Not thread-safe: one writer calls ``write``, ``reopen`` and ``close``. A failed open (a
    symlink planted at ``path``, a full disk) raises from ``write``; the next ``write`` tries
    again."""

    def __init__(self, path: str, mode: int, *, max_bytes: int, keep: int,
                 header: Callable[[], bytes] | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, not {max_bytes}")
        if keep < 0:
            raise ValueError(f"keep must be 0 or more, not {keep}")
        self.path = path
        self.mode = mode
        self.max_bytes = max_bytes
        self.keep = keep
        self.header = header
        self.size = 0  # bytes in the current file
        self.rotations = 0
        self._file = None
        self._header_size = 0  # what the current file held when it was opened, if only a header

    def open(self) -> None:
        """Open ``path`` for appending (UnsafeFile: a symlink or not a regular file); an empty
        file gets the header first."""
        f = open(open_append(self.path, self.mode), "ab", buffering=0)
        try:
            size = os.fstat(f.fileno()).st_size
            header_size = 0
            if size == 0 and self.header is not None:
                data = self.header()
                _write_all(f, data)
                size = header_size = len(data)
        except BaseException:
            f.close()
            raise
        self._file, self.size, self._header_size = f, size, header_size

    def write(self, line: bytes) -> None:
        """Append one whole line (rotating first when it would not fit), straight to the kernel
        (no buffer: a process killed afterwards leaves it complete). A write that fails part way
        (a full disk) is cut off again and the file closed (opened again by the next write), so
        the file holds whole lines only."""
        if self._file is None:
            self.open()
        # the size as it is (logrotate's copytruncate may have emptied the file)
        self.size = os.lseek(self._file.fileno(), 0, os.SEEK_END)
        if self.max_bytes and self.size > self._header_size and self.size + len(line) > self.max_bytes:
            self.rotate()
        before = self.size
        try:
            _write_all(self._file, line)
        except BaseException:
            try:
                os.ftruncate(self._file.fileno(), before)
            except OSError:
                pass
            self.close()
            raise
        self.size = before + len(line)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes go into the file as it is without a rotation (opening it
        first when it is closed)."""
        if self._file is None:
            self.open()
        if not self.max_bytes:
            return True
        return os.lseek(self._file.fileno(), 0, os.SEEK_END) + n <= self.max_bytes

    def rotate(self) -> None:
        """Close, rename ``path`` -> ``path.1`` -> ... (the oldest deleted), open a new ``path``."""
        self.close()
        rotate_names(self.path, self.keep)
        self.rotations += 1
        self.open()

    def reopen(self) -> None:
        """Close the file and open ``path`` again (logrotate renamed it: a new one is created)."""
        self.close()
        self.open()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def files(self) -> list[str]:
        """The files there are, newest first: path, path.1, ..."""
        names = [self.path] + [f"{self.path}.{i}" for i in range(1, self.keep + 1)]
        return [n for n in names if os.path.lexists(n)]


def rotate_names(path: str, keep: int) -> None:
    """``path`` -> ``path.1`` -> ... -> ``path.<keep>``, the oldest deleted (keep 0: ``path``
    deleted). Renames and unlinks act on the names themselves: a symlink at any of them is
    moved or replaced, never followed."""
    if keep == 0:
        _remove(path)
        return
    for i in range(keep - 1, 0, -1):
        _rename(f"{path}.{i}", f"{path}.{i + 1}")
    _rename(path, f"{path}.1")


def _rename(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except FileNotFoundError:  # not there (or renamed by someone else meanwhile)
        pass


def _write_all(f, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
