"""Protection is monotone except for departures, end to end: the real Service (proxy, container
rewrite, reconciler) in front of the fake runtime, driven like a kubelet, writing into a fake
cgroupfs tree of real files. Every pod / QoS / kubepods memory.min and memory.low is sampled
after every call; a value that goes down without a pod or container having left fails."""
from __future__ import annotations

import threading

import pytest

from shim.cri import pb
from memqos_dev.testing.fake_runtime import FakeRuntime
from shim.tools.kubelet_requests import create_container, sandbox_config
from tests.reconciler_support import MI, FakeCgroupTree, Kubelet, ServiceThread, serve_args, wait_for
from tests.test_reconciler import Stack, make_stack  # noqa: F401 (the fixture)

FILES = ("memory.min", "memory.low")
# a v1.22-v1.35 kubelet with the MemoryQoS gate on, as in tests/data/traces (memqos-on)
GATE_ON = {"featureGates": {"MemoryQoS": True}, "memoryThrottlingFactor": 0.8}


def is_pod(rel: str) -> bool:
    return rel.rsplit("/", 1)[-1].startswith("pod")


class Watch:
    """Samples every pod / QoS / kubepods value; a drop is a value lower than the last sample,
    unless that pod left (``depart(path)``) or, for QoS / kubepods, some pod left since."""

    def __init__(self, tree: FakeCgroupTree):
        self.tree = tree
        self.last: dict[tuple[str, str], int] = {}
        self.drops: list[tuple[str, str, str, int, int]] = []
        self.left: set[str] = set()
        self.some_left = False
        self.samples = 0

    def depart(self, path: str) -> None:
        self.left.add(path)
        self.some_left = True

    def sample(self, label: str) -> None:
        self.samples += 1
        for rel, pair in self.tree.values().items():
            if rel.count("/") > 2:
                continue
            for file, value in zip(FILES, pair):
                prev = self.last.get((rel, file))
                allowed = rel in self.left if is_pod(rel) else self.some_left
                if prev is not None and value < prev and not allowed:
                    self.drops.append((label, rel, file, prev, value))
                self.last[(rel, file)] = value


class OwnWrites:
    """What a v1.22-v1.35 kubelet with the gate on writes itself: a pod's memory.min = the sum
    of its requests when it creates the pod's cgroup (before RunPodSandbox), the burstable QoS
    cgroup and kubepods the sums; when a pod goes, the sums without it."""

    def __init__(self, tree: FakeCgroupTree):
        self.tree = tree
        self.pods: dict[str, tuple[str, int]] = {}

    def pod(self, qos: str, uid: str, value: int) -> str:
        path = self.tree.make_pod(qos, uid)
        self.tree.set(path, "memory.min", value)
        self.pods[path] = (qos, value)
        self.sums()
        return path

    def gone(self, path: str) -> None:
        del self.pods[path]
        self.sums()

    def sums(self) -> None:
        b = sum(v for q, v in self.pods.values() if q == "burstable")
        g = sum(v for q, v in self.pods.values() if q == "guaranteed")
        self.tree.set(self.tree.burstable, "memory.min", b)
        self.tree.set(self.tree.kubepods, "memory.min", g + b)


def start_pods(s, w: Watch, own: OwnWrites | None = None, gate_on: bool = False) -> dict[str, str]:
    """A Guaranteed pod, a Burstable one, and `multi` (init 16Mi that exits, a sidecar 4Mi that
    keeps running, init2 12Mi that exits, then a 24Mi and b 8Mi): sampled after every call."""
    k = s.kubelet

    def step(label):
        s.sync()
        w.sample(label)

    def unified(request):
        return {"memory.min": str(request)} if gate_on else {}

    sids = {}
    for name, uid, qos, containers, total in (
        ("g", "0e01", "guaranteed", [("main", 64 * MI)], 64 * MI),
        ("b", "0e02", "burstable", [("main", 32 * MI)], 32 * MI),
        ("multi", "0e03", "burstable", [("init", 16 * MI), ("side", 4 * MI), ("init2", 12 * MI), ("a", 24 * MI),
                                         ("b", 8 * MI)], 36 * MI),
    ):
        if own is not None:
            own.pod(qos, uid, total)
            w.sample(f"kubelet writes pod {name}")
        sid = sids[name] = k.run_pod(name, uid, qos)
        step(f"RunPodSandbox {name}")
        for cname, request in containers:
            limit = request if qos == "guaranteed" else 0
            cid = k.create(sid, cname, qos, request=request, limit=limit, unified=unified(request), exact=gate_on)
            step(f"CreateContainer {name}/{cname}")
            if cname.startswith("init"):
                k.exit(cid)
                step(f"init of {name} exited")
            k.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid), pb.ContainerStatusResponse)
            step(f"ContainerStatus {name}/{cname}")
    return sids


