"""What happens to pods and containers on the node, as typed events: the one vocabulary both
front ends speak to the node state (``shim.node.state.NodeState.apply``). ``shim.cri.events``
makes them from finished CRI calls, ``shim.nri.facts`` from NRI requests and events. Plain
frozen dataclasses: no protobuf, no I/O."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from shim.decision.facts import ContainerFacts, PodFacts


@dataclass(frozen=True)
class PodSandboxStarted:
    """RunPodSandbox answered with the sandbox's id."""

    sandbox_id: str
    pod: PodFacts
    overhead: int


@dataclass(frozen=True)
class ContainerCreated:
    """CreateContainer answered with the container's id: the pod it is in, and its resources
    as the kubelet asked (``kubelet``) and as the runtime got them (``unified``, ``annotations``)."""

    container_id: str
    sandbox_id: str
    pod: PodFacts
    overhead: int  # of the sandbox config the request carries
    name: str
    attempt: int
    kubelet: ContainerFacts
    unified: Mapping[str, str]  # as sent
    annotations: Mapping[str, str]  # as sent
    start_ns: int  # the shim's clock when the call began
    done_ns: int  # ... and when it ended


@dataclass(frozen=True)
class ContainerResourcesUpdated:
    """UpdateContainerResources with linux resources."""

    container_id: str
    unified: Mapping[str, str]  # as sent
    kubelet_unified: Mapping[str, str]  # as the kubelet sent it
    limit: int  # memory_limit_in_bytes


@dataclass(frozen=True)
class PodResourcesUpdated:
    """UpdatePodSandboxResources with an overhead."""

    sandbox_id: str
    overhead: int


@dataclass(frozen=True)
class ContainerRemoved:
    """RemoveContainer: the container is gone (whether or not it was known)."""

    container_id: str


@dataclass(frozen=True)
class PodSandboxStopped:
    """StopPodSandbox: the sandbox is no longer ready (the pod stays active while another
    sandbox of it is); its containers stay until removed."""

    sandbox_id: str


@dataclass(frozen=True)
class PodSandboxRemoved:
    """RemovePodSandbox: the sandbox and every container in it are gone; the pod with them
    when it has no other sandbox (its cgroup's protection goes with it, the QoS class and
    node sums shrink)."""

    sandbox_id: str


@dataclass(frozen=True)
class ContainerStatusSeen:
    """A ContainerStatus answer: when the container was created and finished (the runtime's
    clock, 0 = not reported), whether it had exited, between ``start_ns`` and ``done_ns``
    (the shim's clock)."""

    container_id: str
    created_at: int
    finished_at: int
    exited: bool
    start_ns: int
    done_ns: int


Event = Union[PodSandboxStarted, ContainerCreated, ContainerResourcesUpdated, PodResourcesUpdated,
              ContainerRemoved, PodSandboxStopped, PodSandboxRemoved, ContainerStatusSeen]

EVENT_TYPES = (PodSandboxStarted, ContainerCreated, ContainerResourcesUpdated, PodResourcesUpdated,
               ContainerRemoved, PodSandboxStopped, PodSandboxRemoved, ContainerStatusSeen)
