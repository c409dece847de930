"""The protection benchmark's outcomes, as pure functions over what a run recorded (e2e/guest_pressure.py):
the samples (every ~0.2 s: per pod memory.current, min/low/high/max, memory.events, memory.stat),
the workloads' per-pass lines, and the run summaries. The checks the VM suite asserts, the table
scripts/protection-bench prints and the PNG it draws per scenario. No I/O but ``plot``'s file."""
from __future__ import annotations

import math

MI = 1 << 20
STAT_KEYS = ("anon", "file", "workingset_refault_anon", "workingset_refault_file", "pgmajfault")
RECLAIMED = 0.75  # a pod counts as reclaimed once its file pages fall below this share of those before


def parse_stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in STAT_KEYS and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_passes(text: str) -> list[tuple[float, float]]:
    """e2e/pressure.c's `pressure: pass N MS ms REALTIME` lines: [(end time, ms)]."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[:2] == ["pressure:", "pass"] and parts[4] == "ms":
            try:
                out.append((float(parts[5]), float(parts[3])))
            except ValueError:
                continue
    return out


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def delta(samples: list[dict], pod: str, key: str, since: float = 0.0) -> int:
    """How much a memory.stat counter of ``pod`` grew from the last sample before ``since`` (or the
    first sample) to the last sample."""
    series = [(s["t"], s["pods"][pod]["stat"].get(key, 0)) for s in samples
              if pod in s["pods"] and "stat" in s["pods"][pod]]
    if not series:
        return 0
    before = [v for t, v in series if t <= since]
    start = before[-1] if before else series[0][1]
    return max(0, series[-1][1] - start)


def peak(samples: list[dict], pod: str, key: str = "current") -> int:
    return max((s["pods"][pod].get(key, 0) for s in samples if pod in s["pods"]), default=0)


def reclaimed_at(samples: list[dict], pod: str, since: float, share: float = RECLAIMED) -> float | None:
    """The first time at or after ``since`` that the pod's file pages read below ``share`` of what
    they were at the last sample before ``since``; None if never (or nothing to reclaim)."""
    before = [s["pods"][pod]["stat"].get("file", 0) for s in samples
              if s["t"] <= since and pod in s["pods"] and "stat" in s["pods"][pod]]
    if not before or before[-1] <= 0:
        return None
    ref = before[-1]
    for s in samples:
        if s["t"] >= since and pod in s["pods"] and s["pods"][pod].get("stat", {}).get("file", ref) < share * ref:
            return s["t"]
    return None


def at_high(samples: list[dict], pod: str, interval: float) -> float:
    """Seconds (samples x interval) the pod's container with a memory.high spent at it (within 1 MiB)."""
    n = sum(1 for s in samples if pod in s["pods"] and "box_high" in s["pods"][pod]
            and s["pods"][pod].get("box_current", 0) >= s["pods"][pod]["box_high"] - MI)
    return round(n * interval, 1)


def stat_at(samples: list[dict], pod: str, key: str, since: float | None = None) -> int:
    """A memory.stat counter of ``pod`` at the last sample at or before ``since`` (None: the last sample)."""
    series = [s["pods"][pod]["stat"].get(key, 0) for s in samples if pod in s["pods"] and "stat" in s["pods"][pod]
              and (since is None or s["t"] <= since)]
    return series[-1] if series else 0


def stall_s(samples: list[dict], pod: str, since: float = 0.0, kind: str = "full") -> float:
    """Seconds the pod's tasks were stalled on memory (memory.pressure ``kind`` total) from the last
    sample before ``since`` (or the first) to the last sample."""
    series = [(s["t"], s["pods"][pod]["psi"].get(kind, 0)) for s in samples
              if pod in s["pods"] and "psi" in s["pods"][pod]]
    if not series:
        return 0.0
    before = [v for t, v in series if t <= since]
    start = before[-1] if before else series[0][1]
    return round(max(0, series[-1][1] - start) / 1e6, 1)


def grown(log_text: str) -> bool:
    """An aggressor is done growing: e2e/hog.c reached its target, or e2e/pressure.c touched all its
    anonymous memory and wrote its files (loop mode: it keeps touching them from then on)."""
    return "hog: done" in log_text or "pressure: files" in log_text


