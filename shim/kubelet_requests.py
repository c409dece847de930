"""Kubelet-shaped CRI requests (demo, tests, benchmarks), built the way the kubelet fills them in."""
from __future__ import annotations

from shim.cri import pb

MI = 2**20
CAPACITY = 2060419072  # the recorded traces' node (tests/data/traces)


def cgroup_parent(qos: str, uid: str, driver: str = "cgroupfs", leaf_only: bool = False) -> str:
    qos = qos.lower()
    if driver == "cgroupfs":
        return {"guaranteed": f"/kubepods/pod{uid}", "burstable": f"/kubepods/burstable/pod{uid}",
                "besteffort": f"/kubepods/besteffort/pod{uid}"}[qos]
    u = uid.replace("-", "_")
    if qos == "guaranteed":
        leaf, full = f"kubepods-pod{u}.slice", f"/kubepods.slice/kubepods-pod{u}.slice"
    else:
        leaf = f"kubepods-{qos}-pod{u}.slice"
        full = f"/kubepods.slice/kubepods-{qos}.slice/{leaf}"
    return leaf if leaf_only else full


def oom_score_adj(qos: str, request: int, capacity: int = CAPACITY) -> int:
    if qos == "guaranteed":
        return -997
    if qos == "besteffort":
        return 1000
    adj = 1000 - (1000 * request) // capacity
    return 3 if adj < 3 else 999 if adj == 1000 else adj


def sandbox_config(name: str, uid: str, qos: str, *, namespace: str = "default", driver: str = "cgroupfs",
                   leaf_only: bool = False, annotations: dict | None = None) -> pb.PodSandboxConfig:
    cfg = pb.PodSandboxConfig()
    cfg.metadata.name, cfg.metadata.uid, cfg.metadata.namespace = name, uid, namespace
    cfg.labels.update({"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                       "io.kubernetes.pod.uid": uid})
    cfg.annotations.update(annotations or {})
    cfg.linux.cgroup_parent = cgroup_parent(qos, uid, driver, leaf_only)
    cfg.linux.security_context.namespace_options.network = pb.NODE
    return cfg


def create_container(sandbox_id: str, sandbox: pb.PodSandboxConfig, container: str, qos: str, *,
                     request: int = 0, limit: int = 0, unified: dict | None = None,
                     capacity: int = CAPACITY) -> pb.CreateContainerRequest:
    req = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id)
    req.sandbox_config.CopyFrom(sandbox)
    c = req.config
    c.metadata.name = container
    c.image.image = "localhost/busybox:latest"
    c.command.extend(["/bin/sh", "-c", "sleep 3600"])
    c.labels.update({"io.kubernetes.container.name": container,
                     "io.kubernetes.pod.name": sandbox.metadata.name,
                     "io.kubernetes.pod.namespace": sandbox.metadata.namespace,
                     "io.kubernetes.pod.uid": sandbox.metadata.uid})
    r = c.linux.resources
    r.cpu_period, r.cpu_shares = 100000, 2
    r.memory_limit_in_bytes = limit
    r.oom_score_adj = oom_score_adj(qos, request, capacity)
    r.unified.update(unified or {})
    return req


def update_resources(container_id: str, *, limit: int, oom_score_adj: int, unified: dict | None = None):
    u = pb.UpdateContainerResourcesRequest(container_id=container_id)
    u.linux.memory_limit_in_bytes = limit
    u.linux.oom_score_adj = oom_score_adj
    u.linux.cpu_period, u.linux.cpu_shares = 100000, 2
    u.linux.unified.update(unified or {})
    return u
