"""`memqos-shim nri`: the NRI front end over the same decision, reconciler and audit as `serve`.

One table, both modes: for the same pod and container the NRI adjustment leaves the container
with what proxy mode's rewrite forwards. Then whole sessions against the fake NRI runtime
(memqos_dev/testing/fake_nri_runtime.py) over a real unix socket, with a temporary cgroup tree:
Synchronize rebuilds the reconciler's node state (values restored, nothing lowered, updates
for containers created without us), CreateContainer / UpdateContainer answers, the lifecycle
events writing pod / QoS / kubepods memory.min, a failing handler answered with an empty
adjustment, the heartbeat file, and `memqos-shim nri` as a process."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shim.app.config import add_arguments, resolve
from shim.app.nri_front import NriService
from shim.app.service import build_container_qos
from shim.container import nri_handler
from shim.container.nri_handler import NriMemoryQoS
from shim.cri import pb as cri
from shim.decision import NodeFacts, Policy
from shim.decision.memory import NEUTRAL
from shim.evidence.health import check
from shim.nri import api_pb2 as pb
from memqos_dev.testing.fake_nri_runtime import FakeNriRuntime, socket_dir
from shim.tools.kubelet_requests import CAPACITY, MI, cgroup_parent, create_container, oom_score_adj, \
    sandbox_config, update_resources
from shim.transport.hooks import RpcCall
from tests.reconciler_support import PAGE, FakeCgroupTree, write_kubelet_config, write_meminfo

REPO = Path(__file__).resolve().parents[1]
ALLOCATABLE = CAPACITY - 200 * MI  # write_kubelet_config reserves 100Mi + 100Mi
UG, UB, UE = ("6b3f1a2e-0000-4000-8000-00000000000%d" % i for i in (1, 2, 3))
NODE = NodeFacts(capacity=CAPACITY, allocatable=ALLOCATABLE, page_size=PAGE, factor=0.9)


# -- the same pod in both modes ------------------------------------------------------------------

def nri_pod(name: str, uid: str, qos: str, annotations: dict | None = None, *, sid: str = "") -> pb.PodSandbox:
    return pb.PodSandbox(id=sid or f"sb-{uid}", name=name, uid=uid, namespace="default",
                         annotations=annotations or {},
                         linux=pb.LinuxPodSandbox(cgroup_parent=cgroup_parent(qos, uid)))


def nri_container(cid: str, pod: pb.PodSandbox, name: str, qos: str, *, request: int = 0, limit: int = 0,
                  unified: dict | None = None, state: int = pb.CONTAINER_CREATED,
                  annotations: dict | None = None) -> pb.Container:
    """A container as containerd hands it to a plugin: the OCI spec's resources (limit, unified),
    oom_score_adj, the cgroups path under the pod's cgroup."""
    c = pb.Container(id=cid, pod_sandbox_id=pod.id, name=name, state=state, annotations=annotations or {})
    c.linux.oom_score_adj.value = oom_score_adj(qos, request)
    c.linux.cgroups_path = f"{pod.linux.cgroup_parent}/{cid}"
    if limit:
        c.linux.resources.memory.limit.value = limit
    c.linux.resources.unified.update(unified or {})
    return c


def proxy_call(qos_hooks, qos: str, uid: str, request: int, limit: int, annotations: dict, unified: dict,
               cid: str = "c1") -> RpcCall:
    """Proxy mode's CreateContainer for this pod and container, rewritten and finished (the
    rewriter then remembers the container as ``cid``)."""
    sb = sandbox_config("p", uid, qos, annotations=annotations)
    req = create_container("sb-" + uid, sb, "app", qos, request=request, limit=limit, unified=unified)
    call = RpcCall("/runtime.v1.RuntimeService/CreateContainer", time.time(), request=req.SerializeToString())
    out = qos_hooks.rewrite(call)
    call.complete(1.0, out, [cri.CreateContainerResponse(container_id=cid).SerializeToString()], "OK", "")
    qos_hooks.finished(call)
    return call


