"""`scripts/soak` and ``python -m memqos_dev.tools.soak upstream`` (see the package docstring)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import time

import memqos_dev.tools.soak
from memqos_dev.tools.soak.checks import CLASSES, LOST, MANGLED, Expect, Tally
from memqos_dev.tools.soak.driver import Context, PodWorker, Poller
from memqos_dev.tools.soak.stack import Faults, Stack
from memqos_dev.tools.soak.upstream import run_upstream

PROBES_MODULE = "memqos_dev.tools.h2_limits"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak", description=memqos_dev.tools.soak.__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200_000, help="calls to make in all (default 200000)")
    p.add_argument("--warmup", type=int, default=20_000,
                   help="calls before the first RSS reading (default 20000)")
    p.add_argument("--kill-every", type=float, default=10.0, metavar="K",
                   help="kill the runtime (SIGKILL) every K seconds and start it again; 0: never (default 10)")
    p.add_argument("--down", type=float, default=0.5, help="seconds the runtime stays down (default 0.5)")
    p.add_argument("--clients", type=int, default=4, help="pod workers, one grpcio channel each (default 4)")
    p.add_argument("--poller", type=int, default=1, choices=(0, 1),
                   help="1: also relist through the shim's UnaryClient (default 1)")
    p.add_argument("--polls", type=int, default=2, help="status polls per pod (default 2)")
    p.add_argument("--deadline", type=float, default=15.0, help="per-call deadline; no answer = lost (default 15)")
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds after the runtime is back during which UNAVAILABLE still counts as the outage's")
    p.add_argument("--backoff", type=float, default=0.2, help="a client's pause after an UNAVAILABLE (default 0.2)")
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop after this long whatever the count")
    p.add_argument("--max-growth-mib", type=float, default=8.0, help="RSS growth per 100k calls that fails the run")
    p.add_argument("--probes", action="store_true", help="run the HTTP/2 limit probes against the shim afterwards")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, audit, cgroup tree)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["upstream"]:
        p = argparse.ArgumentParser(prog="python -m memqos_dev.tools.soak upstream")
        p.add_argument("--listen", required=True)
        return run_upstream(p.parse_args(argv[1:]).listen)
    args = parse_args(argv)
    return run(args)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    stack = Stack()
    stack.prepare()
    faults = None
    failures: list[str] = []
    try:
        stack.start_upstream()
        stack.start_shim()
        log(f"soak: memqos-shim serve (pid {stack.shim.pid}) in {stack.dir}")
        faults = Faults(stack, args.kill_every, args.down)
        tally = Tally()
        t_start = time.monotonic()
        ctx = Context(target=f"unix://{stack.shim_sock}", cgroot=stack.cgroot, expect=Expect(stack), faults=faults,
                      tally=tally, calls=args.calls, deadline=args.deadline, grace=args.grace, backoff=args.backoff,
                      end_at=t_start + args.max_seconds)
        workers = [PodWorker(ctx, i, args.polls) for i in range(args.clients)]
        if args.poller:
            workers.append(Poller(ctx))
        faults.start()
        for w in workers:
            w.start()
        rss_start = stack.shim_rss_kib()
        warm = half = None  # (calls, RSS KiB, seconds) after warm-up, half-way from there
        last_log = time.monotonic()
        rss_max = rss_start
        while any(w.is_alive() for w in workers):
            time.sleep(0.2)
            n = tally.total
            rss = stack.shim_rss_kib()
            if warm is None and n >= args.warmup:
                warm = (n, rss, time.monotonic() - t_start)
            if half is None and n >= (args.warmup + args.calls) / 2:
                half = (n, rss, time.monotonic() - t_start)
            if warm is not None:
                rss_max = max(rss_max, rss)
            if not stack.shim_alive():
                failures.append(f"the shim exited ({stack.shim.returncode}): {stack.shim_log_tail(800)}")
                ctx.stop.set()
            if faults.error:
                failures.append(f"the runtime did not restart: {faults.error}")
                ctx.stop.set()
            if time.monotonic() - last_log >= 10:
                last_log = time.monotonic()
                log(f"  {n} calls, {time.monotonic() - t_start:.0f} s, {len(faults.windows)} outages, "
                    f"RSS {rss / 1024:.1f} MiB, " + ", ".join(f"{c} {tally.counts[c]}" for c in CLASSES[1:]))
        elapsed = time.monotonic() - t_start
        faults.stop()
        for w in workers:
            w.join(args.deadline + 5)
            if w.error:
                failures.append(f"{w.name} stopped: {w.error}")
        if stack.upstream is None or stack.upstream.poll() is not None:
            stack.start_upstream()
        time.sleep(1.0)  # let the audit writer and the reconciler catch up before the last reading
        rss_end = stack.shim_rss_kib()
        summary(args, tally, faults, stack, rss_start, warm, half, rss_end, rss_max, elapsed, failures)
        if args.probes and not run_probes(stack):
            return 1
        if tally.counts[LOST] or tally.counts[MANGLED] or failures:
            return 1
        if warm is None or growth_per_100k(warm, rss_end, tally.total) >= args.max_growth_mib:
            return 1
        return 0
    finally:
        if faults is not None and faults.is_alive():
            faults.stop()
        stack.stop(keep=args.keep)
        if args.keep:
            log(f"soak: files kept in {stack.dir}")


def growth_per_100k(warm: tuple, rss_end: int, calls: int) -> float:
    n0, rss0, _ = warm
    return (rss_end - rss0) / 1024 / max(1, calls - n0) * 100_000


def summary(args, tally: Tally, faults: Faults, stack: Stack, rss_start: int, warm, half, rss_end: int,
            rss_max: int, elapsed: float, failures: list[str]) -> None:
    c = tally.counts
    rows = [
        ("clients", f"{args.clients} grpcio" + (" + 1 UnaryClient poller" if args.poller else "")),
        ("calls", f"{tally.total} in {elapsed:.0f} s ({tally.total / max(elapsed, 1e-9):.0f}/s)"),
        ("answered as the runtime answered", f"{c['ok']} (rewrites checked against shim.decision: "
                                             f"{tally.rewrites_checked})"),
        ("unavailable during outages", str(c["unavailable"])),
        ("NOT_FOUND, object lost or removed", str(c["stale"])),
        ("lost (no answer in time)", str(c["lost"])),
        ("mangled", str(c["mangled"])),
        ("outages (runtime killed)", f"{len(faults.windows)} (every {args.kill_every:g} s, down {args.down:g} s)"),
        ("shim RSS at start", f"{rss_start / 1024:.1f} MiB"),
    ]
    if warm is not None:
        n0, rss0, t0 = warm
        g = growth_per_100k(warm, rss_end, tally.total)
        rows += [
            ("shim RSS after warm-up", f"{rss0 / 1024:.1f} MiB (after {n0} calls, {t0:.0f} s)"),
            ("shim RSS at the end", f"{rss_end / 1024:.1f} MiB (highest after warm-up {rss_max / 1024:.1f} MiB)"),
            ("RSS growth per 100k calls", f"{g:+.2f} MiB over {tally.total - n0} calls "
                                          f"(limit {args.max_growth_mib:g} MiB)"),
        ]
        if half is not None and tally.total > half[0]:
            rows.append(("  over the second half", f"{growth_per_100k(half, rss_end, tally.total):+.2f} MiB "
                                                   f"({half[1] / 1024:.1f} MiB after {half[0]} calls)"))
    else:
        rows.append(("RSS after warm-up", f"not reached ({args.warmup} calls)"))
    width = max(len(k) for k, _ in rows)
    print("\nsoak summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    per_method = sorted({m for m, _ in tally.by_method})
    print("\n  per method: " + "; ".join(
        f"{m} " + "/".join(str(tally.by_method.get((m, cl), 0)) for cl in CLASSES) for m in per_method)
          + "  (ok/unavailable/stale/lost/mangled)")
    for cl in (MANGLED, LOST):
        for ex in tally.examples.get(cl, []):
            print(f"  {cl}: {ex}")
    for f in failures:
        print(f"  FAILED: {f}")


def run_probes(stack: Stack) -> bool:
    """The HTTP/2 limit probes (``memqos_dev.tools.h2_limits.run_probes``) against this shim, when the
    tree has them: their arguments are matched by name to what the soak knows. False if they
    raised."""
    print()
    if importlib.util.find_spec(PROBES_MODULE) is None:
        print("h2 limit probes: not available in this tree")
        return True
    mod = importlib.import_module(PROBES_MODULE)
    known = {"socket": str(stack.shim_sock), "shim_socket": str(stack.shim_sock), "path": str(stack.shim_sock),
             "target": f"unix://{stack.shim_sock}", "listen": f"unix://{stack.shim_sock}",
             "address": f"unix://{stack.shim_sock}", "pid": stack.shim.pid, "shim_pid": stack.shim.pid,
             "upstream": f"unix://{stack.runtime_sock}"}
    params = inspect.signature(mod.run_probes).parameters
    kwargs = {k: v for k, v in known.items() if k in params}
    try:
        result = mod.run_probes(**kwargs)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        print(f"h2 limit probes failed: {e.__class__.__name__}: {e}")
        return False
    if isinstance(result, str):
        print(result)
    elif result is not None:
        for row in result:
            print("  " + ("  ".join(str(x) for x in row) if isinstance(row, (tuple, list)) else str(row)))
    return True


if __name__ == "__main__":
    raise SystemExit(main())
