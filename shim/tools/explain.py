"""`memqos-shim explain`: what the shim would put in ``unified`` for a request, a limit and a
node, and why; ``--table`` the KEP's comparison, ``--plot`` memory.high against request."""
from __future__ import annotations

import argparse
import json
import os
import sys

from shim import decision
from shim.decision.quantity import (PAGE_SIZE_MAX, PAGE_SIZE_MIN, QuantityError, format_bytes, parse_bytes,
                                    parse_page_size)

_QOS_PARENTS = {
    decision.QoSClass.GUARANTEED: "/kubepods/pod0000",
    decision.QoSClass.BURSTABLE: "/kubepods/burstable/pod0000",
    decision.QoSClass.BESTEFFORT: "/kubepods/besteffort/pod0000",
}


def _policy_arg(v: str) -> str:
    try:
        return decision.Policy(v).value
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown policy {v!r}: Hard, Soft, TieredReservation or None "
                                         "(any case)") from None


def _explain_factor(v: str) -> float | None:
    if v.lower() == "none":
        return None
    f = float(v)
    if not 0 < f <= 1:
        raise ValueError("factor must be in (0, 1]")
    return f


def _page_size(v: str | None) -> int:
    """--page-size: a base page size as serve takes it (parse_page_size), else the system's."""
    if not v:
        return os.sysconf("SC_PAGE_SIZE")
    try:
        return parse_page_size(v)
    except QuantityError as e:
        raise ValueError(f"--page-size: {e}") from None


def qos_contradiction(qos: str | None, request: int, limit: int) -> str | None:
    """Why --qos cannot be the class of a container with this request and limit (None: it can)."""
    if qos == "besteffort" and (request or limit):
        return ("--qos besteffort with a memory request or limit: Kubernetes makes a container with either "
                "Burstable or Guaranteed (BestEffort: no request and no limit)")
    if qos == "guaranteed" and (not limit or request != limit):
        return ("--qos guaranteed needs --limit equal to --request: a Guaranteed container's memory request "
                "equals its limit")
    return None


def cmd_explain(args: argparse.Namespace) -> int:
    if getattr(args, "plot", None):
        return _explain_plot(args)
    if args.table:
        print(kep_tables())
        return 0
    try:
        request = parse_bytes(args.request)
        limit = parse_bytes(args.limit)
        allocatable = parse_bytes(args.allocatable)
        factor = _explain_factor(args.factor)
        page = _page_size(args.page_size)
        policy = decision.Policy(args.policy)  # already checked by argparse
        ratio = float(args.protection_headroom_ratio)
        if not 0 <= ratio < 1:
            raise ValueError(f"--protection-headroom-ratio must be in [0, 1), not {args.protection_headroom_ratio}")
        floor = parse_bytes(args.protection_headroom_min)
        kubelet = _kubelet_arg(getattr(args, "kubelet", None))
    except (QuantityError, ValueError) as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    if limit and request > limit:  # the API server's validation: such a pod never reaches a node
        print(f"memqos-shim explain: request {args.request} is above limit {args.limit}: the API server refuses "
              f"such a container (resources.requests: Invalid value: must be less than or equal to memory "
              f"limit of {args.limit})", file=sys.stderr)
        return 2
    contradiction = qos_contradiction(args.qos, request, limit)
    if contradiction:
        print(f"memqos-shim explain: {contradiction}", file=sys.stderr)
        return 2
    if args.qos:
        qos = {q.name.lower(): q for q in decision.QoSClass}[args.qos]
    elif limit > 0 and request == limit:
        qos = decision.QoSClass.GUARANTEED
    elif request == 0 and limit == 0:
        qos = decision.QoSClass.BESTEFFORT
    else:
        qos = decision.QoSClass.BURSTABLE
    node = decision.NodeFacts(capacity=allocatable, allocatable=allocatable, page_size=page, factor=factor,
                              headroom_ratio=ratio, headroom_min=floor)
    d = decision.decide(
        decision.PodFacts(cgroup_parent=_QOS_PARENTS[qos]),
        decision.ContainerFacts(name="explain", limit=limit),
        node,
        policy,
        decision.Request(request, decision.RequestSource.GIVEN),
    )
    out = {
        "unified": dict(d.unified_after),
        "qos": d.qos.value,
        "request": request,
        "limit": limit,
        "allocatable": allocatable,
        "factor": factor,
        "page_size": page,
        "policy": policy.value,
        "protection_headroom_ratio": ratio,
        "protection_headroom_min": floor,
        "reasons": dict(d.reasons),
        **({"notes": list(d.notes)} if d.notes else {}),
    }
    if kubelet is not None:
        written = kubelet_keys(kubelet, d, limit, node)
        out["kubelet"] = kubelet.summary()
        out["kubelet_writes"] = written
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"QoS class {d.qos.value}; request {format_bytes(request)}, limit "
          f"{format_bytes(limit) if limit else 'none'}, allocatable {format_bytes(allocatable) if allocatable else 'unknown'}, "
          f"factor {factor if factor is not None else 'none'}, page {page}, policy {policy.value}")
    for key in ("memory.min", "memory.low", "memory.high"):
        value = d.unified_after.get(key)
        shown = f"{value} ({format_bytes(int(value))})" if value is not None else "-"
        print(f"  {key:12} {shown:28} {d.reasons.get(key, '')}")
    cap = _cap_line(d, request, limit, node)
    if cap:
        print(f"  cap: {cap}")
    for note in d.notes:
        print(f"  note: {note}")
    if kubelet is not None:
        print(f"  {kubelet.summary()}")
        print(f"  for this container it writes: {', '.join(sorted(written)) or 'nothing'}"
              + (" (NRI mode on containerd < 2.2 does not see these values and leaves them to the kubelet; proxy "
                 "mode decides them as above, rules in docs/memory-qos.md section 6)" if written else ""))
    return 0


