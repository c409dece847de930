"""Node state on its own: the pod request rule (init containers, sidecars, restarts, overhead),
observed calls, and the targets computed from the state (no threads, no sockets)."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shim.decision.pod import CONTAINER_ANNOTATION
from shim.cri import pb
from shim.decision import Policy
from shim.effects import CgroupLayout
from shim.decision.pod import INIT, REGULAR, REPLACED, SIDECAR, UNSURE, pod_request
from shim.node.state import ContainerRecord, NodeState
from shim.node.reconciler import compute_targets
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import MI, create_container, sandbox_config

RS = "/runtime.v1.RuntimeService/"


def C(cid, name, req, order, **kw):
    return ContainerRecord(cid, "s1", name, request=req * MI, order=order, **kw)


# -- the pod request rule -------------------------------------------------------------------
def test_multi_pod_init_by_max_regular_summed():
    # the traced pod `multi`: init 16Mi ran and exited, then a (24Mi) and b (8Mi)
    init = C("i", "init", 16, 1, created_at=100, finished_at=200)
    a = C("a", "a", 24, 2, created_at=300, alive_at=10_000, exists_at=5_000)
    b = C("b", "b", 8, 3, created_at=400, exists_at=6_000)
    r = pod_request([init, a, b])
    assert r.bytes == 32 * MI and r.summed == 32 * MI and r.init_max == 16 * MI
    assert dict(r.kinds) == {"i": INIT, "a": REGULAR, "b": REGULAR}


def test_only_what_is_known_counts_while_the_pod_starts():
    init = C("i", "init", 16, 1, created_at=100)
    assert pod_request([init]).bytes == 16 * MI  # the newest container is summed
    init.finished_at = 200
    a = C("a", "a", 24, 2, created_at=300)
    assert pod_request([init, a]).bytes == 24 * MI  # max(16, 24)


def test_sidecars_add_to_the_init_containers_after_them_and_to_the_regular_ones():
    # setup (init 20) exits; proxy (sidecar 8) keeps running; migrate (init 30) exits; app 16
    setup = C("s", "setup", 20, 1, created_at=100, finished_at=150)
    proxy = C("p", "proxy", 8, 2, created_at=200, alive_at=900, exists_at=210)
    migrate = C("m", "migrate", 30, 3, created_at=300, finished_at=400, exists_at=310)
    app = C("a", "app", 16, 4, created_at=500, exists_at=510)
    r = pod_request([setup, proxy, migrate, app])
    # kubelet: max(16 + 8, 20, 30 + 8) = 38
    assert r.bytes == 38 * MI
    assert dict(r.kinds) == {"s": INIT, "p": SIDECAR, "m": INIT, "a": REGULAR}


def test_unknown_state_counts_like_an_init_container_the_lower_value():
    a = C("a", "a", 24, 1, created_at=100)  # never observed after b was created
    b = C("b", "b", 8, 2, created_at=200)
    r = pod_request([a, b])
    assert r.bytes == 24 * MI and r.kinds["a"] == UNSURE  # not 32: unsure -> lower
    a.alive_at, b.exists_at = 1000, 900  # then seen running after b existed
    assert pod_request([a, b]).bytes == 32 * MI


def test_restarted_container_replaces_its_earlier_attempt():
    first = C("a0", "app", 64, 1, created_at=100, finished_at=150)
    second = C("a1", "app", 64, 2, created_at=200, attempt=1)
    r = pod_request([first, second])
    assert r.bytes == 64 * MI and r.kinds["a0"] == REPLACED


def test_regular_container_exiting_early_is_never_overcounted():
    # a regular container that exited before its sibling was created looks like an init
    # container: counted by max, the lower value
    a = C("a", "a", 10, 1, created_at=100, finished_at=110)
    b = C("b", "b", 20, 2, created_at=200)
    assert pod_request([a, b]).bytes == 20 * MI


def test_overhead_is_added():
    assert pod_request([C("a", "a", 10, 1)], overhead=5 * MI).bytes == 15 * MI
    assert pod_request([], overhead=5 * MI).bytes == 5 * MI


def _true_request(spec):
    """kubelet's PodRequests for a spec [(kind, MiB)] in declaration order."""
    regular = sum(r for k, r in spec if k == "regular")
    sidecars = 0
    init_max = 0
    for k, r in spec:
        if k == "sidecar":
            sidecars += r
            init_max = max(init_max, sidecars)
        elif k == "init":
            init_max = max(init_max, r + sidecars)
    return max(regular + sidecars, init_max)


specs = st.lists(st.tuples(st.sampled_from(["init", "sidecar"]), st.integers(0, 64)), max_size=4).flatmap(
    lambda inits: st.lists(st.tuples(st.just("regular"), st.integers(0, 64)), min_size=1, max_size=4).map(
        lambda regs: inits + regs))


