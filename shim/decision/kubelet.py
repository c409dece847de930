"""What a kubelet with the MemoryQoS gate on writes into one container's ``unified`` itself, and
which container keys are the kubelet's for one container (docs/memory-qos.md section 6, "What
each version writes" and "Who owns each value").

The kubelet's container keys, as its kuberuntime sets them (pkg/kubelet/kuberuntime/
kuberuntime_container_linux.go), read per version:

* memory.min: v1.22-v1.35 the container's request whenever it is not 0, whatever the QoS class;
  v1.36+ by its ``memoryReservationPolicy`` (``TieredReservation``: Guaranteed memory.min,
  Burstable memory.low; ``None``: "0" in both, no value);
* memory.high: v1.22-v1.26 ``limit (or allocatable) x factor`` truncated to bytes, written
  when above the request (BestEffort containers included, Guaranteed ones never, since the
  factor is at most 1); v1.27-v1.36 ``request + (limit or allocatable - request) x factor``
  rounded down to a page, skipped when request = limit (Guaranteed containers, and BestEffort
  ones, both 0); v1.37+ the same, skipped only when request = limit > 0 (kubernetes/kubernetes
  #138139: BestEffort containers get one); written only when not 0 and above the request.

Pure: no I/O. ``shim.node.kubelet`` makes a ``KubeletRule`` from the kubelet's version and
configuration; ``decide`` resolves a ``KubeletKeys`` for each container in both front ends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Mapping

from shim.decision.facts import OWNED_KEYS, Policy, QoSClass, Request, RequestSource

REQUEST = "request"  # before v1.36: memory.min = the request, every QoS class
V122, V127, V137 = "v1.22", "v1.27", "v1.37"  # the memory.high formulas
PROTECTION_KEYS = ("memory.min", "memory.low")
EXACT = (RequestSource.KUBELET_UNIFIED, RequestSource.GUARANTEED_LIMIT, RequestSource.GIVEN)


@dataclass(frozen=True)
class KubeletRule:
    """What a kubelet puts in a container's ``unified`` for Memory QoS, by version and
    configuration. ``protection``: ``REQUEST`` (v1.22-v1.35 with the gate on), a
    ``memoryReservationPolicy`` other than None (v1.36+), or None (writes no memory.min /
    memory.low value). ``factor``: the kubelet's throttling factor, None when it writes no
    memory.high. ``formulas``: its memory.high formula; more than one when the version is not
    known (each is taken as possible)."""

    gate: bool = False
    protection: str | None = None
    factor: float | None = None
    formulas: tuple[str, ...] = (V127,)
    version: str = "unknown"


def _protection_key(rule: KubeletRule, qos: QoSClass) -> str | None:
    if rule.protection == REQUEST:
        return "memory.min"
    if rule.protection is None:
        return None
    policy = Policy(rule.protection)
    if policy is Policy.NONE or qos is QoSClass.BESTEFFORT:
        return None
    if policy is Policy.HARD or (policy is Policy.TIERED_RESERVATION and qos is QoSClass.GUARANTEED):
        return "memory.min"
    return "memory.low"


def kubelet_values(rule: KubeletRule, formula: str, qos: QoSClass, request: int, limit: int, allocatable: int,
                   page_size: int) -> dict[str, str]:
    """The values (not the neutral "0" / "max") the kubelet of ``rule`` writes into the unified
    map of a container of ``qos`` whose request and limit are these, with memory.high by
    ``formula``."""
    out: dict[str, str] = {}
    if not rule.gate:
        return out
    key = _protection_key(rule, qos)
    if key is not None and request > 0:
        out[key] = str(request)
    f = rule.factor
    ceiling = limit if limit > 0 else allocatable
    if f is None or ceiling <= 0:
        return out
    if formula == V122:
        high = int(float(ceiling) * f)
    elif request != limit or (formula == V137 and limit <= 0):
        page = max(1, page_size)
        high = math.floor(float(request) + (float(ceiling) - float(request)) * f) // page * page
    else:
        return out
    if high != 0 and high > request:
        out["memory.high"] = str(high)
    return out


def request_range(qos: QoSClass, request: Request, limit: int) -> tuple[int, int | None]:
    """(low, high): what the kubelet's request for the container can be, low <= request < high
    (high None: unbounded), never above the limit. Exact for BestEffort (0), Guaranteed (the
    limit) and a request the kubelet sent or the caller states; the oom_score_adj range for its
    estimate; anything else (an annotation is the tenant's word, not the kubelet's) is not
    known."""
    if qos is QoSClass.BESTEFFORT:
        return 0, 1
    if qos is QoSClass.GUARANTEED and limit > 0:
        return limit, limit + 1
    if request.source in EXACT:
        return request.bytes, request.bytes + 1
    low, high = (max(0, request.bytes), request.upper) if request.source is RequestSource.OOM_SCORE_ADJ else (0, None)
    if limit > 0:  # a request is never above the limit (the API server refuses such a container)
        low, high = min(low, limit), limit + 1 if high is None else min(high, limit + 1)
    return low, high


def kubelet_writes_keys(rule: KubeletRule, qos: QoSClass, request: Request, limit: int, allocatable: int,
                        page_size: int, *, together: bool = True) -> dict[str, str]:
    """The container keys the kubelet of ``rule`` may write a value into for this container
    (key -> why): a key it writes for some request the container can have, by some formula the
    kubelet can use. ``together``: memory.min and memory.low count as one (both carry the one
    request: where the kubelet protects the container with either, the other is its too)."""
    if not rule.gate:
        return {}
    low, high = request_range(qos, request, limit)
    # the smallest request gives memory.high its best chance (its distance to the value above
    # it only shrinks as the request grows); the next one when the smallest equals the limit
    candidates = [low] + ([low + 1] if high is None or low + 1 < high else [])
    found: dict[str, str] = {}
    for formula in rule.formulas:
        for r in candidates:
            for key in kubelet_values(rule, formula, qos, r, limit, allocatable, page_size):
                found.setdefault(key, formula)
    if high == low + 1:
        req = f"request {low}"
    else:
        req = f"request {low} or more" if high is None else f"request in [{low}, {high})"
    out: dict[str, str] = {}
    for key, formula in found.items():
        if key == "memory.high":
            out[key] = (f"kubelet {rule.version} writes memory.high for this {qos.value} container ({req}, limit "
                        f"{limit}: its {formula} formula, factor {rule.factor})")
        else:
            out[key] = f"kubelet {rule.version} writes {key} = the request for this {qos.value} container ({req})"
    protection = next((out[k] for k in PROTECTION_KEYS if k in out), None)
    if together and protection is not None:
        for key in PROTECTION_KEYS:
            out.setdefault(key, f"{protection}; memory.min and memory.low carry that one request")
    return out


class KubeletKeys(Mapping):
    """The container keys the kubelet owns (key -> why).

    As a mapping: the keys it owns in every container -- the ones it is configured to write
    (its value is forwarded as sent, or the key left out where it sent none). ``hidden``: where
    the shim does not see what the kubelet sends (NRI on a runtime that hands plugins no
    ``unified``: containerd before 2.2), the rule of what it writes; ``for_container`` then adds
    each key the kubelet writes for the container at hand, since the plugin cannot see its
    value and leaves it alone (an estimate of its own could lower it)."""

    __slots__ = ("_always", "hidden", "hidden_why")

    def __init__(self, always: Mapping[str, str] | None = None, hidden: KubeletRule | None = None,
                 hidden_why: str = ""):
        self._always = MappingProxyType(dict(always or {}))
        self.hidden = hidden
        self.hidden_why = hidden_why

    def __getitem__(self, key: str) -> str:
        return self._always[key]

    def __contains__(self, key: object) -> bool:
        return key in self._always

    def __iter__(self) -> Iterator[str]:
        return iter(self._always)

    def __len__(self) -> int:
        return len(self._always)

    def __repr__(self) -> str:
        return f"KubeletKeys({dict(self._always)!r}, hidden={self.hidden!r})"

    def for_container(self, qos: QoSClass, request: Request, limit: int, allocatable: int, page_size: int,
                      sent: Mapping[str, str]) -> Mapping[str, str]:
        """The keys the kubelet owns in this container. ``sent``: the container's unified as
        the shim sees it; a memory key in it shows the kubelet's values are visible, and the
        keys are then those of every container."""
        if self.hidden is None or any(k in sent for k in OWNED_KEYS):
            return self._always
        written = kubelet_writes_keys(self.hidden, qos, request, limit, allocatable, page_size)
        extra = {k: f"{self.hidden_why}: {why}" for k, why in written.items() if k not in self._always}
        if not extra:
            return self._always
        return MappingProxyType({**self._always, **extra})
