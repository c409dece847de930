"""Node state for the pod/QoS/node reconciler: the pods on this node and their containers.

Updated from the CRI calls the proxy observes (RunPodSandbox, CreateContainer,
UpdateContainerResources, UpdatePodSandboxResources, RemoveContainer, StopPodSandbox,
RemovePodSandbox) and rebuilt from the runtime's own listings (``rebuild``). Everything here
runs on the reconciler's thread; nothing here is on the CRI path.

Each observed call is applied as its event (``shim.decision.events``: made by ``shim.cri.events``
from CRI calls, by ``shim.nri.facts`` from NRI requests), one method per event type.
The pod's memory request is the kubelet's rule, ``shim.decision.pod.pod_request``, applied to
the containers kept here.

Departures -- a container removed, a sandbox stopped or removed, a pod or container gone from
the runtime's listing, a request or the overhead lowered by an update -- are kept by pod uid
until the reconciler takes them (``take_departures``): only those let a pod's protection in
force go down (``shim.decision.protection``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from shim.cri.events import call_event, status_seen
from shim.decision.events import (
    ContainerCreated,
    ContainerRemoved,
    ContainerResourcesUpdated,
    ContainerStatusSeen,
    Event,
    PodResourcesUpdated,
    PodSandboxRemoved,
    PodSandboxStarted,
    PodSandboxStopped,
)
from shim.decision import QoSClass, parse_cgroup_parent
from shim.decision.pod import PodRequest, container_request, derive_request, note_class, pod_request, \
    request_from_unified
from shim.transport.hooks import RpcCall

MAX_DEPARTED_PODS = 4096  # pods with departures not yet taken (the reconciler takes them every pass)
MAX_REASONS = 8  # reasons kept per pod


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
    cls: str = ""  # idem: the class it was created with ("" for none)
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
        return self.qos_of(self.cgroup_parent)

    def qos_of(self, cgroup_parent: str, parse=parse_cgroup_parent) -> QoSClass | None:
        """The pod's QoS class given its ``cgroup_parent`` (``parse``: how a cgroup parent is
        read, ``parse_cgroup_parent`` or a cache of it)."""
        q, _ = parse(cgroup_parent)
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


# -- the state ---------------------------------------------------------------------------
class NodeState:
    def __init__(self, capacity: int = 0, unprotected: frozenset[str] = frozenset()):
        self.capacity = capacity
        # classes whose containers are not protected (policy None): they count 0 in the pod sums
        self.unprotected = unprotected
        self.pods: dict[str, PodRecord] = {}
        self.sandbox_pod: dict[str, str] = {}
        self.container_pod: dict[str, str] = {}
        self._order = 0
        self.snap_gen = 0  # number of the last runtime listing applied
        self.departures: dict[str, list[str]] = {}  # pod uid -> why, since the reconciler last took them
        self.departures_dropped = 0  # departures not kept (MAX_DEPARTED_PODS reached): a counter
        self._overflow = False  # some were not kept since the last take

    # -- departures
    def depart(self, uid: str, why: str) -> None:
        """Note that something of pod ``uid`` left (bounded: MAX_DEPARTED_PODS, MAX_REASONS)."""
        reasons = self.departures.get(uid)
        if reasons is None:
            if len(self.departures) >= MAX_DEPARTED_PODS:
                self.departures_dropped += 1
                self._overflow = True
                return
            reasons = self.departures[uid] = []
        if len(reasons) < MAX_REASONS and why not in reasons:
            reasons.append(why)

    def take_departures(self) -> dict[str, tuple[str, ...]]:
        """The departures since the last take (pod uid -> why), and forget them. When some were
        not kept (the bound), every pod known is taken as departed: its value may go down to the
        computed one, rather than a departure lost keeping a value up for good."""
        out = {uid: tuple(r) for uid, r in self.departures.items()}
        if self._overflow:
            why = f"more than {MAX_DEPARTED_PODS} pods had departures before the reconciler's pass"
            for uid in self.pods:
                out.setdefault(uid, (why,))
        self.departures, self._overflow = {}, False
        return out

    def restore_departures(self, departures: Mapping[str, tuple[str, ...]]) -> None:
        """Put taken departures back (their pass could not write every value down)."""
        for uid, reasons in departures.items():
            for why in reasons:
                self.depart(uid, why)

    # -- queries
    def container(self, cid: str) -> ContainerRecord | None:
        uid = self.container_pod.get(cid)
        return self.pods[uid].containers.get(cid) if uid in self.pods else None

    def pod_of_sandbox(self, sid: str) -> PodRecord | None:
        uid = self.sandbox_pod.get(sid)
        return self.pods.get(uid) if uid else None

    def request(self, pod: PodRecord) -> PodRequest:
        """The pod's request; a container of an unprotected class (``unprotected``) counts 0."""
        containers = pod.containers.values()
        if self.unprotected and any(c.cls in self.unprotected for c in containers):
            containers = [replace(c, request=0) if c.cls in self.unprotected else c for c in containers]
        return pod_request(containers, pod.overhead)

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
        pod = self.pods[uid]
        c = pod.containers.pop(cid, None)
        self.depart(uid, f"pod {pod.label()}: container {c.name if c else cid[:12]} removed")
        self._gc(uid)
        return True

    def stop_sandbox(self, sid: str) -> bool:
        pod = self.pod_of_sandbox(sid)
        if pod is None or sid not in pod.sandboxes or not pod.sandboxes[sid].ready:
            return False
        pod.sandboxes[sid].ready = False
        self.depart(pod.uid, f"pod {pod.label()}: sandbox stopped")
        return True

    def remove_sandbox(self, sid: str) -> bool:
        uid = self.sandbox_pod.pop(sid, None)
        if uid is None or uid not in self.pods:
            return False
        pod = self.pods[uid]
        self.depart(uid, f"pod {pod.label()}: sandbox removed")
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
    def apply_call(self, call: RpcCall) -> tuple[bool, str | None]:
        """Apply one finished call (its event, ``shim.cri.events``). Returns (state changed,
        uid of a pod whose container states should be refreshed from the runtime)."""
        event = call_event(call)
        return (False, None) if event is None else self.apply(event)

    def apply(self, event: Event) -> tuple[bool, str | None]:
        """Apply one event: (state changed, uid of a pod to refresh from the runtime)."""
        return _APPLY[type(event)](self, event)

    def sandbox_started(self, e: PodSandboxStarted) -> tuple[bool, str | None]:
        pod = self.upsert_pod(e.pod.uid, e.pod.namespace, e.pod.name, e.pod.annotations)
        self.add_sandbox(pod, SandboxRecord(e.sandbox_id, pod.uid, True, 0, e.pod.cgroup_parent, e.overhead))
        return True, None

    def container_created(self, e: ContainerCreated) -> tuple[bool, str | None]:
        facts = e.pod
        uid = facts.uid
        if not uid:
            return False, None
        pod = self.pods.get(uid)
        if pod is None or not pod.name:
            pod = self.upsert_pod(uid, facts.namespace, facts.name, facts.annotations)
        sid = e.sandbox_id
        if sid not in pod.sandboxes:  # RunPodSandbox not seen (shim restarted since)
            self.add_sandbox(pod, SandboxRecord(sid, uid, True, 0, facts.cgroup_parent, e.overhead))
        b, src, note = container_request(e.unified, e.annotations,
                                         lambda: derive_request(facts, e.kubelet, self.capacity))
        sent = request_from_unified(e.kubelet.unified)
        if src == "unified" and sent is not None and sent > b:  # a kubelet's memory.min the shim lowered
            b, src = sent, "kubelet-unified"                    # (correct-kubelet-min) still states the request
        self.add_container(pod, ContainerRecord(
            id=e.container_id, sandbox_id=sid, name=e.name, attempt=e.attempt,
            request=b, source=src, create_start=e.start_ns, exists_at=e.done_ns,
            qos=str(note.get("qos", "")) if note else "",
            cgroup_parent=str(note.get("cgroup_parent", "")) if note else "",
            cls=note_class(note),
        ))
        return True, uid

    def container_updated(self, e: ContainerResourcesUpdated) -> tuple[bool, str | None]:
        c = self.container(e.container_id)
        if c is None:
            return False, None
        v = request_from_unified(e.unified)
        src = "update:unified"
        sent = request_from_unified(e.kubelet_unified)
        if sent is not None and (v is None or sent > v):  # none sent, or the kubelet's lowered (correct-kubelet-min)
            v, src = sent, "update:kubelet-unified"
        pod = self.pods[self.container_pod[c.id]]
        if v is None and pod.qos is QoSClass.GUARANTEED and e.limit > 0:
            v, src = e.limit, "update:guaranteed-limit"
        if v is None or v == c.request:
            return False, None
        if v < c.request:
            self.depart(pod.uid, f"pod {pod.label()}: container {c.name} request lowered by UpdateContainerResources "
                                 f"({c.request} -> {v})")
        c.request, c.source = v, src
        return True, None

    def pod_updated(self, e: PodResourcesUpdated) -> tuple[bool, str | None]:
        pod = self.pod_of_sandbox(e.sandbox_id)
        if pod is None:
            return False, None
        sb = pod.sandboxes[e.sandbox_id]
        if e.overhead == sb.overhead:
            return False, None
        if e.overhead < sb.overhead:
            self.depart(pod.uid, f"pod {pod.label()}: overhead lowered by UpdatePodSandboxResources "
                                 f"({sb.overhead} -> {e.overhead})")
        sb.overhead = e.overhead
        return True, None

    def container_removed(self, e: ContainerRemoved) -> tuple[bool, str | None]:
        return self.remove_container(e.container_id), None

    def sandbox_stopped(self, e: PodSandboxStopped) -> tuple[bool, str | None]:
        return self.stop_sandbox(e.sandbox_id), None

    def sandbox_removed(self, e: PodSandboxRemoved) -> tuple[bool, str | None]:
        return self.remove_sandbox(e.sandbox_id), None

    def status_seen(self, e: ContainerStatusSeen) -> tuple[bool, str | None]:
        return self.seen(e), None

    # -- runtime status
    def observe_status(self, status: Any, start_ns: int, end_ns: int) -> bool:
        """Take what a ContainerStatus says (start_ns / end_ns: the shim's clock around the
        call)."""
        return self.seen(status_seen(status, start_ns, end_ns))

    def seen(self, e: ContainerStatusSeen) -> bool:
        """created_at, and finished_at for an exited container, or that it had not finished
        when the call began."""
        c = self.container(e.container_id)
        if c is None:
            return False
        before = (c.created_at, c.finished_at, c.exited_by, c.alive_at)
        if e.created_at:
            c.created_at = e.created_at
        if e.exited:
            if e.finished_at:
                c.finished_at = e.finished_at
            if not c.exited_by or e.done_ns < c.exited_by:
                c.exited_by = e.done_ns
        else:
            c.alive_at = max(c.alive_at, e.start_ns)
        return before != (c.created_at, c.finished_at, c.exited_by, c.alive_at)

    def rebuild(self, snapshot: "Snapshot") -> None:
        """Replace the state by what the runtime reported (built aside, then swapped in, so a
        reader on another thread sees the old state or the new one, never a half-built one)."""
        new = NodeState(self.capacity, self.unprotected)
        new.snap_gen = max(self.snap_gen, snapshot.gen)
        for sv in snapshot.sandboxes:
            pod = new.upsert_pod(sv.pod.uid, sv.pod.namespace, sv.pod.name, sv.pod.annotations)
            new.add_sandbox(pod, sv.record)
        for cr in sorted(snapshot.containers, key=lambda c: (c.created_at, c.order, c.id)):
            pod = new.pod_of_sandbox(cr.sandbox_id)
            if pod is None:
                continue  # its sandbox is gone: the container goes with it
            cr.order = 0
            new.add_container(pod, cr)
        self._listing_departures(new)
        self.sandbox_pod, self.container_pod, self._order = new.sandbox_pod, new.container_pod, new._order
        self.snap_gen = new.snap_gen
        self.pods = new.pods

    def _listing_departures(self, new: "NodeState") -> None:
        """What a runtime listing no longer shows: pods, containers, ready sandboxes."""
        for uid, pod in self.pods.items():
            now = new.pods.get(uid)
            if now is None:
                self.depart(uid, f"pod {pod.label()}: gone from the runtime listing")
                continue
            for cid, c in pod.containers.items():
                if cid not in now.containers:
                    self.depart(uid, f"pod {pod.label()}: container {c.name} gone from the runtime listing")
            if pod.active and not now.active:
                self.depart(uid, f"pod {pod.label()}: sandbox not ready in the runtime listing")


