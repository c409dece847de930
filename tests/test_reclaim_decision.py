"""Proactive reclaim's decision (shim.decision.reclaim): samples in, bytes to reclaim (or
nothing) out, always with the reason.

Each row of TABLE feeds samples one at a time through decide(), carrying the state as the
monitor does, and lists every RECLAIM as (sample time, MiB asked), plus a fragment the last
decision's reason must contain."""
from __future__ import annotations

import pytest

from shim.decision.reclaim import (
    ReclaimConfig,
    ReclaimState,
    Sample,
    Verdict,
    after_write,
    decide,
)

MI = 2**20
HIGH = 100 * MI  # headroom 10 MiB (10 %), reclaim above 90 MiB, target 85 MiB


def stat(file=60 * MI, anon=30 * MI, refaults=0, shmem=0, mapped=0, dirty=0, writeback=0, refaults_anon=0):
    return {"file": file, "anon": anon, "shmem": shmem, "file_mapped": mapped, "file_dirty": dirty,
            "file_writeback": writeback, "workingset_refault_file": refaults, "workingset_refault_anon": refaults_anon}


def s(t, current, *, high=HIGH, some=0.0, mn=16 * MI, low=0, qos="Burstable", **kw):
    st = kw.pop("st", None)
    return Sample(t=float(t), current=current, high=high, min=mn, low=low, some_avg10=some, full_avg10=0.0,
                  stat=st if st is not None else stat(**kw), qos=qos)


def steady(t0, t1, current, step=5, **kw):
    return [s(t, current, **kw) for t in range(t0, t1 + 1, step)]


def run(series, cfg: ReclaimConfig, state: ReclaimState = ReclaimState()):
    samples, out, d = [], [], None
    for sample in series:
        samples.append(sample)
        d = decide(samples, cfg, state)
        if d.verdict is Verdict.RECLAIM:
            out.append((int(sample.t), round(d.bytes / MI, 2)))
        state = d.state
    return out, d


