"""Where a container's memory request comes from: CRI does not carry it, so the shim
takes the first source that has it (annotation, kubelet's unified, Guaranteed limit,
oom_score_adj lower bound) and says which one it used."""
from __future__ import annotations

import json

from shim.decision.facts import (
    REQUESTS_ANNOTATION,
    ContainerFacts,
    PodFacts,
    QoSClass,
    Request,
    RequestSource,
)
from shim.decision.quantity import MAX_BYTES, QuantityError, parse_bytes

MAX_ANNOTATION_BYTES = 64 * 1024


def _from_annotation(pod: PodFacts, container: ContainerFacts, notes: list[str]) -> int | None:
    raw = pod.annotations.get(REQUESTS_ANNOTATION)
    if raw is None:
        return None
    if len(raw) > MAX_ANNOTATION_BYTES:
        notes.append(f"{REQUESTS_ANNOTATION} ignored: longer than {MAX_ANNOTATION_BYTES} bytes")
        return None
    try:
        table = json.loads(raw)
    except (ValueError, RecursionError) as e:
        notes.append(f"{REQUESTS_ANNOTATION} ignored: not JSON ({e.__class__.__name__})")
        return None
    if not isinstance(table, dict):
        notes.append(f"{REQUESTS_ANNOTATION} ignored: not a JSON object")
        return None
    if container.name not in table:
        return None
    try:
        value = parse_bytes(table[container.name])
    except QuantityError as e:
        notes.append(f"{REQUESTS_ANNOTATION}[{container.name!r}] ignored: {e}")
        return None
    if container.limit and value > container.limit:
        notes.append(
            f"{REQUESTS_ANNOTATION}[{container.name!r}] ignored: {value} exceeds the limit {container.limit}"
        )
        return None
    return value


def _from_unified(container: ContainerFacts, notes: list[str]) -> int | None:
    for key in ("memory.min", "memory.low"):
        raw = container.unified.get(key)
        if raw is None:
            continue
        if not raw.isascii() or not raw.isdigit():
            if raw != "max":
                notes.append(f"kubelet's {key}={raw[:40]!r} is not a byte count")
            continue
        if len(raw) > 19 or int(raw) > MAX_BYTES:
            notes.append(f"kubelet's {key}={raw[:40]!r} is beyond int64: ignored")
            continue
        value = int(raw)
        if value > 0:
            return value
    return None


def oom_score_adj_bounds(adj: int, capacity: int) -> tuple[int, int | None] | None:
    """(low, high) with low <= request < high for a Burstable container's oom_score_adj.

    kubelet: adj = 1000 - (1000 * req) // capacity, then adj < 3 -> 3 and 1000 -> 999.
    With k = 1000 - adj: k * capacity / 1000 <= req < (k + 1) * capacity / 1000.
    adj 999 is k = 1 or a clamped k = 0 (low 0); adj 3 is any k >= 997 (high None:
    unbounded). Bounds are whole bytes: low = ceil(k*c/1000), high = ceil((k+1)*c/1000).
    """
    if capacity <= 0 or adj < 3 or adj > 999:
        return None
    if adj == 999:
        return 0, -(-2 * capacity // 1000)
    k = 1000 - adj
    low = -(-k * capacity // 1000)
    high = None if adj == 3 else -(-(k + 1) * capacity // 1000)
    return low, high


def _within_evidence(claimed: int, unified: int | None, qos: QoSClass, container: ContainerFacts,
                     capacity: int, notes: list[str]) -> int | None:
    """The pod annotation's request, or None when what the kubelet itself sent says the request is
    lower: the annotation is the pod's own (tenant) input and never buys more protection than the
    request (docs/decisions.md, "Where the request comes from"). Evidence: the kubelet's memory.min /
    memory.low (its request), else a Burstable container's oom_score_adj, which the kubelet derives
    from the request (request < the range's upper end). A claim at or below the evidence is kept."""
    where = f"{REQUESTS_ANNOTATION}[{container.name!r}]"
    if unified is not None:
        if claimed > unified:
            notes.append(f"{where} ignored: {claimed} is above the kubelet's request {unified}")
            return None
        return claimed
    if qos is QoSClass.BURSTABLE:
        bounds = oom_score_adj_bounds(container.oom_score_adj, capacity)
        if bounds is not None and bounds[1] is not None and claimed >= bounds[1]:
            notes.append(f"{where} ignored: {claimed} is not below {bounds[1]}, the most "
                         f"oom_score_adj {container.oom_score_adj} allows")
            return None
    return claimed


def resolve_request(
    pod: PodFacts, container: ContainerFacts, qos: QoSClass, capacity: int
) -> Request:
    notes: list[str] = []
    if qos is QoSClass.BESTEFFORT:
        return Request(0, RequestSource.NONE, "BestEffort pods have no requests")
    claimed = _from_annotation(pod, container, notes)
    unified = _from_unified(container, notes)
    if claimed is not None:
        claimed = _within_evidence(claimed, unified, qos, container, capacity, notes)
    if claimed is not None:
        return Request(claimed, RequestSource.ANNOTATION, "; ".join(notes))
    if unified is not None:
        return Request(unified, RequestSource.KUBELET_UNIFIED, "; ".join(notes))
    if qos is QoSClass.GUARANTEED:
        if container.limit > 0:
            return Request(container.limit, RequestSource.GUARANTEED_LIMIT, "; ".join(notes))
        notes.append("Guaranteed pod without a memory limit")
        return Request(0, RequestSource.NONE, "; ".join(notes))
    bounds = oom_score_adj_bounds(container.oom_score_adj, capacity)
    if bounds is not None:
        low, high = bounds
        if container.limit > 0:
            low = min(low, container.limit)
        shown = "?" if high is None else high
        notes.append(f"oom_score_adj {container.oom_score_adj}: {low} <= request < {shown}")
        return Request(low, RequestSource.OOM_SCORE_ADJ, "; ".join(notes), upper=high)
    if not -1000 <= container.oom_score_adj <= 1000:
        notes.append(f"oom_score_adj {container.oom_score_adj} is outside [-1000, 1000]: ignored")
    notes.append(f"no source (oom_score_adj {container.oom_score_adj}, capacity {capacity})")
    return Request(0, RequestSource.NONE, "; ".join(notes))
