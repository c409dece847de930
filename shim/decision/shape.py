"""The values the shim writes for a pod of a given shape under a policy: each container's
memory.min / memory.low / memory.high (``decide``) and the pod cgroup's memory.min / memory.low
(``node_targets``), from requests and limits alone. Pure: for tools and tests that need the
shim's numbers for a pod without running the shim (a benchmark's cgroup layout, property
tests of the protection rule)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

from shim.decision.facts import ContainerFacts, NodeFacts, PodFacts, Policy, QoSClass, Request, RequestSource
from shim.decision.memory import decide
from shim.decision.node import PlacedPod, node_targets

KUBEPODS, BURSTABLE, BESTEFFORT = "/kubepods", "/kubepods/burstable", "/kubepods/besteffort"
UID = "00000000-0000-4000-8000-000000000000"


@dataclass(frozen=True)
class ContainerShape:
    """One container: its request and limit in bytes (0: none), and its kind: ``regular``,
    ``sidecar`` (a restartable init container: runs beside the regular ones) or ``init`` (an
    ordinary init container: runs alone before them)."""

    name: str
    request: int
    limit: int = 0
    kind: str = "regular"


@dataclass(frozen=True)
class PodValues:
    qos: QoSClass
    containers: Mapping[str, Mapping[str, str]]  # container name -> its unified protection keys
    pod: Mapping[str, int]  # the pod cgroup's memory.min / memory.low
    pod_request: int  # the kubelet's rule: max(Σ regular + sidecars, each init + sidecars before it)
    pod_limit: int  # the pod's memory.max as the kubelet sets it; 0: none (a container without limit)
    reasons: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: MappingProxyType({}))


def qos_of(containers: Sequence[ContainerShape]) -> QoSClass:
    """The pod's QoS class by the API server's rule (memory only)."""
    if all(c.request == 0 and c.limit == 0 for c in containers):
        return QoSClass.BESTEFFORT
    if all(c.limit > 0 and c.request == c.limit for c in containers):
        return QoSClass.GUARANTEED
    return QoSClass.BURSTABLE


def _pod_sum(containers: Sequence[ContainerShape], value: str, overhead: int) -> int:
    """max(Σ regular and sidecars, each init + the sidecars declared before it) + overhead."""
    summed = sum(getattr(c, value) for c in containers if c.kind != "init")
    best, sidecars = summed, 0
    for c in containers:
        if c.kind == "sidecar":
            sidecars += getattr(c, value)
        elif c.kind == "init":
            best = max(best, getattr(c, value) + sidecars)
    return best + overhead


class _Record:
    """The little of a pod record ``node_targets`` reads."""

    def __init__(self, uid: str) -> None:
        self.uid, self.active, self.containers = uid, True, {}

    def label(self) -> str:
        return f"shape/{self.uid}"


class _Request:
    def __init__(self, n: int) -> None:
        self.bytes = n

    def explain(self, names=None) -> str:  # noqa: ARG002 - node_targets' interface
        return f"sum {self.bytes}"


def pod_values(containers: Sequence[ContainerShape], policy: Policy, node: NodeFacts,
               overhead: int = 0) -> PodValues:
    """What the shim writes for this pod: container keys as ``decide`` gives them (the request
    stated, as the pod annotation would), the pod cgroup's values as ``node_targets`` gives
    them."""
    qos = qos_of(containers)
    parent = {QoSClass.GUARANTEED: KUBEPODS, QoSClass.BURSTABLE: BURSTABLE, QoSClass.BESTEFFORT: BESTEFFORT}[qos]
    path = f"{parent}/pod{UID}"
    pod = PodFacts(uid=UID, cgroup_parent=path)
    out: dict[str, Mapping[str, str]] = {}
    reasons: dict[str, Mapping[str, str]] = {}
    for c in containers:
        req = Request(c.request, RequestSource.GIVEN) if qos is not QoSClass.BESTEFFORT else None
        d = decide(pod, ContainerFacts(name=c.name, limit=c.limit), node, policy, req)
        out[c.name] = MappingProxyType(dict(d.unified_after))
        reasons[c.name] = d.reasons
    request = _pod_sum(containers, "request", overhead) if qos is not QoSClass.BESTEFFORT else 0
    limit = _pod_sum(containers, "limit", overhead) if all(c.limit > 0 for c in containers) else 0
    placed = PlacedPod(_Record(UID), qos, path, _Request(request) if request > 0 else None)
    targets = node_targets([placed], KUBEPODS, BURSTABLE, BESTEFFORT, policy, node.page_size,
                           capacity=node.capacity, allocatable=node.allocatable)
    pod_files = {f: t.value for (p, f), t in targets.items() if p == path}
    return PodValues(qos, MappingProxyType(out), MappingProxyType(pod_files), request, limit,
                     MappingProxyType(reasons))