def proxy_unified(qos_hooks, qos: str, uid: str, request: int, limit: int, annotations: dict,
                  unified: dict) -> dict:
    """What proxy mode forwards in CreateContainer's unified for this pod and container."""
    call = proxy_call(qos_hooks, qos, uid, request, limit, annotations, unified)
    return dict(cri.CreateContainerRequest.FromString(call.forwarded or call.request).config.linux.resources.unified)


def effective(unified: dict) -> dict:
    """What the container's cgroup holds for the memory keys (a key nobody sets: its default)."""
    return {k: unified.get(k, v) for k, v in NEUTRAL.items()} | \
        {k: v for k, v in unified.items() if k not in NEUTRAL}


class Owns:
    """An Ownership by which the kubelet owns container memory.min / memory.low."""

    def kubelet_keys(self):
        return {"memory.min": "kubelet v1.36 with a memoryReservationPolicy",
                "memory.low": "kubelet v1.36 with a memoryReservationPolicy"}


REQ = json.dumps({"app": "256Mi"})
# qos, request, limit, pod annotations, the kubelet's unified (containerd >= 2.2 copies it), policy, ownership
TABLE = [
    ("guaranteed", 512 * MI, 512 * MI, {}, {}, Policy.HARD, None),
    ("burstable", 256 * MI, 1024 * MI, {"memqos.io/requests": REQ}, {}, Policy.HARD, None),
    ("burstable", 256 * MI, 0, {}, {}, Policy.HARD, None),  # only oom_score_adj tells: its lower bound
    ("burstable", 300 * MI, 1024 * MI, {}, {"memory.min": str(300 * MI)}, Policy.HARD, None),
    ("burstable", 300 * MI, 1024 * MI, {}, {"memory.min": str(300 * MI), "memory.oom.group": "1"}, Policy.SOFT,
     None),
    ("burstable", 256 * MI, 1024 * MI, {"memqos.io/requests": REQ}, {}, Policy.TIERED_RESERVATION, None),
    ("burstable", 300 * MI, 1024 * MI, {}, {"memory.min": str(200 * MI)}, Policy.HARD, Owns()),
    ("besteffort", 0, 0, {}, {}, Policy.HARD, None),
    ("guaranteed", 512 * MI, 512 * MI, {}, {"memory.min": str(512 * MI)}, Policy.NONE, None),
]


@pytest.mark.parametrize("qos, req, limit, annotations, unified, policy, owns", TABLE)
def test_the_nri_adjustment_leaves_the_container_with_what_proxy_mode_forwards(qos, req, limit, annotations,
                                                                              unified, policy, owns):
    proxy_records, nri_records = [], []
    rewriter = build_container_qos(NODE, policy, proxy_records.append, ownership=owns)
    handler = NriMemoryQoS(NODE, policy, nri_records.append, ownership=owns)
    call = proxy_call(rewriter, qos, "u1", req, limit, annotations, unified)
    forwarded = dict(cri.CreateContainerRequest.FromString(call.forwarded or call.request)
                     .config.linux.resources.unified)
    pod = nri_pod("p", "u1", qos, annotations)
    container = nri_container("c1", pod, "app", qos, request=req, limit=limit, unified=unified)
    adjust = handler.create_container(pod, container) or pb.ContainerAdjustment()
    applied = {**unified, **adjust.linux.resources.unified}  # the runtime merges the keys over the spec
    assert effective(applied) == effective(forwarded)
    if owns is not None:  # the keys the kubelet owns are not in the adjustment at all
        assert not {"memory.min", "memory.low"} & set(adjust.linux.resources.unified)
    [record] = nri_records
    assert record["mode"] == "nri" and record["method"] == "CreateContainer"
    d = call.rewritten.decision
    assert (record["qos"], record["request"], record["request_source"], record["unified_after"]) == \
        (d.qos.value, d.request.bytes, d.request.source.value, dict(d.unified_after))
    assert json.loads(adjust.annotations["memqos.io/request"])["bytes"] == record["request"]