DEFAULT = ReclaimConfig()
TABLE = [
    # name, config, series, expected (t, MiB asked) of every RECLAIM, fragment of the last reason
    ("below the headroom: nothing", DEFAULT, steady(0, 20, 89 * MI), [], "below memory.high - headroom"),
    ("exactly at high - headroom: nothing", DEFAULT, steady(0, 20, 90 * MI), [], "below memory.high - headroom"),
    ("first sample above: waits for a refault comparison", DEFAULT, [s(0, 95 * MI)], [], "first sample"),
    ("within the headroom: back to the target (95 -> 85 MiB)", DEFAULT, steady(0, 5, 95 * MI),
     [(5, 10.0)], "bounded by back to 85.0MiB"),
    ("every interval while it stays there", DEFAULT, steady(0, 15, 95 * MI),
     [(5, 10.0), (10, 10.0), (15, 10.0)], "asking 10.0MiB"),
    ("bounded by the step", ReclaimConfig(step_bytes=4 * MI), steady(0, 5, 99 * MI), [(5, 4.0)], "the step 4.0MiB"),
    ("bounded by the reclaimable cache", DEFAULT, steady(0, 5, 99 * MI, file=5 * MI, anon=90 * MI),
     [(5, 5.0)], "the reclaimable page cache 5.0MiB"),
    ("shmem, mapped, dirty and writeback pages are not reclaimable", DEFAULT,
     steady(0, 5, 99 * MI, file=20 * MI, shmem=6 * MI, mapped=4 * MI, dirty=3 * MI, writeback=1 * MI),
     [(5, 6.0)], "the reclaimable page cache 6.0MiB"),
    ("anon-only container: left alone, says why", DEFAULT, steady(0, 30, 99 * MI, file=512 * 1024, anon=98 * MI),
     [], "anon-only"),
    ("tmpfs cache (shmem) counts as not reclaimable", DEFAULT,
     steady(0, 30, 99 * MI, file=80 * MI, shmem=80 * MI, anon=10 * MI), [], "nothing worth reclaiming"),
    ("Guaranteed: never, says why", DEFAULT, steady(0, 30, 99 * MI, qos="Guaranteed"), [], "Guaranteed"),
    ("memory.high max: never", DEFAULT, steady(0, 30, 99 * MI, high=None), [], "memory.high is max"),
    ("never below memory.min", DEFAULT, steady(0, 5, 95 * MI, mn=92 * MI), [(5, 3.0)], "protection floor 92.0MiB"),
    ("never below memory.low either", DEFAULT, steady(0, 5, 95 * MI, mn=0, low=93 * MI), [(5, 2.0)],
     "protection floor 93.0MiB"),
    ("at memory.min: nothing", DEFAULT, steady(0, 10, 95 * MI, mn=95 * MI), [], "at its protection"),
    ("PSI some at the target: nothing (the container already stalls)", DEFAULT,
     steady(0, 20, 95 * MI, some=10.0), [], "already stalls"),
    ("PSI some just below the target: reclaim", DEFAULT, steady(0, 5, 95 * MI, some=9.9), [(5, 10.0)], "9.9%"),
    ("no PSI reading: nothing", DEFAULT,
     [Sample(float(t), 95 * MI, HIGH, 0, 0, None, None, stat(), "Burstable") for t in (0, 5, 10)], [], "no PSI"),
    ("memory.stat unread: nothing", DEFAULT,
     [Sample(float(t), 95 * MI, HIGH, 0, 0, 0.0, 0.0, None, "Burstable") for t in (0, 5, 10)], [],
     "memory.stat unreadable"),
    ("pressure after the shim's reclaim: back-off, then again after it", ReclaimConfig(backoff=20.0),
     steady(0, 5, 95 * MI) + [s(10, 95 * MI, some=25.0)] + steady(15, 30, 95 * MI) + steady(35, 40, 95 * MI),
     [(5, 10.0), (30, 10.0), (35, 10.0), (40, 10.0)], "asking 10.0MiB"),
    ("while backing off: says so", ReclaimConfig(backoff=20.0),
     steady(0, 5, 95 * MI) + [s(10, 95 * MI, some=25.0)] + steady(15, 25, 95 * MI), [(5, 10.0)], "backing off for 5 s more"),
    ("refaults grow: the cache is the working set, back off", ReclaimConfig(backoff=60.0),
     [s(0, 95 * MI, refaults=0), s(5, 95 * MI, refaults=0), s(10, 95 * MI, refaults=4 * MI),
      s(15, 95 * MI, refaults=4 * MI)], [(5, 10.0)], "backing off"),
    ("refault back-off reason", DEFAULT,
     [s(0, 95 * MI, refaults=0), s(5, 95 * MI, refaults=0, refaults_anon=3 * MI)], [], "working set"),
    ("refaults within the tolerance: go on", DEFAULT,
     [s(0, 95 * MI, refaults=0), s(5, 95 * MI, refaults=MI // 2), s(10, 95 * MI, refaults=MI)],
     [(5, 10.0), (10, 10.0)], "asking"),
    ("rate budget: 16 MiB/s x 5 s burst, then what 1 s earns", ReclaimConfig(step_bytes=128 * MI, target_factor=10.0),
     [s(t, 99 * MI, file=90 * MI, anon=5 * MI, mn=0) for t in (0, 1, 2, 3)], [(1, 80.0), (2, 16.0), (3, 16.0)],
     "the rate budget"),
    ("gap longer than max_gap: refaults not compared, waits", ReclaimConfig(max_gap=15.0),
     [s(0, 95 * MI), s(30, 95 * MI), s(35, 95 * MI)], [(35, 10.0)], "asking"),
    ("small memory.high: headroom capped at half", DEFAULT, steady(0, 5, 12 * MI, high=12 * MI, mn=0),
     [(5, 9.0)], "back to 3.0MiB"),
]


@pytest.mark.parametrize("name,cfg,series,expected,reason", TABLE, ids=[row[0] for row in TABLE])
def test_reclaim_table(name, cfg, series, expected, reason):
    got, last = run(series, cfg)
    assert got == expected
    assert reason in last.reason, last.reason


def test_reclaim_decision_fields():
    d = decide([s(0, 95 * MI), s(5, 95 * MI)], DEFAULT)
    assert d.verdict is Verdict.RECLAIM and d.bytes == 10 * MI
    assert d.state.last_reclaim == 5.0 and d.state.tokens == 80 * MI - 10 * MI
    assert "some avg10 0.0%" in d.reason


def test_no_samples():
    assert decide([], DEFAULT).verdict is Verdict.KEEP


def test_pressure_without_recent_reclaim_does_not_start_a_back_off():
    d = decide([s(0, 95 * MI, some=30.0), s(5, 95 * MI, some=30.0)], DEFAULT)
    assert d.verdict is Verdict.KEEP and not d.backoff and d.state.backoff_until is None


def test_fruitless_eagain_backs_off_and_a_partial_one_does_not():
    st = ReclaimState(last_reclaim=5.0)
    assert after_write(st, 5.0, 10 * MI, 6 * MI, True, DEFAULT) == st
    backed = after_write(st, 5.0, 10 * MI, 0, True, DEFAULT)
    assert backed.backoff_until == 65.0 and "EAGAIN" in backed.backoff_reason
    assert after_write(st, 5.0, 10 * MI, 0, False, DEFAULT) == st
    d = decide([s(0, 95 * MI), s(10, 95 * MI)], DEFAULT, backed)
    assert d.verdict is Verdict.KEEP and "EAGAIN" in d.reason
