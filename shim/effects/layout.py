"""Where the kubelet puts the kubepods, QoS-class and pod cgroups, for both cgroup drivers.

cgroupfs: <cgroupRoot>/kubepods, kubepods/burstable, kubepods/besteffort,
          kubepods/burstable/pod<uid> (Guaranteed: kubepods/pod<uid>).
systemd:  kubepods.slice, kubepods.slice/kubepods-burstable.slice,
          kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice
          (Guaranteed: kubepods.slice/kubepods-pod<uid_>.slice).

Pod paths are never taken from the kubelet's cgroup_parent as is: they are built from the
driver, the QoS class and the pod's own uid, and the cgroup_parent must then be exactly that
path (or, with systemd, its leaf slice name). Anything else is refused.
"""
from __future__ import annotations

import os
import re

from shim.decision import QoSClass, parse_cgroup_parent
from shim.effects.cgroupfs import PathRefused, split_path

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"
_UID = re.compile(r"^[0-9a-fA-F][0-9a-fA-F-]{0,63}$")
_QOS_NAME = {QoSClass.BURSTABLE: "burstable", QoSClass.BESTEFFORT: "besteffort"}
POD_DIR = re.compile(r"^(?:kubepods-(?:burstable-|besteffort-)?)?pod[0-9a-fA-F_-]{1,64}(?:\.slice)?$")


def detect_driver(fs_root: str, cgroup_root: str = "/") -> str | None:
    """systemd when <root>/kubepods.slice exists, cgroupfs when <root>/<cgroupRoot>/kubepods does."""
    if os.path.isdir(os.path.join(fs_root, "kubepods.slice")):
        return SYSTEMD
    prefix = [p for p in cgroup_root.split("/") if p]
    if os.path.isdir(os.path.join(fs_root, *prefix, "kubepods")):
        return CGROUPFS
    return None


class CgroupLayout:
    def __init__(self, driver: str, cgroup_root: str = "/"):
        if driver not in (CGROUPFS, SYSTEMD):
            raise ValueError(f"unknown cgroup driver {driver!r}")
        self.driver = driver
        self.prefix = split_path(cgroup_root or "/")
        if driver == SYSTEMD and self.prefix:
            raise ValueError(f"cgroupRoot {cgroup_root!r} with the systemd driver is not supported (only '/')")

    def _join(self, *parts: str) -> str:
        return "/".join([*self.prefix, *parts])

    @property
    def kubepods(self) -> str:
        return self._join("kubepods.slice" if self.driver == SYSTEMD else "kubepods")

    def qos(self, qos: QoSClass) -> str | None:
        """The QoS-class cgroup; None for Guaranteed (its pods sit directly in kubepods)."""
        name = _QOS_NAME.get(qos)
        if name is None:
            return None
        if self.driver == SYSTEMD:
            return f"{self.kubepods}/kubepods-{name}.slice"
        return f"{self.kubepods}/{name}"

    def pod(self, qos: QoSClass, uid: str) -> str:
        if not _UID.match(uid or ""):
            raise PathRefused(f"pod uid {uid[:80]!r} is not a uid")
        parent = self.qos(qos) or self.kubepods
        if self.driver == SYSTEMD:
            u = uid.replace("-", "_")
            name = _QOS_NAME.get(qos)
            leaf = f"kubepods-{name}-pod{u}.slice" if name else f"kubepods-pod{u}.slice"
            return f"{parent}/{leaf}"
        return f"{parent}/pod{uid}"

    def pod_from_parent(self, cgroup_parent: str, uid: str) -> tuple[QoSClass, str]:
        """(QoS class, pod cgroup path) for a pod's cgroup_parent, after checking that it is
        exactly where this driver puts the pod with this uid. PathRefused otherwise."""
        if not _UID.match(uid or ""):
            raise PathRefused(f"pod uid {str(uid)[:80]!r} is not a uid")
        qos, puid = parse_cgroup_parent(cgroup_parent)
        if qos is None:
            raise PathRefused(f"cgroup_parent {cgroup_parent[:200]!r} is not a kubepods pod cgroup")
        want_uid = uid.replace("-", "_") if self.driver == SYSTEMD else uid
        if puid != want_uid:
            raise PathRefused(f"cgroup_parent {cgroup_parent[:200]!r}: pod element does not match uid {uid}")
        expected = self.pod(qos, uid)
        accepted = {"/" + expected}
        if self.driver == SYSTEMD:
            accepted.add(expected.rsplit("/", 1)[-1])
        if cgroup_parent not in accepted:
            raise PathRefused(
                f"cgroup_parent {cgroup_parent[:200]!r} is not where the {self.driver} driver puts pod "
                f"{uid} ({'/' + expected!r})"
            )
        return qos, expected

    def reserved(self, name: str) -> str:
        """A kubeReservedCgroup / systemReservedCgroup as a path under the cgroup root."""
        parts = split_path(name)
        if not parts:
            raise PathRefused(f"reserved cgroup {name!r} is the cgroup root")
        if self.driver == SYSTEMD and len(parts) == 1 and parts[0].endswith(".slice") and "-" in parts[0]:
            # a leaf slice name: a-b.slice lives in a.slice/a-b.slice
            words = parts[0][: -len(".slice")].split("-")
            parts = ["-".join(words[: i + 1]) + ".slice" for i in range(len(words))]
            split_path("/".join(parts))
        kp = split_path(self.kubepods)
        if parts[: len(kp)] == kp or kp[: len(parts)] == parts:
            raise PathRefused(f"reserved cgroup {name!r} overlaps the kubepods cgroup")
        return "/".join(parts)
