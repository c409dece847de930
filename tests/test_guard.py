"""The memory.high guard's decision (shim.decision.guard): pressure series in, action out.

Each row of TABLE feeds samples one at a time through decide(), carrying the state as the
monitor does, and lists every non-KEEP verdict as (sample time, verdict)."""
from __future__ import annotations

import pytest

from shim.decision.guard import (
    RELAXED,
    REPORTED,
    WATCH,
    GuardAction,
    GuardConfig,
    GuardState,
    Sample,
    Verdict,
    decide,
)

MI = 2**20
HIGH = 64 * MI
MAX = 128 * MI
R, RS, REP, CL, REL = Verdict.RELAX, Verdict.RESTORE, Verdict.REPORT, Verdict.CLEAR, Verdict.RELEASED


def crawl(t0, t1, *, full=90.0, current=HIGH + 2 * MI, high=HIGH, step=5):
    """A container at memory.high with PSI full avg10 = full, sampled every step seconds."""
    return [(t, current, high, full) for t in range(t0, t1 + 1, step)]


def relaxed_calm(t0, t1, *, current=40 * MI, full=2.0, step=5):
    """After the guard wrote max: memory.high reads max."""
    return [(t, current, None, full) for t in range(t0, t1 + 1, step)]


def run(series, cfg: GuardConfig, state: GuardState = GuardState()):
    samples, out = [], []
    for t, current, high, full in series:
        samples.append(Sample(t=float(t), current=current, high=high, full_avg10=full, max=MAX))
        d = decide(samples, cfg, state)
        if d.verdict is not Verdict.KEEP:
            out.append((t, d.verdict))
        state = d.state
    return out, state


DEFAULT = GuardConfig()  # relax, 40 %, 30 s window, 300 s cool-down
TABLE = [
    # name, config, series, expected non-KEEP verdicts, final mode
    ("crawl relaxed after the window", DEFAULT, crawl(0, 30), [(30, R)], RELAXED),
    ("relaxed, then memory.high reads a number again: released", DEFAULT, crawl(0, 40), [(30, R), (35, REL)], WATCH),
    ("released and still crawling: a full new window", DEFAULT, crawl(0, 65), [(30, R), (35, REL), (65, R)], RELAXED),
    ("the reference crawl (90 %, 6.1 kernel)", DEFAULT, crawl(0, 28, step=2), [], WATCH),  # 28 s < window
    ("at exactly the threshold", DEFAULT, crawl(0, 30, full=40.0), [(30, R)], RELAXED),
    ("just below the threshold", DEFAULT, crawl(0, 120, full=39.9), [], WATCH),
    ("pressure but far below memory.high (parent or node pressure)", DEFAULT,
     crawl(0, 120, current=32 * MI), [], WATCH),
    ("within the at-high margin counts (2 % / 1 MiB)", DEFAULT,
     crawl(0, 30, current=HIGH - MI), [(30, R)], RELAXED),
    ("just outside the margin does not", DEFAULT,
     crawl(0, 60, current=HIGH - int(HIGH * 0.02) - 4096), [], WATCH),
    ("memory.high max: nothing to guard", DEFAULT, crawl(0, 60, high=None), [], WATCH),
    ("one calm sample restarts the window", DEFAULT,
     crawl(0, 20) + [(25, HIGH, HIGH, 10.0)] + crawl(30, 60), [(60, R)], RELAXED),
    ("a sample without PSI restarts the window", DEFAULT,
     crawl(0, 20) + [(25, HIGH, HIGH, None)] + crawl(30, 60), [(60, R)], RELAXED),
    ("a gap longer than max_gap restarts the window", GuardConfig(max_gap=15.0),
     crawl(0, 10) + crawl(40, 70), [(70, R)], RELAXED),
    ("short window", GuardConfig(window=10.0), crawl(0, 10), [(10, R)], RELAXED),
    ("higher threshold ignores 50 %", GuardConfig(threshold=60.0), crawl(0, 60, full=50.0), [], WATCH),
    ("relax, then calm for the cool-down: restore", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 340), [(30, R), (335, RS)], WATCH),
    ("relaxed and still using more than memory.high: stays relaxed", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 1000, current=HIGH + 10 * MI), [(30, R)], RELAXED),
    ("relaxed, pressure between calm (20 %) and threshold: stays relaxed", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 1000, full=25.0), [(30, R)], RELAXED),
    ("relaxed, calm interrupted: the cool-down starts again", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 200) + [(205, 40 * MI, None, 30.0)] + relaxed_calm(210, 520),
     [(30, R), (510, RS)], WATCH),
    ("relaxed, no PSI: stays relaxed (the safe side)", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 1000, full=None), [(30, R)], RELAXED),
    ("relaxed, the runtime rewrote memory.high: released", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 50) + [(55, 40 * MI, 96 * MI, 0.0)], [(30, R), (55, REL)], WATCH),
    ("restored, crawls again: relaxed again after a full window", DEFAULT,
     crawl(0, 30) + relaxed_calm(35, 335) + crawl(340, 370), [(30, R), (335, RS), (370, R)], RELAXED),
    ("short cool-down", GuardConfig(cooldown=20.0),
     crawl(0, 30) + relaxed_calm(35, 60), [(30, R), (55, RS)], WATCH),
    ("action none: reported once, cleared after the cool-down", GuardConfig(action=GuardAction.NONE),
     crawl(0, 100) + [(t, 40 * MI, HIGH, 1.0) for t in range(105, 420, 5)], [(30, REP), (405, CL)], WATCH),
    ("action none: still crawling, no second report", GuardConfig(action=GuardAction.NONE),
     crawl(0, 1000), [(30, REP)], REPORTED),
]


@pytest.mark.parametrize("name,cfg,series,expected,mode", TABLE, ids=[row[0] for row in TABLE])
def test_guard_table(name, cfg, series, expected, mode):
    got, state = run(series, cfg)
    assert got == expected
    assert state.mode == mode


def test_relax_writes_max_and_remembers_the_computed_value():
    samples = [Sample(float(t), HIGH, HIGH, 90.0, MAX) for t in range(0, 31, 5)]
    d = decide(samples, DEFAULT)
    assert d.verdict is Verdict.RELAX and d.write == "max"
    assert d.state == GuardState(RELAXED, 30.0, HIGH)
    assert "memory.pressure full avg10 >= 40%" in d.reason and "128.0MiB" in d.reason


def test_restore_writes_the_value_seen_before_relaxing():
    state = GuardState(RELAXED, 0.0, 50 * MI)
    samples = [Sample(float(t), 10 * MI, None, 0.0) for t in range(5, 400, 5)]
    d = decide(samples, DEFAULT, state)
    assert d.verdict is Verdict.RESTORE and d.write == str(50 * MI)
    assert d.state.mode == WATCH


def test_no_samples_and_no_psi():
    assert decide([], DEFAULT).verdict is Verdict.KEEP
    d = decide([Sample(0.0, HIGH, HIGH, None)], DEFAULT)
    assert d.verdict is Verdict.KEEP and "PSI" in d.reason


def test_samples_before_the_relaxation_do_not_count_as_calm():
    # calm samples older than the relaxation (a stale history) must not shorten the cool-down
    old_calm = [Sample(float(t), 10 * MI, None, 0.0) for t in range(0, 400, 5)]
    state = GuardState(RELAXED, 400.0, HIGH)
    d = decide(old_calm + [Sample(405.0, 10 * MI, None, 0.0)], DEFAULT, state)
    assert d.verdict is Verdict.KEEP
