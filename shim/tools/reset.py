"""`memqos-shim reset`: set every memory.min / memory.low the shim manages back to 0.

For turning the feature off. What the shim manages at pod, QoS and node level: the kubepods
cgroup, the burstable and besteffort QoS cgroups, every pod cgroup below them, and the
kube-reserved / system-reserved cgroups when the KubeletConfiguration enforces them and names
them (memory.min only there). Values are lowered bottom-up (pods, then QoS cgroups, then
kubepods and the reserved cgroups) and only where they are not 0 already; every write is
audited like the reconciler's. Container cgroups are not touched: their values came through
the runtime (CRI ``unified``), and with kubepods at 0 the kernel gives them no protection
anyway (a child's effective memory.min/low is capped by its ancestors').

Stop the shim first, or run it with ``--policy none`` / ``--reconcile false``: a running
shim with a protecting policy puts the values back at its next resync.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from shim.app.config import OPTIONS, ConfigError, add_arguments, resolve
from shim.decision import QoSClass
from shim.effects import MANAGED_FILES, CgroupFS, CgroupLayout, PathRefused, Write, detect_driver
from shim.effects.layout import POD_DIR
from shim.effects.systemd import CgroupWriter
from shim.node.facts import KubeletFacts, is_cgroup_v2, load_kubelet_config

log = logging.getLogger(__name__)

RESET_OPTIONS = tuple(o for o in OPTIONS if o.name in ("cgroup-root", "kubelet-config", "kubelet-version", "audit-log",
                                                       "audit-max-bytes", "audit-keep", "log-level",
                                                       "systemd-writes"))


def _subdirs(fs: CgroupFS, rel: str) -> list[str]:
    try:
        entries = list(os.scandir(fs.abspath(rel)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))


def managed_cgroups(fs: CgroupFS, layout: CgroupLayout, reserved: list[str]) -> list[tuple[int, str]]:
    """(level, path) of every cgroup the shim manages that exists, bottom-up order."""
    kp = layout.kubepods
    qos_dirs = [q for q in (layout.qos(QoSClass.BURSTABLE), layout.qos(QoSClass.BESTEFFORT)) if q]
    pods = []
    for parent in [kp, *qos_dirs]:
        for name in _subdirs(fs, parent):
            if POD_DIR.match(name):
                pods.append((2, f"{parent}/{name}"))
    out = sorted(pods, key=lambda p: p[1])
    out += [(1, q) for q in qos_dirs]
    out += [(0, kp)] + [(0, r) for r in reserved]
    return out


def reset_cgroups(cgroup_root: str, kubelet: KubeletFacts, emit, *, dry_run: bool = False,
                  kubelet_version: tuple[int, int] | None = None, systemd_writes: str = "cgroupfs",
                  bus=None) -> tuple[list[Write], list[str], list[str]]:
    """Set every managed value to 0, bottom-up. Returns (writes, notes, errors). Values the
    kubelet writes itself (its MemoryQoS configured to protect requests, shim.node.kubelet)
    are the kubelet's: reset leaves them alone and says so. Through systemd on a systemd node
    (``systemd_writes``, as ``serve``): a 0 written to cgroupfs there would be replaced by
    systemd's MemoryMin/MemoryLow at its next daemon-reload."""
    from shim.node.kubelet import fmt_version, kubelet_writes

    problems: list[str] = []
    writes_of_kubelet = kubelet_writes(kubelet, kubelet_version)
    if writes_of_kubelet.writes_protection:
        return [], [f"the kubelet writes the pod / QoS / node values itself ({writes_of_kubelet.summary()}; "
                    f"version {fmt_version(kubelet_version)}): nothing to reset"], []
    if not is_cgroup_v2(cgroup_root):
        return [], [f"{cgroup_root} is not a cgroup v2 hierarchy: the shim writes nothing there"], []
    driver = kubelet.cgroup_driver if kubelet.source else detect_driver(cgroup_root, kubelet.cgroup_root)
    if driver is None:
        return [], [f"no kubepods cgroup under {cgroup_root}: nothing to reset"], []
    layout = CgroupLayout(driver, kubelet.cgroup_root)
    reserved = []
    for kind, name in (("kube-reserved", kubelet.kube_reserved_cgroup),
                       ("system-reserved", kubelet.system_reserved_cgroup)):
        if kind in kubelet.enforce_node_allocatable and name:
            try:
                reserved.append(layout.reserved(name))
            except PathRefused as e:
                problems.append(f"{kind} cgroup refused: {e}")
    fs = CgroupWriter(cgroup_root, [layout.kubepods, *reserved], emit=emit, dry_run=dry_run, mode=systemd_writes,
                      bus=bus)
    fs.set_driver(driver, reserved)
    writes: list[Write] = []
    try:
        for level, path in managed_cgroups(fs, layout, reserved):
            files = ("memory.min",) if path in reserved else MANAGED_FILES
            for file in files:
                try:
                    w = fs.write(path, file, 0, "memqos-shim reset", level=level, extra={"trigger": "reset"})
                except FileNotFoundError:
                    continue
                except PathRefused as e:
                    problems.append(f"{path}: refused: {e}")
                    continue
                except OSError as e:
                    problems.append(f"{path}/{file}: {e}")
                    continue
                if w is not None:
                    writes.append(w)
    finally:
        if bus is None:  # the writer's own connection to systemd
            fs.close()
    return writes, [], problems


def cmd_reset(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args, RESET_OPTIONS)
    except ConfigError as e:
        print(f"memqos-shim reset: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from shim.app.config_unused import unused_note

    if (note := unused_note("reset", args.config, RESET_OPTIONS)) is not None:
        print(f"memqos-shim reset: {note}", file=sys.stderr)
    from shim.evidence.audit import AuditLog

    kubelet = load_kubelet_config(cfg.kubelet_config)
    for problem in kubelet.problems:
        log.warning("kubelet config: %s", problem)
    audit = AuditLog(cfg.audit_log, max_bytes=cfg.audit_max_bytes, keep=cfg.audit_keep).start()
    try:
        from shim.node.kubelet import detect_kubelet_version

        version, _ = detect_kubelet_version(cfg.kubelet_version)
        writes, notes, errors = reset_cgroups(cfg.cgroup_root, kubelet, audit.emit, dry_run=args.dry_run,
                                              kubelet_version=version, systemd_writes=cfg.systemd_writes)
    finally:
        audit.close()
    for p in notes + errors:
        print(f"memqos-shim reset: {p}", file=sys.stderr)
    verb = "would set" if args.dry_run else "set"
    print(f"memqos-shim reset: {verb} {len(writes)} value(s) to 0", file=sys.stderr)
    return 1 if errors else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("reset", help="set every pod/QoS/node memory.min and memory.low the shim manages to 0",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, RESET_OPTIONS)
    p.add_argument("--dry-run", action="store_true", help="only say what would be written")
    p.set_defaults(func=cmd_reset)
