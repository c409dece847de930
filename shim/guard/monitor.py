"""The monitor: one side thread that samples every managed container's cgroup on an interval
(for the metrics) and runs the memory.high safety guard (shim.decision.guard) on the samples.

Nothing here is on the CRI path. Which containers: the ones the shim rewrote since it started
(``ContainerMemoryQoS.containers``) and, when the reconciler runs, every container of its node
state (rebuilt from the runtime at start, so containers created before a restart are watched
too). Their cgroup directory is built, never taken as is, from request data:

* the pod directory from the pod's cgroup_parent and uid through ``CgroupLayout.pod_from_parent``
  (the reconciler's validation: the parent must be exactly where the kubelet's driver puts that
  pod);
* the container directory below it from the runtime's naming: cgroupfs ``<pod>/<id>``
  (containerd) or ``<pod>/crio-<id>`` (CRI-O); systemd ``<pod>/cri-containerd-<id>.scope`` or
  ``<pod>/crio-<id>.scope`` -- whichever exists. The id must look like an id.

Every path is walked one component at a time with O_NOFOLLOW below the cgroup root and must lie
in the kubepods subtree: a symlink, ``..`` or anything outside is refused (and audited once).
The guard's only write is ``memory.high`` of such a container directory, compare-and-write: the
file must still hold what the decision saw.

Each guard action is an audit record (``guard-relax``, ``guard-restore``, ``guard-report``,
``guard-clear``, ``guard-released``, ``guard-error``); the metrics count them from the audit
stream.

Proactive reclaim (``--reclaim true``; off by default): the monitor also reads memory.stat and
runs shim.decision.reclaim on each container's samples; a RECLAIM verdict is a write of a byte
count to the container's memory.reclaim (the same validated walk). Writes are audited in sums,
one ``reclaim`` record per container at most every ``reclaim_audit_interval`` seconds (the
first write of a quiet container at once). With reclaim off nothing of this runs: the same
files are read as before, nothing more is written or audited.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from shim.decision import reclaim as rc
from shim.decision.guard import (
    RELAXED,
    WATCH,
    GuardAction,
    GuardConfig,
    GuardState,
    Sample,
    Verdict,
    decide,
    history_needed,
)
from shim.effects.cgroupfs import CgroupTree, PathRefused, ReclaimUnsupported, split_path
from shim.effects.layout import SYSTEMD, CgroupLayout, detect_driver
from shim.guard.episodes import REF_FIELDS, Episode, EpisodeFile
from shim.node.facts import KubeletFacts, is_cgroup_v2

log = logging.getLogger(__name__)

READ_FILES = ("memory.current", "memory.min", "memory.low", "memory.high", "memory.max",
              "memory.events", "memory.pressure")
RECLAIM_READ_FILES = READ_FILES + ("memory.stat",)  # what the monitor reads with reclaim on
WRITE_FILES = frozenset({"memory.high"})
EVENTS = ("low", "high", "max", "oom", "oom_kill")
_ID = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_.-]{0,127}$")
_MAX_READ = 4096
_MAX_READ_STAT = 16384  # memory.stat: ~50 lines on 6.x kernels


# -- parsing ---------------------------------------------------------------------------
def parse_memory_value(text: str | None) -> int | None | str:
    """'123' -> 123, 'max' -> None; anything else (or no file) -> '?'."""
    if text is None:
        return "?"
    t = text.strip()
    if t == "max":
        return None
    if t.isascii() and t.isdigit():
        return int(t)
    return "?"


def parse_flat_keyed(text: str | None) -> dict[str, int]:
    """memory.events: 'low 0\\nhigh 12\\n...' -> {'low': 0, 'high': 12, ...}."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_pressure(text: str | None) -> dict[str, dict[str, float]]:
    """memory.pressure: 'some avg10=1.00 avg60=0.50 avg300=0.10 total=1234\\nfull ...' ->
    {'some': {'avg10': 1.0, ..., 'total': 1234.0}, 'full': {...}} (total in microseconds)."""
    out: dict[str, dict[str, float]] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        values = {}
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            try:
                values[k] = float(v)
            except ValueError:
                continue
        out[parts[0]] = values
    return out


