"""The rewrite hooks on their own (no sockets): parsing, fail-open, memory for updates."""
from __future__ import annotations

import json

import pytest

from shim.container.rewriter import ContainerMemoryQoS, container_note
from shim.cri import pb
from shim.decision import NodeFacts, Policy
from shim.cri.methods import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import MI, create_container, sandbox_config, update_resources

NODE = NodeFacts(capacity=2060419072, allocatable=1850703872, page_size=4096, factor=0.9)


def run(hooks, method, request: bytes, response: bytes = b"", code="OK"):
    call = RpcCall(method, 0.0, request=request)
    forwarded = hooks.rewrite(call)
    hooks.finished(call.complete(0.1, forwarded if forwarded != request else None,
                                 [response] if code == "OK" else [], code, ""))
    return forwarded


def test_garbage_is_forwarded_unchanged_with_a_fail_open_record():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    garbage = b"\xff\xff\xff\xff not protobuf"
    assert run(hooks, CREATE_CONTAINER, garbage) is garbage
    assert records[0]["event"] == "fail-open"
    assert "DecodeError" in records[0]["error"]


def test_disabled_on_cgroup_v1_passes_through_without_records():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append, enabled=False, disabled_reason="v1")
    req = create_container("s1", sandbox_config("p", "0a1b", "burstable"), "main", "burstable",
                           request=32 * MI, limit=128 * MI).SerializeToString()
    assert run(hooks, CREATE_CONTAINER, req) is req
    assert records == []


def test_update_uses_pod_facts_remembered_at_creation():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    sb = sandbox_config("p", "0a1b", "burstable", annotations={"memqos.io/requests": '{"main": "32Mi"}'})
    req = create_container("s1", sb, "main", "burstable", request=32 * MI, limit=128 * MI)
    run(hooks, CREATE_CONTAINER, req.SerializeToString(),
        pb.CreateContainerResponse(container_id="c1").SerializeToString())
    assert records[0]["container_id"] == "c1" and records[0]["request_source"] == "annotation"

    upd = update_resources("c1", limit=256 * MI, oom_score_adj=984, unified={"memory.high": "max"})
    out = pb.UpdateContainerResourcesRequest.FromString(run(hooks, UPDATE_CONTAINER_RESOURCES, upd.SerializeToString()))
    high = ((32 * MI) + int((256 * MI - 32 * MI) * 0.9)) // 4096 * 4096
    assert dict(out.linux.unified) == {"memory.min": str(32 * MI), "memory.high": str(high), "memory.low": "0"}
    rec = records[1]
    assert rec["pod"] == "default/p" and rec["container"] == "main" and rec["request_remembered"] is True
    assert rec["unified_before"] == {"memory.high": "max"}


def test_update_of_unknown_container_still_decides_from_the_update():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    upd = update_resources("unknown", limit=64 * MI, oom_score_adj=-997)
    out = pb.UpdateContainerResourcesRequest.FromString(run(hooks, UPDATE_CONTAINER_RESOURCES, upd.SerializeToString()))
    assert dict(out.linux.unified) == {"memory.min": str(56 * MI), "memory.low": str(64 * MI),
                                      "memory.high": "max"}  # memory.min 8Mi under the limit
    assert "not seen at creation" in records[0]["note"]


def test_update_to_request_equal_limit_resets_memory_high():
    """containerd merges an update's unified into the container's: a memory.high that no
    longer applies must be sent as "max", not left out."""
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    sb = sandbox_config("p", "0a1b", "burstable", annotations={"memqos.io/requests": '{"main": "64Mi"}'})
    req = create_container("s1", sb, "main", "burstable", request=64 * MI, limit=128 * MI)
    created = pb.CreateContainerRequest.FromString(run(
        hooks, CREATE_CONTAINER, req.SerializeToString(), pb.CreateContainerResponse(container_id="c1").SerializeToString()))
    assert "memory.high" in created.config.linux.resources.unified
    upd = update_resources("c1", limit=64 * MI, oom_score_adj=969)
    out = pb.UpdateContainerResourcesRequest.FromString(run(hooks, UPDATE_CONTAINER_RESOURCES, upd.SerializeToString()))
    assert out.linux.unified["memory.high"] == "max"
    assert out.linux.unified["memory.min"] == str(56 * MI)  # 8Mi under the limit
    assert out.linux.unified["memory.low"] == str(64 * MI)