def test_an_update_gets_what_proxy_mode_forwards_for_the_same_container():
    rewriter = build_container_qos(NODE, Policy.HARD, lambda r: None)
    handler = NriMemoryQoS(NODE, Policy.HARD, lambda r: None)
    annotations = {"memqos.io/requests": REQ}
    cid = "c1"
    proxy_call(rewriter, "burstable", "u1", 256 * MI, 1024 * MI, annotations, {}, cid)
    assert cid in rewriter.containers
    pod = nri_pod("p", "u1", "burstable", annotations)
    handler.create_container(pod, nri_container(cid, pod, "app", "burstable", request=256 * MI, limit=1024 * MI))
    # the resize: limit 1 GiB -> 2 GiB
    upd = update_resources(cid, limit=2048 * MI, oom_score_adj=oom_score_adj("burstable", 256 * MI))
    call = RpcCall("/runtime.v1.RuntimeService/UpdateContainerResources", time.time(),
                   request=upd.SerializeToString())
    forwarded = dict(cri.UpdateContainerResourcesRequest.FromString(rewriter.rewrite(call)).linux.unified)
    res = pb.LinuxResources()
    res.memory.limit.value = 2048 * MI
    [update] = handler.update_container(pod, nri_container(cid, pod, "app", "burstable", request=256 * MI,
                                                           limit=1024 * MI), res)
    assert update.container_id == cid
    assert effective(dict(update.linux.resources.unified)) == effective(forwarded)
    assert update.linux.resources.unified["memory.high"] != NEUTRAL["memory.high"]


SLICE_UID = UB.replace("-", "_")


@pytest.mark.parametrize("pod_parent, pod_path, container_path, parent, qos", [
    (f"/kubepods/burstable/pod{UB}", "", "", f"/kubepods/burstable/pod{UB}", "Burstable"),
    # no cgroup_parent: the container's cgroups path (systemd driver: "<pod slice>:<prefix>:<id>")
    ("", "", f"kubepods-besteffort-pod{SLICE_UID}.slice:cri-containerd:c1",
     f"kubepods-besteffort-pod{SLICE_UID}.slice", "BestEffort"),
    ("", "", f"/kubepods/pod{UB}/c1", f"/kubepods/pod{UB}", "Guaranteed"),
    # ... or the sandbox's own
    ("", f"/kubepods/burstable/pod{UB}/sb1", "", f"/kubepods/burstable/pod{UB}", "Burstable"),
])
def test_the_qos_class_comes_from_the_cgroup_parent_or_a_cgroups_path(pod_parent, pod_path, container_path, parent,
                                                                      qos):
    from shim.nri import facts

    pod = pb.PodSandbox(id="sb1", uid=UB, linux=pb.LinuxPodSandbox(cgroup_parent=pod_parent, cgroups_path=pod_path))
    c = pb.Container(id="c1", name="app")
    c.linux.cgroups_path = container_path
    c.linux.oom_score_adj.value = -997 if qos == "BestEffort" else 1000  # says otherwise: the parent wins
    assert facts.pod_facts(pod, c).cgroup_parent == parent
    records = []
    NriMemoryQoS(NODE, Policy.HARD, records.append).create_container(pod, c)
    assert (records[-1]["qos"], records[-1]["qos_source"]) == (qos, "cgroup-parent")


def test_nri_facts_are_the_proxy_facts_of_the_same_container():
    from shim.cri.facts import container_facts, pod_facts
    from shim.nri import facts

    annotations = {"memqos.io/requests": REQ}
    sb = sandbox_config("p", UB, "burstable", annotations=annotations)
    req = create_container("sb-" + UB, sb, "app", "burstable", request=256 * MI, limit=1024 * MI,
                           unified={"memory.min": "1"})
    pod = nri_pod("p", UB, "burstable", annotations)
    c = nri_container("c1", pod, "app", "burstable", request=256 * MI, limit=1024 * MI, unified={"memory.min": "1"})
    assert facts.pod_facts(pod, c) == pod_facts(req.sandbox_config)
    assert facts.container_facts(c) == container_facts("app", req.config.linux.resources)
    pod.linux.pod_overhead.memory.limit.value = 64 * MI
    assert facts.pod_overhead(pod) == 64 * MI
    c.annotations["io.kubernetes.container.restartCount"] = "3"
    assert facts.container_created(pod, c, {}, {}, 1, 2).attempt == 3