@pytest.mark.parametrize("version", ["1.23", "1.28"])
def test_gate_on_the_shim_writes_no_pod_qos_or_kubepods_value_and_never_lowers_the_kubelets(make_stack, version):
    s = make_stack(kubelet_extra=GATE_ON, extra=("--kubelet-version", version))
    t = s.tree
    w, own = Watch(t), OwnWrites(t)
    sids = start_pods(s, w, own, gate_on=True)
    # the pod is removed the way the kubelet does it: the kubelet lowers its sums, a departure
    multi = t.pod("burstable", "0e03")
    s.kubelet.stop_pod(sids["multi"])
    w.depart(multi)
    own.gone(multi)
    s.kubelet.remove_pod(sids["multi"])
    s.sync()
    w.sample("multi removed")
    assert w.drops == []
    assert s.writes == []  # the kubelet owns these levels: left to it entirely
    assert t.get(t.kubepods) == 96 * MI and t.get(t.burstable) == 32 * MI
    assert not [r for r in s.records() if r["event"] == "cgroup-write"]


def test_gate_off_pod_start_with_init_and_sidecar_containers_only_rises(make_stack):
    s = make_stack()
    t = s.tree
    w = Watch(t)
    start_pods(s, w)
    assert w.drops == [] and w.samples >= 16
    # the kubelet sends no request: the shim knows the oom_score_adj lower bounds; the init
    # container by max, the one that kept running summed
    state = s.svc.reconciler.state
    kinds = {state.container(cid).name: kind for cid, kind in state.request(state.pods["0e03"]).kinds.items()}
    assert kinds == {"init": "init", "side": "sidecar", "init2": "init", "a": "regular", "b": "regular"}
    assert 0 < t.get(t.pod("burstable", "0e03")) <= 36 * MI


