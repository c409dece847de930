"""Proactive reclaim's decision: pure, no I/O, no clock.

Why: a Burstable container whose page cache grows until memory.current reaches memory.high
is reclaimed *synchronously*, in its own allocating tasks (memory.events ``high`` counts each
time), and those stalls show in its PSI. Asking the kernel to reclaim through cgroup v2
``memory.reclaim`` (kernel >= 5.19) from the shim's side thread a little *before* memory.high
keeps the container out of that path: the reclaim work (and its memory stall) happens in the
shim's task, not in the container's. Useful only for memory the kernel can take without
hurting: clean, unmapped page cache. Anonymous memory without swap cannot be reclaimed at
all, and reclaiming the cache a container re-reads (its working set) only moves the stall.

``decide(samples, config, state)`` looks at one container's recent samples (oldest first, the
newest last) and its reclaim state and returns how many bytes to write to memory.reclaim now
(``Verdict.RECLAIM`` with ``bytes``) or nothing (``Verdict.KEEP``), always with the reason.
Rules, in order (the first that applies decides):

1. a Guaranteed pod's container: never (its memory.high is max; its memory is what it asked for);
2. memory.high max/unset: never (there is no synchronous-reclaim threshold to keep away from);
3. memory.current at or below ``high - headroom`` (headroom = ``headroom_fraction`` of
   memory.high, at least ``headroom_min_bytes``, at most half of memory.high): nothing to do;
4. backing off (a previous rule 5/6 or an EAGAIN that found nothing): nothing until it ends;
5. PSI memory ``some`` avg10 unreadable: nothing (reclaim cannot see whether it hurts); at or
   above ``psi_some_target``: nothing, and a back-off of ``backoff`` seconds when the shim
   reclaimed within the last ``backoff`` seconds (its reclaim may be the pressure);
6. refaults (memory.stat ``workingset_refault_file`` + ``workingset_refault_anon``, in bytes)
   grew by more than ``refault_tolerance_bytes`` since the previous sample: back off (the cache
   being reclaimed is the working set). The first sample of a container (or one after a gap
   longer than ``max_gap``) only records the counter: one interval of waiting;
7. the protection floor: never below max(memory.min, memory.low);
8. what can be reclaimed: ``file - shmem - file_mapped - file_dirty - file_writeback`` of
   memory.stat (unmapped, clean page cache; shmem/tmpfs is not reclaimable without swap).
   Less than ``min_bytes``: nothing -- an anon-only container is left alone, and the reason
   says so;
9. otherwise ask for ``current - target`` (target = ``high - target_factor * headroom``),
   bounded by the reclaimable cache, by ``step_bytes`` (one write), by the floor, and by the
   rate budget (a token bucket per container: ``rate_bytes`` per second, at most
   ``burst_seconds`` of it saved up); under ``min_bytes`` after the bounds: nothing.

The outcome of a write goes back through ``after_write``: an EAGAIN that freed less than
``min_bytes`` (the kernel found nothing to take) backs off like rule 6.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

MI = 1 << 20
GUARANTEED = "Guaranteed"


class Verdict(str, Enum):
    KEEP = "keep"  # write nothing
    RECLAIM = "reclaim"  # write ``bytes`` to memory.reclaim


@dataclass(frozen=True)
class Sample:
    """One reading of a container's cgroup. ``high`` None means memory.high reads "max" (or
    is unreadable); ``stat`` is memory.stat as parsed (bytes; refault counters converted from
    pages to bytes), empty when unread."""

    t: float  # seconds, any monotonic clock
    current: int | None
    high: int | None
    min: int | None = None
    low: int | None = None
    some_avg10: float | None = None  # percent, 0..100
    full_avg10: float | None = None
    stat: dict[str, int] | None = None
    qos: str = ""  # the pod's QoS class when known ("Guaranteed", "Burstable", "BestEffort")

    def refaults(self) -> int | None:
        if not self.stat or "workingset_refault_file" not in self.stat:
            return None
        return self.stat["workingset_refault_file"] + self.stat.get("workingset_refault_anon", 0)

    def reclaimable(self) -> int | None:
        """Unmapped, clean page cache: what memory.reclaim can take without swap."""
        s = self.stat
        if not s or "file" not in s:
            return None
        hold = s.get("shmem", 0) + s.get("file_mapped", 0) + s.get("file_dirty", 0) + s.get("file_writeback", 0)
        return max(0, s["file"] - hold)


@dataclass(frozen=True)
class ReclaimConfig:
    headroom_fraction: float = 0.10  # reclaim once memory.current is within 10 % of memory.high ...
    headroom_min_bytes: int = 8 * MI  # ... or 8 MiB, whichever is larger (at most half of memory.high)
    target_factor: float = 1.5  # ... down to memory.high - 1.5 x headroom
    step_bytes: int = 32 * MI  # at most this much per write
    rate_bytes: int = 16 * MI  # per second and container (token bucket) ...
    burst_seconds: float = 5.0  # ... saving up at most this many seconds of it
    min_bytes: int = 1 * MI  # asks smaller than this are not worth a write
    psi_some_target: float = 10.0  # percent: reclaim only while some avg10 is below
    refault_tolerance_bytes: int = 1 * MI  # refaults per sample interval tolerated
    backoff: float = 60.0  # seconds of no reclaim after pressure, refaults or a fruitless EAGAIN
    max_gap: float | None = None  # a longer gap between samples: refaults cannot be compared

    def headroom(self, high: int) -> int:
        return min(max(int(high * self.headroom_fraction), self.headroom_min_bytes), high // 2)

    def target(self, high: int) -> int:
        return max(0, high - int(self.target_factor * self.headroom(high)))


@dataclass(frozen=True)
class ReclaimState:
    tokens: float = -1.0  # bytes of rate budget left (-1: full, never used)
    tokens_t: float = 0.0  # when ``tokens`` was computed
    backoff_until: float | None = None
    backoff_reason: str = ""
    last_reclaim: float | None = None  # sample time of the last write


@dataclass(frozen=True)
class ReclaimDecision:
    verdict: Verdict
    state: ReclaimState
    reason: str
    bytes: int = 0  # to write to memory.reclaim (RECLAIM only)
    backoff: bool = False  # this decision started a back-off


def _mb(n: int | None) -> str:
    if n is None:
        return "max"
    return f"{n / MI:.1f}MiB"


def tokens_at(state: ReclaimState, t: float, cfg: ReclaimConfig) -> float:
    cap = cfg.rate_bytes * cfg.burst_seconds
    if state.tokens < 0:
        return cap
    return min(cap, state.tokens + cfg.rate_bytes * max(0.0, t - state.tokens_t))


def _keep(state: ReclaimState, reason: str) -> ReclaimDecision:
    return ReclaimDecision(Verdict.KEEP, state, reason)


def _back_off(state: ReclaimState, t: float, cfg: ReclaimConfig, reason: str) -> ReclaimDecision:
    until = t + cfg.backoff
    return ReclaimDecision(Verdict.KEEP, replace(state, backoff_until=until, backoff_reason=reason),
                           f"{reason}: backing off for {cfg.backoff:g} s", backoff=True)


def _previous(samples: Sequence[Sample], cfg: ReclaimConfig) -> Sample | None:
    if len(samples) < 2:
        return None
    prev, now = samples[-2], samples[-1]
    if cfg.max_gap is not None and now.t - prev.t > cfg.max_gap:
        return None
    return prev


def decide(samples: Sequence[Sample], cfg: ReclaimConfig, state: ReclaimState = ReclaimState()) -> ReclaimDecision:
    if not samples:
        return _keep(state, "no sample")
    now = samples[-1]
    if now.qos == GUARANTEED:
        return _keep(state, "Guaranteed pod: never reclaimed (memory.high is max and its memory is what it asked for)")
    if now.high is None:
        return _keep(state, "memory.high is max: no synchronous-reclaim threshold to keep away from")
    if now.current is None:
        return _keep(state, "memory.current unreadable")
    headroom = cfg.headroom(now.high)
    start = now.high - headroom
    where = f"memory.current {_mb(now.current)}, memory.high {_mb(now.high)}"
    if now.current <= start:
        return _keep(state, f"{where}: below memory.high - headroom ({_mb(start)})")
    if state.backoff_until is not None and now.t < state.backoff_until:
        return _keep(state, f"backing off for {state.backoff_until - now.t:.0f} s more ({state.backoff_reason})")
    if now.some_avg10 is None:
        return _keep(state, "no PSI reading (memory.pressure unreadable): reclaim cannot see whether it hurts")
    recent = state.last_reclaim is not None and now.t - state.last_reclaim <= cfg.backoff
    if now.some_avg10 >= cfg.psi_some_target:
        why = f"memory.pressure some avg10 {now.some_avg10:.1f}% >= {cfg.psi_some_target:g}%"
        if recent:
            return _back_off(state, now.t, cfg, f"{why} after the shim's reclaim")
        return _keep(state, f"{why}: the container already stalls; not adding reclaim")
    rf = now.refaults()
    if rf is None:
        return _keep(state, "memory.stat unreadable (no workingset_refault_file): refaults cannot be watched")
    prev = _previous(samples, cfg)
    rf_prev = prev.refaults() if prev is not None else None
    if rf_prev is None:
        return _keep(state, f"{where}: first sample with refault counters; waiting for the next to compare")
    grew = rf - rf_prev
    if grew > cfg.refault_tolerance_bytes:
        return _back_off(state, now.t, cfg, f"refaults grew by {_mb(grew)} in {now.t - prev.t:.0f} s "
                                            f"(> {_mb(cfg.refault_tolerance_bytes)}): the page cache is the working set")
    floor = max(now.min or 0, now.low or 0)
    if now.current <= floor:
        return _keep(state, f"{where}: at its protection (memory.min/low {_mb(floor)})")
    reclaimable = now.reclaimable()
    if reclaimable is None:
        return _keep(state, "memory.stat unreadable (no file): nothing known to be reclaimable")
    if reclaimable < cfg.min_bytes:
        anon = (now.stat or {}).get("anon", 0)
        if anon > (now.stat or {}).get("file", 0):
            return _keep(state, f"anon-only: {_mb(anon)} anon, {_mb(reclaimable)} unmapped clean page cache; "
                                "without swap memory.reclaim cannot take anonymous memory")
        return _keep(state, f"{_mb(reclaimable)} unmapped clean page cache: nothing worth reclaiming")
    target = cfg.target(now.high)
    want = now.current - target
    tokens = tokens_at(state, now.t, cfg)
    bounds = [(want, f"back to {_mb(target)} (memory.high - {cfg.target_factor:g} x headroom {_mb(headroom)})"),
              (reclaimable, f"the reclaimable page cache {_mb(reclaimable)}"),
              (cfg.step_bytes, f"the step {_mb(cfg.step_bytes)}"),
              (now.current - floor, f"the protection floor {_mb(floor)}"),
              (int(tokens), f"the rate budget ({_mb(int(tokens))} left at {_mb(cfg.rate_bytes)}/s)")]
    n, why = min(bounds, key=lambda b: b[0])
    if n < cfg.min_bytes:
        return _keep(state, f"{where}: only {_mb(max(n, 0))} allowed by {why}")
    new = replace(state, tokens=tokens - n, tokens_t=now.t, last_reclaim=now.t)
    return ReclaimDecision(
        Verdict.RECLAIM, new,
        f"{where} is within the headroom {_mb(headroom)}; some avg10 {now.some_avg10:.1f}%: asking "
        f"{_mb(n)}, bounded by {why}", bytes=n)


def after_write(state: ReclaimState, t: float, asked: int, freed: int, eagain: bool, cfg: ReclaimConfig) -> ReclaimState:
    """The state after a write's outcome: an EAGAIN that freed (almost) nothing backs off."""
    if eagain and freed < cfg.min_bytes:
        return replace(state, backoff_until=t + cfg.backoff,
                       backoff_reason=f"memory.reclaim returned EAGAIN for {_mb(asked)} and freed {_mb(freed)}")
    return state


def history_needed(cfg: ReclaimConfig) -> int:
    """Samples decide() looks at (the newest and the previous one)."""
    return 2
