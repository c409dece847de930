"""The recorded kubelet traces (tests/data/traces) replayed call by call through the proxy with
the reconciler observing, every pod / QoS / kubepods memory.min and memory.low sampled after
each call: no value goes down unless a pod or container left (RemoveContainer, StopPodSandbox,
RemovePodSandbox of that pod; for QoS / kubepods, of any pod).

For the MemoryQoS-on trace the kubelet's own writes are reproduced in the tree, as that kubelet
(v1.23, gate on) made them: a pod's memory.min = the pod's request when it creates the pod's
cgroup, before RunPodSandbox (the values of *.cgroups.txt), the burstable QoS cgroup and
kubepods the sums; when a pod is stopped, the sums without it.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from shim.app.service import build_container_qos
from shim.container.chain import build_request_hooks
from shim.cri import pb
from shim.cri.methods import CRI_METHODS
from shim.effects import CgroupLayout
from shim.evidence.trace import read_trace
from shim.node.reconciler import Reconciler
from shim.tools.trace_runtime import TraceRuntime
from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, data_file, trace_file
from shim.tools.replay import drive, replay_settings
from shim.transport.relay import RelayProxy
from tests.reconciler_support import FakeCgroupTree
from tests.test_protection_node import OwnWrites, Watch
from tests.test_reconciler_traces import kubelet_cgroups

METHOD = "/runtime.v1.RuntimeService/"


def _ids(trace):
    """sandbox id -> pod cgroup path, container id -> sandbox id, from the recorded answers."""
    layout = CgroupLayout("cgroupfs")
    sandbox_path, container_sandbox = {}, {}
    for call in trace.calls:
        if call.code != "OK" or not call.responses:
            continue
        if call.method == METHOD + "RunPodSandbox":
            cfg = pb.RunPodSandboxRequest.FromString(call.request).config
            sid = pb.RunPodSandboxResponse.FromString(call.responses[0]).pod_sandbox_id
            sandbox_path[sid] = layout.pod_from_parent(cfg.linux.cgroup_parent, cfg.metadata.uid)[1]
        elif call.method == METHOD + "CreateContainer":
            req = pb.CreateContainerRequest.FromString(call.request)
            cid = pb.CreateContainerResponse.FromString(call.responses[0]).container_id
            container_sandbox[cid] = req.pod_sandbox_id
    return sandbox_path, container_sandbox


def replay_sampled(tmp_path: Path, name: str, kubelet_writes: bool) -> Watch:
    trace = read_trace(str(trace_file(name)))
    settings = replay_settings(trace.header)
    tree = FakeCgroupTree(tmp_path / "cgroup")
    watch = Watch(tree)
    own = OwnWrites(tree)
    kubelet_values = kubelet_cgroups(data_file(name + ".cgroups.txt"))[0]
    sandbox_path, container_sandbox = _ids(trace)
    layout = CgroupLayout("cgroupfs")
    records: list[dict] = []
    reconciler = Reconciler(cgroup_root=str(tree.root), kubelet=settings.kubelet, policy=settings.policy,
                            capacity=settings.node.capacity, page_size=settings.node.page_size,
                            emit=records.append, client_factory=None, resync_interval=60,
                            ownership=settings.ownership())
    hooks = build_request_hooks(build_container_qos(settings.node, settings.policy, lambda r: None),
                                [reconciler.observer])
    last = ["start"]

    def before(call) -> None:
        assert reconciler.sync(10)
        watch.sample(f"after {last[0]}")
        method = call.method.rsplit("/", 1)[-1]
        last[0] = f"{call.seq} {method}"
        if method == "RunPodSandbox":
            cfg = pb.RunPodSandboxRequest.FromString(call.request).config
            qos, path = layout.pod_from_parent(cfg.linux.cgroup_parent, cfg.metadata.uid)
            tree.mkdir(path)  # the kubelet creates the pod cgroup first
            if kubelet_writes and path not in own.pods:
                own.pod(qos.value.lower(), cfg.metadata.uid, kubelet_values.get(path, 0))
        elif method == "RemoveContainer":
            sid = container_sandbox.get(pb.RemoveContainerRequest.FromString(call.request).container_id)
            if sid in sandbox_path:
                watch.depart(sandbox_path[sid])
        elif method in ("StopPodSandbox", "RemovePodSandbox"):
            sid = pb.StopPodSandboxRequest.FromString(call.request).pod_sandbox_id
            if sid in sandbox_path:
                watch.depart(sandbox_path[sid])
                if kubelet_writes and sandbox_path[sid] in own.pods:
                    own.gone(sandbox_path[sid])
        if kubelet_writes:
            watch.sample(f"kubelet's own writes before {last[0]}")

    async def run():
        runtime = TraceRuntime(trace.calls)
        await runtime.start(str(tmp_path / "runtime.sock"))
        proxy = RelayProxy("unix://" + str(tmp_path / "shim.sock"), runtime.endpoint, hooks, methods=CRI_METHODS)
        await proxy.start()
        try:
            return await drive("unix://" + proxy.listen_path, trace.in_start_order(), before=before)
        finally:
            await proxy.stop(None)
            await runtime.stop(None)

    reconciler.start()
    loop = asyncio.new_event_loop()
    try:
        outcomes = loop.run_until_complete(run())
    finally:
        loop.close()
        assert reconciler.sync(10)
        watch.sample(f"after {last[0]}")
        reconciler.stop()
    assert not [o for o in outcomes if o.problem()]
    assert not [r for r in records if r["event"] in ("reconciler-error", "cgroup-refused")], records
    watch.records = records
    return watch


def test_memqos_on_trace_never_lowers_the_kubelets_own_values(tmp_path):
    w = replay_sampled(tmp_path, MEMQOS_ON, kubelet_writes=True)
    assert w.samples > 1000
    assert w.drops == [], w.drops[:5]
    assert not [r for r in w.records if r["event"] == "cgroup-write"]  # the kubelet's levels: left to it
    # the kubelet's values at the end: qos-besteffort and multi gone
    assert w.last[("kubepods", "memory.min")] == 224 * 2**20
    assert w.last[("kubepods/burstable", "memory.min")] == 160 * 2**20


def test_memqos_off_trace_values_only_rise_until_pods_leave(tmp_path):
    w = replay_sampled(tmp_path, MEMQOS_OFF, kubelet_writes=False)
    assert w.samples > 800
    assert w.drops == [], w.drops[:5]
    writes = [r for r in w.records if r["event"] == "cgroup-write"]
    assert writes and all(int(r["new"]) > int(r["old"] or 0) for r in writes if not r.get("departure"))
    downs = [r for r in writes if int(r["new"]) < int(r["old"])]
    assert downs and all(r.get("departure") for r in downs)  # every value that went down names why
