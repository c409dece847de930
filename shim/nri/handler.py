"""What a front end implements to act on NRI events: ``Handler``, whose defaults do nothing and
ask for no change, and two builders for the answers memqos gives (unified cgroup keys).

Handlers are plain functions called on the plugin's event loop while the runtime waits, under
its node-wide lock and its request timeout (2 s by default): they must return in milliseconds
and must not call the runtime back. An exception is logged by the plugin and answered with an
empty reply (no adjustment, no update): never an error status, which would fail the pod.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from shim.nri import api_pb2 as pb

# RunPodSandbox, RemovePodSandbox, CreateContainer, UpdateContainer, RemoveContainer (0x48d),
# and UpdatePodSandbox where the runtime knows it (NRI >= v0.10)
DEFAULT_EVENTS = frozenset({pb.RUN_POD_SANDBOX, pb.REMOVE_POD_SANDBOX, pb.CREATE_CONTAINER,
                            pb.UPDATE_CONTAINER, pb.REMOVE_CONTAINER, pb.UPDATE_POD_SANDBOX})


class Handler:
    """The no-op handler: subscribes to ``events``, changes nothing."""

    events: frozenset = DEFAULT_EVENTS

    def configure(self, request: pb.ConfigureRequest) -> None:
        """The runtime's name, version, NRI version, timeouts and the plugin's config text."""

    def synchronize(self, pods: Sequence[pb.PodSandbox],
                    containers: Sequence[pb.Container]) -> Sequence[pb.ContainerUpdate]:
        """Every pod and container the runtime has, once per connection (all chunks of a split
        sync together); updates for existing containers."""
        return ()

    def create_container(self, pod: pb.PodSandbox, container: pb.Container) -> pb.ContainerAdjustment | None:
        return None

    def update_container(self, pod: pb.PodSandbox, container: pb.Container,
                         resources: pb.LinuxResources) -> Sequence[pb.ContainerUpdate]:
        """In-place resize: a ContainerUpdate for ``container.id`` changes what is applied."""
        return ()

    def update_pod_sandbox(self, pod: pb.PodSandbox, overhead: pb.LinuxResources,
                           resources: pb.LinuxResources) -> None:
        """NRI >= v0.10 only; a notification."""

    def event(self, event: int, pod: pb.PodSandbox, container: pb.Container | None) -> None:
        """A lifecycle event (``pb.Event`` number), from its own RPC or from StateChange."""

    def shutdown(self) -> None:
        """The runtime says it is going down (it may also just close the connection)."""

    def disconnected(self, reason: str) -> None:
        """The connection to the runtime is gone; events may be missed until the next sync."""

    def answering(self) -> None:
        """A runtime call reached the plugin (before its handler method runs)."""

    def undecodable(self, method: str, error: str) -> None:
        """A runtime call whose request does not parse (e.g. a string that is not UTF-8): it is
        answered with an empty reply (nothing adjusted)."""

    def replied(self) -> None:
        """The reply to the call is written to the socket: work that need not delay it goes now."""


def unified_resources(unified: Mapping[str, str]) -> pb.LinuxResources:
    res = pb.LinuxResources()
    res.unified.update(unified)
    return res


def unified_adjustment(unified: Mapping[str, str]) -> pb.ContainerAdjustment:
    """A ContainerAdjustment setting these cgroup v2 keys (adjust.linux.resources.unified)."""
    adj = pb.ContainerAdjustment()
    adj.linux.resources.CopyFrom(unified_resources(unified))
    return adj


def unified_update(container_id: str, unified: Mapping[str, str], ignore_failure: bool = True) -> pb.ContainerUpdate:
    """A ContainerUpdate setting these cgroup v2 keys on an existing container."""
    upd = pb.ContainerUpdate(container_id=container_id, ignore_failure=ignore_failure)
    upd.linux.resources.CopyFrom(unified_resources(unified))
    return upd
