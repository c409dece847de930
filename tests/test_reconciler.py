"""The pod/QoS/node reconciler end to end: the real Service (proxy + container rewrite +
reconciler) in front of the fake runtime, driven like a kubelet, writing into a fake cgroupfs
tree of real files. Values are checked after every step, and so is the order of the writes."""
from __future__ import annotations

import json
import os

import pytest

from shim.cri import pb
from shim.decision import Policy
from memqos_dev.testing.fake_runtime import FakeRuntime, FakeRuntimeServer
from shim.node.facts import KubeletFacts
from shim.node.reconciler import Reconciler, ReconcilerObserver
from shim.transport.hooks import RpcCall
from tests.reconciler_support import (
    MI,
    FakeCgroupTree,
    Kubelet,
    ServiceThread,
    read_audit,
    seed_runtime,
    serve_args,
    wait_for,
)

G_UID = "5d9d3685019daf0a672ac2d2de981877"
B_UID = "b1013052-e446-98fd-e2f5-96c3bd9b3930"  # RFC 4122 form: dashes become _ in systemd
BE_UID = "827c0d3c9bd782df6f7d722bb0196b95"
M_UID = "de5baa105f184138bbf9bfdd79323231"
S_UID = "0c0ffee0-0000-4000-8000-000000000001"


class Stack:
    def __init__(self, tmp, driver="cgroupfs", policy="Hard", resync=0.2, kubelet_extra=None, tree=None,
                 runtime=None, extra=()):
        self.tmp = tmp
        self.tree = tree or FakeCgroupTree(tmp / "cgroup", driver)
        self.audit = tmp / f"audit-{os.urandom(3).hex()}.jsonl"
        self.rt = FakeRuntimeServer(str(tmp / "containerd.sock"), runtime, **({} if runtime else
                                                                              {"cgroup_driver": driver})).start()
        listen = str(tmp / "shim.sock")
        self.svc = ServiceThread(serve_args(tmp, self.tree, self.rt.path, listen, driver=driver, policy=policy,
                                            resync=resync, audit=self.audit, kubelet_extra=kubelet_extra,
                                            extra=extra)).start()
        self.kubelet = Kubelet(listen, self.tree, self.rt.runtime, driver)
        wait_for(lambda: self.svc.reconciler.resyncs >= 1)

    @property
    def writes(self):
        return list(self.svc.reconciler.fs.writes)

    def sync(self):
        self.svc.sync()

    def new_writes(self, since):
        return [(w.path, w.file, int(w.old), int(w.new)) for w in self.writes[since:]]

    def records(self):
        self.svc.service.audit.flush()
        return read_audit(self.audit)

    def close(self, runtime_too=True):
        self.kubelet.close()
        self.svc.stop()
        if runtime_too:
            self.rt.stop()


@pytest.fixture
def make_stack(tmp_path):
    stacks = []

    def make(**kw):
        s = Stack(tmp_path, **kw)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


def v(tree, rel, file="memory.min"):
    return tree.get(rel, file)


