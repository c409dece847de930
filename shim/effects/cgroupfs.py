"""Validated reads and writes of cgroup v2 interface files (memory.min, memory.low).

Every path is relative to one cgroup root (normally /sys/fs/cgroup) and is walked one
component at a time with ``openat(O_NOFOLLOW | O_DIRECTORY)``: a symlink anywhere below the
root, a ``..`` or an empty component, or a path outside the allowed subtrees (the kubepods
tree and the configured reserved cgroups) is refused with ``PathRefused`` before anything
is opened for writing. Files are never created: a cgroup interface file that does not exist
means the cgroup does not exist.

``write()`` reads the file first and writes only when the value differs; each write is
appended to ``writes`` (in order, what tests assert) and handed to ``emit`` as an audit
record ``{"event": "cgroup-write", "path", "file", "old", "new", "why", ...}``. It is the last
line of defence against absurd numbers: a value above ``ceiling`` (the node's capacity; int64
when not known) is refused with ``ValueRefused`` and nothing is written -- the decision caps
every value before, so a refusal here means a bug above, and the file keeps what it held.

``reclaim()`` writes a byte count to the write-only memory.reclaim (proactive reclaim,
kernel >= 5.19) through the same walk; the monitor audits those writes itself, in sums.

In observe (``shim.effects.rollout``: every tree has a ``rollout``, shared with the rest of the
running shim) nothing is written: ``write()`` reads the file, decides as it would and audits
the write it would make (``"rollout": "observe"``; the same would-write once per mode spell,
not at every resync), ``reclaim()`` reads memory.current and asks for nothing.
"""
from __future__ import annotations

import collections
import errno
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from shim.decision.quantity import MAX_BYTES
from shim.effects.rollout import OBSERVE, Rollout

MANAGED_FILES = ("memory.min", "memory.low")
RECLAIM_FILE = "memory.reclaim"  # write-only, kernel >= 5.19
# A cgroup directory name: what kubelet, systemd and runtimes produce (no '/', no NUL).
_COMPONENT = re.compile(r"^[A-Za-z0-9_.:@+-]{1,255}$")
_MAX_DEPTH = 32


class PathRefused(ValueError):
    """A cgroup path that must not be written: outside the allowed tree, a symlink, ``..``."""


class ValueRefused(PathRefused):
    """A value that must not be written: negative, not an int, or above the writer's ceiling
    (the node's capacity). Reported like a refused path (``cgroup-refused``)."""


class ReclaimUnsupported(Exception):
    """The cgroup exists but has no memory.reclaim (kernel older than 5.19)."""


@dataclass(frozen=True)
class ReclaimOutcome:
    """One write to memory.reclaim. ``eagain``: the kernel reclaimed less than asked (it
    still reclaimed what it could). Freed bytes are measured as memory.current before minus
    after (the container may allocate meanwhile: a lower bound of what reclaim took)."""

    asked: int
    before: int | None
    after: int | None
    eagain: bool

    @property
    def freed(self) -> int:
        if self.before is None or self.after is None:
            return 0
        return max(0, self.before - self.after)


@dataclass(frozen=True)
class Write:
    """One write the effects layer made (or would make, in dry-run)."""

    seq: int
    path: str  # relative to the cgroup root, e.g. "kubepods/burstable"
    file: str  # memory.min | memory.low
    old: str  # what the file held, as read (stripped), e.g. "0" or "max"
    new: str
    why: str
    level: int = 0  # 0 node (kubepods, reserved), 1 QoS class, 2 pod
    drift: bool = False
    time: float = field(default_factory=time.time)


def split_path(rel: str) -> list[str]:
    """Components of a relative cgroup path; refuses '..', '.', odd characters and depth."""
    if not isinstance(rel, str) or "\x00" in rel:
        raise PathRefused(f"not a path: {rel!r}")
    parts = [p for p in rel.split("/") if p != ""]
    if len(parts) > _MAX_DEPTH:
        raise PathRefused(f"path too deep: {rel[:200]!r}")
    for p in parts:
        if p in (".", "..") or not _COMPONENT.match(p):
            raise PathRefused(f"refused path component {p[:80]!r} in {rel[:200]!r}")
    return parts


def parse_value(text: str | None) -> int | None:
    """'123' -> 123, 'max' -> None (unbounded); anything else raises ValueError."""
    if text is None:
        raise ValueError("no value")
    t = text.strip()
    if t == "max":
        return None
    if not t.isascii() or not t.isdigit():
        raise ValueError(f"not a cgroup memory value: {t[:40]!r}")
    return int(t)