def _seed_without_unified(rt: FakeRuntime, name: str, uid: str, qos: str, request: int, limit: int = 0) -> str:
    """A pod a gate-off kubelet created before the shim was there: CRI carries only the
    oom_score_adj, so a shim can derive no more than its lower bound."""
    cfg = sandbox_config(name, uid, qos)
    sid = pb.RunPodSandboxResponse.FromString(
        rt.handle("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg).SerializeToString())).pod_sandbox_id
    req = create_container(sid, cfg, "main", qos, request=request, limit=limit)
    cid = pb.CreateContainerResponse.FromString(rt.handle("CreateContainer", req.SerializeToString())).container_id
    rt.handle("StartContainer", pb.StartContainerRequest(container_id=cid).SerializeToString())
    return sid


def test_start_with_pods_running_keeps_what_it_reads_back_and_writes_nothing_lower(make_stack, tmp_path):
    rt = FakeRuntime()
    _seed_without_unified(rt, "p", "0f01", "burstable", 32 * MI)
    tree = FakeCgroupTree(tmp_path / "cgroup")
    pod = tree.make_pod("burstable", "0f01")
    tree.set(pod, "memory.min", 32 * MI)  # written before this start (an earlier shim knew it exactly)
    tree.set(tree.burstable, "memory.min", 32 * MI)
    tree.set(tree.kubepods, "memory.min", 32 * MI)
    s = make_stack(tree=tree, runtime=rt)
    s.sync()
    c = next(iter(s.svc.reconciler.state.pods["0f01"].containers.values()))
    assert c.source.startswith("derived:") and c.request < 32 * MI  # the shim computes less...
    assert tree.get(pod) == 32 * MI  # ...and keeps what is in force
    assert tree.get(tree.burstable) == 32 * MI and tree.get(tree.kubepods) == 32 * MI
    assert s.writes == []


def test_start_lowers_qos_and_kubepods_only_to_the_running_pods_sum(make_stack, tmp_path):
    """A pod gone while the shim was down: its share of the sums goes; the running pod's value,
    read back, stays although the shim computes less for it."""
    rt = FakeRuntime()
    _seed_without_unified(rt, "p", "0f01", "burstable", 32 * MI)
    tree = FakeCgroupTree(tmp_path / "cgroup")
    pod = tree.make_pod("burstable", "0f01")
    tree.set(pod, "memory.min", 32 * MI)
    tree.set(tree.burstable, "memory.min", 48 * MI)  # + 16Mi of a pod removed meanwhile
    tree.set(tree.kubepods, "memory.min", 48 * MI)
    s = make_stack(tree=tree, runtime=rt)
    s.sync()
    assert tree.get(pod) == 32 * MI
    assert tree.get(tree.burstable) == 32 * MI and tree.get(tree.kubepods) == 32 * MI
    recs = [r for r in s.records() if r["event"] == "cgroup-write"]
    assert {r["path"].rsplit("/", 1)[-1] for r in recs} == {"kubepods", "burstable"}
    assert all("held" in r and r["departure"].startswith("start:") for r in recs)


def test_a_restart_under_pod_churn_lowers_nothing_for_pods_still_running(tmp_path):
    """The shim stops while pods are being created (one pod's containers half made), the kubelet
    goes on creating straight on the runtime, and a fresh shim starts on the same tree: sampled
    every few milliseconds from before the first shim stops until the second has settled, no
    pod / QoS / kubepods value of a running pod goes down."""
    s = Stack(tmp_path)
    t, k, rt = s.tree, s.kubelet, s.rt
    w = Watch(t)
    sampling = threading.Event()
    sampler_errors = []

    def sampler():
        while not sampling.wait(0.005):
            try:
                w.sample("background")
            except Exception as e:  # pragma: no cover - a file mid-write is retried by tree.get
                sampler_errors.append(e)

    th = threading.Thread(target=sampler, daemon=True)
    s2 = None
    try:
        a = k.run_pod("a", "0d01", "burstable")
        k.create(a, "main", "burstable", request=32 * MI)
        m = k.run_pod("multi", "0d02", "burstable")
        init = k.create(m, "init", "burstable", request=16 * MI)
        k.exit(init)
        k.create(m, "a", "burstable", request=24 * MI, limit=64 * MI)
        s.sync()
        th.start()
        s.close(runtime_too=False)  # gone without a word, like kill -9 (nothing is undone at stop)
        # meanwhile the kubelet retries on the runtime: multi's b, and a new pod half made
        cfg = k.sandboxes[m]
        req = create_container(m, cfg, "b", "burstable", request=8 * MI, unified={"memory.min": str(8 * MI)})
        rt.runtime.handle("CreateContainer", req.SerializeToString())
        _seed_without_unified(rt.runtime, "c", "0d03", "burstable", 16 * MI)
        t.make_pod("burstable", "0d03")
        listen = str(tmp_path / "shim.sock")
        s2 = ServiceThread(serve_args(tmp_path, t, rt.path, listen, audit=tmp_path / "audit-2.jsonl")).start()
        wait_for(lambda: s2.reconciler.resyncs >= 3, timeout=10)
        k2 = Kubelet(listen, t, rt.runtime)
        k2.sandboxes.update(k.sandboxes)
        k2.create(m, "c", "burstable", request=4 * MI)
        s2.sync()
        k2.close()
    finally:
        sampling.set()
        if th.is_alive():
            th.join(5)
        w.sample("settled")
        if s2 is not None:
            s2.stop()
        rt.stop()
    assert not sampler_errors
    assert w.drops == [] and w.samples > 5
    assert t.get(t.pod("burstable", "0d02")) == 36 * MI  # max(24 + 8 + 4, 16)


def _hard_then(tmp_path, policy: str):
    s = Stack(tmp_path, policy="Hard")
    k, t = s.kubelet, s.tree
    g = k.run_pod("g", "0a01", "guaranteed")
    k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    b = k.run_pod("b", "0a02", "burstable")
    k.create(b, "main", "burstable", request=32 * MI)
    s.sync()
    rt = s.rt
    s.close(runtime_too=False)
    s2 = Stack.__new__(Stack)
    s2.tmp, s2.tree, s2.rt = tmp_path, t, rt
    s2.audit = tmp_path / "audit-2.jsonl"
    listen = str(tmp_path / "shim.sock")
    s2.svc = ServiceThread(serve_args(tmp_path, t, rt.path, listen, policy=policy, audit=s2.audit)).start()
    s2.kubelet = Kubelet(listen, t, rt.runtime)
    wait_for(lambda: s2.svc.reconciler.resyncs >= 1)
    s2.sync()
    return s2


def test_a_policy_change_moves_protection_to_the_other_file_and_audits_it(tmp_path):
    s = _hard_then(tmp_path, "Soft")
    t = s.tree
    try:
        g, b = t.pod("guaranteed", "0a01"), t.pod("burstable", "0a02")
        assert t.values()[g] == (0, 64 * MI) and t.values()[b] == (0, 32 * MI)
        assert t.values()[t.kubepods] == (0, 96 * MI) and t.values()[t.burstable] == (0, 32 * MI)
        downs = [r for r in s.records() if r["event"] == "cgroup-write" and int(r["new"]) < int(r["old"])]
        assert {(r["path"].split("/cgroup/", 1)[1], r["file"]) for r in downs} == {
            (g, "memory.min"), (b, "memory.min"), (t.kubepods, "memory.min"), (t.burstable, "memory.min")}
        assert all("policy Soft protects with memory.low" in r["why"] or "protected by memory.low (policy Soft)"
                   in r["why"] for r in downs)
        assert not [r for r in downs if "held" in r]
    finally:
        s.close()


def test_a_change_to_tiered_reservation_moves_burstable_pods_to_memory_low(tmp_path):
    s = _hard_then(tmp_path, "TieredReservation")
    t = s.tree
    try:
        g, b = t.pod("guaranteed", "0a01"), t.pod("burstable", "0a02")
        assert t.values()[g] == (64 * MI, 0) and t.values()[b] == (0, 32 * MI)
        assert t.values()[t.kubepods] == (64 * MI, 96 * MI) and t.values()[t.burstable] == (0, 32 * MI)
    finally:
        s.close()


def test_departures_lower_values_and_the_audit_names_them(make_stack):
    s = make_stack(resync=30)  # no periodic listing: each departure comes from its call
    k, t = s.kubelet, s.tree
    p = k.run_pod("p", "0b01", "burstable", overhead=4 * MI)
    main = k.create(p, "main", "burstable", request=32 * MI)
    side = k.create(p, "side", "burstable", request=8 * MI)
    q = k.run_pod("q", "0b02", "burstable")
    k.create(q, "main", "burstable", request=16 * MI)
    s.sync()
    pod = t.pod("burstable", "0b01")
    assert t.get(pod) == 44 * MI

    def last_down(path):
        recs = [r for r in s.records() if r["event"] == "cgroup-write" and r["path"].endswith("/" + path)
                and int(r["new"]) < int(r["old"])]
        return recs[-1]

    k.remove_container(side)
    s.sync()
    assert t.get(pod) == 36 * MI and t.get(t.burstable) == 52 * MI
    assert last_down(pod)["departure"] == "pod default/p: container side removed"
    assert "container side removed" in last_down(t.burstable)["departure"]
    assert "container side removed" in last_down(t.kubepods)["departure"]

    k.update(main, limit=0, oom_score_adj=984, unified={"memory.min": str(16 * MI)})
    s.sync()
    assert t.get(pod) == 20 * MI
    assert "container main request lowered by UpdateContainerResources" in last_down(pod)["departure"]

    k.update_pod(p, overhead=MI)
    s.sync()
    assert t.get(pod) == 17 * MI
    assert "overhead lowered by UpdatePodSandboxResources" in last_down(pod)["departure"]

    k.stop_pod(p)
    s.sync()
    assert t.get(pod) == 0 and t.get(t.burstable) == 16 * MI
    assert last_down(pod)["departure"] == "pod default/p: sandbox stopped"
    k.remove_pod(q)
    s.sync()
    assert t.get(t.burstable) == 0 and t.get(t.kubepods) == 0
    assert "pod default/q: sandbox removed" in last_down(t.kubepods)["departure"]
