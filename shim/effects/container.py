"""Container-level cgroup files: the monitor's reads of memory.* and its writes (the guard's
memory.high, proactive reclaim's memory.reclaim), and the memory.min / memory.low / memory.high
the shim writes after an update the runtime did not carry to the kernel (``settle``).

Every path is walked like every other write (shim.effects.cgroupfs.CgroupTree): one component
at a time with O_NOFOLLOW below the cgroup root, and strictly inside the allowed subtree (the
kubepods cgroup): a symlink, ``..`` or anything outside is refused. memory.high is written
compare-and-write: the file must still hold what the decision saw.
"""
from __future__ import annotations

import os
from typing import Iterable

from shim.effects.cgroupfs import CgroupTree, PathRefused

READ_FILES = ("memory.current", "memory.min", "memory.low", "memory.high", "memory.max",
              "memory.events", "memory.pressure")
RECLAIM_READ_FILES = READ_FILES + ("memory.stat",)  # what the monitor reads with reclaim on
WRITE_FILES = frozenset({"memory.high"})
SETTLE_FILES = ("memory.min", "memory.low", "memory.high")  # in this order
_MAX_READ = 4096
_MAX_READ_STAT = 16384  # memory.stat: ~50 lines on 6.x kernels


class ContainerCgroups(CgroupTree):
    """Reads of memory.* files and writes of memory.high, below ``root``, only strictly inside
    the ``allowed`` subtrees (relative paths), never through a symlink (CgroupTree)."""

    strictly_below = True

    def is_dir(self, rel: str) -> bool:
        """False when missing; PathRefused for a symlink (or a file) on the way."""
        return self._has_dir(rel, (OSError,))

    def read_files(self, rel: str, files: Iterable[str] = READ_FILES) -> dict[str, str | None]:
        """file -> content (None: missing or unreadable). FileNotFoundError when the cgroup is gone."""
        dfd = self._open_dir(self.check(rel))
        out: dict[str, str | None] = {}
        try:
            for name in files:
                if name not in RECLAIM_READ_FILES:
                    raise PathRefused(f"{name!r} is not a file the monitor reads")
                try:
                    fd = self._open_file(dfd, name, os.O_RDONLY)
                except (OSError, PathRefused):
                    out[name] = None
                    continue
                try:
                    out[name] = os.read(fd, _MAX_READ_STAT if name == "memory.stat" else _MAX_READ).decode(
                        "ascii", "replace")
                except OSError:  # e.g. EOPNOTSUPP: memory.pressure with PSI disabled
                    out[name] = None
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
        return out

    def write(self, rel: str, name: str, value: str, expect: str | None = None, *,
              observe: bool | None = None) -> str:
        """Write value to rel/name. With ``expect``, only when the file holds it (stripped);
        ValueError otherwise. Returns what the file held. ``observe`` (default: the rollout's
        mode at the call): read only, write nothing, and no ``expect`` check (in observe the file holds
        what the container really runs with, not what an earlier would-write left)."""
        if name not in WRITE_FILES:
            raise PathRefused(f"{name!r} is not a file the monitor writes")
        if value != "max" and not (value.isascii() and value.isdigit()):
            raise ValueError(f"bad memory value {value!r}")
        if observe is None:
            observe = self.rollout.observe

        def decide(old: str) -> str | None:
            if observe:
                return None
            if expect is not None and old != expect:
                raise ValueError(f"{name} holds {old!r}, not {expect!r}: changed meanwhile")
            return value

        dfd = self._open_dir(self.check(rel))
        try:
            return self._read_then_write(dfd, name, decide)
        finally:
            os.close(dfd)


    def settle(self, rel: str, values: dict[str, str], page_size: int, *,
               observe: bool | None = None) -> dict[str, tuple[str, str | None]]:
        """Make memory.min / memory.low / memory.high of ``rel`` hold ``values`` (file -> "max" or
        bytes): each file is read and written only when it holds something else (a byte count
        compared as the kernel keeps it, rounded down to ``page_size``). Returns file -> (what it
        held, what was written or None). ``observe`` (default: the rollout's mode): nothing is
        written, the would-writes are returned. FileNotFoundError when the cgroup is gone; an
        OSError of one file stops there (files written before it stay written)."""
        if observe is None:
            observe = self.rollout.observe
        for name, value in values.items():
            if name not in SETTLE_FILES:
                raise PathRefused(f"{name!r} is not a file the shim settles")
            if value != "max" and not (value.isascii() and value.isdigit()):
                raise ValueError(f"bad memory value {value!r}")
        out: dict[str, tuple[str, str | None]] = {}
        dfd = self._open_dir(self.check(rel))
        try:
            for name in SETTLE_FILES:
                if name not in values:
                    continue
                value = values[name]
                want = value if value == "max" else str(int(value) // page_size * page_size)
                written: list[str] = []

                def decide(old: str, value=value, want=want, written=written) -> str | None:
                    if old == want or old == value:
                        return None
                    written.append(value)
                    return None if observe else value

                old = self._read_then_write(dfd, name, decide)
                out[name] = (old, written[0] if written else None)
        finally:
            os.close(dfd)
        return out
