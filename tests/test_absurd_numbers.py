"""Absurd numbers never reach a cgroup file (docs/memory-qos.md, "Absurd numbers"): a request or
limit beyond the node, a value beyond int64, a negative one. Properties over the full int64 range
(and beyond, for the strings a kubelet or an annotation can carry) for the container decision and
the node targets; then the 2^63-1 Guaranteed limit end to end through the rewriter and through the
reconciler onto a cgroup tree of real files; then the effects layer's last line of defence."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES
from shim.decision import (
    OWNED_KEYS,
    ContainerFacts,
    NodeFacts,
    PodFacts,
    Policy,
    QoSClass,
    Request,
    RequestSource,
    decide,
)
from shim.decision.node import MIN, NODE, PlacedPod, Reserved, node_targets
from shim.decision.pod import container_request, parse_annotation
from shim.effects import CgroupFS, PathRefused, ValueRefused
from shim.effects.systemd import CgroupWriter
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import MI, create_container, sandbox_config, update_resources

INT64 = 2**63 - 1
GI = 2**30
NODE_8G = NodeFacts(capacity=8 * GI, allocatable=8 * GI - 512 * MI, page_size=4096, factor=0.9)
UID = "1f0c2a9e-0000-4000-8000-000000000005"
PARENTS = {
    QoSClass.GUARANTEED: f"/kubepods/pod{UID}",
    QoSClass.BURSTABLE: f"/kubepods/burstable/pod{UID}",
    QoSClass.BESTEFFORT: f"/kubepods/besteffort/pod{UID}",
}


def _bound(node: NodeFacts) -> int:
    """What the node can give pods: allocatable, never above the capacity; int64 when unknown."""
    cap = node.capacity if 0 < node.capacity <= INT64 else INT64
    return min(node.allocatable, cap) if node.allocatable > 0 else cap


def _assert_within_the_node(d, node: NodeFacts, owned_by_kubelet=()) -> None:
    cap = node.capacity if 0 < node.capacity <= INT64 else INT64
    for key in OWNED_KEYS:
        raw = d.unified_after.get(key)
        if raw is None or not (raw.isascii() and raw.isdigit()):
            continue  # absent, "max", or a kubelet's non-number forwarded as sent
        value = int(raw)
        assert 0 <= value <= (cap if key == "memory.high" else _bound(node)), (key, raw, d.reasons.get(key))
        if key == "memory.high" and key not in owned_by_kubelet:
            assert value % node.page_size == 0, (key, raw)
    assert 0 <= d.request.bytes <= _bound(node)


# -- strategies: the full int64 range, and strings beyond it -----------------------------------
int64s = st.integers(-(2**63), INT64)
edges = st.sampled_from([0, 1, -1, INT64, INT64 - 1, -(2**63), 2**62, 8 * GI, 8 * GI + 1, 2**32, 4096])
numbers = st.one_of(edges, int64s)
sizes = edges.filter(lambda n: n >= 0)  # what the node state sums (never negative)
wide = st.integers(-(2**70), 2**70)
byte_strings = st.one_of(
    numbers.map(str), wide.map(str),
    st.sampled_from(["99999999999999999999", "9999999999999999999", "9223372036854775807",
                     "9223372036854775808", "0", "max", "-1", "", "1e30", "0" * 30 + "1", "9" * 200]),
)
quantities = st.one_of(
    byte_strings,
    st.sampled_from(["1e30", "9Ei", "7Ei", "8Ei", "-1Gi", "-5Mi", "1E18", "9.3E18", "0.5", "16Ei", "1e-30",
                     "128Mi", "9223372036854775807", "9223372036854775808"]),
    st.tuples(st.integers(-(2**20), 2**20), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "E",
                                                             "e18", "e19", "e30"])).map(lambda t: f"{t[0]}{t[1]}"),
)
nodes = st.builds(
    lambda cap, alloc_frac, page, factor, alloc_override: NodeFacts(
        capacity=cap, allocatable=alloc_override if alloc_override is not None else cap * alloc_frac // 100,
        page_size=page, factor=factor),
    st.one_of(st.integers(0, 2**46), st.sampled_from([8 * GI, 2060419072, INT64])),
    st.integers(0, 100),
    st.sampled_from([4096, 16384, 65536]),
    st.sampled_from([None, 0.9, 0.6, 1.0, 0.1]),
    st.one_of(st.none(), st.integers(0, INT64)),
)


@settings(max_examples=600, deadline=None)
@given(
    node=nodes,
    qos=st.sampled_from(list(QoSClass)),
    policy=st.sampled_from([Policy.HARD, Policy.SOFT, Policy.TIERED_RESERVATION, Policy.NONE]),
    limit=numbers,
    adj=st.one_of(numbers, st.integers(-1000, 1000)),
    unified=st.dictionaries(st.sampled_from(["memory.min", "memory.low", "memory.high"]), byte_strings, max_size=3),
    annotation=st.one_of(st.none(), quantities),
    given_request=st.one_of(st.none(), numbers),
    owned=st.sets(st.sampled_from(OWNED_KEYS)),
    reset_absent=st.booleans(),
)
def test_no_container_value_beyond_the_node(node, qos, policy, limit, adj, unified, annotation, given_request,
                                            owned, reset_absent):
    annotations = {} if annotation is None else {"memqos.io/requests": json.dumps({"c": annotation})}
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[qos], annotations=annotations)
    container = ContainerFacts(name="c", limit=limit, oom_score_adj=adj, unified=unified)
    req = None if given_request is None else Request(given_request, RequestSource.GIVEN)
    d = decide(pod, container, node, policy, req, reset_absent=reset_absent,
               kubelet_owns={k: "test" for k in owned})
    _assert_within_the_node(d, node, owned)


def test_guaranteed_limit_int64_on_an_8g_node():
    """The issue's case, at the decision: request from the limit, clamped to allocatable, noted."""
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[QoSClass.GUARANTEED])
    d = decide(pod, ContainerFacts(name="c", limit=INT64, oom_score_adj=-997), NODE_8G, Policy.HARD)
    assert d.unified_after["memory.min"] == str(NODE_8G.allocatable)
    assert d.request.source is RequestSource.GUARANTEED_LIMIT and d.request.bytes == NODE_8G.allocatable
    assert f"clamped: request {INT64} above allocatable {NODE_8G.allocatable}" in d.notes
    assert f"limit {INT64} above capacity {8 * GI}: treated as no limit" in d.notes
    assert "clamped: request" in d.reasons["memory.min"]


