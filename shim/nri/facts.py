"""NRI messages to decision facts and node events: the one place NRI's protobuf fields become
``PodFacts`` / ``ContainerFacts`` and the typed events of ``shim.decision.events`` (what
``shim.cri.facts`` and ``shim.cri.events`` are for CRI), so the decision and the node state
see the same facts whichever front end saw the pod.

Where NRI puts what the decision needs (docs/design: nri.md section 2.2):

* QoS class: the pod's ``linux.cgroup_parent`` (the kubelet's parent); failing that the
  container's ``linux.cgroups_path`` or the sandbox's (``<parent slice>:<prefix>:<id>`` with
  the systemd driver, ``<parent>/<id>`` with cgroupfs);
* the request: the pod annotation ``memqos.io/requests`` (``PodSandbox.annotations`` carries
  the pod's own annotations), the kubelet's ``unified`` values (``container.linux.resources.
  unified``: empty on containerd < 2.2, whose NRI does not copy them), the memory limit for
  Guaranteed (``linux.resources.memory.limit``), the ``oom_score_adj`` bound
  (``container.linux.oom_score_adj``, filled by containerd since 1.7.0);
* overhead: ``PodSandbox.linux.pod_overhead.memory.limit``.
"""
from __future__ import annotations

import posixpath
from types import MappingProxyType
from typing import Mapping

from shim.decision import ContainerFacts, PodFacts
from shim.decision.events import (  # noqa: F401  (re-exported for the front end)
    ContainerCreated,
    ContainerRemoved,
    ContainerResourcesUpdated,
    ContainerStatusSeen,
    Event,
    PodResourcesUpdated,
    PodSandboxRemoved,
    PodSandboxStarted,
    PodSandboxStopped,
)
from shim.nri import api_pb2 as pb

EMPTY: Mapping[str, str] = MappingProxyType({})
RESTART_COUNT = "io.kubernetes.container.restartCount"  # the kubelet's container annotation


