"""Pod, QoS-class and node memory.min / memory.low through systemd, on systemd-driver nodes.

On a node whose kubelet uses the systemd cgroup driver, kubepods.slice, the QoS slices and
the pod slices are systemd units (transient slices the kubelet starts). systemd owns their
cgroup attributes: whenever it re-applies a unit's properties (``systemctl daemon-reload``,
a SetUnitProperties call such as the kubelet's periodic one on kubepods.slice, a sibling
unit starting) it writes every memory attribute of that unit from its own idea of the unit,
and a memory.min or memory.low written directly to cgroupfs goes back to what systemd knows
(0). So on such a node the shim tells systemd instead: ``SetUnitProperties(unit,
runtime=true, [(MemoryMin|MemoryLow, <uint64 value>)])`` on its D-Bus API (``SystemdBus``,
shim/effects/systemd_bus.py), and systemd writes the file and keeps writing the same value.

``CgroupWriter`` is the writer the reconciler and ``reset`` use: a ``CgroupFS`` (same path
validation, read-before-write, audit records) whose ``write()`` goes through systemd when
the mode says so: ``dbus`` always, ``auto`` when the cgroup driver is systemd, systemd is
PID 1 (``/run/systemd/system`` exists, as sd_booted() checks) and the cgroup root is the
hierarchy systemd manages (/sys/fs/cgroup), ``cgroupfs`` never.

Unit names are never taken from a request: the reconciler's paths are built by
``CgroupLayout`` and validated by ``CgroupTree.check``; here the unit is the path's last
component, which must be a unit name whose place in the tree is exactly where systemd puts
it (``a-b.slice`` at ``a.slice/a-b.slice``), and either a ``kubepods*.slice`` or one of the
configured reserved cgroups itself.

systemd accepts a property for a slice it has not loaded: it loads the slice, stores the
property and creates an (empty) cgroup for it (seen with systemd 252 in the systemd guest). So
systemd is asked only about cgroups that exist (the file is read first); a pod slice stopped
between that read and the call stays behind as an inactive slice with a runtime drop-in until
the next boot.
"""
from __future__ import annotations

import os
import re
import time
from typing import Callable, Iterable

from shim.effects.cgroupfs import CgroupFS, PathRefused, Write, split_path
from shim.effects.systemd_bus import SystemdBus, SystemdError

__all__ = ["CgroupWriter", "SystemdBus", "SystemdError", "slice_path", "unit_for_path", "systemd_booted"]

WRITE_MODES = ("auto", "dbus", "cgroupfs")
SYSTEMD_CGROUP_ROOT = "/sys/fs/cgroup"  # where systemd mounts the unified hierarchy
PROPERTY = {"memory.min": "MemoryMin", "memory.low": "MemoryLow"}
# systemd's unit name rules, restricted to what a kubepods or reserved unit looks like:
# no escapes (backslash), no '@' templates, at most 255 characters.
_UNIT = re.compile(r"^[A-Za-z0-9:_.-]{1,248}\.(slice|service|scope)$")
_KUBEPODS_SLICE = re.compile(r"^kubepods(?:-[A-Za-z0-9_]+)*\.slice$")


def slice_path(name: str) -> list[str]:
    """Where systemd puts a slice: 'a-b-c.slice' -> ['a.slice', 'a-b.slice', 'a-b-c.slice'];
    '-.slice' (the root slice) -> []. PathRefused for names systemd would reject."""
    if name == "-.slice":
        return []
    if not name.endswith(".slice") or not _UNIT.match(name):
        raise PathRefused(f"{name[:80]!r} is not a slice name")
    words = name[: -len(".slice")].split("-")
    if any(w == "" for w in words):  # leading, trailing or doubled dash
        raise PathRefused(f"{name[:80]!r}: systemd does not accept empty words in a slice name")
    return ["-".join(words[: i + 1]) + ".slice" for i in range(len(words))]


def unit_for_path(rel: str, reserved: Iterable[str] = ()) -> str:
    """The systemd unit whose cgroup is ``rel`` (relative to the cgroup root), if the shim may
    set its properties: a kubepods slice, or exactly one of the ``reserved`` cgroup paths.
    PathRefused otherwise."""
    parts = split_path(rel)
    if not parts:
        raise PathRefused("the cgroup root is not a unit the shim sets")
    unit = parts[-1]
    m = _UNIT.match(unit)
    if not m:
        raise PathRefused(f"{unit[:80]!r} in {rel[:200]!r} is not a systemd unit name")
    if m.group(1) == "slice":
        where = slice_path(unit)
    else:  # a service or scope sits directly in its slice
        parent = parts[-2] if len(parts) > 1 else "-.slice"
        where = [*slice_path(parent), unit]
    if where != parts:
        raise PathRefused(f"{rel[:200]!r} is not where systemd puts {unit!r} ({'/'.join(where)})")
    reserved_paths = {"/".join(split_path(r)) for r in reserved}
    if _KUBEPODS_SLICE.match(unit) or "/".join(parts) in reserved_paths:
        return unit
    raise PathRefused(f"{unit!r} is neither a kubepods slice nor a configured reserved cgroup")


