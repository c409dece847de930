"""NRI mode: the values answered are confirmed in the kernel (shim.container.nri_confirm), and a
kubelet that writes its own Memory QoS values keeps them (NRI ownership, never lowering a value
in force)."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from shim.app.nri_front import NriService
from shim.container.nri_confirm import Expected, NriConfirmer
from shim.cri import pb as cri
from shim.decision import Policy
from shim.effects.rollout import Rollout
from shim.evidence.trace import read_trace
from shim.nri import api_pb2 as pb
from shim.node.facts import load_kubelet_config
from shim.node.kubelet import CONTAINER_HIGH, CONTAINER_PROTECTION, KUBELET, SHIM, kubelet_writes, ownership
from memqos_dev.testing.fake_nri_runtime import FakeNriRuntime
from memqos_dev.testing.traces import TRACES_DIR, trace_file
from shim.tools.kubelet_requests import MI
from tests.reconciler_support import FakeCgroupTree
from tests.test_nri_front import UB, UE, Stack, nri_args, nri_config, nri_container, nri_pod, records, run

MEMQOS_ON = "kubelet-1.23-cgroupfs-memqos-on"
ON_CONFIG = TRACES_DIR / "kubelet-config-memqos-on.json"
REQ = json.dumps({"app": "256Mi"})


def container_cgroup(tree: FakeCgroupTree, qos: str, uid: str, cid: str, *, low="0", high="max") -> str:
    """A container's cgroup as runc leaves it when nobody set its memory keys."""
    rel = f"{tree.make_pod(qos, uid)}/{cid}"
    d = tree.mkdir(rel)
    (d / "memory.low").write_text(f"{low}\n")
    (d / "memory.high").write_text(f"{high}\n")
    return rel


def text(tree: FakeCgroupTree, rel: str, file: str) -> str:
    return (tree.root / rel / file).read_text().strip()


class Kubelet:
    source = ""
    cgroup_driver = "cgroupfs"
    cgroup_root = "/"


def confirmer(tree: FakeCgroupTree, emitted: list, **kw) -> NriConfirmer:
    now = [0.0]
    c = NriConfirmer(cgroup_root=str(tree.root), kubelet=Kubelet(), emit=emitted.append, clock=lambda: now[0], **kw)
    c.now = now
    return c


def expected(tree: FakeCgroupTree, cid: str, uid: str, values: dict, qos: str = "burstable") -> Expected:
    return Expected(cid, uid, "/" + tree.pod(qos, uid), f"default/p/{cid}", values, "Synchronize")


# -- the confirmer ---------------------------------------------------------------------------------

