"""Protection in force is kept (shim.decision.protection) and the node state reports what left
(NodeState departures): the pure function over hand-made targets, and the departures each
CRI event and each runtime listing produces."""
from __future__ import annotations

from shim.cri.events import (
    ContainerRemoved,
    ContainerResourcesUpdated,
    PodResourcesUpdated,
    PodSandboxRemoved,
    PodSandboxStopped,
)
from shim.decision import Policy, QoSClass
from shim.decision.node import LOW, MIN, NODE, POD, QOS, PlacedPod, node_targets
from shim.decision.pod import PodRequest
from shim.decision.protection import keep_protection
from shim.node.state import MAX_DEPARTED_PODS, ContainerRecord, NodeState, SandboxRecord, Snapshot, SandboxView

MI = 2**20
PAGE = 4096
CAP = 8 * 1024 * MI
KP, BQ, BE = "kubepods", "kubepods/burstable", "kubepods/besteffort"


class Pod:
    def __init__(self, uid, active=True):
        self.uid, self.active, self.containers = uid, active, {}

    def label(self):
        return f"default/{self.uid}"


def req(n):
    return PodRequest(n, n, 0, 0, {})


def placed(uid, qos, n, active=True):
    path = f"kubepods/pod{uid}" if qos is QoSClass.GUARANTEED else f"kubepods/{qos.value.lower()}/pod{uid}"
    return PlacedPod(Pod(uid, active), qos, path, req(n) if active else None)


def targets(*pods, policy=Policy.HARD):
    return node_targets(pods, KP, BQ, BE, policy, PAGE)


def values(out):
    return {k: t.value for k, t in out.items()}


G = QoSClass.GUARANTEED
B = QoSClass.BURSTABLE


# -- the pure function -----------------------------------------------------------------------------
def test_a_pod_value_in_force_is_kept_when_the_computed_one_is_lower_and_no_pod_left():
    # the kubelet (or a shim before this one) wrote 32Mi; only one of two containers is known yet
    t = targets(placed("a", B, 16 * MI))
    out = keep_protection(t, {("kubepods/burstable/poda", MIN): 32 * MI}, {}, CAP, PAGE)
    got = out[("kubepods/burstable/poda", MIN)]
    assert got.value == 32 * MI
    assert got.held == f"value in force {32 * MI} kept above the computed {16 * MI}, no pod left"
    assert "held:" in got.why
    # the sums follow the pods' values as kept
    assert out[(BQ, MIN)].value == 32 * MI and out[(KP, MIN)].value == 32 * MI
    assert "held" in out[(BQ, MIN)].why


def test_a_pod_with_a_departure_goes_down_to_the_computed_value_and_says_why():
    t = targets(placed("a", B, 16 * MI), placed("b", B, 8 * MI))
    in_force = {("kubepods/burstable/poda", MIN): 32 * MI, ("kubepods/burstable/podb", MIN): 8 * MI,
                (BQ, MIN): 40 * MI, (KP, MIN): 40 * MI}
    out = keep_protection(t, in_force, {"a": ("pod default/a: container side removed",)}, CAP, PAGE)
    assert values(out)[("kubepods/burstable/poda", MIN)] == 16 * MI
    assert out[("kubepods/burstable/poda", MIN)].departure == "pod default/a: container side removed"
    # the sums lose exactly what the departed pod gave up (40 - 16 = 24)
    assert values(out)[(BQ, MIN)] == 24 * MI and values(out)[(KP, MIN)] == 24 * MI
    assert "container side removed" in out[(BQ, MIN)].departure


def test_a_sum_in_force_is_kept_less_the_departed_pods_drop_only():
    # the burstable cgroup holds 100Mi (someone's value the shim cannot attribute); one pod leaves 10Mi
    t = targets(placed("a", B, 0), placed("b", B, 8 * MI))
    in_force = {("kubepods/burstable/poda", MIN): 10 * MI, ("kubepods/burstable/podb", MIN): 8 * MI,
                (BQ, MIN): 100 * MI, (KP, MIN): 100 * MI}
    out = keep_protection(t, in_force, {"a": ("pod default/a: sandbox stopped",)}, CAP, PAGE)
    assert values(out)[(BQ, MIN)] == 90 * MI and values(out)[(KP, MIN)] == 90 * MI
    assert "less" in out[(BQ, MIN)].held
    # without the departure nothing goes down
    out = keep_protection(t, in_force, {}, CAP, PAGE)
    assert values(out)[(BQ, MIN)] == 100 * MI and values(out)[("kubepods/burstable/poda", MIN)] == 10 * MI