@settings(max_examples=300, deadline=None)
@given(specs, st.data())
def test_never_above_the_true_request_whatever_is_known(spec, data):
    """Simulate the kubelet's start sequence, with random knowledge of states: the computed
    value is never above the kubelet's, and equals it when every state is known."""
    t = 0
    recs = []
    for i, (kind, r) in enumerate(spec):
        t += 10
        c = ContainerRecord(f"c{i}", "s", f"n{i}", request=r * MI, order=i + 1, created_at=t, exists_at=t)
        if kind == "init":
            t += 5
            c.finished_at = t  # ends before the next container is created
        recs.append((kind, c))
    now = t + 100
    full = []
    partial = []
    for kind, c in recs:
        full_c = ContainerRecord(**{**c.__dict__})
        if kind != "init":
            full_c.alive_at = now
        full.append(full_c)
        p = ContainerRecord(**{**c.__dict__})
        if not data.draw(st.booleans(), label=f"finished known {c.id}"):
            p.finished_at = 0
        if kind != "init" and data.draw(st.booleans(), label=f"alive known {c.id}"):
            p.alive_at = now
        # a regular container may even have exited early: known or not, never counted higher
        partial.append(p)
    truth = _true_request(spec) * MI
    assert pod_request(full).bytes == truth
    assert pod_request(partial).bytes <= truth


# -- observed calls ----------------------------------------------------------------------
def _call(method, req, resp=None, forwarded=None, start=1000.0):
    return RpcCall(RS + method, start, 1.0, req.SerializeToString(),
                        forwarded.SerializeToString() if forwarded is not None else None,
                        [resp.SerializeToString()] if resp is not None else [], "OK", "")


def test_calls_build_pods_and_containers():
    s = NodeState(capacity=2060419072)
    cfg = sandbox_config("multi", "0a1b2c", "burstable")
    cfg.linux.overhead.memory_limit_in_bytes = 4 * MI
    s.apply_call(_call("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg), pb.RunPodSandboxResponse(pod_sandbox_id="s1")))
    pod = s.pods["0a1b2c"]
    assert pod.name == "multi" and pod.overhead == 4 * MI and pod.active
    req = create_container("s1", cfg, "init", "burstable", request=16 * MI)
    fwd = pb.CreateContainerRequest.FromString(req.SerializeToString())
    fwd.config.linux.resources.unified["memory.min"] = str(16 * MI)
    fwd.config.annotations[CONTAINER_ANNOTATION] = json.dumps({"bytes": 16 * MI, "source": "x", "qos": "Burstable",
                                                               "cgroup_parent": cfg.linux.cgroup_parent})
    changed, refresh = s.apply_call(_call("CreateContainer", req, pb.CreateContainerResponse(container_id="c1"),
                                          forwarded=fwd))
    assert changed and refresh == "0a1b2c"
    c = s.container("c1")
    assert c.request == 16 * MI and c.source == "unified" and c.create_start and c.exists_at
    assert s.request(pod).bytes == 20 * MI
    # the kubelet's ContainerStatus poll says it exited
    st_ = pb.ContainerStatusResponse()
    st_.status.id, st_.status.state, st_.status.created_at, st_.status.finished_at = "c1", pb.CONTAINER_EXITED, 5, 9
    s.apply_call(_call("ContainerStatus", pb.ContainerStatusRequest(container_id="c1"), st_, start=1001.0))
    assert c.finished_at == 9 and c.exited_by
    # a is created after that: init is counted by max
    req_a = create_container("s1", cfg, "a", "burstable", request=24 * MI, unified={"memory.min": str(24 * MI)})
    s.apply_call(_call("CreateContainer", req_a, pb.CreateContainerResponse(container_id="c2"), start=1002.0))
    assert s.request(pod).bytes == (24 + 4) * MI
    # resize through an update carrying the new memory.min
    upd = pb.UpdateContainerResourcesRequest(container_id="c2")
    upd.linux.unified["memory.min"] = str(40 * MI)
    s.apply_call(_call("UpdateContainerResources", upd, pb.UpdateContainerResourcesResponse()))
    assert s.request(pod).bytes == (40 + 4) * MI
    ups = pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id="s1")
    ups.overhead.memory_limit_in_bytes = 0
    s.apply_call(_call("UpdatePodSandboxResources", ups, pb.UpdatePodSandboxResourcesResponse()))
    assert s.request(pod).bytes == 40 * MI
    s.apply_call(_call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id="s1"), pb.StopPodSandboxResponse()))
    assert not pod.active
    s.apply_call(_call("RemoveContainer", pb.RemoveContainerRequest(container_id="c1"), pb.RemoveContainerResponse()))
    assert s.container("c1") is None
    s.apply_call(_call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id="s1"), pb.RemovePodSandboxResponse()))
    assert s.pods == {} and s.container_pod == {} and s.sandbox_pod == {}