def attempt(container: pb.Container) -> int:
    """The container's attempt (the kubelet's restart count annotation; 0 when absent)."""
    raw = container.annotations.get(RESTART_COUNT, "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 9 else 0


def parent_of_cgroups_path(path: str) -> str:
    """The parent cgroup of an OCI ``cgroupsPath``: systemd ``<slice>:<prefix>:<name>`` gives
    the slice, a cgroupfs path its directory ("" for anything else)."""
    if not path:
        return ""
    if ":" in path:
        return path.split(":", 1)[0]
    parent = posixpath.dirname(path)
    return "" if parent in ("", "/") else parent


def cgroup_parent(pod: pb.PodSandbox, container: pb.Container | None = None) -> str:
    """The pod's cgroup parent (which says its QoS class), from the first field that has it."""
    linux = pod.linux
    if linux.cgroup_parent:
        return linux.cgroup_parent
    if container is not None and container.linux.cgroups_path:
        # the container's parent is the pod's cgroup
        return parent_of_cgroups_path(container.linux.cgroups_path)
    return parent_of_cgroups_path(linux.cgroups_path)


def pod_facts(pod: pb.PodSandbox, container: pb.Container | None = None) -> PodFacts:
    return PodFacts(uid=pod.uid, namespace=pod.namespace, name=pod.name,
                    cgroup_parent=cgroup_parent(pod, container),
                    annotations=MappingProxyType(dict(pod.annotations)))


def memory_limit(resources: pb.LinuxResources) -> int:
    """The memory limit of NRI LinuxResources (0: none; a negative or absent one is none)."""
    if resources.HasField("memory") and resources.memory.HasField("limit"):
        return max(0, resources.memory.limit.value)
    return 0


def oom_score_adj(container: pb.Container) -> int:
    linux = container.linux
    return linux.oom_score_adj.value if linux.HasField("oom_score_adj") else 0


def container_facts(container: pb.Container) -> ContainerFacts:
    """A container as the decision reads it: limit, oom_score_adj and the unified map the
    runtime handed us (the kubelet's values only where the runtime's NRI copies them)."""
    linux = container.linux
    res = linux.resources
    unified = res.unified
    return ContainerFacts(name=container.name, limit=memory_limit(res),
                          oom_score_adj=linux.oom_score_adj.value if linux.HasField("oom_score_adj") else 0,
                          unified=MappingProxyType(dict(unified) if unified else {}))


def update_facts(container: pb.Container, resources: pb.LinuxResources) -> ContainerFacts:
    """An UpdateContainer's new resources (the kubelet's resize) for the same container."""
    return ContainerFacts(name=container.name, limit=memory_limit(resources), oom_score_adj=oom_score_adj(container),
                          unified=MappingProxyType(dict(resources.unified)))


def pod_overhead(pod: pb.PodSandbox) -> int:
    linux = pod.linux
    return memory_limit(linux.pod_overhead) if linux.HasField("pod_overhead") else 0


# -- events ------------------------------------------------------------------------------
def sandbox_started(pod: pb.PodSandbox) -> PodSandboxStarted | None:
    if not pod.id or not pod.uid:
        return None
    return PodSandboxStarted(pod.id, pod_facts(pod), pod_overhead(pod))


def container_created(pod: pb.PodSandbox, container: pb.Container, unified: Mapping[str, str],
                      annotations: Mapping[str, str], start_ns: int, done_ns: int, *,
                      facts: tuple[PodFacts, ContainerFacts] | None = None) -> ContainerCreated | None:
    """A container as created: ``unified`` / ``annotations`` as the runtime applies them (the
    container's own merged with our adjustment); ``facts``: its pod_facts and container_facts
    when already made."""
    if not container.id:
        return None
    pod_f, kubelet = facts if facts is not None else (pod_facts(pod, container), container_facts(container))
    return ContainerCreated(
        container_id=container.id, sandbox_id=container.pod_sandbox_id or pod.id,
        pod=pod_f, overhead=pod_overhead(pod), name=container.name, attempt=attempt(container),
        kubelet=kubelet, unified=MappingProxyType(dict(unified)),
        annotations=MappingProxyType(dict(annotations)), start_ns=start_ns, done_ns=done_ns)


def container_updated(container_id: str, unified: Mapping[str, str], kubelet_unified: Mapping[str, str],
                      resources: pb.LinuxResources) -> ContainerResourcesUpdated:
    return ContainerResourcesUpdated(container_id, MappingProxyType(dict(unified)),
                                     MappingProxyType(dict(kubelet_unified)), memory_limit(resources))


def container_seen(container: pb.Container, start_ns: int, done_ns: int) -> ContainerStatusSeen | None:
    """The container's state as an NRI message carries it (created_at / finished_at in ns, the
    runtime's clock): what ContainerStatus tells in proxy mode, for the init-container rule."""
    if not container.id or container.state == pb.CONTAINER_UNKNOWN:
        return None
    exited = container.state == pb.CONTAINER_STOPPED
    return ContainerStatusSeen(container.id, container.created_at, container.finished_at if exited else 0,
                               exited, start_ns, done_ns)


def lifecycle_events(event: int, pod: pb.PodSandbox, container: pb.Container | None,
                     now_ns: int) -> list[Event]:
    """The node events of one NRI lifecycle event (its own RPC or a StateChange)."""
    if event == pb.RUN_POD_SANDBOX:
        started = sandbox_started(pod)
        return [started] if started is not None else []
    if event == pb.STOP_POD_SANDBOX:
        return [PodSandboxStopped(pod.id)] if pod.id else []
    if event == pb.REMOVE_POD_SANDBOX:
        return [PodSandboxRemoved(pod.id)] if pod.id else []
    if container is None or not container.id:
        return []
    if event == pb.REMOVE_CONTAINER:
        return [ContainerRemoved(container.id)]
    if event == pb.STOP_CONTAINER:  # it has stopped, whatever state the message still carries
        # (containerd relays it from the task's delete, before it records the exit)
        return [ContainerStatusSeen(container.id, container.created_at, container.finished_at, True, now_ns, now_ns)]
    seen = container_seen(container, now_ns, now_ns)
    return [seen] if seen is not None else []


def update_pod_sandbox(pod: pb.PodSandbox, overhead: pb.LinuxResources) -> PodResourcesUpdated | None:
    return PodResourcesUpdated(pod.id, memory_limit(overhead)) if pod.id else None
