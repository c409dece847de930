"""Container memory QoS as an NRI plugin: the ``shim.nri.handler.Handler`` of `memqos-shim nri`.

The same decision as the CRI rewriter (``shim.container.rewriter``), over NRI's messages
(``shim.nri.facts``): CreateContainer gets ``adjust.linux.resources.unified`` with the keys the
decision sets (keys the kubelet owns are left as they are), UpdateContainer a ContainerUpdate
for the same container, Synchronize updates for the containers that were created without us.
Every answer is audited like the rewriter's, with ``mode: nri``.

In observe (``shim.effects.rollout``) everything is decided and audited as in enforce (the
records tagged ``"rollout": "observe"``, with the ``adjust`` enforce would send) and the answers
are empty: no adjustment, no update. The node events are the ones enforce makes.

What the runtime tells about pods and containers becomes the node state's typed events
(``shim.decision.events``) handed to ``enqueue`` (the reconciler's queue: a put, never a wait);
Synchronize becomes one ``Rebuild`` of the node state, queued before any event after it.

Handlers run on the plugin's event loop while the runtime holds its node-wide lock and waits
(2 s by default): they only parse and decide; their audit records, node events and
confirmations (``shim.container.nri_confirm``: the values answered, looked for in the
container's cgroup) are handed to their threads once the reply is written (``replied``). Our own problems never become an error
status (that fails the pod): they are logged and audited (``fail-open``), and the answer is an
empty adjustment.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from shim.container.nri_confirm import Expected
from shim.container.rewriter import ContainerMemoryQoS, KnownContainer, container_note
from shim.decision import OWNED_KEYS, Decision, NodeFacts, Policy, QoSClass, Request, RequestSource, decide
from shim.decision.memory import NEUTRAL, kernel_values
from shim.decision.classes import NO_CLASS, remembered, with_swap
from shim.decision.pod import CONTAINER_ANNOTATION, parse_annotation
from shim.effects.rollout import Rollout, tag
from shim.nri import api_pb2 as pb
from shim.nri import facts as nf
from shim.nri.handler import DEFAULT_EVENTS, Handler, unified_update

log = logging.getLogger(__name__)

# what the node state needs: the defaults (pods and containers coming and going, resizes), the
# sandboxes stopping, and containers stopping (their finish time: the init-container rule)
NRI_EVENTS = DEFAULT_EVENTS | {pb.STOP_POD_SANDBOX, pb.STOP_CONTAINER}
MAX_CONTAINERS_PER_POD = 1024  # containers of one pod followed as running (a bound, far above any pod)


def keep_in_force(keys: dict[str, str], in_force: Mapping[str, str | None]) -> dict[str, str]:
    """Drop from ``keys`` each memory.min / memory.low the cgroup already holds at or above the
    value decided (a value in force is never lowered); what was kept -> its value."""
    kept = {}
    for key in ("memory.min", "memory.low"):
        want, have = keys.get(key), (in_force.get(key) or "").strip()
        if want is not None and have.isascii() and have.isdigit() and want.isdigit() and int(have) >= int(want):
            if int(have) > int(want):
                kept[key] = have
            del keys[key]
    return kept


def adjustment_keys(decision: Decision, kubelet_owns: Mapping[str, str]) -> dict[str, str]:
    """The unified keys to send so that the container ends up with ``unified_after``: the ones
    that differ from what it has, and, for a key the decision leaves out that the container
    has, its neutral value (an adjustment merges keys, it cannot remove one; "0" / "max" is
    what a cgroup holds when nobody writes the key). Keys the kubelet owns are never sent."""
    before, after = decision.unified_before, decision.unified_after
    out = {k: v for k, v in after.items() if before.get(k) != v and k not in kubelet_owns}
    for key in OWNED_KEYS:
        if key in before and key not in after and key not in kubelet_owns:
            out[key] = NEUTRAL[key]
    return out


class NriMemoryQoS(Handler):
    """The NRI front end's handler. ``containers`` (id -> KnownContainer) is what it decided at
    creation, for resizes and for the monitor (as the rewriter's); ``ownership`` as the
    rewriter's (``set_ownership`` from any thread)."""

    events = frozenset(NRI_EVENTS)

    def __init__(self, node: NodeFacts, policy: Policy, emit: Callable[[dict], None], *,
                 enqueue: Callable[[Any], None] | None = None, ownership=None, enabled: bool = True,
                 disabled_reason: str = "", rebuild: Callable[[list], Any] | None = None,
                 clock: Callable[[], int] = time.time_ns, rollout: Rollout | None = None, confirmer=None,
                 **classes: Any):
        # while a runtime call is answered: what goes to the side threads (audit records, node
        # events, confirmations), handed over once the reply is written (``replied``), so no
        # thread wakes up to compete with the reply for the interpreter
        self._after: list[Callable[[], Any]] | None = None
        # the decision and its audit record are the rewriter's, as they are in proxy mode
        # (``classes``: the rewriter's classes, guard_action and reclaim)
        self.qos = ContainerMemoryQoS(node, policy, self._emit, enabled=enabled, disabled_reason=disabled_reason,
                                      ownership=ownership, rollout=rollout, **classes)
        self.rollout = self.qos.rollout
        self._emit_now = emit
        self._enqueue = enqueue
        self._rebuild = rebuild  # events of a Synchronize -> the reconciler's queue item
        self._clock = clock
        # shim.container.nri_confirm.NriConfirmer: the values answered are confirmed in the kernel
        # (submit: a put, never a wait), and the kernel's values read at Synchronize
        self.confirmer = confirmer
        self.containers: dict[str, KnownContainer] = self.qos.containers
        # sandbox id -> containers created and not stopped (for _running_beside)
        self.running: dict[str, set[str]] = {}
        self.runtime = ""
        self.syncs = 0
        self.errors = 0  # answers that failed open

    @property
    def ownership(self):
        return self.qos.ownership

    @property
    def class_settings(self):
        """Every class's settings over the node's (the rewriter's)."""
        return self.qos.class_settings

    def set_ownership(self, ownership) -> None:
        self.qos.set_ownership(ownership)

    # -- the runtime's calls ---------------------------------------------------------------
    def configure(self, request: pb.ConfigureRequest) -> None:
        self.runtime = f"{request.runtime_name} {request.runtime_version}".strip()
        self._emit({"event": "nri-configure", "mode": "nri", "runtime": self.runtime,
                    "nri_version": request.NRI_version or None,
                    "request_timeout_ms": request.request_timeout or None})

    def create_container(self, pod: pb.PodSandbox, container: pb.Container) -> pb.ContainerAdjustment | None:
        start = self._clock()
        observe = self.rollout.observe
        try:
            adjust, unified, annotations, facts = self._create(pod, container, observe=observe, start=start)
        except Exception as e:  # noqa: BLE001 - fail open: the container is created as asked
            self._failed("CreateContainer", pod, container, e, observe)
            adjust, unified, annotations, facts = None, container.linux.resources.unified, container.annotations, None
        done = self._clock()
        self._event(lambda: nf.container_created(pod, container, unified, annotations, start, done, facts=facts))
        self._running_beside(pod.id or container.pod_sandbox_id, container.id, done)
        if adjust is not None:
            self._confirm(pod, container, adjust.linux.resources.unified, "CreateContainer")
        return None if observe else adjust

    def _running_beside(self, sandbox_id: str, cid: str, at: int) -> None:
        """Every container of the pod created and not stopped is still running when ``cid`` is
        created: said to the node state (``ContainerStatusSeen``, alive at ``at``), which tells
        regular containers and sidecars (summed) from init containers that had finished (max),
        what ContainerStatus polls tell in proxy mode. containerd relays StopContainer for a
        container that exits by itself before its status says EXITED (the task's delete), so
        before the kubelet can create the next container after it."""
        running = self.running.setdefault(sandbox_id, set())
        for other in sorted(running):
            if other != cid:
                self._put(nf.ContainerStatusSeen(other, 0, 0, False, at, at))
        if len(running) < MAX_CONTAINERS_PER_POD:
            running.add(cid)

    def _create(self, pod: pb.PodSandbox, container: pb.Container, method: str = "CreateContainer", *,
                observe: bool = False, start: int | None = None, in_force: Mapping[str, str | None] | None = None):
        """The decision for one container and its adjustment; with ``start`` (the clock when the
        runtime's call reached the handler) the audit record carries ``handler_us``, the handler's
        own time up to the record: facts, decision and the adjustment built. ``in_force``: an
        existing container's memory.* files as its cgroup holds them; a memory.min / memory.low
        there at or above the decision is kept (left out of the adjustment: never lowered)."""
        qos = self.qos
        facts = nf.pod_facts(pod, container)
        kubelet = nf.container_facts(container)
        unified: Mapping[str, str] = kubelet.unified
        annotations: Mapping[str, str] = container.annotations
        if not qos.enabled:
            qos.rewrite_disabled()
            return None, unified, annotations, (facts, kubelet)
        owns = qos.kubelet_keys
        choice, settings = qos.choose(facts, container.name)
        decision = with_swap(decide(facts, kubelet, settings.node, settings.policy, kubelet_owns=owns), settings)
        owns = decision.kubelet_owns  # this container's
        keys = adjustment_keys(decision, owns)
        kept = keep_in_force(keys, in_force) if in_force else {}
        note = container_note(decision.request.bytes, decision.request.source.value, decision.qos.value,
                              facts.cgroup_parent, choice.name)
        adjust = pb.ContainerAdjustment()
        if keys:
            target = adjust.linux.resources.unified
            for key, value in keys.items():  # (a protobuf map's update() is the slow generic one)
                target[key] = value
        if annotations.get(CONTAINER_ANNOTATION) != note:
            adjust.annotations[CONTAINER_ANNOTATION] = note
        self.containers[container.id] = KnownContainer(container.pod_sandbox_id or pod.id, container.name, facts,
                                                       decision.qos, decision.request,
                                                       MappingProxyType(kernel_values(decision, owns)),
                                                       max(0, decision.limit), choice.name)
        self._emit(tag({**self._base(method, pod, container), **qos.describe(decision, owns, None, settings, choice),
                        "event": "rewrite" if keys else "unchanged", "adjust": keys,
                        **({"kept_in_force": kept} if kept else {}),
                        **({"handler_us": (self._clock() - start) // 1000} if start is not None else {})},
                       observe))
        return adjust, {**unified, **keys}, {**annotations, CONTAINER_ANNOTATION: note}, (facts, kubelet)

    def update_container(self, pod: pb.PodSandbox, container: pb.Container,
                         resources: pb.LinuxResources) -> Sequence[pb.ContainerUpdate]:
        observe = self.rollout.observe
        try:
            update, unified = self._update(pod, container, resources, observe)
        except Exception as e:  # noqa: BLE001
            self._failed("UpdateContainer", pod, container, e, observe)
            update, unified = (), resources.unified
        self._event(lambda: nf.container_updated(container.id, unified, resources.unified, resources))
        for u in update:
            self._confirm(pod, container, u.linux.resources.unified, "UpdateContainer")
        return () if observe else update

    def _update(self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources,
                observe: bool = False):
        qos = self.qos
        if not qos.enabled:
            return (), resources.unified
        known = self.containers.get(container.id)
        facts = nf.update_facts(container, resources)
        if facts.limit <= 0 and (known is None or known.limit > 0):
            # A zero limit is "unchanged" to the runtime (the CPU manager's cpuset-only update) and a
            # key left out keeps its value: no adjustment, the cgroup keeps the memory values in force
            # (docs/decisions.md, "An update without a memory limit").
            why = (f"no memory limit in the update: the runtime keeps the container's {known.limit} and the memory "
                   "values in force" if known is not None else
                   "container not seen before and no memory limit in the update: nothing to decide from (fail open)")
            self._emit(tag({**self._base("UpdateContainer", pod, container), "event": "unchanged", "adjust": {},
                            "reason": why}, observe))
            return (), resources.unified
        override = None
        if known is not None:
            kubelet_value = any(facts.unified.get(k, "0") not in ("", "0") for k in ("memory.min", "memory.low"))
            if kubelet_value:
                override = None  # the update carries a new source: discover again
            elif known.qos is QoSClass.GUARANTEED and facts.limit > 0:
                override = Request(facts.limit, RequestSource.GUARANTEED_LIMIT)
            else:
                override = known.request
        owns = qos.kubelet_keys
        pod_facts = nf.pod_facts(pod, container)
        if known is not None:
            choice, settings = qos.settings_of(known)
        else:  # not seen created (the plugin restarted): the class our annotation recorded, if any
            choice, settings = self._recorded_class(container.annotations, pod_facts.namespace)
        decision = with_swap(decide(pod_facts, facts, settings.node, settings.policy, override, reset_absent=True,
                                    kubelet_owns=owns), settings)
        owns = decision.kubelet_owns  # this container's
        keys = adjustment_keys(decision, owns)
        if known is not None and not observe:
            # what the cgroup is to hold once the runtime applied it
            self.containers[container.id] = known._replace(unified=MappingProxyType(kernel_values(decision, owns)),
                                                           limit=max(0, facts.limit))
        self._emit(tag({**self._base("UpdateContainer", pod, container),
                        **qos.describe(decision, owns, None, settings, choice),
                        "event": "rewrite" if keys else "unchanged", "adjust": keys,
                        **({"request_remembered": True} if known is not None and override is known.request else {})},
                       observe))
        if not keys:
            return (), resources.unified
        return [unified_update(container.id, keys)], {**resources.unified, **keys}

    def update_pod_sandbox(self, pod: pb.PodSandbox, overhead: pb.LinuxResources,
                           resources: pb.LinuxResources) -> None:
        self._event(lambda: nf.update_pod_sandbox(pod, overhead))

    def event(self, event: int, pod: pb.PodSandbox, container: pb.Container | None) -> None:
        if event in (pb.STOP_CONTAINER, pb.REMOVE_CONTAINER) and container is not None:
            self.running.get(pod.id or container.pod_sandbox_id, set()).discard(container.id)
            if event == pb.REMOVE_CONTAINER:
                self.containers.pop(container.id, None)
        elif event == pb.REMOVE_POD_SANDBOX:
            self.running.pop(pod.id, None)
            for cid in [c for c, k in self.containers.items() if k.sandbox_id == pod.id]:
                self.containers.pop(cid, None)
        now = self._clock()
        for e in self._safe(lambda: nf.lifecycle_events(event, pod, container, now)) or ():
            self._put(e)

    def synchronize(self, pods: Sequence[pb.PodSandbox],
                    containers: Sequence[pb.Container]) -> Sequence[pb.ContainerUpdate]:
        """The node state is rebuilt from what the runtime lists (queued before any later
        event); containers created while we were away (no ``memqos.io/request`` annotation of
        ours) get our values as updates. Containers we created are left alone: their values
        may be the guard's (a relaxed memory.high) or the kubelet's since."""
        self.syncs += 1
        now = self._clock()
        observe = self.rollout.observe
        by_id = {p.id: p for p in pods}
        events: list = []
        updates: list = []
        for p in pods:
            started = self._safe(lambda: nf.sandbox_started(p))
            if started is not None:
                events.append(started)
        for c in containers:
            pod = by_id.get(c.pod_sandbox_id)
            if pod is None:
                continue
            unified, annotations = c.linux.resources.unified, c.annotations
            if CONTAINER_ANNOTATION in annotations:
                self._safe(lambda: self._remember(pod, c))
            elif c.state != pb.CONTAINER_STOPPED:
                made = self._safe(lambda: self._create(pod, c, "Synchronize", observe=observe,
                                                       in_force=self._in_force(pod, c)),
                                  "Synchronize", pod, c, observe=observe)
                if made is not None:
                    adjust, unified, annotations, _ = made
                    keys = dict(adjust.linux.resources.unified) if adjust is not None else {}
                    if keys:
                        updates.append(unified_update(c.id, keys))
                        self._confirm(pod, c, keys, "Synchronize")
            for make in (lambda: nf.container_created(pod, c, unified, annotations, now, now),
                         lambda: nf.container_seen(c, now, now)):
                e = self._safe(make)
                if e is not None:
                    events.append(e)
        listed = {c.id for c in containers}
        for cid in [cid for cid in self.containers if cid not in listed]:  # removed while we were away
            self.containers.pop(cid, None)
        self.running = {}
        for c in containers:
            if c.state != pb.CONTAINER_STOPPED and c.pod_sandbox_id in by_id:
                self.running.setdefault(c.pod_sandbox_id, set()).add(c.id)
        if self._rebuild is not None:
            self._put(self._rebuild(events))
        self._emit(tag({"event": "nri-synchronize", "mode": "nri", "pods": len(pods), "containers": len(containers),
                        "updates": len(updates)}, observe))
        return [] if observe else updates

    def _remember(self, pod: pb.PodSandbox, c: pb.Container) -> None:
        """A container we created before (our annotation says what was decided): remembered for
        its resizes, as at its creation."""
        note = parse_annotation(c.annotations)
        if note is None or c.id in self.containers:
            return
        try:
            source, qos = RequestSource(note.get("source", "")), QoSClass(note.get("qos", ""))
        except ValueError:
            return
        facts = nf.pod_facts(pod, c)
        choice, _ = self._recorded_class(c.annotations, facts.namespace)
        self.containers[c.id] = KnownContainer(c.pod_sandbox_id or pod.id, c.name, facts, qos,
                                               Request(int(note["bytes"]), source), cls=choice.name)

    def _recorded_class(self, annotations: Mapping[str, str], namespace: str):
        """(ClassChoice, ContainerSettings) of the class our ``memqos.io/request`` annotation
        recorded at creation (the node's settings when none, or when the node no longer
        defines or allows it)."""
        qos = self.qos
        if not qos.classes:
            return NO_CLASS, qos.base
        note = parse_annotation(annotations)
        choice = remembered(qos.classes, note.get("class") if note else None, namespace)
        return choice, qos.class_settings.get(choice.name, qos.base)

    def undecodable(self, method: str, error: str) -> None:
        """A request that does not parse was answered with an empty reply: audited as fail-open."""
        self._emit(tag({"event": "fail-open", "method": method, "mode": "nri", "error": error[:500],
                        "reason": "the request does not parse: answered with no adjustment"}, self.rollout.observe))

    def disconnected(self, reason: str) -> None:
        self._emit({"event": "nri-disconnected", "mode": "nri", "reason": reason[:500]})

    # -- helpers -----------------------------------------------------------------------------
    def _base(self, method: str, pod: pb.PodSandbox, container: pb.Container) -> dict:
        return {"method": method, "mode": "nri", "pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid,
                "container": container.name, "container_id": container.id,
                "sandbox_id": container.pod_sandbox_id or pod.id}

    def _failed(self, method: str, pod: Any, container: Any, e: Exception, observe: bool = False) -> None:
        self.errors += 1
        log.exception("policy error on NRI %s; answering with no adjustment", method)
        record = {"event": "fail-open", "method": method, "mode": "nri",
                  "error": f"{e.__class__.__name__}: {e}"[:500]}
        try:
            record.update(self._base(method, pod, container), event="fail-open")
        except Exception:  # noqa: BLE001 - the record goes out with what is known
            pass
        self._emit(tag(record, observe))

    def _safe(self, fn: Callable[[], Any], method: str = "", pod: Any = None, container: Any = None, *,
              observe: bool = False):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            if method:
                self._failed(method, pod, container, e, observe)
            else:
                self.errors += 1
                log.exception("NRI: cannot make a node event")
            return None

    def _event(self, make: Callable[[], Any]) -> None:
        e = self._safe(make)
        if e is not None:
            self._put(e)

    def _put(self, item: Any) -> None:
        if self._enqueue is not None:
            self._later(self._enqueue, item)

    def _emit(self, record: dict) -> None:
        self._later(self._emit_now, record)

    def _later(self, fn: Callable[[Any], Any], arg: Any) -> None:
        if self._after is None:
            fn(arg)
        else:
            self._after.append(partial(fn, arg))

    def answering(self) -> None:
        """A runtime call is being answered: hand-overs wait for ``replied`` (those of an earlier
        call whose reply was never reported, e.g. a caller without a socket, go first)."""
        if self._after:
            self.replied()
        self._after = []

    def replied(self) -> None:
        """The reply is written: the call's audit records, node events and confirmations go to
        their threads now, in the order they were made."""
        after, self._after = self._after or [], None
        for fn in after:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a full queue or a closed writer must not stop the rest
                log.exception("NRI: handing over after the reply failed")

    def _in_force(self, pod: pb.PodSandbox, c: pb.Container) -> Mapping[str, str | None] | None:
        """The container's memory.* files in its cgroup (cgroupfs reads, no disk), None when
        unknown (no confirmer, no cgroup, a refused path)."""
        if self.confirmer is None or not self.qos.enabled:
            return None
        return self.confirmer.kernel_values(c.id, pod.uid, nf.cgroup_parent(pod, c))

    def _confirm(self, pod: pb.PodSandbox, c: pb.Container, keys: Mapping[str, str], method: str) -> None:
        """Hand the values answered to the confirmer (a put without waiting); not in observe,
        where nothing is answered."""
        if self.confirmer is None or not keys or self.rollout.observe:
            return
        expected = self._safe(lambda: Expected(c.id, pod.uid, nf.cgroup_parent(pod, c),
                                               f"{pod.namespace}/{pod.name}/{c.name}", MappingProxyType(dict(keys)),
                                               method))
        if expected is not None:
            self._later(self.confirmer.submit, expected)

