"""Container resources as containerd and runc apply them: the OCI spec merge, cgroupsPath, the
cgroup directory a container gets under each cgroup driver and the files written into it."""
from __future__ import annotations

import os
import posixpath
from typing import Any

from shim.cri import pb
from memqos_dev.testing.fake_runtime.records import SYSTEMD

#: the fields WithResources copies only when the new value is non-zero
_OVERWRITE_IF_SET = ("cpu_period", "cpu_quota", "cpu_shares", "cpuset_cpus", "cpuset_mems")


def apply_linux_resources(
    spec: pb.LinuxContainerResources,
    new: pb.LinuxContainerResources,
    *,
    swap_controller: bool = True,
    hugetlb_controller: bool = False,
) -> None:
    """Merge ``new`` into ``spec`` the way containerd's ``opts.WithResources`` edits the OCI spec.

    Used for CreateContainer and, on a copy of the current spec, for UpdateContainerResources
    (``updateOCIResource``). Semantics (pkg/cri/opts/spec_linux.go):

    * cpu_period / cpu_quota / cpu_shares / cpuset_cpus / cpuset_mems / memory_limit_in_bytes
      overwrite only when non-zero -- a zero field in an update keeps the old value;
    * with a memory limit and no explicit swap limit, swap = limit (when the swap controller is
      available, as on the traced node: every limited container reports
      memory_swap_limit_in_bytes == memory_limit_in_bytes); a non-zero swap limit wins;
    * ``unified`` keys are merged in: added or overwritten, never removed;
    * hugepage limits are appended only if the hugetlb controller exists; otherwise skipped
      (tolerate_missing_hugetlb_controller, the default): the traced node had none, so its
      statuses carry no hugepage_limits although the kubelet sent 2MB/1GB entries;
    * oom_score_adj is not a resource here (it is process-level, set at create only).
    """
    for name in _OVERWRITE_IF_SET:
        value = getattr(new, name)
        if value:
            setattr(spec, name, value)
    if new.memory_limit_in_bytes:
        spec.memory_limit_in_bytes = new.memory_limit_in_bytes
        if not new.memory_swap_limit_in_bytes and swap_controller:
            spec.memory_swap_limit_in_bytes = new.memory_limit_in_bytes
    if new.memory_swap_limit_in_bytes and swap_controller:
        spec.memory_swap_limit_in_bytes = new.memory_swap_limit_in_bytes
    if hugetlb_controller:
        for limit in new.hugepage_limits:
            spec.hugepage_limits.add(page_size=limit.page_size, limit=limit.limit)
    for key, value in new.unified.items():
        spec.unified[key] = value


def oci_linux_resources(r: pb.LinuxContainerResources) -> dict[str, Any]:
    """The ``linux.resources`` object of an OCI runtime spec holding ``r`` (for verbose info)."""
    out: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    memory: dict[str, Any] = {}
    if r.memory_limit_in_bytes:
        memory["limit"] = r.memory_limit_in_bytes
    if r.memory_swap_limit_in_bytes:
        memory["swap"] = r.memory_swap_limit_in_bytes
    out["memory"] = memory
    cpu: dict[str, Any] = {}
    if r.cpu_shares:
        cpu["shares"] = r.cpu_shares
    if r.cpu_quota:
        cpu["quota"] = r.cpu_quota
    if r.cpu_period:
        cpu["period"] = r.cpu_period
    if r.cpuset_cpus:
        cpu["cpus"] = r.cpuset_cpus
    if r.cpuset_mems:
        cpu["mems"] = r.cpuset_mems
    out["cpu"] = cpu
    if r.hugepage_limits:
        out["hugepageLimits"] = [{"pageSize": h.page_size, "limit": h.limit} for h in r.hugepage_limits]
    if r.unified:
        out["unified"] = dict(sorted(r.unified.items()))
    return out


KERNEL_DEFAULTS = {"memory.min": "0", "memory.low": "0", "memory.high": "max"}
CONTAINERD_PREFIX = "cri-containerd"
CRIO_PREFIX = "crio"


def cgroups_path(cgroup_parent: str, id: str, prefix: str = CONTAINERD_PREFIX) -> str:
    """containerd's getCgroupsPath: ``slice:cri-containerd:id`` under a systemd slice, else a path
    (``<parent>/<id>``). CRI-O (``prefix`` "crio") names the leaf ``crio-<id>`` on cgroupfs too."""
    base = posixpath.basename(cgroup_parent)
    if base.endswith(".slice"):
        return f"{base}:{prefix}:{id}"
    leaf = id if prefix == CONTAINERD_PREFIX else f"{prefix}-{id}"
    return posixpath.join(cgroup_parent, leaf) if cgroup_parent else leaf


def expand_slice(name: str) -> str:
    """systemd's slice naming: 'kubepods-burstable-pod1_2.slice' lives at
    'kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice' (every dash
    names a parent slice); '-.slice' is the root."""
    if not name.endswith(".slice") or name == "-.slice":
        raise ValueError(f"not a slice name: {name!r}")
    stem = name[: -len(".slice")]
    if not stem or stem.startswith("-") or stem.endswith("-") or "--" in stem or "/" in stem:
        raise ValueError(f"invalid slice name: {name!r}")
    parts = stem.split("-")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def container_cgroup(cgroup_parent: str, id: str, driver: str, prefix: str = CONTAINERD_PREFIX) -> str:
    """Where runc puts a container's cgroup (relative to the cgroup v2 root), from containerd's
    cgroupsPath: with the systemd driver ``slice:cri-containerd:id`` becomes the scope
    ``cri-containerd-<id>.scope`` in the expanded slice (the kubelet may send the full slice
    path or the leaf slice alone: only the leaf counts); with cgroupfs ``<parent>/<id>``.
    ValueError for the combinations runc refuses (systemd driver and a plain path)."""
    path = cgroups_path(cgroup_parent, id, prefix)
    if driver == SYSTEMD:
        parts = path.split(":")
        if len(parts) != 3:
            raise ValueError(f'expected cgroupsPath to be of format "slice:prefix:name" for systemd cgroups, '
                             f'got "{path}" instead')
        slice_name, prefix, name = parts
        return posixpath.join(expand_slice(slice_name), f"{prefix}-{name}.scope")
    if ":" in path:
        raise ValueError(f"cgroupfs driver: invalid cgroup path {path!r} (a systemd slice parent)")
    return path.lstrip("/")


def write_cgroup(directory: str, resources: pb.LinuxContainerResources, *, create: bool,
                 kernel_files: bool = False) -> None:
    """Write a container's resources into its cgroup directory as runc does: ``memory.max`` (the
    limit, or "max") and every ``unified`` key. ``create`` makes the directory (task start),
    with ``kernel_files`` also memory.min / memory.low / memory.high at the kernel's defaults
    (without, a file exists only when something wrote it);
    otherwise a missing directory is left alone (an update of a container without a task).
    ValueError for a unified key that is not a file name."""
    if create:
        os.makedirs(directory, exist_ok=True)
        for name, default in KERNEL_DEFAULTS.items() if kernel_files else ():  # as a new cgroup has them
            with open(posixpath.join(directory, name), "w", encoding="ascii") as f:
                f.write(default + "\n")
    elif not os.path.isdir(directory):
        return
    r = resources
    values = {"memory.max": str(r.memory_limit_in_bytes) if r.memory_limit_in_bytes else "max"}
    values.update(r.unified)
    for key, value in values.items():
        if "/" in key or key.startswith("."):
            raise ValueError(f"invalid unified key {key!r}")
        with open(posixpath.join(directory, key), "w", encoding="ascii") as f:
            f.write(value + "\n")
