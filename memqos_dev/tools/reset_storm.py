"""``scripts/reset-storm``: the resident memory of ``memqos-shim serve`` through rapid-reset storms
(HEADERS + RST_STREAM pairs on one connection, CVE-2023-44487), this tree's relay side by side
with the relay of a baseline git ref, in one run.

Every shim is measured the same way: RSS after one call (before), after each round of ``pairs``
streams opened and reset on a fresh connection that is then closed, and ``settle`` seconds
after the last round; then one more call must be answered (the shim still serves). Printed as a
table (MiB; growth = after - before) and, with --json, written as JSON. Loopback only, bounded
in rounds and pairs, stops by itself.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.cri.methods import VERSION
from memqos_dev.testing.h2_storm import reset_storm
from memqos_dev.tools.bench.processes import Processes, proc_rss_mib
from memqos_dev.tools.bench.workload import REPO


def _call(path: str) -> float:
    """One Version call on a new connection; its time in ms (raises when not answered)."""
    from shim.transport.unary_client import UnaryClient

    client = UnaryClient(path)
    try:
        t0 = time.perf_counter()
        client.call(VERSION, b"", timeout=10)
        return (time.perf_counter() - t0) * 1000
    finally:
        client.close()


def export(ref: str, into: Path) -> Path:
    """The tree of ``ref`` written under ``into`` (git archive: the repository is only read)."""
    path = into / "baseline"
    path.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return path


def measure(procs: Processes, rounds: int, pairs: int, settle: float, with_data: bool) -> dict:
    out: dict = {}
    for name, sock in procs.socks.items():
        pid = procs.shims[name].pid
        _call(str(sock))
        time.sleep(0.5)
        row = {"before": proc_rss_mib(pid), "rounds": [], "storms": []}
        for _ in range(rounds):
            r = reset_storm(str(sock), pairs, with_data=with_data, timeout=120)
            row["storms"].append({"streams": r.streams, "seconds": round(r.seconds, 2),
                                  "closed_by_server": r.closed_by_server, "received": r.received})
            time.sleep(0.5)
            row["rounds"].append(proc_rss_mib(pid))
        time.sleep(settle)
        row["settled"] = proc_rss_mib(pid)
        row["call_after_ms"] = round(_call(str(sock)), 2)
        out[name] = row
    return out


def render(results: dict, rounds: int, pairs: int) -> str:
    head = ["shim", "before"] + [f"round {i + 1}" for i in range(rounds)] + ["settled", "growth", "call after"]
    lines = [f"RSS (MiB) through {rounds} rounds of {pairs} HEADERS+RST_STREAM pairs, one connection each",
             " | ".join(head), " | ".join("---" for _ in head)]
    for name, r in results.items():
        cells = [name, f"{r['before']:.1f}"] + [f"{v:.1f}" for v in r["rounds"]]
        cells += [f"{r['settled']:.1f}", f"{r['settled'] - r['before']:+.1f}", f"{r['call_after_ms']:.1f} ms"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/reset-storm", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="main", metavar="REF",
                   help="git ref whose relay is measured beside this tree's ('none': skip)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pairs", type=int, default=20000)
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the last round")
    p.add_argument("--no-data", action="store_true", help="HEADERS without the request's DATA before the reset")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not (1 <= args.rounds <= 20 and 1 <= args.pairs <= 200000):
        p.error("rounds 1..20, pairs 1..200000")
    work = Path(tempfile.mkdtemp(prefix="mqrs-"))
    sources = {}
    if args.baseline != "none":
        sources[f"relay@{args.baseline}"] = ("relay", export(args.baseline, work))
    sources["relay"] = ("relay", REPO)
    procs = Processes(list(sources), sources)
    try:
        procs.start()
        results = measure(procs, args.rounds, args.pairs, args.settle, not args.no_data)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(render(results, args.rounds, args.pairs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
