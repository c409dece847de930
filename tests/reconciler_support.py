"""Test support for the pod/QoS/node reconciler: a fake cgroupfs tree (real files in a temp
dir), and a running stack -- fake runtime (gRPC) + the real Service (proxy, container rewrite,
reconciler) on an event loop in a thread -- driven like a kubelet through a sync client."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import grpc

from shim.cri import pb
from shim.decision import QoSClass
from shim.effects import CgroupLayout

try:
    from tests.kubelet_requests import CAPACITY, MI, create_container, sandbox_config
except ImportError:  # pragma: no cover
    from kubelet_requests import CAPACITY, MI, create_container, sandbox_config  # noqa: F401

QOS = {"guaranteed": QoSClass.GUARANTEED, "burstable": QoSClass.BURSTABLE, "besteffort": QoSClass.BESTEFFORT}
PAGE = 4096


class FakeCgroupTree:
    """A cgroup v2 tree on disk: cgroup.controllers at the root, the kubelet's kubepods and
    QoS cgroups, and pod cgroups on demand; every cgroup holds memory.min / memory.low "0\\n"."""

    def __init__(self, root: Path, driver: str = "cgroupfs", *, v2: bool = True, kubepods: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.layout = CgroupLayout(driver)
        if v2:
            (self.root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        if kubepods:
            self.mkdir(self.layout.kubepods)
            self.mkdir(self.layout.qos(QoSClass.BURSTABLE))
            self.mkdir(self.layout.qos(QoSClass.BESTEFFORT))

    def mkdir(self, rel: str) -> Path:
        d = self.root / rel
        d.mkdir(parents=True, exist_ok=True)
        for f in ("memory.min", "memory.low"):
            if not (d / f).exists():
                (d / f).write_text("0\n")
        return d

    def pod(self, qos: str, uid: str) -> str:
        return self.layout.pod(QOS[qos], uid)

    def make_pod(self, qos: str, uid: str) -> str:
        rel = self.pod(qos, uid)
        self.mkdir(rel)
        return rel

    def get(self, rel: str, file: str = "memory.min") -> int:
        for _ in range(100):  # a plain file is empty for a moment while a writer truncates it
            text = (self.root / rel / file).read_text()
            if text.strip():
                return int(text)
            time.sleep(0.001)
        raise AssertionError(f"{rel}/{file} stays empty")

    def set(self, rel: str, file: str, value: int) -> None:
        (self.root / rel / file).write_text(f"{value}\n")

    @property
    def kubepods(self) -> str:
        return self.layout.kubepods

    @property
    def burstable(self) -> str:
        return self.layout.qos(QoSClass.BURSTABLE)

    @property
    def besteffort(self) -> str:
        return self.layout.qos(QoSClass.BESTEFFORT)

    def values(self) -> dict[str, tuple[int, int]]:
        """rel path -> (memory.min, memory.low) for every cgroup in the tree."""
        out = {}
        for dirpath, _dirs, files in os.walk(self.root):
            if "memory.min" in files:
                rel = os.path.relpath(dirpath, self.root)
                out[rel] = (self.get(rel, "memory.min"), self.get(rel, "memory.low"))
        return out

    def nonzero(self) -> dict[str, tuple[int, int]]:
        return {k: v for k, v in self.values().items() if v != (0, 0)}


def write_kubelet_config(path: Path, driver: str = "cgroupfs", **extra) -> Path:
    doc = {"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
           "cgroupDriver": driver, "cgroupsPerQOS": True, "cgroupRoot": "/",
           "kubeReserved": {"memory": "100Mi"}, "systemReserved": {"memory": "100Mi"},
           "enforceNodeAllocatable": ["pods"]}
    doc.update(extra)
    path.write_text(json.dumps(doc))
    return path


def write_meminfo(path: Path, capacity: int = CAPACITY) -> Path:
    path.write_text(f"MemTotal:       {capacity // 1024} kB\nMemFree:        1000 kB\n")
    return path


def serve_args(tmp: Path, tree: FakeCgroupTree, runtime_sock: str, listen: str, *, driver="cgroupfs",
               policy="Hard", resync=0.2, audit: Path | None = None, kubelet_extra: dict | None = None,
               extra: tuple = ()) -> list[str]:
    kc = write_kubelet_config(tmp / "kubelet.json", driver, **(kubelet_extra or {}))
    mi = write_meminfo(tmp / "meminfo")
    return ["--listen", "unix://" + listen, "--upstream", "unix://" + runtime_sock,
            "--kubelet-config", str(kc), "--cgroup-root", str(tree.root), "--meminfo", str(mi),
            "--policy", policy, "--resync-interval", str(resync), "--page-size", str(PAGE),
            "--audit-log", str(audit) if audit else "none", *extra]


class Kubelet:
    """Drives the shim's socket the way the kubelet does (sync gRPC client)."""

    def __init__(self, listen: str, tree: FakeCgroupTree, runtime=None, driver: str = "cgroupfs"):
        self.channel = grpc.insecure_channel("unix://" + listen)
        self.tree = tree
        self.runtime = runtime  # FakeRuntime, for exit_container
        self.driver = driver
        self.sandboxes: dict[str, pb.PodSandboxConfig] = {}

    def close(self) -> None:
        self.channel.close()

    def call(self, name: str, req, resp_cls):
        fn = self.channel.unary_unary(f"/runtime.v1.RuntimeService/{name}",
                                      request_serializer=type(req).SerializeToString,
                                      response_deserializer=resp_cls.FromString)
        return fn(req, timeout=10)

    def run_pod(self, name: str, uid: str, qos: str, *, overhead: int = 0, leaf_only: bool = False,
                annotations: dict | None = None, cgroup_parent: str | None = None, mkdir: bool = True) -> str:
        cfg = sandbox_config(name, uid, qos, driver=self.driver, leaf_only=leaf_only, annotations=annotations)
        if cgroup_parent is not None:
            cfg.linux.cgroup_parent = cgroup_parent
        if overhead:
            cfg.linux.overhead.memory_limit_in_bytes = overhead
        if mkdir:
            self.tree.make_pod(qos, uid)  # the kubelet creates the pod cgroup before RunPodSandbox
        sid = self.call("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg), pb.RunPodSandboxResponse).pod_sandbox_id
        self.sandboxes[sid] = cfg
        return sid

    def create(self, sid: str, name: str, qos: str, *, request: int = 0, limit: int = 0,
               unified: dict | None = None, start: bool = True, attempt: int = 0, exact: bool = True) -> str:
        """exact: a Burstable request also goes into unified memory.min (as a kubelet with the
        MemoryQoS gate sends it), so the shim knows it exactly; else only oom_score_adj tells."""
        unified = dict(unified or {})
        if exact and request and qos == "burstable":
            unified.setdefault("memory.min", str(request))
        req = create_container(sid, self.sandboxes[sid], name, qos, request=request, limit=limit, unified=unified)
        req.config.metadata.attempt = attempt
        cid = self.call("CreateContainer", req, pb.CreateContainerResponse).container_id
        if start:
            self.call("StartContainer", pb.StartContainerRequest(container_id=cid), pb.StartContainerResponse)
        return cid

    def exit(self, cid: str) -> None:
        """The container's process ends; the kubelet then sees it EXITED (ContainerStatus)."""
        self.runtime.exit_container(cid)
        self.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid), pb.ContainerStatusResponse)

    def update(self, cid: str, *, limit: int, oom_score_adj: int, unified: dict | None = None) -> None:
        u = pb.UpdateContainerResourcesRequest(container_id=cid)
        u.linux.memory_limit_in_bytes = limit
        u.linux.oom_score_adj = oom_score_adj
        u.linux.unified.update(unified or {})
        self.call("UpdateContainerResources", u, pb.UpdateContainerResourcesResponse)

    def update_pod(self, sid: str, *, overhead: int) -> None:
        r = pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=sid)
        r.overhead.memory_limit_in_bytes = overhead
        self.call("UpdatePodSandboxResources", r, pb.UpdatePodSandboxResourcesResponse)

    def stop_pod(self, sid: str) -> None:
        self.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sid), pb.StopPodSandboxResponse)

    def remove_pod(self, sid: str) -> None:
        self.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sid), pb.RemovePodSandboxResponse)

    def remove_container(self, cid: str) -> None:
        self.call("RemoveContainer", pb.RemoveContainerRequest(container_id=cid), pb.RemoveContainerResponse)


