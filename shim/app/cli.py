"""memqos-shim command line: serve, explain (more subcommands register themselves here)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Callable

from shim import __version__, decision
from shim.app.config import OPTIONS, ConfigError, add_arguments, file_only_note, resolve
from shim.decision.quantity import QuantityError, format_bytes, parse_bytes
from shim.transport.grpc_extra import grpc_missing

log = logging.getLogger("memqos-shim")

_QOS_PARENTS = {
    decision.QoSClass.GUARANTEED: "/kubepods/pod0000",
    decision.QoSClass.BURSTABLE: "/kubepods/burstable/pod0000",
    decision.QoSClass.BESTEFFORT: "/kubepods/besteffort/pod0000",
}


# -- serve ---------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args)
    except ConfigError as e:
        print(f"memqos-shim: {e}", file=sys.stderr)
        return 2
    if cfg.transport == "grpc" and (missing := grpc_missing("--transport grpc")):
        print(f"memqos-shim: {missing}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from shim.app.limits import raise_nofile_limit
    from shim.app.service import Service
    from shim.effects.files import UnsafeFile

    raise_nofile_limit(cfg.max_connections)
    hold_sighup()
    try:
        service = Service.from_config(cfg)
    except UnsafeFile as e:  # a symlink where the shim writes: a configuration problem
        print(f"memqos-shim: {e.strerror}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    return asyncio.run(_serve(service, config_path=args.config))


# -- nri -----------------------------------------------------------------------
def cmd_nri(args: argparse.Namespace) -> int:
    """The shim as an NRI plugin (shim.app.nri_front), from the same settings as serve."""
    try:
        cfg = resolve(args)
    except ConfigError as e:
        print(f"memqos-shim: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from shim.app.nri_front import NriService
    from shim.effects.files import UnsafeFile

    hold_sighup()
    try:
        service = NriService.from_config(cfg)
    except UnsafeFile as e:
        print(f"memqos-shim: {e.strerror}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    return asyncio.run(_serve(service, f"NRI plugin on {cfg.nri_socket}", config_path=args.config))


# -- SIGHUP --------------------------------------------------------------------
def sighup_actions(service) -> list[Callable[[], None]]:
    """What SIGHUP does, in this order. An action runs on the event loop (the signal's
    callback, not the handler itself) and only sets a flag or puts a mark on a queue: the
    work happens on the thread that owns it."""
    return [
        service.reopen_files,  # the audit log and the recorder, before their next record
    ]


def on_sighup(actions: list[Callable[[], None]]) -> None:
    """Run SIGHUP's actions; one that raises is logged and the others still run."""
    log.info("SIGHUP: %s", ", ".join(getattr(a, "__name__", repr(a)) for a in actions))
    for action in actions:
        try:
            action()
        except Exception:
            log.exception("SIGHUP: %r failed", action)


_early_sighup = False


def _remember_sighup(signum, frame) -> None:
    global _early_sighup
    _early_sighup = True


def hold_sighup() -> None:
    """From here until the event loop takes SIGHUP over, a SIGHUP (logrotate's, while the shim
    starts) is remembered and acted on then, instead of ending the process."""
    global _early_sighup
    _early_sighup = False
    signal.signal(signal.SIGHUP, _remember_sighup)


async def _serve(service, status: str = "", config_path: str | None = None) -> int:
    global _early_sighup
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hup = asyncio.Event()  # set by SIGHUP; the config file is read again by _on_sighup

    def reload_config() -> None:
        hup.set()

    actions = sighup_actions(service) + [reload_config]
    loop.add_signal_handler(signal.SIGHUP, on_sighup, actions)
    reloads = asyncio.ensure_future(_on_sighup(hup, service, config_path))
    if _early_sighup:
        _early_sighup = False
        on_sighup(actions)
    await service.start()
    sd_notify(f"READY=1\nSTATUS={status or f'serving on {service.cfg.listen}'}")
    await stop.wait()
    log.info("stopping")
    sd_notify("STOPPING=1")
    reloads.cancel()
    await service.stop()
    return 0


async def _on_sighup(hup: asyncio.Event, service, config_path: str | None) -> None:
    """Each SIGHUP: the config file's mode applied (shim.app.reload), in a worker thread so
    that the event loop never waits for the file."""
    from shim.app.reload import reload_mode

    while True:
        await hup.wait()
        hup.clear()
        try:
            await asyncio.to_thread(reload_mode, service, config_path)
        except Exception:  # noqa: BLE001 - a reload never stops the shim
            log.exception("SIGHUP: reload failed; the running settings are kept")


def sd_notify(state: str) -> bool:
    """Tell systemd (``Type=notify``: $NOTIFY_SOCKET) the service's state: READY=1 once the
    socket serves, so that a kubelet ordered after the shim starts only then. Without
    $NOTIFY_SOCKET nothing is sent; a failure is logged, never fatal."""
    import socket

    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr[0] == "@":  # an abstract socket
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd (%s): %s", addr.replace("\0", "@"), e)
        return False


# -- explain -------------------------------------------------------------------
def _policy_arg(v: str) -> str:
    try:
        return decision.Policy(v).value
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown policy {v!r}: Hard, Soft, TieredReservation, None "
                                         "(or request, tiered, none)") from None