def test_removed_containers_are_forgotten():
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    req = create_container("s1", sandbox_config("p", "0a1b", "burstable"), "main", "burstable", request=32 * MI)
    run(hooks, CREATE_CONTAINER, req.SerializeToString(), pb.CreateContainerResponse(container_id="c1").SerializeToString())
    assert "c1" in hooks.containers
    run(hooks, "/runtime.v1.RuntimeService/RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id="s1").SerializeToString())
    assert hooks.containers == {}


def test_with_the_reconciler_wired_the_removals_are_parsed_on_its_thread(tmp_path):
    """As ``serve`` wires them: finished() on the transport's thread does not parse
    RemoveContainer / RemovePodSandbox; the reconciler's thread makes the events and the rewriter
    forgets from them."""
    import threading

    from shim.app.service import Service
    from shim.node.facts import KubeletFacts
    from shim.node.reconciler import Reconciler

    hooks = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    reconciler = Reconciler(cgroup_root=str(tmp_path), kubelet=KubeletFacts(), policy=Policy.HARD,
                            capacity=NODE.capacity, page_size=4096, emit=lambda r: None)
    chain = Service(None, NODE, KubeletFacts(), None, hooks, reconciler=reconciler).hooks  # serve's wiring
    told = []
    forget = hooks.forget

    def on_removed(event):
        told.append((type(event).__name__, threading.current_thread().name))
        forget(event)

    reconciler.removal_listeners[:] = [on_removed]
    for sandbox, cid in (("s1", "c1"), ("s1", "c2"), ("s2", "c3")):
        req = create_container(sandbox, sandbox_config("p" + sandbox, "0a1b" + sandbox, "burstable"), "main" + cid,
                               "burstable", request=32 * MI)
        run(chain, CREATE_CONTAINER, req.SerializeToString(),
            pb.CreateContainerResponse(container_id=cid).SerializeToString())
    assert set(hooks.containers) == {"c1", "c2", "c3"}
    run(chain, "/runtime.v1.RuntimeService/RemoveContainer",
        pb.RemoveContainerRequest(container_id="c3").SerializeToString())
    run(chain, "/runtime.v1.RuntimeService/RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id="s1").SerializeToString())
    assert set(hooks.containers) == {"c1", "c2", "c3"}  # finished() read nothing of them
    reconciler.start()
    try:
        assert reconciler.sync(10)
    finally:
        reconciler.stop()
    assert hooks.containers == {}
    assert told == [("ContainerRemoved", "memqos-reconciler"), ("PodSandboxRemoved", "memqos-reconciler")]


def test_failed_create_is_audited_with_code_and_not_remembered():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    req = create_container("s1", sandbox_config("p", "0a1b", "guaranteed"), "main", "guaranteed",
                           request=64 * MI, limit=64 * MI)
    run(hooks, CREATE_CONTAINER, req.SerializeToString(), code="NOT_FOUND")
    assert records[0]["code"] == "NOT_FOUND"
    assert hooks.containers == {}


def test_unparsed_fields_survive_the_rewrite():
    """A newer kubelet's fields this proto does not know must reach the runtime."""
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    req = create_container("s1", sandbox_config("p", "0a1b", "burstable"), "main", "burstable",
                           request=32 * MI, limit=128 * MI).SerializeToString()
    unknown_field = b"\xa2\x06\x03abc"  # field 100, length-delimited, at the top level
    out = run(hooks, CREATE_CONTAINER, req + unknown_field)
    assert out != req + unknown_field
    assert out.endswith(unknown_field) or unknown_field in out


def test_created_container_carries_the_request_for_restart_recovery():
    import json

    hooks = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    sb = sandbox_config("p", "0a1b", "burstable")
    req = create_container("s1", sb, "main", "burstable", request=32 * MI, limit=128 * MI,
                           unified={"memory.min": str(32 * MI)})
    out = pb.CreateContainerRequest.FromString(run(hooks, CREATE_CONTAINER, req.SerializeToString()))
    note = json.loads(out.config.annotations["memqos.io/request"])
    assert note == {"bytes": 32 * MI, "source": "kubelet-unified", "qos": "Burstable",
                    "cgroup_parent": "/kubepods/burstable/pod0a1b"}
    # everything but the annotation and unified is what the kubelet sent
    out.config.annotations.pop("memqos.io/request")
    out.config.linux.resources.unified.clear()
    req.config.linux.resources.unified.clear()
    assert out == req


def test_transport_fail_open_is_audited():
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    hooks.not_rewritten(CREATE_CONTAINER, "transport: a 20971520-byte message is above the hold cap")
    assert records == [{"event": "fail-open", "method": "CreateContainer",
                        "error": "transport: a 20971520-byte message is above the hold cap"}]


@pytest.mark.parametrize("parent", [
    "/kubepods/burstable/pod1234", "kubepods-burstable-pod12_34.slice", "", 'quo"te\\back\nline\x00\x7f',
    "ünïcødé/\u2028/\U0001f600", "x" * 5000,
])
@pytest.mark.parametrize("request_bytes", [0, 1, 2**62])
def test_container_note_is_the_json_of_its_fields(parent, request_bytes):
    """The annotation is built without json.dumps on the hot path; it must be byte for byte what
    json.dumps writes (a restarted shim and `reset` parse it), for any cgroup parent."""
    fields = {"bytes": request_bytes, "source": "pod-annotation", "qos": "Burstable", "cgroup_parent": parent}
    note = container_note(request_bytes, "pod-annotation", "Burstable", parent)
    assert note == json.dumps(fields, separators=(",", ":"))
    assert json.loads(note) == fields


def test_policy_errors_do_not_flood_the_log(caplog):
    """Hostile requests each get a fail-open record, but the log says so at most once per
    interval (with a count of the lines it left out)."""
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    garbage = b"\xff\xff\xff\xff not protobuf"
    with caplog.at_level("ERROR", logger="shim.container.rewriter"):
        for _ in range(500):
            assert run(hooks, CREATE_CONTAINER, garbage) is garbage
    assert len(records) == 500 and all(r["event"] == "fail-open" for r in records)
    said = [r for r in caplog.records if "policy error" in r.getMessage()]
    assert len(said) == 1
    assert hooks.errors_not_logged == 499
    hooks._error_logged_at -= 3600  # the interval has passed: the next error is logged with the count
    with caplog.at_level("ERROR", logger="shim.container.rewriter"):
        run(hooks, CREATE_CONTAINER, garbage)
    said = [r for r in caplog.records if "policy error" in r.getMessage()]
    assert len(said) == 2 and "499 more not logged" in said[-1].getMessage()