def test_burstable_limit_above_capacity_is_no_limit():
    """memory.high comes from allocatable, as for a container without a limit."""
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[QoSClass.BURSTABLE])
    c = ContainerFacts(name="c", limit=INT64, oom_score_adj=900, unified={"memory.min": str(64 * MI)})
    d = decide(pod, c, NODE_8G, Policy.HARD)
    unlimited = decide(pod, ContainerFacts(name="c", limit=0, oom_score_adj=900, unified={"memory.min": str(64 * MI)}),
                       NODE_8G, Policy.HARD)
    assert d.unified_after == unlimited.unified_after
    assert int(d.unified_after["memory.high"]) <= NODE_8G.allocatable
    assert any("treated as no limit" in n for n in d.notes)


@pytest.mark.parametrize("raw,expect_min,note", [
    ("9999999999999999999", None, "beyond int64"),  # 19 digits, above int64
    ("99999999999999999999", None, "beyond int64"),  # 20 digits
    ("9223372036854775807", str(8 * GI - 512 * MI), "clamped: request 9223372036854775807 above allocatable"),
    ("8589934593", str(8 * GI - 512 * MI), "clamped: request 8589934593 above allocatable"),
])
def test_kubelet_unified_beyond_the_node(raw, expect_min, note):
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[QoSClass.BURSTABLE])
    d = decide(pod, ContainerFacts(name="c", limit=0, oom_score_adj=999, unified={"memory.min": raw}),
               NODE_8G, Policy.HARD)
    assert d.unified_after.get("memory.min") == expect_min
    assert note in d.request.note + " ".join(d.notes)


@pytest.mark.parametrize("quantity,expect,note", [
    ("7Ei", 8 * GI - 512 * MI, "clamped: request 8070450532247928832 above allocatable"),
    ("9Ei", None, "out of range"),
    ("1e30", None, "out of range"),
    ("-1Gi", None, "negative"),
])
def test_annotation_beyond_the_node(quantity, expect, note):
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[QoSClass.BURSTABLE],
                   annotations={"memqos.io/requests": json.dumps({"c": quantity})})
    # oom_score_adj 3: the request may be anything from 99.7 % of the capacity up (no upper end)
    d = decide(pod, ContainerFacts(name="c", limit=0, oom_score_adj=3), NODE_8G, Policy.HARD)
    if expect is None:
        assert d.request.source is not RequestSource.ANNOTATION
    else:
        assert d.unified_after["memory.min"] == str(expect)
    assert note in d.request.note + " ".join(d.notes)


