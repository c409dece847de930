"""Decision tables from docs/memory-qos.md, plus properties."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from shim.decision import (
    ContainerFacts,
    NodeFacts,
    PodFacts,
    Policy,
    QoSClass,
    Request,
    RequestSource,
    decide,
    memory_high,
    oom_score_adj_bounds,
    parse_cgroup_parent,
    qos_class,
    resolve_request,
)

Mi = 2**20
Gi = 2**30
BURSTABLE = PodFacts(cgroup_parent="/kubepods/burstable/pod123")
GUARANTEED = PodFacts(cgroup_parent="/kubepods/pod123")
BESTEFFORT = PodFacts(cgroup_parent="/kubepods/besteffort/pod123")


def given_request(n):
    return Request(n, RequestSource.GIVEN)


# Reference section 1, "Worked examples (limit 1000Mi, page 1Mi)". The KEP's typos
# (960 for 800, 980 for 900 at factor 0.9) are NOT encoded: the arithmetic wins.
KEP_TABLE = [
    (0, 0.9, 900),
    (100, 0.9, 910),
    (500, 0.9, 950),
    (800, 0.9, 980),
    (900, 0.9, 990),
    (1000, 0.9, None),
    (500, 0.6, 800),
    (800, 0.6, 920),
    (500, 0.8, 900),
    (850, 0.8, 970),
    (500, 0.4, 700),
]


@pytest.mark.parametrize("request_mi,factor,high_mi", KEP_TABLE)
def test_kep_table(request_mi, factor, high_mi):
    node = NodeFacts(capacity=0, allocatable=0, page_size=Mi, factor=factor)
    d = decide(BURSTABLE, ContainerFacts(limit=1000 * Mi), node, Policy.HARD, given_request(request_mi * Mi))
    if high_mi is None:
        assert "memory.high" not in d.unified_after
        assert "request equals limit" in d.reasons["memory.high"]
    else:
        assert d.unified_after["memory.high"] == str(high_mi * Mi)
    if request_mi:  # memory.min stays a headroom of max(10% of the limit, 8Mi) = 100Mi under the limit
        assert d.unified_after["memory.min"] == str(min(request_mi, 900) * Mi)
        assert d.unified_after.get("memory.low") == (str(request_mi * Mi) if request_mi > 900 else None)
    else:
        assert "memory.min" not in d.unified_after


def test_issue_example_128_256():
    node = NodeFacts(capacity=32 * Gi, allocatable=32 * Gi, page_size=4096, factor=0.9)
    d = decide(BURSTABLE, ContainerFacts(limit=256 * Mi), node, Policy.HARD, given_request(128 * Mi))
    assert dict(d.unified_after) == {"memory.min": "134217728", "memory.high": "255012864"}


def test_float64_semantics_at_page_boundary():
    # exact rational arithmetic gives 258048 (63 pages); float64 gives 258047.99999999997
    assert memory_high(0, 368640, 0.7, 4096) == 253952


def test_besteffort_from_allocatable():
    node = NodeFacts(capacity=2060419072, allocatable=1850703872, page_size=4096, factor=0.8)
    d = decide(BESTEFFORT, ContainerFacts(oom_score_adj=1000), node, Policy.HARD)
    # floor(0.8 * 1850703872 / 4096) * 4096
    assert d.unified_after == {"memory.high": str((int(0.8 * 1850703872) // 4096) * 4096)}
    assert d.qos is QoSClass.BESTEFFORT


def test_guaranteed_never_gets_memory_high():
    node = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=0.9)
    d = decide(GUARANTEED, ContainerFacts(limit=64 * Mi, oom_score_adj=-997), node, Policy.HARD)
    # memory.min capped a headroom of 8Mi under the limit, memory.low carries the request
    assert dict(d.unified_after) == {"memory.min": str(56 * Mi), "memory.low": str(64 * Mi)}
    assert d.request.source is RequestSource.GUARANTEED_LIMIT


def test_factor_none_means_no_memory_high():
    node = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=None)
    d = decide(BESTEFFORT, ContainerFacts(oom_score_adj=1000), node, Policy.HARD)
    assert dict(d.unified_after) == {}


def test_owned_keys_replaced_other_keys_kept():
    node = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=0.9)
    before = {"memory.high": "max", "memory.min": "0", "memory.oom.group": "1", "memory.swap.max": "0"}
    d = decide(BURSTABLE, ContainerFacts(limit=256 * Mi, unified=before), node, Policy.HARD, given_request(128 * Mi))
    assert d.unified_after == {
        "memory.oom.group": "1",
        "memory.swap.max": "0",
        "memory.min": "134217728",
        "memory.high": "255012864",
    }
    assert "replaces kubelet's 'max'" in d.reasons["memory.high"]


def test_kubelet_zero_memory_low_removed():
    node = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=0.9)
    before = {"memory.min": "0", "memory.low": "0"}
    d = decide(BURSTABLE, ContainerFacts(limit=256 * Mi, unified=before), node, Policy.HARD, given_request(128 * Mi))
    assert "memory.low" not in d.unified_after
    assert "removed" in d.reasons["memory.low"]


@pytest.mark.parametrize(
    "policy,pod,expect_key",
    [
        (Policy.HARD, BURSTABLE, "memory.min"),
        (Policy.TIERED_RESERVATION, BURSTABLE, "memory.low"),
        (Policy.TIERED_RESERVATION, GUARANTEED, "memory.min"),
        (Policy.NONE, BURSTABLE, None),
        (Policy.NONE, GUARANTEED, None),
    ],
)
def test_policies(policy, pod, expect_key):
    node = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=0.9)
    limit = 128 * Mi if pod is GUARANTEED else 256 * Mi
    d = decide(pod, ContainerFacts(limit=limit, unified={"memory.min": "5"}), node, policy, given_request(128 * Mi))
    protection = {k: v for k, v in d.unified_after.items() if k in ("memory.min", "memory.low")}
    if expect_key is None:
        assert protection == {}
    elif pod is GUARANTEED:  # memory.min capped under the limit (128Mi - ceil(12.8Mi), page), memory.low = request
        assert protection == {"memory.min": "120795136", "memory.low": str(128 * Mi)}
    else:
        assert protection == {expect_key: str(128 * Mi)}


# -- QoS class -------------------------------------------------------------------
@pytest.mark.parametrize(
    "parent,qos,uid",
    [
        ("/kubepods/burstable/pod1234-ab", QoSClass.BURSTABLE, "1234-ab"),
        ("/kubepods/besteffort/pod1234-ab", QoSClass.BESTEFFORT, "1234-ab"),
        ("/kubepods/pod1234-ab", QoSClass.GUARANTEED, "1234-ab"),
        ("/custom-root/kubepods/burstable/podabc", QoSClass.BURSTABLE, "abc"),
        ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12_34.slice", QoSClass.BURSTABLE, "12_34"),
        ("kubepods-burstable-pod12_34.slice", QoSClass.BURSTABLE, "12_34"),
        ("kubepods-besteffort-pod12_34.slice", QoSClass.BESTEFFORT, "12_34"),
        ("/kubepods.slice/kubepods-pod12_34.slice", QoSClass.GUARANTEED, "12_34"),
        ("kubepods-pod12_34.slice", QoSClass.GUARANTEED, "12_34"),
        ("", None, None),
        ("/system.slice/foo", None, None),
        ("/kubepods/burstable/../../etc", None, None),
        ("/kubepods/weird/pod123", None, None),
    ],
)
def test_parse_cgroup_parent(parent, qos, uid):
    assert parse_cgroup_parent(parent) == (qos, uid)


@pytest.mark.parametrize("adj,qos", [(-997, QoSClass.GUARANTEED), (1000, QoSClass.BESTEFFORT), (984, QoSClass.BURSTABLE), (3, QoSClass.BURSTABLE)])
def test_qos_falls_back_to_oom_score_adj(adj, qos):
    assert qos_class("", adj) == (qos, "oom-score-adj")


def test_cgroup_parent_wins_over_oom_score_adj():
    # a node-critical Burstable pod gets -997 but lives under burstable
    assert qos_class("/kubepods/burstable/pod0ab", -997) == (QoSClass.BURSTABLE, "cgroup-parent")


# -- request sources ------------------------------------------------------------
CAP = 2060419072


def test_request_source_order():
    pod = PodFacts(cgroup_parent="/kubepods/burstable/pod0ab", annotations={"memqos.io/requests": '{"main": "24Mi"}'})
    c = ContainerFacts(name="main", limit=128 * Mi, oom_score_adj=984, unified={"memory.min": str(32 * Mi)})
    assert resolve_request(pod, c, QoSClass.BURSTABLE, CAP) == Request(24 * Mi, RequestSource.ANNOTATION)
    r = resolve_request(BURSTABLE, c, QoSClass.BURSTABLE, CAP)
    assert (r.bytes, r.source) == (32 * Mi, RequestSource.KUBELET_UNIFIED)
    c2 = ContainerFacts(name="main", limit=128 * Mi, oom_score_adj=984)
    r = resolve_request(BURSTABLE, c2, QoSClass.BURSTABLE, CAP)
    assert r.source is RequestSource.OOM_SCORE_ADJ and r.bytes == -(-16 * CAP // 1000)
    c3 = ContainerFacts(name="main", limit=64 * Mi, oom_score_adj=-997)
    assert resolve_request(GUARANTEED, c3, QoSClass.GUARANTEED, CAP).source is RequestSource.GUARANTEED_LIMIT
    assert resolve_request(BURSTABLE, ContainerFacts(oom_score_adj=-998), QoSClass.BURSTABLE, CAP).source is RequestSource.NONE


def test_annotation_above_the_kubelets_request_is_ignored():
    """The annotation is the pod's own input: above the request the kubelet sent it buys nothing."""
    pod = PodFacts(cgroup_parent="/kubepods/burstable/pod0ab", annotations={"memqos.io/requests": '{"main": "48Mi"}'})
    c = ContainerFacts(name="main", limit=128 * Mi, oom_score_adj=984, unified={"memory.min": str(32 * Mi)})
    r = resolve_request(pod, c, QoSClass.BURSTABLE, CAP)
    assert (r.bytes, r.source) == (32 * Mi, RequestSource.KUBELET_UNIFIED)
    assert f"ignored: {48 * Mi} is above the kubelet's request {32 * Mi}" in r.note


