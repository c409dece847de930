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


def test_the_back_to_back_create_is_a_4_kb_create_the_shim_rewrites():
    from shim.app.service import build_container_qos
    from shim.cri.methods import CREATE_CONTAINER
    from shim.decision import Policy
    from shim.node.facts import load_kubelet_config, node_facts
    from shim.tools.kubelet_requests import sandbox_config
    from shim.transport.hooks import RpcCall
    from memqos_dev.tools.bench.workload import BACK_TO_BACK_BYTES, kubelet_sized_create

    sandbox = sandbox_config("web", "1f0c2a9e-0000-4000-8000-000000000005", "burstable")
    request = kubelet_sized_create("s" * 64, sandbox, "app").SerializeToString()
    assert BACK_TO_BACK_BYTES <= len(request) < BACK_TO_BACK_BYTES + 400
    node = node_facts(16 << 30, load_kubelet_config(None), page_size=4096, allocatable=None, factor="auto")
    records = []
    qos = build_container_qos(node, Policy.HARD, records.append)
    call = RpcCall(CREATE_CONTAINER, 0.0, request=request)
    assert qos.rewrite(call) != request
    assert call.rewritten.decision.changed


def test_bench_back_to_back_alone_runs_end_to_end():
    """`scripts/bench --only back-to-back`: fresh processes, both kinds of call back to back
    against direct and the relay, the table's rows for them and nothing else measured."""
    from memqos_dev.tools.bench.report import table
    from memqos_dev.tools.bench.run import one_run
    from memqos_dev.tools.bench.workload import Sizes

    sizes = Sizes(runs=1, back_to_back=6, back_to_back_block=3, replay_pods=2)
    m = one_run(sizes, None, lambda msg: None, ("back-to-back",))
    relay = m["relay"]
    for key in ("b2b_create_p50_us", "b2b_passthrough_p50_us", "added_b2b_create_p50_us", "b2b_added_ratio",
                "b2b_cpu_ms_per_create", "b2b_cpu_ms_per_passthrough"):
        assert key in relay, key
    assert relay["b2b_cpu_ms_per_create"] >= 0 and m["direct"]["b2b_request_bytes"] >= 4096
    assert "small_p50_us" not in relay and "rss_defaults_mib" not in relay
    text = table({"median": m})
    assert "back to back: ~4 KB CreateContainer p50 (rewritten)" in text
    assert "small call p50" not in text
