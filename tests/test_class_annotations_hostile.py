"""Hostile class annotations (tenant input) through the real parse paths: the CRI rewriter given
serialized CreateContainer bytes, and the NRI plugin's protocol handler given serialized NRI
requests in front of the real NRI handler. Each case gets the node's settings (the values a pod
without the annotation gets), an audit note naming why, no crash, and never more protection
than the request: an unknown class, a class of another namespace, oversized values, values that
are not class names, bytes that are not UTF-8, thousands of annotations, a container key naming a
container that does not exist."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shim.container.nri_handler import NriMemoryQoS
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER
from shim.decision import NodeFacts, Policy
from shim.decision.classes import ContainerClass, make_table
from shim.nri import api_pb2 as npb
from shim.nri.plugin import NriProtocol
from shim.transport.hooks import RpcCall
from shim.transport.wire import ttrpc
from tests.kubelet_requests import CAPACITY, MI, create_container, sandbox_config
from tests.test_nri_front import nri_container, nri_pod

NODE = NodeFacts(capacity=CAPACITY, allocatable=CAPACITY - 200 * MI, page_size=4096, factor=0.9)
UID = "7c1d0000-0000-4000-8000-0000000000ff"
REQUEST, LIMIT = 256 * MI, 1024 * MI
# a class that protects harder than the node (Hard, no headroom, no memory.high): what a tenant
# would want and its namespace may not use
TABLE = make_table({"gold": ContainerClass("gold", policy=Policy.HARD, factor_set=True, factor=None,
                                           headroom_ratio=0.0, headroom_min=0),
                    "batch": ContainerClass("batch", factor_set=True, factor=0.5)},
                   {"trusted": ["gold"], "tenant-a": ["batch"]})

HOSTILE = [
    ({"memqos.io/class": "platinum"}, "unknown-class"),
    ({"memqos.io/class": "gold"}, "namespace-not-allowed"),
    ({"memqos.io/class.main": "gold"}, "namespace-not-allowed"),
    ({"memqos.io/class": "g" * 300}, "malformed"),
    ({"memqos.io/class": "gold" * 100_000}, "malformed"),
    ({"memqos.io/class": "Gold"}, "malformed"),
    ({"memqos.io/class": "gold\x00"}, "malformed"),
    ({"memqos.io/class": "g\u00f6ld"}, "malformed"),
    ({"memqos.io/class": "\U0001f947"}, "malformed"),
    ({"memqos.io/class": ""}, "malformed"),
    ({"memqos.io/class": " gold"}, "malformed"),
    ({"memqos.io/class.main": "-", "memqos.io/class": "batch"}, "malformed"),  # the container's key wins
]


def run(hooks, request: bytes, cid: str = "c1") -> tuple[bytes, RpcCall]:
    call = RpcCall(CREATE_CONTAINER, 0.0, request=request)
    out = hooks.rewrite(call)
    hooks.finished(call.complete(0.1, out if out != request else None,
                                 [pb.CreateContainerResponse(container_id=cid).SerializeToString()], "OK", ""))
    return out, call


def cri_request(annotations: dict, namespace: str = "tenant-a") -> bytes:
    sb = sandbox_config("p", UID, "burstable", namespace=namespace, annotations=annotations)
    return create_container("s1", sb, "main", "burstable", request=REQUEST, limit=LIMIT,
                            unified={"memory.min": str(REQUEST)}).SerializeToString()


def node_default() -> dict:
    """What the node's settings give this container (no annotation at all)."""
    out, _ = run(ContainerMemoryQoS(NODE, Policy.SOFT, lambda r: None, classes=TABLE), cri_request({}))
    return dict(pb.CreateContainerRequest.FromString(out).config.linux.resources.unified)


def within_the_request(unified) -> None:
    for key in ("memory.min", "memory.low"):
        assert int(unified.get(key, "0")) <= REQUEST, (key, unified)


@pytest.mark.parametrize("annotations,reason", HOSTILE)
def test_a_hostile_annotation_through_the_cri_path_gets_the_nodes_settings_and_a_note(annotations, reason):
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE)
    out, call = run(hooks, cri_request(annotations))
    msg = pb.CreateContainerRequest.FromString(out)
    unified = dict(msg.config.linux.resources.unified)
    assert unified == node_default()
    within_the_request(unified)
    (rec,) = records
    assert rec["event"] == "rewrite" and rec["code"] == "OK"
    assert rec["class"] is None and rec["class_refused"] == reason and "memqos.io/class" in rec["class_note"]
    assert len(rec["class_note"]) < 400
    json.dumps(rec).encode("ascii")  # a record a log shipper can take, whatever the value held
    assert "class" not in json.loads(msg.config.annotations["memqos.io/request"])
    assert hooks.containers["c1"].cls is None


