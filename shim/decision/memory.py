"""Container-level memory.min / memory.low / memory.high (reference section 1)."""
from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType
from typing import Mapping

from shim.decision.facts import OWNED_KEYS, ContainerFacts, Decision, NodeFacts, PodFacts, Policy, QoSClass, Request, RequestSource
from shim.decision.kubelet import KubeletKeys
from shim.decision.qos import qos_class
from shim.decision.quantity import MAX_BYTES, allocatable_bound, capacity_bound, clamp
from shim.decision.request import resolve_request


# The kernel's defaults: no protection, no throttling.
NEUTRAL = {"memory.min": "0", "memory.low": "0", "memory.high": "max"}


def kernel_values(decision: Decision, kubelet_owns: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the container's cgroup holds once the runtime applied ``decision`` (created or
    updated with its ``unified_after``), for the keys the shim owns: the value sent, or the
    kernel's default for a key left out. Keys the kubelet owns (``kubelet_owns``, by default the
    decision's own, for its container) are not the shim's to check."""
    after = decision.unified_after
    if kubelet_owns is None:
        kubelet_owns = decision.kubelet_owns
    return {k: after.get(k, NEUTRAL[k]) for k in OWNED_KEYS if k not in kubelet_owns}


def memory_high(request: int, ceiling: int, factor: float, page_size: int) -> int:
    """floor(req + (ceiling - req) * factor) in IEEE float64 like the kubelet, then
    rounded down to a whole page with integer arithmetic. ceiling is the limit, or
    allocatable when there is no limit. Never above the ceiling (float64 rounds a ceiling
    beyond 2^53 up: 2^63-1 becomes 2^63)."""
    high = math.floor(float(request) + (float(ceiling) - float(request)) * factor)
    if high > ceiling:
        high = ceiling
    return (high // page_size) * page_size


def protection_key(policy: Policy, qos: QoSClass) -> str | None:
    """The interface file that carries a pod's / container's request under a policy (the
    kubelet's memoryReservationPolicy mapping, KEP-2570): None when nothing is protected."""
    if policy is Policy.NONE or qos is QoSClass.BESTEFFORT:
        return None
    if policy is Policy.HARD:
        return "memory.min"
    if policy is Policy.SOFT:
        return "memory.low"
    return "memory.min" if qos is QoSClass.GUARANTEED else "memory.low"  # TieredReservation


NEVER_OOM = "docs/memory-qos.md#protection-that-never-oom-kills"


def headroom(limit: int, ratio: float, floor: int) -> int:
    """How far a container's memory.min stays under its limit: max(ceil(limit * ratio), floor),
    in IEEE float64 like memory.high, never above the limit."""
    return min(limit, max(math.ceil(float(limit) * ratio), floor))


def capped_min(request: int, limit: int, node: NodeFacts) -> tuple[int, int]:
    """(memory.min, headroom) for a container whose policy puts its request in memory.min:
    min(request, limit - headroom(limit)), the capped value rounded down to a page, never below
    0; no limit (0): the request, headroom 0. Below its limit by more than the pod's sandbox
    uses, the container is above its memory.min whenever the pod is at its memory.max, so its
    page cache stays reclaimable there (docs/memory-qos.md, "Protection that never OOM-kills")."""
    if limit <= 0 or request <= 0:
        return max(0, request), 0
    room = headroom(limit, node.headroom_ratio, node.headroom_min)
    if request <= limit - room:
        return request, room
    page = max(1, node.page_size)
    return max(0, (limit - room) // page * page), room


def _protection(policy: Policy, qos: QoSClass, req: Request, limit: int,
                node: NodeFacts) -> tuple[dict[str, int], dict[str, str]]:
    keys: dict[str, int] = {}
    reasons: dict[str, str] = {}
    why = f"request {req.bytes} from {req.source.value}"
    key = protection_key(policy, qos)
    if policy is Policy.NONE:
        reasons["memory.min"] = reasons["memory.low"] = "not set: policy None"
    elif req.bytes <= 0 or key is None:
        reasons["memory.min"] = reasons["memory.low"] = "not set: no memory request"
    else:
        other = "memory.low" if key == "memory.min" else "memory.min"
        keys[key] = req.bytes
        if policy is Policy.TIERED_RESERVATION:
            reasons[key] = f"{why} (policy TieredReservation, {qos.value})"
            reasons[other] = f"not set: policy TieredReservation protects {qos.value} with {key}"
        else:
            reasons[key] = f"{why} (policy {policy.value})"
            reasons[other] = f"not set: {key} protects this container"
        if key == "memory.min":
            _cap_min(keys, reasons, req, limit, node)
    return keys, reasons


def _cap_min(keys: dict[str, int], reasons: dict[str, str], req: Request, limit: int, node: NodeFacts) -> None:
    """memory.min capped under the limit; memory.low then carries the request (memory.low never
    OOM-kills: the kernel reclaims below it when nothing else is left)."""
    value, room = capped_min(req.bytes, limit, node)
    if value >= req.bytes:
        return
    raw = limit - room
    cap = (f"capped at limit {limit} - headroom {room} = {raw}"
           + (f" -> {value}" if value != raw else "") + " so the pod can reclaim its own page cache "
           f"({NEVER_OOM})")
    keys["memory.low"] = req.bytes
    if value > 0:
        keys["memory.min"] = value
        reasons["memory.min"] += f"; {cap}"
        reasons["memory.low"] = (f"request {req.bytes}: memory.min is capped under the limit, memory.low "
                                 f"protects the rest (memory.low never OOM-kills)")
    else:
        del keys["memory.min"]
        reasons["memory.min"] = f"not set: {reasons['memory.min']}; {cap}: nothing left"
        reasons["memory.low"] = (f"request {req.bytes}: memory.min capped to 0 under the limit, memory.low "
                                 f"protects the container instead (memory.low never OOM-kills)")


def _throttle(node: NodeFacts, qos: QoSClass, req: Request, limit: int) -> tuple[int | None, str]:
    if node.factor is None:
        return None, "not set: no throttling factor"
    if qos is QoSClass.GUARANTEED:
        return None, "not set: Guaranteed pod"
    if limit > 0 and req.bytes == limit:
        return None, "not set: request equals limit"
    if (
        req.source is RequestSource.OOM_SCORE_ADJ
        and limit > 0
        and req.bytes <= limit
        and (req.upper is None or limit < req.upper)
    ):
        return None, "not set: the request estimated from oom_score_adj may equal the limit"
    if limit > 0:
        ceiling, what = limit, "limit"
    else:  # allocatable, never above the capacity (a --node-allocatable beyond it)
        ceiling, what = allocatable_bound(node.allocatable, node.capacity) if node.allocatable > 0 else (0, "")
    if ceiling <= 0:
        return None, "not set: no limit and allocatable unknown"
    high = memory_high(req.bytes, ceiling, node.factor, node.page_size)
    if high <= req.bytes or high == 0:
        return None, f"not set: computed {high} is not above the request {req.bytes}"
    return high, (
        f"floor({req.bytes} + ({what} {ceiling} - {req.bytes}) * {node.factor}) "
        f"rounded down to page {node.page_size}"
    )


def _bounded_limit(node: NodeFacts, container: ContainerFacts, notes: list[str]) -> tuple[ContainerFacts, int]:
    """The container as request discovery reads it (a negative or beyond-int64 limit is none)
    and the limit memory.high uses (a limit above the capacity is none too: memory.high is then
    computed from allocatable). docs/memory-qos.md, "Absurd numbers"."""
    limit = container.limit
    if limit < 0 or limit > MAX_BYTES:
        notes.append(f"memory_limit_in_bytes {limit} is not a byte count: treated as no limit")
        container = replace(container, limit=0)
        limit = 0
    cap = capacity_bound(node.capacity)
    if limit > cap[0]:
        notes.append(f"limit {limit} above {cap[1]} {cap[0]}: treated as no limit")
        limit = 0
    return container, limit


def _correct_kubelet_min(after: dict[str, str], reasons: dict[str, str], sent: str, limit: int,
                         node: NodeFacts) -> None:
    """Setting correct-kubelet-min: the kubelet's container memory.min (its request) lowered
    under the limit by the rule of ``capped_min``; never raised, memory.low / memory.high
    untouched."""
    raw = after.get("memory.min", "")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19):
        return
    value = int(raw)
    capped, room = capped_min(value, limit, node)
    if capped >= value:
        return
    after["memory.min"] = str(capped)
    reasons["memory.min"] = (
        f"kubelet's {sent!r} lowered to {capped} (correct-kubelet-min): capped at limit {limit} - headroom {room}"
        f" = {limit - room}, rounded down to a page, so the pod can reclaim its own page cache ({NEVER_OOM}); "
        + ("no memory.min is left under this limit; " if capped == 0 else "")
        + f"before: {reasons['memory.min']}")


def _kubelet_value(key: str, raw: str, node: NodeFacts) -> tuple[str, str]:
    """A value the kubelet owns, forwarded as sent unless it is a byte count above what the node
    has: memory.min / memory.low above allocatable are clamped to it, memory.high above the
    capacity is "max" (a limit above the capacity is no limit)."""
    if not (raw.isascii() and raw.isdigit()):
        return raw, ""
    value = int(raw) if len(raw) <= 40 else MAX_BYTES + 1
    if key == "memory.high":
        cap = capacity_bound(node.capacity)
        if value > cap[0]:
            return "max", f"clamped: kubelet's memory.high {raw[:40]} above {cap[1]} {cap[0]}: set to 'max'"
        return raw, ""
    bounded, note = clamp(value, allocatable_bound(node.allocatable, node.capacity), f"kubelet's {key} {raw[:40]}")
    return (str(bounded), note) if note else (raw, "")


def decide(
    pod: PodFacts,
    container: ContainerFacts,
    node: NodeFacts,
    policy: Policy,
    request: Request | None = None,
    *,
    reset_absent: bool = False,
    kubelet_owns: Mapping[str, str] | KubeletKeys = MappingProxyType({}),
) -> Decision:
    """What the shim puts in the container's unified map, and why.

    `request` overrides request discovery (updates remember the creation's request;
    explain states it). `reset_absent` (updates): a key the shim does not set gets its
    neutral value ("0", or "max" for memory.high) instead of being left out, because
    containerd merges an update's unified map into the container's and never removes
    a key -- leaving it out would keep the old value in force.

    `kubelet_owns`: owned keys the kubelet is configured to write itself (key -> why, from
    shim.node.kubelet.Ownership): its value is forwarded unchanged (unless it is a byte count
    above what the node has), or left out when it sent none. A ``KubeletKeys`` is resolved for
    this container (its QoS class, request and limit: ``KubeletKeys.for_container``); the
    decision carries the keys it resolved to (``Decision.kubelet_owns``).

    No value above the node ever comes out (docs/memory-qos.md, "Absurd numbers"): the request
    (discovered or given) is clamped to allocatable, a limit above the capacity is no limit,
    and ``notes`` says each time it happened."""
    # (this is the CRI path: the common case, numbers within the node, is checked inline and
    # allocates nothing; the notes list is made when there is something to note)
    notes: list[str] | None = None
    qos, qos_reason = qos_class(pod.cgroup_parent, container.oom_score_adj)
    limit = container.limit
    seen = container
    if not 0 <= limit <= node.capacity <= MAX_BYTES:
        notes = []
        seen, limit = _bounded_limit(node, container, notes)
    req = request if request is not None else resolve_request(pod, seen, qos, node.capacity)
    clamped = ""
    if not 0 <= req.bytes <= node.allocatable <= node.capacity <= MAX_BYTES:
        clamped_bytes, clamped = clamp(req.bytes, allocatable_bound(node.allocatable, node.capacity), "request")
        if clamped:
            notes = notes or []
            notes.append(clamped)
            req = replace(req, bytes=clamped_bytes)
    if isinstance(kubelet_owns, KubeletKeys):
        kubelet_owns = kubelet_owns.for_container(qos, req, seen.limit, node.allocatable, node.page_size,
                                                  container.unified)
    desired, reasons = _protection(policy, qos, req, limit, node)
    if clamped:
        for key in desired:
            reasons[key] += f" ({clamped})"
    high, reasons["memory.high"] = _throttle(node, qos, req, limit)
    if high is not None:
        desired["memory.high"] = high

    before = dict(container.unified)
    after = {k: v for k, v in before.items() if k not in OWNED_KEYS}
    for key in OWNED_KEYS:
        if key in kubelet_owns:
            if key in before:
                after[key], note = _kubelet_value(key, before[key], node)
                if note:
                    notes = notes or []
                    notes.append(note)
                    reasons[key] = f"{note} (the kubelet owns it: {kubelet_owns[key]})"
                else:
                    reasons[key] = f"kubelet's {before[key]!r} kept: {kubelet_owns[key]}"
                if key == "memory.min" and node.correct_kubelet_min:
                    _correct_kubelet_min(after, reasons, before[key], limit, node)
            else:
                reasons[key] = f"not set: the kubelet owns it, and no value of the kubelet's is in the request " \
                               f"({kubelet_owns[key]})"
            continue
        if key in desired:
            after[key] = str(desired[key])
            if key in before and before[key] != after[key]:
                reasons[key] += f"; replaces kubelet's {before[key]!r}"
            elif key in before:
                reasons[key] += "; same as kubelet's"
        elif reset_absent:
            after[key] = NEUTRAL[key]
            reasons[key] += f"; set to {NEUTRAL[key]!r} so an earlier value does not stay in force"
        elif key in before:
            reasons[key] += f"; kubelet's {before[key]!r} removed"
    decision = Decision(
        qos=qos,
        qos_reason=qos_reason,
        request=req,
        limit=container.limit,
        unified_before=MappingProxyType(before),
        unified_after=MappingProxyType(after),
        reasons=MappingProxyType(reasons),
        kubelet_owns=kubelet_owns,
    )
    return replace(decision, notes=tuple(notes)) if notes else decision
