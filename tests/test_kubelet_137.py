"""A v1.37 kubelet in front of the shim, three configurations: defaults (MemoryQoS gate on,
memoryReservationPolicy None, memoryThrottlingFactor unset), TieredReservation, and a factor.

End to end: the real `serve` (relay transport, reconciler) on a unix socket in front of the
in-repo fake runtime, a fake cgroup tree of real files, a client sending the requests such a
kubelet sends (shim.tools.kubelet_requests.kubelet_unified), and the pod / QoS / kubepods values such
a kubelet writes itself put into the tree as it would. Checked: what reached the runtime, and
which cgroup files the shim wrote (never one the kubelet owns)."""
from __future__ import annotations

import json
import math

import pytest

from shim.node.kubelet import kubelet_writes
from shim.tools.kubelet_requests import kubelet_unified
from shim.node.facts import kubelet_facts_from_dict
from tests.reconciler_support import MI
from tests.test_reconciler import B_UID, G_UID, Stack

PAGE = 4096
CAPACITY = 2060419072  # reconciler_support's meminfo
ALLOC = CAPACITY - 200 * MI  # kubeReserved + systemReserved 100Mi each
B_REQ, B_LIM, G_REQ = 32 * MI, 128 * MI, 64 * MI
G_MIN = G_REQ - 8 * MI  # the Guaranteed container's memory.min: 8Mi (the least headroom) under its limit
REQUESTS = {"memqos.io/requests": json.dumps({"main": "32Mi"})}  # the exact request, for the shim

CONFIGS = {
    "defaults": {},
    "tiered": {"memoryReservationPolicy": "TieredReservation"},
    "factor": {"memoryThrottlingFactor": 0.9},
}


def high(req, lim, factor=0.9):
    return math.floor(req + (lim - req) * factor) // PAGE * PAGE


@pytest.fixture
def stack(tmp_path, request):
    stacks = []

    def make(config, driver):
        s = Stack(tmp_path, driver=driver, kubelet_extra=CONFIGS[config], extra=("--kubelet-version", "1.37"))
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


def kubelet_side(config):
    base = {"kind": "KubeletConfiguration", "cgroupDriver": "cgroupfs", "kubeReserved": {"memory": "100Mi"},
            "systemReserved": {"memory": "100Mi"}, "enforceNodeAllocatable": ["pods"]}
    return kubelet_writes(kubelet_facts_from_dict({**base, **CONFIGS[config]}, "test"), (1, 37))


