"""The memory.high safety guard's decision: pure, no I/O, no clock.

Why it exists (reference section 4): memory.high never kills. Past it, the kernel reclaims
and then makes every allocating task sleep; without swap, anonymous memory cannot be
reclaimed, so a container that grows past memory.high *crawls* (seen on a 6.1 kernel:
64 MB -> 74 MB in 28 s, PSI memory ``full`` avg10 about 90 %) instead of reaching memory.max
and being OOM-killed, which is what its owner expects from a limit. That crawl stalled the
upstream Memory QoS feature. The guard watches for it and takes the configured action.

``decide(samples, config, state)`` looks at one container's recent samples (oldest first,
the newest last) and its guard state, and says what to do now:

* ``watch`` state (memory.high is the computed value):

  - *hot* sample: memory.pressure ``full avg10 >= threshold`` **and** memory.current is at
    memory.high (``current >= high - margin``, margin = ``at_high_fraction`` of high, at
    least ``at_high_min_bytes``) **and** memory.high is set (not ``max``);
  - when the trailing run of hot samples (no sample missing its reading, no gap longer than
    ``max_gap`` between two of them, none from before the last restore or release) spans at
    least ``window`` seconds: action ``relax`` ->
    ``RELAX`` (write ``max`` to memory.high: the kernel's normal limit, memory.max, applies;
    the container proceeds, or is OOM-killed at its limit as its owner expects); action
    ``none`` -> ``REPORT`` once per episode, nothing written.

* ``relaxed`` state (the guard wrote ``max``):

  - memory.high no longer reads ``max``: someone else wrote it (the runtime applying an
    UpdateContainerResources, an operator) -> ``RELEASED``: the guard forgets the episode and
    writes nothing (if the container crawls again, a new episode starts);
  - *calm* sample: ``full avg10 < threshold * calm_fraction`` **and** memory.current is
    below the value to restore by at least the margin (restoring would not throttle it at
    once);
  - when the trailing run of calm samples since the relaxation spans at least ``cooldown``
    seconds -> ``RESTORE`` (write the computed memory.high back).

* ``reported`` state (action ``none``): calm (``full avg10 < threshold * calm_fraction``) for
  ``cooldown`` seconds, or memory.high gone -> ``CLEAR`` (the episode is over).

A container of a swap class (``swap_progress``) that is paging out to swap makes progress past
memory.high: its memory.swap.current grew by at least ``SWAP_PROGRESS_BYTES`` since the sample
before (``Sample.swapping``). Such a sample is not hot: memory.high pushes its anon pages to swap
as the class asks, and the guard leaves memory.high alone while it does; when swap stops
growing (swap full, memory.swap.max reached, or pages only going in and out) and the crawl goes
on, the samples are hot again and the guard acts as for any container (docs/memory-qos.md, "Swap").

A sample without a PSI reading (kernel built without PSI, ``psi=0``) is never hot and never
calm: the guard does nothing it cannot justify, and a relaxed container stays relaxed (the
safe side: no crawl).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence


class GuardAction(str, Enum):
    """What the operator configured (--guard-action)."""

    RELAX = "relax"
    NONE = "none"


class Verdict(str, Enum):
    KEEP = "keep"  # nothing to do
    RELAX = "relax"  # write "max" to memory.high
    RESTORE = "restore"  # write the computed memory.high back
    REPORT = "report"  # action none: the guard would have relaxed (report only)
    CLEAR = "clear"  # action none: the reported episode is over
    RELEASED = "released"  # someone else rewrote memory.high while relaxed: stand down


WATCH, RELAXED, REPORTED = "watch", "relaxed", "reported"
SWAP_PROGRESS_BYTES = 1 << 20  # memory.swap.current growth between two samples that counts as progress


@dataclass(frozen=True)
class Sample:
    """One reading of a container's cgroup. ``high``/``max`` None mean the file reads "max";
    ``current``/``full_avg10`` None mean the file could not be read."""

    t: float  # seconds, any monotonic clock
    current: int | None
    high: int | None
    full_avg10: float | None  # percent, 0..100
    max: int | None = None
    some_avg10: float | None = None
    swap_current: int | None = None  # memory.swap.current (None: not read)
    swapping: bool = False  # swap_current grew by SWAP_PROGRESS_BYTES or more since the sample before


def is_swapping(before: Sample | None, swap_current: int | None) -> bool:
    """Whether memory.swap.current grew by SWAP_PROGRESS_BYTES or more since ``before``."""
    return (before is not None and before.swap_current is not None and swap_current is not None
            and swap_current - before.swap_current >= SWAP_PROGRESS_BYTES)


@dataclass(frozen=True)
class GuardConfig:
    action: GuardAction = GuardAction.RELAX
    threshold: float = 40.0  # percent, PSI memory full avg10
    window: float = 30.0  # seconds the condition must hold
    cooldown: float = 300.0  # seconds of calm before memory.high is restored
    calm_fraction: float = 0.5  # calm = full avg10 below threshold * calm_fraction
    at_high_fraction: float = 0.02  # "at memory.high" = within 2 % of it ...
    at_high_min_bytes: int = 1 << 20  # ... or 1 MiB, whichever is larger
    max_gap: float | None = None  # a longer gap between samples breaks a run (None: no limit)
    swap_progress: bool = False  # a swap class: a sample that is swapping out is not hot

    def margin(self, high: int) -> int:
        return max(int(high * self.at_high_fraction), self.at_high_min_bytes)

    @property
    def calm_threshold(self) -> float:
        return self.threshold * self.calm_fraction


@dataclass(frozen=True)
class GuardState:
    mode: str = WATCH
    since: float = 0.0  # when the current mode began (sample time)
    restore_high: int | None = None  # relaxed/reported: the computed memory.high at the time


@dataclass(frozen=True)
class GuardDecision:
    verdict: Verdict
    state: GuardState
    reason: str
    write: str | None = None  # the value to write to memory.high, when any


def _mb(n: int | None) -> str:
    if n is None:
        return "max"
    return f"{n / 2**20:.1f}MiB"


def is_hot(s: Sample, cfg: GuardConfig) -> bool:
    return (
        s.high is not None
        and s.current is not None
        and s.full_avg10 is not None
        and s.full_avg10 >= cfg.threshold
        and s.current >= s.high - cfg.margin(s.high)
        and not (cfg.swap_progress and s.swapping)
    )


def is_calm(s: Sample, cfg: GuardConfig, restore_high: int | None) -> bool:
    """Calm enough to restore (relaxed) or to clear a report (restore_high None)."""
    if s.full_avg10 is None or s.full_avg10 >= cfg.calm_threshold:
        return False
    if restore_high is None:
        return True
    return s.current is not None and s.current < restore_high - cfg.margin(restore_high)


def trailing_span(samples: Sequence[Sample], pred, cfg: GuardConfig, not_before: float | None = None) -> float | None:
    """Seconds covered by the trailing run of samples satisfying pred (newest included),
    None when the newest does not. A gap longer than cfg.max_gap, or a sample older than
    not_before, ends the run."""
    if not samples or not pred(samples[-1]):
        return None
    first = samples[-1]
    for s in reversed(samples[:-1]):
        if not_before is not None and s.t < not_before:
            break
        if cfg.max_gap is not None and first.t - s.t > cfg.max_gap:
            break
        if not pred(s):
            break
        first = s
    return samples[-1].t - first.t


def decide(samples: Sequence[Sample], cfg: GuardConfig, state: GuardState = GuardState()) -> GuardDecision:
    if not samples:
        return GuardDecision(Verdict.KEEP, state, "no sample")
    now = samples[-1]
    if state.mode == RELAXED:
        return _relaxed(samples, cfg, state)
    if state.mode == REPORTED:
        return _reported(samples, cfg, state)

    if now.high is None:
        return GuardDecision(Verdict.KEEP, state, "memory.high is max: nothing to guard")
    if now.full_avg10 is None:
        return GuardDecision(Verdict.KEEP, state, "no PSI reading (memory.pressure unreadable)")
    # samples from before the last mode change (a relaxation, a restore) do not count
    span = trailing_span(samples, lambda s: is_hot(s, cfg), cfg, not_before=state.since)
    if span is None and cfg.swap_progress and now.swapping:
        return GuardDecision(Verdict.KEEP, state, f"swapping out past memory.high (swap class): memory.swap.current "
                                                  f"{_mb(now.swap_current)}, full avg10 {now.full_avg10:.1f}%")
    if span is None:
        return GuardDecision(Verdict.KEEP, state, f"not crawling: full avg10 {now.full_avg10:.1f}%, "
                                                  f"memory.current {_mb(now.current)}, memory.high {_mb(now.high)}")
    why = (f"memory.pressure full avg10 >= {cfg.threshold:g}% for {span:.0f} s (now {now.full_avg10:.1f}%) "
           f"while memory.current {_mb(now.current)} is at memory.high {_mb(now.high)}")
    if span < cfg.window:
        return GuardDecision(Verdict.KEEP, state, f"{why}; waiting for the {cfg.window:g} s window")
    if cfg.action is GuardAction.NONE:
        return GuardDecision(Verdict.REPORT, GuardState(REPORTED, now.t, now.high),
                             f"{why}: the container crawls (guard action none: reported only)")
    return GuardDecision(
        Verdict.RELAX, GuardState(RELAXED, now.t, now.high),
        f"{why}: the container crawls instead of reaching its limit; memory.high raised to max so that "
        f"memory.max ({_mb(now.max)}) applies", write="max")


def _relaxed(samples: Sequence[Sample], cfg: GuardConfig, state: GuardState) -> GuardDecision:
    now = samples[-1]
    if now.high is not None:
        return GuardDecision(
            Verdict.RELEASED, GuardState(WATCH, now.t, None),
            f"memory.high reads {now.high}, not the max the guard wrote: rewritten by someone else "
            f"(the runtime applying an update?); the guard stands down")
    if state.restore_high is None:  # cannot happen through decide(); be safe
        return GuardDecision(Verdict.RELEASED, GuardState(WATCH, now.t, None), "no memory.high to restore")
    span = trailing_span(samples, lambda s: is_calm(s, cfg, state.restore_high), cfg, not_before=state.since)
    if span is None:
        return GuardDecision(
            Verdict.KEEP, state,
            f"relaxed since {now.t - state.since:.0f} s; not calm: full avg10 "
            f"{'?' if now.full_avg10 is None else f'{now.full_avg10:.1f}%'}, memory.current {_mb(now.current)} "
            f"(restore to {_mb(state.restore_high)} needs below {_mb(state.restore_high - cfg.margin(state.restore_high))})")
    if span < cfg.cooldown:
        return GuardDecision(Verdict.KEEP, state, f"calm for {span:.0f} s of the {cfg.cooldown:g} s cool-down")
    return GuardDecision(
        Verdict.RESTORE, GuardState(WATCH, now.t, None),
        f"calm for {span:.0f} s (full avg10 {now.full_avg10:.1f}% < {cfg.calm_threshold:g}%, memory.current "
        f"{_mb(now.current)} below {_mb(state.restore_high)}): computed memory.high restored",
        write=str(state.restore_high))


def _reported(samples: Sequence[Sample], cfg: GuardConfig, state: GuardState) -> GuardDecision:
    now = samples[-1]
    if now.high is None:
        return GuardDecision(Verdict.CLEAR, GuardState(WATCH, now.t, None), "memory.high is max now: episode over")
    span = trailing_span(samples, lambda s: is_calm(s, cfg, None), cfg, not_before=state.since)
    if span is None or span < cfg.cooldown:
        return GuardDecision(Verdict.KEEP, state, "reported; not calm for the cool-down yet")
    return GuardDecision(Verdict.CLEAR, replace(state, mode=WATCH, since=now.t, restore_high=None),
                         f"calm for {span:.0f} s (full avg10 {now.full_avg10:.1f}% < {cfg.calm_threshold:g}%): "
                         "episode over")


def history_needed(cfg: GuardConfig) -> float:
    """Seconds of samples decide() can look at."""
    return max(cfg.window, cfg.cooldown) + 60.0
