"""The pod's memory request: the kubelet's rule (reference section 2) applied to what is known
of a pod's containers, and the container requests it sums. Pure: no I/O, no protobuf.

Regular containers and sidecars are summed, ordinary init containers counted by max (each plus
the sidecars started before it), plus pod overhead. CRI never says which container is an init
container, so ``pod_request`` infers it from timestamps (see its docstring); when unsure it
picks the lower value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Protocol

from shim.decision.classes import valid_name
from shim.decision.facts import ContainerFacts, PodFacts
from shim.decision.qos import parse_cgroup_parent, qos_from_oom_score_adj
from shim.decision.quantity import MAX_BYTES
from shim.decision.request import resolve_request

# Left on every container the shim creates, so a restarted shim can rebuild pod-level
# sums from the runtime alone (ListContainers / ContainerStatus return annotations).
CONTAINER_ANNOTATION = "memqos.io/request"

# container kinds, as inferred
INIT = "init"  # ordinary init container: counted by max
SIDECAR = "sidecar"  # summed, created before an ordinary init container
REGULAR = "regular"  # summed
UNSURE = "unsure"  # state not known: counted like an init container (the lower value)
REPLACED = "replaced"  # an earlier attempt of a container restarted under the same name


class ContainerLife(Protocol):
    """What the rule reads of a container (``shim.node.state.ContainerRecord``): its request
    and what is known of when it was created and finished, on the runtime's clock
    (``created_at``, ``finished_at``), the shim's (``create_start``, ``exists_at``,
    ``exited_by``, ``alive_at``) and the runtime listings' numbers (``first_gen``, ``alive_gen``)."""

    id: str
    name: str
    request: int
    order: int
    created_at: int
    finished_at: int
    create_start: int
    exists_at: int
    exited_by: int
    alive_at: int
    first_gen: int
    alive_gen: int


@dataclass(frozen=True)
class PodRequest:
    bytes: int
    summed: int  # regular containers + sidecars
    init_max: int  # largest ordinary init container (+ the sidecars before it)
    overhead: int
    kinds: Mapping[str, str]  # container id -> INIT / SIDECAR / REGULAR / UNSURE / REPLACED

    def explain(self, names: Mapping[str, str] | None = None) -> str:
        names = names or {}
        by: dict[str, list[str]] = {}
        for cid, kind in self.kinds.items():
            by.setdefault(kind, []).append(names.get(cid, cid[:12]))
        parts = [f"sum {self.summed}"]
        if self.init_max:
            parts.append(f"init max {self.init_max}")
        text = f"max({', '.join(parts)})" if len(parts) > 1 else parts[0]
        text += f" + overhead {self.overhead}" if self.overhead else ""
        detail = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(by.items()))
        return f"{text} [{detail}]" if detail else text


def finished_before(e: ContainerLife, later: ContainerLife) -> bool | None:
    """Did e finish before ``later`` was created? None when what is known cannot tell."""
    if e.finished_at and later.created_at:  # both on the runtime's clock
        return e.finished_at <= later.created_at
    if e.exited_by and later.create_start and e.exited_by <= later.create_start:
        return True  # seen exited before the CreateContainer began
    if e.alive_at and later.exists_at and e.alive_at >= later.exists_at:
        return False  # seen not finished while the later one existed
    if e.alive_gen and later.first_gen and e.alive_gen >= later.first_gen:
        return False  # listed not exited in a listing that (or an earlier one) had the later one
    return None