# -- validated cgroup access -----------------------------------------------------------
class ContainerCgroups(CgroupTree):
    """Reads of memory.* files and writes of memory.high, below ``root``, only strictly inside
    the ``allowed`` subtrees (relative paths), never through a symlink (CgroupTree)."""

    strictly_below = True

    def is_dir(self, rel: str) -> bool:
        """False when missing; PathRefused for a symlink (or a file) on the way."""
        try:
            fd = self._open_dir(self.check(rel))
        except OSError:
            return False
        os.close(fd)
        return True

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

    def write(self, rel: str, name: str, value: str, expect: str | None = None) -> str:
        """Write value to rel/name. With ``expect``, only when the file holds it (stripped);
        ValueError otherwise. Returns what the file held."""
        if name not in WRITE_FILES:
            raise PathRefused(f"{name!r} is not a file the monitor writes")
        if value != "max" and not (value.isascii() and value.isdigit()):
            raise ValueError(f"bad memory value {value!r}")
        def decide(old: str) -> str:
            if expect is not None and old != expect:
                raise ValueError(f"{name} holds {old!r}, not {expect!r}: changed meanwhile")
            return value

        dfd = self._open_dir(self.check(rel))
        try:
            return self._read_then_write(dfd, name, decide)
        finally:
            os.close(dfd)


