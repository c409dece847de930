"""A container's memory.min stays a headroom under its limit, so a pod at its memory.max can
reclaim its own page cache (docs/memory-qos.md, "Protection that never OOM-kills"): the rule,
what it does to each policy, that the cap never lowers a request the shim reads back, and
properties over pod shapes with the kernel's arithmetic at the pod as reclaim root."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri.events import ContainerResourcesUpdated
from shim.decision import (ContainerFacts, NodeFacts, PodFacts, Policy, QoSClass, Request, RequestSource, capped_min,
                           decide, headroom)
from shim.decision.pod import container_request, request_from_unified
from shim.decision.shape import ContainerShape, pod_values
from shim.node.state import ContainerRecord, NodeState, SandboxRecord

MI = 2**20
PAGE = 4096
NODE = NodeFacts(capacity=64 * 1024 * MI, allocatable=60 * 1024 * MI, page_size=PAGE, factor=0.9)
GUARANTEED = PodFacts(uid="u1", cgroup_parent="/kubepods/pod1f0c2a9e-0000-4000-8000-000000000001")
BURSTABLE = PodFacts(uid="u1", cgroup_parent="/kubepods/burstable/pod1f0c2a9e-0000-4000-8000-000000000001")


def given_request(n: int) -> Request:
    return Request(n, RequestSource.GIVEN)


def protection(d) -> dict[str, str]:
    return {k: v for k, v in d.unified_after.items() if k in ("memory.min", "memory.low")}


# -- the rule -------------------------------------------------------------------------------------
def test_headroom_is_the_larger_of_the_ratio_and_the_floor():
    assert headroom(256 * MI, 0.1, 8 * MI) == 26843546  # ceil(26843545.6)
    assert headroom(64 * MI, 0.1, 8 * MI) == 8 * MI
    assert headroom(4 * MI, 0.1, 8 * MI) == 4 * MI  # never above the limit
    assert headroom(256 * MI, 0, 0) == 0


def test_capped_min_worked_examples():
    assert capped_min(256 * MI, 256 * MI, NODE) == (241590272, 26843546)  # 241591910 rounded down to a page
    assert capped_min(64 * MI, 64 * MI, NODE) == (56 * MI, 8 * MI)
    assert capped_min(100_000_001, 1024 * MI, NODE)[0] == 100_000_001  # under the cap: as it is, not page-rounded
    assert capped_min(4 * MI, 4 * MI, NODE)[0] == 0
    assert capped_min(256 * MI, 0, NODE) == (256 * MI, 0)  # no limit: no cap
    off = NodeFacts(capacity=NODE.capacity, allocatable=NODE.allocatable, page_size=PAGE, factor=0.9,
                    headroom_ratio=0.0, headroom_min=0)
    assert capped_min(256 * MI, 256 * MI, off)[0] == 256 * MI


@pytest.mark.parametrize("policy,pod,want", [
    (Policy.HARD, GUARANTEED, {"memory.min": "241590272", "memory.low": str(256 * MI)}),
    (Policy.HARD, BURSTABLE, {"memory.min": "241590272", "memory.low": str(256 * MI)}),
    (Policy.TIERED_RESERVATION, GUARANTEED, {"memory.min": "241590272", "memory.low": str(256 * MI)}),
    (Policy.TIERED_RESERVATION, BURSTABLE, {"memory.low": str(256 * MI)}),  # memory.low: never capped
    (Policy.SOFT, GUARANTEED, {"memory.low": str(256 * MI)}),
    (Policy.NONE, GUARANTEED, {}),
])
def test_every_policy_that_puts_memory_min_on_a_container_caps_it(policy, pod, want):
    d = decide(pod, ContainerFacts(name="c", limit=256 * MI), NODE, policy, given_request(256 * MI))
    assert protection(d) == want
    if "memory.min" in want:
        assert "capped at limit 268435456 - headroom 26843546 = 241591910 -> 241590272" in d.reasons["memory.min"]
        assert "protection-that-never-oom-kills" in d.reasons["memory.min"]
        assert "memory.low never OOM-kills" in d.reasons["memory.low"]


def test_a_limit_below_the_headroom_protects_with_memory_low_and_says_why():
    d = decide(GUARANTEED, ContainerFacts(name="c", limit=4 * MI), NODE, Policy.HARD, given_request(4 * MI))
    assert protection(d) == {"memory.low": str(4 * MI)}
    assert d.reasons["memory.min"].startswith("not set:") and "nothing left" in d.reasons["memory.min"]
    assert "memory.low protects the container instead" in d.reasons["memory.low"]


def test_an_update_that_uncaps_sends_memory_low_zero():
    """containerd merges an update's unified: memory.low from an earlier cap must be reset."""
    d = decide(BURSTABLE, ContainerFacts(name="c", limit=1024 * MI, unified={"memory.low": str(256 * MI)}), NODE,
               Policy.HARD, given_request(256 * MI), reset_absent=True)
    assert protection(d) == {"memory.min": str(256 * MI), "memory.low": "0"}


