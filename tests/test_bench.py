"""scripts/bench: what it reads."""
import pytest


def test_the_110_pod_load_takes_its_call_mix_from_the_in_repo_trace():
    """The bench's default trace is the compressed kubelet recording in tests/data/traces; its
    steady-state rates are close to what BUILTIN_RATES restates (those were taken over seconds
    25-100 of the same recording; the bench takes the whole steady state)."""
    from memqos_dev.tools.bench.workload import BUILTIN_RATES, DEFAULT_TRACE, steady_rates, trace_calls

    assert DEFAULT_TRACE.is_file() and DEFAULT_TRACE.name.endswith(".jsonl.xz")
    rates = steady_rates(trace_calls(DEFAULT_TRACE))
    assert set(rates) == set(BUILTIN_RATES)
    for name, rate in BUILTIN_RATES.items():
        assert rates[name] == pytest.approx(rate, rel=0.15, abs=0.01), name
