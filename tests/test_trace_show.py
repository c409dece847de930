"""`memqos-shim trace show` decodes every method present in the recorded traces."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shim.cli.main import main
from shim.evidence.trace import TraceCall, make_header, read_trace, write_trace
from memqos_dev.testing.traces import MEMQOS_ON, SMOKE, all_traces, trace_file

ROOT = Path(__file__).resolve().parents[1]
ALL_TRACES = all_traces()
NO_PROTO = {"/runtime.v1.RuntimeService/NoSuch"}  # a method that does not exist


def json_stream(text: str) -> list:
    decoder = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def no_errors(obj) -> bool:
    if isinstance(obj, dict):
        return "_error" not in obj and "_undecoded_base64" not in obj and all(no_errors(v) for v in obj.values())
    if isinstance(obj, list):
        return all(no_errors(v) for v in obj)
    return True


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_every_call_of_every_method_is_decoded(path, capsys):
    assert main(["trace", "show", str(path)]) == 0
    out, err = capsys.readouterr()
    values = json_stream(out)
    trace = read_trace(str(path))
    assert values[0]["header"]["format"] == "cri-trace"
    calls = values[1:]
    assert len(calls) == len(trace.calls) and f"{len(trace.calls)} of {len(trace.calls)}" in err
    assert {c["method"] for c in calls} == set(trace.methods())
    for c in calls:
        if c["method"] in NO_PROTO:
            assert c["decoded_as"] is None and "request_base64" in c
            continue
        assert c["decoded_as"] and isinstance(c["request"], dict), c["method"]
        assert len(c["responses"]) == len(next(t for t in trace.calls if t.seq == c["seq"]).responses)
        assert no_errors(c), (c["seq"], c["method"])
        assert "_unknown_fields" not in json.dumps(c), (c["seq"], c["method"])


def test_method_filter_and_readable_create_container(capsys):
    path = trace_file(MEMQOS_ON)
    assert main(["trace", "show", str(path), "--method", "CreateContainer$", "--no-header"]) == 0
    calls = json_stream(capsys.readouterr().out)
    assert len(calls) == 8 and {c["method"] for c in calls} == {"/runtime.v1.RuntimeService/CreateContainer"}
    first = calls[0]
    res = first["request"]["config"]["linux"]["resources"]
    assert first["request"]["config"]["metadata"]["name"] in ("init", "main", "a", "b")
    assert "memory.min" in res["unified"] and "oom_score_adj" in res
    assert first["request"]["sandbox_config"]["linux"]["cgroup_parent"].startswith("/kubepods")
    assert len(first["responses"][0]["container_id"]) == 64


def test_v1alpha2_is_decoded_with_the_v1_types_and_says_so(capsys):
    assert main(["trace", "show", str(trace_file(SMOKE)), "--method", "v1alpha2", "--compact"]) == 0
    (header, call) = json_stream(capsys.readouterr().out)
    assert "v1alpha2" in call["decoded_as"] and call["responses"][0]["runtime_api_version"] == "v1alpha2"


def test_forwarded_and_unknown_fields_are_shown(tmp_path, capsys):
    from shim.cri import pb

    req = pb.ContainerStatusRequest(container_id="c1").SerializeToString()
    fwd = pb.ContainerStatusRequest(container_id="c1", verbose=True).SerializeToString()
    resp = pb.ContainerStatusResponse().SerializeToString() + b"\xc2\x3e\x02hi"  # field 1000, unknown
    path = tmp_path / "t.jsonl"
    write_trace(str(path), make_header(source="t", mem_total_bytes=1, page_size=4096, cgroup_driver="cgroupfs",
                                       kubelet_config={}),
                [TraceCall(1, 1.0, 0.1, "/runtime.v1.RuntimeService/ContainerStatus", req, fwd, [resp], "OK", ""),
                 TraceCall(2, 2.0, 0.1, "/runtime.v1.RuntimeService/Version", b"\xff\xff", None, [], "INTERNAL", "x")])
    assert main(["trace", "show", str(path), "--seq", "1-2", "--no-header"]) == 0
    one, two = json_stream(capsys.readouterr().out)
    assert one["request"] == {"container_id": "c1"} and one["forwarded"]["verbose"] is True
    assert one["responses"][0]["_unknown_fields"] == [{"path": ".", "field": 1000, "wire_type": 2}]
    assert "_error" in two["request"] and two["code"] == "INTERNAL" and two["details"] == "x"


def test_unreadable_trace_is_a_usage_error(tmp_path, capsys):
    p = tmp_path / "x.jsonl"
    p.write_text("{}\n")
    assert main(["trace", "show", str(p)]) == 2
    assert "not a cri-trace header" in capsys.readouterr().err
