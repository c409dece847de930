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
import re
from typing import Iterable

from shim.effects.cgroupfs import CgroupTree, PathRefused
from shim.effects.layout import SYSTEMD, CgroupLayout

READ_FILES = ("memory.current", "memory.min", "memory.low", "memory.high", "memory.max",
              "memory.events", "memory.pressure")
RECLAIM_READ_FILES = READ_FILES + ("memory.stat",)  # what the monitor reads with reclaim on
SWAP_READ_FILE = "memory.swap.current"  # read too for a container of a swap class (the guard)
MONITOR_FILES = frozenset(RECLAIM_READ_FILES + (SWAP_READ_FILE,))  # every file the monitor may read
WRITE_FILES = frozenset({"memory.high"})
SETTLE_FILES = ("memory.min", "memory.low", "memory.high")  # in this order
VALUE_FILES = frozenset({"memory.min", "memory.low", "memory.high"})  # what the NRI confirmer writes
CONTAINER_ID = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_.-]{0,127}$")
_MAX_READ = 4096
_MAX_READ_STAT = 16384  # memory.stat: ~50 lines on 6.x kernels


def container_names(driver: str, cid: str) -> tuple[str, ...]:
    """The directory names a container's cgroup may have below its pod's: systemd
    ``cri-containerd-<id>.scope`` / ``crio-<id>.scope``, cgroupfs ``<id>`` / ``crio-<id>``.
    PathRefused when the id does not look like an id."""
    if not CONTAINER_ID.match(cid or ""):
        raise PathRefused(f"container id {str(cid)[:80]!r} is not an id")
    if driver == SYSTEMD:
        return f"cri-containerd-{cid}.scope", f"crio-{cid}.scope"
    return cid, f"crio-{cid}"


def container_dir(fs: "ContainerCgroups", layout: CgroupLayout, cid: str, uid: str, cgroup_parent: str) -> str | None:
    """The container's cgroup directory (relative), None while it does not exist. The pod's
    directory is built from the driver, its QoS class and uid (``pod_from_parent``), never
    taken from request data as is; PathRefused for data that does not make a valid path."""
    _, pod_path = layout.pod_from_parent(cgroup_parent, uid)
    for name in container_names(layout.driver, cid):
        rel = f"{pod_path}/{name}"
        fs.check(rel)
        if fs.is_dir(rel):
            return rel
    return None


class ContainerCgroups(CgroupTree):
    """Reads of memory.* files and writes of ``write_files`` (memory.high unless told), below
    ``root``, only strictly inside the ``allowed`` subtrees (relative paths), never through a
    symlink (CgroupTree)."""

    strictly_below = True

    def __init__(self, root: str, allowed: Iterable[str] = (), *, rollout=None,
                 write_files: frozenset = WRITE_FILES):
        super().__init__(root, allowed, rollout=rollout)
        self.write_files = frozenset(write_files) & VALUE_FILES

    def is_dir(self, rel: str) -> bool:
        """False when missing; PathRefused for a symlink (or a file) on the way."""
        return self._has_dir(rel, (OSError,))

    def read_files(self, rel: str, files: Iterable[str] = READ_FILES) -> dict[str, str | None]:
        """file -> content (None: missing or unreadable). FileNotFoundError when the cgroup is gone."""
        dfd = self._open_dir(self.check(rel))
        out: dict[str, str | None] = {}
        try:
            for name in files:
                if name not in MONITOR_FILES:
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
        if name not in self.write_files:
            raise PathRefused(f"{name!r} is not a file this writer writes")
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
