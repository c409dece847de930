"""Expected cgroup values for the real-kernel suite, computed independently of the shim.

Deliberately does NOT import shim.decision (or anything of the shim but the generated CRI
stubs elsewhere): the arithmetic is written again here from docs/memory-qos.md,
so a wrong formula in the shim shows up as a difference on the real kernel.

Inputs are the facts the kubelet put on the wire (recorded CreateContainer requests) and the
node facts of the trace header (MemTotal, page size, KubeletConfiguration). Values are the bytes
the shim should write; `kernel_reads` gives what the kernel reads back (memory.min/high/max
are kept in whole pages: a write of N bytes reads back as floor(N / page) * page).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MI = 1 << 20
GUARANTEED, BURSTABLE, BESTEFFORT = "Guaranteed", "Burstable", "BestEffort"

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def quantity(q) -> int:
    """Kubernetes memory quantity ('100Mi', '64M', 1024) -> bytes (integers only)."""
    if q is None:
        return 0
    if isinstance(q, int):
        return q
    m = re.fullmatch(r"(\d+)([kMGT]i?|)", str(q).strip())
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Node:
    capacity: int
    page: int
    kube_reserved: int = 0
    system_reserved: int = 0
    factor: float | None = 0.9

    @property
    def allocatable(self) -> int:
        return max(0, self.capacity - self.kube_reserved - self.system_reserved)

    @classmethod
    def from_trace_header(cls, header: dict) -> "Node":
        node = header["node"]
        kc = node.get("kubelet_config") or {}
        factor = kc.get("memoryThrottlingFactor", 0.9)
        return cls(
            capacity=int(node["mem_total_bytes"]),
            page=int(node["page_size"]),
            kube_reserved=quantity((kc.get("kubeReserved") or {}).get("memory")),
            system_reserved=quantity((kc.get("systemReserved") or {}).get("memory")),
            factor=float(factor) if factor is not None else None,
        )


def qos_from_cgroup_parent(parent: str) -> str:
    parts = [p for p in parent.split("/") if p]
    if len(parts) >= 2 and parts[-2] in ("burstable", "besteffort"):
        return BURSTABLE if parts[-2] == "burstable" else BESTEFFORT
    if len(parts) >= 2 and parts[-2] == "kubepods":
        return GUARANTEED
    raise ValueError(f"not a cgroupfs kubepods pod parent: {parent!r}")


@dataclass(frozen=True)
class Request:
    bytes: int
    source: str
    upper: int | None = None  # exclusive upper bound when only a range is known


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def container_request(qos: str, limit: int, oom_score_adj: int, unified: dict, node: Node) -> Request:
    """What the shim can know of a container's memory request from CRI alone (reference
    section 3): the kubelet's own memory.min/low when MemoryQoS is on; the limit for a
    Guaranteed pod; else the lower bound that oom_score_adj gives (never above the truth)."""
    if qos == BESTEFFORT:
        return Request(0, "none")
    for key in ("memory.min", "memory.low"):
        raw = unified.get(key, "")
        if raw.isdigit() and int(raw) > 0:
            return Request(int(raw), "kubelet-unified")
    if qos == GUARANTEED:
        return Request(limit, "guaranteed-limit")
    adj, c = oom_score_adj, node.capacity
    if adj < 3 or adj > 999:
        return Request(0, "none")
    # kubelet: adj = 1000 - (1000 * req) // capacity, clamped to [3, 999]
    if adj == 999:
        low, upper = 0, _ceil_div(2 * c, 1000)
    else:
        k = 1000 - adj
        low = _ceil_div(k * c, 1000)
        upper = None if adj == 3 else _ceil_div((k + 1) * c, 1000)
    if limit:
        low = min(low, limit)
    return Request(low, "oom-score-adj", upper)


def kubelet_high(request: int, ceiling: int, factor: float, page: int) -> int:
    """floor(req + (ceiling - req) * factor) in IEEE float64 (as the kubelet's Go code), then
    rounded down to a whole page in integers."""
    value = math.floor(float(request) + (float(ceiling) - float(request)) * factor)
    return value - value % page


@dataclass
class ContainerExpectation:
    qos: str
    request: Request
    limit: int
    min: int  # 0 = not written
    high: int | None  # None = not written ("max")
    max: int | None  # None = no limit ("max")
    why: dict = field(default_factory=dict)
    low: int = 0  # 0 = not written: the request where memory.min is capped under the limit


def capped_min(request: int, limit: int, page: int, ratio: float = 0.1, floor: int = 8 * 2**20) -> int:
    """memory.min of a container with a limit: at most limit - max(ceil(limit * ratio), floor),
    rounded down to a page when capped, never below 0 (docs/memory-qos.md, "Protection that never
    OOM-kills"; the defaults of protection-headroom-ratio / -min)."""
    if limit <= 0 or request <= 0:
        return max(0, request)
    cap = limit - max(math.ceil(float(limit) * ratio), floor)
    return request if request <= cap else max(0, cap // page * page)


def container_expectation(qos: str, limit: int, oom_score_adj: int, unified: dict, node: Node) -> ContainerExpectation:
    req = container_request(qos, limit, oom_score_adj, unified, node)
    why = {"request": f"{req.bytes} ({req.source})"}
    high: int | None = None
    if node.factor is None:
        why["memory.high"] = "no throttling factor"
    elif qos == GUARANTEED:
        why["memory.high"] = "Guaranteed: not set"
    elif limit > 0 and req.bytes == limit:
        why["memory.high"] = "request == limit: not set"
    elif req.source == "oom-score-adj" and limit > 0 and (req.upper is None or limit < req.upper):
        # the true request lies in [low, upper): it may equal the limit, so no memory.high
        why["memory.high"] = f"request estimate [{req.bytes}, {req.upper}) may equal the limit {limit}: not set"
    else:
        ceiling = limit if limit > 0 else node.allocatable
        value = kubelet_high(req.bytes, ceiling, node.factor, node.page) if ceiling > 0 else 0
        if value > req.bytes:
            high = value
            what = "limit" if limit > 0 else "allocatable"
            why["memory.high"] = f"floor({req.bytes} + ({what} {ceiling} - {req.bytes}) * {node.factor}) paged"
        else:
            why["memory.high"] = f"{value} not above the request: not set"
    low = 0
    protect = capped_min(req.bytes, limit, node.page)
    if protect < req.bytes:
        low = req.bytes
        why["memory.min"] = f"capped under the limit {limit}: {protect}; memory.low = request {low}"
    return ContainerExpectation(qos, req, limit, protect, high, limit or None, why, low)


def pod_request(regular: list[int], init: list[int], overhead: int = 0) -> int:
    """The kubelet's pod memory request: max(sum of regular containers, each init container)
    plus overhead (reference section 2)."""
    return max([sum(regular)] + list(init)) + overhead


def kernel_reads(value: int | None, page: int) -> str:
    """What memory.min/high/max read back after the shim/runc wrote `value` bytes."""
    if value is None:
        return "max"
    return str((value // page) * page)
