"""The recorded kubelet traffic (tests/data/traces) through the proxy with the reconciler
observing: the pod / QoS / node values it writes match the recorded pods.

Upstream is the TraceRuntime (every call answered with the recorded answer), so the
reconciler runs without its own runtime client here: it learns everything from the calls the
kubelet made, including the kubelet's ContainerStatus polls that showed the init container of
`multi` exited before `a` was created.

memqos-on: the kubelet sent each request in unified memory.min, so every request is known
exactly and the shim's model of the values must equal the kubelet's own pod / burstable /
kubepods values in *.cgroups.txt; that kubelet writes them itself, so the reconciler writes
none of them (shim.node.kubelet.ownership). memqos-off: Burstable requests are only known as oom_score_adj lower bounds;
the values must be the sums of those bounds, never above the true values.
"""
from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path


from shim.cri import pb
from shim.cri.methods import CRI_METHODS
from shim.effects import CgroupLayout
from shim.evidence.trace import read_trace
from shim.node.reconciler import Reconciler, compute_targets
from shim.tools.replay import drive, replay_settings
from shim.app.service import build_container_qos
from shim.container.chain import build_request_hooks
from shim.tools.trace_runtime import TraceRuntime
from shim.transport.relay import RelayProxy
from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, data_file, trace_file
from tests.reconciler_support import FakeCgroupTree

ON = trace_file(MEMQOS_ON)
OFF = trace_file(MEMQOS_OFF)
MI = 2**20
CAPACITY = 2060419072
PAGE = 4096
STOP_CONTAINER = "/runtime.v1.RuntimeService/StopContainer"


# README: the pods' true requests (the ground truth behind the traffic)
TRUE = {"qos-guaranteed": 64 * MI, "qos-burstable-limit": 32 * MI, "qos-burstable-nolimit": 32 * MI,
        "qos-limit-only": 96 * MI, "qos-besteffort": 0, "multi": 32 * MI}


def kubelet_cgroups(path: Path) -> list[dict[str, int]]:
    """The *.cgroups.txt sections: [{cgroup path: memory.min}] for kubepods, QoS and pod cgroups."""
    sections: list[dict[str, int]] = []
    for line in path.read_text().splitlines():
        if line.startswith("###"):
            sections.append({})
            continue
        m = re.match(r"^/(\S+) min=(\d+) ", line)
        if m and sections is not None:
            rel = m.group(1)
            parts = rel.split("/")
            if parts[-1].startswith("pod") or rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
                sections[-1][rel] = int(m.group(2))
    return sections


def replay_through_proxy(tmp_path: Path, trace_path: Path):
    """Replay the trace; return (tree, values at steady state, values at the end, pods by name)."""
    trace = read_trace(str(trace_path))
    settings = replay_settings(trace.header)
    tree = FakeCgroupTree(tmp_path / "cgroup")
    layout = CgroupLayout("cgroupfs")
    pods = {}
    for call in trace.calls:
        if call.method.endswith("/RunPodSandbox"):
            cfg = pb.RunPodSandboxRequest.FromString(call.request).config
            tree.mkdir(cfg.linux.cgroup_parent.lstrip("/"))  # the kubelet creates it first
            qos, path = layout.pod_from_parent(cfg.linux.cgroup_parent, cfg.metadata.uid)
            pods[cfg.metadata.name.rsplit("-virtme-ng", 1)[0]] = path
    records: list[dict] = []
    reconciler = Reconciler(cgroup_root=str(tree.root), kubelet=settings.kubelet, policy=settings.policy,
                            capacity=settings.node.capacity, page_size=settings.node.page_size,
                            emit=records.append, client_factory=None, resync_interval=60)
    qos = build_container_qos(settings.node, settings.policy, lambda r: None)
    hooks = build_request_hooks(qos, [reconciler.observer])
    snapshots: dict[str, dict] = {}

    def model() -> dict[str, int]:
        """The pod / QoS / kubepods memory.min the shim's model gives, owner aside."""
        targets, _ = compute_targets(reconciler.state, layout, settings.policy, settings.node.page_size)
        return {path: t.value for (path, file), t in targets.items() if file == "memory.min"}

    def before(call) -> None:
        if call.method == STOP_CONTAINER and "steady" not in snapshots:
            assert reconciler.sync(10)
            snapshots["steady"] = tree.values()
            snapshots["model_steady"] = model()
            snapshots["kinds"] = {
                p.name.rsplit("-virtme-ng", 1)[0]: {c.name: reconciler.state.request(p).kinds[c.id]
                                                    for c in p.containers.values()}
                for p in reconciler.state.pods.values()}

    async def run():
        runtime = TraceRuntime(trace.calls)
        await runtime.start(str(tmp_path / "runtime.sock"))
        proxy = RelayProxy("unix://" + str(tmp_path / "shim.sock"), runtime.endpoint, hooks, methods=CRI_METHODS)
        await proxy.start()
        try:
            outcomes = await drive("unix://" + proxy.listen_path, trace.in_start_order(), before=before)
        finally:
            await proxy.stop(None)
            await runtime.stop(None)
        return outcomes

    reconciler.start()
    loop = asyncio.new_event_loop()
    try:
        outcomes = loop.run_until_complete(run())
    finally:
        loop.close()
        assert reconciler.sync(10)
        snapshots["end"] = tree.values()
        snapshots["model_end"] = model()
        reconciler.stop()
    assert not [o for o in outcomes if o.problem()]
    assert not [r for r in records if r["event"] in ("reconciler-error", "cgroup-refused")], records
    replay_through_proxy.models = (snapshots["model_steady"], snapshots["model_end"])
    return tree, snapshots["steady"], snapshots["end"], pods, snapshots["kinds"], records


