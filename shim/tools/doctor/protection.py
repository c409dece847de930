"""Protection that never OOM-kills (docs/memory-qos.md): whether the kubelet writes a container
memory.min that can OOM-kill a pod, whether kubepods and the QoS cgroups leave room under their
memory.max, and whether cgroup2 is mounted with memory_recursiveprot."""
from __future__ import annotations

import os

from shim.decision import Policy
from shim.tools.doctor.common import PASS, WARN, CheckBase, Result, cgroup_mounts, read_text

DOC = "docs/memory-qos.md#protection-that-never-oom-kills"
MAX_CHILDREN = 10000  # cgroups read under one parent at most (a node has a few hundred pods)


def _bytes(path: str) -> int | None:
    """A memory.* file's value: bytes, None for "max", unreadable or not a number."""
    text = (read_text(path, 64) or "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def children_min(cgroup: str) -> tuple[int, int]:
    """(Σ memory.min of the direct child cgroups, how many were read)."""
    total = n = 0
    try:
        with os.scandir(cgroup) as it:
            for entry in it:
                if n >= MAX_CHILDREN:
                    break
                if entry.is_dir(follow_symlinks=False):
                    total += _bytes(os.path.join(entry.path, "memory.min")) or 0
                    n += 1
    except OSError:
        pass
    return total, n


class ProtectionChecks(CheckBase):
    """The kubelet's container memory.min, headroom under kubepods / QoS memory.max, recursiveprot."""

    def check_protection(self) -> list[Result]:
        return [self._kubelet_container_min(), *self._headroom(), self._recursiveprot()]

    def _kubelet_container_min(self) -> Result:
        name = "container memory.min"
        writes, owners, _ = self._ownership()
        cfg = self.cfg
        rule = (f"capped at limit - max(ceil(limit x {cfg.protection_headroom_ratio}), "
                f"{cfg.protection_headroom_min} bytes) so a pod at its memory.max can reclaim its own page cache")
        kubelet_owns = owners.kubelet_keys().get("memory.min")
        kubelet_min = writes.writes_protection and writes.protection in (Policy.HARD, Policy.TIERED_RESERVATION)
        if not (kubelet_owns and kubelet_min):
            return Result(name, PASS, f"the shim's: {rule}")
        if cfg.correct_kubelet_min:
            return Result(name, PASS, f"the kubelet's ({kubelet_owns}), lowered by correct-kubelet-min: {rule}")
        return Result(name, WARN, "the kubelet writes a container's memory.min = its request "
                                  f"({writes.protection.value}): a pod whose container's request is at or near "
                                  "its limit (every Guaranteed pod) is OOM-killed when it needs its own page cache "
                                  "back", [
            f"the kernel does not reclaim below memory.min, and at the pod's memory.max such a container is below "
            f"it ({DOC})",
            "set correct-kubelet-min: true in the shim's config file (the shim then lowers it under the limit), or",
            "leave memoryReservationPolicy unset on the kubelet so that the shim writes the container values"])

    def _headroom(self) -> list[Result]:
        from shim.decision import QoSClass
        from shim.decision.quantity import format_bytes
        from shim.effects.layout import CgroupLayout

        _, driver = self._driver()
        try:
            layout = CgroupLayout(driver, self.kubelet.cgroup_root)
        except ValueError:
            return []
        floor = self.cfg.protection_headroom_min
        out = []
        for rel in (layout.kubepods, layout.qos(QoSClass.BURSTABLE), layout.qos(QoSClass.BESTEFFORT)):
            path = os.path.join(self.cfg.cgroup_root, rel)
            limit = _bytes(os.path.join(path, "memory.max"))
            if limit is None:  # "max", absent or unreadable: kubepods' reclaim root is the node
                continue
            protected, n = children_min(path)
            room = limit - protected
            text = (f"{rel}: its {n} child cgroups' memory.min sum to {format_bytes(protected)} of its memory.max "
                    f"{format_bytes(limit)}, {format_bytes(max(0, room))} left")
            if room < floor:
                out.append(Result("protection headroom", WARN, text, [
                    f"less than protection-headroom-min ({format_bytes(floor)}): when {rel} reaches its memory.max, "
                    "reclaim finds (nearly) nothing unprotected below it and OOM-kills",
                    "the pods' requests sum to (nearly) all the node gives its pods: check kubeReserved / "
                    f"systemReserved and the eviction threshold ({DOC})"]))
            else:
                out.append(Result("protection headroom", PASS, text))
        return out

    def _recursiveprot(self) -> Result:
        root = os.path.realpath(self.cfg.cgroup_root)
        for mount_point, fs, options in cgroup_mounts(self.env.proc):
            if fs == "cgroup2" and os.path.realpath(mount_point) == root:
                if "memory_recursiveprot" in options.split(","):
                    return Result("memory_recursiveprot", PASS, f"{mount_point} is mounted with memory_recursiveprot: "
                                  "a pod's memory.min also covers its containers' headroom against other pods")
                return Result("memory_recursiveprot", PASS, f"{mount_point} is mounted without memory_recursiveprot: "
                              "a container's headroom under its limit is not protected against other pods' pressure "
                              f"(no OOM risk; {DOC})")
        return Result("memory_recursiveprot", PASS, f"no cgroup2 mount at {self.cfg.cgroup_root} in "
                      f"{self.env.proc}/self/mountinfo: cannot tell")