def test_values_that_did_not_land_are_written_and_protection_in_force_is_never_lowered(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    missing = container_cgroup(tree, "burstable", UB, "c1")  # 0 / max: the answer did not land
    higher = container_cgroup(tree, "besteffort", UE, "c2")
    tree.set(higher, "memory.min", 300 * MI)  # in force, above the decision
    out: list = []
    c = confirmer(tree, out)
    c.handle([expected(tree, "c1", UB, {"memory.min": str(256 * MI), "memory.high": str(900 * MI)}),
              expected(tree, "c2", UE, {"memory.min": str(256 * MI)}, "besteffort")])
    c.now[0] = 1.0
    c.handle([])
    assert text(tree, missing, "memory.min") == "0"  # one look: the runtime may be about to write them
    c.now[0] = 2.0
    c.handle([])
    assert text(tree, missing, "memory.min") == str(256 * MI) and text(tree, missing, "memory.high") == str(900 * MI)
    assert text(tree, higher, "memory.min") == str(300 * MI)  # kept
    [rec] = out
    assert rec["event"] == "nri-confirm" and rec["outcome"] == "written" and rec["container_id"] == "c1"
    assert rec["values"]["memory.min"] == {"kernel": "0", "decided": str(256 * MI), "action": "written"}
    assert (c.stats.confirmed, c.stats.written, c.stats.reported) == (1, 2, 0)


def test_report_mode_observe_and_the_guards_episode_write_nothing(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    rel = container_cgroup(tree, "burstable", UB, "c1")
    want = {"memory.min": str(256 * MI), "memory.high": str(900 * MI)}
    for kw in ({"mode": "report"}, {"rollout": Rollout("observe")}):
        out: list = []
        c = confirmer(tree, out, **kw)
        c.handle([expected(tree, "c1", UB, want)])
        for t in (1.0, 2.0):
            c.now[0] = t
            c.handle([])
        assert text(tree, rel, "memory.min") == "0" and text(tree, rel, "memory.high") == "max"
        assert [r["outcome"] for r in out] == ["reported"] and c.stats.reported == 2
    out = []
    c = confirmer(tree, out, guarded=lambda cid: cid == "c1")
    c.handle([expected(tree, "c1", UB, want)])
    for t in (1.0, 2.0):
        c.now[0] = t
        c.handle([])
    assert text(tree, rel, "memory.min") == str(256 * MI) and text(tree, rel, "memory.high") == "max"
    assert out[0]["values"]["memory.high"]["action"].startswith("reported: the guard")


def test_a_container_whose_cgroup_never_appears_is_given_up_after_the_window(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    tree.make_pod("burstable", UB)
    out: list = []
    c = confirmer(tree, out, window=10.0)
    c.handle([expected(tree, "late", UB, {"memory.min": "4096"})])
    for t in (1.0, 5.0):
        c.now[0] = t
        c.handle([])
        assert c.wait_time() is not None  # still waiting for it
    c.now[0] = 11.0
    c.handle([])
    assert c.stats.gave_up == 1 and c.wait_time() is None
    assert out[-1]["outcome"] == "gave-up"


def test_the_queue_is_bounded_and_counts_what_it_drops(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    c = confirmer(tree, [], max_pending=1)  # (the thread is not started: nothing is taken)
    assert c.submit(expected(tree, "a", UB, {"memory.min": "4096"}))
    assert not c.submit(expected(tree, "b", UB, {"memory.min": "4096"}))
    assert (c.stats.submitted, c.stats.dropped) == (1, 1)


def test_request_data_that_makes_no_valid_path_is_refused(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    out: list = []
    c = confirmer(tree, out)
    c.handle([Expected("../../etc", UB, "/" + tree.pod("burstable", UB), "x", {"memory.min": "1"}, "Synchronize"),
              Expected("c1", UB, "/somewhere/else", "x", {"memory.min": "1"}, "Synchronize")])
    c.now[0] = 1.0
    c.handle([])
    assert c.stats.refused == 2 and [r["outcome"] for r in out] == ["refused", "refused"]


# -- through the plugin: a Synchronize update containerd keeps in the spec only --------------------

def test_a_synchronize_update_that_does_not_reach_the_cgroup_is_written_by_the_confirmer(tmp_path):
    st = Stack(tmp_path)
    tree = st.tree
    b = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
    # created while the plugin was away and not running yet: containerd updates its stored spec
    # only, its cgroup keeps 0 / max
    cb = nri_container("cb", b, "app", "burstable", request=256 * MI, limit=1024 * MI, state=pb.CONTAINER_CREATED)
    rel = container_cgroup(tree, "burstable", UB, "cb")

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock, pods=[b], containers=[cb]) as rt:
                p = await rt.next_plugin()
                [u] = p.sync_replies[-1].update
                want = dict(u.linux.resources.unified)
                assert want["memory.min"] == str(256 * MI)
                for _ in range(200):
                    if text(tree, rel, "memory.min") != "0":
                        break
                    await asyncio.sleep(0.05)
                assert text(tree, rel, "memory.min") == want["memory.min"]
                assert text(tree, rel, "memory.high") == want["memory.high"]
                assert service.audit.sync(10)
                [rec] = records(st.audit, "nri-confirm")
                assert rec["outcome"] == "written" and rec["method"] == "Synchronize"
        finally:
            await service.stop()
    run(main())


def test_synchronize_never_lowers_a_memory_min_in_force(tmp_path):
    st = Stack(tmp_path)
    tree = st.tree
    b = nri_pod("b", UB, "burstable")
    # only oom_score_adj tells the request: the plugin's estimate is below the 32 Mi in force
    cb = nri_container("cb", b, "app", "burstable", request=32 * MI, limit=128 * MI, state=pb.CONTAINER_RUNNING)
    rel = container_cgroup(tree, "burstable", UB, "cb")
    tree.set(rel, "memory.min", 32 * MI)

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock, pods=[b], containers=[cb]) as rt:
                p = await rt.next_plugin()
                updates = {u.container_id: dict(u.linux.resources.unified) for u in p.sync_replies[-1].update}
                assert "memory.min" not in updates.get("cb", {})
                assert service.audit.sync(10)
                [rec] = [r for r in records(st.audit) if r.get("method") == "Synchronize"]
                assert int(rec["kept_in_force"]["memory.min"]) == 32 * MI
                assert text(tree, rel, "memory.min") == str(32 * MI)
        finally:
            await service.stop()
    run(main())


# -- a gate-on kubelet's keys (the recorded gate-on trace) -----------------------------------------

def nri_from_cri(req: cri.CreateContainerRequest, cid: str) -> tuple[pb.PodSandbox, pb.Container]:
    """The pod and container a containerd before 2.2 hands a plugin for this CRI request: the
    kubelet's unified map is not copied."""
    sb, cfg = req.sandbox_config, req.config
    pod = pb.PodSandbox(id=req.pod_sandbox_id, name=sb.metadata.name, uid=sb.metadata.uid,
                        namespace=sb.metadata.namespace, annotations=dict(sb.annotations),
                        linux=pb.LinuxPodSandbox(cgroup_parent=sb.linux.cgroup_parent))
    c = pb.Container(id=cid, pod_sandbox_id=req.pod_sandbox_id, name=cfg.metadata.name,
                     state=pb.CONTAINER_CREATED, annotations=dict(cfg.annotations))
    res = cfg.linux.resources
    c.linux.oom_score_adj.value = res.oom_score_adj
    c.linux.cgroups_path = f"{sb.linux.cgroup_parent}/{cid}"
    if res.memory_limit_in_bytes:
        c.linux.resources.memory.limit.value = res.memory_limit_in_bytes
    return pod, c


def test_nri_ownership_leaves_a_gate_on_kubelets_container_keys_to_it():
    writes = kubelet_writes(load_kubelet_config(str(ON_CONFIG)), None)  # the pod cannot run `kubelet --version`
    proxy, nri = ownership(writes, Policy.HARD), ownership(writes, Policy.HARD, nri=True)
    assert proxy.owner(CONTAINER_PROTECTION) == SHIM  # the proxy reuses the kubelet's request exactly
    assert nri.owner(CONTAINER_PROTECTION) == KUBELET and nri.owner(CONTAINER_HIGH) == KUBELET
    assert set(nri.kubelet_keys()) == {"memory.min", "memory.low", "memory.high"}
    assert nri.kubelet_scopes() == proxy.kubelet_scopes()
    off = kubelet_writes(load_kubelet_config(str(TRACES_DIR / "kubelet-config-memqos-off.json")), None)
    assert ownership(off, Policy.HARD, nri=True).kubelet_keys() == {}


def test_beside_the_recorded_gate_on_kubelet_no_adjustment_touches_its_keys(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    args = nri_args(tmp_path, tree, os.path.join(tmp_path, "nri.sock"), audit=tmp_path / "audit.jsonl")
    args[args.index("--kubelet-config") + 1] = str(ON_CONFIG)
    args[args.index("--kubelet-version") + 1] = "unknown"
    service = NriService.from_config(nri_config(args))
    try:
        trace = read_trace(str(trace_file(MEMQOS_ON)))
        creates = [c for c in trace.calls if c.name == "CreateContainer"]
        assert len(creates) == 8
        for i, call in enumerate(creates):
            req = cri.CreateContainerRequest.FromString(call.request)
            kubelets = dict(req.config.linux.resources.unified)
            pod, c = nri_from_cri(req, f"c{i}")
            adjust = service.handler.create_container(pod, c)
            sent = dict(adjust.linux.resources.unified) if adjust is not None else {}
            assert not {"memory.min", "memory.low", "memory.high"} & set(sent), (c.name, sent, kubelets)
        # the kubelet's values in force are not lowered by a Synchronize either
        pod, c = nri_from_cri(cri.CreateContainerRequest.FromString(creates[-1].request), "running")
        c.state = pb.CONTAINER_RUNNING
        assert service.handler.synchronize([pod], [c]) == []
    finally:
        service.audit.close()
        if service.handler.confirmer is not None:
            service.handler.confirmer.stop()


def test_the_recorded_trace_is_where_the_test_looks():
    assert Path(trace_file(MEMQOS_ON)).exists() and ON_CONFIG.exists()


def test_doctor_says_which_keys_nri_mode_leaves_to_the_kubelet(tmp_path):
    from shim.tools.doctor import Doctor
    from tests.test_doctor import cfg, env

    # version unknown, gate on: v1.22-v1.35 assumed, either memory.high formula (v1.22's writes one for
    # BestEffort containers, v1.27's none)
    for config, version, want in (
            (ON_CONFIG, "unknown", "the kubelet's keys, left out of the adjustment of each container it writes them "
                                   "for (Guaranteed: memory.low, memory.min; Burstable request < limit: memory.high, "
                                   "memory.low, memory.min;"),
            (ON_CONFIG, "unknown", "BestEffort: memory.high)"),
            (ON_CONFIG, "1.28", "BestEffort: none)"),
            (TRACES_DIR / "kubelet-config-memqos-off.json", "unknown", "the kubelet writes no container")):
        r = Doctor(cfg(kubelet_config=str(config), kubelet_version=version), env(tmp_path)).check_nri()
        assert any(want in line for line in r.details), r.details


def test_nri_metrics_count_confirmations_call_times_and_loop_stalls(tmp_path):
    import urllib.request

    st = Stack(tmp_path, extra=("--metrics-address", "127.0.0.1:0"))
    tree = st.tree
    b = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
    cb = nri_container("cb", b, "app", "burstable", request=256 * MI, limit=1024 * MI, state=pb.CONTAINER_CREATED)
    container_cgroup(tree, "burstable", UB, "cb")

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock, pods=[b], containers=[cb]) as rt:
                await rt.next_plugin()
                while service.handler.confirmer.stats.written == 0:
                    await asyncio.sleep(0.05)
                host, port = service.metrics.address
                text = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode())
                assert 'memqos_nri_confirm_total{outcome="written"} 2.0' in text
                assert 'memqos_nri_calls_total{method="Synchronize"} 1.0' in text
                assert 'memqos_nri_call_seconds_max{method="Synchronize",part="handler"}' in text
                assert "memqos_nri_loop_stalls_total" in text
        finally:
            await service.stop()
    run(main())


def test_the_kernels_page_rounding_is_no_difference():
    from shim.container.nri_confirm import differs

    assert not differs("memory.min", "16482304", "16483353", 4096)  # read back rounded down to a page
    assert differs("memory.min", "16478208", "16483353", 4096)
    assert not differs("memory.high", "max", "max", 4096) and differs("memory.high", "max", "124092416", 4096)
    assert not differs("memory.min", "33554432", "16777216", 4096)  # higher in force: kept
    assert not differs("memory.low", None, "4096", 4096)  # unreadable: nothing to compare


def test_values_written_between_two_looks_are_not_counted_as_missing(tmp_path):
    """A runtime makes the cgroup, then writes its values: the first look may fall in between."""
    tree = FakeCgroupTree(tmp_path / "cg")
    rel = container_cgroup(tree, "burstable", UB, "c1")
    out: list = []
    c = confirmer(tree, out)
    c.handle([expected(tree, "c1", UB, {"memory.min": str(256 * MI)})])
    c.now[0] = 1.0
    c.handle([])
    tree.set(rel, "memory.min", 256 * MI)  # the runtime's write
    c.now[0] = 2.0
    c.handle([])
    assert out == [] and (c.stats.confirmed, c.stats.written) == (1, 0) and c.wait_time() is None