# -- the request read back is the request, never the cap ------------------------------------------
def test_the_request_read_back_from_a_capped_unified_is_the_request():
    d = decide(GUARANTEED, ContainerFacts(name="c", limit=256 * MI), NODE, Policy.HARD, given_request(256 * MI))
    assert request_from_unified(d.unified_after) == 256 * MI
    assert container_request(d.unified_after, {}, lambda: (0, "derived")) == (256 * MI, "unified", None)
    tiny = decide(GUARANTEED, ContainerFacts(name="c", limit=4 * MI), NODE, Policy.HARD, given_request(4 * MI))
    assert request_from_unified(tiny.unified_after) == 4 * MI


def test_the_capped_values_resent_by_an_update_are_no_departure():
    s = NodeState(NODE.capacity)
    pod = s.upsert_pod("u1", "default", "web")
    s.add_sandbox(pod, SandboxRecord("sb1", "u1", True, 0, GUARANTEED.cgroup_parent, 0))
    s.add_container(pod, ContainerRecord("c1", "sb1", "main", request=256 * MI))
    d = decide(GUARANTEED, ContainerFacts(name="main", limit=256 * MI), NODE, Policy.HARD, given_request(256 * MI),
               reset_absent=True)
    s.apply(ContainerResourcesUpdated("c1", dict(d.unified_after), {}, 256 * MI))
    assert s.take_departures() == {}
    assert s.container("c1").request == 256 * MI


# -- properties over pod shapes -------------------------------------------------------------------
@st.composite
def pod_shapes(draw):
    """1-4 regular containers, 0-2 ordinary init containers, 0-1 sidecar; each with a request
    and a limit >= it (or none), Guaranteed shapes (request = limit everywhere) drawn often."""
    guaranteed = draw(st.booleans())
    n_regular = draw(st.integers(1, 4))
    kinds = ["sidecar"] * draw(st.integers(0, 1)) + ["init"] * draw(st.integers(0, 2)) + ["regular"] * n_regular
    out = []
    for i, kind in enumerate(kinds):
        request = draw(st.integers(0, 4096)) * MI // 4 + draw(st.integers(0, PAGE - 1))
        if guaranteed:
            request = max(request, 1)
            limit = request
        else:
            limit = draw(st.one_of(st.just(0), st.just(request), st.integers(request, 8 * 1024 * MI)))
        out.append(ContainerShape(f"c{i}", request, limit, kind))
    return out


@settings(max_examples=300, deadline=None)
@given(shape=pod_shapes(), policy=st.sampled_from(list(Policy)), sandbox=st.integers(0, 4 * MI))
def test_at_the_pods_memory_max_every_container_stays_reclaimable(shape, policy, sandbox):
    v = pod_values(shape, policy, NODE)
    for c in shape:
        keys = v.containers[c.name]
        mn, low = int(keys.get("memory.min", "0")), int(keys.get("memory.low", "0"))
        assert mn <= c.request and low <= c.request
        if v.pod_limit and c.limit:
            # the pod as reclaim root: at its memory.max every container uses at least its limit
            # less the sandbox's usage (the others are at most at theirs); it must be above its
            # memory.min, or its page cache is out of reach and the pod is OOM-killed
            least_usage = c.limit - sandbox
            assert mn < least_usage or mn == 0, (c, keys)
        protects = policy is not Policy.NONE and v.qos is not QoSClass.BESTEFFORT and c.request > 0
        assert (mn > 0 or low > 0) == protects, (c, keys, policy)
    # the pod's protecting file holds the sum of the requests (page-rounded), never of the caps
    key = None if policy is Policy.NONE or v.qos is QoSClass.BESTEFFORT else (
        "memory.low" if policy is Policy.SOFT or (policy is Policy.TIERED_RESERVATION and v.qos is QoSClass.BURSTABLE)
        else "memory.min")
    summed = sum(c.request for c in shape if c.kind != "init")
    sidecars, requests = 0, summed
    for c in shape:
        sidecars += c.request if c.kind == "sidecar" else 0
        requests = max(requests, c.request + sidecars) if c.kind == "init" else requests
    if key is not None and requests > 0:
        assert v.pod_request == requests
        assert v.pod[key] == requests // PAGE * PAGE
    else:
        assert v.pod.get("memory.min", 0) == 0 and v.pod.get("memory.low", 0) == 0