@pytest.mark.parametrize("driver,leaf_only", [("cgroupfs", False), ("systemd", False), ("systemd", True)])
def test_pods_of_every_class_created_resized_removed(make_stack, driver, leaf_only):
    s = make_stack(driver=driver)
    k, t = s.kubelet, s.tree
    kp, bq = t.kubepods, t.burstable
    assert t.nonzero() == {}

    # 1. Guaranteed 64Mi: kubepods first, then the pod (top-down)
    n = len(s.writes)
    g = k.run_pod("qos-guaranteed", G_UID, "guaranteed", leaf_only=leaf_only)
    g_main = k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    s.sync()
    gp = t.pod("guaranteed", G_UID)
    assert s.new_writes(n) == [(kp, "memory.min", 0, 64 * MI), (gp, "memory.min", 0, 64 * MI)]

    # 2. Burstable 32Mi: kubepods, burstable, pod
    n = len(s.writes)
    b = k.run_pod("qos-burstable", B_UID, "burstable", leaf_only=leaf_only)
    b_main = k.create(b, "main", "burstable", request=32 * MI, limit=128 * MI)
    s.sync()
    bp = t.pod("burstable", B_UID)
    assert s.new_writes(n) == [(kp, "memory.min", 64 * MI, 96 * MI), (bq, "memory.min", 0, 32 * MI),
                               (bp, "memory.min", 0, 32 * MI)]

    # 3. BestEffort: nothing to protect, nothing written
    n = len(s.writes)
    be = k.run_pod("qos-besteffort", BE_UID, "besteffort", leaf_only=leaf_only)
    k.create(be, "main", "besteffort")
    s.sync()
    assert s.new_writes(n) == []

    # 4. multi with overhead 10Mi: init 16Mi, exits, then a 24Mi and b 8Mi
    m = k.run_pod("multi", M_UID, "burstable", overhead=10 * MI, leaf_only=leaf_only)
    mp = t.pod("burstable", M_UID)
    init = k.create(m, "init", "burstable", request=16 * MI)
    s.sync()
    assert v(t, mp) == 26 * MI and v(t, bq) == 58 * MI and v(t, kp) == 122 * MI
    k.exit(init)
    k.create(m, "a", "burstable", request=24 * MI, limit=64 * MI)
    s.sync()
    assert v(t, mp) == 34 * MI  # max(16, 24) + 10
    k.create(m, "b", "burstable", request=8 * MI)
    s.sync()
    assert v(t, mp) == 42 * MI and v(t, bq) == 74 * MI and v(t, kp) == 138 * MI  # max(16, 24+8) + 10

    # 5. sidecar pod: setup (init 20) exits; proxy (sidecar 8) runs; migrate (init 30) exits; app 16
    sc = k.run_pod("sidecar", S_UID, "burstable", leaf_only=leaf_only)
    sp = t.pod("burstable", S_UID)
    setup = k.create(sc, "setup", "burstable", request=20 * MI)
    k.exit(setup)
    k.create(sc, "proxy", "burstable", request=8 * MI)
    migrate = k.create(sc, "migrate", "burstable", request=30 * MI)
    k.exit(migrate)
    k.create(sc, "app", "burstable", request=16 * MI)
    s.sync()
    assert v(t, sp) == 38 * MI  # the kubelet's rule: max(16 + 8, 20, 30 + 8)
    assert v(t, bq) == (32 + 42 + 38) * MI and v(t, kp) == (64 + 32 + 42 + 38) * MI

    # 6. resize up (Guaranteed limit 64Mi -> 128Mi): top-down
    n = len(s.writes)
    k.update(g_main, limit=128 * MI, oom_score_adj=-997)
    s.sync()
    assert s.new_writes(n) == [(kp, "memory.min", 176 * MI, 240 * MI), (gp, "memory.min", 64 * MI, 128 * MI)]

    # 7. resize down (Burstable 32Mi -> 16Mi): bottom-up
    n = len(s.writes)
    k.update(b_main, limit=128 * MI, oom_score_adj=992, unified={"memory.min": str(16 * MI)})
    s.sync()
    assert s.new_writes(n) == [(bp, "memory.min", 32 * MI, 16 * MI), (bq, "memory.min", 112 * MI, 96 * MI),
                               (kp, "memory.min", 240 * MI, 224 * MI)]

    # 8. overhead of multi changes through UpdatePodSandboxResources
    k.update_pod(m, overhead=2 * MI)
    s.sync()
    assert v(t, mp) == 34 * MI and v(t, bq) == 88 * MI

    # 9. multi stopped and removed as the kubelet does it: bottom-up
    n = len(s.writes)
    k.stop_pod(m)
    s.sync()
    assert s.new_writes(n) == [(mp, "memory.min", 34 * MI, 0), (bq, "memory.min", 88 * MI, 54 * MI),
                               (kp, "memory.min", 216 * MI, 182 * MI)]
    n = len(s.writes)
    for c in list(s.rt.runtime.containers_in(m)):
        k.remove_container(c.id)
    k.remove_pod(m)
    s.sync()
    assert s.new_writes(n) == []

    # 10. the rest removed without a stop first (RemovePodSandbox stops it)
    for sid in (g, b, be, sc):
        k.remove_pod(sid)
    s.sync()
    assert t.nonzero() == {}
    ws = s.writes
    assert all(int(w.new) % 4096 == 0 for w in ws)
    assert not [r for r in s.records() if r["event"] in ("reconciler-error", "cgroup-refused")]


