"""Classes through the real request paths: the CRI rewriter (serialized CreateContainer and
UpdateContainerResources), the NRI handler (create, update, Synchronize after a plugin restart),
the node state's sums rebuilt from the shim's container annotation, the monitor's per-class
guard and reclaim, swap, and the refusal metric."""
from __future__ import annotations

import json

from shim.app.config_classes import unprotected_classes
from shim.container.nri_handler import NriMemoryQoS
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES
from shim.decision import NodeFacts, Policy
from shim.decision.classes import ContainerClass, make_table
from shim.decision.events import ContainerCreated, PodSandboxStarted
from shim.decision.facts import ContainerFacts, PodFacts
from shim.decision.guard import GuardConfig, GuardState, Sample, Verdict, decide, is_swapping
from shim.evidence.metrics import Metrics
from shim.guard.monitor import Monitor
from shim.node.state import NodeState
from shim.nri import api_pb2 as npb
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import CAPACITY, MI, create_container, sandbox_config, update_resources
from tests.test_nri_front import nri_container, nri_pod

NODE = NodeFacts(capacity=CAPACITY, allocatable=CAPACITY - 200 * MI, page_size=4096, factor=0.9)
UID = "7c1d0000-0000-4000-8000-000000000001"
TABLE = make_table({
    "latency-critical": ContainerClass("latency-critical", factor_set=True, factor=None, guard_action="none"),
    "batch": ContainerClass("batch", factor_set=True, factor=0.5, reclaim=True, policy=Policy.NONE),
    "swappy": ContainerClass("swappy", swap=True),
}, {"default": ["latency-critical", "batch", "swappy"]})


def rewriter(records, table=TABLE):
    return ContainerMemoryQoS(NODE, Policy.HARD, records.append, classes=table)


def run(hooks, method, request: bytes, response: bytes = b"") -> bytes:
    call = RpcCall(method, 0.0, request=request)
    out = hooks.rewrite(call)
    hooks.finished(call.complete(0.1, out if out != request else None, [response], "OK", ""))
    return out


def create(hooks, annotations: dict, *, cid="c1", name="main", unified=None, request=256 * MI, limit=1024 * MI):
    sb = sandbox_config("p", UID, "burstable", annotations=annotations)
    req = create_container("s1", sb, name, "burstable", request=request, limit=limit,
                           unified={"memory.min": str(request), **(unified or {})})
    out = run(hooks, CREATE_CONTAINER, req.SerializeToString(),
              pb.CreateContainerResponse(container_id=cid).SerializeToString())
    return pb.CreateContainerRequest.FromString(out)


def test_a_class_changes_the_containers_values_and_is_kept_for_its_updates():
    records = []
    hooks = rewriter(records)
    plain = dict(create(rewriter([]), {}).config.linux.resources.unified)
    assert "memory.high" in plain and plain["memory.min"] == str(256 * MI)
    out = create(hooks, {"memqos.io/class": "latency-critical"})
    unified = dict(out.config.linux.resources.unified)
    assert unified == {"memory.min": str(256 * MI)}  # factor none: no memory.high
    note = json.loads(out.config.annotations["memqos.io/request"])
    assert note["class"] == "latency-critical"
    rec = records[-1]
    assert (rec["class"], rec["class_source"], rec["factor"]) == ("latency-critical", "pod-annotation", None)
    assert "class_refused" not in rec
    # the update carries no annotation: the class the container was created with still applies
    upd = update_resources("c1", limit=2048 * MI, oom_score_adj=500)
    out = pb.UpdateContainerResourcesRequest.FromString(run(hooks, UPDATE_CONTAINER_RESOURCES, upd.SerializeToString()))
    assert dict(out.linux.unified)["memory.high"] == "max"
    assert records[-1]["class"] == "latency-critical" and records[-1]["class_source"] == "remembered"
    assert hooks.containers["c1"].cls == "latency-critical"


