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


def kubelet_unified(writes, qos: str, *, request: int = 0, limit: int = 0, allocatable: int = 0,
                    page_size: int = 4096, oom_group: bool = True) -> dict[str, str]:
    """The ``unified`` map a kubelet puts in a container's LinuxContainerResources on cgroup v2,
    for the kubelet described by ``writes`` (shim.node.kubelet.KubeletWrites): what the shim
    receives from kubelets of each version (kuberuntime_container_linux.go, KEP-2570).

    * v1.32+ on cgroup v2 (singleProcessOOMKill unset): memory.oom.group="1";
    * gate off, v1.37+: memory.high="max", so that a value from an earlier enablement is cleared
      (kubernetes/kubernetes#139377); before v1.37 nothing;
    * gate on, before v1.36: memory.min = request when non-zero, memory.high by the version's
      formula when the result is above the request (v1.22-v1.26: limit, or allocatable, x factor,
      truncated, no page rounding -- as the recorded v1.23 kubelet sent it; v1.27+: req + (limit -
      req) x factor to a page, and only when request != limit);
    * gate on, v1.36+: memory.min and memory.low always present: the request in the key its
      memoryReservationPolicy maps the QoS class to, "0" otherwise; memory.high as above when a
      factor is in force (BestEffort too from v1.37, kubernetes/kubernetes#138139 -- by merge
      date, assumed), else "max" (v1.37 with memoryThrottlingFactor unset: assumed, not recorded --
      a neutral value like the gate-off case).
    """
    import math

    from shim.decision import QoSClass, protection_key

    q = {"guaranteed": QoSClass.GUARANTEED, "burstable": QoSClass.BURSTABLE,
         "besteffort": QoSClass.BESTEFFORT}[qos.lower()]
    v = writes.version or (1, 37)
    # memory.oom.group: v1.32+ on cgroup v2 unless singleProcessOOMKill
    unified: dict[str, str] = {"memory.oom.group": "1"} if oom_group and v >= (1, 32) else {}
    if not writes.gate:
        if v >= (1, 37):
            unified["memory.high"] = "max"
        return unified
    if not writes.policy_aware:
        if request:
            unified["memory.min"] = str(request)
    else:
        key = protection_key(writes.protection, q) if writes.protection is not None else None
        unified["memory.min"] = str(request) if key == "memory.min" and request else "0"
        unified["memory.low"] = str(request) if key == "memory.low" and request else "0"
    high = None
    f = writes.factor
    ceiling = limit or allocatable
    if f is not None and ceiling > 0:
        if writes.formula == "v1.22":  # limit (or allocatable) x factor, truncated, no page rounding
            high = int(float(ceiling) * f)
        elif request != limit or (request == 0 and v >= (1, 37)):
            high = math.floor(float(request) + (float(ceiling) - float(request)) * f) // page_size * page_size
        if high is not None and not (high != 0 and high > request):
            high = None
    if high is not None:
        unified["memory.high"] = str(high)
    elif writes.policy_aware and f is None and v >= (1, 37):
        unified["memory.high"] = "max"
    return unified