# -- sessions against the fake runtime -------------------------------------------------------------

def nri_args(tmp: Path, tree: FakeCgroupTree, nri_sock: str, *, audit: Path, extra: tuple = ()) -> list[str]:
    kc = write_kubelet_config(tmp / "kubelet.json")
    mi = write_meminfo(tmp / "meminfo")
    return ["--nri-socket", nri_sock, "--kubelet-config", str(kc), "--cgroup-root", str(tree.root),
            "--meminfo", str(mi), "--policy", "Hard", "--resync-interval", "30", "--page-size", str(PAGE),
            "--audit-log", str(audit), "--kubelet-version", "1.33", "--monitor-interval", "0", *extra]


def nri_config(args: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(args))


def records(audit: Path, event: str | None = None) -> list[dict]:
    if not audit.exists():
        return []
    out = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    return [r for r in out if event is None or r.get("event") == event]


class Stack:
    """NriService from a config, a fake runtime, a cgroup tree, in one event loop."""

    def __init__(self, tmp: Path, *, extra: tuple = ()):
        self.tmp = tmp
        self.tree = FakeCgroupTree(tmp / "cg")
        self.audit = tmp / "audit.jsonl"
        self.sock = os.path.join(socket_dir(), "nri.sock")
        self.cfg = nri_config(nri_args(tmp, self.tree, self.sock, audit=self.audit, extra=extra))

    def service(self) -> NriService:
        s = NriService.from_config(self.cfg)
        s.plugin.backoff = (0.05, 0.2)
        return s

    def settle(self, service: NriService) -> None:
        """Everything the handler queued so far is applied and written."""
        assert service.reconciler.sync(10)
        assert service.audit.sync(10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_synchronize_rebuilds_the_node_state_restores_values_and_lowers_nothing(tmp_path):
    st = Stack(tmp_path)
    tree = st.tree
    g = nri_pod("g", UG, "guaranteed")
    b = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
    e = nri_pod("e", UE, "besteffort")
    ours = json.dumps({"bytes": 512 * MI, "source": "guaranteed-limit", "qos": "Guaranteed",
                       "cgroup_parent": g.linux.cgroup_parent})
    containers = [
        # created through us before a restart: our annotation, values in place; no update
        nri_container("cg", g, "app", "guaranteed", request=512 * MI, limit=512 * MI, state=pb.CONTAINER_RUNNING,
                      annotations={"memqos.io/request": ours}),
        # created while the plugin was away: get our values in the Synchronize reply
        nri_container("cb", b, "app", "burstable", request=256 * MI, limit=1024 * MI, state=pb.CONTAINER_RUNNING),
        nri_container("ce", e, "app", "besteffort", state=pb.CONTAINER_RUNNING),
    ]
    for qos, uid in (("guaranteed", UG), ("burstable", UB), ("besteffort", UE)):
        tree.make_pod(qos, uid)
    tree.set(tree.pod("guaranteed", UG), "memory.min", 600 * MI)  # in force, above the request: kept

    async def main():
        service = st.service()
        service.handler.containers["gone"] = "a container the runtime no longer lists"
        await service.start()
        try:
            await asyncio.sleep(0.3)
            assert service.reconciler.sync(10)
            assert records(st.audit, "resync") == []  # nothing before the runtime's listing
            # split in pieces of 2 (as a runtime does above 4 MiB): updates only in the last reply
            async with FakeNriRuntime(st.sock, pods=[g, b, e], containers=containers, sync_chunk=2) as rt:
                p = await rt.next_plugin()
                assert [r.more for r in p.sync_replies] == [True, True, False]
                reply = p.sync_replies[-1]
                # (BestEffort gets memory.high too: allocatable x factor, as in proxy mode)
                assert [u.container_id for u in reply.update] == ["cb", "ce"]
                upd = dict(reply.update[0].linux.resources.unified)
                assert upd["memory.min"] == str(256 * MI) and upd["memory.high"] != "max"
                assert reply.update[0].ignore_failure
                assert "gone" not in service.handler.containers  # removed while the plugin was away
                # what our annotation says is remembered for resizes, as at creation
                known = service.handler.containers["cg"]
                assert (known.request.bytes, known.request.source.value, known.qos.value) == \
                    (512 * MI, "guaranteed-limit", "Guaranteed")
                st.settle(service)
                assert tree.get(tree.pod("guaranteed", UG)) == 600 * MI  # not lowered
                assert tree.get(tree.pod("burstable", UB)) == 256 * MI
                assert tree.get(tree.pod("besteffort", UE)) == 0
                assert tree.get(tree.burstable) == 256 * MI
                assert tree.get(tree.kubepods) == 600 * MI + 256 * MI
                [resync] = [r for r in records(st.audit, "resync") if r["reason"] == "nri-synchronize"]
                assert resync["source"] == "listing and events" and resync["pods"] == 3
        finally:
            await service.stop()
    run(main())


def test_events_drive_pod_qos_and_kubepods_values_and_answers_come_over_the_socket(tmp_path):
    st = Stack(tmp_path)
    tree = st.tree

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock, runtime_version="2.1.9", nri_version=(0, 8, 0)) as rt:
                p = await rt.next_plugin()
                # StopPodSandbox (2) and StopContainer (10) on top of the defaults, all known to NRI 0.8
                assert p.events == 0x48d | 0x2 | 0x200
                pods = {"guaranteed": nri_pod("g", UG, "guaranteed"),
                        "burstable": nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ}),
                        "besteffort": nri_pod("e", UE, "besteffort")}
                sizes = {"guaranteed": (512 * MI, 512 * MI), "burstable": (256 * MI, 1024 * MI),
                         "besteffort": (0, 0)}
                for qos, pod in pods.items():
                    tree.make_pod(qos, pod.uid)
                    await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=pod), pb.Empty)
                    request, limit = sizes[qos]
                    c = nri_container("c" + qos[0], pod, "app", qos, request=request, limit=limit)
                    resp = await p.create_container(pod, c)
                    rewriter = build_container_qos(service.node, Policy.HARD, lambda r: None)
                    forwarded = proxy_unified(rewriter, qos, pod.uid, request, limit, dict(pod.annotations), {})
                    assert effective(dict(resp.adjust.linux.resources.unified)) == effective(forwarded)
                st.settle(service)
                assert tree.get(tree.pod("guaranteed", UG)) == 512 * MI
                assert tree.get(tree.pod("burstable", UB)) == 256 * MI
                assert tree.get(tree.burstable) == 256 * MI
                assert tree.get(tree.kubepods) == 768 * MI
                # an in-place resize of the Guaranteed container: 512 Mi -> 640 Mi
                res = pb.LinuxResources()
                res.memory.limit.value = 640 * MI
                g = pods["guaranteed"]
                cg = nri_container("cg", g, "app", "guaranteed", request=512 * MI, limit=512 * MI,
                                   state=pb.CONTAINER_RUNNING)
                reply = await p.call("UpdateContainer", pb.UpdateContainerRequest(pod=g, container=cg,
                                                                                   linux_resources=res),
                                     pb.UpdateContainerResponse)
                [u] = reply.update
                assert u.container_id == "cg" and u.linux.resources.unified["memory.min"] == str(576 * MI)
                assert u.linux.resources.unified["memory.low"] == str(640 * MI)  # memory.min 10% under the limit
                st.settle(service)
                assert tree.get(tree.pod("guaranteed", UG)) == 640 * MI
                assert tree.get(tree.kubepods) == 896 * MI
                # the burstable pod goes away: container removed, sandbox stopped and removed
                b = pods["burstable"]
                cb = nri_container("cb", b, "app", "burstable", request=256 * MI, limit=1024 * MI,
                                   state=pb.CONTAINER_STOPPED)
                for event, container in ((pb.STOP_CONTAINER, cb), (pb.REMOVE_CONTAINER, cb),
                                         (pb.STOP_POD_SANDBOX, None), (pb.REMOVE_POD_SANDBOX, None)):
                    await p.call("StateChange", pb.StateChangeEvent(event=event, pod=b, container=container),
                                 pb.Empty)
                st.settle(service)
                assert tree.get(tree.burstable) == 0
                assert tree.get(tree.kubepods) == 640 * MI
                assert "cb" not in service.handler.containers
                creates = [r for r in records(st.audit) if r.get("method") == "CreateContainer"]
                assert [(r["mode"], r["qos"]) for r in creates] == [("nri", "Guaranteed"), ("nri", "Burstable"),
                                                                   ("nri", "BestEffort")]
        finally:
            await service.stop()
    run(main())


