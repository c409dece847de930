"""The protection benchmark's pure parts (e2e/guest_pressure.py runs them in the guest): the pods
and their cgroup layout as the kubelet makes it (cgroupfs driver), the value sets written into
them -- none, a gate-on kubelet's (KEP-2570), and the shim's, taken from the shim's own decision
code (shim.decision.memory.decide for containers, shim.decision.node.node_targets for pod, QoS
and kubepods cgroups) -- and the oom_score_adj the kubelet gives each process. No I/O."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from shim.app.config_classes import parse_classes
from shim.decision.classes import ContainerClass, ContainerSettings, apply_class, with_swap
from shim.decision.facts import ContainerFacts, NodeFacts, Policy, PodFacts, QoSClass
from shim.decision.memory import decide
from shim.decision.node import PlacedPod, node_targets
from shim.decision.pod import pod_request

MI = 1 << 20
PAGE = 4096
KEP_FACTOR = 0.9  # the kubelet's default memoryThrottlingFactor, and the shim's without a kubelet config
KUBEPODS, BURSTABLE, BESTEFFORT = "kubepods", "kubepods/burstable", "kubepods/besteffort"
PAUSE_MIB = 2  # what the sandbox's pause process holds (the kubelet's pause sibling)
# value sets: no protection, a gate-on kubelet's, the shim's default policy, then each policy
SETS = ("none", "kubelet", "shim", "shim-Soft", "shim-TieredReservation", "shim-None")
SHIM_DEFAULT = Policy.HARD
# The classes of the class scenarios, as the config file's key `classes` says them, read by the
# shim's own parser (shim.app.config_classes): what a class changes comes from the shim's code.
CLASSES_CONFIG = {
    "latency-critical": {"factor": "none"},  # no memory.high: never throttled, OOM-killed at memory.max
    "swap": {"swap": True},  # may swap where the kubelet leaves swap to the runtime
}
CLASS_PREFIX = "class:"  # a value set "class:NAME": the shim's values with NAME for the scenario's classed pods


def classes() -> dict[str, ContainerClass]:
    return {c.name: c for c in parse_classes(CLASSES_CONFIG) or ()}


@dataclass(frozen=True)
class Box:
    """A container: request / limit in bytes (0: none) and its workload, e2e/pressure.c's or
    e2e/hog.c's arguments: ("write"|"loop", anon MiB, files, file MiB, passes) or ("hog", MiB, step ms)."""

    name: str
    request: int
    limit: int
    work: tuple


@dataclass(frozen=True)
class Pod:
    name: str
    uid: str
    boxes: tuple[Box, ...]
    role: str = "holder"  # holder | aggressor | writer

    @property
    def qos(self) -> QoSClass:
        if all(b.limit > 0 and b.request == b.limit for b in self.boxes):
            return QoSClass.GUARANTEED
        if all(b.request == 0 and b.limit == 0 for b in self.boxes):
            return QoSClass.BESTEFFORT
        return QoSClass.BURSTABLE

    @property
    def path(self) -> str:
        parent = {QoSClass.GUARANTEED: KUBEPODS, QoSClass.BURSTABLE: BURSTABLE,
                  QoSClass.BESTEFFORT: BESTEFFORT}[self.qos]
        return f"{parent}/pod{self.uid}"

    @property
    def request(self) -> int:
        return sum(b.request for b in self.boxes)

    @property
    def limit(self) -> int:
        """The pod cgroup's memory.max as the kubelet sets it: the sum of the limits when every
        container has one, else none (0)."""
        return sum(b.limit for b in self.boxes) if all(b.limit for b in self.boxes) else 0

    def label(self) -> str:  # what node_targets' reasons name a pod by
        return f"default/{self.name}"


@dataclass
class Layout:
    """Every cgroup of a run and the values written into it: path -> {file: value}."""

    files: dict[str, dict[str, str]] = field(default_factory=dict)

    def put(self, path: str, file: str, value) -> None:
        self.files.setdefault(path, {})[file] = str(value)

    def get(self, path: str, file: str, default: str = "") -> str:
        return self.files.get(path, {}).get(file, default)