def _kubelet_arg(v: str | None):
    """--kubelet VERSION: the shim.node.kubelet.KubeletWrites of a kubelet of that version with
    the MemoryQoS gate on and its other defaults; None without the flag."""
    if not v:
        return None
    from shim.node.facts import KubeletFacts
    from shim.node.kubelet import kubelet_writes, parse_version

    version = parse_version(v)
    if version is None or version < (1, 22):
        raise ValueError(f"--kubelet: {v!r} is not a kubelet version with Memory QoS (1.22 or later)")
    return kubelet_writes(KubeletFacts(memory_qos_gate=True), version)


def kubelet_keys(writes, d: decision.Decision, limit: int, node: decision.NodeFacts) -> dict[str, str]:
    """The keys that kubelet writes a value into for this container (key -> why), by the rule
    both front ends decide ownership with (shim.decision.kubelet)."""
    from shim.decision.kubelet import kubelet_writes_keys

    return kubelet_writes_keys(writes.rule(), d.qos, d.request, limit, node.allocatable, node.page_size,
                               together=False)


def _cap_line(d: decision.Decision, request: int, limit: int, node: decision.NodeFacts) -> str:
    """Why a memory.min protecting the request is below it: the headroom under the limit."""
    if request <= 0 or limit <= 0 or "memory.min" not in d.reasons or d.unified_after.get("memory.low") is None:
        return ""
    value, room = decision.capped_min(request, limit, node)
    if value >= request:
        return ""
    return (f"memory.min = min(request {request}, limit {limit} - headroom {room}) rounded down to a page = {value}: "
            f"headroom = max(ceil(limit x {node.headroom_ratio}), {node.headroom_min}); at the pod's memory.max "
            f"the container then stays above its memory.min and its page cache stays reclaimable, where "
            f"memory.min = request OOM-kills it (docs/memory-qos.md, \"Protection that never OOM-kills\"); "
            f"memory.low = request keeps the rest protected without that risk")