def test_dedicated_lifecycle_rpcs_of_nri_0_12_feed_the_reconciler(tmp_path):
    st = Stack(tmp_path)
    tree = st.tree

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock, runtime_version="2.2.0", nri_version=(0, 12, 0)) as rt:
                p = await rt.next_plugin()
                assert p.events & (1 << (pb.UPDATE_POD_SANDBOX - 1))
                b = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
                tree.make_pod("burstable", UB)
                await p.call("RunPodSandbox", pb.RunPodSandboxRequest(pod=b), pb.RunPodSandboxResponse)
                await p.create_container(b, nri_container("cb", b, "app", "burstable", request=256 * MI,
                                                          limit=1024 * MI))
                overhead = pb.LinuxResources()
                overhead.memory.limit.value = 64 * MI
                await p.call("UpdatePodSandbox", pb.UpdatePodSandboxRequest(pod=b, overhead_linux_resources=overhead),
                             pb.UpdatePodSandboxResponse)
                st.settle(service)
                assert tree.get(tree.pod("burstable", UB)) == 320 * MI
                await p.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod=b), pb.RemovePodSandboxResponse)
                st.settle(service)
                assert tree.get(tree.burstable) == 0
        finally:
            await service.stop()
    run(main())


def test_a_failing_decision_gets_an_empty_adjustment_and_a_fail_open_record(tmp_path, monkeypatch):
    st = Stack(tmp_path)

    def broken(*a, **kw):
        raise RuntimeError("policy bug")

    monkeypatch.setattr(nri_handler, "decide", broken)

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock) as rt:
                p = await rt.next_plugin()
                b = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
                st.tree.make_pod("burstable", UB)
                await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=b), pb.Empty)
                resp = await p.create_container(b, nri_container("cb", b, "app", "burstable", request=256 * MI,
                                                                 limit=1024 * MI))
                assert resp == pb.CreateContainerResponse()  # no adjustment, and no error: the pod starts
                assert not p.closed and service.plugin.stats.protocol.handler_errors == 0
                st.settle(service)
                # the reconciler still knows the container (request from the pod annotation)
                assert st.tree.get(st.tree.pod("burstable", UB)) == 256 * MI
        finally:
            await service.stop()
        [fail] = records(st.audit, "fail-open")
        assert (fail["mode"], fail["method"], fail["container_id"]) == ("nri", "CreateContainer", "cb")
        assert "policy bug" in fail["error"]
    run(main())


