"""The node as the reconciler last saw it, for other threads to read.

The reconciler's NodeState is mutated by its own thread only. After each change it applies,
the reconciler publishes a ``NodeView``: an immutable tuple of ``ContainerRef`` (one per
container: its id, pod, container name, cgroup parent, QoS class and memory QoS class),
replacing a single attribute; ``classes`` indexes the containers created with a class (the
rewriter's updates of a container created before the shim restarted). A reader (the monitor) takes that attribute once and iterates it without locks
or retries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from shim.decision.qos import parse_cgroup_parent

if TYPE_CHECKING:
    from shim.node.state import NodeState


@dataclass(frozen=True)
class ContainerRef:
    """A container and the pod data its cgroup directory is built from."""

    id: str
    namespace: str
    pod: str
    container: str
    uid: str
    cgroup_parent: str
    qos: str = ""
    cls: str = ""  # the class it was created with ("" for none: the node's settings)

    def label(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class NodeView:
    """Every container of the node state, immutable."""

    containers: tuple[ContainerRef, ...] = ()
    # container id -> the class it was created with, for the containers created with one
    classes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, state: NodeState) -> "NodeView":
        """The view of ``state``: made after every batch the reconciler applies, so each pod's
        cgroup parent is found once and read through a cache (a pod's parent does not change)."""
        out = []
        parse = _parse_cached
        for pod in state.pods.values():
            parent = pod.cgroup_parent
            qos = pod.qos_of(parent, parse)
            for c in pod.containers.values():
                out.append(ContainerRef(c.id, pod.namespace, pod.name, c.name, pod.uid, parent,
                                        qos.value if qos is not None else "", c.cls))
        return cls(tuple(out), MappingProxyType({r.id: r.cls for r in out if r.cls}))


_PARSED: dict = {}
_PARSED_MAX = 4096  # cgroup parents remembered (about one per pod); beyond, the cache starts over


def _parse_cached(cgroup_parent: str):
    """``parse_cgroup_parent``, remembered (a pure function of a string)."""
    got = _PARSED.get(cgroup_parent)
    if got is None:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        got = _PARSED[cgroup_parent] = parse_cgroup_parent(cgroup_parent)
    return got