def seed_runtime(runtime, pods) -> dict[str, str]:
    """Create pods straight on a FakeRuntime, as a kubelet did before the shim was there.
    pods: [(name, uid, qos, [(container, request, limit)])] -> {container name: id}. Burstable
    requests go into unified memory.min (a kubelet with the MemoryQoS gate)."""
    ids = {}
    for name, uid, qos, containers in pods:
        cfg = sandbox_config(name, uid, qos)
        raw = runtime.handle("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg).SerializeToString())
        sid = pb.RunPodSandboxResponse.FromString(raw).pod_sandbox_id
        for cname, request, limit in containers:
            unified = {"memory.min": str(request)} if request and qos == "burstable" else {}
            req = create_container(sid, cfg, cname, qos, request=request, limit=limit, unified=unified)
            cid = pb.CreateContainerResponse.FromString(
                runtime.handle("CreateContainer", req.SerializeToString())).container_id
            runtime.handle("StartContainer", pb.StartContainerRequest(container_id=cid).SerializeToString())
            ids[cname] = cid
    return ids


class ServiceThread:
    """The real Service (from `serve` flags) on its own event loop in a thread."""

    def __init__(self, argv: list[str]):
        from shim.cli.main import build_parser
        from shim.app.config import resolve
        from shim.app.service import Service

        args = build_parser().parse_args(["serve", *argv])
        self.cfg = resolve(args)
        self.service = Service.from_config(self.cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="service-loop", daemon=True)

    def start(self) -> "ServiceThread":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    @property
    def reconciler(self):
        return self.service.reconciler

    def sync(self) -> None:
        # A barrier on the relay's loop first: the relay writes an answer and then, in the same
        # callback, hands the call to the call-finisher, so a client can hold its answer before the
        # hand-over. A callback queued now runs after that one has ended.
        relay_loop = getattr(self.service.proxy, "_loop", None) or self.loop
        if relay_loop.is_running():
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), relay_loop).result(10)
        assert self.service.finisher.sync(10), "the call-finisher did not catch up"
        assert self.reconciler.sync(10), "reconciler did not catch up"


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        time.sleep(interval)


def read_audit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by SIGKILL
    return out