def test_the_heartbeat_says_connecting_then_registered(tmp_path):
    health = tmp_path / "health.json"
    st = Stack(tmp_path, extra=("--health-file", str(health)))

    async def main():
        service = st.service()
        service.heartbeat_interval = 0.05
        await service.start()
        try:
            await asyncio.sleep(0.2)
            assert json.loads(health.read_text())["state"] == "connecting"
            assert check(str(health), 30)[0] and not check(str(health), 30, ready=True)[0]
            async with FakeNriRuntime(st.sock):
                for _ in range(100):
                    if json.loads(health.read_text())["state"] == "registered":
                        break
                    await asyncio.sleep(0.05)
                assert check(str(health), 30, ready=True)[0]
            for _ in range(100):  # the runtime went away: not ready any more
                if json.loads(health.read_text())["state"] == "connecting":
                    break
                await asyncio.sleep(0.05)
            assert not check(str(health), 30, ready=True)[0]
        finally:
            await service.stop()
        assert not health.exists()
    run(main())


def test_memqos_shim_nri_as_a_process_registers_and_adjusts(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg")
    audit = tmp_path / "audit.jsonl"
    health = tmp_path / "health.json"
    sock = os.path.join(socket_dir(), "nri.sock")
    args = nri_args(tmp_path, tree, sock, audit=audit, extra=("--health-file", str(health)))
    config = tmp_path / "config.yaml"
    config.write_text("".join(f"{k[2:]}: {json.dumps(v)}\n" for k, v in zip(args[::2], args[1::2])))

    async def main():
        async with FakeNriRuntime(sock) as rt:
            proc = subprocess.Popen([sys.executable, "-m", "shim", "nri", "--config", str(config)], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                p = await rt.next_plugin(timeout=30)
                assert rt.registrations == [("50", "memqos")]
                g = nri_pod("g", UG, "guaranteed")
                tree.make_pod("guaranteed", UG)
                await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=g), pb.Empty)
                resp = await p.create_container(g, nri_container("cg", g, "app", "guaranteed", request=512 * MI,
                                                                 limit=512 * MI))
                # memory.min ceil(10%) under the limit, page-rounded; memory.low the request
                assert resp.adjust.linux.resources.unified["memory.min"] == "483180544"
                assert resp.adjust.linux.resources.unified["memory.low"] == str(512 * MI)
                for _ in range(200):
                    if tree.get(tree.pod("guaranteed", UG)) == 512 * MI and health.exists() and \
                            json.loads(health.read_text())["state"] == "registered":
                        break
                    await asyncio.sleep(0.05)
                assert tree.get(tree.pod("guaranteed", UG)) == 512 * MI
                assert json.loads(health.read_text())["state"] == "registered"
            finally:
                proc.send_signal(signal.SIGTERM)
                out = await asyncio.get_running_loop().run_in_executor(None, lambda: proc.communicate(timeout=20)[0])
            assert proc.returncode == 0, out.decode()[-2000:]
        assert not health.exists()
        [start] = records(audit, "start")
        assert (start["mode"], start["nri_index"]) == ("nri", "50")
    run(main())


