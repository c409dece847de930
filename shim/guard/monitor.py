"""The monitor: one side thread that samples every managed container's cgroup on an interval
(for the metrics) and runs the memory.high safety guard (shim.decision.guard) on the samples.

Nothing here is on the CRI path. Which containers: the ones the shim rewrote since it started
(``ContainerMemoryQoS.containers``) and, when the reconciler runs, every container of its node
state (rebuilt from the runtime at start, so containers created before a restart are watched
too). Their cgroup directory is built, never taken as is, from request data:

the pod directory from the pod's cgroup_parent and uid (the reconciler's validation), the
container directory below it from the runtime's naming (containerd's or CRI-O's): shim.guard.locate.

Every path is walked one component at a time with O_NOFOLLOW below the cgroup root and must lie
in the kubepods subtree: a symlink, ``..`` or anything outside is refused (and audited once).
The guard's only write is ``memory.high`` of such a container directory, compare-and-write: the
file must still hold what the decision saw (shim.effects.container makes every read and write).

Each guard action is an audit record (``guard-relax``, ``guard-restore``, ``guard-report``,
``guard-clear``, ``guard-released``, ``guard-error``); the metrics count them from the audit
stream.

Proactive reclaim (``--reclaim true``; off by default): the monitor also reads memory.stat and
runs shim.guard.reclaim on each container's samples (writes to memory.reclaim, audited in
sums). With reclaim off nothing of this runs: the same files are read as before, nothing more
is written or audited.

The monitor is a shim.worker.Worker (thread ``memqos-monitor``): a round every ``interval``
seconds. It reads the reconciler's published NodeView (one attribute) and measures the
reconciler's lag with the reconciler's ``probe()``.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import replace
from functools import partial
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
    is_swapping,
)
from shim.effects.cgroupfs import PathRefused
from shim.effects.container import READ_FILES, RECLAIM_READ_FILES, SWAP_READ_FILE, ContainerCgroups
from shim.effects.layout import CgroupLayout
from shim.effects.rollout import OBSERVE
from shim.guard.episodes import REF_FIELDS, Episode, EpisodeFile
from shim.guard.locate import container_dir, node_layout
from shim.guard.reclaim import TOTALS, ReclaimRunner
from shim.guard.update_follow import KernelCheck
from shim.guard.sampling import ContainerRef, MonitorSnapshot, Reading, reading_from
from shim.node.facts import KubeletFacts
from shim.worker import Probe, Worker

log = logging.getLogger(__name__)

# -- containers ------------------------------------------------------------------------
def refs_from_container_qos(container_qos) -> list[ContainerRef]:
    """ContainerMemoryQoS.containers: the containers rewritten since this shim started."""
    out = []
    for cid, k in list(dict(container_qos.containers).items()):
        out.append(ContainerRef(cid, k.pod.namespace, k.pod.name, k.name, k.pod.uid, k.pod.cgroup_parent,
                                getattr(k.qos, "value", str(k.qos)), k.cls or ""))
    return out


def refs_from_reconciler(reconciler) -> list[ContainerRef]:
    """The containers of the reconciler's node state, from the view it last published (one
    read of an immutable NodeView; the reconciler's own state is never touched)."""
    return list(reconciler.view.containers)


