"""NRI mode's confirmation that a container's values are in its cgroup.

An NRI answer is a request to the runtime, not a write: containerd applies a Synchronize
update only to the stored spec of a container that is not running yet (its cgroup keeps what
runc wrote at creation), and a runtime that drops the plugin mid-call creates the container
without the adjustment. So after each CreateContainer / UpdateContainer adjustment and each
Synchronize update, the handler hands the values it decided to ``NriConfirmer``: a side thread
(``memqos-nri-confirm``) that waits for the container's cgroup to exist, reads memory.min /
memory.low / memory.high there and, where the kernel holds something else, writes the decided
value (``nri-confirm: write``) or only reports it (``report``, and in observe), once a second look
``retry`` seconds after the first still finds it missing (a runtime writes a new cgroup's values
just after making it):

* memory.min / memory.low are only raised: a value in force above the decision is kept
  (never lower protection in force);
* memory.high is written when it differs, except while the guard has an episode open for the
  container (the guard's ``max`` is left alone and reported).

Every write is compare-and-write (the file must still hold what was read) below the kubepods
cgroup, the container's directory built from the pod's cgroup parent and uid as the monitor
builds it (``shim.effects.container.container_dir``). Nothing here runs on the runtime's call:
``submit`` is a put without waiting; a full queue (``nri-confirm-queue``) drops and counts. A
container whose cgroup does not appear within ``nri-confirm-window`` seconds is given up and
counted. Each container whose values differed is one audit record ``nri-confirm`` (outcome
``written`` / ``reported`` / ``refused``); a confirmation that found every value right writes
no record, only a count.
"""
from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from shim.effects.cgroupfs import PathRefused
from shim.effects.container import VALUE_FILES, ContainerCgroups, container_dir
from shim.effects.layout import CgroupLayout, detect_driver
from shim.node.facts import is_cgroup_v2
from shim.worker import Worker

log = logging.getLogger(__name__)

WRITE, REPORT, OFF = "write", "report", "off"
PROTECTION = ("memory.min", "memory.low")
RETRY = 0.5  # seconds between looks at a container whose cgroup is not there yet
PAGE = os.sysconf("SC_PAGE_SIZE")  # the kernel keeps memory.* values in pages


@dataclass(frozen=True)
class Expected:
    """The values decided for one container (unified key -> value), and where its cgroup is."""

    container_id: str
    uid: str
    cgroup_parent: str
    label: str  # namespace/pod/container
    values: Mapping[str, str]
    method: str  # the answer that carried them: CreateContainer, UpdateContainer, Synchronize


@dataclass
class ConfirmStats:
    submitted: int = 0
    confirmed: int = 0  # found every value in place
    written: int = 0  # values written (one per key)
    reported: int = 0  # values that differ and were not written (report, observe, the guard's)
    gave_up: int = 0  # no cgroup within the window
    dropped: int = 0  # queue full
    refused: int = 0  # a path the request data does not make valid
    errors: int = 0
    outcomes: dict = field(default_factory=dict)


def differs(key: str, kernel: str | None, want: str, page: int = PAGE) -> bool:
    """Whether ``kernel`` (the file's content) misses the decided value ``want``, as the kernel
    reads it back (rounded down to a page): protection only when it is lower (a value in force
    above the decision is kept), memory.high when it is anything else."""
    if kernel is None:
        return False  # unreadable: nothing to compare with (the cgroup's absence is looked at before)
    have, need = _bytes(kernel), _bytes(want)
    if need != float("inf"):
        need = need // page * page
    if key in PROTECTION:
        return have < need
    return have != need


def _bytes(text: str) -> float:
    """A memory file's value: 'max' is unbounded; what does not parse counts as 0 (a decided
    value is always a number or 'max')."""
    t = text.strip()
    if t == "max":
        return float("inf")
    return int(t) if t.isascii() and t.isdigit() else 0