def test_init_containers_count_by_max_and_containers_running_side_by_side_by_sum(tmp_path):
    """The pod-request rule needs to know which containers had finished when the next was
    created: in NRI mode StopContainer says it (proxy mode asks ContainerStatus)."""
    st = Stack(tmp_path)
    tree = st.tree
    uid_init, uid_two = UB, UE.replace("0003", "0004")

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock) as rt:
                p = await rt.next_plugin()
                annotations = {"memqos.io/requests": json.dumps({"init": "128Mi", "app": "512Mi", "a": "256Mi",
                                                                 "b": "128Mi"})}
                # an init container (128 Mi) that finishes, then the app (512 Mi): max, 512 Mi
                pi = nri_pod("with-init", uid_init, "burstable", annotations)
                tree.make_pod("burstable", uid_init)
                await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=pi), pb.Empty)
                init = nri_container("ci", pi, "init", "burstable", request=128 * MI, limit=1024 * MI)
                await p.create_container(pi, init)
                init.state = pb.CONTAINER_RUNNING  # containerd relays StopContainer before it records the exit
                await p.call("StateChange", pb.StateChangeEvent(event=pb.STOP_CONTAINER, pod=pi, container=init),
                             pb.Empty)
                await p.create_container(pi, nri_container("ca", pi, "app", "burstable", request=512 * MI,
                                                           limit=1024 * MI))
                # two containers side by side (256 Mi, then 128 Mi): summed, 384 Mi
                pt = nri_pod("two", uid_two, "burstable", annotations)
                tree.make_pod("burstable", uid_two)
                await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=pt), pb.Empty)
                for cid, name, req in (("c-a", "a", 256 * MI), ("c-b", "b", 128 * MI)):
                    await p.create_container(pt, nri_container(cid, pt, name, "burstable", request=req,
                                                               limit=1024 * MI))
                st.settle(service)
                assert tree.get(tree.pod("burstable", uid_init)) == 512 * MI
                assert tree.get(tree.pod("burstable", uid_two)) == 384 * MI
                assert tree.get(tree.burstable) == 896 * MI
        finally:
            await service.stop()
    run(main())


