"""CRI messages to decision facts: the one place protobuf fields become ``PodFacts`` and
``ContainerFacts`` (shim.decision stays free of protobuf)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from shim.cri import pb
from shim.decision import ContainerFacts, PodFacts
from shim.decision.pod import derive_request
from shim.decision.runtime import Runtime


def pod_facts(sandbox_config: Any) -> PodFacts:
    """A PodSandboxConfig's pod: uid, namespace, name, cgroup parent, annotations."""
    return PodFacts(
        uid=sandbox_config.metadata.uid,
        namespace=sandbox_config.metadata.namespace,
        name=sandbox_config.metadata.name,
        cgroup_parent=sandbox_config.linux.cgroup_parent,
        annotations=MappingProxyType(dict(sandbox_config.annotations)),
    )


def container_facts(name: str, resources: Any) -> ContainerFacts:
    """A LinuxContainerResources as the decision reads it, numbers as sent (the decision treats
    a negative limit as none and says so: docs/memory-qos.md, "Absurd numbers")."""
    return ContainerFacts(
        name=name,
        limit=resources.memory_limit_in_bytes,
        oom_score_adj=resources.oom_score_adj,
        unified=MappingProxyType(dict(resources.unified)),
    )


def observed_container_facts(name: str, resources: Any) -> ContainerFacts:
    """A LinuxContainerResources the runtime or the kubelet reported: a negative limit is none."""
    return ContainerFacts(
        name=name,
        limit=max(0, resources.memory_limit_in_bytes),
        oom_score_adj=resources.oom_score_adj,
        unified=MappingProxyType(dict(resources.unified)),
    )


def pod_overhead(linux: Any) -> int:
    """The memory overhead of a LinuxPodSandboxConfig (0 when it has none)."""
    if linux.HasField("overhead"):
        return max(0, linux.overhead.memory_limit_in_bytes)
    return 0


def derived_request(pod: PodFacts, name: str, resources: Any, capacity: int) -> tuple[int, str]:
    """``shim.decision.pod.derive_request`` of a container's LinuxContainerResources."""
    return derive_request(pod, observed_container_facts(name, resources), capacity)


def version_runtime(response: bytes) -> Runtime | None:
    """The runtime a CRI Version answer names; None for an answer that does not parse or names
    no runtime."""
    try:
        msg = pb.VersionResponse.FromString(response)
    except Exception:  # noqa: BLE001 - a runtime answering garbage
        return None
    if not msg.runtime_name:
        return None
    return Runtime(msg.runtime_name[:100], msg.runtime_version[:100])
