"""What the soak expects of each answer: the rewrite ``shim.decision`` computes for a request
(``Expect``), and the class of every call (``Tally``): ok, unavailable, stale, lost, mangled."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from shim.app.config import OPTIONS
from shim.cri import pb
from shim.cri.facts import container_facts, pod_facts
from shim.decision import Decision, Policy, decide
from shim.node.facts import load_kubelet_config, node_facts, read_mem_total
from shim.node.kubelet import kubelet_writes, ownership, parse_version
from memqos_dev.tools.soak.stack import KUBELET_VERSION, PAGE, Stack

ANNOTATION = "memqos.io/request"  # the shim's note on every container it decided for


class Expect:
    """The node facts, policy and kubelet-owned keys `serve` derives from the stack's files,
    read the way it reads them, and the decision for a request made with them."""

    def __init__(self, stack: Stack, policy: Policy | None = None) -> None:
        if policy is None:  # `serve`'s default, as the soak does not set one
            policy = next(o.default for o in OPTIONS if o.name == "policy")
        kubelet = load_kubelet_config(str(stack.kubelet_config))
        self.node = node_facts(read_mem_total(str(stack.meminfo)), kubelet, page_size=PAGE)
        self.policy = policy
        self.kubelet_owns = ownership(kubelet_writes(kubelet, parse_version(KUBELET_VERSION)), policy).kubelet_keys()

    def create(self, req: pb.CreateContainerRequest) -> Decision:
        return decide(pod_facts(req.sandbox_config), container_facts(req.config.metadata.name, req.config.linux.resources),
                      self.node, self.policy, kubelet_owns=self.kubelet_owns)

    def update(self, created: pb.CreateContainerRequest, at_create: Decision,
               upd: pb.UpdateContainerResourcesRequest) -> Decision:
        """An update of a container the shim saw created: the request remembered from then."""
        return decide(pod_facts(created.sandbox_config), container_facts(created.config.metadata.name, upd.linux),
                      self.node, self.policy, at_create.request, reset_absent=True, kubelet_owns=self.kubelet_owns)


def status_problems(status: pb.ContainerStatus, cid: str, sent: pb.CreateContainerRequest,
                    unified: dict[str, str], limit: int) -> list[str]:
    """How the runtime's view of a container differs from what the kubelet sent, rewritten as
    expected: only ``unified`` and the shim's annotation may differ."""
    out = []
    if status.id != cid:
        out.append(f"status of {cid[:12]} names {status.id[:12]!r}")
    if status.metadata != sent.config.metadata:
        out.append("metadata differs")
    if dict(status.labels) != dict(sent.config.labels):
        out.append("labels differ")
    ann = dict(status.annotations)
    if ANNOTATION not in ann:
        out.append(f"no {ANNOTATION} annotation")
    ann.pop(ANNOTATION, None)
    if ann != dict(sent.config.annotations):
        out.append("annotations differ")
    got = status.resources.linux
    if dict(got.unified) != unified:
        out.append(f"unified {dict(got.unified)} != expected {unified}")
    if got.memory_limit_in_bytes != limit:
        out.append(f"memory limit {got.memory_limit_in_bytes} != {limit}")
    if got.oom_score_adj != sent.config.linux.resources.oom_score_adj:
        out.append("oom_score_adj differs")
    return out


OK, UNAVAILABLE, STALE, LOST, MANGLED = "ok", "unavailable", "stale", "lost", "mangled"
CLASSES = (OK, UNAVAILABLE, STALE, LOST, MANGLED)


@dataclass
class Tally:
    """Counts per class (and per method), the first examples of each bad class; thread-safe."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    by_method: dict[tuple[str, str], int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    rewrites_checked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, cls: str, method: str, note: str = "") -> None:
        with self.lock:
            self.counts[cls] += 1
            key = (method, cls)
            self.by_method[key] = self.by_method.get(key, 0) + 1
            if note and cls in (LOST, MANGLED, STALE, UNAVAILABLE):
                ex = self.examples.setdefault(cls, [])
                if len(ex) < 10:
                    ex.append(f"{method}: {note}")

    def checked_rewrite(self) -> None:
        with self.lock:
            self.rewrites_checked += 1