def oom_score_adj(pod: Pod, box: Box, capacity: int) -> int:
    """The kubelet's oom_score_adj for a container's processes (pkg/kubelet/qos/policy.go)."""
    if pod.qos is QoSClass.GUARANTEED:
        return -997
    if pod.qos is QoSClass.BESTEFFORT:
        return 1000
    adj = 1000 - (1000 * box.request) // capacity
    return min(max(adj, 2), 999)


def kubelet_high(request: int, limit: int, allocatable: int, factor: float = KEP_FACTOR, page: int = PAGE) -> int:
    """A gate-on kubelet's container memory.high: floor((request + factor * (limit or
    allocatable - request)) / page) * page."""
    ceiling = limit or allocatable
    return math.floor((request + factor * (ceiling - request)) / page) * page


def limits(pods: list[Pod], allocatable: int) -> Layout:
    """memory.max as the kubelet sets it: kubepods = allocatable (the node allocatable reclaim
    root), each pod the sum of its limits, each container its limit; the pause sibling none."""
    lay = Layout()
    lay.put(KUBEPODS, "memory.max", allocatable)
    for path in (BURSTABLE, BESTEFFORT):
        lay.put(path, "memory.max", "max")
    for pod in pods:
        lay.put(pod.path, "memory.max", pod.limit or "max")
        lay.put(f"{pod.path}/pause", "memory.max", "max")
        for b in pod.boxes:
            lay.put(f"{pod.path}/{b.name}", "memory.max", b.limit or "max")
    return lay


def kubelet_values(pods: list[Pod], allocatable: int) -> Layout:
    """What a kubelet with the MemoryQoS gate on writes (KEP-2570): container and pod memory.min =
    request, the burstable QoS cgroup and kubepods the sums, memory.high for Burstable and
    BestEffort containers (none for Guaranteed)."""
    lay = Layout()
    sums = {QoSClass.GUARANTEED: 0, QoSClass.BURSTABLE: 0, QoSClass.BESTEFFORT: 0}
    for pod in pods:
        sums[pod.qos] += pod.request
        if pod.request:
            lay.put(pod.path, "memory.min", pod.request)
        for b in pod.boxes:
            path = f"{pod.path}/{b.name}"
            if b.request:
                lay.put(path, "memory.min", b.request)
            if pod.qos is not QoSClass.GUARANTEED:
                high = kubelet_high(b.request, b.limit, allocatable)
                if high > b.request:
                    lay.put(path, "memory.high", high)
    lay.put(BURSTABLE, "memory.min", sums[QoSClass.BURSTABLE])
    lay.put(KUBEPODS, "memory.min", sums[QoSClass.GUARANTEED] + sums[QoSClass.BURSTABLE])
    return lay


def node_facts(capacity: int, allocatable: int) -> NodeFacts:
    """The guest as the shim sees it (no kubelet config: factor 0.9, the shim's default)."""
    return NodeFacts(capacity=capacity, allocatable=allocatable, page_size=PAGE, factor=KEP_FACTOR)


def _lives(pod: Pod) -> list:
    """The pod's containers as shim.decision.pod.pod_request reads them: regular containers,
    all running (each seen alive after the next one existed)."""
    return [SimpleNamespace(id=f"{pod.uid}-{b.name}", name=b.name, request=b.request, order=i, created_at=i + 1,
                            finished_at=0, create_start=0, exists_at=i + 1, exited_by=0, alive_at=1000,
                            first_gen=0, alive_gen=0)
            for i, b in enumerate(pod.boxes)]


SHIM_KEYS = ("memory.min", "memory.low", "memory.high", "memory.swap.max")