def _explain_factor(v: str) -> float | None:
    if v.lower() == "none":
        return None
    f = float(v)
    if not 0 < f <= 1:
        raise ValueError("factor must be in (0, 1]")
    return f


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
        page = int(args.page_size) if args.page_size else os.sysconf("SC_PAGE_SIZE")
        if page <= 0:
            raise ValueError("page size must be positive")
        policy = decision.Policy(args.policy)  # already checked by argparse
    except (QuantityError, ValueError) as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    if limit and request > limit:  # the API server's validation: such a pod never reaches a node
        print(f"memqos-shim explain: request {args.request} is above limit {args.limit}: the API server refuses "
              f"such a container (resources.requests: Invalid value: must be less than or equal to memory "
              f"limit of {args.limit})", file=sys.stderr)
        return 2
    if args.qos:
        qos = {q.name.lower(): q for q in decision.QoSClass}[args.qos]
    elif limit > 0 and request == limit:
        qos = decision.QoSClass.GUARANTEED
    elif request == 0 and limit == 0:
        qos = decision.QoSClass.BESTEFFORT
    else:
        qos = decision.QoSClass.BURSTABLE
    node = decision.NodeFacts(capacity=allocatable, allocatable=allocatable, page_size=page, factor=factor)
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
        "reasons": dict(d.reasons),
        **({"notes": list(d.notes)} if d.notes else {}),
    }
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
    for note in d.notes:
        print(f"  note: {note}")
    return 0


def _explain_plot(args: argparse.Namespace) -> int:
    """--plot FILE.png: memory.high against request for the KEP's factors (and --factor), limit
    --limit (default 1000Mi), the v1.22 formula for contrast."""
    from shim.tools.plot import KEP_FACTORS, KEP_LIMIT, PlotUnavailable, write_plot

    try:
        limit = parse_bytes(args.limit) or KEP_LIMIT
        factor = _explain_factor(args.factor)
        page = int(args.page_size) if args.page_size else os.sysconf("SC_PAGE_SIZE")
        if page <= 0:
            raise ValueError("page size must be positive")
    except (QuantityError, ValueError) as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    factors = KEP_FACTORS + ((factor,) if factor is not None and factor not in KEP_FACTORS else ())
    try:
        write_plot(args.plot, limit=limit, factors=factors, page=page)
    except PlotUnavailable as e:
        print(f"memqos-shim explain: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"memqos-shim explain: cannot write {args.plot}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.plot}: memory.high against request, limit {format_bytes(limit)}, factors "
          f"{', '.join(f'{f:g}' for f in factors)}, v1.22 formula for contrast")
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


# -- wiring --------------------------------------------------------------------
def build_parser(*, serve_only: bool = False) -> argparse.ArgumentParser:
    """The command line; ``serve_only``: without the tools' commands (``serve`` does not import
    them, which keeps its start short)."""
    p = argparse.ArgumentParser(
        prog="memqos-shim",
        description="A CRI proxy between the kubelet and containerd/CRI-O that gives containers, pods "
                    "and the node memory QoS (memory.min / memory.high) on cgroup v2.",
        epilog="Run `memqos-shim COMMAND --help` for a command's options. Docs: README.md.")
    p.add_argument("--version", action="version", version=f"memqos-shim {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the CRI proxy", epilog=file_only_note())
    add_arguments(serve, OPTIONS)
    serve.set_defaults(func=cmd_serve)

    nri = sub.add_parser("nri", help="run as an NRI plugin of containerd / CRI-O (no kubelet change)",
                         epilog=file_only_note())
    add_arguments(nri, OPTIONS)
    nri.set_defaults(func=cmd_nri)

    ex = sub.add_parser("explain", help="show what the shim would put in unified, and why")
    ex.add_argument("--request", default="0", metavar="Q", help="memory request (quantity)")
    ex.add_argument("--limit", default="0", metavar="Q", help="memory limit (quantity, 0 = none)")
    ex.add_argument("--allocatable", default="0", metavar="Q", help="node allocatable memory (quantity)")
    ex.add_argument("--factor", default="0.9", metavar="F", help="throttling factor in (0, 1] or 'none'")
    ex.add_argument("--page-size", default=None, metavar="N", help="page size (default: the system's)")
    ex.add_argument("--qos", choices=["guaranteed", "burstable", "besteffort"],
                    help="QoS class (default: from request and limit)")
    ex.add_argument("--policy", default="Hard", type=_policy_arg, metavar="POLICY",
                    help="Hard (default), Soft, TieredReservation or None; also the aliases "
                         "request, tiered, none")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--table", action="store_true", help="print the KEP's comparison tables")
    ex.add_argument("--plot", metavar="FILE.png",
                    help="draw memory.high against request (KEP factors, v1.22 for contrast) to a PNG; "
                         "needs the [plot] extra (matplotlib)")
    ex.set_defaults(func=cmd_explain)

    for register in () if serve_only else _EXTRA_COMMANDS:
        register(sub)
    return p


def _register_trace_commands(sub) -> None:
    from shim.tools.replay import register as register_replay
    from shim.tools.trace_view import register as register_trace

    register_replay(sub)
    register_trace(sub)


_EXTRA_COMMANDS: list = [_register_trace_commands]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(serve_only=bool(argv) and argv[0] in ("serve", "nri"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


def _register_reset(sub) -> None:
    from shim.tools.reset import register

    register(sub)


_EXTRA_COMMANDS.append(_register_reset)


def _register_doctor(sub) -> None:
    from shim.tools.doctor import register

    register(sub)


_EXTRA_COMMANDS.append(_register_doctor)


def _register_health(sub) -> None:
    from shim.evidence.health import add_arguments, run_check

    p = sub.add_parser("health", help="exit 0 when the running front end's heartbeat file is fresh "
                                      "(and with --ready, registered): the DaemonSet's exec probes")
    add_arguments(p)
    p.set_defaults(func=lambda args: run_check(args, sys.stdout))


_EXTRA_COMMANDS.append(_register_health)


def _register_demo(sub) -> None:
    from shim.tools.demo import register

    register(sub)


_EXTRA_COMMANDS.append(_register_demo)
