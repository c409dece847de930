"""Node facts read once at start: memory capacity, the KubeletConfiguration, cgroup v2."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from shim.decision import NodeFacts
from shim.decision.quantity import QuantityError, parse_bytes

log = logging.getLogger(__name__)

DEFAULT_FACTOR = 0.9
# the kubelet's memoryReservationPolicy values: v1.36 None / TieredReservation, v1.38 proposal Hard / Soft
RESERVATION_POLICIES = ("None", "TieredReservation", "Hard", "Soft")


@dataclass(frozen=True)
class KubeletFacts:
    """The KubeletConfiguration fields the shim uses (reference section 3)."""

    source: str = ""  # path, "trace header", or "" when none was read
    cgroup_driver: str = "cgroupfs"
    cgroups_per_qos: bool = True
    cgroup_root: str = "/"
    kube_reserved: int = 0
    system_reserved: int = 0
    kube_reserved_cgroup: str = ""
    system_reserved_cgroup: str = ""
    enforce_node_allocatable: tuple[str, ...] = ("pods",)
    memory_throttling_factor: float | None = None  # None: not in the file
    memory_qos_gate: bool | None = None  # featureGates.MemoryQoS, None: not set
    # memoryReservationPolicy (v1.36+): None, TieredReservation (v1.38 proposal: Hard, Soft);
    # None here: not in the file
    memory_reservation_policy: str | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)


def _reserved_memory(section: Any, name: str, problems: list[str]) -> int:
    if section is None:
        return 0
    if not isinstance(section, Mapping):
        problems.append(f"{name} is not a map")
        return 0
    raw = section.get("memory")
    if raw is None:
        return 0
    try:
        return parse_bytes(raw)
    except QuantityError as e:
        problems.append(f"{name}.memory: {e}")
        return 0


def kubelet_facts_from_dict(doc: Any, source: str) -> KubeletFacts:
    problems: list[str] = []
    if not isinstance(doc, Mapping):
        return KubeletFacts(source=source, problems=("not a KubeletConfiguration map",))
    driver = doc.get("cgroupDriver", "cgroupfs")
    if driver not in ("cgroupfs", "systemd"):
        problems.append(f"unknown cgroupDriver {driver!r}; assuming cgroupfs")
        driver = "cgroupfs"
    factor = doc.get("memoryThrottlingFactor")
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            problems.append(f"memoryThrottlingFactor {factor!r} is outside (0, 1]; ignored")
            factor = None
        else:
            factor = float(factor)
    gates = doc.get("featureGates") or {}
    gate = gates.get("MemoryQoS") if isinstance(gates, Mapping) else None
    reservation = doc.get("memoryReservationPolicy")
    if reservation is not None and reservation not in RESERVATION_POLICIES:
        problems.append(f"memoryReservationPolicy {reservation!r} is not one of {list(RESERVATION_POLICIES)}; "
                        "ignored")
        reservation = None
    enforce = doc.get("enforceNodeAllocatable", ["pods"])
    if not isinstance(enforce, list):
        problems.append("enforceNodeAllocatable is not a list")
        enforce = ["pods"]
    return KubeletFacts(
        source=source,
        cgroup_driver=driver,
        cgroups_per_qos=bool(doc.get("cgroupsPerQOS", True)),
        cgroup_root=str(doc.get("cgroupRoot") or "/"),
        kube_reserved=_reserved_memory(doc.get("kubeReserved"), "kubeReserved", problems),
        system_reserved=_reserved_memory(doc.get("systemReserved"), "systemReserved", problems),
        kube_reserved_cgroup=str(doc.get("kubeReservedCgroup") or ""),
        system_reserved_cgroup=str(doc.get("systemReservedCgroup") or ""),
        enforce_node_allocatable=tuple(str(x) for x in enforce),
        memory_throttling_factor=factor,
        memory_qos_gate=bool(gate) if isinstance(gate, bool) else None,
        memory_reservation_policy=reservation,
        problems=tuple(problems),
    )


def load_kubelet_config(path: str | None) -> KubeletFacts:
    """Read a KubeletConfiguration file. A missing or broken file is not fatal: the
    shim must start (it is the kubelet's only runtime endpoint); the problem is logged
    and kept in `problems`."""
    if not path:
        return KubeletFacts()
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        return KubeletFacts(problems=(f"{path}: not found; using defaults",))
    except (OSError, yaml.YAMLError) as e:
        return KubeletFacts(problems=(f"{path}: unreadable ({e.__class__.__name__}: {e}); using defaults",))
    return kubelet_facts_from_dict(doc, path)


def read_mem_total(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                parts = line.split()
                value = int(parts[1])
                unit = parts[2] if len(parts) > 2 else "kB"
                if unit != "kB":
                    raise ValueError(f"unexpected MemTotal unit {unit!r}")
                return value * 1024
    raise ValueError(f"no MemTotal in {meminfo}")


def is_cgroup_v2(cgroup_root: str) -> bool:
    """cgroup v2 (unified hierarchy) mounted at cgroup_root."""
    return os.path.isfile(os.path.join(cgroup_root, "cgroup.controllers"))


def system_page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def node_facts(
    capacity: int,
    kubelet: KubeletFacts,
    *,
    page_size: int,
    allocatable: int | None = None,
    factor: float | None | str = "auto",
    headroom_ratio: float = 0.1,
    headroom_min: int = 8 * 1024 * 1024,
    correct_kubelet_min: bool = False,
) -> NodeFacts:
    """Combine the inputs. factor "auto": the kubelet's memoryThrottlingFactor when its
    configuration sets one, else 0.9; None: no memory.high. headroom_*: how far a container's
    memory.min stays under its limit (settings protection-headroom-ratio / -min)."""
    if allocatable is None:
        allocatable = max(0, capacity - kubelet.kube_reserved - kubelet.system_reserved)
    if factor == "auto":
        factor = kubelet.memory_throttling_factor
        if factor is None:
            factor = DEFAULT_FACTOR
    return NodeFacts(capacity=capacity, allocatable=allocatable, page_size=page_size, factor=factor,
                     headroom_ratio=headroom_ratio, headroom_min=headroom_min,
                     correct_kubelet_min=correct_kubelet_min)