def mins(values: dict) -> dict[str, int]:
    return {k: v[0] for k, v in values.items() if k.count("/") < 3}  # kubepods, QoS, pods


def test_memqos_on_trace_matches_the_kubelets_own_values(tmp_path):
    tree, steady, end, pods, kinds, records = replay_through_proxy(tmp_path, ON)
    model_steady, model_end = replay_through_proxy.models
    # that kubelet writes pod / QoS / kubepods memory.min itself: the reconciler writes none of it
    assert not [r for r in records if r["event"] == "cgroup-write"], records
    assert not tree.nonzero()
    # the shim's model of those values agrees with the kubelet's, value for value
    assert model_steady[pods["multi"]] == 32 * MI  # max(16Mi init, 24Mi + 8Mi)
    kubelet_steady, kubelet_removed, _ = kubelet_cgroups(data_file(MEMQOS_ON + ".cgroups.txt"))
    assert model_steady == {k: v for k, v in kubelet_steady.items() if k in model_steady}
    assert model_steady["kubepods/burstable"] == 192 * MI and model_steady["kubepods"] == 256 * MI
    got_end = {k: v for k, v in model_end.items() if k in kubelet_removed}
    assert got_end == kubelet_removed  # 160Mi / 224Mi once qos-besteffort and multi are gone
    assert pods["multi"] not in model_end
    for name, path in pods.items():
        assert model_steady[path] == TRUE[name]
    # learned from the kubelet's own ContainerStatus polls: init had exited before a was created
    assert kinds["multi"] == {"init": "init", "a": "regular", "b": "regular"}


def lower_bound(adj: int, limit: int) -> int:
    k = 1000 - adj
    low = math.ceil(k * CAPACITY / 1000)
    return min(low, limit) if limit else low


def test_memqos_off_trace_gives_the_sums_of_the_oom_score_adj_bounds(tmp_path):
    tree, steady, end, pods, kinds, records = replay_through_proxy(tmp_path, OFF)
    assert kinds["multi"] == {"init": "init", "a": "regular", "b": "regular"}
    # the bounds, from each CreateContainer's oom_score_adj and limit (README table)
    lb = {
        "qos-burstable-limit": lower_bound(984, 134217728),
        "qos-burstable-nolimit": lower_bound(984, 0),
        "qos-limit-only": lower_bound(952, 100663296),
        "multi": max(lower_bound(992, 0), lower_bound(988, 67108864) + lower_bound(996, 0)),
        "qos-guaranteed": 64 * MI,
        "qos-besteffort": 0,
    }
    got = mins(steady)
    for name, path in pods.items():
        assert got[path] == lb[name] // PAGE * PAGE, name
        assert got[path] <= TRUE[name]
    burstable = sum(v for n, v in lb.items() if n not in ("qos-guaranteed", "qos-besteffort"))
    assert got["kubepods/burstable"] == burstable // PAGE * PAGE <= 192 * MI
    assert got["kubepods"] == (burstable + 64 * MI) // PAGE * PAGE <= 256 * MI
    # after qos-besteffort and multi are removed
    after = burstable - lb["multi"]
    assert mins(end)["kubepods/burstable"] == after // PAGE * PAGE <= 160 * MI
    assert mins(end)["kubepods"] == (after + 64 * MI) // PAGE * PAGE <= 224 * MI
    assert all(v[1] == 0 for v in end.values())  # policy request: no memory.low anywhere
