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

Files written by rename (``replace_file``: the guard's episodes, the heartbeat file) create
their temporary file with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and rename it over the path: a
rename replaces a symlink at the destination, it never writes through it. They replace only a
file of their own kind (a JSON object with the caller's keys, or an empty file): a symlink, a
directory or anyone else's file at the path is left alone (``ForeignFile``).

``RotatingFile`` (the audit log, the recorder's files) appends whole lines and rotates by size
with a bounded number of files, ``FILE`` -> ``FILE.1`` -> ... -> ``FILE.<keep>`` (the oldest is
deleted): renames only, never through a symlink, and the new ``FILE`` is opened by
``open_append`` like the first. ``reopen()`` closes the file and opens ``FILE`` again (after
logrotate renamed it away).

Nothing is deleted or renamed over unless it is one of the shim's own files (``own_file``: a
regular file, empty or starting as the JSON lines the shim writes). A ``FILE`` that holds
anything else is refused (UnsafeFile) before a byte is appended; anything else at ``FILE.<n>``
(a symlink, a file of someone else's) ends the rotation chain there: the files below it rotate
and the oldest of them is deleted, it stays as it is (logged).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
from typing import Callable

log = logging.getLogger(__name__)

#: how every file the shim writes (JSON lines: audit records, a trace's header) starts
OWN_FILE_START = b'{"'


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


def own_file(path: str) -> bool | None:
    """None: nothing at ``path``; True: one of the shim's own files (a regular file, empty or
    starting as the JSON lines it writes); False: anything else (a symlink, a directory, a
    file of someone else's), which the shim never deletes, renames over or appends to."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # a symlink (ELOOP), a FIFO without a writer, no permission to read it
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, len(OWN_FILE_START))
    except OSError:
        return False
    finally:
        os.close(fd)
    return head in (b"", OWN_FILE_START)


def refuse_foreign(path: str) -> None:
    """UnsafeFile when ``path`` holds a regular file that is not one of the shim's own."""
    if own_file(path) is False and not os.path.islink(path):
        raise UnsafeFile(errno.EEXIST, f"{path} holds something the shim did not write (not JSON lines); "
                                       "refusing to append to it or rotate it away (move it aside, or point "
                                       "the setting at a new file)")


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
            refuse_foreign(self.path)
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


def rotate_names(path: str, keep: int) -> int:
    """``path`` -> ``path.1`` -> ... -> ``path.<keep>``, the oldest deleted (keep 0: ``path``
    deleted); returns the files kept. Only the shim's own files (``own_file``) are renamed or
    deleted: UnsafeFile when ``path`` is not one; anything else at ``path.<n>`` ends the chain
    before it (it stays; fewer files are kept, and the oldest of those is deleted)."""
    if own_file(path) is False:
        check_not_symlink(path)
        refuse_foreign(path)
        raise UnsafeFile(errno.EINVAL, f"{path} is not a regular file; refusing to rotate it")
    kept = keep
    for i in range(1, keep + 1):
        if own_file(f"{path}.{i}") is False:
            kept = i - 1
            log.warning("%s.%d is not a file the shim wrote: left alone, %d rotated file(s) kept below it",
                        path, i, kept)
            break
    if kept == 0:
        _remove(path)
        return 0
    for i in range(kept - 1, 0, -1):
        _rename(f"{path}.{i}", f"{path}.{i + 1}")
    _rename(path, f"{path}.1")
    return kept


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


class ForeignFile(UnsafeFile):
    """What is at a path a file is to be written by rename is not the caller's kind of file
    (``what``: a symbolic link, not a regular file, not JSON, ...): never replaced."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EEXIST, f"{path} is {what}; left alone")
        self.what = what


def foreign_json(path: str, keys: tuple[str, ...], max_bytes: int) -> str | None:
    """What is at ``path`` when it is not a JSON file of the caller's kind, in a few words (a
    symbolic link, not a regular file, not JSON, ...); None when nothing is there, the file is
    empty, or it holds a JSON object (of at most ``max_bytes``) with every key of ``keys``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        return "a symbolic link" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        raw = os.read(fd, max_bytes + 1)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    finally:
        os.close(fd)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        return f"not a JSON object with {', '.join(keys)}"
    return None


def replace_file(path: str, data: bytes, *, keys: tuple[str, ...], max_bytes: int, mode: int = 0o600,
                 fsync: bool = True, make_parent: bool = False) -> None:
    """Replace the file at ``path`` with ``data`` at once for any reader: written to a new file
    of a unique name beside it (O_CREAT | O_EXCL | O_NOFOLLOW: nothing there is reused or
    followed), given ``mode``, fsynced (``fsync``), renamed over ``path``. Only a file of the
    caller's kind is replaced (foreign_json with ``keys`` and ``max_bytes``): anything else at
    ``path`` raises ForeignFile before anything is written. ``make_parent``: create the missing
    directories (0755). OSError otherwise, the new file removed."""
    what = foreign_json(path, keys, max_bytes)
    if what:
        raise ForeignFile(path, what)
    parent = os.path.dirname(path) or "."
    if make_parent:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if mode != 0o600:  # mkstemp's
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