class Monitor(Worker):
    """The side thread (``memqos-monitor``) that samples every managed container and runs the
    memory.high guard (and, with reclaim on, the reclaim runner) on the samples."""

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
        rollout=None,
        expected: Callable[[str], object] | None = None,
        class_settings=None,
        reclaim_default: bool = True,
    ):
        super().__init__("memqos-monitor", logger=log, label="monitor")
        self.cgroup_root = cgroup_root
        self.kubelet = kubelet
        self.guard = guard
        self.interval = interval
        self._emit = emit
        self.sources = list(sources)
        self.reconciler = reconciler
        self._clock = clock
        # observe (shim.effects.rollout): the guard decides and audits, nothing is written
        self.fs = ContainerCgroups(cgroup_root, rollout=rollout)
        # observe: container id -> the memory.high (None: max) the guard's writes would have left,
        # which its samples read instead of the file's; dropped (back to watching) once the shim
        # enforces, and never saved as an episode
        self._observed: dict[str, int | None] = {}
        self.layout: CgroupLayout | None = None
        self._paths: dict[str, str] = {}  # container id -> relative cgroup dir
        self._history: dict[str, collections.deque[Sample]] = {}
        self._states: dict[str, GuardState] = {}
        self._last_ref: dict[str, ContainerRef] = {}  # containers with a guard episode open
        self._refused: set[str] = set()
        self._read_errors = 0
        self._probe: Probe | None = None
        self._lag: float | None = None
        self._snapshot = MonitorSnapshot()
        self._next_round = 0.0  # time.monotonic() of the thread's next round
        # open guard episodes survive a restart through this file (None: in memory only)
        self.episodes = episodes
        self._resumed: dict[str, ContainerRef] | None = None  # loaded at the first round
        self._saved: tuple = ()
        # proactive reclaim (None: off; then nothing below is used)
        self.reclaim = reclaim
        self.reclaim_audit_interval = reclaim_audit_interval
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        # expected(container id): the memory.* values its cgroup is to hold (None: not known);
        # a cgroup holding others is reported (shim.guard.update_follow.KernelCheck)
        self.kernel_check = KernelCheck(expected, emit, self.page_size) if expected is not None else None
        # class name -> its ContainerSettings (guard action, reclaim, swap), for the containers created
        # with a class (ContainerRef.cls); reclaim_default: whether reclaim runs for the others
        self.class_settings = class_settings or {}
        self.reclaim_default = reclaim_default
        self.kubelet_high = False  # the kubelet owns container memory.high: no class relaxes it
        self.reclaimer = (ReclaimRunner(reclaim, self.fs, emit, self._error, self.page_size, reclaim_audit_interval)
                          if reclaim is not None else None)

    @property
    def reclaim_totals(self) -> dict[str, int]:
        """Proactive reclaim's running totals (all 0 with reclaim off)."""
        return self.reclaimer.totals if self.reclaimer is not None else dict.fromkeys(TOTALS, 0)

    # -- the thread
    def wait_time(self) -> float:
        return max(0.0, self._next_round - time.monotonic())

    def handle(self, items: list) -> None:
        """A round when one is due (nothing is queued to the monitor but stop and sync marks)."""
        if self.stopping or time.monotonic() < self._next_round:
            return
        try:
            self.tick()
        except Exception:  # the thread must survive anything
            log.exception("monitor: sampling failed")
        self._next_round = time.monotonic() + self.interval

    def snapshot(self) -> MonitorSnapshot:
        return self._snapshot

    def guard_states(self) -> dict[str, GuardState]:
        return dict(self._states)

    # -- one round
    def _layout(self) -> str | None:
        """None when ready, else why the monitor is idle."""
        layout, why = node_layout(self.cgroup_root, self.kubelet, self.layout)
        if layout is None:
            return why
        if layout is not self.layout:
            self.layout = layout
            self.fs.set_allowed([layout.kubepods])
            self._paths.clear()
        return None

    def on_idle(self, reason: str) -> None:
        log.info("monitor idle: %s", reason)

    def on_active(self) -> None:
        log.info("monitor: sampling containers every %g s under %s", self.interval, self.cgroup_root)

    def has_episode(self, container_id: str) -> bool:
        """Whether the guard has an episode open for the container (its memory.high is the
        guard's until the episode ends). Safe from any thread."""
        return container_id in self._last_ref

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
        rel = container_dir(self.fs, self.layout, ref)
        if rel is not None:
            self._paths[ref.id] = rel
        return rel

    def tick(self, now: float | None = None) -> list[tuple[ContainerRef, object]]:
        """Sample every container once and run the guard. Returns (ref, GuardDecision) for
        each container whose decision was not KEEP (tests)."""
        t0 = time.perf_counter()
        now = self._clock() if now is None else now
        self._probe_reconciler()
        if self._observed and not self.fs.rollout.observe:
            self._forget_observed()
        idle = self._layout()
        self.say_idle(idle or None)
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
            settings = self.class_settings.get(ref.cls) if ref.cls else None
            names = READ_FILES if self.reclaim is None else RECLAIM_READ_FILES
            try:
                files = self.fs.read_files(rel, names + (SWAP_READ_FILE,) if settings is not None and settings.swap
                                           else names)
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
            reading = reading_from(ref, self.fs.abspath(rel), self._clock(), files)
            readings.append(reading)
            decision = self._guard(ref, rel, reading, now, self._guard_for(settings))
            if decision is not None:
                acted.append((ref, decision))
            mode = self._states.get(ref.id, GuardState()).mode
            reading.relaxed = mode == RELAXED
            if self.kernel_check is not None and not self.fs.rollout.observe:
                self.kernel_check.check(ref, reading.path, files, skip_high=mode != WATCH)
            if self.reclaimer is not None and (settings.reclaim if settings is not None else self.reclaim_default):
                try:
                    self.reclaimer.run(ref, rel, reading, files.get("memory.stat"), now)
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
                self._observed.pop(cid, None)
            if self.reclaimer is not None:
                self.reclaimer.forget(alive, now)
            if self.kernel_check is not None:
                self.kernel_check.forget(alive)
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
        return tuple(sorted((cid, st.mode, st.restore_high) for cid, st in self._states.items()
                            if st.mode != WATCH and cid not in self._observed))

    def _forget_observed(self) -> None:
        """Enforcing again: the guard states that follow writes observe did not make start over."""
        for cid in self._observed:
            self._states.pop(cid, None)
        self._observed.clear()

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
    def _guard_for(self, settings) -> GuardConfig:
        """The guard's settings for a container of a class (``settings``; None: the node's):
        the class's guard action (never relax where the kubelet owns memory.high), and for a
        swap class, swapping out counts as progress (shim.decision.guard)."""
        guard = self.guard
        if settings is None:
            return guard
        action = GuardAction(settings.guard_action)
        if action is GuardAction.RELAX and self.kubelet_high:
            action = GuardAction.NONE
        if action is guard.action and not settings.swap:
            return guard
        return replace(guard, action=action, swap_progress=settings.swap)

    def _guard(self, ref: ContainerRef, rel: str, r: Reading, now: float, guard: GuardConfig | None = None):
        guard = guard or self.guard
        high_text = None
        observe = self.fs.rollout.observe
        hist = self._history.get(ref.id)
        if hist is None:
            hist = self._history[ref.id] = collections.deque()
        sample = Sample(
            t=now, current=r.current, high=self._observed.get(ref.id, r.high) if observe else r.high, max=r.max,
            full_avg10=r.pressure.get("full", {}).get("avg10"),
            some_avg10=r.pressure.get("some", {}).get("avg10"),
            swap_current=r.swap_current, swapping=is_swapping(hist[-1] if hist else None, r.swap_current),
        )
        hist.append(sample)
        keep = history_needed(guard)
        while hist and now - hist[0].t > keep:
            hist.popleft()
        state = self._states.get(ref.id, GuardState())
        d = decide(list(hist), guard, state)
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
            "action": guard.action.value,
            "memory_current": r.current,
            "memory_high": "max" if r.high is None else r.high,
            "memory_max": "max" if r.max is None else r.max,
            "full_avg10": sample.full_avg10,
            "threshold": guard.threshold,
            "window": guard.window,
            "cooldown": guard.cooldown,
        }
        if ref.cls:
            record["class"] = ref.cls
        if sample.swap_current is not None:
            record["memory_swap_current"] = sample.swap_current
        if d.write is not None:
            expect = "max" if d.verdict is Verdict.RESTORE else str(r.high)
            try:
                old = self.fs.write(rel, "memory.high", d.write, expect=expect, observe=observe)
            except (OSError, ValueError, PathRefused) as e:
                # state unchanged: the next round decides again from fresh samples
                self._emit({**record, "event": "guard-error", "wanted": d.verdict.value, "new": d.write,
                            "error": f"{e.__class__.__name__}: {e}"[:500]})
                log.warning("guard: could not %s memory.high of %s: %s", d.verdict.value, ref.label(), e)
                return d
            record.update(old=old, new=d.write)
            high_text = d.write
            if observe:
                record["rollout"] = OBSERVE
                self._observed[ref.id] = None if d.write == "max" else int(d.write)
            else:
                r.high = None if d.write == "max" else int(d.write)  # what is in force now
        self._states[ref.id] = d.state
        if high_text is not None:
            log.warning("guard: %s memory.high of %s (%s): %s -> %s; %s", d.verdict.value, ref.label(),
                        ref.id[:12], record["old"], high_text, d.reason)
        else:
            log.info("guard: %s for %s: %s", d.verdict.value, ref.label(), d.reason)
        self._emit(record)
        return d

    # -- reconciler lag
    def _probe_reconciler(self) -> None:
        """Measure how long the reconciler takes to work through what is queued: a probe put
        on its queue is set once everything queued before it is processed. While a probe is
        outstanding, its age is a lower bound of the lag."""
        rec = self.reconciler
        if rec is None or not hasattr(rec, "probe"):
            return
        p = self._probe
        if p is not None and not p.is_set():
            self._lag = max(self._lag or 0.0, time.monotonic() - p.put_at)
            return
        if p is not None and p.done_at is not None:
            self._lag = p.done_at - p.put_at
        self._probe = rec.probe()

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

