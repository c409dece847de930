"""Container-level memory.min / memory.low / memory.high (reference section 1)."""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

from shim.decision.facts import OWNED_KEYS, ContainerFacts, Decision, NodeFacts, PodFacts, Policy, QoSClass, Request, RequestSource
from shim.decision.qos import qos_class
from shim.decision.request import resolve_request


# The kernel's defaults: no protection, no throttling.
NEUTRAL = {"memory.min": "0", "memory.low": "0", "memory.high": "max"}


def memory_high(request: int, ceiling: int, factor: float, page_size: int) -> int:
    """floor(req + (ceiling - req) * factor) in IEEE float64 like the kubelet, then
    rounded down to a whole page with integer arithmetic. ceiling is the limit, or
    allocatable when there is no limit."""
    high = math.floor(float(request) + (float(ceiling) - float(request)) * factor)
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


def _protection(policy: Policy, qos: QoSClass, req: Request) -> tuple[dict[str, int], dict[str, str]]:
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
    return keys, reasons


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
    ceiling, what = (limit, "limit") if limit > 0 else (node.allocatable, "allocatable")
    if ceiling <= 0:
        return None, "not set: no limit and allocatable unknown"
    high = memory_high(req.bytes, ceiling, node.factor, node.page_size)
    if high <= req.bytes or high == 0:
        return None, f"not set: computed {high} is not above the request {req.bytes}"
    return high, (
        f"floor({req.bytes} + ({what} {ceiling} - {req.bytes}) * {node.factor}) "
        f"rounded down to page {node.page_size}"
    )


def decide(
    pod: PodFacts,
    container: ContainerFacts,
    node: NodeFacts,
    policy: Policy,
    request: Request | None = None,
    *,
    reset_absent: bool = False,
    kubelet_owns: Mapping[str, str] = MappingProxyType({}),
) -> Decision:
    """What the shim puts in the container's unified map, and why.

    `request` overrides request discovery (updates remember the creation's request;
    explain states it). `reset_absent` (updates): a key the shim does not set gets its
    neutral value ("0", or "max" for memory.high) instead of being left out, because
    containerd merges an update's unified map into the container's and never removes
    a key -- leaving it out would keep the old value in force.

    `kubelet_owns`: owned keys the kubelet is configured to write itself (key -> why, from
    shim.node.kubelet.Ownership): its value is forwarded unchanged, or left out when it sent
    none."""
    qos, qos_reason = qos_class(pod.cgroup_parent, container.oom_score_adj)
    req = request if request is not None else resolve_request(pod, container, qos, node.capacity)
    desired, reasons = _protection(policy, qos, req)
    high, reasons["memory.high"] = _throttle(node, qos, req, container.limit)
    if high is not None:
        desired["memory.high"] = high

    before = dict(container.unified)
    after = {k: v for k, v in before.items() if k not in OWNED_KEYS}
    for key in OWNED_KEYS:
        if key in kubelet_owns:
            if key in before:
                after[key] = before[key]
                reasons[key] = f"kubelet's {before[key]!r} kept: {kubelet_owns[key]}"
            else:
                reasons[key] = f"not set: the kubelet sent none and owns it ({kubelet_owns[key]})"
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
    return Decision(
        qos=qos,
        qos_reason=qos_reason,
        request=req,
        limit=container.limit,
        unified_before=MappingProxyType(before),
        unified_after=MappingProxyType(after),
        reasons=MappingProxyType(reasons),
    )
