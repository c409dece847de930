"""The node-level targets: memory.min / memory.low of the pod, QoS-class, kubepods and reserved
cgroups under a policy, with the reason for each value. Pure: the pods come already placed in
the cgroup tree (their paths checked by the caller), the node's cgroups as path strings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from shim.decision.facts import Policy, QoSClass
from shim.decision.memory import protection_key
from shim.decision.quantity import format_bytes

NODE, QOS, POD = 0, 1, 2
MIN, LOW = "memory.min", "memory.low"

# The cgroups the reconciler manages, by who may own their memory.min / memory.low (see
# shim.node.kubelet.Ownership: a scope the kubelet owns is left to it).
SCOPES = ("pod", "qos", "kubepods", "reserved")


@dataclass(frozen=True)
class Target:
    """One managed file's value: ``value`` bytes into ``path``/``file``, at a level of the tree
    (NODE, QOS, POD: increases go top-down, decreases bottom-up), and why."""

    path: str
    file: str
    value: int
    level: int
    why: str
    # what shim.decision.protection needs to keep protection in force: the pod a pod-level file
    # belongs to, whether the file is the one the policy protects with (a pod's protecting
    # file, or a QoS / kubepods sum), and for a sum the pods of the classes it sums
    pod: str = ""
    protecting: bool = False
    members: frozenset[str] = frozenset()
    # set by shim.decision.protection: why a value was kept above the computed one, and the
    # departures that let a value in force go down (both audited with the write)
    held: str = ""
    departure: str = ""


@dataclass(frozen=True)
class Reserved:
    """A reserved cgroup the kubelet enforces, and the memory reserved for it."""

    kind: str  # kube-reserved | system-reserved
    path: str
    bytes: int


class PlacedPod(NamedTuple):
    """A pod at its place in the cgroup tree: its record (``uid``, ``active``, ``label()``,
    ``containers``), QoS class, cgroup path, and its request (None: inactive, BestEffort or
    without requests)."""

    pod: Any
    qos: QoSClass
    path: str
    request: Any


def describe_bytes(n: int) -> str:
    """'1073741824 (1Gi)' as the reasons show a byte count; '0' for zero."""
    return f"{n} ({format_bytes(n)})" if n else "0"


def node_targets(
    pods: Iterable[PlacedPod],
    kubepods: str,
    burstable: str,
    besteffort: str,
    policy: Policy,
    page_size: int,
    reserved: Iterable[Reserved] = (),
    kubelet_owns: frozenset[str] | set[str] = frozenset(),
) -> dict[tuple[str, str], Target]:
    """Every managed (path, file) -> Target, values rounded down to whole pages.

    Per policy (the kubelet's memoryReservationPolicy values, KEP-2570):

    * Hard: pods, the burstable QoS cgroup (Σ Burstable) and kubepods (Σ Guaranteed + Burstable)
      get memory.min; memory.low 0.
    * Soft: the same sums in memory.low; memory.min 0.
    * TieredReservation: Guaranteed pods memory.min, Burstable pods and the burstable QoS cgroup
      memory.low (as the kubelet); kubepods memory.min = Σ Guaranteed and memory.low = Σ
      Guaranteed + Burstable (the kubelet writes memory.min = Σ Guaranteed + Burstable there; the
      shim keeps the Burstable part soft, and without kubepods' memory.low the kernel would cap the
      Burstable pods' effective memory.low at 0 under node-wide reclaim).
    * None: every managed value 0.

    ``kubelet_owns``: scopes (``SCOPES``) whose values the kubelet writes itself; the shim
    leaves them out entirely (it neither writes nor zeroes them)."""
    page = max(1, page_size)
    pods = list(pods)
    sums = {QoSClass.GUARANTEED: 0, QoSClass.BURSTABLE: 0}
    counts = {QoSClass.GUARANTEED: 0, QoSClass.BURSTABLE: 0}
    for p in pods:
        if p.request is not None:
            sums[p.qos] += p.request.bytes
            counts[p.qos] += 1

    targets: dict[tuple[str, str], Target] = {}

    def put(path: str | None, file: str, value: int, level: int, why: str, scope: str, *, pod: str = "",
            protecting: bool = False, members: frozenset[str] = frozenset()) -> None:
        if path is not None and scope not in kubelet_owns:
            targets[(path, file)] = Target(path, file, (value // page) * page, level, why, pod, protecting, members)

    def put_both(path: str | None, level: int, why: str, scope: str, *, pod: str = "", key: str | None = None) -> None:
        put(path, MIN, 0, level, why, scope, pod=pod, protecting=key == MIN)
        put(path, LOW, 0, level, why, scope, pod=pod, protecting=key == LOW)

    # the pods each sum is made of (contributing or not: a stopped pod is still a member)
    gm = frozenset(p.pod.uid for p in pods if p.qos is QoSClass.GUARANTEED)
    bm = frozenset(p.pod.uid for p in pods if p.qos is QoSClass.BURSTABLE)
    name = policy.value
    g, b = sums[QoSClass.GUARANTEED], sums[QoSClass.BURSTABLE]
    ng, nb = counts[QoSClass.GUARANTEED], counts[QoSClass.BURSTABLE]
    kp, bq, beq = kubepods, burstable, besteffort
    all_sum = f"kubepods: {ng} Guaranteed + {nb} Burstable pods' requests sum to {describe_bytes(g + b)}"
    b_sum = f"burstable: {nb} Burstable pods' requests sum to {describe_bytes(b)}"
    if policy is Policy.NONE:
        put_both(kp, NODE, "policy None", "kubepods")
        for path in (bq, beq):
            put_both(path, QOS, "policy None", "qos")
    elif policy is Policy.TIERED_RESERVATION:
        put(kp, MIN, g, NODE, f"kubepods: {ng} Guaranteed pods' requests sum to {describe_bytes(g)} "
                              "(policy TieredReservation)", "kubepods", protecting=True, members=gm)
        put(kp, LOW, g + b, NODE, f"{all_sum} (policy TieredReservation)", "kubepods", protecting=True,
            members=gm | bm)
        put(bq, MIN, 0, QOS, "policy TieredReservation protects Burstable pods with memory.low", "qos")
        put(bq, LOW, b, QOS, f"{b_sum} (policy TieredReservation)", "qos", protecting=True, members=bm)
    else:
        key, other = (MIN, LOW) if policy is Policy.HARD else (LOW, MIN)
        put(kp, key, g + b, NODE, f"{all_sum} (policy {name})", "kubepods", protecting=True, members=gm | bm)
        put(kp, other, 0, NODE, f"policy {name} protects with {key}", "kubepods")
        put(bq, key, b, QOS, f"{b_sum} (policy {name})", "qos", protecting=True, members=bm)
        put(bq, other, 0, QOS, f"policy {name} protects with {key}", "qos")
    if policy is not Policy.NONE:
        put_both(beq, QOS, "BestEffort pods have no requests", "qos")
    for pod, qos, path, req in pods:
        who = f"pod {pod.label()} ({qos.value})"
        uid = pod.uid
        key = protection_key(policy, qos)  # None: the policy protects this pod with nothing
        if policy is Policy.NONE:
            put_both(path, POD, f"{who}: policy None", "pod", pod=uid)
            continue
        if not pod.active:
            put_both(path, POD, f"{who}: sandbox stopped", "pod", pod=uid)  # not running: nothing to keep
            continue
        if req is None:
            put_both(path, POD, f"{who}: no requests", "pod", pod=uid, key=key)
            continue
        names = {c.id: c.name for c in pod.containers.values()}
        why = f"{who}: request {describe_bytes(req.bytes)} = {req.explain(names)}"
        key = key or MIN
        other = LOW if key == MIN else MIN
        put(path, key, req.bytes, POD, f"{why} (policy {name})", "pod", pod=uid, protecting=True)
        put(path, other, 0, POD, f"{who}: protected by {key} (policy {name})", "pod", pod=uid)
    for r in reserved:
        none = policy is Policy.NONE
        put(r.path, MIN, 0 if none else r.bytes, NODE,
            f"{r.kind}: policy None" if none else f"{r.kind}: reserved memory {describe_bytes(r.bytes)}", "reserved")
    return targets
