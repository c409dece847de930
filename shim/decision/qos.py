"""The pod's QoS class, from the cgroup parent the kubelet chose or from oom_score_adj."""
from __future__ import annotations

import re

from shim.decision.facts import QoSClass

GUARANTEED_OOM_SCORE_ADJ = -997
BESTEFFORT_OOM_SCORE_ADJ = 1000

_POD_ELEMENT = re.compile(r"^pod([0-9a-fA-F_-]{1,64})$")


def _expand_slice(leaf: str) -> list[str] | None:
    """'kubepods-burstable-pod1234_5678.slice' -> ['kubepods', 'burstable', 'pod1234_5678']."""
    if not leaf.endswith(".slice"):
        return None
    return leaf[: -len(".slice")].split("-")


def parse_cgroup_parent(cgroup_parent: str) -> tuple[QoSClass | None, str | None]:
    """(QoS class, pod uid) from a pod cgroup parent, or (None, None) if not a kubepods path.

    cgroupfs: /kubepods/burstable/pod<uid>, /kubepods/besteffort/pod<uid>, /kubepods/pod<uid>
    (possibly below a cgroupRoot). systemd: the same as slices, full path or leaf only,
    e.g. kubepods-burstable-pod<uid with _>.slice. The uid is returned as written
    (underscores for systemd).
    """
    if not cgroup_parent or len(cgroup_parent) > 4096:
        return None, None
    parts = [p for p in cgroup_parent.split("/") if p]
    if not parts:
        return None, None
    leaf = parts[-1]
    if leaf.endswith(".slice"):
        elements = _expand_slice(leaf) or []
    else:
        elements = parts
    if len(elements) < 2:
        return None, None
    m = _POD_ELEMENT.match(elements[-1])
    if not m:
        return None, None
    above = elements[-2]
    if above == "burstable" and len(elements) >= 3 and elements[-3] == "kubepods":
        return QoSClass.BURSTABLE, m.group(1)
    if above == "besteffort" and len(elements) >= 3 and elements[-3] == "kubepods":
        return QoSClass.BESTEFFORT, m.group(1)
    if above == "kubepods":
        return QoSClass.GUARANTEED, m.group(1)
    return None, None


def qos_from_oom_score_adj(adj: int) -> QoSClass:
    if adj == GUARANTEED_OOM_SCORE_ADJ:
        return QoSClass.GUARANTEED
    if adj == BESTEFFORT_OOM_SCORE_ADJ:
        return QoSClass.BESTEFFORT
    return QoSClass.BURSTABLE


def qos_class(cgroup_parent: str, oom_score_adj: int) -> tuple[QoSClass, str]:
    """The QoS class and how it was found."""
    qos, _ = parse_cgroup_parent(cgroup_parent)
    if qos is not None:
        return qos, "cgroup-parent"
    return qos_from_oom_score_adj(oom_score_adj), "oom-score-adj"
