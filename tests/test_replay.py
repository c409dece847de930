"""`memqos-shim replay`: every recorded trace (tests/data/traces) through the real proxy and hooks in front of the
trace-driven runtime; golden files; --expect; settings precedence; the runtime's matching."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from shim.cli.main import main
from shim.cri import pb
from shim.decision import Policy
from shim.evidence.trace import TraceCall, make_header, read_trace, trace_stem, write_trace
from shim.tools.replay import compare_records, drive, load_records, replay, replay_settings
from shim.tools.trace_runtime import TraceRuntime, normalized_request
from shim.cri.methods import CREATE_CONTAINER
from memqos_dev.testing.traces import MEMQOS_OFF as MEMQOS_OFF_STEM, MEMQOS_ON as MEMQOS_ON_STEM, SMOKE as SMOKE_STEM, TRACES_DIR, all_traces, trace_file

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
ALL_TRACES = all_traces()
SMOKE = trace_file(SMOKE_STEM)
MEMQOS_ON = trace_file(MEMQOS_ON_STEM)

_results: dict[str, object] = {}


def replayed(path: Path):
    """Each recorded trace is replayed once per test session."""
    key = str(path)
    if key not in _results:
        trace = read_trace(key)
        _results[key] = (trace, replay(trace, replay_settings(trace.header)))
    return _results[key]


def test_every_recorded_trace_is_covered_by_a_golden_file():
    assert len(ALL_TRACES) == 3, f"expected the three recorded traces in {TRACES_DIR}"
    assert {trace_stem(p.name) for p in ALL_TRACES} == {p.name[: -len(".replay.jsonl")] for p in GOLDEN.glob("*.replay.jsonl")}


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_recorded_trace_replays_without_error_and_matches_its_golden_file(path):
    trace, result = replayed(path)
    assert result.problems == []
    assert result.calls == len(trace.calls)
    # every call was answered by its own recorded call, and every request reached the runtime
    # exactly as recorded except for the shim's rewrites
    assert dict(result.matched_by) == {"seq": len(trace.calls)}
    creates = [c for c in trace.calls if c.method == CREATE_CONTAINER]
    assert sorted(result.forwarded) == sorted(c.seq for c in creates)
    assert len(result.records) == len(creates)
    assert [r["seq"] for r in result.records] == [c.seq for c in trace.in_start_order() if c.method == CREATE_CONTAINER]
    golden = load_records(str(GOLDEN / f"{trace_stem(path.name)}.replay.jsonl"))
    assert compare_records(golden, result.records) == []


def test_unknown_methods_replay_with_their_recorded_answers():
    trace, result = replayed(SMOKE)
    methods = {c.method for c in trace.calls}
    assert {"/runtime.v1alpha2.RuntimeService/Version", "/runtime.v1.RuntimeService/NoSuch"} <= methods
    assert {c.code for c in trace.calls} >= {"NOT_FOUND", "UNIMPLEMENTED"}
    assert result.problems == []  # NOT_FOUND / UNIMPLEMENTED came back with the recorded details


def test_records_carry_the_fields_operators_need():
    _, result = replayed(MEMQOS_ON)
    for r in result.records:
        for key in ("method", "pod", "container", "qos", "request", "request_source", "limit",
                    "unified_before", "unified_after"):
            assert key in r, key
        assert "/" in r["pod"] and isinstance(r["request"], int) and isinstance(r["limit"], int)


# ----------------------------------------------------------------------- the CLI


@pytest.fixture
def small_on(tmp_path) -> Path:
    """The memqos-on trace without the polling calls (fast; same records, as they depend only
    on the lifecycle calls)."""
    from shim.evidence.recorder import MethodFilter

    trace = read_trace(str(MEMQOS_ON))
    keep = MethodFilter(None)
    path = tmp_path / f"{MEMQOS_ON_STEM}.jsonl"
    write_trace(str(path), trace.header.raw, [c for c in trace.calls if keep(c.method)])
    return path


def test_cli_json_and_expect(tmp_path, capsys, small_on):
    golden = GOLDEN / f"{MEMQOS_ON_STEM}.replay.jsonl"
    assert main(["replay", str(small_on), "--json", "--expect", str(golden)]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines()] == load_records(str(golden))
    assert "same as" in err

    changed = load_records(str(golden))
    changed[2]["unified_after"]["memory.high"] = "1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in changed))
    assert main(["replay", str(small_on), "--json", "--expect", str(bad)]) == 1
    _, err = capsys.readouterr()
    assert "DIFFERS" in err and "unified_after" in err


def test_cli_flags_override_the_header(capsys, small_on):
    golden = GOLDEN / f"{MEMQOS_ON_STEM}.replay.jsonl"
    assert main(["replay", str(small_on), "--json", "--factor", "0.5", "--expect", str(golden)]) == 1
    out, _ = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert {r["factor"] for r in records} == {0.5}


def test_cli_config_file_and_table(tmp_path, capsys, small_on):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("policy: TieredReservation\nlisten: unix:///ignored.sock\n")  # a serve config file is accepted
    assert main(["replay", str(small_on), "--config", str(cfg)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:4] == ["SEQ", "METHOD", "EVENT", "POD"]
    assert "default/qos-burstable-limit-virtme-ng" in out and "memory.low=33554432" in out
    assert f"policy TieredReservation (--config {cfg})" in err


def test_cli_rejects_a_missing_trace(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------- settings


def _header(**shim):
    h = make_header(source="t", mem_total_bytes=2060419072, page_size=4096, cgroup_driver="cgroupfs",
                    kubelet_config={"kubeReserved": {"memory": "100Mi"}, "systemReserved": {"memory": "100Mi"},
                                    "memoryThrottlingFactor": 0.8})
    if shim:
        h["shim"] = shim
    from shim.evidence.trace import TraceHeader

    return TraceHeader(h)


def test_settings_precedence():
    s = replay_settings(_header())
    assert (s.node.capacity, s.node.allocatable, s.node.factor, s.node.page_size, s.policy) == (
        2060419072, 1850703872, 0.8, 4096, Policy.HARD)
    s = replay_settings(_header(allocatable=10**9, factor=None, policy="tiered", enabled=False))
    assert (s.node.allocatable, s.node.factor, s.policy, s.enabled) == (10**9, None, Policy.TIERED_RESERVATION, False)
    s = replay_settings(_header(allocatable=10**9, factor=None), factor=0.7, allocatable=5 * 10**8,
                        page_size=65536, policy=Policy.NONE)
    assert (s.node.allocatable, s.node.factor, s.node.page_size, s.policy) == (5 * 10**8, 0.7, 65536, Policy.NONE)
    s = replay_settings(_header(allocatable=10**9), mem_total=4 * 2**30)  # new capacity: recompute
    assert s.node.allocatable == 4 * 2**30 - 200 * 2**20


def test_a_recording_made_with_injection_off_replays_to_no_records(tmp_path, small_on):
    trace = read_trace(str(small_on))
    header = dict(trace.header.raw, shim={"enabled": False})
    path = tmp_path / "off.jsonl"
    write_trace(str(path), header, trace.calls)
    assert len(trace.calls) < 100
    t = read_trace(str(path))
    result = replay(t, replay_settings(t.header))
    assert result.problems == [] and result.records == []


# ----------------------------------------------------------------------- the trace runtime


def _run(coro):
    return asyncio.run(coro)


async def _against_runtime(calls, sent, tag_seq=False):
    sockets = tempfile.mkdtemp(prefix="mq-")
    runtime = TraceRuntime(calls)
    try:
        await runtime.start(f"{sockets}/rt.sock")
        outcomes = await drive(runtime.endpoint, sent, tag_seq=tag_seq)
    finally:
        await runtime.stop(None)
        shutil.rmtree(sockets, ignore_errors=True)
    return runtime, outcomes


def test_runtime_alone_answers_a_whole_trace_by_request_bytes():
    trace = read_trace(str(trace_file(MEMQOS_OFF_STEM)))
    runtime, outcomes = _run(_against_runtime(trace.calls, trace.in_start_order()))
    assert [o.problem() for o in outcomes if o.problem()] == []
    assert {a.matched_by for a in runtime.answered} == {"bytes"}
    assert runtime.unused() == []


def _call(seq, method, request, responses=(b"",), code="OK", details="", forwarded=None, start=None):
    return TraceCall(seq, float(start if start is not None else seq), 1.0, method, request, forwarded,
                     list(responses), code, details)


def test_runtime_matching_rules_and_misses():
    from shim.tools.kubelet_requests import create_container, sandbox_config

    status = "/runtime.v1.RuntimeService/ContainerStatus"
    req = create_container("s1", sandbox_config("p", "0a1b", "burstable"), "main", "burstable",
                           request=2**25, limit=2**27)
    original = req.SerializeToString()
    rewritten_msg = pb.CreateContainerRequest.FromString(original)
    rewritten_msg.config.linux.resources.unified["memory.min"] = "33554432"
    rewritten_msg.config.annotations["memqos.io/request"] = "{}"
    rewritten = rewritten_msg.SerializeToString()
    assert normalized_request(CREATE_CONTAINER, rewritten) == normalized_request(CREATE_CONTAINER, original)

    calls = [
        _call(1, status, b"\x0a\x01a", [b"\x0a\x00"]),
        _call(2, status, b"\x0a\x01a", [], "NOT_FOUND", "not found"),
        _call(3, CREATE_CONTAINER, original, [pb.CreateContainerResponse(container_id="c9").SerializeToString()]),
        _call(4, "/runtime.v1alpha2.RuntimeService/Version", b"", [b"\x0a\x03abc"]),
    ]
    sent = [
        calls[0],
        calls[1],
        _call(3, CREATE_CONTAINER, rewritten),  # what a shim forwards: matched apart from shim-owned fields
        calls[3],
        _call(5, status, b"\x0a\x01z"),  # nothing left for this method
    ]
    runtime, outcomes = _run(_against_runtime(calls, sent))
    assert [a.matched_by for a in runtime.answered] == ["bytes", "bytes", "normalized", "bytes", "miss"]
    assert outcomes[1].code == "NOT_FOUND" and outcomes[1].details == "not found"
    assert pb.CreateContainerResponse.FromString(outcomes[2].responses[0]).container_id == "c9"
    assert outcomes[3].responses == [b"\x0a\x03abc"]
    assert outcomes[4].code == "FAILED_PRECONDITION" and len(runtime.misses) == 1
    assert runtime.mismatches == []


def test_runtime_reports_a_request_that_differs_from_the_recorded_one():
    status = "/runtime.v1.RuntimeService/ContainerStatus"
    calls = [_call(1, status, b"\x0a\x01a", [b"\x0a\x00"])]
    runtime, outcomes = _run(_against_runtime(calls, [_call(1, status, b"\x0a\x01b")], tag_seq=True))
    assert runtime.answered[0].matched_by == "seq" and outcomes[0].code == "OK"
    assert len(runtime.mismatches) == 1


def test_streams_failures_and_unknown_streaming_methods_replay(tmp_path):
    events = "/runtime.v1.RuntimeService/GetContainerEvents"
    calls = [
        _call(1, events, b"", [pb.ContainerEventResponse(container_id=f"c{i}").SerializeToString() for i in range(3)]),
        _call(2, events, b"", [], "CANCELLED"),
        _call(3, "/runtime.v1.RuntimeService/ExecSync", b"\x0a\x01c", [], "DEADLINE_EXCEEDED", "Deadline Exceeded"),
        _call(4, "/runtime.v1.RuntimeService/Version", b"", [], "UNAVAILABLE", "connection refused"),
        _call(5, "/runtime.v1alpha2.RuntimeService/ListThings", b"\x0a\x01c", [b"\x0a\x01a", b"\x0a\x01b"]),
    ]
    path = tmp_path / "synthetic.jsonl"
    write_trace(str(path), make_header(source="synthetic", mem_total_bytes=2**30, page_size=4096,
                                       cgroup_driver="cgroupfs", kubelet_config={}), calls)
    trace = read_trace(str(path))
    result = replay(trace, replay_settings(trace.header))
    assert result.problems == [] and dict(result.matched_by) == {"seq": 5} and result.records == []