@settings(max_examples=200, deadline=None)
@given(request=st.integers(1, 64 * 1024 * MI), extra=st.integers(0, 64 * 1024 * MI),
       ratio=st.floats(0, 0.99), floor=st.integers(0, 64 * MI))
def test_capped_min_properties(request, extra, ratio, floor):
    node = NodeFacts(capacity=NODE.capacity, allocatable=NODE.allocatable, page_size=PAGE, factor=0.9,
                     headroom_ratio=ratio, headroom_min=floor)
    limit = request + extra
    value, room = capped_min(request, limit, node)
    assert 0 <= value <= request
    assert value <= max(0, limit - room)
    assert value == request or value % PAGE == 0
    assert room >= min(limit, floor)


# -- correct-kubelet-min: the kubelet's own container memory.min --------------------------------------
OWNS = {"memory.min": "kubelet v1.36 gate on, memoryReservationPolicy TieredReservation",
        "memory.low": "kubelet v1.36 gate on, memoryReservationPolicy TieredReservation"}
CORRECTING = NodeFacts(capacity=NODE.capacity, allocatable=NODE.allocatable, page_size=PAGE, factor=0.9,
                       correct_kubelet_min=True)
SENT = {"memory.min": str(256 * MI), "memory.low": "0", "memory.high": "max"}


def test_the_kubelets_memory_min_is_forwarded_as_sent_by_default():
    d = decide(GUARANTEED, ContainerFacts(name="c", limit=256 * MI, unified=SENT), NODE, Policy.HARD,
               kubelet_owns=OWNS)
    assert d.unified_after["memory.min"] == str(256 * MI)


def test_correct_kubelet_min_lowers_the_kubelets_value_and_says_both():
    d = decide(GUARANTEED, ContainerFacts(name="c", limit=256 * MI, unified=SENT), CORRECTING, Policy.HARD,
               kubelet_owns=OWNS)
    assert d.unified_after["memory.min"] == "241590272"
    assert d.unified_after["memory.low"] == "0"  # the kubelet's, untouched
    why = d.reasons["memory.min"]
    assert "kubelet's '268435456' lowered to 241590272 (correct-kubelet-min)" in why
    assert "limit 268435456 - headroom 26843546" in why and "protection-that-never-oom-kills" in why


@pytest.mark.parametrize("sent,limit", [
    ({"memory.min": str(32 * MI), "memory.low": "0"}, 256 * MI),  # far under the limit: as sent
    ({"memory.min": "0", "memory.low": str(256 * MI)}, 256 * MI),  # memory.low: never touched
    ({"memory.min": str(256 * MI)}, 0),  # no limit: no cap
    ({"memory.min": "garbage"}, 256 * MI),  # not a byte count: as sent
])
def test_correct_kubelet_min_never_raises_nor_touches_other_keys(sent, limit):
    d = decide(BURSTABLE, ContainerFacts(name="c", limit=limit, unified=sent), CORRECTING, Policy.HARD,
               kubelet_owns=OWNS)
    assert {k: d.unified_after.get(k) for k in sent} == sent


def test_a_corrected_kubelet_value_still_states_the_request_to_the_node_state():
    from shim.decision.events import ContainerCreated

    d = decide(GUARANTEED, ContainerFacts(name="main", limit=256 * MI, unified=SENT), CORRECTING, Policy.HARD,
               kubelet_owns=OWNS)
    s = NodeState(NODE.capacity)
    s.apply(ContainerCreated("c1", "sb1", GUARANTEED, 0, "main", 0,
                             ContainerFacts(name="main", limit=256 * MI, unified=SENT), dict(d.unified_after), {}, 1, 2))
    assert s.container("c1").request == 256 * MI
    s.apply(ContainerResourcesUpdated("c1", dict(d.unified_after), SENT, 256 * MI))
    assert s.take_departures() == {} and s.container("c1").request == 256 * MI