def test_failed_calls_change_nothing():
    s = NodeState()
    cfg = sandbox_config("p", "0a", "burstable")
    call = _call("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg), None)
    call.code = "DEADLINE_EXCEEDED"
    assert s.apply_call(call) == (False, None) and s.pods == {}


def test_container_without_annotation_gets_the_decision_request():
    s = NodeState(capacity=2060419072)
    cfg = sandbox_config("g", "0c", "guaranteed")
    req = create_container("sg", cfg, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    s.apply_call(_call("CreateContainer", req, pb.CreateContainerResponse(container_id="g1")))
    c = s.container("g1")
    assert c.request == 64 * MI and c.source == "derived:guaranteed-limit"
    # Burstable with only oom_score_adj: the lower bound, never above the true request
    cfg_b = sandbox_config("b", "0d", "burstable")
    req_b = create_container("sb", cfg_b, "main", "burstable", request=32 * MI, limit=128 * MI)
    s.apply_call(_call("CreateContainer", req_b, pb.CreateContainerResponse(container_id="b1")))
    assert 31 * MI < s.container("b1").request <= 32 * MI


# -- targets --------------------------------------------------------------------------------
def _state_with(pods, driver="cgroupfs"):
    s = NodeState()
    for uid, qos, reqs, active in pods:
        pod = s.upsert_pod(uid, "ns", f"pod-{uid}")
        from shim.node.state import SandboxRecord

        from tests.kubelet_requests import cgroup_parent
        s.add_sandbox(pod, SandboxRecord(f"s-{uid}", uid, active, 1, cgroup_parent(qos, uid, driver)))
        for i, r in enumerate(reqs):
            s.add_container(pod, ContainerRecord(f"{uid}-{i}", f"s-{uid}", f"c{i}", request=r * MI,
                                                 alive_at=10**12, exists_at=1))
    return s


def _values(targets):
    return {k: t.value // MI for k, t in targets.items() if t.value}


def test_targets_request_policy():
    s = _state_with([("0a", "guaranteed", [64], True), ("0b", "burstable", [32, 8], True),
                     ("0c", "besteffort", [0], True), ("0d", "burstable", [100], False)])
    t, refused = compute_targets(s, CgroupLayout("cgroupfs"), Policy.HARD, 4096)
    assert refused == []
    assert _values(t) == {("kubepods", "memory.min"): 104, ("kubepods/burstable", "memory.min"): 40,
                          ("kubepods/pod0a", "memory.min"): 64, ("kubepods/burstable/pod0b", "memory.min"): 40}
    assert t[("kubepods/burstable/pod0d", "memory.min")].value == 0  # stopped


def test_targets_tiered_and_none():
    s = _state_with([("0a", "guaranteed", [64], True), ("0b", "burstable", [32], True)], "systemd")
    t, _ = compute_targets(s, CgroupLayout("systemd"), Policy.TIERED_RESERVATION, 4096)
    kp, bq = "kubepods.slice", "kubepods.slice/kubepods-burstable.slice"
    assert _values(t) == {(kp, "memory.min"): 64, (kp, "memory.low"): 96, (bq, "memory.low"): 32,
                          (f"{kp}/kubepods-pod0a.slice", "memory.min"): 64,
                          (f"{bq}/kubepods-burstable-pod0b.slice", "memory.low"): 32}
    t, _ = compute_targets(s, CgroupLayout("systemd"), Policy.NONE, 4096)
    assert _values(t) == {} and (kp, "memory.min") in t


def test_targets_round_down_to_the_page():
    s = _state_with([("0b", "burstable", [0], True)])
    next(iter(s.pods["0b"].containers.values())).request = 32966706  # an oom_score_adj lower bound
    t, _ = compute_targets(s, CgroupLayout("cgroupfs"), Policy.HARD, 4096)
    assert t[("kubepods/burstable/pod0b", "memory.min")].value == 32966706 // 4096 * 4096


def test_hostile_pods_are_refused_and_left_out_of_the_sums():
    s = _state_with([("0a", "burstable", [10], True), ("0b", "burstable", [20], True),
                     ("0c", "burstable", [30], True), ("0d", "guaranteed", [40], True)])
    s.pods["0a"].sandboxes["s-0a"].cgroup_parent = "/kubepods/burstable/pod0a/../../../etc"
    s.pods["0b"].sandboxes["s-0b"].cgroup_parent = "/etc/kubepods/burstable/pod0b"  # absolute jump
    s.pods["0c"].sandboxes["s-0c"].cgroup_parent = "/kubepods/burstable/pod0d"  # someone else's pod
    t, refused = compute_targets(s, CgroupLayout("cgroupfs"), Policy.HARD, 4096)
    assert len(refused) == 3
    assert _values(t) == {("kubepods", "memory.min"): 40, ("kubepods/pod0d", "memory.min"): 40}