def run(s, config):
    """Two pods as a v1.37 kubelet with `config` creates them; the kubelet's own pod / QoS /
    kubepods writes go into the tree first. Returns (what the runtime got per pod, kubelet's files)."""
    k, t = s.kubelet, s.tree
    w = kubelet_side(config)
    kubelet_files = {}
    if w.writes_protection:  # TieredReservation: the kubelet's values (KEP-2570 mapping rules)
        kubelet_files = {(t.kubepods, "memory.min"): G_REQ + B_REQ, (t.burstable, "memory.low"): B_REQ}
    g = k.run_pod("g", G_UID, "guaranteed")
    b = k.run_pod("b", B_UID, "burstable", annotations=REQUESTS)
    if w.writes_protection:
        kubelet_files[(t.pod("guaranteed", G_UID), "memory.min")] = G_REQ
        kubelet_files[(t.pod("burstable", B_UID), "memory.low")] = B_REQ
    for (path, file), value in kubelet_files.items():
        t.set(path, file, value)
    sent = {
        "g": kubelet_unified(w, "guaranteed", request=G_REQ, limit=G_REQ, allocatable=ALLOC),
        "b": kubelet_unified(w, "burstable", request=B_REQ, limit=B_LIM, allocatable=ALLOC),
    }
    cids = {"g": k.create(g, "main", "guaranteed", request=G_REQ, limit=G_REQ, unified=sent["g"], exact=False),
            "b": k.create(b, "main", "burstable", request=B_REQ, limit=B_LIM, unified=sent["b"], exact=False)}
    s.sync()
    got = {p: dict(s.rt.runtime.container(c).create_request.config.linux.resources.unified) for p, c in cids.items()}
    return sent, got, kubelet_files, cids


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_v137_defaults_the_kubelet_writes_nothing_the_shim_everything(stack, driver):
    s = stack("defaults", driver)
    sent, got, kubelet_files, _ = run(s, "defaults")
    t = s.tree
    # the kubelet sends neutral values only
    assert sent["b"] == {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": "max"}
    # the shim replaces them (policy Hard, factor 0.9 of its own)
    assert got["b"] == {"memory.oom.group": "1", "memory.min": str(B_REQ), "memory.high": str(high(B_REQ, B_LIM))}
    assert got["g"] == {"memory.oom.group": "1", "memory.min": str(G_MIN), "memory.low": str(G_REQ)}
    assert kubelet_files == {}
    assert t.nonzero() == {t.kubepods: (G_REQ + B_REQ, 0), t.burstable: (B_REQ, 0),
                           t.pod("guaranteed", G_UID): (G_REQ, 0), t.pod("burstable", B_UID): (B_REQ, 0)}
    start = [r for r in s.records() if r["event"] == "start"][0]
    assert start["kubelet_version"] == "1.37" and "gate on" in start["kubelet_writes"]
    assert {v["owner"] for v in start["ownership"].values()} == {"shim"}


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_v137_tiered_reservation_the_kubelet_owns_protection(stack, driver):
    s = stack("tiered", driver)
    sent, got, kubelet_files, cids = run(s, "tiered")
    t = s.tree
    assert sent["b"] == {"memory.oom.group": "1", "memory.min": "0", "memory.low": str(B_REQ), "memory.high": "max"}
    assert sent["g"] == {"memory.oom.group": "1", "memory.min": str(G_REQ), "memory.low": "0", "memory.high": "max"}
    # memory.min / memory.low forwarded as the kubelet sent them; memory.high is the shim's (the
    # kubelet sets none: memoryThrottlingFactor unset)
    assert got["b"] == {**sent["b"], "memory.high": str(high(B_REQ, B_LIM))}
    assert got["g"] == {k: v for k, v in sent["g"].items() if k != "memory.high"}
    # not one write to a pod / QoS / kubepods file: they stay the kubelet's
    assert s.writes == []
    assert {(p, f): t.get(p, f) for p, f in kubelet_files} == kubelet_files
    # an update: the kubelet's protection keys again pass unchanged
    upd = kubelet_unified(kubelet_side("tiered"), "burstable", request=48 * MI, limit=B_LIM, allocatable=ALLOC)
    s.kubelet.update(cids["b"], limit=B_LIM, oom_score_adj=970, unified=upd)
    s.sync()
    last = s.rt.runtime.container(cids["b"]).update_request_messages[-1]
    assert dict(last.linux.unified)["memory.low"] == str(48 * MI) and dict(last.linux.unified)["memory.min"] == "0"
    assert s.writes == []
    recs = [r for r in s.records() if r.get("method") == "CreateContainer"]
    assert all(r["kubelet_owns"] == ["memory.low", "memory.min"] for r in recs)
    assert all("kept" in r["reasons"]["memory.min"] for r in recs)


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_v137_factor_the_kubelet_owns_memory_high(stack, driver):
    s = stack("factor", driver)
    sent, got, kubelet_files, _ = run(s, "factor")
    t = s.tree
    kubelet_high = str(high(B_REQ, B_LIM))
    assert sent["b"] == {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": kubelet_high}
    assert "memory.high" not in sent["g"]  # Guaranteed: none
    # memory.high is the kubelet's, forwarded unchanged; protection is the shim's (policy Hard)
    assert got["b"] == {"memory.oom.group": "1", "memory.min": str(B_REQ), "memory.high": kubelet_high}
    assert got["g"] == {"memory.oom.group": "1", "memory.min": str(G_MIN), "memory.low": str(G_REQ)}
    assert kubelet_files == {}
    assert t.nonzero() == {t.kubepods: (G_REQ + B_REQ, 0), t.burstable: (B_REQ, 0),
                           t.pod("guaranteed", G_UID): (G_REQ, 0), t.pod("burstable", B_UID): (B_REQ, 0)}


def test_kubelet_owned_values_are_not_zeroed_when_pods_go(stack):
    """TieredReservation: the shim never wrote those files and never resets them either."""
    s = stack("tiered", "cgroupfs")
    _, _, kubelet_files, _ = run(s, "tiered")
    s.svc.reconciler.request_resync("test", fresh=True)
    s.sync()
    assert s.writes == [] and {(p, f): s.tree.get(p, f) for p, f in kubelet_files} == kubelet_files


def test_container_cgroup_files_under_systemd(tmp_path):
    """The values end up in the container's cgroup as runc would write them: the fake runtime
    makes cri-containerd-<id>.scope in the expanded pod slice of the same tree."""
    from memqos_dev.testing.fake_runtime import FakeRuntime
    from tests.reconciler_support import FakeCgroupTree

    tree = FakeCgroupTree(tmp_path / "cgroup", "systemd")
    rt = FakeRuntime(cgroup_driver="systemd", cgroup_root=str(tree.root))
    s = Stack(tmp_path, driver="systemd", kubelet_extra=CONFIGS["factor"], extra=("--kubelet-version", "1.37"),
              tree=tree, runtime=rt)
    try:
        sent, got, _, cids = run(s, "factor")
        scope = tree.root / tree.pod("burstable", B_UID) / f"cri-containerd-{cids['b']}.scope"
        files = {f: (scope / f).read_text().strip() for f in ("memory.min", "memory.high", "memory.max")}
        assert files == {"memory.min": str(B_REQ), "memory.high": sent["b"]["memory.high"], "memory.max": str(B_LIM)}
        assert not (scope / "memory.low").exists()  # the shim dropped the kubelet's neutral "0"
    finally:
        s.close()


@pytest.mark.parametrize("config,action", [("factor", "none"), ("tiered", "relax"), ("defaults", "relax")])
def test_the_guard_reports_instead_of_relaxing_a_memory_high_the_kubelet_owns(stack, config, action):
    assert stack(config, "cgroupfs").svc.service.monitor.guard.action.value == action