# -- containers ------------------------------------------------------------------------
@dataclass(frozen=True)
class ContainerRef:
    id: str
    namespace: str
    pod: str
    container: str
    uid: str
    cgroup_parent: str
    qos: str = ""

    def label(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def refs_from_container_qos(container_qos) -> list[ContainerRef]:
    """ContainerMemoryQoS.containers: the containers rewritten since this shim started."""
    out = []
    for cid, k in list(dict(container_qos.containers).items()):
        out.append(ContainerRef(cid, k.pod.namespace, k.pod.name, k.name, k.pod.uid, k.pod.cgroup_parent,
                                getattr(k.qos, "value", str(k.qos))))
    return out


def refs_from_reconciler(reconciler) -> list[ContainerRef]:
    """The reconciler's node state (another thread mutates it: copy, retry on a race)."""
    for _ in range(3):
        try:
            out = []
            for pod in list(reconciler.state.pods.values()):
                parent = pod.cgroup_parent
                qos = pod.qos
                for c in list(pod.containers.values()):
                    out.append(ContainerRef(c.id, pod.namespace, pod.name, c.name, pod.uid, parent,
                                            qos.value if qos is not None else ""))
            return out
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return []


@dataclass
class Reading:
    """One container's cgroup files as last sampled (what /metrics shows)."""

    ref: ContainerRef
    path: str  # absolute cgroup directory
    t: float
    current: int | None
    min: int | None
    low: int | None
    high: int | None  # None: "max"
    max: int | None  # None: "max"
    events: dict[str, int] = field(default_factory=dict)
    pressure: dict[str, dict[str, float]] = field(default_factory=dict)
    relaxed: bool = False
    reclaimed: int | None = None  # bytes memory.reclaim freed so far (None: reclaim off)


@dataclass
class MonitorSnapshot:
    readings: list[Reading] = field(default_factory=list)
    taken_at: float = 0.0  # time.time()
    duration: float = 0.0  # seconds the sampling took
    containers: int = 0  # containers known (some may have no cgroup yet)
    read_errors: int = 0  # cumulative
    reconciler_lag: float | None = None  # seconds
    idle_reason: str = ""


class _Probe(threading.Event):
    """Put on the reconciler's queue: set() when everything queued before it was processed."""

    def __init__(self, put_at: float):
        super().__init__()
        self.put_at = put_at
        self.done_at: float | None = None

    def set(self) -> None:
        self.done_at = time.monotonic()
        super().set()


class Monitor:
    def __init__(
        self,
        *,
        cgroup_root: str,
        kubelet: KubeletFacts,
        guard: GuardConfig,
        interval: float,
        emit: Callable[[dict], None],
        sources: Iterable[Callable[[], list[ContainerRef]]] = (),
        reconciler=None,
        clock: Callable[[], float] = time.monotonic,
        episodes: EpisodeFile | None = None,
        reclaim: rc.ReclaimConfig | None = None,
        reclaim_audit_interval: float = 60.0,
        page_size: int | None = None,
    ):
        self.cgroup_root = cgroup_root
        self.kubelet = kubelet
        self.guard = guard
        self.interval = interval
        self._emit = emit
        self.sources = list(sources)
        self.reconciler = reconciler
        self._clock = clock
        self.fs = ContainerCgroups(cgroup_root)
        self.layout: CgroupLayout | None = None
        self._paths: dict[str, str] = {}  # container id -> relative cgroup dir
        self._history: dict[str, collections.deque[Sample]] = {}
        self._states: dict[str, GuardState] = {}
        self._last_ref: dict[str, ContainerRef] = {}  # containers with a guard episode open
        self._refused: set[str] = set()
        self._errors_at: dict[str, float] = {}
        self._read_errors = 0
        self._probe: _Probe | None = None
        self._lag: float | None = None
        self._snapshot = MonitorSnapshot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle: str | None = ""
        # open guard episodes survive a restart through this file (None: in memory only)
        self.episodes = episodes
        self._resumed: dict[str, ContainerRef] | None = None  # loaded at the first round
        self._saved: tuple = ()
        # proactive reclaim (None: off; then nothing below is used)
        self.reclaim = reclaim
        self.reclaim_audit_interval = reclaim_audit_interval
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._rc_hist: dict[str, collections.deque[rc.Sample]] = {}
        self._rc_states: dict[str, rc.ReclaimState] = {}
        self._rc_acc: dict[str, dict] = {}  # container id -> sums since its last record
        self._rc_emitted: dict[str, float] = {}  # container id -> when its last record was emitted
        self._rc_pending: dict[str, int] = {}  # container id -> memory.events high at its last write
        self._rc_freed: dict[str, int] = {}  # container id -> bytes freed so far
        self._rc_unsupported: str | None = None
        self.reclaim_totals = {"writes": 0, "eagain": 0, "errors": 0, "asked_bytes": 0, "freed_bytes": 0,
                               "backoffs": 0, "stalls_avoided": 0, "high_events_while_active": 0}

    # -- lifecycle
    def start(self) -> "Monitor":
        self._thread = threading.Thread(target=self._run, name="memqos-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def snapshot(self) -> MonitorSnapshot:
        return self._snapshot

    def guard_states(self) -> dict[str, GuardState]:
        return dict(self._states)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the thread must survive anything
                log.exception("monitor: sampling failed")
            self._stop.wait(self.interval)

    # -- one round
    def _layout(self) -> str | None:
        """None when ready, else why the monitor is idle."""
        if not is_cgroup_v2(self.cgroup_root):
            return f"{self.cgroup_root} is not cgroup v2: nothing to sample"
        k = self.kubelet
        driver = k.cgroup_driver if k.source else detect_driver(self.cgroup_root, k.cgroup_root)
        if driver is None:
            return f"no kubepods cgroup under {self.cgroup_root} yet"
        if self.layout is None or self.layout.driver != driver:
            try:
                self.layout = CgroupLayout(driver, k.cgroup_root)
            except (ValueError, PathRefused) as e:
                return str(e)
            self.fs.set_allowed([self.layout.kubepods])
            self._paths.clear()
        return None

    def _say_idle(self, reason: str | None) -> None:
        if reason == self._idle:
            return
        self._idle = reason
        if reason:
            log.info("monitor idle: %s", reason)
        else:
            log.info("monitor: sampling containers every %g s under %s", self.interval, self.cgroup_root)

    def refs(self) -> list[ContainerRef]:
        seen: dict[str, ContainerRef] = {}
        for source in self.sources:
            try:
                for r in source():
                    # the first source that knows a container wins; later ones fill gaps
                    if r.id not in seen or (not seen[r.id].cgroup_parent and r.cgroup_parent):
                        seen[r.id] = r
            except Exception:
                log.exception("monitor: container source failed")
        return list(seen.values())

    def resolve(self, ref: ContainerRef) -> str | None:
        """The container's cgroup directory (relative), None while it does not exist.
        PathRefused for request data that does not make a valid path."""
        cached = self._paths.get(ref.id)
        if cached is not None:
            return cached
        if not _ID.match(ref.id or ""):
            raise PathRefused(f"container id {ref.id[:80]!r} is not an id")
        _, pod_path = self.layout.pod_from_parent(ref.cgroup_parent, ref.uid)
        if self.layout.driver == SYSTEMD:
            names = (f"cri-containerd-{ref.id}.scope", f"crio-{ref.id}.scope")
        else:
            names = (ref.id, f"crio-{ref.id}")
        for name in names:
            rel = f"{pod_path}/{name}"
            self.fs.check(rel)
            if self.fs.is_dir(rel):
                self._paths[ref.id] = rel
                return rel
        return None

    def tick(self, now: float | None = None) -> list[tuple[ContainerRef, object]]:
        """Sample every container once and run the guard. Returns (ref, GuardDecision) for
        each container whose decision was not KEEP (tests)."""
        t0 = time.perf_counter()
        now = self._clock() if now is None else now
        self._probe_reconciler()
        idle = self._layout()
        self._say_idle(idle)
        refs = self.refs() if idle is None else []
        if self._resumed is None:
            self._resume(now)
        resumed: dict[str, ContainerRef] = {}
        if idle is None:
            # a container the guard relaxed stays watched while its cgroup exists, even if a
            # source forgets it for a while: its episode must end with a restore, not be dropped;
            # so do episodes a previous shim left (resumed once, at the first round that can look)
            resumed, self._resumed = self._resumed, {}
            listed = {r.id for r in refs}
            for cid, r in list(self._last_ref.items()) + list(resumed.items()):
                if cid not in listed:
                    listed.add(cid)
                    refs.append(r)
        readings: list[Reading] = []
        acted = []
        alive: set[str] = set()
        for ref in refs:
            try:
                rel = self.resolve(ref)
            except PathRefused as e:
                self._refuse(ref, str(e))
                continue
            if rel is None:
                continue
            try:
                files = self.fs.read_files(rel) if self.reclaim is None else self.fs.read_files(rel, RECLAIM_READ_FILES)
            except FileNotFoundError:  # the container's cgroup went away
                self._paths.pop(ref.id, None)
                continue
            except (OSError, PathRefused) as e:
                self._read_errors += 1
                self._error(f"read/{ref.id}", f"reading {self.fs.abspath(rel)}: {e}")
                continue
            alive.add(ref.id)
            if ref.id in resumed:
                self._resumed_alive(ref, rel)
            reading = self._reading(ref, rel, files)
            readings.append(reading)
            decision = self._guard(ref, rel, reading, now)
            if decision is not None:
                acted.append((ref, decision))
            reading.relaxed = self._states.get(ref.id, GuardState()).mode == RELAXED
            if self.reclaim is not None:
                try:
                    self._reclaim(ref, rel, reading, files.get("memory.stat"), now)
                except Exception:  # optional: must never take the guard's round down
                    log.exception("reclaim: failed for %s", ref.label())
        for cid in resumed:
            if cid not in alive:
                log.info("guard: the episode of container %s left by the previous shim is over: its cgroup is gone",
                         cid[:12])
        if idle is None:
            for cid in [c for c in set(self._history) | set(self._states) if c not in alive]:
                self._history.pop(cid, None)
                self._states.pop(cid, None)
            if self.reclaim is not None:
                self._reclaim_forget(alive, now)
            self._last_ref = {r.id: r for r in refs
                              if r.id in alive and self._states.get(r.id, GuardState()).mode != WATCH}
            self._save_episodes()
        for cid in [c for c in self._paths if c not in alive]:
            self._paths.pop(cid, None)
        self._snapshot = MonitorSnapshot(
            readings=readings, taken_at=time.time(), duration=time.perf_counter() - t0,
            containers=len(refs), read_errors=self._read_errors, reconciler_lag=self._lag,
            idle_reason=idle or "")
        return acted

    def _reading(self, ref: ContainerRef, rel: str, files: dict[str, str | None]) -> Reading:
        def num(name: str) -> int | None:
            v = parse_memory_value(files.get(name))
            return None if v == "?" else v

        def bytes_or_none(name: str) -> int | None:
            v = parse_memory_value(files.get(name))
            return v if isinstance(v, int) else None

        def limit(name: str) -> int | None:
            v = parse_memory_value(files.get(name))
            if v == "?":
                raise ValueError(name)
            return v

        try:
            high = limit("memory.high")
        except ValueError:
            high = None
        try:
            mx = limit("memory.max")
        except ValueError:
            mx = None
        return Reading(
            ref=ref, path=self.fs.abspath(rel), t=self._clock(),
            current=bytes_or_none("memory.current"), min=num("memory.min"), low=num("memory.low"),
            high=high, max=mx,
            events=parse_flat_keyed(files.get("memory.events")),
            pressure=parse_pressure(files.get("memory.pressure")),
        )

    # -- episodes across restarts
    def _resume(self, now: float) -> None:
        """Take over the episodes a previous shim left: each container's guard state as it was
        (relaxed: the value to restore), its cool-down starting now."""
        self._resumed = {}
        if self.episodes is None:
            return
        for e in self.episodes.load():
            ref = ContainerRef(**e.ref)
            self._resumed[ref.id] = ref
            self._states[ref.id] = GuardState(e.mode, now, e.restore_high)
        self._saved = self._episode_key()

    def _resumed_alive(self, ref: ContainerRef, rel: str) -> None:
        st = self._states.get(ref.id)
        if st is None or st.mode == WATCH:
            return
        log.info("guard: resuming the %s episode of %s (%s) left by the previous shim", st.mode, ref.label(),
                 ref.id[:12])
        self._emit({"event": "guard-resume", "container_id": ref.id, "pod": f"{ref.namespace}/{ref.pod}",
                    "pod_uid": ref.uid, "container": ref.container, "path": self.fs.abspath(rel), "mode": st.mode,
                    "restore_high": st.restore_high})

    def _episode_key(self) -> tuple:
        return tuple(sorted((cid, st.mode, st.restore_high) for cid, st in self._states.items() if st.mode != WATCH))

    def _save_episodes(self) -> None:
        if self.episodes is None:
            return
        key = self._episode_key()
        if key == self._saved:
            return
        out = []
        for cid, mode, high in key:
            ref = self._last_ref.get(cid)
            if ref is not None:
                out.append(Episode({k: getattr(ref, k) for k in REF_FIELDS}, mode, high))
        if self.episodes.save(out):
            self._saved = key

    # -- the guard
    def _guard(self, ref: ContainerRef, rel: str, r: Reading, now: float):
        high_text = None
        sample = Sample(
            t=now, current=r.current, high=r.high, max=r.max,
            full_avg10=r.pressure.get("full", {}).get("avg10"),
            some_avg10=r.pressure.get("some", {}).get("avg10"),
        )
        hist = self._history.get(ref.id)
        if hist is None:
            hist = self._history[ref.id] = collections.deque()
        hist.append(sample)
        keep = history_needed(self.guard)
        while hist and now - hist[0].t > keep:
            hist.popleft()
        state = self._states.get(ref.id, GuardState())
        d = decide(list(hist), self.guard, state)
        if d.verdict is Verdict.KEEP:
            return None
        record = {
            "event": f"guard-{d.verdict.value}",
            "container_id": ref.id,
            "pod": f"{ref.namespace}/{ref.pod}",
            "pod_uid": ref.uid,
            "container": ref.container,
            "path": self.fs.abspath(rel),
            "file": "memory.high",
            "reason": d.reason,
            "action": self.guard.action.value,
            "memory_current": r.current,
            "memory_high": "max" if r.high is None else r.high,
            "memory_max": "max" if r.max is None else r.max,
            "full_avg10": sample.full_avg10,
            "threshold": self.guard.threshold,
            "window": self.guard.window,
            "cooldown": self.guard.cooldown,
        }
        if d.write is not None:
            expect = "max" if d.verdict is Verdict.RESTORE else str(r.high)
            try:
                old = self.fs.write(rel, "memory.high", d.write, expect=expect)
            except (OSError, ValueError, PathRefused) as e:
                # state unchanged: the next round decides again from fresh samples
                self._emit({**record, "event": "guard-error", "wanted": d.verdict.value, "new": d.write,
                            "error": f"{e.__class__.__name__}: {e}"[:500]})
                log.warning("guard: could not %s memory.high of %s: %s", d.verdict.value, ref.label(), e)
                return d
            record.update(old=old, new=d.write)
            high_text = d.write
            r.high = None if d.write == "max" else int(d.write)  # what is in force now
        self._states[ref.id] = d.state
        if high_text is not None:
            log.warning("guard: %s memory.high of %s (%s): %s -> %s; %s", d.verdict.value, ref.label(),
                        ref.id[:12], record["old"], high_text, d.reason)
        else:
            log.info("guard: %s for %s: %s", d.verdict.value, ref.label(), d.reason)
        self._emit(record)
        return d

    # -- proactive reclaim
    def _reclaim(self, ref: ContainerRef, rel: str, r: Reading, stat_text: str | None, now: float) -> None:
        cfg = self.reclaim
        cid = ref.id
        stat = parse_flat_keyed(stat_text) if stat_text is not None else None
        if stat is not None:
            for k in ("workingset_refault_file", "workingset_refault_anon"):
                if k in stat:  # counted in pages
                    stat[k] *= self.page_size
        high_events = r.events.get("high")
        # "stalls avoided": the interval after a write in which memory.events high did not grow
        if cid in self._rc_pending and high_events is not None:
            grew = high_events - self._rc_pending.pop(cid)
            acc = self._rc_acc.setdefault(cid, _new_acc(now))
            if grew <= 0:
                self.reclaim_totals["stalls_avoided"] += 1
                acc["stalls_avoided"] += 1
            else:
                self.reclaim_totals["high_events_while_active"] += grew
                acc["high_events_while_active"] += grew
        r.reclaimed = self._rc_freed.get(cid, 0)
        sample = rc.Sample(t=now, current=r.current, high=r.high, min=r.min, low=r.low,
                           some_avg10=r.pressure.get("some", {}).get("avg10"),
                           full_avg10=r.pressure.get("full", {}).get("avg10"), stat=stat, qos=ref.qos)
        hist = self._rc_hist.get(cid)
        if hist is None:
            hist = self._rc_hist[cid] = collections.deque(maxlen=rc.history_needed(cfg))
        hist.append(sample)
        if self._rc_unsupported is None:
            state = self._rc_states.get(cid, rc.ReclaimState())
            d = rc.decide(list(hist), cfg, state)
            self._rc_states[cid] = d.state
            if d.backoff:
                self.reclaim_totals["backoffs"] += 1
                acc = self._rc_acc.setdefault(cid, _new_acc(now))
                acc["backoffs"] += 1
                acc["backoff_reason"] = d.reason
                log.info("reclaim: %s (%s): %s", ref.label(), cid[:12], d.reason)
            if d.verdict is rc.Verdict.RECLAIM:
                self._reclaim_write(ref, rel, r, sample, d, now)
        acc = self._rc_acc.get(cid)
        if acc is not None and (acc["writes"] or acc["backoffs"] or acc["errors"]):
            last = self._rc_emitted.get(cid)
            if last is None or now - last >= self.reclaim_audit_interval:
                self._rc_emit(ref, rel, r, sample, now)

    def _reclaim_write(self, ref: ContainerRef, rel: str, r: Reading, sample, d, now: float) -> None:
        cid = ref.id
        acc = self._rc_acc.setdefault(cid, _new_acc(now))
        try:
            out = self.fs.reclaim(rel, d.bytes)
        except FileNotFoundError:  # the cgroup went away meanwhile
            return
        except ReclaimUnsupported as e:
            self._rc_unsupported = str(e)
            log.warning("reclaim: %s; proactive reclaim is off for this shim", e)
            self._emit({"event": "reclaim-error", "container_id": cid, "pod": f"{ref.namespace}/{ref.pod}",
                        "container": ref.container, "path": self.fs.abspath(rel), "file": "memory.reclaim",
                        "error": str(e)[:500], "reclaim_disabled": True})
            return
        except (OSError, ValueError, PathRefused) as e:
            self.reclaim_totals["errors"] += 1
            acc["errors"] += 1
            acc["error"] = f"{e.__class__.__name__}: {e}"[:500]
            self._error(f"reclaim/{cid}", f"writing {d.bytes} to {self.fs.abspath(rel, 'memory.reclaim')}: {e}")
            return
        freed = out.freed
        self._rc_states[cid] = rc.after_write(self._rc_states[cid], now, d.bytes, freed, out.eagain, self.reclaim)
        tot = self.reclaim_totals
        tot["writes"] += 1
        tot["eagain"] += out.eagain
        tot["asked_bytes"] += d.bytes
        tot["freed_bytes"] += freed
        self._rc_freed[cid] = self._rc_freed.get(cid, 0) + freed
        r.reclaimed = self._rc_freed[cid]
        acc["writes"] += 1
        acc["eagain"] += out.eagain
        acc["asked_bytes"] += d.bytes
        acc["freed_bytes"] += freed
        acc["reason"] = d.reason
        if r.events.get("high") is not None:
            self._rc_pending[cid] = r.events["high"]
        if out.after is not None:
            r.current = out.after
        log.debug("reclaim: %s asked %d, freed %d%s: %s", ref.label(), d.bytes, freed,
                  " (EAGAIN)" if out.eagain else "", d.reason)

    def _rc_emit(self, ref: ContainerRef | None, rel: str | None, r: Reading | None, sample, now: float,
                 cid: str | None = None) -> None:
        cid = cid or ref.id
        acc = self._rc_acc.pop(cid, None)
        if not acc:
            return
        self._rc_emitted[cid] = now
        record = {"event": "reclaim", "container_id": cid, "file": "memory.reclaim",
                  "period_s": round(now - acc["since"], 3), **{k: v for k, v in acc.items() if k != "since"}}
        if ref is not None:
            record.update(pod=f"{ref.namespace}/{ref.pod}", pod_uid=ref.uid, container=ref.container,
                          path=self.fs.abspath(rel))
        if r is not None:
            record.update(memory_current=r.current, memory_high="max" if r.high is None else r.high,
                          some_avg10=sample.some_avg10, full_avg10=sample.full_avg10,
                          reclaimed_total_bytes=self._rc_freed.get(cid, 0))
        self._emit(record)

    def _reclaim_forget(self, alive: set[str], now: float) -> None:
        for cid in [c for c in set(self._rc_hist) | set(self._rc_acc) | set(self._rc_emitted) if c not in alive]:
            if self._rc_acc.get(cid):
                self._rc_emit(None, None, None, None, now, cid=cid)
            for d in (self._rc_hist, self._rc_states, self._rc_acc, self._rc_emitted, self._rc_pending,
                      self._rc_freed):
                d.pop(cid, None)

    # -- reconciler lag
    def _probe_reconciler(self) -> None:
        """Measure how long the reconciler takes to work through what is queued: a probe put
        on its queue is set once everything queued before it is processed. While a probe is
        outstanding, its age is a lower bound of the lag."""
        rec = self.reconciler
        q = getattr(rec, "_q", None) if rec is not None else None
        if q is None:
            return
        p = self._probe
        if p is not None and not p.is_set():
            self._lag = max(self._lag or 0.0, time.monotonic() - p.put_at)
            return
        if p is not None and p.done_at is not None:
            self._lag = p.done_at - p.put_at
        self._probe = _Probe(time.monotonic())
        q.put(self._probe)

    # -- reporting
    def _refuse(self, ref: ContainerRef, reason: str) -> None:
        if ref.id in self._refused:
            return
        if len(self._refused) > 10000:
            self._refused.clear()
        self._refused.add(ref.id)
        log.warning("monitor: refused container %s: %s", ref.label(), reason)
        self._emit({"event": "cgroup-refused", "by": "monitor", "container_id": ref.id[:128],
                    "pod": f"{ref.namespace}/{ref.pod}", "container": ref.container, "reason": reason[:500]})

    def _error(self, key: str, message: str, every: float = 60.0) -> None:
        t = time.monotonic()
        if t - self._errors_at.get(key, -1e9) < every:
            return
        if len(self._errors_at) > 10000:
            self._errors_at.clear()
        self._errors_at[key] = t
        log.warning("monitor: %s", message)


def guard_config(cfg) -> GuardConfig:
    interval = cfg.monitor_interval or 5.0
    return GuardConfig(
        action=GuardAction(cfg.guard_action),
        threshold=cfg.guard_threshold,
        window=cfg.guard_window,
        cooldown=cfg.guard_cooldown,
        max_gap=max(3 * interval, 15.0),
    )


def _new_acc(now: float) -> dict:
    return {"since": now, "writes": 0, "eagain": 0, "errors": 0, "asked_bytes": 0, "freed_bytes": 0,
            "backoffs": 0, "stalls_avoided": 0, "high_events_while_active": 0}


def reclaim_config(cfg) -> rc.ReclaimConfig | None:
    """--reclaim and its settings (None: off, the default)."""
    if not cfg.reclaim:
        return None
    interval = cfg.monitor_interval or 5.0
    return rc.ReclaimConfig(
        headroom_fraction=cfg.reclaim_headroom / 100.0,
        headroom_min_bytes=cfg.reclaim_headroom_min,
        step_bytes=cfg.reclaim_step,
        rate_bytes=cfg.reclaim_rate,
        psi_some_target=cfg.reclaim_psi_some,
        refault_tolerance_bytes=cfg.reclaim_refault_tolerance,
        backoff=cfg.reclaim_backoff,
        max_gap=max(3 * interval, 15.0),
    )


def build_monitor(cfg, kubelet: KubeletFacts, emit: Callable[[dict], None], *, container_qos=None,
                  reconciler=None) -> Monitor | None:
    """The monitor `serve` runs (None with --monitor-interval 0)."""
    interval = cfg.monitor_interval
    if not interval:
        if cfg.reclaim:
            log.warning("--reclaim true has no effect with --monitor-interval 0: the monitor runs the reclaim")
        return None
    sources = []
    if container_qos is not None:
        sources.append(lambda: refs_from_container_qos(container_qos))
    if reconciler is not None:
        sources.append(lambda: refs_from_reconciler(reconciler))
    guard = guard_config(cfg)
    owners = getattr(container_qos, "ownership", None)
    kubelet_high = owners is not None and owners.owner("container memory.high") == "kubelet"
    if kubelet_high and guard.action is GuardAction.RELAX:
        # the kubelet is configured to set memory.high itself: relaxing it would fight the kubelet
        log.warning("the kubelet owns container memory.high (%s): the guard reports crawls instead of relaxing",
                    owners.reasons["container memory.high"])
        guard = replace(guard, action=GuardAction.NONE)
    return Monitor(cgroup_root=cfg.cgroup_root, kubelet=kubelet, guard=guard, interval=interval,
                   emit=emit, sources=sources, reconciler=reconciler, episodes=episode_file(cfg),
                   reclaim=reclaim_config(cfg),
                   reclaim_audit_interval=cfg.reclaim_audit_interval)


def episode_file(cfg) -> EpisodeFile | None:
    """--guard-state: 'auto' is guard-episodes.json next to the shim's socket (a directory only
    the shim writes); none keeps episodes in memory only."""
    path = cfg.guard_state
    if path == "auto":
        from shim.transport.endpoints import socket_path

        path = os.path.join(os.path.dirname(socket_path(cfg.listen)), "guard-episodes.json")
    return EpisodeFile(path) if path else None
