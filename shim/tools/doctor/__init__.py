"""`memqos-shim doctor`: is this node ready for the shim, and is the shim set up right?

Every check prints one line, PASS / WARN / FAIL, then what it saw and what to do; SKIP when
a check it depends on FAILed (the guard and reclaim without cgroup v2's memory controller). A check
never crashes the command: an unexpected error is that check's FAIL with the reason. Exit
code 0 when nothing failed, 1 otherwise.

The settings are the ones `serve` would run with: the same flags, ``--config FILE``, and
without it /etc/memqos-shim/config.yaml when that file exists (the systemd unit's config).
"""
from __future__ import annotations

import argparse
import os
import sys

from shim.tools.doctor.classes import ClassChecks
from shim.tools.doctor.common import FAIL, PASS, SKIP, WARN, Env, Result, kernel_version
from shim.tools.doctor.kubelet import KubeletChecks
from shim.tools.doctor.node import NodeChecks
from shim.tools.doctor.nri import NriChecks
from shim.tools.doctor.protection import ProtectionChecks
from shim.tools.doctor.service import ShimChecks
from shim.tools.doctor.swap import SwapChecks

__all__ = ["DEFAULT_CONFIG", "FAIL", "PASS", "SKIP", "WARN", "Doctor", "Env", "Result", "cmd_doctor", "format_results",
           "kernel_version", "register", "skip_without_preconditions"]

DEFAULT_CONFIG = "/etc/memqos-shim/config.yaml"


class Doctor(NodeChecks, KubeletChecks, SwapChecks, ProtectionChecks, ShimChecks, ClassChecks, NriChecks):
    """Every check of `memqos-shim doctor`, in the order they print."""

    CHECKS = ("check_kernel", "check_psi", "check_cgroup_v2", "check_memory_controller", "check_kubelet_config",
              "check_swap", "check_kubelet_swap", "check_protection", "check_kubelet_endpoint", "check_upstream",
              "check_socket", "check_audit_log", "check_guard", "check_metrics", "check_reclaim", "check_classes",
              "check_nri")

    # a check that cannot pass while one of these failed: its pass would say nothing
    PRECONDITIONS = {
        "memory controller": ("kernel", "cgroup v2"),
        "memory.high guard": ("kernel", "cgroup v2", "memory controller"),
        "proactive reclaim": ("kernel", "cgroup v2", "memory controller"),
    }

    def run(self) -> list[Result]:
        out: list[Result] = []
        for attr in self.CHECKS:
            name = attr.removeprefix("check_").replace("_", " ")
            try:
                r = getattr(self, attr)()
            except Exception as e:  # a check must never take the command down
                r = Result(name, FAIL, f"the check itself failed: {e.__class__.__name__}: {e}")
            out.extend(r if isinstance(r, list) else [r])
        return skip_without_preconditions(out, self.PRECONDITIONS)


def skip_without_preconditions(results: list[Result], preconditions: dict[str, tuple[str, ...]]) -> list[Result]:
    """A PASS whose precondition FAILed becomes SKIP ("not checked: ..."); a WARN or FAIL stays:
    what it says holds whatever the precondition."""
    failed = {r.name: r for r in results if r.verdict == FAIL}
    out = []
    for r in results:
        missing = [name for name in preconditions.get(r.name, ()) if name in failed]
        if r.verdict == PASS and missing:
            r = Result(r.name, SKIP, f"not checked: {' and '.join(missing)} failed (above)")
        out.append(r)
    return out


# -- command -------------------------------------------------------------------------------
def format_results(results: list[Result], header: str = "") -> str:
    lines = [header] if header else []
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        lines.append(f"{r.verdict.upper():4}  {r.name:<{width}}  {r.summary}")
        for d in r.details:
            lines.append(f"{'':4}  {'':<{width}}    {d}")
    n = {v: sum(r.verdict == v for r in results) for v in (PASS, WARN, SKIP, FAIL)}
    lines.append(f"{n[PASS]} pass, {n[WARN]} warn, " + (f"{n[SKIP]} skip, " if n[SKIP] else "") + f"{n[FAIL]} fail")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace, env: Env | None = None) -> int:
    from shim.app.config import Config, ConfigError, resolve

    note = ""
    if not getattr(args, "config", None) and os.path.isfile(DEFAULT_CONFIG):
        args.config = DEFAULT_CONFIG
    results: list[Result] = []
    try:
        cfg = resolve(args)
        note = f"config: {args.config}" if getattr(args, "config", None) else "config: built-in defaults and flags"
    except ConfigError as e:
        results.append(Result("config", FAIL, str(e), ["the checks below use the built-in defaults"]))
        cfg = Config()
        note = "config: unusable, defaults"
    try:
        results += Doctor(cfg, env).run()
    except Exception as e:  # never a traceback
        results.append(Result("doctor", FAIL, f"{e.__class__.__name__}: {e}"))
    print(format_results(results, f"memqos-shim doctor ({note})"))
    sys.stdout.flush()
    return 1 if any(r.verdict == FAIL for r in results) else 0


def register(subparsers) -> None:
    from shim.app.config import OPTIONS, add_arguments

    p = subparsers.add_parser(
        "doctor", help="check this node and the shim's setup (pass/warn/fail per check)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every flag of `memqos-shim serve` is taken too (`memqos-shim serve --help` lists them).")
    add_arguments(p, OPTIONS, listed=False)
    p.set_defaults(func=cmd_doctor)