def test_nri_settings_index_and_socket(tmp_path):
    from shim.app.config import ConfigError

    st = Stack(tmp_path, extra=("--nri-index", "7"))
    assert (st.cfg.nri_index, st.cfg.nri_socket) == (7, st.sock)
    service = st.service()
    try:
        assert (service.plugin.index, service.plugin.name, service.plugin.socket_path) == ("07", "memqos", st.sock)
    finally:
        service.audit.close()
    assert nri_config([]).nri_index == 50 and nri_config([]).nri_socket == "/var/run/nri/nri.sock"
    assert nri_config(["--nri-socket", "unix:///run/nri.sock"]).nri_socket == "/run/nri.sock"
    for bad in (["--nri-index", "100"], ["--nri-index", "-1"], ["--nri-index", "x"], ["--nri-socket", "nri.sock"]):
        with pytest.raises(ConfigError):
            nri_config(bad)


def test_metrics_and_the_monitor_run_in_nri_mode(tmp_path):
    """The same metrics and monitor as serve: the NRI handler's decisions are counted, and the
    monitor follows the containers the handler and the reconciler know."""
    import urllib.request

    st = Stack(tmp_path, extra=("--metrics-address", "127.0.0.1:0", "--monitor-interval", "0.1"))
    tree = st.tree

    async def main():
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock) as rt:
                p = await rt.next_plugin()
                g = nri_pod("g", UG, "guaranteed")
                tree.make_pod("guaranteed", UG)
                await p.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=g), pb.Empty)
                await p.create_container(g, nri_container("cg", g, "app", "guaranteed", request=512 * MI,
                                                          limit=512 * MI))
                st.settle(service)
                # the monitor follows the container: from the handler and from the reconciler's view
                assert [r.id for r in service.monitor.refs()] == ["cg"]
                for _ in range(100):  # and its next round counts it
                    if service.monitor.snapshot().containers == 1:
                        break
                    await asyncio.sleep(0.05)
                assert service.monitor.snapshot().containers == 1
                host, port = service.metrics.address
                text = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode())
                assert 'memqos_rewrites_total{class="",method="CreateContainer",qos="Guaranteed"' in text
                assert service.monitor.running
        finally:
            await service.stop()
    run(main())


def test_create_container_record_carries_the_handlers_own_time():
    """`handler_us`: the clock from the call reaching the handler to its audit record (the
    VM suite's latency bench reads it beside the CreateContainer round trip)."""
    ticks = iter(range(0, 10 ** 9, 250_000))  # 250 µs per reading of the clock
    records = []
    pod = nri_pod("p", UB, "burstable")
    c = nri_container("c1", pod, "app", "burstable", request=256 * MI, limit=1024 * MI)
    NriMemoryQoS(NODE, Policy.HARD, records.append, clock=lambda: next(ticks)).create_container(pod, c)
    created = [r for r in records if r.get("method") == "CreateContainer"]
    assert len(created) == 1 and created[0]["handler_us"] == 250


def test_a_cpuset_only_update_leaves_the_memory_values_in_force():
    """The CPU manager's update carries cpuset only (no memory limit): no adjustment, so the
    runtime keeps the container's limit and memory values; an unknown container the same."""
    records = []
    handler = NriMemoryQoS(NODE, Policy.HARD, records.append)
    annotations = {"memqos.io/requests": REQ}
    pod = nri_pod("p", "u1", "burstable", annotations)
    c = nri_container("c1", pod, "app", "burstable", request=256 * MI, limit=1024 * MI)
    handler.create_container(pod, c)
    cpuset = pb.LinuxResources()
    cpuset.cpu.cpus = "0-1"
    assert list(handler.update_container(pod, c, cpuset)) == []
    [rec] = [r for r in records if r.get("method") == "UpdateContainer"]
    assert rec["event"] == "unchanged" and rec["adjust"] == {} and "no memory limit in the update" in rec["reason"]
    other = nri_container("c2", pod, "app2", "burstable", request=256 * MI, limit=1024 * MI)
    assert list(handler.update_container(pod, other, cpuset)) == []
    # a resize with the limit is still decided
    res = pb.LinuxResources()
    res.memory.limit.value = 2048 * MI
    [update] = handler.update_container(pod, c, res)
    assert update.linux.resources.unified["memory.high"] != NEUTRAL["memory.high"]