def test_a_guaranteed_departure_does_not_lower_the_burstable_sum():
    t = targets(placed("g", G, 0), placed("b", B, 8 * MI))
    in_force = {("kubepods/podg", MIN): 64 * MI, ("kubepods/burstable/podb", MIN): 8 * MI,
                (BQ, MIN): 50 * MI, (KP, MIN): 72 * MI}
    out = keep_protection(t, in_force, {"g": ("pod default/g: container main removed",)}, CAP, PAGE)
    assert values(out)[(BQ, MIN)] == 50 * MI  # g was never part of it
    assert values(out)[(KP, MIN)] == 8 * MI
    assert out[(BQ, MIN)].departure == ""


def test_a_pod_gone_without_a_known_value_leaves_the_sums_at_the_running_pods():
    t = targets(placed("b", B, 8 * MI))
    in_force = {("kubepods/burstable/podb", MIN): 8 * MI, (BQ, MIN): 40 * MI, (KP, MIN): 40 * MI}
    out = keep_protection(t, in_force, {"gone": ("pod default/gone: gone from the runtime listing",)}, CAP, PAGE)
    assert values(out)[(BQ, MIN)] == 8 * MI and values(out)[(KP, MIN)] == 8 * MI
    assert "gone from the runtime listing" in out[(KP, MIN)].departure


def test_at_start_the_sums_get_no_floor_beyond_the_running_pods_but_the_pods_keep_theirs():
    t = targets(placed("a", B, 16 * MI))
    in_force = {("kubepods/burstable/poda", MIN): 32 * MI, (BQ, MIN): 96 * MI, (KP, MIN): 96 * MI}
    out = keep_protection(t, in_force, {}, CAP, PAGE, start=True)
    assert values(out)[("kubepods/burstable/poda", MIN)] == 32 * MI
    assert values(out)[(BQ, MIN)] == 32 * MI and values(out)[(KP, MIN)] == 32 * MI


def test_a_value_in_force_above_the_node_is_capped_before_it_becomes_a_floor():
    t = targets(placed("a", B, 16 * MI))
    huge = 9223372036854771712
    out = keep_protection(t, {("kubepods/burstable/poda", MIN): huge, (BQ, MIN): huge, (KP, MIN): huge},
                          {}, CAP + 123, PAGE)
    assert values(out)[("kubepods/burstable/poda", MIN)] == CAP
    assert values(out)[(BQ, MIN)] == CAP and values(out)[(KP, MIN)] == CAP
    assert "capped" in out[("kubepods/burstable/poda", MIN)].held


def test_what_the_policy_sets_to_zero_goes_to_zero():
    # Soft after Hard: memory.min held the request; the policy now protects with memory.low
    t = targets(placed("a", B, 16 * MI), policy=Policy.SOFT)
    in_force = {("kubepods/burstable/poda", MIN): 16 * MI, (BQ, MIN): 16 * MI, (KP, MIN): 16 * MI}
    out = keep_protection(t, in_force, {}, CAP, PAGE)
    assert values(out)[("kubepods/burstable/poda", MIN)] == 0
    assert values(out)[(BQ, MIN)] == 0 and values(out)[(KP, MIN)] == 0
    assert values(out)[("kubepods/burstable/poda", LOW)] == 16 * MI
    # TieredReservation: a Burstable pod moves to memory.low, a Guaranteed one keeps memory.min,
    # kubepods' memory.min is the Guaranteed sum
    t = targets(placed("a", B, 16 * MI), placed("g", G, 64 * MI), policy=Policy.TIERED_RESERVATION)
    in_force = {("kubepods/burstable/poda", MIN): 16 * MI, ("kubepods/podg", MIN): 64 * MI,
                (BQ, MIN): 16 * MI, (KP, MIN): 80 * MI}
    out = keep_protection(t, in_force, {}, CAP, PAGE, start=True)
    assert values(out)[("kubepods/burstable/poda", MIN)] == 0
    assert values(out)[(BQ, MIN)] == 0 and values(out)[(KP, MIN)] == 64 * MI
    assert values(out)[(KP, LOW)] == 80 * MI
    # None: everything 0; a stopped pod: 0
    out = keep_protection(targets(placed("a", B, 16 * MI), policy=Policy.NONE),
                          {("kubepods/burstable/poda", MIN): 16 * MI}, {}, CAP, PAGE)
    assert set(values(out).values()) == {0}
    out = keep_protection(targets(placed("a", B, 0, active=False)),
                          {("kubepods/burstable/poda", MIN): 16 * MI}, {}, CAP, PAGE)
    assert values(out)[("kubepods/burstable/poda", MIN)] == 0