def pod_request(containers: Iterable[ContainerLife], overhead: int = 0) -> PodRequest:
    """The pod's memory request from what is known of its containers.

    The rule (CRI does not say which container is an init container):
    * containers restarted under the same name replace earlier attempts (the newest counts);
    * a container that EXITED while a container of the same pod was created after it
      finished is an ordinary init container: the kubelet creates the next init container,
      and the regular ones, only after it ended -- counted by max;
    * a container known not to have finished when every later container was created is
      summed (a regular container or a sidecar), and so is the newest container;
    * a container for which that cannot be told yet (its state was not observed since a
      later container was created) is counted like an init container: max() never exceeds
      the sum, so the pod value can only come out lower than the truth, never higher.
    Pod request = max(sum of summed, max over init containers of (its request + the summed
    containers created before it, i.e. the sidecars it runs beside)) + overhead.
    """
    containers = sorted(containers, key=lambda c: (c.order, c.created_at, c.id))
    newest: dict[str, ContainerLife] = {}
    for c in containers:
        newest[c.name] = c
    kinds: dict[str, str] = {c.id: REPLACED for c in containers if newest.get(c.name) is not c}
    live = [c for c in containers if newest.get(c.name) is c]
    summed: list[ContainerLife] = []
    inits: list[tuple[ContainerLife, str]] = []
    for i, e in enumerate(live):
        answers = [finished_before(e, later) for later in live[i + 1:]]
        if any(a is True for a in answers):
            inits.append((e, INIT))
        elif all(a is False for a in answers):
            summed.append(e)
        else:
            inits.append((e, UNSURE))
    total = sum(c.request for c in summed)
    init_max = 0
    last_init = -1
    for e, kind in inits:
        before = sum(s.request for s in summed if s.order < e.order)
        init_max = max(init_max, e.request + before)
        kinds[e.id] = kind
        last_init = max(last_init, e.order)
    for s in summed:
        kinds[s.id] = SIDECAR if s.order < last_init else REGULAR
    return PodRequest(max(total, init_max) + overhead, total, init_max, overhead, MappingProxyType(kinds))


# -- container requests ------------------------------------------------------------------
def _positive(raw: str | None) -> int | None:
    if raw and raw.isascii() and raw.isdigit() and len(raw) <= 19:
        v = int(raw)
        return v if 0 < v <= MAX_BYTES else None  # beyond int64: absent (the pod sum is capped anyway)
    return None


def request_from_unified(unified: Mapping[str, str]) -> int | None:
    """The request the shim put in a container's unified map: the larger of memory.min and
    memory.low. The shim writes the request in the file its policy protects with, creation and
    every update alike; where it caps memory.min under the container's limit it puts the
    request in memory.low (docs/memory-qos.md, "Protection that never OOM-kills"), so the capped
    memory.min is never read as a lower request. The runtime reports the map back in
    ContainerStatus."""
    values = [v for v in (_positive(unified.get(k)) for k in ("memory.min", "memory.low")) if v is not None]
    return max(values) if values else None


def parse_annotation(annotations: Mapping[str, str]) -> dict | None:
    """The shim's ``memqos.io/request`` annotation of a container, None when absent or not its."""
    raw = annotations.get(CONTAINER_ANNOTATION)
    if not raw or len(raw) > 4096:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    b = doc.get("bytes")
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BYTES:
        return None
    return doc


def note_class(note: Mapping | None) -> str:
    """The class a container was created with, as the shim's annotation records it ("" for none,
    or for a value that is not a class name)."""
    cls = note.get("class") if note else None
    return cls if isinstance(cls, str) and valid_name(cls) else ""


def derive_request(pod: PodFacts, container: ContainerFacts, capacity: int) -> tuple[int, str]:
    """The request as the container decision finds it (pod annotation, kubelet's unified,
    Guaranteed limit, oom_score_adj lower bound) -- for containers the shim did not annotate."""
    q, _ = parse_cgroup_parent(pod.cgroup_parent)
    qos = q if q is not None else qos_from_oom_score_adj(container.oom_score_adj)
    req = resolve_request(pod, container, qos, capacity)
    return req.bytes, f"derived:{req.source.value}"


def container_request(
    unified: Mapping[str, str], annotations: Mapping[str, str], derive: Callable[[], tuple[int, str]]
) -> tuple[int, str, dict | None]:
    """(bytes, source, annotation) -- unified memory.min/low, else the annotation, else derive()."""
    note = parse_annotation(annotations)
    v = request_from_unified(unified)
    if v is not None:
        return v, "unified", note
    if note is not None:
        return note["bytes"], f"annotation:{note.get('source', '')}", note
    b, src = derive()
    return b, src, None