def oom_killed(run: dict) -> set[str]:
    return {name for name, p in run["pods"].items() if p.get("oom_kill", 0) > 0}


# -- the checks (each: (ok, expected, actual)) -------------------------------------------------------
def no_new_oom(baseline: dict, run: dict) -> tuple[bool, str, str]:
    """No pod OOM-killed in ``run`` that the no-protection baseline of the same scenario did not lose."""
    new = sorted(oom_killed(run) - oom_killed(baseline))
    return (not new, f"OOM kills within the baseline's {sorted(oom_killed(baseline)) or 'none'}",
            f"killed {sorted(oom_killed(run)) or 'none'}" + (f"; new: {new}" if new else ""))


def refaults_cut(baseline: dict, run: dict, pod: str, ratio: float = 0.1, kind: str = "file") -> tuple[bool, str, str]:
    """A protected holder's refaults (``kind`` file or anon) under pressure are at most ``ratio`` of
    the baseline's."""
    base = baseline["pods"][pod].get(f"refault_{kind}", 0)
    got = run["pods"][pod].get(f"refault_{kind}", 0)
    return got <= ratio * base, f"<= {ratio:g} x {base} (no protection)", str(got)


def throttled(run: dict, pod: str) -> tuple[bool, str, str]:
    """The pod was held at memory.high at least once (memory.events high)."""
    n = run["pods"][pod].get("high_events", 0)
    return n > 0, "> 0", str(n)


def not_throttled(run: dict, pod: str) -> tuple[bool, str, str]:
    """The pod was never held at memory.high (memory.events high 0)."""
    n = run["pods"][pod].get("high_events", 0)
    return n == 0, "0", str(n)


def same_oom(baseline: dict, run: dict, pod: str) -> tuple[bool, str, str]:
    """The pod is OOM-killed exactly when it is without protection."""
    def said(r: dict) -> str:
        return "OOM-killed" if r["pods"][pod].get("oom_kill", 0) > 0 else "not OOM-killed"
    return said(run) == said(baseline), f"{said(baseline)} (as without QoS)", said(run)


def kept_running(run: dict, pod: str) -> tuple[bool, str, str]:
    """The pod was not OOM-killed, its processes still ran at the end, and it had pages in swap."""
    p = run["pods"][pod]
    alive = all(code is None for code in (p.get("exits") or {"?": 0}).values())
    ok = p.get("oom_kill", 0) == 0 and alive and p.get("swap_peak", 0) > 0
    return ok, "no OOM kill, running at the end, swap used > 0", (
        f"oom_kill {p.get('oom_kill', 0)}, {'running' if alive else 'exited ' + str(p.get('exits'))}, "
        f"swap peak {_mib(p.get('swap_peak', 0))} MiB")


def anon_resident(run: dict, pod: str, share: float) -> tuple[bool, str, str]:
    """The pod's anonymous memory at the end is at least ``share`` of what it was when the pressure began."""
    p = run["pods"][pod]
    before, end = p.get("anon_before", 0), p.get("anon_end", 0)
    return before > 0 and end >= share * before, f">= {share:g} x {_mib(before)} MiB", f"{_mib(end)} MiB"


def reclaimed_first(samples: list[dict], first: str, second: str, since: float) -> tuple[bool, str, str]:
    """``first``'s file pages are reclaimed (fall below RECLAIMED of what they were when the pressure
    began) no later than ``second``'s; ``second`` never reclaimed passes when ``first`` was."""
    a, b = reclaimed_at(samples, first, since), reclaimed_at(samples, second, since)
    ok = a is not None and (b is None or a <= b)

    def at(t):
        return "never" if t is None else f"{t - since:.1f} s"
    return ok, f"{first} reclaimed no later than {second}", f"{first} {at(a)}, {second} {at(b)}"


# -- the table and the plot ----------------------------------------------------------------------
def _mib(n) -> str:
    return "-" if n is None else f"{n / MI:.0f}"


def _ms(x) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 10 else f"{x:.1f}")


