"""memqos-shim's command line: ``serve`` and ``nri`` (``shim.app.cli``), the operator's commands
(``shim.tools``: explain, replay, trace, reset, doctor, demo) and ``health``
(``shim.evidence.health``), each registered by the module that runs it."""
from __future__ import annotations

import argparse
import os
import sys

from shim import __version__
from shim.app.cli import register as register_front_ends


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
    register_front_ends(sub)
    for register in () if serve_only else _EXTRA_COMMANDS:
        register(sub)
    return p


def _register_trace_commands(sub) -> None:
    from shim.tools.replay import register as register_replay
    from shim.tools.trace_view import register as register_trace

    register_replay(sub)
    register_trace(sub)


def _register_explain(sub) -> None:
    from shim.tools.explain import register

    register(sub)


def _register_reset(sub) -> None:
    from shim.tools.reset import register

    register(sub)


def _register_doctor(sub) -> None:
    from shim.tools.doctor import register

    register(sub)


def _register_health(sub) -> None:
    from shim.evidence.health import add_arguments, run_check

    p = sub.add_parser("health", help="exit 0 when the running front end's heartbeat file is fresh "
                                      "(and with --ready, registered): the DaemonSet's exec probes")
    add_arguments(p)
    p.set_defaults(func=lambda args: run_check(args, sys.stdout))


def _register_demo(sub) -> None:
    from shim.tools.demo import register

    register(sub)


#: the commands beside serve and nri, in the order of --help
_EXTRA_COMMANDS: list = [_register_explain, _register_trace_commands, _register_reset, _register_doctor,
                         _register_health, _register_demo]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(serve_only=bool(argv) and argv[0] in ("serve", "nri"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (`memqos-shim doctor | head`): nothing more to say, and no
        # traceback; stdout points at /dev/null so the interpreter's final flush is quiet too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe ended
