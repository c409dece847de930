"""For every CreateContainer in the recorded kubelet traces: what the shim must produce, worked
out here from the trace's own facts with the reference's formulas (not from shim.decision,
which this module never imports), and checked against the replay's audit records and the
bytes the replay actually forwarded to the runtime.

Facts used per container: the sandbox's cgroup_parent (QoS class), memory_limit_in_bytes,
oom_score_adj, the kubelet's own `unified` (the MemoryQoS-on trace carries memory.min = the
request), the header's node capacity, page size and KubeletConfiguration (reservations,
memoryThrottlingFactor). The pods' true requests (tests/data/traces/README.md, manifests/)
are used only as a sanity check of the derived values, never as an input.
"""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest

from shim.cri import pb
from shim.evidence.trace import open_text
from memqos_dev.testing.traces import kubelet_traces

ROOT = Path(__file__).resolve().parents[1]
KUBELET_TRACES = kubelet_traces()

CREATE = "/runtime.v1.RuntimeService/CreateContainer"
MI = 2**20
NODE_SUFFIX = "-virtme-ng"  # static pod names carry the node name
# README / manifests: (pod, container) -> (true request, true limit, QoS class of the pod)
TRUTH = {
    ("qos-guaranteed", "main"): (64 * MI, 64 * MI, "Guaranteed"),
    ("qos-burstable-limit", "main"): (32 * MI, 128 * MI, "Burstable"),
    ("qos-burstable-nolimit", "main"): (32 * MI, 0, "Burstable"),
    ("qos-limit-only", "main"): (96 * MI, 96 * MI, "Burstable"),
    ("qos-besteffort", "main"): (0, 0, "BestEffort"),
    ("multi", "init"): (16 * MI, 0, "Burstable"),
    ("multi", "a"): (24 * MI, 64 * MI, "Burstable"),
    ("multi", "b"): (8 * MI, 0, "Burstable"),
}


def quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * mult
    return int(text)


def load(path: Path) -> tuple[dict, list[dict]]:
    with open_text(str(path)) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    return objs[0], objs[1:]