def _explain_plot(args: argparse.Namespace) -> int:
    """--plot FILE.png: memory.high against request for the KEP's factors (and --factor), limit
    --limit (default 1000Mi), the v1.22 formula for contrast."""
    from shim.tools.plot import KEP_FACTORS, KEP_LIMIT, PlotUnavailable, write_plot

    try:
        request = parse_bytes(args.request)
        limit = parse_bytes(args.limit) or KEP_LIMIT
        factor = _explain_factor(args.factor)
        page = _page_size(args.page_size)
    except (QuantityError, ValueError) as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    if request > limit:
        print(f"memqos-shim explain: request {args.request} is above limit {format_bytes(limit)}", file=sys.stderr)
        return 2
    factors = KEP_FACTORS + ((factor,) if factor is not None and factor not in KEP_FACTORS else ())
    # the container asked about, on the --factor curve (0.9 when --factor is none)
    mark = (request, factor if factor is not None else 0.9) if request else None
    try:
        data = write_plot(args.plot, limit=limit, factors=factors, page=page, mark=mark)
    except PlotUnavailable as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"memqos-shim explain: cannot write {args.plot}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.plot}: memory.high against request, limit {format_bytes(limit)}, factors "
          f"{', '.join(f'{f:g}' for f in factors)}, v1.22 formula for contrast")
    if data.get("mark"):
        m = data["mark"]
        high = f"memory.high {m['high']:g}Mi" if m["high"] is not None else "memory.high not set"
        print(f"marked: request {m['request']:g}Mi at factor {m['factor']:g}: {high}")
    return 0


def kep_tables() -> str:
    """The KEP-2570 comparison (limit 1000Mi, page 1Mi) with correct arithmetic."""
    from shim.decision import memory_high

    mi = 2**20
    limit = 1000 * mi
    factors = (0.9, 0.8, 0.6, 0.4)
    lines = ["memory.high for limit 1000Mi, page 1Mi (v1.27 formula: request + (limit - request) * factor;",
             "'-' = not set because request == limit). v1.22 formula (limit * factor) for contrast.", ""]
    lines.append("request  | " + " | ".join(f"factor {f}" for f in factors) + " | v1.22 @0.9")
    lines.append("-------- | " + " | ".join("----------" for _ in factors) + " | ----------")
    for r in range(0, 1001, 100):
        cells = []
        for f in factors:
            if r * mi == limit:
                cells.append("-")
                continue
            high = memory_high(r * mi, limit, f, mi)
            cells.append(f"{high // mi}Mi" if high > r * mi else "-")
        old = "-" if r * mi == limit else f"{int(limit * 0.9) // mi}Mi"
        lines.append(f"{r:>5}Mi  | " + " | ".join(f"{c:>10}" for c in cells) + f" | {old:>10}")
    lines.append("")
    lines.append("Note: the KEP and the 1.27 blog print 960 (request 800) and 980 (request 900) at factor 0.9;")
    lines.append("the arithmetic gives 980 and 990. A KEP row says 'request 500Gi, factor 0.4': it means 500Mi (700Mi).")
    return "\n".join(lines)


def register(sub) -> None:
    ex = sub.add_parser("explain", help="show what the shim would put in unified, and why")
    ex.add_argument("--request", default="0", metavar="Q", help="memory request (quantity)")
    ex.add_argument("--limit", default="0", metavar="Q", help="memory limit (quantity, 0 = none)")
    ex.add_argument("--allocatable", default="0", metavar="Q", help="node allocatable memory (quantity)")
    ex.add_argument("--factor", default="0.9", metavar="F", help="throttling factor in (0, 1] or 'none'")
    ex.add_argument("--page-size", default=None, metavar="N",
                    help=f"page size, a power of two from {PAGE_SIZE_MIN} to {PAGE_SIZE_MAX} (default: the system's)")
    ex.add_argument("--qos", choices=["guaranteed", "burstable", "besteffort"],
                    help="QoS class (default: from request and limit); one that request and limit contradict "
                         "is refused (guaranteed: limit = request; besteffort: neither)")
    ex.add_argument("--policy", default="Hard", type=_policy_arg, metavar="POLICY",
                    help="Hard (default), Soft, TieredReservation or None (any case)")
    ex.add_argument("--protection-headroom-ratio", default="0.1", metavar="R",
                    help="a container's memory.min stays max(limit x R, --protection-headroom-min) under its limit")
    ex.add_argument("--protection-headroom-min", default="8Mi", metavar="Q", help="the least headroom (quantity)")
    ex.add_argument("--kubelet", metavar="VERSION",
                    help="also say which keys a kubelet of this version (1.22+) with the MemoryQoS gate on and its "
                         "defaults writes for this container itself")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--table", action="store_true", help="print the KEP's comparison tables")
    ex.add_argument("--plot", metavar="FILE.png",
                    help="draw memory.high against request (KEP factors, v1.22 for contrast) to a PNG, the "
                         "container of --request marked on the --factor curve; needs the [plot] extra (matplotlib)")
    ex.set_defaults(func=cmd_explain)

