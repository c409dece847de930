"""shim.decision.node: the node-level targets from placed pods alone (no layout, no state)."""
from types import SimpleNamespace

from shim.decision import Policy, QoSClass
from shim.decision.node import LOW, MIN, NODE, POD, QOS, PlacedPod, Reserved, node_targets


def _pod(uid, active=True):
    return SimpleNamespace(uid=uid, active=active, containers={}, label=lambda: f"ns/{uid}")


def _req(n):
    return SimpleNamespace(bytes=n, explain=lambda names: f"sum {n}")


PODS = [
    PlacedPod(_pod("g"), QoSClass.GUARANTEED, "kubepods/podg", _req(1000)),
    PlacedPod(_pod("b"), QoSClass.BURSTABLE, "kubepods/burstable/podb", _req(5000)),
    PlacedPod(_pod("e"), QoSClass.BESTEFFORT, "kubepods/besteffort/pode", None),
]


def _values(targets):
    return {k: (t.value, t.level) for k, t in targets.items()}


def test_hard_sums_pages_and_reserved():
    t = node_targets(PODS, "kubepods", "kubepods/burstable", "kubepods/besteffort", Policy.HARD, 4096,
                     [Reserved("kube-reserved", "kube.slice", 10000)])
    v = _values(t)
    assert v[("kubepods", MIN)] == (4096, NODE)  # 6000 rounded down to a page
    assert v[("kubepods", LOW)] == (0, NODE)
    assert v[("kubepods/burstable", MIN)] == (4096, QOS)
    assert v[("kubepods/besteffort", MIN)] == (0, QOS)
    assert v[("kubepods/podg", MIN)] == (0, POD)  # 1000 < one page
    assert v[("kubepods/besteffort/pode", MIN)] == (0, POD)
    assert v[("kube.slice", MIN)] == (8192, NODE)
    assert "no requests" in t[("kubepods/besteffort/pode", LOW)].why


def test_scopes_the_kubelet_owns_are_left_out():
    t = node_targets(PODS, "kubepods", "kubepods/burstable", "kubepods/besteffort", Policy.HARD, 1,
                     kubelet_owns=frozenset({"pod", "qos"}))
    assert set(t) == {("kubepods", MIN), ("kubepods", LOW)}
    assert t[("kubepods", MIN)].value == 6000


def test_policy_none_zeroes_everything():
    t = node_targets(PODS, "kubepods", "kubepods/burstable", "kubepods/besteffort", Policy.NONE, 1)
    assert t and all(x.value == 0 and "policy None" in x.why for x in t.values())