def guard_config(cfg) -> GuardConfig:
    interval = cfg.monitor_interval or 5.0
    return GuardConfig(
        action=GuardAction(cfg.guard_action),
        threshold=cfg.guard_threshold,
        window=cfg.guard_window,
        cooldown=cfg.guard_cooldown,
        max_gap=max(3 * interval, 15.0),
    )


def reclaim_config(cfg, class_settings=None) -> rc.ReclaimConfig | None:
    """--reclaim and its settings (None: off, the default, unless a class turns it on)."""
    if not cfg.reclaim and not any(s.reclaim for s in (class_settings or {}).values()):
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
                  reconciler=None, rollout=None) -> Monitor | None:
    """The monitor `serve` runs (None with --monitor-interval 0)."""
    interval = cfg.monitor_interval
    if not interval:
        if cfg.reclaim:
            log.warning("--reclaim true has no effect with --monitor-interval 0: the monitor runs the reclaim")
        return None
    sources = []
    expected = None
    if container_qos is not None:
        sources.append(lambda: refs_from_container_qos(container_qos))
        expected = partial(known_values, container_qos)
    if reconciler is not None:
        sources.append(lambda: refs_from_reconciler(reconciler))
    owners = getattr(container_qos, "ownership", None)
    guard = guard_for_ownership(cfg, owners)
    classes = {name: s for name, s in (getattr(container_qos, "class_settings", None) or {}).items() if name}
    monitor = Monitor(cgroup_root=cfg.cgroup_root, kubelet=kubelet, guard=guard, interval=interval,
                      emit=emit, sources=sources, reconciler=reconciler, episodes=episode_file(cfg),
                      reclaim=reclaim_config(cfg, classes),
                      reclaim_audit_interval=cfg.reclaim_audit_interval, rollout=rollout,
                      page_size=cfg.page_size or None, expected=expected, class_settings=classes,
                      reclaim_default=cfg.reclaim)
    monitor.kubelet_high = kubelet_owns_high(owners)
    return monitor


