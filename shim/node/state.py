"""Node state for the pod/QoS/node reconciler: the pods on this node and their containers.

Updated from the CRI calls the proxy observes (RunPodSandbox, CreateContainer,
UpdateContainerResources, UpdatePodSandboxResources, RemoveContainer, StopPodSandbox,
RemovePodSandbox) and rebuilt from the runtime's own listings (``rebuild``). Everything here
runs on the reconciler's thread; nothing here is on the CRI path.

The pod's memory request is the kubelet's rule (reference section 2): regular containers and
sidecars summed, ordinary init containers by max (each plus the sidecars started before it),
plus pod overhead. CRI never says which container is an init container, so ``pod_request``
infers it from timestamps (see its docstring); when unsure it picks the lower value.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from shim.container.rewriter import CONTAINER_ANNOTATION
from shim.cri import pb
from shim.decision import ContainerFacts, PodFacts, QoSClass, parse_cgroup_parent, resolve_request
from shim.decision.qos import qos_from_oom_score_adj
from shim.transport.hooks import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES, FinishedCall

_RS = "/runtime.v1.RuntimeService/"
RUN_POD_SANDBOX = _RS + "RunPodSandbox"
STOP_POD_SANDBOX = _RS + "StopPodSandbox"
REMOVE_POD_SANDBOX = _RS + "RemovePodSandbox"
REMOVE_CONTAINER = _RS + "RemoveContainer"
CONTAINER_STATUS = _RS + "ContainerStatus"
UPDATE_POD_SANDBOX_RESOURCES = _RS + "UpdatePodSandboxResources"
OBSERVED_METHODS = frozenset({
    RUN_POD_SANDBOX, CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES, UPDATE_POD_SANDBOX_RESOURCES,
    REMOVE_CONTAINER, STOP_POD_SANDBOX, REMOVE_POD_SANDBOX,
    CONTAINER_STATUS,  # the kubelet's own polls: when containers were created and finished
})

# container kinds, as inferred
INIT = "init"  # ordinary init container: counted by max
SIDECAR = "sidecar"  # summed, created before an ordinary init container
REGULAR = "regular"  # summed
UNSURE = "unsure"  # state not known: counted like an init container (the lower value)
REPLACED = "replaced"  # an earlier attempt of a container restarted under the same name


@dataclass
class ContainerRecord:
    """A container and what is known of its life. Two clocks are kept apart: ``created_at`` /
    ``finished_at`` come from the runtime's statuses (the runtime's clock: a replayed trace
    carries the recording's); the ``*_at`` fields below them are the shim's own clock
    (time.time_ns) around the calls it observed or made."""

    id: str
    sandbox_id: str
    name: str
    attempt: int = 0
    request: int = 0
    source: str = ""
    qos: str = ""  # from the memqos.io/request annotation, when present
    cgroup_parent: str = ""  # idem
    order: int = 0  # creation order within the node state
    created_at: int = 0  # runtime clock, ns; 0 = not reported yet
    finished_at: int = 0  # runtime clock, ns; 0 = not known to have finished
    create_start: int = 0  # shim clock: the container did not exist before this (CreateContainer began)
    exists_at: int = 0  # shim clock: the container existed at this moment
    exited_by: int = 0  # shim clock: it had finished by this moment (an observation said EXITED)
    alive_at: int = 0  # shim clock: it had not finished at this moment (an observation said so)
    # runtime listings (snapshots) are numbered; one listing is one instant
    first_gen: int = 0  # the first listing it appeared in
    alive_gen: int = 0  # the last listing that showed it not exited


@dataclass
class SandboxRecord:
    id: str
    uid: str
    ready: bool = True
    created_at: int = 0
    cgroup_parent: str = ""
    overhead: int = 0


@dataclass
class PodRecord:
    uid: str
    namespace: str = ""
    name: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    sandboxes: dict[str, SandboxRecord] = field(default_factory=dict)
    containers: dict[str, ContainerRecord] = field(default_factory=dict)

    @property
    def sandbox(self) -> SandboxRecord | None:
        """The sandbox that speaks for the pod: the newest ready one, else the newest."""
        if not self.sandboxes:
            return None
        return max(self.sandboxes.values(), key=lambda s: (s.ready, s.created_at))

    @property
    def active(self) -> bool:
        return any(s.ready for s in self.sandboxes.values())

    @property
    def cgroup_parent(self) -> str:
        sb = self.sandbox
        if sb is not None and sb.cgroup_parent:
            return sb.cgroup_parent
        for c in self.containers.values():
            if c.cgroup_parent:
                return c.cgroup_parent
        return ""

    @property
    def overhead(self) -> int:
        sb = self.sandbox
        return sb.overhead if sb is not None else 0

    @property
    def qos(self) -> QoSClass | None:
        q, _ = parse_cgroup_parent(self.cgroup_parent)
        if q is not None:
            return q
        for c in self.containers.values():
            try:
                return QoSClass(c.qos)
            except ValueError:
                continue
        return None

    def label(self) -> str:
        return f"{self.namespace}/{self.name}" if self.name else self.uid


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


def finished_before(e: ContainerRecord, later: ContainerRecord) -> bool | None:
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


def pod_request(containers: Iterable[ContainerRecord], overhead: int = 0) -> PodRequest:
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
    newest: dict[str, ContainerRecord] = {}
    for c in containers:
        newest[c.name] = c
    kinds: dict[str, str] = {c.id: REPLACED for c in containers if newest.get(c.name) is not c}
    live = [c for c in containers if newest.get(c.name) is c]
    summed: list[ContainerRecord] = []
    inits: list[tuple[ContainerRecord, str]] = []
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


# -- requests --------------------------------------------------------------------------
def _positive(raw: str | None) -> int | None:
    if raw and raw.isascii() and raw.isdigit() and len(raw) <= 19:
        v = int(raw)
        return v if v > 0 else None
    return None


def request_from_unified(unified: Mapping[str, str]) -> int | None:
    """The memory.min (else memory.low) the shim put in a container's unified map: the shim
    writes its request there (policy request/tiered), creation and every update alike, and the
    runtime reports the map back in ContainerStatus."""
    for key in ("memory.min", "memory.low"):
        v = _positive(unified.get(key))
        if v is not None:
            return v
    return None


def parse_annotation(annotations: Mapping[str, str]) -> dict | None:
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
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        return None
    return doc


def derive_request(pod: PodFacts, name: str, resources: Any, capacity: int) -> tuple[int, str]:
    """The request as the container decision finds it (pod annotation, kubelet's unified,
    Guaranteed limit, oom_score_adj lower bound) -- for containers the shim did not annotate."""
    facts = ContainerFacts(
        name=name,
        limit=max(0, resources.memory_limit_in_bytes),
        oom_score_adj=resources.oom_score_adj,
        unified=MappingProxyType(dict(resources.unified)),
    )
    q, _ = parse_cgroup_parent(pod.cgroup_parent)
    qos = q if q is not None else qos_from_oom_score_adj(resources.oom_score_adj)
    req = resolve_request(pod, facts, qos, capacity)
    return req.bytes, f"derived:{req.source.value}"


def container_request(
    unified: Mapping[str, str], annotations: Mapping[str, str], derive
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


def _pod_facts(cfg: Any) -> PodFacts:
    return PodFacts(
        uid=cfg.metadata.uid,
        namespace=cfg.metadata.namespace,
        name=cfg.metadata.name,
        cgroup_parent=cfg.linux.cgroup_parent,
        annotations=MappingProxyType(dict(cfg.annotations)),
    )


def _overhead(linux: Any) -> int:
    if linux.HasField("overhead"):
        return max(0, linux.overhead.memory_limit_in_bytes)
    return 0


# -- the state ---------------------------------------------------------------------------
class NodeState:
    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.pods: dict[str, PodRecord] = {}
        self.sandbox_pod: dict[str, str] = {}
        self.container_pod: dict[str, str] = {}
        self._order = 0
        self.snap_gen = 0  # number of the last runtime listing applied

    # -- queries
    def container(self, cid: str) -> ContainerRecord | None:
        uid = self.container_pod.get(cid)
        return self.pods[uid].containers.get(cid) if uid in self.pods else None

    def pod_of_sandbox(self, sid: str) -> PodRecord | None:
        uid = self.sandbox_pod.get(sid)
        return self.pods.get(uid) if uid else None

    def request(self, pod: PodRecord) -> PodRequest:
        return pod_request(pod.containers.values(), pod.overhead)

    # -- mutations
    def upsert_pod(self, uid: str, namespace: str = "", name: str = "",
                   annotations: Mapping[str, str] | None = None) -> PodRecord:
        pod = self.pods.get(uid)
        if pod is None:
            pod = self.pods[uid] = PodRecord(uid)
        if name:
            pod.namespace, pod.name = namespace, name
        if annotations is not None:
            pod.annotations = dict(annotations)
        return pod

    def add_sandbox(self, pod: PodRecord, sb: SandboxRecord) -> None:
        old = self.sandbox_pod.get(sb.id)
        if old is not None and old != pod.uid and old in self.pods:
            self.pods[old].sandboxes.pop(sb.id, None)
        pod.sandboxes[sb.id] = sb
        self.sandbox_pod[sb.id] = pod.uid

    def add_container(self, pod: PodRecord, c: ContainerRecord) -> None:
        if not c.order:
            self._order += 1
            c.order = self._order
        pod.containers[c.id] = c
        self.container_pod[c.id] = pod.uid

    def remove_container(self, cid: str) -> bool:
        uid = self.container_pod.pop(cid, None)
        if uid is None or uid not in self.pods:
            return False
        self.pods[uid].containers.pop(cid, None)
        self._gc(uid)
        return True

    def stop_sandbox(self, sid: str) -> bool:
        pod = self.pod_of_sandbox(sid)
        if pod is None or sid not in pod.sandboxes or not pod.sandboxes[sid].ready:
            return False
        pod.sandboxes[sid].ready = False
        return True

    def remove_sandbox(self, sid: str) -> bool:
        uid = self.sandbox_pod.pop(sid, None)
        if uid is None or uid not in self.pods:
            return False
        pod = self.pods[uid]
        pod.sandboxes.pop(sid, None)
        for cid in [c.id for c in pod.containers.values() if c.sandbox_id == sid]:
            pod.containers.pop(cid, None)
            self.container_pod.pop(cid, None)
        self._gc(uid)
        return True

    def _gc(self, uid: str) -> None:
        pod = self.pods.get(uid)
        if pod is not None and not pod.sandboxes and not pod.containers:
            del self.pods[uid]

    # -- observed calls
    def apply_call(self, call: FinishedCall) -> tuple[bool, str | None]:
        """Apply one finished, successful call. Returns (state changed, uid of a pod whose
        container states should be refreshed from the runtime)."""
        if call.code != "OK":
            return False, None
        m = call.method
        start_ns = int(call.start * 1e9)
        done_ns = int((call.start + call.duration_ms / 1000.0) * 1e9)
        if m == CONTAINER_STATUS:
            if not call.responses:
                return False, None
            resp = pb.ContainerStatusResponse.FromString(call.responses[0])
            return self.observe_status(resp.status, start_ns, done_ns), None
        if m == RUN_POD_SANDBOX:
            req = pb.RunPodSandboxRequest.FromString(call.request)
            if not call.responses:
                return False, None
            sid = pb.RunPodSandboxResponse.FromString(call.responses[0]).pod_sandbox_id
            cfg = req.config
            if not sid or not cfg.metadata.uid:
                return False, None
            pod = self.upsert_pod(cfg.metadata.uid, cfg.metadata.namespace, cfg.metadata.name, cfg.annotations)
            self.add_sandbox(pod, SandboxRecord(sid, pod.uid, True, 0, cfg.linux.cgroup_parent,
                                                _overhead(cfg.linux)))
            return True, None
        if m == CREATE_CONTAINER:
            if not call.responses:
                return False, None
            cid = pb.CreateContainerResponse.FromString(call.responses[0]).container_id
            if not cid:
                return False, None
            original = pb.CreateContainerRequest.FromString(call.request)
            sent = pb.CreateContainerRequest.FromString(call.forwarded) if call.forwarded else original
            sbc = original.sandbox_config
            uid = sbc.metadata.uid
            if not uid:
                return False, None
            pod = self.pods.get(uid)
            if pod is None or not pod.name:
                pod = self.upsert_pod(uid, sbc.metadata.namespace, sbc.metadata.name, sbc.annotations)
            sid = original.pod_sandbox_id
            if sid not in pod.sandboxes:  # RunPodSandbox not seen (shim restarted since)
                self.add_sandbox(pod, SandboxRecord(sid, uid, True, 0, sbc.linux.cgroup_parent, _overhead(sbc.linux)))
            facts = _pod_facts(sbc)
            res = original.config.linux.resources
            name = original.config.metadata.name
            b, src, note = container_request(
                sent.config.linux.resources.unified, sent.config.annotations,
                lambda: derive_request(facts, name, res, self.capacity),
            )
            self.add_container(pod, ContainerRecord(
                id=cid, sandbox_id=sid, name=name, attempt=original.config.metadata.attempt,
                request=b, source=src, create_start=start_ns, exists_at=done_ns,
                qos=str(note.get("qos", "")) if note else "",
                cgroup_parent=str(note.get("cgroup_parent", "")) if note else "",
            ))
            return True, uid
        if m == UPDATE_CONTAINER_RESOURCES:
            original = pb.UpdateContainerResourcesRequest.FromString(call.request)
            c = self.container(original.container_id)
            if c is None or not original.HasField("linux"):
                return False, None
            sent = pb.UpdateContainerResourcesRequest.FromString(call.forwarded) if call.forwarded else original
            v = request_from_unified(sent.linux.unified)
            src = "update:unified"
            if v is None:
                v = request_from_unified(original.linux.unified)
                src = "update:kubelet-unified"
            pod = self.pods[self.container_pod[c.id]]
            if v is None and pod.qos is QoSClass.GUARANTEED and original.linux.memory_limit_in_bytes > 0:
                v, src = original.linux.memory_limit_in_bytes, "update:guaranteed-limit"
            if v is None or v == c.request:
                return False, None
            c.request, c.source = v, src
            return True, None
        if m == UPDATE_POD_SANDBOX_RESOURCES:
            req = pb.UpdatePodSandboxResourcesRequest.FromString(call.request)
            pod = self.pod_of_sandbox(req.pod_sandbox_id)
            if pod is None or not req.HasField("overhead"):
                return False, None
            sb = pod.sandboxes[req.pod_sandbox_id]
            new = max(0, req.overhead.memory_limit_in_bytes)
            if new == sb.overhead:
                return False, None
            sb.overhead = new
            return True, None
        if m == REMOVE_CONTAINER:
            return self.remove_container(pb.RemoveContainerRequest.FromString(call.request).container_id), None
        if m == STOP_POD_SANDBOX:
            return self.stop_sandbox(pb.StopPodSandboxRequest.FromString(call.request).pod_sandbox_id), None
        if m == REMOVE_POD_SANDBOX:
            return self.remove_sandbox(pb.RemovePodSandboxRequest.FromString(call.request).pod_sandbox_id), None
        return False, None

    # -- runtime status
    def observe_status(self, status: Any, start_ns: int, end_ns: int) -> bool:
        """Take what a ContainerStatus says (start_ns / end_ns: the shim's clock around the
        call): created_at, and finished_at for an exited container, or that it had not
        finished when the call began."""
        c = self.container(status.id)
        if c is None:
            return False
        before = (c.created_at, c.finished_at, c.exited_by, c.alive_at)
        if status.created_at:
            c.created_at = status.created_at
        if status.state == pb.CONTAINER_EXITED:
            if status.finished_at:
                c.finished_at = status.finished_at
            if not c.exited_by or end_ns < c.exited_by:
                c.exited_by = end_ns
        else:
            c.alive_at = max(c.alive_at, start_ns)
        return before != (c.created_at, c.finished_at, c.exited_by, c.alive_at)

    def rebuild(self, snapshot: "Snapshot") -> None:
        """Replace the state by what the runtime reported (built aside, then swapped in, so a
        reader on another thread sees the old state or the new one, never a half-built one)."""
        new = NodeState(self.capacity)
        new.snap_gen = max(self.snap_gen, snapshot.gen)
        for sv in snapshot.sandboxes:
            pod = new.upsert_pod(sv.uid, sv.namespace, sv.name, sv.annotations)
            new.add_sandbox(pod, SandboxRecord(sv.id, sv.uid, sv.ready, sv.created_at, sv.cgroup_parent, sv.overhead))
        for cr in sorted(snapshot.containers, key=lambda c: (c.created_at, c.order, c.id)):
            pod = new.pod_of_sandbox(cr.sandbox_id)
            if pod is None:
                continue  # its sandbox is gone: the container goes with it
            cr.order = 0
            new.add_container(pod, cr)
        self.sandbox_pod, self.container_pod, self._order = new.sandbox_pod, new.container_pod, new._order
        self.snap_gen = new.snap_gen
        self.pods = new.pods


@dataclass
class SandboxView:
    id: str
    uid: str
    namespace: str = ""
    name: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    created_at: int = 0
    cgroup_parent: str = ""
    overhead: int = 0


@dataclass
class Snapshot:
    gen: int = 0
    taken_at: int = field(default_factory=time.time_ns)
    sandboxes: list[SandboxView] = field(default_factory=list)
    containers: list[ContainerRecord] = field(default_factory=list)