def test_annotation_beyond_what_oom_score_adj_allows_is_ignored():
    """adj 984 is a request in [16, 17) thousandths of the capacity: 48Mi claims more, the lower
    bound is taken; a claim inside the range is kept."""
    high = -(-17 * CAP // 1000)
    c = ContainerFacts(name="main", limit=128 * Mi, oom_score_adj=984)
    claim = PodFacts(cgroup_parent="/kubepods/burstable/pod0ab", annotations={"memqos.io/requests": '{"main": "48Mi"}'})
    r = resolve_request(claim, c, QoSClass.BURSTABLE, CAP)
    assert (r.bytes, r.source) == (-(-16 * CAP // 1000), RequestSource.OOM_SCORE_ADJ)
    assert f"ignored: {48 * Mi} is not below {high}" in r.note
    inside = PodFacts(cgroup_parent="/kubepods/burstable/pod0ab",
                      annotations={"memqos.io/requests": json.dumps({"main": str(high - 1)})})
    assert resolve_request(inside, c, QoSClass.BURSTABLE, CAP) == Request(high - 1, RequestSource.ANNOTATION)


@pytest.mark.parametrize(
    "value,why",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"main": "lots"}', "not a quantity"),
        ('{"main": "-5Mi"}', "negative"),
        ('{"main": "1Ei"}', "exceeds the limit"),
        ('{"main": {"nested": 1}}', "must be a string"),
        ("[" * 5000 + "]" * 5000, "ignored"),
    ],
)
def test_hostile_annotation_is_ignored_with_a_note(value, why):
    pod = PodFacts(cgroup_parent="/kubepods/burstable/pod0ab", annotations={"memqos.io/requests": value})
    c = ContainerFacts(name="main", limit=128 * Mi, oom_score_adj=984)
    r = resolve_request(pod, c, QoSClass.BURSTABLE, CAP)
    assert r.source is RequestSource.OOM_SCORE_ADJ
    assert why in r.note


def test_limit_only_burstable_gets_no_memory_high():
    # qos-limit-only in the recorded traces: request defaulted to the 96Mi limit, adj 952
    node = NodeFacts(capacity=CAP, allocatable=1850703872, page_size=4096, factor=0.9)
    d = decide(BURSTABLE, ContainerFacts(name="main", limit=100663296, oom_score_adj=952), node, Policy.HARD)
    assert "memory.high" not in d.unified_after
    assert "may equal the limit" in d.reasons["memory.high"]
    assert int(d.unified_after["memory.min"]) <= 100663296


# -- properties -----------------------------------------------------------------
def kubelet_oom_score_adj(req: int, capacity: int) -> int:
    adj = 1000 - (1000 * req) // capacity
    if adj < 3:
        return 3
    if adj == 1000:
        return 999
    return adj


@settings(max_examples=400, deadline=None)
@given(
    capacity=st.integers(min_value=64 * Mi, max_value=4 * 2**40),
    req_fraction=st.floats(min_value=0, max_value=1.5),
    extra_limit=st.one_of(st.just(None), st.integers(min_value=0, max_value=64 * Gi)),
)
def test_estimated_request_never_exceeds_the_true_one(capacity, req_fraction, extra_limit):
    true_req = int(capacity * req_fraction)
    adj = kubelet_oom_score_adj(true_req, capacity)
    limit = 0 if extra_limit is None else true_req + extra_limit
    r = resolve_request(BURSTABLE, ContainerFacts(limit=limit, oom_score_adj=adj), QoSClass.BURSTABLE, capacity)
    assert r.bytes <= true_req
    low, high = oom_score_adj_bounds(adj, capacity)
    assert low <= true_req and (high is None or true_req < high)


@settings(max_examples=600, deadline=None)
@given(
    req=st.integers(min_value=0, max_value=256 * Gi),
    limit=st.integers(min_value=0, max_value=256 * Gi),
    alloc=st.integers(min_value=0, max_value=1024 * Gi),
    factor=st.floats(min_value=0.01, max_value=1.0, allow_nan=False),
    page=st.sampled_from([4096, 16384, 65536, Mi]),
    pod=st.sampled_from([BURSTABLE, BESTEFFORT, GUARANTEED]),
)
def test_memory_high_properties(req, limit, alloc, factor, page, pod):
    node = NodeFacts(capacity=alloc, allocatable=alloc, page_size=page, factor=factor)
    d = decide(pod, ContainerFacts(limit=limit), node, Policy.HARD, given_request(req))
    high = d.unified_after.get("memory.high")
    if high is None:
        return
    high = int(high)
    assert high % page == 0
    assert high > 0
    if "memory.min" in d.unified_after:
        assert high > int(d.unified_after["memory.min"])
    if limit > 0:
        assert high <= limit
    else:
        assert high <= alloc
    assert pod is not GUARANTEED