def known_values(container_qos, cid: str):
    """The memory.* values the rewriter's last decision for the container put in force (None:
    a container it did not see created)."""
    known = container_qos.containers.get(cid)
    return known.unified if known is not None else None


def guard_for_ownership(cfg, owners) -> GuardConfig:
    """The guard's settings given who owns container memory.high (shim.node.kubelet.Ownership,
    or None): a kubelet configured to set memory.high itself is not fought, ``relax`` acts as
    ``none`` (crawls are reported). Serve replaces ``Monitor.guard`` with this when the
    ownership changes (the kubelet's version found after start)."""
    guard = guard_config(cfg)
    if kubelet_owns_high(owners) and guard.action is GuardAction.RELAX:
        log.warning("the kubelet owns container memory.high (%s): the guard reports crawls instead of relaxing",
                    owners.reasons["container memory.high"])
        guard = replace(guard, action=GuardAction.NONE)
    return guard


def kubelet_owns_high(owners) -> bool:
    """Whether the kubelet owns container memory.high (shim.node.kubelet.Ownership, or None)."""
    return owners is not None and owners.owner("container memory.high") == "kubelet"


def episode_file(cfg) -> EpisodeFile | None:
    """guard-state: 'auto' is guard-episodes.json next to the shim's socket (a directory only
    the shim writes); none keeps episodes in memory only."""
    path = cfg.guard_state
    if path == "auto":
        from shim.transport.endpoints import socket_path

        path = os.path.join(os.path.dirname(socket_path(cfg.listen)), "guard-episodes.json")
    return EpisodeFile(path) if path else None