def test_levels_and_members_of_the_targets():
    t = targets(placed("a", B, 16 * MI), placed("g", G, 64 * MI))
    assert t[("kubepods/burstable/poda", MIN)].pod == "a" and t[("kubepods/burstable/poda", MIN)].protecting
    assert not t[("kubepods/burstable/poda", LOW)].protecting
    assert t[(BQ, MIN)].members == {"a"} and t[(BQ, MIN)].level == QOS
    assert t[(KP, MIN)].members == {"a", "g"} and t[(KP, MIN)].level == NODE
    assert t[("kubepods/podg", MIN)].level == POD


# -- departures from the node state -----------------------------------------------------------------
def _state():
    s = NodeState(CAP)
    pod = s.upsert_pod("u1", "default", "web")
    s.add_sandbox(pod, SandboxRecord("sb1", "u1", True, 0, "/kubepods/burstable/podu1", 2 * MI))
    s.add_container(pod, ContainerRecord("c1", "sb1", "main", request=32 * MI))
    s.add_container(pod, ContainerRecord("c2", "sb1", "side", request=8 * MI))
    return s


def test_removing_a_container_stopping_and_removing_a_sandbox_are_departures():
    s = _state()
    assert s.take_departures() == {}
    s.apply(ContainerRemoved(container_id="c2"))
    assert s.take_departures() == {"u1": ("pod default/web: container side removed",)}
    assert s.take_departures() == {}  # taken once
    s.apply(PodSandboxStopped(sandbox_id="sb1"))
    s.apply(PodSandboxRemoved(sandbox_id="sb1"))
    assert s.take_departures() == {"u1": ("pod default/web: sandbox stopped", "pod default/web: sandbox removed")}


def test_a_lowered_request_or_overhead_is_a_departure_a_raised_one_is_not():
    s = _state()
    s.apply(ContainerResourcesUpdated("c1", {"memory.min": str(64 * MI)}, {}, 0))
    assert s.take_departures() == {}
    s.apply(ContainerResourcesUpdated("c1", {"memory.min": str(16 * MI)}, {}, 0))
    assert s.take_departures() == {"u1": (f"pod default/web: container main request lowered by "
                                          f"UpdateContainerResources ({64 * MI} -> {16 * MI})",)}
    s.apply(PodResourcesUpdated(sandbox_id="sb1", overhead=4 * MI))
    assert s.take_departures() == {}
    s.apply(PodResourcesUpdated(sandbox_id="sb1", overhead=MI))
    assert list(s.take_departures()) == ["u1"]


def test_what_a_runtime_listing_no_longer_shows_is_a_departure():
    s = _state()
    other = s.upsert_pod("u2", "default", "db")
    s.add_sandbox(other, SandboxRecord("sb2", "u2", True, 0, "/kubepods/burstable/podu2"))
    snap = Snapshot(gen=1)
    pod = s.pods["u1"]
    snap.sandboxes.append(SandboxView(SandboxRecord("sb1", "u1", False, 0, "/kubepods/burstable/podu1"),
                                      type(pod)("u1", "default", "web")))
    snap.containers.append(ContainerRecord("c1", "sb1", "main", request=32 * MI))
    s.rebuild(snap)
    assert s.take_departures() == {
        "u1": ("pod default/web: container side gone from the runtime listing",
               "pod default/web: sandbox not ready in the runtime listing"),
        "u2": ("pod default/db: gone from the runtime listing",)}
    # the first listing after start: nothing was known, nothing left
    fresh = NodeState(CAP)
    fresh.rebuild(snap)
    assert fresh.take_departures() == {}


def test_departures_are_bounded():
    s = NodeState(CAP)
    for i in range(MAX_DEPARTED_PODS + 10):
        s.depart(f"u{i}", "left")
    for _ in range(20):
        s.depart("u0", f"again {_}")
    assert len(s.departures) == MAX_DEPARTED_PODS and s.departures_dropped == 10
    assert len(s.departures["u0"]) <= 8
    # what could not be kept is not lost: every pod known is taken as departed once
    s.upsert_pod("running")
    taken = s.take_departures()
    assert len(taken) == MAX_DEPARTED_PODS + 1 and "more than" in taken["running"][0]
    s.depart("x", "left")
    assert s.take_departures() == {"x": ("left",)}


def test_departures_not_kept_are_counted_in_the_metrics():
    from types import SimpleNamespace

    from shim.evidence.metrics import Metrics

    s = NodeState(CAP)
    for i in range(MAX_DEPARTED_PODS + 3):
        s.depart(f"u{i}", "left")
    text = Metrics().attach(reconciler=SimpleNamespace(resyncs=1, state=s)).render().decode()
    assert "memqos_reconciler_departures_dropped_total 3.0" in text
