"""Protection that never OOM-kills (docs/memory-qos.md): whether the kubelet writes a container
memory.min that can OOM-kill a pod, which running containers hold a memory.min above the cap
the rule puts under their memory.max, whether kubepods and the QoS cgroups leave room under their
memory.max, and whether cgroup2 is mounted with memory_recursiveprot."""
from __future__ import annotations

import os
import re
from typing import Iterator

from shim.decision import Policy
from shim.tools.doctor.common import PASS, WARN, CheckBase, Result, cgroup_mounts, read_text

DOC = "docs/memory-qos.md#protection-that-never-oom-kills"
MAX_CHILDREN = 10000  # cgroups read under one parent at most (a node has a few hundred pods)
MAX_LISTED = 10  # containers named one by one in a warning; the rest are counted ("and K more")
_POD_UID = re.compile(r"pod([0-9a-fA-F_-]{1,64})(?:\.slice)?$")
_RUNTIME_PREFIX = re.compile(r"^(?:cri-containerd-|crio-|docker-)")


def _bytes(path: str) -> int | None:
    """A memory.* file's value: bytes, None for "max", unreadable or not a number."""
    text = (read_text(path, 64) or "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def subdirs(path: str) -> list[os.DirEntry]:
    """The directories directly below ``path`` (not through a symlink), at most MAX_CHILDREN."""
    out: list[os.DirEntry] = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if len(out) >= MAX_CHILDREN:
                    break
                if entry.is_dir(follow_symlinks=False):
                    out.append(entry)
    except OSError:
        pass
    return out


def container_cgroups(root: str, parents: list[str]) -> Iterator[tuple[str, str, str]]:
    """(pod uid, container id, path) of every cgroup below a pod cgroup directly under one of
    ``parents`` (relative to ``root``): the containers, and the sandbox's too."""
    from shim.effects.layout import POD_DIR

    for parent in parents:
        for pod in subdirs(os.path.join(root, parent)):
            m = _POD_UID.search(pod.name)
            if not POD_DIR.match(pod.name) or m is None:
                continue
            uid = m.group(1).replace("_", "-")
            for c in subdirs(pod.path):
                yield uid, _RUNTIME_PREFIX.sub("", c.name).removesuffix(".scope"), c.path


def children_min(cgroup: str) -> tuple[int, int]:
    """(Σ memory.min of the direct child cgroups, how many were read)."""
    children = subdirs(cgroup)
    return sum(_bytes(os.path.join(c.path, "memory.min")) or 0 for c in children), len(children)


class ProtectionChecks(CheckBase):
    """The kubelet's container memory.min, headroom under kubepods / QoS memory.max, recursiveprot."""

    def check_protection(self) -> list[Result]:
        return [self._kubelet_container_min(), *self._containers_min(), *self._headroom(), self._recursiveprot()]

    def _kubelet_writes_min(self):
        """(KubeletWrites, why the kubelet owns container memory.min where it writes one there =
        the request, else None)."""
        writes, owners, _ = self._ownership()
        kubelet_owns = owners.kubelet_keys().get("memory.min")
        kubelet_min = writes.writes_protection and writes.protection in (Policy.HARD, Policy.TIERED_RESERVATION)
        return writes, (kubelet_owns if kubelet_min else None)

    def _kubelet_container_min(self) -> Result:
        name = "container memory.min"
        cfg = self.cfg
        rule = (f"capped at limit - max(ceil(limit x {cfg.protection_headroom_ratio}), "
                f"{cfg.protection_headroom_min} bytes) so a pod at its memory.max can reclaim its own page cache")
        writes, kubelet_owns = self._kubelet_writes_min()
        if not kubelet_owns:
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

    def _containers_min(self) -> list[Result]:
        """Running containers whose memory.min is above what the rule (capped_min, from their
        memory.max) allows: created before it, by a kubelet that writes memory.min = request, or
        by hand. A page of slack for the kernel's rounding of memory.max down to a page."""
        from shim.decision import NodeFacts, QoSClass, capped_min
        from shim.decision.quantity import format_bytes
        from shim.effects.layout import CgroupLayout
        from shim.node.facts import system_page_size

        name = "containers' memory.min"
        _, driver = self._driver()
        try:
            layout = CgroupLayout(driver, self.kubelet.cgroup_root)
        except ValueError:
            return []
        cfg = self.cfg
        page = cfg.page_size or system_page_size()
        node = NodeFacts(capacity=0, allocatable=0, page_size=page, factor=None,
                         headroom_ratio=cfg.protection_headroom_ratio, headroom_min=cfg.protection_headroom_min)
        parents = [layout.kubepods, layout.qos(QoSClass.BURSTABLE), layout.qos(QoSClass.BESTEFFORT)]
        read, over = 0, []
        for uid, cid, path in container_cgroups(cfg.cgroup_root, parents):
            value, limit = _bytes(os.path.join(path, "memory.min")), _bytes(os.path.join(path, "memory.max"))
            if not value or limit is None:  # no protection, or no limit: no cap
                continue
            read += 1
            cap, room = capped_min(value, limit, node)
            if value > cap + page:
                over.append(f"pod {uid} container {cid[:13]}: memory.min {value} ({format_bytes(value)}) of "
                            f"memory.max {limit} ({format_bytes(limit)}); the rule caps it at {cap} "
                            f"(headroom {room})")
        if not read:
            return [Result(name, PASS, f"no container cgroup with a memory.min and a memory.max under "
                                       f"{layout.kubepods}")]
        if not over:
            return [Result(name, PASS, f"{read} container cgroups with a memory.min and a memory.max: each leaves "
                                       "the headroom the rule asks under its memory.max")]
        listed = over[:MAX_LISTED] + ([f"and {len(over) - MAX_LISTED} more"] if len(over) > MAX_LISTED else [])
        if self._kubelet_writes_min()[1]:
            todo = [("correct-kubelet-min is on: " if cfg.correct_kubelet_min else
                     "set correct-kubelet-min: true in the shim's config file: ")
                    + "the shim then lowers the memory.min the kubelet sends when it creates or updates a "
                    "container; a running container keeps its value until the kubelet sends an update for it "
                    "or it is recreated"]
        else:
            todo = ["the shim sets a container's memory.min only when the container is created or updated through "
                    "it, so one created before the rule, before the shim, or by a kubelet that wrote memory.min = "
                    "request keeps its value"]
        todo.append("recreate these containers (delete the pod; its controller creates it again) to get the "
                    f"capped value; `crictl ps --id ID` names the pod and container ({DOC})")
        return [Result(name, WARN, f"{len(over)} of {read} container cgroups hold a memory.min above the rule's cap "
                                   "under their memory.max: at the pod's memory.max such a container cannot reclaim "
                                   "its own page cache and is OOM-killed", listed + todo)]

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
