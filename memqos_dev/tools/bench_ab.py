"""A/B of two versions of the shim in one run (``scripts/bench-ab REF_A REF_B``).

Each git ref is checked out into a temporary worktree and served by its own ``memqos-shim
serve`` process in front of one shared fake runtime (``memqos_dev.tools.bench
upstream``); the client alternates every call between direct, A and B, so the machine's drift
hits all three alike. Reported per block, then as medians over the blocks, added over direct:
small call p50, a 200 KB answer (ExecSync), a CreateContainer that is rewritten, a passthrough
call of the same size, and the rewrite's extra cost (the difference of the last two). This is how a change to the
rewrite path is judged on a noisy machine: its effect is often smaller than the spread
between two ``scripts/bench`` runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shim.cri.methods import CREATE_CONTAINER, EXEC_SYNC, VERSION
from memqos_dev.tools.bench.load import Client
from memqos_dev.tools.bench.processes import Processes
from memqos_dev.tools.bench.workload import DEFAULT_TRACE, QUICK, REPO, exec_request, padded, pct, prepare

MiB = 1 << 20


def worktree(ref: str, into: Path) -> Path:
    """``ref`` checked out (detached) in a new worktree under ``into``."""
    path = into / ref.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    return path


def remove_worktrees(trees: list[Path]) -> None:
    for t in trees:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(t)], check=False)


def run(ref_a: str, ref_b: str, blocks: int, calls: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mqab-"))
    trees: list[Path] = []
    procs: Processes | None = None
    try:
        sources = {}
        for tag, ref in (("A", ref_a), ("B", ref_b)):
            src = REPO if ref == "WORKTREE" else worktree(ref, work)
            if src != REPO:
                trees.append(src)
            sources[tag] = ("relay", src)
        procs = Processes([], sources)
        procs.start()
        targets = procs.targets()
        client = Client(targets)
        client.wait_ready()
        w = prepare(targets["direct"], QUICK, DEFAULT_TRACE)
        client.alternate(VERSION, lambda i, n: b"", 300)
        template = w.create_template
        pad = padded(template.ByteSize())
        reply200k = exec_request(w.exec_container, 200 * 1024)
        counter = [0]

        def create_req(i: int, name: str) -> bytes:
            counter[0] += 1
            template.config.metadata.attempt = counter[0]
            return template.SerializeToString()

        per = {t: {"small": [], "reply200k": [], "create": [], "passthrough": [], "rewrite_extra": []}
               for t in ("A", "B")}
        for b in range(blocks):
            lc = client.alternate(CREATE_CONTAINER, create_req, calls)
            lp = client.alternate(VERSION, lambda i, n: pad, calls)
            ls = client.alternate(VERSION, lambda i, n: b"", calls)
            lr = client.alternate(EXEC_SYNC, lambda i, n: reply200k, max(1, calls // 3))
            for t in ("A", "B"):
                c = (pct(lc[t], 50) - pct(lc["direct"], 50)) * 1e6
                p = (pct(lp[t], 50) - pct(lp["direct"], 50)) * 1e6
                per[t]["create"].append(c)
                per[t]["passthrough"].append(p)
                per[t]["rewrite_extra"].append(c - p)
                per[t]["small"].append((pct(ls[t], 50) - pct(ls["direct"], 50)) * 1e6)
                per[t]["reply200k"].append((pct(lr[t], 50) - pct(lr["direct"], 50)) * 1e6)
            print(f"  block {b + 1}/{blocks}: rewrite extra A {per['A']['rewrite_extra'][-1]:.0f} us, "
                  f"B {per['B']['rewrite_extra'][-1]:.0f} us", file=sys.stderr)
        client.close()
        return {"A": ref_a, "B": ref_b, "blocks": blocks, "calls_per_block": calls,
                "median": {t: {k: statistics.median(v) for k, v in per[t].items()} for t in per},
                "blocks_us": per}
    finally:
        if procs is not None:
            procs.stop()
        remove_worktrees(trees)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench-ab", description=__doc__.split("\n\n")[0])
    p.add_argument("ref_a", help="git ref of version A (WORKTREE: this checkout as it is)")
    p.add_argument("ref_b", nargs="?", default="WORKTREE", help="git ref of version B (default: WORKTREE)")
    p.add_argument("--blocks", type=int, default=8, help="blocks of calls; medians over them (default 8)")
    p.add_argument("--calls", type=int, default=300, help="calls per target per kind in a block (default 300)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    result = run(args.ref_a, args.ref_b, args.blocks, args.calls)
    m = result["median"]
    print(f"memqos-shim bench-ab: {args.blocks} blocks x {args.calls} calls per kind, alternating direct / A / B; "
          f"medians over blocks of p50 added over direct (µs)")
    print(f"| metric | A: {args.ref_a} | B: {args.ref_b} | B − A |")
    print("|---|---|---|---|")
    for key, label in (("small", "small call"), ("reply200k", "200 KB answer"),
                       ("create", "CreateContainer (rewritten)"), ("passthrough", "same-size passthrough"),
                       ("rewrite_extra", "rewrite extra over passthrough")):
        print(f"| {label} | {m['A'][key]:+.0f} | {m['B'][key]:+.0f} | {m['B'][key] - m['A'][key]:+.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