@pytest.mark.parametrize("adj", [-(2**63), -1001, 1001, INT64])
def test_oom_score_adj_out_of_range_is_ignored_and_noted(adj):
    pod = PodFacts(uid=UID)  # no cgroup parent: QoS from oom_score_adj
    d = decide(pod, ContainerFacts(name="c", oom_score_adj=adj), NODE_8G, Policy.HARD)
    assert d.request.bytes == 0 and "memory.min" not in d.unified_after
    assert "outside [-1000, 1000]" in d.request.note


def test_kubelet_owned_values_beyond_the_node_are_clamped_and_noted():
    pod = PodFacts(uid=UID, cgroup_parent=PARENTS[QoSClass.BURSTABLE])
    c = ContainerFacts(name="c", oom_score_adj=999,
                       unified={"memory.min": "99999999999999999999", "memory.high": str(INT64)})
    d = decide(pod, c, NODE_8G, Policy.HARD, kubelet_owns={"memory.min": "gate on", "memory.high": "factor"})
    assert d.unified_after["memory.min"] == str(NODE_8G.allocatable)
    assert d.unified_after["memory.high"] == "max"
    assert sum("clamped: kubelet's" in n for n in d.notes) == 2


def test_pod_rule_treats_beyond_int64_as_absent():
    assert container_request({"memory.min": "9999999999999999999"}, {}, lambda: (5, "derived"))[0] == 5
    assert parse_annotation({"memqos.io/request": json.dumps({"bytes": 2**64})}) is None


# -- node targets ----------------------------------------------------------------------------
def _pod(uid, active=True):
    return SimpleNamespace(uid=uid, active=active, containers={}, label=lambda: f"ns/{uid}")


def _req(n):
    return SimpleNamespace(bytes=n, explain=lambda names: f"sum {n}")


