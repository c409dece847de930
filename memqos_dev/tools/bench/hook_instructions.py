"""`scripts/bench-instructions`: the rewrite hook's cost in instructions, two versions side by side.

A change to the rewrite path is often smaller than the noise of a timed A/B on this machine.
Instructions are not: ``valgrind --tool=callgrind`` counts the same for the same code and input
whatever else the machine does. Each version runs a Burstable CreateContainer through the hooks
as ``serve`` builds them, in-process: the path before the request goes upstream (the call object
and ``rewrite()``), and that path with ``finished()`` and the runtime's answer. The count per call
is the difference between a run of 3N calls and one of N, divided by 2N (imports and set-up
cancel out).

The measured code is :func:`one_call`, run in a subprocess whose ``sys.path`` starts at the
version's tree; it also knows the older hook API (``rewrite(method, bytes)``, whose
rewriter kept each call's record in a dict until ``finished()``: the "rewrite" path there empties
that dict after each call, as ``finished()`` would, at the cost of one ``clear()``).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from memqos_dev.tools.bench_ab import remove_worktrees, worktree
from memqos_dev.tools.bench.workload import REPO

MODES = ("rewrite", "rewrite+finished")

# Runs inside the version's tree (``python -c``): argv = calls, mode.
PROBE = r'''
import sys
from shim.cri import pb
from shim.decision import Policy
try:
    try:
        from shim.app.service import build_container_qos
        from shim.container.chain import build_request_hooks
    except ImportError:  # a tree with the hook chain in the wiring room
        from shim.app.service import build_container_qos, build_request_hooks
    from shim.node.facts import load_kubelet_config, node_facts
    from shim.transport.hooks import RpcCall
    try:
        from shim.tools import kubelet_requests as kr
    except ImportError:  # a tree with the stand-ins inside the package
        from shim.testing import kubelet_requests as kr
except ImportError:  # a tree without the rooms (shim/app, shim/node, ...)
    RpcCall = None
    from shim.service import build_container_qos, build_request_hooks
    from shim.node import load_kubelet_config, node_facts
    from shim import kubelet_requests as kr
    from shim.transport.hooks import FinishedCall
M = "/runtime.v1.RuntimeService/CreateContainer"
MiB = 1 << 20
node = node_facts(16 * 1024 * MiB, load_kubelet_config(None), page_size=4096, allocatable=None, factor="auto")
hooks = build_request_hooks(build_container_qos(node, Policy("Hard"), lambda record: None))
sandbox = kr.sandbox_config("web", "1f0c2a9e-0000-4000-8000-000000000005", "burstable")
calls, mode = int(sys.argv[1]), sys.argv[2]
requests = []
for i in range(3000):
    m = kr.create_container("sb1", sandbox, "app", "burstable", request=128 * MiB, limit=256 * MiB)
    m.config.metadata.attempt = i
    requests.append(m.SerializeToString())
answer = [pb.CreateContainerResponse(container_id="c" * 64).SerializeToString()]
def one_call(r):
    if RpcCall is not None:
        call = RpcCall(M, 0.0, request=r)
        out = hooks.rewrite(call)
        if mode != "rewrite":
            hooks.finished(call.complete(1.0, out if out is not r else None, answer, "OK", ""))
    else:
        out = hooks.rewrite(M, r)
        if mode != "rewrite":
            hooks.finished(FinishedCall(M, 0.0, 1.0, r, out if out is not r else None, answer, "OK", ""))
        else:  # finished() would take the entry out: keep the dict as small as in the running shim
            hooks.rewriter._pending.clear()
for r in requests[:300]:
    one_call(r)
for r in requests[:calls]:
    one_call(r)
'''


def instructions(tree: Path, calls: int, mode: str, work: Path) -> int:
    """Instructions callgrind counts for one run of ``calls`` calls in ``tree``."""
    out = work / f"cg-{tree.name}-{calls}-{mode.replace('+', '_')}"
    p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c",
                        f"import sys; sys.path.insert(0, {str(tree)!r}); exec({PROBE!r})", str(calls), mode],
                       cwd=tree, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"callgrind run in {tree} failed:\n{p.stderr[-2000:]}")
    for line in p.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1])
    raise RuntimeError(f"no instruction count in callgrind's output:\n{p.stderr[-2000:]}")


def per_call(tree: Path, calls: int, mode: str, work: Path) -> float:
    return (instructions(tree, 3 * calls, mode, work) - instructions(tree, calls, mode, work)) / (2 * calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench-instructions", description=__doc__.split("\n\n")[0])
    p.add_argument("ref_a", help="git ref of version A (WORKTREE: this checkout as it is)")
    p.add_argument("ref_b", nargs="?", default="WORKTREE", help="git ref of version B (default: WORKTREE)")
    p.add_argument("--calls", type=int, default=1000, help="N: runs of N and 3N calls (default 1000)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("scripts/bench-instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="mqinstr-"))
    trees: list[Path] = []
    try:
        sources = {}
        for tag, ref in (("A", args.ref_a), ("B", args.ref_b)):
            sources[tag] = REPO if ref == "WORKTREE" else worktree(ref, work)
            if sources[tag] != REPO:
                trees.append(sources[tag])
        print(f"memqos-shim bench-instructions: a Burstable CreateContainer through the hooks, in-process, "
              f"callgrind; instructions per call ((3N - N) / 2N, N = {args.calls})")
        print(f"| path | A: {args.ref_a} | B: {args.ref_b} | B / A |")
        print("|---|---|---|---|")
        for mode in MODES:
            a, b = (per_call(sources[t], args.calls, mode, work) for t in ("A", "B"))
            print(f"| {mode} | {a:,.0f} | {b:,.0f} | {b / a:.3f} |", flush=True)
    finally:
        remove_worktrees(trees)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
