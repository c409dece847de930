"""The benchmark's table: each figure per target, added over direct, against the performance targets."""
from __future__ import annotations

from memqos_dev.tools.bench.workload import TARGETS


ROWS = [
    # label, key, unit, added-over-direct?
    ("small call p50", "small_p50_us", "µs", True),
    ("small call p99", "small_p99_us", "µs", True),
    ("200 KB reply p50", "reply200k_p50_us", "µs", True),
    ("16 MiB reply p50", "reply16m_p50_ms", "ms", True),
    ("calls/s, 32 callers", "throughput32_cps", "", "ratio"),
    ("quick call, 100 slow in flight, p50", "quick_under_slow_p50_ms", "ms", False),
    ("  same, max", "quick_under_slow_max_ms", "ms", False),
    ("CreateContainer p50 (rewritten)", "create_p50_us", "µs", True),
    ("same-size passthrough p50", "passthrough_same_size_p50_us", "µs", True),
    ("rewrite extra over passthrough", "rewrite_extra_us", "µs", None),
    ("  the decision code's rewrite() alone (in-process)", "hook_rewrite_us", "µs", None),
    ("back to back: ~4 KB CreateContainer p50 (rewritten)", "b2b_create_p50_us", "µs", True),
    ("back to back: same-size passthrough p50", "b2b_passthrough_p50_us", "µs", True),
    ("  back to back: added p50, create / passthrough", "b2b_added_ratio", "×", None),
    ("shim CPU per back-to-back rewritten create", "b2b_cpu_ms_per_create", "ms", None),
    ("shim CPU per back-to-back passthrough call", "b2b_cpu_ms_per_passthrough", "ms", None),
    ("shim CPU per 1000 small calls", "cpu_ms_per_1000", "ms", None),
    ("shim CPU per 1000 calls, 32 callers", "load_cpu_ms_per_1000", "ms", None),
    ("shim RSS idle", "rss_idle_mib", "MiB", None),
    ("shim RSS after the load calls", "rss_100k_mib", "MiB", None),
    ("shim RSS growth over the last 80% of them", "rss_growth_mib", "MiB", None),
    ("serve RSS idle with every default (reconciler, monitor)", "rss_defaults_mib", "MiB", None),
    ("shim RSS at the end (16 MiB replies, creates, 1.5 s idle)", "rss_end_mib", "MiB", None),
    ("110-pod kubelet load: call p50", "replay_p50_us", "µs", True),
    ("110-pod kubelet load: shim CPU", "replay_cpu_pct", "% of a core", None),
]
TARGET_KEY = {"small_p50_us": "small_p50_us", "reply200k_p50_us": "reply200k_p50_us",
              "throughput32_cps": "throughput32_ratio"}


def _fmt(v: float | None, unit: str) -> str:
    if v is None or v != v:
        return "-"
    if unit in ("µs",):
        return f"{v:.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def verdict(key: str, v: dict[str, float]) -> tuple[str, str]:
    tkey = TARGET_KEY.get(key, key)
    if tkey not in TARGETS:
        return "", ""
    kind, limit = TARGETS[tkey]
    if kind == "added":
        value = v.get("added_" + tkey)
        return f"≤ +{limit:g}", ("met" if value is not None and value <= limit else "NOT met")
    if kind == "min":
        value = v.get(tkey)
        return f"≥ {limit:g}×", ("met" if value is not None and value >= limit else "NOT met")
    value = v.get(tkey)
    return f"≤ {limit:g}", ("met" if value is not None and value <= limit else "NOT met")


def table(result: dict) -> str:
    med = result["median"]
    shims = [n for n in med if n != "direct"]
    head = ["metric", "unit", "direct"]
    for s in shims:
        head += [f"{s}", f"{s} added", "target", "met?"]
    rows = [head]
    for label, key, unit, added in ROWS:
        if all(key not in v for v in med.values()):
            continue  # not measured in this run (scripts/bench --only)
        d = med["direct"].get(key)
        row = [label, unit, _fmt(d, unit) if added is not None else ""]
        for s in shims:
            v = med[s]
            val = v.get(key)
            if added is True:
                extra = v.get("added_" + key)
                ratio = f" ({val / d:.2f}×)" if d and val is not None else ""
                add = ("+" + _fmt(extra, unit) if extra is not None and extra >= 0 else _fmt(extra, unit)) + ratio
            elif added == "ratio":
                add = f"{v.get('throughput32_ratio', float('nan')):.2f}× direct"
            else:
                add = ""
            t, ok = verdict(key, v)
            row += [_fmt(val, unit), add, t, ok]
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("| " + " | ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