def test_every_write_is_audited_with_old_new_and_why(make_stack):
    s = make_stack()
    k = s.kubelet
    sid = k.run_pod("p", B_UID, "burstable")
    k.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    recs = [r for r in s.records() if r["event"] == "cgroup-write"]
    assert [(r["path"], r["old"], r["new"]) for r in recs] == [
        (str(s.tree.root / "kubepods"), "0", str(32 * MI)),
        (str(s.tree.root / "kubepods/burstable"), "0", str(32 * MI)),
        (str(s.tree.root / f"kubepods/burstable/pod{B_UID}"), "0", str(32 * MI)),
    ]
    assert "1 Burstable pods' requests sum to 33554432 (32Mi)" in recs[1]["why"]
    assert recs[2]["why"].startswith("pod default/p (Burstable): request 33554432 (32Mi)")
    assert all(r["file"] == "memory.min" for r in recs)


def test_pods_from_before_the_shim_are_recovered_and_equal_values_are_not_rewritten(make_stack, tmp_path):
    """Pods created straight on the runtime (no shim, no memqos.io/request annotation) by a
    kubelet with its own MemoryQoS: the shim derives the requests the same way the container
    rewrite does, finds the kubelet's values already right, and writes nothing."""
    rt = FakeRuntime()
    ids = seed_runtime(rt, [("p", B_UID, "burstable", [("main", 32 * MI, 0)])])
    tree = FakeCgroupTree(tmp_path / "cgroup")
    tree.set("kubepods", "memory.min", 32 * MI)  # the kubelet's own MemoryQoS set them
    tree.set("kubepods/burstable", "memory.min", 32 * MI)
    tree.make_pod("burstable", B_UID)
    tree.set(f"kubepods/burstable/pod{B_UID}", "memory.min", 32 * MI)
    s = make_stack(tree=tree, runtime=rt)
    s.sync()
    assert s.writes == []
    assert s.svc.reconciler.state.container(ids["main"]).source == "unified"