def shim_values(pods: list[Pod], node: NodeFacts, policy: Policy,
                classed: dict[str, ContainerClass] | None = None) -> Layout:
    """What the shim writes under ``policy``: each container's unified memory.min / low / high
    (and memory.swap.max where a swap class's ``with_swap`` adds one) from ``decide`` (the kubelet's gate-on
    values are what it is sent, as CreateContainer carries them), pod / QoS / kubepods memory.min
    / low from ``node_targets``. ``classed``: pod name -> the class its containers were created
    with; their settings are ``apply_class``'s over the node's (a pod not named: the node's)."""
    classed = classed or {}
    if any(c.policy is not None and c.policy is not policy for c in classed.values()):
        raise ValueError("a class that changes the policy changes the sums: not modelled here")
    base = ContainerSettings(cls=None, node=node, policy=policy)
    lay = Layout()
    sent = kubelet_values(pods, node.allocatable)
    placed = []
    for pod in pods:
        parent = "/" + pod.path.rsplit("/", 1)[0]
        facts = PodFacts(uid=pod.uid, namespace="default", name=pod.name, cgroup_parent=parent)
        for b in pod.boxes:
            path = f"{pod.path}/{b.name}"
            unified = {k: v for k, v in sent.files.get(path, {}).items()}
            settings = apply_class(classed.get(pod.name), base)
            d = with_swap(decide(facts, ContainerFacts(name=b.name, limit=b.limit, oom_score_adj=oom_score_adj(
                pod, b, node.capacity), unified=unified), settings.node, settings.policy), settings)
            for key in SHIM_KEYS:
                if key in d.unified_after:
                    lay.put(path, key, d.unified_after[key])
        lives = _lives(pod)
        record = SimpleNamespace(uid=pod.uid, active=True, label=pod.label,
                                 containers={c.id: c for c in lives})
        req = pod_request(lives) if pod.qos is not QoSClass.BESTEFFORT else None
        placed.append(PlacedPod(record, pod.qos, pod.path, req))
    for (path, file), target in node_targets(placed, KUBEPODS, BURSTABLE, BESTEFFORT, policy, node.page_size,
                                             capacity=node.capacity, allocatable=node.allocatable).items():
        lay.put(path, file, target.value)
    return lay


def values(name: str, pods: list[Pod], node: NodeFacts, classed: tuple[str, ...] = ()) -> Layout:
    """The value set ``name`` (one of SETS, or "class:NAME") for these pods. "class:NAME": the
    shim's default values with the class NAME for the pods ``classed`` names ("*": every pod),
    every other pod with the node's settings (the default class)."""
    if name.startswith(CLASS_PREFIX):
        table = classes()
        cls = name[len(CLASS_PREFIX):]
        if cls not in table:
            raise ValueError(f"unknown class {cls!r}")
        who = {p.name for p in pods} if "*" in classed else set(classed)
        return shim_values(pods, node, SHIM_DEFAULT, {p: table[cls] for p in who})
    if name == "none":
        return Layout()
    if name == "kubelet":
        return kubelet_values(pods, node.allocatable)
    if name == "shim":
        return shim_values(pods, node, SHIM_DEFAULT)
    if name.startswith("shim-"):
        return shim_values(pods, node, Policy(name[5:]))
    raise ValueError(f"unknown value set {name!r}")


def describe(lay: Layout, pods: list[Pod]) -> str:
    """One line: the protection of each pod and container, in MiB (min/low/high; '-' unset)."""
    def mib(path: str, file: str) -> str:
        v = lay.get(path, file)
        return "-" if v in ("", "0", "max") or not v.isdigit() else f"{int(v) / MI:g}"

    parts = [f"kubepods min {mib(KUBEPODS, 'memory.min')} low {mib(KUBEPODS, 'memory.low')}"]
    for pod in pods:
        boxes = ", ".join(f"{b.name} {mib(pod.path + '/' + b.name, 'memory.min')}/"
                          f"{mib(pod.path + '/' + b.name, 'memory.low')}/{mib(pod.path + '/' + b.name, 'memory.high')}"
                          for b in pod.boxes)
        parts.append(f"{pod.name} {mib(pod.path, 'memory.min')}/{mib(pod.path, 'memory.low')} [{boxes}]")
    return "; ".join(parts)
