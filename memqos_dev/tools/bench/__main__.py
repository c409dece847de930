"""`scripts/bench` and ``python -m memqos_dev.tools.bench upstream`` (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import memqos_dev.tools.bench
from memqos_dev.tools.bench.processes import has_transport_option, run_upstream
from memqos_dev.tools.bench.report import table
from memqos_dev.tools.bench.run import PARTS, median_runs, one_run
from memqos_dev.tools.bench.workload import DEFAULT_TRACE, QUICK, REPO, TARGETS, Sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["upstream"]:
        p = argparse.ArgumentParser(prog="python -m memqos_dev.tools.bench upstream")
        p.add_argument("--listen", required=True)
        return run_upstream(p.parse_args(argv[1:]).listen)
    p = argparse.ArgumentParser(prog="scripts/bench", description=memqos_dev.tools.bench.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one short run (about a minute)")
    p.add_argument("--runs", type=int, help="runs to take medians over (default 3, --quick 1)")
    p.add_argument("--transport", default=None,
                   help="comma-separated transports of `serve` to put side by side, when this tree's `serve` "
                        "has a --transport option (default: relay)")
    p.add_argument("--serve-defaults", action="store_true",
                   help="run the measured shims with the reconciler and the monitor on, as `serve` runs by "
                        "default (otherwise --reconcile false --monitor-interval 0: the transport path alone)")
    p.add_argument("--ref", action="append", default=[],
                   help="also serve this git ref's `serve` (relay) from a temporary worktree, as a column of its "
                        "own in the same run (repeatable)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated measurements to run (default: all): {', '.join(PARTS)}")
    p.add_argument("--load-calls", type=int, help="calls for the RSS-after-load measurement (default 100000)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="kubelet trace for the steady-state mix")
    p.add_argument("--json", default=str(REPO / "out" / "bench" / "bench.json"), help="where to write the JSON")
    args = p.parse_args(argv)
    sizes = Sizes(**vars(QUICK)) if args.quick else Sizes()
    if args.runs:
        sizes.runs = args.runs
    if args.load_calls:
        sizes.load_calls = args.load_calls
    transports = ["relay"] if args.transport is None else [t.strip() for t in args.transport.split(",") if t.strip()]
    if transports != ["relay"] and not has_transport_option():
        p.error("this tree's `serve` has no --transport option: it relays, and --transport can only be relay")
    parts = PARTS if args.only is None else tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"--only: unknown measurement(s) {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
    trace = Path(args.trace) if args.trace else None

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import compileall
    import shutil
    import tempfile

    from memqos_dev.tools.bench_ab import remove_worktrees, worktree

    sources = {t: (t, REPO) for t in transports}
    work = Path(tempfile.mkdtemp(prefix="mqbench-")) if args.ref else None
    trees = []
    for ref in args.ref:
        tree = worktree(ref, work)
        trees.append(tree)
        sources[f"relay@{ref}"] = ("relay", tree)
    for tree in [REPO, *trees]:
        compileall.compile_dir(str(tree / "shim"), quiet=1)  # bytecode, as `pip install` leaves it
    try:
        runs = measure(sizes, sources, trace, parts, args.serve_defaults, log)
    finally:
        remove_worktrees(trees)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    write_report(args, argv, sizes, runs)
    return 0


def measure(sizes: Sizes, sources: dict, trace, parts, serve_defaults: bool, log) -> dict:
    """The runs (fresh processes each) and what the report says about the machine meanwhile."""
    runs = []
    t_start = time.time()
    load = [os.getloadavg()[0]]
    for r in range(sizes.runs):
        log(f"run {r + 1}/{sizes.runs}")
        runs.append(one_run(sizes, trace, log, parts, serve_defaults, sources))
        load.append(os.getloadavg()[0])
    return {"runs": runs, "load": load, "start": t_start}


def write_report(args, argv: list[str], sizes: Sizes, measured: dict) -> None:
    runs, load, t_start = measured["runs"], measured["load"], measured["start"]
    result = {
        "command": "scripts/bench " + " ".join(argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "loadavg_1min_before_and_after_each_run": [round(x, 2) for x in load]},
        "sizes": vars(sizes),
        "targets": {k: {"kind": v[0], "limit": v[1]} for k, v in TARGETS.items()},
        "runs": runs,
        "median": median_runs(runs),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"memqos-shim bench: {sizes.runs} run(s), medians; added = via shim − direct, same run "
          f"(calls alternate between targets, call by call, back to back block by block); "
          f"{sizes.load_calls} load calls; "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, 1-min load average "
          f"{' → '.join(f'{x:.1f}' for x in load)} (other work on the machine adds noise)")
    print(table(result))
    print(f"JSON: {out}")


if __name__ == "__main__":
    sys.exit(main())
