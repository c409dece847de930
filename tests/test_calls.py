"""The call object the hooks share, and the typed events made from finished calls."""
from __future__ import annotations

import dataclasses

import pytest

from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.events import ContainerCreated, ContainerResourcesUpdated, OBSERVED_METHODS, call_event
from shim.cri.methods import CREATE_CONTAINER, RUN_POD_SANDBOX, UPDATE_CONTAINER_RESOURCES
from shim.decision import Decision, NodeFacts, Policy
from shim.evidence.trace import read_trace
from shim.node.state import NodeState
from memqos_dev.testing.traces import all_traces
from shim.tools.replay import replay_settings
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import MI, create_container, sandbox_config

NODE = NodeFacts(capacity=16 * 1024 * MI, allocatable=15 * 1024 * MI, factor=0.8, page_size=4096)
TRACES = all_traces()


def qos_hooks():
    records: list[dict] = []
    return ContainerMemoryQoS(NODE, Policy.HARD, records.append), records


def create_request() -> bytes:
    cfg = sandbox_config("web", "u1", "Burstable")
    return create_container("s1", cfg, "app", "Burstable", request=512 * MI, limit=1024 * MI).SerializeToString()


def test_finished_gets_the_call_rewrite_saw_not_a_record_found_by_its_bytes():
    """Two identical CreateContainer requests in flight: each call carries its own decision and
    record; one the transport never gave to rewrite() leaves no record, even with the same bytes."""
    hooks, records = qos_hooks()
    req = create_request()
    a, b, skipped = (RpcCall(CREATE_CONTAINER, 1.0, request=req) for _ in range(3))
    out_a, out_b = hooks.rewrite(a), hooks.rewrite(b)
    assert out_a == out_b != req
    a_, b_ = a.rewritten, b.rewritten
    assert isinstance(a_.decision, Decision) and a_.decision is not b_.decision
    assert a_.parsed is not b_.parsed and a_.memo is not b_.memo
    # finished in another order than rewritten, and one call that was never rewritten
    hooks.finished(skipped.complete(1.0, None, [], "UNAVAILABLE", "down"))
    assert records == []
    hooks.finished(b.complete(2.0, out_b, [pb.CreateContainerResponse(container_id="cb").SerializeToString()],
                              "OK", ""))
    hooks.finished(a.complete(3.0, out_a, [], "DEADLINE_EXCEEDED", "late"))
    assert [(r["code"], r.get("container_id"), r.get("details")) for r in records] == [
        ("OK", "cb", None), ("DEADLINE_EXCEEDED", None, "late")]
    assert set(hooks.containers) == {"cb"} and hooks.containers["cb"] is b.rewritten.memo


def test_the_rewriter_declares_the_methods_it_holds():
    assert ContainerMemoryQoS.held_methods == {CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES}


def test_fail_open_record_travels_on_the_call():
    hooks, records = qos_hooks()
    call = RpcCall(CREATE_CONTAINER, 1.0, request=b"\xff\xff not protobuf")
    assert hooks.rewrite(call) is call.request
    assert call.rewritten.parsed is None and call.rewritten.decision is None
    hooks.finished(call.complete(1.0, None, [], "OK", ""))
    assert [r["event"] for r in records] == ["fail-open"]


def _state(s: NodeState) -> dict:
    return {
        uid: {
            "pod": (p.namespace, p.name, dict(p.annotations)),
            "sandboxes": {k: dataclasses.asdict(v) for k, v in p.sandboxes.items()},
            "containers": {k: dataclasses.asdict(v) for k, v in p.containers.items()},
            "request": s.request(p),
        }
        for uid, p in s.pods.items()
    }


def _bytes_only(call: RpcCall) -> RpcCall:
    return RpcCall(call.method, call.start, call.duration_ms, call.request, call.forwarded, call.responses,
                   call.code, call.details, call.truncated)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_events_reuse_what_the_rewriter_parsed_and_match_parsing_again(path):
    """Recorded calls through the rewriter: the events made from its parsed messages (as sent)
    and its decision equal the events parsed from the bytes alone, and so does the node state."""
    trace = read_trace(str(path))
    settings = replay_settings(trace.header)
    hooks = ContainerMemoryQoS(settings.node, settings.policy, lambda r: None)
    reused, parsed = NodeState(settings.node.capacity), NodeState(settings.node.capacity)
    seen = {ContainerCreated: 0, ContainerResourcesUpdated: 0}
    for tc in trace.in_start_order():
        call = RpcCall(tc.method, tc.start, request=tc.request)
        forwarded = None
        if tc.method in hooks.held_methods:
            out = hooks.rewrite(call)
            forwarded = out if out != tc.request else None
        call.complete(tc.duration_ms, forwarded, tc.responses, tc.code, tc.details, tc.truncated)
        plain = _bytes_only(call)
        if call.method not in OBSERVED_METHODS:
            assert call_event(call) is None
            continue
        event = call_event(call)
        assert event == call_event(plain)
        if type(event) in seen:
            seen[type(event)] += call.rewritten is not None and call.rewritten.parsed is not None
        if event is not None:
            reused.apply(event)
        parsed.apply_call(plain)
        hooks.finished(call)
    assert _state(reused) == _state(parsed)
    creates = [c for c in trace.calls if c.method == CREATE_CONTAINER and c.code == "OK"]
    assert seen[ContainerCreated] == len(creates)
    if creates:
        assert any(p.containers for p in reused.pods.values())


def test_run_pod_sandbox_event_carries_the_pod_and_its_overhead():
    cfg = sandbox_config("web", "u1", "Burstable")
    cfg.linux.overhead.memory_limit_in_bytes = 64 * MI
    call = RpcCall(RUN_POD_SANDBOX, 1.0, 2.0, pb.RunPodSandboxRequest(config=cfg).SerializeToString(), None,
                   [pb.RunPodSandboxResponse(pod_sandbox_id="s1").SerializeToString()])
    e = call_event(call)
    assert (e.sandbox_id, e.pod.uid, e.pod.cgroup_parent, e.overhead) == ("s1", "u1", cfg.linux.cgroup_parent,
                                                                         64 * MI)
    call.code = "UNAVAILABLE"
    assert call_event(call) is None
