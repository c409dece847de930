"""What a finished CRI call tells about the node, as typed events (``shim.decision.events``; no
protobuf past here).

``call_event(call)`` turns one finished, successful call of ``OBSERVED_METHODS`` into its event,
or None when it tells nothing. It parses the call's messages -- never on the relay thread: the
reconciler's observer only enqueues the call, the events are made on its own thread (which
tells the rewriter's memory of containers the removals). Only a rewriter with no reconciler
(``--reconcile false``, ``replay``) calls it from its ``finished``, for RemoveContainer and
RemovePodSandbox. A message
the rewriter already parsed is reused (``RpcCall.rewritten``, a ``shim.cri.rewritten.Rewritten``:
``parsed`` is the request as enforce sends it, the rewriter changes it in place; with its
``decision``, ``unified_before`` is the kubelet's map). In observe the kubelet's bytes went upstream, and the event is still the one enforce
makes: the node state decides as enforce would.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

from shim.cri import pb
from shim.cri.facts import observed_container_facts, pod_facts, pod_overhead
from shim.cri.methods import (
    CONTAINER_STATUS,
    CREATE_CONTAINER,
    REMOVE_CONTAINER,
    REMOVE_POD_SANDBOX,
    RUN_POD_SANDBOX,
    STOP_POD_SANDBOX,
    UPDATE_CONTAINER_RESOURCES,
    UPDATE_POD_SANDBOX_RESOURCES,
)
from shim.cri.rewritten import Rewritten
from shim.decision import ContainerFacts, Decision
from shim.decision.events import (  # noqa: F401  (the event types, re-exported for callers)
    EVENT_TYPES,
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
from shim.transport.hooks import RpcCall


def status_seen(status: Any, start_ns: int, done_ns: int) -> ContainerStatusSeen:
    """A ContainerStatus message's status, seen between start_ns and done_ns."""
    return ContainerStatusSeen(status.id, status.created_at, status.finished_at,
                               status.state == pb.CONTAINER_EXITED, start_ns, done_ns)


def created_container_id(response: bytes) -> str:
    """The container id of a CreateContainerResponse ("" when it does not parse)."""
    try:
        return pb.CreateContainerResponse.FromString(response).container_id
    except Exception:
        return ""


def _times(call: RpcCall) -> tuple[int, int]:
    return int(call.start * 1e9), int((call.start + call.duration_ms / 1000.0) * 1e9)


def _sent_and_kubelet(call: RpcCall, cls: Any) -> tuple[Any, Any, Mapping[str, str] | None]:
    """(the request as sent, as the kubelet sent it or None when only its unified map differs,
    that map then)."""
    note = call.rewritten
    sent = note.parsed if type(note) is Rewritten and type(note.parsed) is cls else None
    if sent is None:
        original = cls.FromString(call.request)
        return (cls.FromString(call.forwarded) if call.forwarded else original), original, None
    if isinstance(note.decision, Decision):  # (forwarded or not: enforce or observe)
        return sent, None, note.decision.unified_before
    if call.forwarded is None:
        return sent, sent, None
    return sent, cls.FromString(call.request), None


def _run_pod_sandbox(call: RpcCall) -> PodSandboxStarted | None:
    cfg = pb.RunPodSandboxRequest.FromString(call.request).config
    if not call.responses:
        return None
    sid = pb.RunPodSandboxResponse.FromString(call.responses[0]).pod_sandbox_id
    if not sid or not cfg.metadata.uid:
        return None
    return PodSandboxStarted(sid, pod_facts(cfg), pod_overhead(cfg.linux))


def _create_container(call: RpcCall) -> ContainerCreated | None:
    if not call.responses:
        return None
    cid = pb.CreateContainerResponse.FromString(call.responses[0]).container_id
    if not cid:
        return None
    sent, original, kubelet_unified = _sent_and_kubelet(call, pb.CreateContainerRequest)
    base = sent if original is None else original  # the fields the rewriter never changes
    sbc = base.sandbox_config
    config = base.config
    name = config.metadata.name
    kubelet = observed_container_facts(name, config.linux.resources)
    if kubelet_unified is not None:
        kubelet = ContainerFacts(kubelet.name, kubelet.limit, kubelet.oom_score_adj,
                                 MappingProxyType(dict(kubelet_unified)))
    start_ns, done_ns = _times(call)
    return ContainerCreated(
        container_id=cid, sandbox_id=base.pod_sandbox_id, pod=pod_facts(sbc), overhead=pod_overhead(sbc.linux),
        name=name, attempt=config.metadata.attempt, kubelet=kubelet,
        unified=MappingProxyType(dict(sent.config.linux.resources.unified)),
        annotations=MappingProxyType(dict(sent.config.annotations)), start_ns=start_ns, done_ns=done_ns,
    )


def _update_container_resources(call: RpcCall) -> ContainerResourcesUpdated | None:
    sent, original, kubelet_unified = _sent_and_kubelet(call, pb.UpdateContainerResourcesRequest)
    base = sent if original is None else original
    if not base.HasField("linux"):
        return None
    if kubelet_unified is None:
        kubelet_unified = original.linux.unified
    return ContainerResourcesUpdated(base.container_id, MappingProxyType(dict(sent.linux.unified)),
                                     MappingProxyType(dict(kubelet_unified)), base.linux.memory_limit_in_bytes)


def _update_pod_sandbox_resources(call: RpcCall) -> PodResourcesUpdated | None:
    req = pb.UpdatePodSandboxResourcesRequest.FromString(call.request)
    if not req.HasField("overhead"):
        return None
    return PodResourcesUpdated(req.pod_sandbox_id, max(0, req.overhead.memory_limit_in_bytes))


def _container_status(call: RpcCall) -> ContainerStatusSeen | None:
    if not call.responses:
        return None
    return status_seen(pb.ContainerStatusResponse.FromString(call.responses[0]).status, *_times(call))


_MAKERS: dict[str, Callable[[RpcCall], Any]] = {
    RUN_POD_SANDBOX: _run_pod_sandbox,
    CREATE_CONTAINER: _create_container,
    UPDATE_CONTAINER_RESOURCES: _update_container_resources,
    UPDATE_POD_SANDBOX_RESOURCES: _update_pod_sandbox_resources,
    REMOVE_CONTAINER: lambda c: ContainerRemoved(pb.RemoveContainerRequest.FromString(c.request).container_id),
    STOP_POD_SANDBOX: lambda c: PodSandboxStopped(pb.StopPodSandboxRequest.FromString(c.request).pod_sandbox_id),
    REMOVE_POD_SANDBOX: lambda c: PodSandboxRemoved(pb.RemovePodSandboxRequest.FromString(c.request).pod_sandbox_id),
    CONTAINER_STATUS: _container_status,  # the kubelet's own polls: when containers were created and finished
}
OBSERVED_METHODS = frozenset(_MAKERS)


def call_event(call: RpcCall) -> Event | None:
    """The event of one finished call; None when it failed, is not observed or tells nothing."""
    if call.code != "OK":
        return None
    make = _MAKERS.get(call.method)
    return make(call) if make is not None else None