def test_the_container_key_wins_and_a_class_without_protection_sets_none():
    records = []
    hooks = rewriter(records)
    out = create(hooks, {"memqos.io/class": "latency-critical", "memqos.io/class.main": "batch"})
    unified = dict(out.config.linux.resources.unified)
    assert "memory.min" not in unified and "memory.low" not in unified  # batch: policy None
    high = int(unified["memory.high"])
    assert high == (256 * MI + (1024 * MI - 256 * MI) // 2) // 4096 * 4096  # factor 0.5
    assert records[-1]["class_source"] == "container-annotation" and records[-1]["policy"] == "None"


def test_a_node_without_classes_writes_what_it_wrote_before():
    with_annotation, without = [], []
    a = create(ContainerMemoryQoS(NODE, Policy.HARD, with_annotation.append), {"memqos.io/class": "batch"})
    b = create(ContainerMemoryQoS(NODE, Policy.HARD, without.append), {})
    assert a.config.linux.resources == b.config.linux.resources
    assert a.config.annotations["memqos.io/request"] == b.config.annotations["memqos.io/request"]
    assert "class" not in json.loads(a.config.annotations["memqos.io/request"])
    assert "class" not in with_annotation[0] and with_annotation[0].keys() == without[0].keys()


def test_a_swap_class_lets_the_runtime_swap_only_where_the_kubelet_sent_no_swap_limit():
    records = []
    hooks = rewriter(records)
    out = create(hooks, {"memqos.io/class": "swappy"})
    assert out.config.linux.resources.unified["memory.swap.max"] == "max"
    assert "allows swap" in records[-1]["reasons"]["memory.swap.max"]
    for sent in ("0", str(64 * MI)):  # NoSwap, a LimitedSwap share: kept as sent
        out = create(hooks, {"memqos.io/class": "swappy"}, cid=f"c-{sent}", unified={"memory.swap.max": sent})
        assert out.config.linux.resources.unified["memory.swap.max"] == sent
    out = create(hooks, {}, cid="c-plain")
    assert "memory.swap.max" not in out.config.linux.resources.unified


def test_the_node_state_rebuilt_from_annotations_keeps_the_class_and_its_sums():
    records = []
    hooks = rewriter(records)
    out = create(hooks, {"memqos.io/class": "batch"})
    kept = create(hooks, {"memqos.io/class": "latency-critical"}, cid="c2", name="side")
    state = NodeState(CAPACITY, unprotected_classes(hooks.class_settings))
    assert state.unprotected == frozenset({"batch"})
    pod = PodFacts(uid=UID, namespace="default", name="p", cgroup_parent=out.sandbox_config.linux.cgroup_parent)
    state.apply(PodSandboxStarted("s1", pod, 0))
    for cid, msg in (("c1", out), ("c2", kept)):  # as a restarted shim lists them: unified and annotations
        res = msg.config.linux.resources
        state.apply(ContainerCreated(cid, "s1", pod, 0, msg.config.metadata.name, 0,
                                     ContainerFacts(msg.config.metadata.name, res.memory_limit_in_bytes,
                                                    res.oom_score_adj, dict(res.unified)),
                                     dict(res.unified), dict(msg.config.annotations), 1, 2))
    assert state.container("c1").cls == "batch" and state.container("c2").cls == "latency-critical"
    assert state.request(state.pods[UID]).bytes == 256 * MI  # batch counts 0, latency-critical its request


def nri_handler(records, table=TABLE):
    return NriMemoryQoS(NODE, Policy.HARD, records.append, classes=table)


def test_nri_create_update_and_a_restarted_plugins_synchronize_use_the_class():
    records = []
    h = nri_handler(records)
    pod = nri_pod("p", UID, "burstable", {"memqos.io/class": "latency-critical"})
    c = nri_container("c1", pod, "main", "burstable", request=256 * MI, limit=1024 * MI,
                      unified={"memory.min": str(256 * MI), "memory.high": str(900 * MI)})
    adjust = h.create_container(pod, c)
    assert dict(adjust.linux.resources.unified) == {"memory.high": "max"}  # the kubelet's memory.high neutralised
    note = adjust.annotations["memqos.io/request"]
    assert json.loads(note)["class"] == "latency-critical" and records[-1]["class"] == "latency-critical"
    # a restarted plugin: the container comes back in Synchronize with the annotation it was created with
    fresh = nri_handler(records)
    c.annotations["memqos.io/request"] = note
    assert fresh.synchronize([pod], [c]) == []
    assert fresh.containers["c1"].cls == "latency-critical"
    res = npb.LinuxResources()
    res.memory.limit.value = 2048 * MI
    res.unified.update({"memory.min": str(256 * MI), "memory.high": str(1900 * MI)})
    (update,) = fresh.update_container(pod, c, res)
    assert update.linux.resources.unified["memory.high"] == "max"
    assert records[-1]["class"] == "latency-critical"
    # a container the restarted plugin never saw, updated: the class its annotation recorded
    other = nri_handler(records)
    (update,) = other.update_container(pod, c, res)
    assert update.linux.resources.unified["memory.high"] == "max" and records[-1]["class_source"] == "remembered"


def test_the_guard_takes_the_classs_action_and_never_relaxes_where_the_kubelet_owns_memory_high():
    m = Monitor.__new__(Monitor)
    m.guard = GuardConfig()
    m.kubelet_high = False
    settings = rewriter([]).class_settings
    assert m._guard_for(None) is m.guard
    assert m._guard_for(settings["latency-critical"]).action.value == "none"
    assert m._guard_for(settings["batch"]) is m.guard
    assert m._guard_for(settings["swappy"]).swap_progress
    m.guard = GuardConfig(action=m._guard_for(settings["latency-critical"]).action)
    relaxing = rewriter([], make_table({"r": ContainerClass("r", guard_action="relax")}, {})).class_settings["r"]
    assert m._guard_for(relaxing).action.value == "relax"
    m.kubelet_high = True
    assert m._guard_for(relaxing).action.value == "none"


def hot(t, swap, prev=None):
    s = Sample(t=t, current=100 * MI, high=100 * MI, full_avg10=90.0, swap_current=swap,
               swapping=is_swapping(prev, swap))
    return s


def test_a_swap_class_that_swaps_out_is_not_a_crawl_until_swap_stops_growing():
    cfg = GuardConfig(window=30.0, swap_progress=True)
    samples = [hot(0.0, 0)]
    for i in range(1, 11):  # 50 s of swapping out 8 MiB per sample: progress, not a crawl
        samples.append(hot(i * 5.0, i * 8 * MI, samples[-1]))
    d = decide(samples, cfg, GuardState())
    assert d.verdict is Verdict.KEEP and "swapping out" in d.reason
    assert decide(samples, GuardConfig(window=30.0), GuardState()).verdict is Verdict.RELAX  # not a swap class
    for i in range(11, 19):  # swap full: memory.swap.current stays, the crawl goes on
        samples.append(hot(i * 5.0, 80 * MI, samples[-1]))
    assert decide(samples, cfg, GuardState()).verdict is Verdict.RELAX


def test_refusals_are_counted_by_reason_from_the_audit_stream():
    m = Metrics()
    records = []
    hooks = rewriter(records)
    for i, value in enumerate(("gold", "NOT A NAME", "gold")):
        create(hooks, {"memqos.io/class": value}, cid=f"c{i}")
    for r in records:
        m.on_audit(r)
    text = m.render().decode()
    assert 'memqos_class_refused_total{reason="unknown-class"} 2.0' in text
    assert 'memqos_class_refused_total{reason="malformed"} 1.0' in text
    assert 'memqos_class_refused_total{reason="namespace-not-allowed"} 0.0' in text


# -- serve end to end: a restart rebuilt from the runtime's listing ------------------------------

def test_a_restarted_serve_keeps_each_containers_class_for_updates_and_sums(tmp_path):
    from tests.test_reconciler import Stack
    from tests.reconciler_support import wait_for

    config = tmp_path / "classes.yaml"
    config.write_text("classes:\n  latency-critical: {factor: none}\n  batch: {policy: None, factor: 0.5}\n"
                      "namespace-classes:\n  default: [latency-critical, batch]\n")
    s = Stack(tmp_path, extra=("--config", str(config)))
    lc_uid, batch_uid = "7c1d0000-0000-4000-8000-0000000000a1", "7c1d0000-0000-4000-8000-0000000000a2"
    lc = s.kubelet.run_pod("lc", lc_uid, "burstable", annotations={"memqos.io/class": "latency-critical"})
    lc_cid = s.kubelet.create(lc, "main", "burstable", request=32 * MI, limit=128 * MI)
    batch = s.kubelet.run_pod("batch", batch_uid, "burstable", annotations={"memqos.io/class": "batch"})
    s.kubelet.create(batch, "main", "burstable", request=64 * MI, limit=256 * MI)
    tree = s.tree
    wait_for(lambda: tree.get(tree.pod("burstable", lc_uid)) == 32 * MI)
    wait_for(lambda: tree.get(tree.kubepods) == 32 * MI)  # the batch container counts 0
    assert tree.get(tree.pod("burstable", batch_uid)) == 0
    runtime = s.rt.runtime
    s.close()

    s = Stack(tmp_path, tree=tree, runtime=runtime, extra=("--config", str(config)))
    try:
        wait_for(lambda: s.svc.reconciler.view.classes.get(lc_cid) == "latency-critical")
        assert s.svc.reconciler.state.unprotected == frozenset({"batch"})
        s.kubelet.update(lc_cid, limit=256 * MI, oom_score_adj=900, unified={"memory.min": str(32 * MI)})
        s.sync()
        (rec,) = [r for r in s.records() if r.get("method") == "UpdateContainerResources"]
        assert rec["class"] == "latency-critical" and rec["class_source"] == "remembered"
        assert rec["unified_after"]["memory.high"] == "max"
        assert tree.get(tree.kubepods) == 32 * MI
    finally:
        s.close()


def test_the_monitor_reclaims_for_a_class_that_asks_and_reads_swap_for_a_swap_class(tmp_path):
    """The real monitor over a fake cgroupfs: the node's reclaim is off, the batch class's on; the
    swap class's container has its memory.swap.current read and carried on its guard record."""
    import dataclasses

    from shim.decision.reclaim import ReclaimConfig
    from tests.test_metrics import CID, CID2, Clock, fake_root, pressure_text, ref, write_cgroup
    from tests.test_reclaim_monitor import FakeKernel, container

    root = fake_root(tmp_path)
    batch_dir = container(root, CID)
    plain_dir = container(root, CID2)
    settings = rewriter([]).class_settings
    refs = [dataclasses.replace(ref(CID), cls="batch"), ref(CID2, name="other")]
    clock, kernel, records = Clock(), FakeKernel(), []
    m = Monitor(cgroup_root=str(root), kubelet=__import__("shim.node.facts", fromlist=["KubeletFacts"]).KubeletFacts(
                    source="test", cgroup_driver="cgroupfs"), guard=GuardConfig(window=10.0), interval=5.0,
                emit=records.append, sources=[lambda: list(refs)], clock=clock, reclaim=ReclaimConfig(),
                page_size=4096, class_settings={k: v for k, v in settings.items() if k}, reclaim_default=False)
    m.fs._write_value = kernel
    for _ in range(2):
        m.tick()
        clock.t += 5
    assert [w[0] for w in kernel.writes] == [str(batch_dir)]  # the class's reclaim only
    assert (plain_dir / "memory.current").read_text() == f"{95 * MI}\n"
    # a swap-class container crawling at memory.high while it swaps out: no relaxation
    swap_ref = dataclasses.replace(ref(CID2, name="other"), cls="swappy")
    refs[:] = [swap_ref]
    write_cgroup(plain_dir, current=100 * MI, min=16 * MI, high=100 * MI, max=200 * MI, events={"high": 5},
                 pressure=pressure_text(0.5, 90.0))
    for i in range(6):
        (plain_dir / "memory.swap.current").write_text(f"{i * 8 * MI}\n")
        m.tick()
        clock.t += 5
    assert (plain_dir / "memory.high").read_text().strip() == str(100 * MI)
    assert m.snapshot().readings[0].swap_current == 5 * 8 * MI
    for _ in range(4):  # swap stops growing: the crawl counts, the guard relaxes memory.high
        m.tick()
        clock.t += 5
    assert (plain_dir / "memory.high").read_text().strip() == "max"
    (relax,) = [r for r in records if r["event"] == "guard-relax"]
    assert relax["class"] == "swappy" and relax["memory_swap_current"] == 5 * 8 * MI