def expected_for(call: dict, header: dict) -> dict:
    """The reference's rules, applied to one recorded CreateContainer."""
    node = header["node"]
    kc = node["kubelet_config"]
    capacity = node["mem_total_bytes"]
    page = node["page_size"]
    alloc = capacity - quantity(kc["kubeReserved"]["memory"]) - quantity(kc["systemReserved"]["memory"])
    factor = kc.get("memoryThrottlingFactor", 0.9)

    req_msg = pb.CreateContainerRequest.FromString(base64.b64decode(call["request"]))
    sandbox = req_msg.sandbox_config
    res = req_msg.config.linux.resources
    limit = res.memory_limit_in_bytes
    adj = res.oom_score_adj
    kubelet_unified = dict(res.unified)

    parts = sandbox.linux.cgroup_parent.strip("/").split("/")
    qos = "BestEffort" if "besteffort" in parts else "Burstable" if "burstable" in parts else "Guaranteed"
    assert parts[0] == "kubepods" and parts[-1] == f"pod{sandbox.metadata.uid}"

    upper = None
    if qos == "BestEffort":
        request, source = 0, "none"
    elif int(kubelet_unified.get("memory.min", "0")) > 0:
        request, source = int(kubelet_unified["memory.min"]), "kubelet-unified"
    elif qos == "Guaranteed":
        request, source = limit, "guaranteed-limit"
    else:
        # adj = 1000 - 1000*req // capacity  =>  k*capacity/1000 <= req < (k+1)*capacity/1000
        assert 3 < adj < 999
        k = 1000 - adj
        request = -(-k * capacity // 1000)
        upper = -(-(k + 1) * capacity // 1000)
        if limit:
            request = min(request, limit)
        source = "oom-score-adj"

    unified = {k: v for k, v in kubelet_unified.items() if k not in ("memory.min", "memory.low", "memory.high")}
    if request > 0:
        # memory.min at most the limit less max(ceil(10% of it), 8Mi), page-rounded when capped;
        # memory.low then carries the request (docs/memory-qos.md, "Protection that never OOM-kills")
        cap = limit - max(math.ceil(limit * 0.1), 8 * MI) if limit > 0 else request
        if request <= cap:
            unified["memory.min"] = str(request)
        else:
            if cap // page * page > 0:
                unified["memory.min"] = str(cap // page * page)
            unified["memory.low"] = str(request)
    request_may_equal_limit = limit > 0 and (request == limit or (upper is not None and request <= limit < upper))
    if qos != "Guaranteed" and not request_may_equal_limit:
        ceiling = limit if limit > 0 else alloc
        high = math.floor(request + (ceiling - request) * factor)  # float64, like the kubelet
        high = high // page * page
        if high > request:
            unified["memory.high"] = str(high)
    return {
        "pod": f"{sandbox.metadata.namespace}/{sandbox.metadata.name}",
        "pod_uid": sandbox.metadata.uid,
        "container": req_msg.config.metadata.name,
        "container_id": pb.CreateContainerResponse.FromString(base64.b64decode(call["responses"][0])).container_id,
        "qos": qos,
        "request": request,
        "request_source": source,
        "limit": limit,
        "unified_before": kubelet_unified,
        "unified_after": unified,
    }


_cache: dict[str, object] = {}


def replayed(path: Path):
    if str(path) not in _cache:
        from shim.tools.replay import replay, replay_settings
        from shim.evidence.trace import read_trace

        trace = read_trace(str(path))
        _cache[str(path)] = replay(trace, replay_settings(trace.header))
    return _cache[str(path)]


def creates(path: Path):
    header, calls = load(path)
    return header, [c for c in calls if c["method"] == CREATE]


@pytest.mark.parametrize("path", KUBELET_TRACES, ids=lambda p: p.name)
def test_every_create_container_gets_the_values_worked_out_from_the_trace(path):
    header, calls = creates(path)
    assert len(calls) == 8
    result = replayed(path)
    assert result.problems == []
    by_seq = {r["seq"]: r for r in result.records}
    assert sorted(by_seq) == sorted(c["seq"] for c in calls)
    for call in calls:
        want = expected_for(call, header)
        got = by_seq[call["seq"]]
        assert {k: got[k] for k in want} == want, f"seq {call['seq']} {want['pod']}/{want['container']}"
        assert got["code"] == "OK"


@pytest.mark.parametrize("path", KUBELET_TRACES, ids=lambda p: p.name)
def test_the_runtime_received_those_values_and_nothing_else_changed(path):
    header, calls = creates(path)
    result = replayed(path)
    for call in calls:
        want = expected_for(call, header)
        original = pb.CreateContainerRequest.FromString(base64.b64decode(call["request"]))
        sent = pb.CreateContainerRequest.FromString(result.forwarded[call["seq"]])
        assert dict(sent.config.linux.resources.unified) == want["unified_after"]
        note = json.loads(sent.config.annotations.pop("memqos.io/request"))
        assert note["bytes"] == want["request"] and note["qos"] == want["qos"]
        sent.config.linux.resources.unified.clear()
        original.config.linux.resources.unified.clear()
        assert sent == original  # limits, oom_score_adj, sandbox config, ... untouched


@pytest.mark.parametrize("path", KUBELET_TRACES, ids=lambda p: p.name)
def test_derived_values_agree_with_the_pods_true_requests(path):
    header, calls = creates(path)
    seen = set()
    for call in calls:
        want = expected_for(call, header)
        pod = want["pod"].split("/", 1)[1]
        assert pod.endswith(NODE_SUFFIX)
        key = (pod[: -len(NODE_SUFFIX)], want["container"])
        true_request, true_limit, true_qos = TRUTH[key]
        seen.add(key)
        assert want["qos"] == true_qos and want["limit"] == true_limit
        # never protect more than the container asked for; at most 0.1% of capacity less
        assert want["request"] <= true_request
        assert true_request - want["request"] < header["node"]["mem_total_bytes"] // 1000
        if "memqos-on" in path.name:
            assert want["request"] == true_request
        if true_limit and true_request == true_limit or true_qos == "Guaranteed":
            assert "memory.high" not in want["unified_after"]
    assert seen == set(TRUTH)


def test_reference_formula_worked_examples():
    # memory-qos.md section 1, limit 1000Mi, page 1Mi: the arithmetic this module relies on
    def high(req, lim, f):
        return math.floor(req + (lim - req) * f) // MI * MI

    assert [high(r * MI, 1000 * MI, 0.9) // MI for r in (0, 100, 500, 800, 900)] == [900, 910, 950, 980, 990]
    assert high(500 * MI, 1000 * MI, 0.6) // MI == 800 and high(850 * MI, 1000 * MI, 0.8) // MI == 970