class NriConfirmer(Worker):
    """The side thread that confirms containers' values; ``submit`` from the plugin's loop."""

    def __init__(self, *, cgroup_root: str, kubelet, emit: Callable[[dict], None], rollout=None,
                 mode: str = WRITE, window: float = 60.0, max_pending: int = 4096,
                 guarded: Callable[[str], bool] | None = None, clock: Callable[[], float] = time.monotonic,
                 retry: float = RETRY):
        super().__init__("memqos-nri-confirm", max_pending=max_pending, logger=log, label="nri-confirm")
        self.cgroup_root, self.kubelet = cgroup_root, kubelet
        self._emit = emit
        self.mode, self.window, self.retry = mode, window, retry
        self.guarded = guarded or (lambda _cid: False)
        self._clock = clock
        self.fs = ContainerCgroups(cgroup_root, rollout=rollout, write_files=VALUE_FILES)
        self.layout: CgroupLayout | None = None
        self.stats = ConfirmStats()
        self._pending: dict[str, tuple[Expected, float, float]] = {}  # id -> (expected, first, next look)
        self._strikes: set[str] = set()  # containers whose values were missing at the last look

    # -- the plugin's side -------------------------------------------------------------------
    def submit(self, expected: Expected) -> bool:
        """Queue a confirmation without waiting; False (counted) when the queue is full."""
        if self.mode == OFF or not expected.values:
            return False
        try:
            self._queue.put_nowait(expected)
        except queue.Full:
            self.stats.dropped += 1
            if self.stats.dropped == 1 or self.stats.dropped % 1000 == 0:
                log.warning("nri-confirm: queue full (nri-confirm-queue): %d confirmations dropped",
                            self.stats.dropped)
            return False
        self.stats.submitted += 1
        return True

    def kernel_values(self, cid: str, uid: str, cgroup_parent: str) -> dict[str, str | None] | None:
        """memory.min / memory.low / memory.high as the container's cgroup holds them (None: no
        cgroup, or a path refused). Cgroup files only (no disk I/O)."""
        try:
            if self._layout() is not None:
                return None
            rel = container_dir(self.fs, self.layout, cid, uid, cgroup_parent)
            if rel is None:
                return None
            return self.fs.read_files(rel, sorted(VALUE_FILES))
        except (OSError, PathRefused):
            return None

    # -- the thread --------------------------------------------------------------------------
    def wait_time(self) -> float | None:
        if not self._pending:
            return None
        return max(0.0, min(n for _, _, n in self._pending.values()) - self._clock())

    def handle(self, items: list) -> None:
        now = self._clock()
        for e in items:
            if isinstance(e, Expected):
                first = self._pending[e.container_id][1] if e.container_id in self._pending else now
                self._pending[e.container_id] = (e, first, now + self.retry)
        for cid, (e, first, at) in list(self._pending.items()):
            if at > now:
                continue
            try:
                done = self.confirm(e)
            except Exception:  # noqa: BLE001 - one container's trouble must not stop the others
                self.stats.errors += 1
                log.exception("nri-confirm: %s failed", e.label)
                done = True
            if done:
                self._pending.pop(cid, None)
            elif now - first >= self.window:
                self._pending.pop(cid, None)
                self._strikes.discard(cid)
                self.stats.gave_up += 1
                self._record(e, "gave-up", {}, f"no cgroup within {self.window:g} s")
            else:
                self._pending[cid] = (e, first, now + self.retry)

    def _layout(self) -> str | None:
        if not is_cgroup_v2(self.cgroup_root):
            return f"{self.cgroup_root} is not cgroup v2"
        k = self.kubelet
        driver = k.cgroup_driver if k.source else detect_driver(self.cgroup_root, k.cgroup_root)
        if driver is None:
            return "no kubepods cgroup yet"
        if self.layout is None or self.layout.driver != driver:
            self.layout = CgroupLayout(driver, k.cgroup_root)
            self.fs.set_allowed([self.layout.kubepods])
        return None

    def confirm(self, e: Expected) -> bool:
        """One look at the container: True when done (values right, written, reported or
        refused), False to look again (no cgroup yet)."""
        if self._layout() is not None:
            return False
        try:
            rel = container_dir(self.fs, self.layout, e.container_id, e.uid, e.cgroup_parent)
        except PathRefused as why:
            self.stats.refused += 1
            self._record(e, "refused", {}, str(why))
            return True
        if rel is None:
            return False
        keys = sorted(k for k in e.values if k in VALUE_FILES)
        try:
            kernel = self.fs.read_files(rel, keys)
        except FileNotFoundError:
            return False
        wrong = {k: kernel.get(k) for k in keys if differs(k, kernel.get(k), e.values[k])}
        if not wrong:
            self._strikes.discard(e.container_id)
            self.stats.confirmed += 1
            return True
        if e.container_id not in self._strikes:
            # the runtime may be between making the cgroup and writing its values: act only when
            # a second look, ``retry`` seconds later, still finds them missing
            self._strikes.add(e.container_id)
            return False
        self._strikes.discard(e.container_id)
        changes = {}
        for key, old in wrong.items():
            want = e.values[key]
            change = {"kernel": (old or "").strip(), "decided": want}
            if self.mode == REPORT or self.fs.rollout.observe:
                change["action"] = "reported"
            elif key == "memory.high" and self.guarded(e.container_id):
                change["action"] = "reported: the guard has an episode open"
            else:
                try:
                    self.fs.write(rel, key, want, expect=(old or "").strip())
                    change["action"] = "written"
                except (OSError, ValueError) as why:  # changed meanwhile, cgroup gone, ...
                    change["action"] = f"not written: {why}"[:300]
            if change["action"] == "written":
                self.stats.written += 1
            else:
                self.stats.reported += 1
            changes[key] = change
        written = any(c["action"] == "written" for c in changes.values())
        self._record(e, "written" if written else "reported", changes, "")
        return True

    def _record(self, e: Expected, outcome: str, changes: dict, why: str) -> None:
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        record = {"event": "nri-confirm", "mode": "nri", "outcome": outcome, "method": e.method,
                  "container": e.label, "container_id": e.container_id, "values": changes}
        if why:
            record["why"] = why[:300]
        if self.fs.rollout.observe:
            record["rollout"] = "observe"
        self._emit(record)