def systemd_booted(run_dir: str = "/run/systemd/system") -> bool:
    """True when systemd is the init system (the test sd_booted() makes)."""
    return os.path.isdir(run_dir)


class CgroupWriter(CgroupFS):
    """CgroupFS whose writes go through systemd on systemd-driver nodes (see the module doc)."""

    def __init__(self, root: str, allowed: Iterable[str] = (), *, mode: str = "auto",
                 bus: SystemdBus | None = None, booted: Callable[[], bool] = systemd_booted,
                 systemd_root: str = SYSTEMD_CGROUP_ROOT, settle: float = 2.0, **kw):
        if mode not in WRITE_MODES:
            raise ValueError(f"systemd-writes must be one of {list(WRITE_MODES)}, not {mode!r}")
        self.mode = mode
        self._bus = bus  # made on the first write through systemd
        self._booted = booted
        self._systemd_root = systemd_root
        self.settle = settle
        self.driver: str | None = None
        self.reserved: list[str] = []
        self._told: dict[tuple[str, str], str] = {}  # (path, file) -> value systemd was given
        super().__init__(root, allowed, **kw)

    def set_driver(self, driver: str | None, reserved: Iterable[str] = ()) -> None:
        """The kubelet's cgroup driver and the reserved cgroup paths (from the reconciler's layout)."""
        self.driver = driver
        self.reserved = ["/".join(split_path(r)) for r in reserved]

    @property
    def bus(self) -> SystemdBus:
        """The connection to systemd (made when first needed: a cgroupfs writer never has one)."""
        if self._bus is None:
            self._bus = SystemdBus()
        return self._bus

    def close(self) -> None:
        """Close the connection to systemd, if one was made."""
        if self._bus is not None:
            self._bus.close()

    @property
    def via(self) -> str:
        """'systemd' or 'cgroupfs': how the next write is made."""
        if self.mode == "dbus":
            return "systemd"
        if (self.mode == "auto" and self.driver == "systemd" and self._booted()
                and os.path.realpath(self.root) == os.path.realpath(self._systemd_root)):
            return "systemd"  # (systemd manages only the hierarchy it mounted: not a test tree)
        return "cgroupfs"

    def read(self, rel: str, file: str) -> str | None:
        """The file's content; through systemd, a value this process has not set through
        systemd reads as unknown (it may have been written to cgroupfs by an earlier shim or
        someone else, and systemd would put its own value back): the caller then writes it,
        which tells systemd."""
        text = super().read(rel, file)
        if text is None or self.via != "systemd":
            return text
        if self._told.get(("/".join(split_path(rel)), file)) == text:
            return text
        return f"{text} (not set through systemd)"

    def write(self, rel: str, file: str, value: int, why: str, *, level: int = 0, drift: bool = False,
              extra: dict | None = None) -> Write | None:
        if self.via != "systemd":
            return super().write(rel, file, value, why, level=level, drift=drift, extra=extra)
        self.check_value(rel, file, value)
        observe = self.rollout.observe
        parts = self.check(rel)
        if file not in PROPERTY:
            raise PathRefused(f"{file!r} is not a file the shim writes")
        path = "/".join(parts)
        unit = unit_for_path(path, self.reserved)
        old = super().read(path, file)
        if old is None:
            raise FileNotFoundError(f"no cgroup {path}")
        new = str(value)
        key = (path, file)
        if old == new and self._told.get(key) == new:
            return None
        if observe and self.observed_before(parts, file, old, new):
            return None
        if not self.dry_run and not observe:
            self._tell_systemd(unit, PROPERTY[file], value)
            if len(self._told) > 100000:
                self._told.clear()
            self._told[key] = new
            # systemd applies the property from its event loop right after answering: wait
            # briefly so that the caller's next read sees it (not needed for correctness).
            deadline = time.monotonic() + self.settle
            while super().read(path, file) != new and time.monotonic() < deadline:
                time.sleep(0.02)
        through = {"via": "systemd", "unit": unit, "property": PROPERTY[file]}
        if old == new:  # the file held it already (cgroupfs write), systemd did not know it
            through["adopted"] = True
        return self._record(parts, file, old, new, why, level, drift, {**through, **(extra or {})}, observe=observe)

    def _tell_systemd(self, unit: str, prop: str, value: int) -> None:
        """SetUnitProperties; the bus going away and coming back are audited once each
        (``systemd-bus`` records), every failed call raises SystemdError."""
        bus = self.bus
        was_down = bus.down
        try:
            bus.set_unit_properties(unit, [(prop, value)])
        finally:
            if bus.down != was_down and self._emit is not None:
                self._emit({"event": "systemd-bus", "state": "down" if bus.down else "up", "bus": bus.where,
                            **({"error": bus.last_error} if bus.down else {})})
