"""Inputs and outputs of the decision: plain, immutable facts (no protobuf, no I/O)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Mapping


class QoSClass(str, Enum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BESTEFFORT = "BestEffort"


class Policy(str, Enum):
    """How requests are protected, named after the kubelet's ``memoryReservationPolicy``
    (KubeletConfiguration, KEP-2570: ``None`` and ``TieredReservation`` since v1.36; ``Hard``
    and ``Soft`` proposed for v1.38), matched in any case."""

    HARD = "Hard"  # memory.min = request for every pod / container with one
    SOFT = "Soft"  # memory.low = request for every pod / container with one
    TIERED_RESERVATION = "TieredReservation"  # Guaranteed -> memory.min, Burstable -> memory.low
    NONE = "None"  # no protection keys (memory.high only)

    @classmethod
    def _missing_(cls, value):
        """An upstream name in any case (``hard``, ``TIEREDRESERVATION``)."""
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if member.value.lower() == key:
                    return member
        return None


class RequestSource(str, Enum):
    ANNOTATION = "annotation"  # pod annotation memqos.io/requests
    KUBELET_UNIFIED = "kubelet-unified"  # memory.min / memory.low the kubelet sent
    GUARANTEED_LIMIT = "guaranteed-limit"  # Guaranteed: request == limit
    OOM_SCORE_ADJ = "oom-score-adj"  # Burstable: lower bound from oom_score_adj
    GIVEN = "given"  # stated by the caller (memqos-shim explain)
    NONE = "none"


# The keys the shim owns in LinuxContainerResources.unified: whatever the kubelet
# sent for them is replaced by the shim's decision (and removed when the shim
# decides the key does not apply). Every other key passes through untouched.
OWNED_KEYS = ("memory.min", "memory.low", "memory.high")
REQUESTS_ANNOTATION = "memqos.io/requests"


@dataclass(frozen=True)
class NodeFacts:
    capacity: int  # MemTotal, bytes
    allocatable: int  # capacity - kubeReserved - systemReserved, or --node-allocatable
    page_size: int
    factor: float | None  # memory throttling factor in (0, 1]; None = no memory.high
    # a container's memory.min stays this far under its limit: max(ceil(limit * ratio), min)
    # (docs/memory-qos.md, "Protection that never OOM-kills")
    headroom_ratio: float = 0.1
    headroom_min: int = 8 * 1024 * 1024
    # where the kubelet owns a container's memory.min, lower the value it sent by the same rule
    correct_kubelet_min: bool = False


@dataclass(frozen=True)
class PodFacts:
    uid: str = ""
    namespace: str = ""
    name: str = ""
    cgroup_parent: str = ""
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class ContainerFacts:
    name: str = ""
    limit: int = 0  # memory_limit_in_bytes, 0 = none
    oom_score_adj: int = 0
    unified: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Request:
    bytes: int
    source: RequestSource
    note: str = ""
    # Upper end (exclusive) of what the true request can be, when only a range is known.
    upper: int | None = None


@dataclass(frozen=True)
class Decision:
    qos: QoSClass
    qos_reason: str
    request: Request
    limit: int
    unified_before: Mapping[str, str]
    unified_after: Mapping[str, str]
    reasons: Mapping[str, str]  # owned key -> why it was set, kept or left out
    # numbers beyond what the node has, and what was done with them ("clamped: ...", "... treated
    # as no limit"): docs/memory-qos.md, "Absurd numbers"
    notes: tuple[str, ...] = ()
    # the owned keys the kubelet writes itself in this container (key -> why): left as it sent
    # them (shim.decision.kubelet.KubeletKeys, resolved for the container)
    kubelet_owns: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def changed(self) -> bool:
        return dict(self.unified_before) != dict(self.unified_after)
