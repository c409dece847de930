"""A/B of two versions of the shim in one run (``scripts/bench-ab REF_A REF_B``).

Each git ref is checked out into a temporary worktree and served by its own ``memqos-shim
serve --transport relay`` process in front of one shared fake runtime (``shim.bench
upstream``); the client alternates every call between direct, A and B, so the machine's drift
hits all three alike. Reported per block, then as medians over the blocks, added over direct:
small call p50, a CreateContainer that is rewritten, a passthrough call of the same size, and
the rewrite's extra cost (the difference of the last two). This is how a change to the
rewrite path is judged on a noisy machine: its effect is often smaller than the spread
between two ``scripts/bench`` runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.bench import (
    CREATE_CONTAINER,
    DEFAULT_TRACE,
    QUICK,
    REPO,
    VERSION,
    Client,
    padded,
    pct,
    prepare,
)

MiB = 1 << 20


def _worktree(ref: str, into: Path) -> Path:
    path = into / ref.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    return path


def _serve(src: Path, sock: Path, upstream: Path, work: Path, tag: str) -> subprocess.Popen:
    cg = work / f"cgroup-{tag}"
    cg.mkdir()
    (cg / "cgroup.controllers").write_text("cpu memory pids\n")
    (work / "meminfo").write_text(f"MemTotal: {16 * 1024 * 1024} kB\n")
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}", "--upstream", f"unix://{upstream}",
         "--kubelet-config", "none", "--cgroup-root", str(cg), "--meminfo", str(work / "meminfo"),
         "--page-size", "4096", "--audit-log", str(work / f"audit-{tag}.jsonl"), "--reconcile", "false",
         "--monitor-interval", "0", "--log-level", "warning", "--transport", "relay"],
        cwd=str(src), env=env, stdout=open(work / f"shim-{tag}.log", "w"), stderr=subprocess.STDOUT)


def run(ref_a: str, ref_b: str, blocks: int, calls: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mqab-"))
    trees: list[Path] = []
    procs: list[subprocess.Popen] = []
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        up = subprocess.Popen([sys.executable, "-m", "shim.bench", "upstream", "--listen", str(work / "rt.sock")],
                              stdout=subprocess.PIPE, stderr=open(work / "upstream.log", "w"), text=True, env=env)
        procs.append(up)
        if "listening" not in up.stdout.readline():
            raise RuntimeError(f"bench upstream did not start: {(work / 'upstream.log').read_text()}")
        targets = {"direct": f"unix://{work / 'rt.sock'}"}
        for tag, ref in (("A", ref_a), ("B", ref_b)):
            src = REPO if ref == "WORKTREE" else _worktree(ref, work)
            if src != REPO:
                trees.append(src)
            sock = work / f"{tag}.sock"
            procs.append(_serve(src, sock, work / "rt.sock", work, tag))
            targets[tag] = f"unix://{sock}"
        deadline = time.monotonic() + 60
        for tag in ("A", "B"):
            while not (work / f"{tag}.sock").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shim {tag} did not start: {(work / f'shim-{tag}.log').read_text()}")
                time.sleep(0.05)
        client = Client(targets)
        client.wait_ready()
        w = prepare(targets["direct"], QUICK, DEFAULT_TRACE)
        client.alternate(VERSION, lambda i, n: b"", 300)
        template = w.create_template
        pad = padded(template.ByteSize())
        counter = [0]

        def create_req(i: int, name: str) -> bytes:
            counter[0] += 1
            template.config.metadata.attempt = counter[0]
            return template.SerializeToString()

        per = {t: {"small": [], "create": [], "passthrough": [], "rewrite_extra": []} for t in ("A", "B")}
        for b in range(blocks):
            lc = client.alternate(CREATE_CONTAINER, create_req, calls)
            lp = client.alternate(VERSION, lambda i, n: pad, calls)
            ls = client.alternate(VERSION, lambda i, n: b"", calls)
            for t in ("A", "B"):
                c = (pct(lc[t], 50) - pct(lc["direct"], 50)) * 1e6
                p = (pct(lp[t], 50) - pct(lp["direct"], 50)) * 1e6
                per[t]["create"].append(c)
                per[t]["passthrough"].append(p)
                per[t]["rewrite_extra"].append(c - p)
                per[t]["small"].append((pct(ls[t], 50) - pct(ls["direct"], 50)) * 1e6)
            print(f"  block {b + 1}/{blocks}: rewrite extra A {per['A']['rewrite_extra'][-1]:.0f} us, "
                  f"B {per['B']['rewrite_extra'][-1]:.0f} us", file=sys.stderr)
        client.close()
        return {"A": ref_a, "B": ref_b, "blocks": blocks, "calls_per_block": calls,
                "median": {t: {k: statistics.median(v) for k, v in per[t].items()} for t in per},
                "blocks_us": per}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for t in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(t)], check=False)


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
    for key, label in (("small", "small call"), ("create", "CreateContainer (rewritten)"),
                       ("passthrough", "same-size passthrough"), ("rewrite_extra", "rewrite extra over passthrough")):
        print(f"| {label} | {m['A'][key]:+.0f} | {m['B'][key]:+.0f} | {m['B'][key] - m['A'][key]:+.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
