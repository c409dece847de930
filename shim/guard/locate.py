"""Where a container's cgroup directory is, built (never taken as is) from request data: the pod
directory from the pod's cgroup_parent and uid through ``CgroupLayout.pod_from_parent`` (the
parent must be exactly where the kubelet's driver puts that pod), the container directory below
it from the runtime's naming -- cgroupfs ``<pod>/<id>`` (containerd) or ``<pod>/crio-<id>``
(CRI-O), systemd ``<pod>/cri-containerd-<id>.scope`` or ``<pod>/crio-<id>.scope`` -- whichever
exists. The id must look like an id. Used by the monitor and by the writes after an update."""
from __future__ import annotations

from shim.effects.cgroupfs import PathRefused
from shim.effects.container import ContainerCgroups
from shim.effects.container import container_dir as _container_dir
from shim.effects.layout import CgroupLayout, detect_driver
from shim.node.facts import KubeletFacts, is_cgroup_v2
from shim.node.view import ContainerRef


def container_dir(fs: ContainerCgroups, layout: CgroupLayout, ref: ContainerRef) -> str | None:
    """The container's cgroup directory (relative to the cgroup root), None while it does not
    exist. PathRefused for request data that does not make a valid path."""
    return _container_dir(fs, layout, ref.id, ref.uid, ref.cgroup_parent)


def node_layout(cgroup_root: str, kubelet: KubeletFacts, current: CgroupLayout | None) -> tuple[CgroupLayout | None, str]:
    """(the layout of the node's kubepods tree, "") or (None, why there is none yet). ``current``
    is returned as it is while the driver did not change."""
    if not is_cgroup_v2(cgroup_root):
        return None, f"{cgroup_root} is not cgroup v2: nothing to sample"
    driver = kubelet.cgroup_driver if kubelet.source else detect_driver(cgroup_root, kubelet.cgroup_root)
    if driver is None:
        return None, f"no kubepods cgroup under {cgroup_root} yet"
    if current is not None and current.driver == driver:
        return current, ""
    try:
        return CgroupLayout(driver, kubelet.cgroup_root), ""
    except (ValueError, PathRefused) as e:
        return None, str(e)