@settings(max_examples=400, deadline=None)
@given(
    requests=st.lists(st.tuples(st.sampled_from([QoSClass.GUARANTEED, QoSClass.BURSTABLE]),
                                st.one_of(sizes, st.integers(0, INT64), st.integers(0, 2**66))), max_size=6),
    reserved=st.lists(st.one_of(sizes, st.integers(0, INT64)), max_size=2),
    capacity=st.one_of(st.integers(1, 2**46), st.sampled_from([8 * GI, 2060419072, INT64])),
    alloc=st.one_of(st.integers(0, 100).map(lambda p: ("frac", p)), st.integers(0, INT64).map(lambda a: ("abs", a))),
    page=st.sampled_from([1, 4096, 65536]),
    policy=st.sampled_from([Policy.HARD, Policy.SOFT, Policy.TIERED_RESERVATION, Policy.NONE]),
)
def test_no_node_target_beyond_the_node(requests, reserved, capacity, alloc, page, policy):
    allocatable = capacity * alloc[1] // 100 if alloc[0] == "frac" else alloc[1]
    pods = [PlacedPod(_pod(f"p{i}"), qos, f"kubepods/{'burstable/' if qos is QoSClass.BURSTABLE else ''}podp{i}",
                      _req(n)) for i, (qos, n) in enumerate(requests)]
    res = [Reserved(f"r{i}", f"r{i}.slice", n) for i, n in enumerate(reserved)]
    targets = node_targets(pods, "kubepods", "kubepods/burstable", "kubepods/besteffort", policy, page, res,
                           capacity=capacity, allocatable=allocatable)
    pods_cap = min(allocatable, capacity) if allocatable > 0 else capacity
    for (path, file), t in targets.items():
        ceiling = capacity if path.endswith(".slice") else pods_cap
        assert 0 <= t.value <= ceiling, (path, file, t.value, t.why)
        assert t.value % page == 0
    if policy is Policy.HARD and requests:
        total = sum(n for _, n in requests)
        kp = targets[("kubepods", MIN)]
        assert kp.value == (min(total, pods_cap) // page) * page
        assert ("clamped:" in kp.why) == (total > pods_cap)


def test_node_targets_without_node_facts_stay_within_int64():
    """Capacity not known (0): int64 is the cap, never a sum beyond it."""
    pods = [PlacedPod(_pod(f"p{i}"), QoSClass.GUARANTEED, f"kubepods/podp{i}", _req(INT64)) for i in range(3)]
    targets = node_targets(pods, "kubepods", "kubepods/burstable", "kubepods/besteffort", Policy.HARD, 4096)
    assert all(0 <= t.value <= INT64 for t in targets.values())
    assert targets[("kubepods", MIN)].level == NODE and "clamped:" in targets[("kubepods", MIN)].why


# -- the rewriter end to end -------------------------------------------------------------------
def _run(hooks, method, request: bytes, response: bytes = b""):
    call = RpcCall(method, 0.0, request=request)
    forwarded = hooks.rewrite(call)
    hooks.finished(call.complete(0.1, forwarded if forwarded != request else None, [response], "OK", ""))
    return forwarded


def test_rewriter_create_and_update_with_an_int64_limit():
    records = []
    hooks = ContainerMemoryQoS(NODE_8G, Policy.HARD, records.append)
    sb = sandbox_config("huge", UID, "guaranteed")
    req = create_container("s1", sb, "main", "guaranteed", limit=INT64)
    out = pb.CreateContainerRequest.FromString(_run(hooks, CREATE_CONTAINER, req.SerializeToString(),
                                                    pb.CreateContainerResponse(container_id="c1").SerializeToString()))
    unified = dict(out.config.linux.resources.unified)
    assert out.config.linux.resources.memory_limit_in_bytes == INT64  # the limit itself is the runtime's
    assert unified == {"memory.min": str(NODE_8G.allocatable)}
    assert json.loads(out.config.annotations["memqos.io/request"])["bytes"] == NODE_8G.allocatable
    rec = records[0]
    assert rec["event"] == "rewrite" and rec["request"] == NODE_8G.allocatable
    assert any(n.startswith(f"clamped: request {INT64} above allocatable") for n in rec["notes"])

    upd = update_resources("c1", limit=INT64, oom_score_adj=-997)
    out = pb.UpdateContainerResourcesRequest.FromString(_run(hooks, UPDATE_CONTAINER_RESOURCES, upd.SerializeToString()))
    assert dict(out.linux.unified) == {"memory.min": str(NODE_8G.allocatable), "memory.low": "0", "memory.high": "max"}
    assert any("clamped: request" in n for n in records[1]["notes"])


def test_rewriter_negative_limit_is_no_limit_not_a_fail_open():
    records = []
    hooks = ContainerMemoryQoS(NODE_8G, Policy.HARD, records.append)
    sb = sandbox_config("neg", UID, "burstable", annotations={"memqos.io/requests": '{"main": "64Mi"}'})
    req = create_container("s1", sb, "main", "burstable", request=64 * MI, limit=-1)
    out = pb.CreateContainerRequest.FromString(_run(hooks, CREATE_CONTAINER, req.SerializeToString(),
                                                    pb.CreateContainerResponse(container_id="c1").SerializeToString()))
    unified = dict(out.config.linux.resources.unified)
    assert unified["memory.min"] == str(64 * MI)
    assert 0 < int(unified["memory.high"]) <= NODE_8G.allocatable
    assert records[0]["event"] == "rewrite"
    assert any("memory_limit_in_bytes -1" in n and "no limit" in n for n in records[0]["notes"])


# -- the reconciler end to end, on a tree of real files ------------------------------------------
@pytest.fixture
def stack(tmp_path):
    from tests.test_reconciler import Stack

    s = Stack(tmp_path)
    yield s
    s.close()


def test_reconciler_int64_guaranteed_limit_end_to_end(stack):
    """The issue's case: a Guaranteed container with memory_limit_in_bytes = 2^63-1 on a node of
    2060419072 bytes (allocatable 200Mi less): pod and kubepods memory.min stay within allocatable."""
    from tests.reconciler_support import CAPACITY

    allocatable = CAPACITY - 200 * MI  # serve_args: kubeReserved 100Mi + systemReserved 100Mi
    k, t = stack.kubelet, stack.tree
    g1 = k.run_pod("huge-1", "5d9d3685019daf0a672ac2d2de981877", "guaranteed", overhead=10 * MI)
    k.create(g1, "main", "guaranteed", limit=INT64)
    stack.sync()  # (the kubepods sum is then allocatable + overhead, before the second pod)
    g2 = k.run_pod("huge-2", "6d9d3685019daf0a672ac2d2de981877", "guaranteed")
    k.create(g2, "main", "guaranteed", limit=INT64)
    b = k.run_pod("kubelet-sent", "b1013052-e446-98fd-e2f5-96c3bd9b3930", "burstable")
    k.create(b, "main", "burstable", request=32 * MI, unified={"memory.min": "9999999999999999999"}, exact=False)
    stack.sync()
    page_alloc = allocatable // 4096 * 4096
    for rel, (mn, lo) in t.values().items():
        assert 0 <= mn <= allocatable and 0 <= lo <= allocatable, (rel, mn, lo)
    assert t.get(t.kubepods) == page_alloc
    assert t.get(t.pod("guaranteed", "5d9d3685019daf0a672ac2d2de981877")) == page_alloc
    writes = [r for r in stack.records() if r["event"] == "cgroup-write"]
    assert writes and all(int(r["new"]) <= allocatable for r in writes)
    for rel in (t.kubepods, t.pod("guaranteed", "5d9d3685019daf0a672ac2d2de981877")):  # allocatable + overhead
        last = [r for r in writes if r["path"] == str(t.root / rel)][-1]
        assert f"clamped: {allocatable + 10 * MI} above allocatable {allocatable}" in last["why"], last
    created = [r for r in stack.records() if r.get("method") == "CreateContainer" and r.get("qos") == "Guaranteed"]
    assert len(created) == 2 and all(any("clamped: request" in n for n in r["notes"]) for r in created)


# -- effects: the last line of defence ---------------------------------------------------------
def _tree(tmp_path, name="kubepods"):
    root = tmp_path / "cg"
    (root / name).mkdir(parents=True)
    for f in ("memory.min", "memory.low"):
        (root / name / f).write_text("0\n")
    return root


@pytest.mark.parametrize("value", [8 * GI + 1, INT64, 2**64, -1])
def test_cgroupfs_refuses_values_beyond_its_ceiling(tmp_path, value):
    root = _tree(tmp_path)
    fs = CgroupFS(str(root), ["kubepods"], ceiling=8 * GI)
    with pytest.raises(ValueRefused):
        fs.write("kubepods", "memory.min", value, "test")
    assert (root / "kubepods" / "memory.min").read_text() == "0\n" and not fs.writes
    assert issubclass(ValueRefused, PathRefused)  # the reconciler reports it as a refusal (cgroup-refused)
    assert fs.write("kubepods", "memory.min", 8 * GI, "test") is not None


def test_cgroupfs_without_a_ceiling_still_refuses_beyond_int64(tmp_path):
    root = _tree(tmp_path)
    fs = CgroupFS(str(root), ["kubepods"])
    with pytest.raises(ValueRefused):
        fs.write("kubepods", "memory.min", INT64 + 1, "test")
    assert fs.write("kubepods", "memory.min", INT64 // 4096 * 4096, "test") is not None


def test_systemd_writer_refuses_before_asking_systemd(tmp_path):
    root = _tree(tmp_path, "kubepods.slice")
    asked = []
    bus = SimpleNamespace(set_unit_properties=lambda *a: asked.append(a), down=False)
    fs = CgroupWriter(str(root), ["kubepods.slice"], mode="dbus", bus=bus, ceiling=8 * GI, settle=0)
    fs.set_driver("systemd")
    with pytest.raises(ValueRefused):
        fs.write("kubepods.slice", "memory.min", INT64, "test")
    assert asked == []
    fs.write("kubepods.slice", "memory.min", 8 * GI, "test")
    assert asked == [("kubepods.slice", [("MemoryMin", 8 * GI)])]


def test_reconciler_reports_a_refused_value_and_goes_on(tmp_path):
    """Were a target above the capacity ever computed (a bug above the writer), the reconciler's
    writer refuses it, says so (cgroup-refused) and still makes the other writes."""
    from shim.decision.node import QOS, Target
    from shim.node.facts import KubeletFacts
    from shim.node.reconciler import Reconciler
    from tests.reconciler_support import FakeCgroupTree

    class Buggy(Reconciler):
        def targets(self):
            out = super().targets()
            out[("kubepods/burstable", MIN)] = Target("kubepods/burstable", MIN, INT64 // 4096 * 4096, QOS, "a bug")
            out[("kubepods", MIN)] = Target("kubepods", MIN, 64 * MI, NODE, "fine")
            return out

    tree = FakeCgroupTree(tmp_path / "cgroup")
    records = []
    r = Buggy(cgroup_root=str(tree.root), kubelet=KubeletFacts(), policy=Policy.HARD, capacity=8 * GI,
              page_size=4096, emit=records.append, resync_interval=60).start()
    try:
        assert r.sync(5)
    finally:
        r.stop()
    assert tree.get("kubepods/burstable") == 0 and tree.get("kubepods") == 64 * MI
    refused = [x for x in records if x["event"] == "cgroup-refused"]
    assert len(refused) == 1 and f"above the node's capacity {8 * GI}" in refused[0]["reason"]