def test_bytes_that_are_not_utf8_never_reach_the_decision_and_the_call_fails_open():
    """protobuf (upb, and the runtime's Go protobuf) refuses a proto3 string that is not UTF-8:
    the rewriter cannot parse the request, forwards the kubelet's bytes unchanged and audits a
    fail-open naming the decode error."""
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE)
    request = cri_request({"memqos.io/class": "ZZZZ"}).replace(b"ZZZZ", b"\xff\xfe\x80g")
    out, _ = run(hooks, request)
    assert out == request
    (rec,) = records
    assert rec["event"] == "fail-open" and "UTF-8" in rec["error"]


def test_thousands_of_annotations_and_keys_for_containers_that_do_not_exist():
    annotations = {f"example.com/noise-{i}": "x" * 64 for i in range(5000)}
    annotations.update({f"memqos.io/class.ghost-{i}": "gold" for i in range(2000)})
    annotations.update({f"memqos.io/class{i}": "gold" for i in range(100)})
    annotations["memqos.io/class.mainx"] = "gold"
    annotations["memqos.io/class"] = "batch"
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE)
    out, _ = run(hooks, cri_request(annotations))
    unified = dict(pb.CreateContainerRequest.FromString(out).config.linux.resources.unified)
    within_the_request(unified)
    assert records[0]["class"] == "batch" and records[0]["class_source"] == "pod-annotation"
    # the same pod without its own class: the ghosts' keys are never read for this container
    del annotations["memqos.io/class"]
    records.clear()
    out, _ = run(hooks, cri_request(annotations), "c2")
    assert dict(pb.CreateContainerRequest.FromString(out).config.linux.resources.unified) == node_default()
    assert records[0]["class"] is None and "class_refused" not in records[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.text(max_size=400), key=st.sampled_from(["memqos.io/class", "memqos.io/class.main"]),
       namespace=st.sampled_from(["tenant-a", "trusted", "other", ""]))
def test_any_annotation_value_gives_a_defined_class_of_the_namespace_or_the_nodes_settings(value, key, namespace):
    records = []
    hooks = ContainerMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE)
    try:
        request = cri_request({key: value}, namespace)
    except ValueError:  # a surrogate: protobuf cannot even build the message
        return
    out, _ = run(hooks, request)
    unified = dict(pb.CreateContainerRequest.FromString(out).config.linux.resources.unified)
    within_the_request(unified)
    (rec,) = records
    assert rec["event"] == "rewrite"
    if rec["class"] is None:
        assert unified == node_default()
    else:
        assert rec["class"] == value and TABLE.allowed(namespace, value)


# -- the NRI path: serialized requests through the plugin's protocol handler ---------------------

def nri_call(proto: NriProtocol, annotations: dict, namespace: str = "tenant-a", payload: bytes | None = None):
    pod = nri_pod("p", UID, "burstable", annotations)
    pod.namespace = namespace
    c = nri_container("c1", pod, "main", "burstable", request=REQUEST, limit=LIMIT,
                      unified={"memory.min": str(REQUEST)})
    req = npb.CreateContainerRequest(pod=pod, container=c).SerializeToString()
    resp = proto.serve(ttrpc.Request("nri.pkg.api.v1alpha1.Plugin", "CreateContainer", payload or req))
    proto.handler.replied()
    return npb.CreateContainerResponse.FromString(resp.payload)


@pytest.mark.parametrize("annotations,reason", HOSTILE)
def test_a_hostile_annotation_through_the_nri_path_gets_the_nodes_settings_and_a_note(annotations, reason):
    records = []
    proto = NriProtocol(NriMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE))
    baseline = nri_call(NriProtocol(NriMemoryQoS(NODE, Policy.SOFT, lambda r: None, classes=TABLE)), {})
    resp = nri_call(proto, annotations)
    assert resp.adjust.linux.resources.unified == baseline.adjust.linux.resources.unified
    within_the_request(dict(resp.adjust.linux.resources.unified))
    (rec,) = [r for r in records if r.get("method") == "CreateContainer"]
    assert rec["class"] is None and rec["class_refused"] == reason
    assert proto.stats.handler_errors == 0


def test_an_nri_request_that_is_not_utf8_gets_an_empty_reply_and_a_fail_open_record():
    records = []
    proto = NriProtocol(NriMemoryQoS(NODE, Policy.SOFT, records.append, classes=TABLE))
    pod = nri_pod("p", UID, "burstable", {"memqos.io/class": "ZZZZ"})
    c = nri_container("c1", pod, "main", "burstable", request=REQUEST, limit=LIMIT)
    payload = npb.CreateContainerRequest(pod=pod, container=c).SerializeToString().replace(b"ZZZZ", b"\xff\xfe\x80g")
    resp = nri_call(proto, {}, payload=payload)
    assert resp == npb.CreateContainerResponse()  # nothing adjusted: the container is created as asked
    (rec,) = records
    assert rec["event"] == "fail-open" and rec["method"] == "CreateContainer" and "UTF-8" in rec["error"]