def test_hostile_cgroup_paths_are_refused_and_nothing_outside_is_written(make_stack, tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    outside = tree.mkdir("system.slice")  # a sibling of kubepods: must never be written
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for f in ("memory.min", "memory.low"):
        (elsewhere / f).write_text("0\n")
    s = make_stack(tree=tree)
    k = s.kubelet

    def pod(name, uid, parent, **kw):
        sid = k.run_pod(name, uid, "burstable", cgroup_parent=parent, mkdir=False, **kw)
        k.create(sid, "main", "burstable", request=32 * MI)
        return sid

    pod("dotdot", "0a", f"/kubepods/burstable/pod0a/../../../system.slice")
    pod("jump", "0b", "/system.slice/kubepods/burstable/pod0b")
    pod("abs-uid", "0c", f"/kubepods/burstable/pod{G_UID}")  # another pod's cgroup
    pod("bad-uid", "../../system.slice", "/kubepods/burstable/pod0d")
    pod("driver", "0e", "kubepods-burstable-pod0e.slice")  # systemd name on a cgroupfs node
    # a pod cgroup that is a symlink out of the tree
    os.symlink(elsewhere, tree.root / "kubepods/burstable/pod0f")
    pod("symlink", "0f", "/kubepods/burstable/pod0f")
    # and a legit pod next to them
    ok = k.run_pod("ok", B_UID, "burstable")
    k.create(ok, "main", "burstable", request=16 * MI)
    s.sync()

    assert tree.nonzero() == {"kubepods": (16 * MI, 0), "kubepods/burstable": (16 * MI, 0),
                              f"kubepods/burstable/pod{B_UID}": (16 * MI, 0)}
    assert (outside / "memory.min").read_text() == "0\n"
    assert (elsewhere / "memory.min").read_text() == "0\n"
    refused = [r["reason"] for r in s.records() if r["event"] == "cgroup-refused"]
    assert len(refused) == 6, refused
    joined = "\n".join(refused)
    for name in ("dotdot", "jump", "abs-uid", "bad-uid", "driver", "symlink"):
        assert f"default/{name}" in joined
    assert "a symlink" in joined
    assert all(w.path.startswith("kubepods") for w in s.writes)


def test_drift_is_repaired_within_one_resync(make_stack):
    s = make_stack(resync=0.2)
    k, t = s.kubelet, s.tree
    sid = k.run_pod("p", B_UID, "burstable")
    k.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    t.set("kubepods/burstable", "memory.min", 0)  # another agent
    t.set("kubepods", "memory.low", 5 * MI)
    wait_for(lambda: v(t, "kubepods/burstable") == 32 * MI and v(t, "kubepods", "memory.low") == 0, timeout=2.0)
    s.sync()
    drift = [r for r in s.records() if r["event"] == "cgroup-write" and r.get("drift_repaired")]
    assert {(r["path"].rsplit("/", 1)[-1], r["file"]) for r in drift} >= {("burstable", "memory.min")}
    assert "drift repaired" in drift[0]["why"]


def test_restart_in_process_rebuilds_the_same_values_without_writing(tmp_path):
    """Shim stopped and started again against the same runtime: recovery from ListPodSandbox /
    ListContainers / ContainerStatus / verbose PodSandboxStatus gives the same values
    (init container by max, overhead) and writes nothing."""
    s = Stack(tmp_path)
    k, t = s.kubelet, s.tree
    m = k.run_pod("multi", M_UID, "burstable", overhead=10 * MI)
    init = k.create(m, "init", "burstable", request=16 * MI)
    k.exit(init)
    k.create(m, "a", "burstable", request=24 * MI, limit=64 * MI)
    k.create(m, "b", "burstable", request=8 * MI)
    g = k.run_pod("g", G_UID, "guaranteed")
    k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    sc = k.run_pod("two", S_UID, "burstable")
    k.create(sc, "one", "burstable", request=5 * MI)
    k.create(sc, "two", "burstable", request=7 * MI)  # two regular containers: summed
    s.sync()
    before = t.nonzero()
    assert before[t.pod("burstable", M_UID)] == (42 * MI, 0)
    assert before[t.pod("burstable", S_UID)] == (12 * MI, 0)
    rt = s.rt
    s.close(runtime_too=False)

    s2 = Stack.__new__(Stack)
    s2.tmp, s2.tree, s2.rt = tmp_path, t, rt
    s2.audit = tmp_path / "audit-2.jsonl"
    listen = str(tmp_path / "shim.sock")
    s2.svc = ServiceThread(serve_args(tmp_path, t, rt.path, listen, audit=s2.audit)).start()
    s2.kubelet = Kubelet(listen, t, rt.runtime)
    try:
        wait_for(lambda: s2.svc.reconciler.resyncs >= 1)
        s2.sync()
        assert t.nonzero() == before
        assert s2.writes == []
        recs = s2.records()
        start = [r for r in recs if r["event"] == "resync"][0]
        assert start["reason"] == "startup" and start["writes"] == 0 and start["pods"] == 3
    finally:
        s2.close()


def test_policy_tiered(make_stack):
    s = make_stack(policy="TieredReservation")
    k, t = s.kubelet, s.tree
    g = k.run_pod("g", G_UID, "guaranteed")
    k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    b = k.run_pod("b", B_UID, "burstable")
    k.create(b, "main", "burstable", request=32 * MI)
    s.sync()
    assert t.nonzero() == {
        "kubepods": (64 * MI, 96 * MI),
        "kubepods/burstable": (0, 32 * MI),
        f"kubepods/pod{G_UID}": (64 * MI, 0),
        f"kubepods/burstable/pod{B_UID}": (0, 32 * MI),
    }


def test_policy_none_clears_values_bottom_up(make_stack, tmp_path):
    rt = FakeRuntime()
    seed_runtime(rt, [("p", B_UID, "burstable", [("main", 32 * MI, 0)])])
    tree = FakeCgroupTree(tmp_path / "cgroup")
    tree.set("kubepods", "memory.min", 96 * MI)  # left by an earlier run with another policy
    tree.set("kubepods/burstable", "memory.low", 32 * MI)
    tree.make_pod("burstable", B_UID)
    tree.set(f"kubepods/burstable/pod{B_UID}", "memory.min", 32 * MI)
    tree.set(f"kubepods/burstable/pod{B_UID}", "memory.low", 32 * MI)
    s = make_stack(policy="None", tree=tree, runtime=rt)
    s.sync()
    assert tree.nonzero() == {}
    assert [(w.path, w.file) for w in s.writes] == [
        (f"kubepods/burstable/pod{B_UID}", "memory.low"), (f"kubepods/burstable/pod{B_UID}", "memory.min"),
        ("kubepods/burstable", "memory.low"), ("kubepods", "memory.min")]
    # and nothing more as pods come and go
    sid = s.kubelet.run_pod("q", S_UID, "burstable")
    s.kubelet.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    assert tree.nonzero() == {} and len(s.writes) == 4


def test_reserved_cgroups_get_the_reserved_memory(make_stack, tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    tree.mkdir("kube.slice")
    tree.mkdir("system.slice")
    s = make_stack(tree=tree, kubelet_extra={
        "enforceNodeAllocatable": ["pods", "kube-reserved", "system-reserved"],
        "kubeReservedCgroup": "/kube.slice", "systemReservedCgroup": "/system.slice",
        "kubeReserved": {"memory": "100Mi"}, "systemReserved": {"memory": "200Mi"}})
    s.sync()
    assert v(tree, "kube.slice") == 100 * MI and v(tree, "system.slice") == 200 * MI
    assert v(tree, "system.slice", "memory.low") == 0


def test_reserved_cgroups_only_when_enforced(make_stack, tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    tree.mkdir("system.slice")
    s = make_stack(tree=tree, kubelet_extra={"systemReservedCgroup": "/system.slice"})
    s.sync()
    assert tree.nonzero() == {}


def test_cgroup_v1_node_does_nothing_and_says_so_once(make_stack, tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup", v2=False)
    s = make_stack(tree=tree, resync=0.05)
    sid = s.kubelet.run_pod("p", B_UID, "burstable")
    s.kubelet.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    wait_for(lambda: s.svc.reconciler.resyncs >= 4)
    assert tree.nonzero() == {} and s.writes == []
    idle = [r for r in s.records() if r["event"] == "reconciler-idle"]
    assert len(idle) == 1 and "cgroup v1" in idle[0]["reason"]


def test_missing_kubepods_idle_until_the_kubelet_creates_it(make_stack, tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup", kubepods=False)
    s = make_stack(tree=tree, resync=0.1)
    sid = s.kubelet.run_pod("p", B_UID, "burstable", mkdir=False)
    s.kubelet.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    wait_for(lambda: s.svc.reconciler.resyncs >= 3)
    assert s.writes == []
    idle = [r for r in s.records() if r["event"] == "reconciler-idle"]
    assert len(idle) == 1 and "kubepods" in idle[0]["reason"]
    tree.mkdir("kubepods/burstable")  # the kubelet starts
    tree.make_pod("burstable", B_UID)
    wait_for(lambda: tree.get(f"kubepods/burstable/pod{B_UID}") == 32 * MI, timeout=2.0)
    assert any(r["event"] == "reconciler-active" for r in s.records())


def test_no_writes_before_the_runtime_state_is_known(tmp_path):
    """Runtime down at start: the reconciler must not write sums from a partial state."""
    tree = FakeCgroupTree(tmp_path / "cgroup")
    tree.set("kubepods", "memory.min", 64 * MI)  # set before the restart
    audit = tmp_path / "audit.jsonl"
    listen = str(tmp_path / "shim.sock")
    svc = ServiceThread(serve_args(tmp_path, tree, str(tmp_path / "nothing.sock"), listen, audit=audit)).start()
    try:
        wait_for(lambda: any(r["event"] == "reconciler-error" for r in read_audit(audit)), timeout=15)
        assert len(svc.reconciler.fs.writes) == 0
        assert tree.get("kubepods") == 64 * MI
    finally:
        svc.stop()


# -- the observer ----------------------------------------------------------------------------
def test_observer_only_enqueues_and_never_raises():
    import queue

    q = queue.SimpleQueue()
    obs = ReconcilerObserver(q)
    garbage = RpcCall("/runtime.v1.RuntimeService/CreateContainer", 0.0, 1.0, b"\xff\xff", None, [b"\x00"])
    obs.finished(garbage)  # not parsed here
    obs.finished(RpcCall("/runtime.v1.RuntimeService/Version", 0.0, 1.0, b"", None, [b""]))
    obs.finished(RpcCall("/runtime.v1.RuntimeService/Version", 0.0, 1.0, b"", None, [], "UNAVAILABLE"))
    obs.finished(RpcCall("/runtime.v1.RuntimeService/Version", 0.0, 1.0, b"", None, [b""]))
    items = [q.get_nowait() for _ in range(q.qsize())]
    assert items[0] is garbage and type(items[1]).__name__ == "_Resync" and items[1].reason == "upstream-reconnected"
    assert len(items) == 2


def test_unparseable_calls_do_not_stop_the_reconciler(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    records = []
    r = Reconciler(cgroup_root=str(tree.root), kubelet=KubeletFacts(), policy=Policy.HARD, capacity=2060419072,
                   page_size=4096, emit=records.append, resync_interval=0.05).start()
    try:
        r.observer.finished(RpcCall("/runtime.v1.RuntimeService/CreateContainer", 0.0, 1.0, b"\xff\xff", None,
                                         [b"\x00"]))
        assert r.sync(5)
        assert any(x["event"] == "reconciler-error" for x in records)
        assert r.sync(5)  # still alive
    finally:
        r.stop()


def test_the_reconciler_publishes_an_immutable_view_of_the_node_after_each_change(make_stack):
    """Other threads (the monitor) read ``reconciler.view``: replaced, never mutated."""
    s = make_stack()
    rec = s.svc.reconciler
    assert rec.view.containers == ()
    sid = s.kubelet.run_pod("v", B_UID, "burstable")
    cid = s.kubelet.create(sid, "main", "burstable", request=32 * MI)
    s.sync()
    first = rec.view
    (c,) = first.containers
    assert (c.id, c.namespace, c.pod, c.container, c.uid, c.qos) == (cid, "default", "v", "main", B_UID, "Burstable")
    assert c.cgroup_parent.endswith(f"pod{B_UID}")
    s.kubelet.remove_container(cid)
    s.sync()
    assert rec.view is not first and rec.view.containers == ()
    assert [x.id for x in first.containers] == [cid]  # what a reader took stays as it was


def test_the_request_annotation_is_visible_to_recovery(make_stack):
    """The memqos.io/request annotation the shim leaves on each container is what recovery reads."""
    s = make_stack()
    sid = s.kubelet.run_pod("q", S_UID, "burstable")
    cid = s.kubelet.create(sid, "main", "burstable", request=32 * MI, exact=False)
    resp = s.kubelet.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid), pb.ContainerStatusResponse)
    note = json.loads(resp.status.annotations["memqos.io/request"])
    assert note["source"] == "oom-score-adj" and 31 * MI < note["bytes"] <= 32 * MI


def test_upstream_reconnect_rebuilds_the_state_from_the_runtime(tmp_path):
    """The runtime goes away and comes back with changes the shim could not see (a pod removed
    meanwhile): the first successful call after UNAVAILABLE triggers a fresh rebuild."""
    s = Stack(tmp_path, resync=30)  # no periodic resync during the test
    try:
        k, t = s.kubelet, s.tree
        a = k.run_pod("a", B_UID, "burstable")
        k.create(a, "main", "burstable", request=32 * MI)
        b = k.run_pod("b", S_UID, "burstable")
        k.create(b, "main", "burstable", request=16 * MI)
        s.sync()
        assert v(t, t.burstable) == 48 * MI
        runtime = s.rt.runtime
        s.rt.stop()
        with pytest.raises(Exception):
            k.call("Version", pb.VersionRequest(), pb.VersionResponse)  # UNAVAILABLE through the proxy
        runtime.handle("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=b).SerializeToString())
        s.rt = FakeRuntimeServer(s.rt.path, runtime).start()
        wait_for(lambda: _version_ok(k), timeout=10)
        s.sync()
        wait_for(lambda: v(t, t.burstable) == 32 * MI, timeout=5)
        assert v(t, t.pod("burstable", S_UID)) == 0  # the shim had written it: lowered again
        assert any(r["event"] == "resync" and r["reason"] == "upstream-reconnected" for r in s.records())
    finally:
        s.close()


def _version_ok(k) -> bool:
    try:
        k.call("Version", pb.VersionRequest(), pb.VersionResponse)
        return True
    except Exception:
        return False