def outcome(run: dict) -> str:
    """The run in a few words: who was OOM-killed, whether the page-cache writers completed, who
    was held at memory.high (5 s or more)."""
    parts = [f"{name} OOM-killed ({p['oom_kill']})" for name, p in run["pods"].items() if p.get("oom_kill")]
    writers = [p for p in run["pods"].values() if p.get("role") == "writer"]
    if not parts:
        parts.append("completed" if writers and all(p.get("completed") for p in writers) else
                     ("no OOM kill" if not writers else "did not complete"))
    parts += [f"{name} held at memory.high {p['at_high_s']:g} s" for name, p in run["pods"].items()
              if not p.get("oom_kill") and p.get("at_high_s", 0) >= 5]
    return "; ".join(parts)


def _lead(run: dict) -> str:
    """A run's first cells: scenario, value set, outcome, seconds."""
    return f"| {run['scenario']} | {run['set']} | {outcome(run)} | {run.get('duration_s', 0):.1f} |"


def _values_of(run: dict, pod: str, fallback: str) -> str:
    """The pod's part of the run's values line ("NAME min/low ..."), or ``fallback``."""
    return next((seg[len(pod) + 1:] for seg in run.get("values", "").split("; ") if seg.startswith(pod + " ")),
                fallback)


def table(runs: list[dict]) -> str:
    """One markdown table: a row per (scenario, value set, pod)."""
    head = ("| scenario | values | outcome | s | pod | QoS | peak MiB | pod min/low [container min/low/high] MiB | "
            "max events | "
            "refault file | refault anon | major faults | pass p50/p99 ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        for i, (name, p) in enumerate(run["pods"].items()):
            lead = _lead(run) if i == 0 else "| | | | |"
            prot = _values_of(run, name, "/".join(_mib(p.get(k)) if p.get(k) else "-" for k in ("min", "low", "high")))
            lines.append(f"{lead} {name} | {p.get('qos', '')} | {_mib(p.get('peak'))} | {prot} | "
                         f"{p.get('max_events', 0)} | {p.get('refault_file', 0)} | {p.get('refault_anon', 0)} | "
                         f"{p.get('pgmajfault', 0)} | {_ms(p.get('p50_ms'))}/{_ms(p.get('p99_ms'))} |")
    return "\n".join(lines)


def is_class(run: dict) -> bool:
    """A run of a class or swap scenario (its own table)."""
    return run["scenario"].startswith("class-") or run["scenario"].endswith("-swap")


def class_table(runs: list[dict]) -> str:
    """The class scenarios' table: a row per (scenario, value set, pod), with swap, stall seconds
    (memory.pressure full) and file / anon refaults, from the aggressor's start."""
    head = ("| scenario | values | outcome | s | pod | QoS | peak MiB | swap peak MiB | "
            "pod min/low [container min/low/high] MiB | high events | stall s | refault file | refault anon | "
            "anon MiB start/end |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        for i, (name, p) in enumerate(run["pods"].items()):
            lead = _lead(run) if i == 0 else "| | | | |"
            prot = _values_of(run, name, "-")
            lines.append(f"{lead} {name} | {p.get('qos', '')} | {_mib(p.get('peak'))} | {_mib(p.get('swap_peak', 0))} | "
                         f"{prot} | {p.get('high_events', 0)} | {p.get('stall_s', 0):g} | {p.get('refault_file', 0)} | "
                         f"{p.get('refault_anon', 0)} | {_mib(p.get('anon_before', 0))}/{_mib(p.get('anon_end', 0))} |")
    return "\n".join(lines)


def plot(scenario: str, runs: list[tuple[dict, list[dict]]], path: str) -> None:
    """One PNG for a scenario: a column per value set; top memory.current of every pod over time
    with its memory.min / low / high as dashed / dotted / dash-dot lines, its pages in swap as a wide
    light line and OOM kills marked, bottom the pods' cumulative file (and anon) refaults and, on the
    right axis, their cumulative memory stall seconds (PSI full)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * max(1, len(runs)), 7), dpi=80)
    axes = fig.subplots(2, max(1, len(runs)), squeeze=False, sharex="col")
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for col, (run, samples) in enumerate(runs):
        top, bottom = axes[0][col], axes[1][col]
        stall_ax = None
        top.set_title(f"{run['set']}: {outcome(run)}"[:60], fontsize=8)
        for i, pod in enumerate(run["pods"]):
            c = colours[i % len(colours)]
            pts = [(s["t"], s["pods"][pod]) for s in samples if pod in s["pods"]]
            if not pts:
                continue
            ts = [t for t, _ in pts]
            top.plot(ts, [v.get("current", 0) / MI for _, v in pts], color=c, label=pod)
            for key, style in (("min", "--"), ("low", ":"), ("box_high", "-.")):
                vals = [v.get(key) for _, v in pts]
                if any(isinstance(x, int) and x > 0 for x in vals):
                    top.plot(ts, [(x or 0) / MI if isinstance(x, int) else float("nan") for x in vals],
                             color=c, linestyle=style, linewidth=0.8)
            for key, style in (("workingset_refault_file", "-"), ("workingset_refault_anon", "--")):
                base = pts[0][1].get("stat", {}).get(key, 0)
                series = [v.get("stat", {}).get(key, 0) - base for _, v in pts]
                if key.endswith("file") or any(series):
                    bottom.plot(ts, series, color=c, linestyle=style)
            if any(v.get("swap", 0) for _, v in pts):  # pages in swap: a light wide line
                top.plot(ts, [v.get("swap", 0) / MI for _, v in pts], color=c, linewidth=3, alpha=0.3)
            if any(v.get("psi") for _, v in pts):  # stall seconds (memory.pressure full), right axis
                if stall_ax is None:
                    stall_ax = bottom.twinx()
                    stall_ax.set_ylabel("stalled s (PSI full) ..", fontsize=7)
                first = pts[0][1].get("psi", {}).get("full", 0)
                stall_ax.plot(ts, [(v.get("psi", {}).get("full", first) - first) / 1e6 for _, v in pts], color=c,
                              linestyle=":")
            kills = [t for (t, v), (_, w) in zip(pts[1:], pts[:-1])
                     if v.get("events", {}).get("oom_kill", 0) > w.get("events", {}).get("oom_kill", 0)]
            for t in kills:
                top.axvline(t, color=c, linewidth=1.5)
                top.annotate("OOM", (t, 0), color=c, fontsize=7)
        if run.get("pressure_t") is not None:
            for ax in (top, bottom):
                ax.axvline(run["pressure_t"], color="grey", linewidth=0.6, linestyle=":")
        top.set_ylabel("memory.current MiB (min -- low .. high -.; swap: wide, light)", fontsize=7)
        bottom.set_ylabel("refaults, pages (file -, anon --)", fontsize=7)
        bottom.set_xlabel("s", fontsize=7)
        top.legend(fontsize=6, loc="lower right")
    fig.suptitle(scenario, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def render(out: str, png_dir: str) -> str:
    """scripts/protection-bench's part on the host: the table of OUT/report.json's runs and a PNG per
    scenario (from OUT/logs/pressure-<scenario>-<set>.jsonl) into ``png_dir``; returns the table."""
    import json
    import os

    path = os.path.join(out, "report.json")
    if not os.path.exists(path):  # a run cut short: the guest's report has the runs it finished
        path = os.path.join(out, "report-guest.json")
    with open(path) as f:
        report = json.load(f)
    runs = (report.get("pressure") or {}).get("runs", [])
    os.makedirs(png_dir, exist_ok=True)
    by_scenario: dict[str, list] = {}
    for run in runs:
        path = os.path.join(out, "logs", f"pressure-{run['scenario']}-{run['set']}.jsonl")
        samples = []
        if os.path.exists(path):
            with open(path) as f:
                samples = [json.loads(line) for line in f if line.strip()]
        by_scenario.setdefault(run["scenario"], []).append((run, samples))
    for scenario, pairs in by_scenario.items():
        plot(scenario, pairs, os.path.join(png_dir, f"protection-{scenario}.png"))
    plain, classed = [r for r in runs if not is_class(r)], [r for r in runs if is_class(r)]
    parts = [table(plain)] if plain else []
    if classed:
        parts.append(class_table(classed))
    return "\n\n".join(parts)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        print("usage: pressure_outcome.py OUT_DIR PNG_DIR", file=sys.stderr)
        sys.exit(2)
    print(render(sys.argv[1], sys.argv[2]))