class CgroupTree:
    """A cgroup root and the subtrees below it that may be touched; every access walks the
    path one component at a time without following symlinks. The one implementation of
    path validation for every writer (reconciler, reset, monitor)."""

    #: True: only cgroups strictly below an allowed subtree (the monitor's containers)
    strictly_below = False

    def __init__(self, root: str, allowed: Iterable[str] = (), *, rollout: Rollout | None = None):
        self.root = root
        #: enforce or observe (shared with the running shim; observe: nothing is written)
        self.rollout = rollout if rollout is not None else Rollout()
        self._allowed: list[list[str]] = []
        self.set_allowed(allowed)

    def set_allowed(self, allowed: Iterable[str]) -> None:
        roots = []
        for a in allowed:
            parts = split_path(a)
            if not parts:
                raise PathRefused("the cgroup root itself cannot be an allowed subtree")
            roots.append(parts)
        self._allowed = roots

    @property
    def allowed(self) -> list[str]:
        return ["/".join(p) for p in self._allowed]

    def check(self, rel: str) -> list[str]:
        """Components of rel if it lies inside an allowed subtree, else PathRefused."""
        parts = split_path(rel)
        extra = 1 if self.strictly_below else 0
        for a in self._allowed:
            if parts[: len(a)] == a and len(parts) >= len(a) + extra:
                return parts
        raise PathRefused(f"{rel!r} is outside the managed cgroups {self.allowed}")

    def abspath(self, rel: str, file: str | None = None) -> str:
        p = os.path.join(self.root, *split_path(rel))
        return os.path.join(p, file) if file else p

    def _has_dir(self, rel: str, absent: tuple[type[Exception], ...]) -> bool:
        """Whether the cgroup rel can be opened (walked like any access); False for the
        ``absent`` errors, the others pass through."""
        try:
            fd = self._open_dir(self.check(rel))
        except absent:
            return False
        os.close(fd)
        return True

    def _open_dir(self, parts: Sequence[str]) -> int:
        """fd of root/parts, walking without following symlinks. FileNotFoundError if missing."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, comp in enumerate(parts):
                try:
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        where = "/".join(parts[: i + 1])
                        try:
                            is_link = stat.S_ISLNK(os.lstat(comp, dir_fd=fd).st_mode)
                        except OSError:
                            is_link = False
                        what = "a symlink" if is_link else "not a directory"
                        raise PathRefused(f"{where!r} is {what}") from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _read_then_write(self, dfd: int, name: str, decide: Callable[[str], str | None],
                         opener: Callable[[int, str, int], int] | None = None) -> str:
        """Read an interface file of an opened cgroup; write what ``decide(old)`` returns
        (nothing for None; it may raise to write nothing). Returns the old content (stripped)."""
        opener = opener or self._open_file
        rfd = opener(dfd, name, os.O_RDONLY)
        try:
            old = os.read(rfd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(rfd)
        new = decide(old)
        if new is not None:
            wfd = opener(dfd, name, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(wfd, (new + "\n").encode())
            finally:
                os.close(wfd)
        return old

    def reclaim(self, rel: str, nbytes: int, *, observe: bool | None = None) -> ReclaimOutcome:
        """Ask the kernel to reclaim ``nbytes`` from cgroup ``rel`` through memory.reclaim
        (the path validated like every other write: inside the allowed subtrees, no symlink).
        memory.current is read before and after through the same directory fd. EAGAIN is an
        outcome (partial reclaim), not an error. FileNotFoundError when the cgroup is gone,
        ReclaimUnsupported when it has no memory.reclaim; other OSErrors pass through.
        ``observe`` (default: the rollout's mode at the call): nothing is asked, nothing freed."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"bad reclaim size {nbytes!r}")
        dfd = self._open_dir(self.check(rel))
        try:
            before = self._read_int(dfd, "memory.current")
            if self.rollout.observe if observe is None else observe:  # what enforce would find, nothing written
                try:
                    os.stat(RECLAIM_FILE, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise ReclaimUnsupported(f"{self.abspath(rel, RECLAIM_FILE)} does not exist (kernel < 5.19?)") \
                        from None
                return ReclaimOutcome(nbytes, before, before, False)
            try:
                fd = self._open_file(dfd, RECLAIM_FILE, os.O_WRONLY)
            except FileNotFoundError:
                raise ReclaimUnsupported(f"{self.abspath(rel, RECLAIM_FILE)} does not exist (kernel < 5.19?)") from None
            eagain = False
            try:
                self._write_value(fd, f"{nbytes}\n")
            except OSError as e:
                if e.errno != errno.EAGAIN:
                    raise
                eagain = True
            finally:
                os.close(fd)
            after = self._read_int(dfd, "memory.current")
        finally:
            os.close(dfd)
        return ReclaimOutcome(nbytes, before, after, eagain)

    def _read_int(self, dfd: int, name: str) -> int | None:
        try:
            fd = self._open_file(dfd, name, os.O_RDONLY)
        except (OSError, PathRefused):
            return None
        try:
            text = os.read(fd, 64).decode("ascii", "replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)
        return int(text) if text.isascii() and text.isdigit() else None

    @staticmethod
    def _write_value(fd: int, text: str) -> None:
        """The one write of a write-only interface file (tests replace it with a fake kernel)."""
        os.write(fd, text.encode())

    @staticmethod
    def _open_file(dfd: int, name: str, flags: int) -> int:
        """An interface file in an opened cgroup: never a symlink, never created."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PathRefused(f"{name} is a symlink") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PathRefused(f"{name} is not a regular file")
        return fd


class CgroupFS(CgroupTree):
    """Reads and writes memory.min / memory.low below ``root``, inside ``allowed`` subtrees."""

    def __init__(
        self,
        root: str,
        allowed: Iterable[str] = (),
        *,
        emit: Callable[[dict], None] | None = None,
        dry_run: bool = False,
        keep: int = 10000,
        ceiling: int = 0,
        rollout: Rollout | None = None,
    ):
        self.dry_run = dry_run
        #: no value above this is ever written (the node's capacity; 0 or above int64: int64)
        self.ceiling = ceiling if 0 < ceiling <= MAX_BYTES else MAX_BYTES
        self._emit = emit
        self._lock = threading.Lock()
        self._seq = 0
        #: every write, in order (bounded)
        self.writes: collections.deque[Write] = collections.deque(maxlen=keep)
        # observe: (path, file) -> (old, new, mode switches) of the would-write last audited
        self._observed: dict[tuple[str, str], tuple[str, str, int]] = {}
        super().__init__(root, allowed, rollout=rollout)

    def validate(self, rel: str) -> bool:
        """PathRefused unless rel is inside the allowed subtrees with no symlink on the way;
        then whether the cgroup exists."""
        return self._has_dir(rel, (FileNotFoundError,))

    def exists(self, rel: str) -> bool:
        return self._has_dir(rel, (FileNotFoundError, PathRefused))

    def _file_fd(self, dfd: int, file: str, flags: int) -> int:
        if file not in MANAGED_FILES:
            raise PathRefused(f"{file!r} is not a file the shim writes")
        return self._open_file(dfd, file, flags)

    def read(self, rel: str, file: str) -> str | None:
        """The file's content (stripped), or None when the cgroup or file does not exist."""
        parts = self.check(rel)
        try:
            dfd = self._open_dir(parts)
        except FileNotFoundError:
            return None
        try:
            try:
                fd = self._file_fd(dfd, file, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                data = os.read(fd, 64)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
        return data.decode("ascii", "replace").strip()

    def write(self, rel: str, file: str, value: int, why: str, *, level: int = 0, drift: bool = False,
              extra: dict | None = None) -> Write | None:
        """Set rel/file to value when it holds something else. Returns the Write, or None when
        the file already held the value. FileNotFoundError when the cgroup does not exist;
        PathRefused for a refused path, ValueRefused for a value above the ceiling; other
        OSErrors from the kernel pass through."""
        self.check_value(rel, file, value)
        parts = self.check(rel)
        new = str(value)
        observe = self.rollout.observe
        dry = self.dry_run or observe
        dfd = self._open_dir(parts)
        try:
            old = self._read_then_write(dfd, file, lambda old: None if old == new or dry else new, self._file_fd)
        finally:
            os.close(dfd)
        if old == new:
            return None
        if observe and self.observed_before(parts, file, old, new):
            return None
        return self._record(parts, file, old, new, why, level, drift, extra, observe=observe)

    def observed_before(self, parts: list[str], file: str, old: str | None, new: str) -> bool:
        """Observe: whether this would-write (the file holding ``old``, ``new`` wanted) was
        audited already in this spell of observe; remembers it otherwise."""
        key = ("/".join(parts), file)
        seen = (str(old), new, self.rollout.switches)
        if self._observed.get(key) == seen:
            return True
        if len(self._observed) > 100000:
            self._observed.clear()
        self._observed[key] = seen
        return False

    def check_value(self, rel: str, file: str, value: int) -> None:
        """ValueRefused unless value is an int in [0, ceiling]."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueRefused(f"bad value {value!r} for {rel[:200]}/{file}")
        if value > self.ceiling:
            raise ValueRefused(f"{value} for {rel[:200]}/{file} is above the node's capacity {self.ceiling}: "
                               "not written")

    def _record(self, parts: list[str], file: str, old: str | None, new: str, why: str, level: int, drift: bool,
                extra: dict | None, *, observe: bool = False) -> Write:
        """Keep a write that was made (or would be: dry run, observe), and audit it (``extra``
        adds keys to the record)."""
        with self._lock:
            self._seq += 1
            w = Write(self._seq, "/".join(parts), file, old, new, why, level, drift)
            self.writes.append(w)
        if self._emit is not None:
            record = {
                "event": "cgroup-write" if not self.dry_run else "cgroup-write-dry-run",
                "path": os.path.join(self.root, *parts),
                "file": file,
                "old": old,
                "new": new,
                "why": why,
                "level": ("node", "qos", "pod")[level] if 0 <= level <= 2 else level,
            }
            if drift:
                record["drift_repaired"] = True
            if extra:
                record.update(extra)
            if observe:
                record["rollout"] = OBSERVE
            self._emit(record)
        return w