@dataclass
class SandboxView:
    """One sandbox of a runtime listing: the record the node state keeps, and its pod's identity
    (a ``PodRecord`` without sandboxes or containers)."""

    record: SandboxRecord
    pod: PodRecord


@dataclass
class Snapshot:
    gen: int = 0
    taken_at: int = field(default_factory=time.time_ns)
    sandboxes: list[SandboxView] = field(default_factory=list)
    containers: list[ContainerRecord] = field(default_factory=list)


_APPLY: dict[type, Callable[[NodeState, Any], tuple[bool, str | None]]] = {
    PodSandboxStarted: NodeState.sandbox_started,
    ContainerCreated: NodeState.container_created,
    ContainerResourcesUpdated: NodeState.container_updated,
    PodResourcesUpdated: NodeState.pod_updated,
    ContainerRemoved: NodeState.container_removed,
    PodSandboxStopped: NodeState.sandbox_stopped,
    PodSandboxRemoved: NodeState.sandbox_removed,
    ContainerStatusSeen: NodeState.status_seen,
}


def listing_snapshot(events, known: NodeState | None, capacity: int, gen: int) -> Snapshot:
    """A runtime listing given as events (``PodSandboxStarted``, ``ContainerCreated``,
    ``ContainerStatusSeen``; e.g. NRI's Synchronize) as the Snapshot ``rebuild`` takes. A
    container the known state has keeps the request it was given there (the listing may carry
    less: no kubelet values on containerd < 2.2)."""
    tmp = NodeState(capacity)
    for e in events:
        tmp.apply(e)
    snap = Snapshot(gen=gen)
    for pod in tmp.pods.values():
        for sb in pod.sandboxes.values():
            snap.sandboxes.append(SandboxView(sb, PodRecord(pod.uid, pod.namespace, pod.name, dict(pod.annotations))))
        for c in pod.containers.values():
            kc = known.container(c.id) if known is not None else None
            if kc is not None and kc.source:
                c.request, c.source, c.qos, c.cgroup_parent = kc.request, kc.source, kc.qos, kc.cgroup_parent
                c.cls = kc.cls or c.cls
                c.create_start = kc.create_start or c.create_start
            c.first_gen = kc.first_gen if kc is not None and kc.first_gen else gen
            if not c.finished_at and not c.exited_by:
                c.alive_gen = gen
            snap.containers.append(c)
    return snap
