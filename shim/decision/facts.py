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
    REQUEST = "request"  # seed design: memory.min = request for every container with one
    TIERED = "tiered"  # Guaranteed -> memory.min, Burstable -> memory.low
    NONE = "none"  # no protection keys (memory.high only)


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

    @property
    def changed(self) -> bool:
        return dict(self.unified_before) != dict(self.unified_after)
