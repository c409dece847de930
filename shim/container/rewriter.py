"""Container memory QoS on the CRI path: rewrites the `unified` map of CreateContainer
and UpdateContainerResources (the transport's CallHooks) and audits every decision.

Parsing and deciding happen here; the arithmetic is in shim.decision. Any error
forwards the kubelet's original bytes and leaves a fail-open audit record.

In observe (``shim.effects.rollout``) every call is parsed, decided and audited as in enforce
(the record tagged ``"rollout": "observe"``), and the kubelet's own bytes go upstream. The
call keeps the message as enforce would have sent it (``Rewritten.parsed``, with the decision),
so the node state is fed what enforce would have made of the call.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from json.encoder import encode_basestring_ascii as _json_string
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

from shim.cri import pb
from shim.cri.events import ContainerRemoved, PodSandboxRemoved, call_event, created_container_id
from shim.cri.facts import container_facts, pod_facts
from shim.cri.methods import CREATE_CONTAINER, REMOVE_CONTAINER, REMOVE_POD_SANDBOX, UPDATE_CONTAINER_RESOURCES
from shim.decision import Decision, NodeFacts, PodFacts, Policy, QoSClass, Request, RequestSource, decide
from shim.decision.classes import EMPTY_TABLE, NO_CLASS, ClassChoice, ClassTable, ContainerSettings, choose_class, \
    remembered, with_swap
from shim.cri.rewritten import Rewritten
from shim.decision.memory import kernel_values
from shim.decision.pod import CONTAINER_ANNOTATION
from shim.effects.rollout import OBSERVE, Rollout
from shim.transport.hooks import RpcCall

log = logging.getLogger(__name__)
ERROR_LOG_INTERVAL = 10.0  # seconds between two logged policy errors (each is audited)


class KnownContainer(NamedTuple):
    """What UpdateContainerResources needs and does not carry: remembered at creation
    (immutable; a tuple: made on every CreateContainer, and cheaper to make than a frozen
    dataclass)."""

    sandbox_id: str
    name: str
    pod: PodFacts
    qos: QoSClass
    request: Request
    # the shim's memory.* keys as the container's cgroup holds them once the runtime applied the
    # last decision it answered OK for (creation, then each UpdateContainerResources); the
    # monitor reports a cgroup that holds something else
    unified: Mapping[str, str] = MappingProxyType({})
    limit: int = 0  # the memory limit in force (0: none), from creation and updates that carry one
    cls: str | None = None  # the class it was created with (shim.decision.classes), None: the node's settings


def without_limit(update: Any, known: KnownContainer | None) -> bool:
    """Whether an UpdateContainerResources leaves out the memory limit of a container known to
    have one (the runtime keeps the limit in force: a zero field changes nothing)."""
    return known is not None and known.limit > 0 and update.linux.memory_limit_in_bytes <= 0


def _create_base(pod: PodFacts, name: str, sandbox_id: str) -> dict:
    return {
        "method": "CreateContainer",
        "pod": f"{pod.namespace}/{pod.name}",
        "pod_uid": pod.uid,
        "container": name,
        "sandbox_id": sandbox_id,
    }


def container_note(request_bytes: int, source: str, qos: str, cgroup_parent: str, cls: str | None = None) -> str:
    """The ``memqos.io/request`` annotation: compact JSON, exactly as
    ``json.dumps({...}, separators=(",", ":"))`` writes it (the strings escaped by the same
    encoder), without building a dict and an encoder per container. ``cls``: the class the
    container was created with, a field ``class`` only when it has one."""
    note = '{"bytes":%s,"source":%s,"qos":%s,"cgroup_parent":%s' % (
        int.__repr__(int(request_bytes)), _json_string(source), _json_string(qos), _json_string(cgroup_parent))
    return note + (',"class":%s}' % _json_string(cls) if cls is not None else "}")


def _observed_record(build: Callable[[], dict]) -> dict:
    record = build()
    record["rollout"] = OBSERVE
    return record


def observed(audit: Any) -> Any:
    """A call's audit record (a dict, or a callable that builds it) tagged as made in observe."""
    if callable(audit):
        return partial(_observed_record, audit)
    if isinstance(audit, dict):
        audit["rollout"] = OBSERVE
    return audit


def container_keys(ownership) -> Mapping[str, str]:
    """The container keys the kubelet owns, as ``decide`` takes them: ``Ownership.container_keys``
    (resolved per container), or the keys of an ownership that only names them."""
    if ownership is None:
        return MappingProxyType({})
    keys = getattr(ownership, "container_keys", None)
    return keys() if keys is not None else MappingProxyType(ownership.kubelet_keys())


def _apply(resources: Any, decision: Decision) -> None:
    unified = resources.unified
    unified.clear()
    for key, value in decision.unified_after.items():  # (a protobuf map's update() is the slow generic one)
        unified[key] = value


class ContainerMemoryQoS:
    """CallHooks for the two rewritten methods (``held_methods``).

    ``rewrite`` leaves on the call (``call.rewritten``, one ``Rewritten``) what ``finished``
    needs: the audit record (``audit``, built in finished, a callable until then: the relay runs
    finished after the kubelet has its answer, so the call does not wait for the record), the
    container to remember once the runtime named it (``memo``), the decision and the parsed
    request (as sent).

    `enabled=False` (cgroup v1, or policy off) forwards everything untouched; the
    reason is logged once."""

    held_methods = frozenset({CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES})

    def __init__(
        self,
        node: NodeFacts,
        policy: Policy,
        emit: Callable[[dict], None],
        *,
        enabled: bool = True,
        disabled_reason: str = "",
        ownership=None,
        rollout: Rollout | None = None,
        classes: ClassTable = EMPTY_TABLE,
        guard_action: str = "relax",
        reclaim: bool = False,
    ):
        self.node = node
        self.policy = policy
        # the classes a pod may ask for (config classes / namespace-classes) and every class's
        # settings over the node's, made once (key None: the node's own)
        self.classes = classes
        self.base = ContainerSettings(None, node, policy, guard_action, reclaim)
        self.class_settings = classes.resolve(self.base)
        # container id -> the class it was created with, for a container this rewriter did not see
        # created (serve wires the reconciler's view: rebuilt from the runtime's listings)
        self.recorded_class: Callable[[str], str | None] | None = None
        # enforce or observe: read once per call (one attribute), switched live by Rollout.set
        self.rollout = rollout if rollout is not None else Rollout()
        # shim.node.kubelet.Ownership: unified keys the kubelet is configured to write are kept
        self.ownership = ownership
        # read once per call on the CRI path; replaced whole (never mutated) by set_ownership;
        # the decision resolves it for each container (shim.decision.kubelet.KubeletKeys)
        self.kubelet_keys = container_keys(ownership)
        self._emit = emit
        self.enabled = enabled
        self.disabled_reason = disabled_reason
        self._warned = False
        self.containers: dict[str, KnownContainer] = {}
        # True: finished() reads RemoveContainer / RemovePodSandbox itself (on the transport's
        # thread) to forget containers; False when the reconciler's thread tells ``forget``
        self.forget_from_calls = True
        # a policy error is logged (with its traceback) at most once per ERROR_LOG_INTERVAL: hostile
        # requests must not flood the log; each one still gets its fail-open audit record
        self._error_logged_at = -ERROR_LOG_INTERVAL
        self.errors_not_logged = 0

    def set_ownership(self, ownership) -> None:
        """Use a new Ownership from the next call on (any thread: the CRI path reads
        ``kubelet_keys`` once per call, and it is replaced in one assignment)."""
        self.ownership = ownership
        self.kubelet_keys = container_keys(ownership)

    def choose(self, pod: PodFacts, name: str) -> tuple[ClassChoice, ContainerSettings]:
        """The class a new container gets from its pod's annotations, and its settings (the
        node's when none is chosen or the annotation is refused)."""
        if not self.classes:
            return NO_CLASS, self.base
        choice = choose_class(self.classes, pod, name)
        return choice, self.class_settings[choice.name]

    def settings_of(self, known: KnownContainer | None, cid: str = "") -> tuple[ClassChoice, ContainerSettings]:
        """The class a container was created with, and its settings: the rewriter's memory, else
        (a container created before a restart) what the node state read from its annotation."""
        cls = known.cls if known is not None else None
        if known is None and self.classes and self.recorded_class is not None and cid:
            cls = self.recorded_class(cid)
        if cls is None:
            return NO_CLASS, self.base
        choice = remembered(self.classes, cls)
        return choice, self.class_settings.get(choice.name, self.base)

    # -- CallHooks ---------------------------------------------------------------
    def rewrite(self, call: RpcCall) -> bytes:
        request = call.request
        if not self.enabled:
            self.rewrite_disabled()
            return request
        method = call.method
        observe = self.rollout.observe
        try:
            if method == CREATE_CONTAINER:
                out = self._create(call)
            elif method == UPDATE_CONTAINER_RESOURCES:
                out = self._update(call)
            else:
                return request
            if observe:  # decided and audited as enforce would; the kubelet's bytes go upstream
                note = call.rewritten
                note.audit = observed(note.audit)
                return request
            return out
        except Exception as e:  # fail open: the kubelet's bytes go upstream unchanged
            now = time.monotonic()
            if now - self._error_logged_at >= ERROR_LOG_INTERVAL:
                self._error_logged_at = now
                unsaid, self.errors_not_logged = self.errors_not_logged, 0
                log.exception("policy error on %s; forwarding the request unchanged%s", method,
                              f" ({unsaid} more not logged since the last such line)" if unsaid else "")
            else:
                self.errors_not_logged += 1
            record = {
                "event": "fail-open",
                "method": method.rsplit("/", 1)[-1],
                "error": f"{e.__class__.__name__}: {e}"[:500],
            }
            if observe:
                record["rollout"] = OBSERVE
            call.rewritten = Rewritten(None, None, record)
            return request

    def rewrite_disabled(self) -> None:
        """Say once why nothing is rewritten."""
        if not self._warned:
            self._warned = True
            log.warning("memory QoS injection is off: %s; containers are created as asked", self.disabled_reason)

    def not_rewritten(self, method: str, reason: str) -> None:
        """The transport forwarded a rewritable call without asking rewrite(): audit the fail-open."""
        record = {"event": "fail-open", "method": method.rsplit("/", 1)[-1], "error": reason[:500]}
        if self.rollout.observe:
            record["rollout"] = OBSERVE
        self._emit(record)

    def finished(self, call: RpcCall) -> None:
        """Both parts of a finished call at once: ``remember`` then ``account``."""
        self.remember(call)
        self.account(call)

    def remember(self, call: RpcCall) -> None:
        """The part of ``finished`` that cannot wait, as soon as the call ended (the transport's
        thread): a created container is remembered under the id the runtime gave it, for an
        UpdateContainerResources that may follow at once; the id stays on the call's record."""
        if call.method == CREATE_CONTAINER and call.code == "OK" and call.responses:
            note = call.rewritten
            if note is None:
                return
            cid = created_container_id(call.responses[0])
            if cid:
                note.container_id = cid
                if note.memo is not None:
                    self.containers[cid] = note.memo

    def wants(self, call: RpcCall) -> bool:
        """Whether ``account`` has work for the call: a call it rewrote (or failed open on), and,
        without a reconciler, a removal."""
        return call.rewritten is not None or (
            self.forget_from_calls and (call.method == REMOVE_CONTAINER or call.method == REMOVE_POD_SANDBOX))

    def account(self, call: RpcCall) -> None:
        """The part of ``finished`` that may come later (``shim.container.chain.CallFinisher``):
        the audit record of a held call, completed with how it ended and timed at its end; and,
        without a reconciler, the containers of a removal forgotten."""
        method = call.method
        if method == CREATE_CONTAINER or method == UPDATE_CONTAINER_RESOURCES:
            note = call.rewritten
            if note is None:
                return
            record = note.audit
            if callable(record):
                record = record()
            code = call.code
            record["code"] = code
            if code != "OK":
                record["details"] = call.details[:500]
            if note.container_id:
                record["container_id"] = note.container_id
            record["time"] = call.start + call.duration_ms / 1000.0
            self._emit(record)
            if method == UPDATE_CONTAINER_RESOURCES and code == "OK" and note.decision is not None \
                    and record.get("rollout") != OBSERVE:
                self._updated(note)
        elif (method == REMOVE_CONTAINER or method == REMOVE_POD_SANDBOX) and call.code == "OK" \
                and self.forget_from_calls:  # (no reconciler to tell it)
            try:
                event = call_event(call)
            except Exception:
                return
            if event is not None:
                self.forget(event)

    def _updated(self, note: Rewritten) -> None:
        """The runtime answered OK to an update it decided: the container's cgroup is to hold
        that decision (an update without the container's memory limit is not decided)."""
        cid = note.parsed.container_id if note.parsed is not None else ""
        known = self.containers.get(cid)
        if known is None:
            return
        values = kernel_values(note.decision)
        self.containers[cid] = known._replace(unified=MappingProxyType(values),
                                              limit=max(0, note.parsed.linux.memory_limit_in_bytes))

    def forget(self, event: ContainerRemoved | PodSandboxRemoved) -> None:
        """A container or a sandbox was removed: its containers leave the memory (any thread:
        one dict operation each, the relay thread adds to it meanwhile)."""
        if isinstance(event, ContainerRemoved):
            self.containers.pop(event.container_id, None)
        elif isinstance(event, PodSandboxRemoved):
            sandbox = event.sandbox_id
            for cid, known in list(self.containers.items()):
                if known.sandbox_id == sandbox:
                    self.containers.pop(cid, None)

    # -- the two methods ---------------------------------------------------------
    def _create(self, call: RpcCall) -> bytes:
        request = call.request
        msg = pb.CreateContainerRequest.FromString(request)
        pod = pod_facts(msg.sandbox_config)
        config = msg.config
        name = config.metadata.name
        sandbox_id = msg.pod_sandbox_id
        if not config.HasField("linux") or not config.linux.HasField("resources"):
            call.rewritten = Rewritten(msg, None, {**_create_base(pod, name, sandbox_id), "event": "unchanged",
                                                   "reason": "no linux resources in the request"})
            return request
        resources = config.linux.resources
        owns = self.kubelet_keys
        choice, settings = self.choose(pod, name)
        decision = with_swap(decide(pod, container_facts(name, resources), settings.node, settings.policy,
                                    kubelet_owns=owns), settings)
        owns = decision.kubelet_owns  # this container's
        memo = KnownContainer(sandbox_id, name, pod, decision.qos, decision.request,
                              MappingProxyType(kernel_values(decision, owns)), max(0, decision.limit), choice.name)
        lazy = partial(self._decision_record, _create_base, (pod, name, sandbox_id), decision, owns,
                       settings, choice)
        note = container_note(decision.request.bytes, decision.request.source.value, decision.qos.value,
                              pod.cgroup_parent, choice.name)
        out = request
        changed = decision.changed
        if changed:
            _apply(resources, decision)
        if changed or config.annotations.get(CONTAINER_ANNOTATION) != note:
            config.annotations[CONTAINER_ANNOTATION] = note
            out = msg.SerializeToString()
        call.rewritten = Rewritten(msg, decision, lazy, memo)
        return out

    def _decision_record(self, base: Callable[..., dict], args: tuple, decision: Decision, owns,
                         settings: ContainerSettings | None = None, choice: ClassChoice = NO_CLASS,
                         **extra: Any) -> dict:
        record = self.describe(decision, owns, base(*args), settings, choice)  # (base makes a new dict)
        if extra:
            record.update(extra)
        return record

    def _update(self, call: RpcCall) -> bytes:
        request = call.request
        msg = pb.UpdateContainerResourcesRequest.FromString(request)
        known = self.containers.get(msg.container_id)
        base: dict[str, Any] = {"method": "UpdateContainerResources", "container_id": msg.container_id}
        if known is not None:
            base.update(pod=f"{known.pod.namespace}/{known.pod.name}", pod_uid=known.pod.uid, container=known.name)
        else:
            base.update(pod="", pod_uid="", container="")
        if not msg.HasField("linux"):
            call.rewritten = Rewritten(msg, None, {**base, "event": "unchanged",
                                                   "reason": "no linux resources in the request"})
            return request
        resources = msg.linux
        if without_limit(msg, known) or (known is None and resources.memory_limit_in_bytes <= 0):
            # A zero limit is "unchanged" to the runtime (the CPU manager's cpuset-only update), and a
            # key left out of an update's unified map keeps its value: forwarded as sent, the cgroup
            # keeps the memory values in force (docs/decisions.md, "An update without a memory limit").
            why = (f"no memory limit in the update: the runtime keeps the container's {known.limit} and the memory "
                   "values in force" if known is not None else
                   "container not seen at creation and no memory limit in the update: nothing to decide from "
                   "(fail open)")
            call.rewritten = Rewritten(msg, None, {**base, "event": "unchanged",
                                                   "reason": why + "; the unified map is forwarded as sent"})
            return request
        facts = container_facts(known.name if known else "", resources)
        request_override = None
        if known is not None:
            pod = known.pod
            has_kubelet_value = any(
                facts.unified.get(k, "0") not in ("", "0") for k in ("memory.min", "memory.low")
            )
            if has_kubelet_value:
                request_override = None  # the update carries a new source: discover again
            elif known.qos is QoSClass.GUARANTEED and facts.limit > 0:
                request_override = Request(facts.limit, RequestSource.GUARANTEED_LIMIT)
            else:
                request_override = known.request
            # The cgroup parent fixes the QoS class; the update's oom_score_adj is not needed.
        else:
            pod = PodFacts()  # not seen at creation (shim restarted): QoS from oom_score_adj
            base["note"] = "container not seen at creation: QoS and request from the update alone"
        owns = self.kubelet_keys
        choice, settings = self.settings_of(known, msg.container_id)
        decision = with_swap(decide(pod, facts, settings.node, settings.policy, request_override, reset_absent=True,
                                    kubelet_owns=owns), settings)
        owns = decision.kubelet_owns  # this container's
        extra = {"request_remembered": True} if known is not None and request_override is known.request else {}
        record = partial(self._decision_record, dict, (base,), decision, owns, settings, choice, **extra)
        out = request
        if decision.changed:
            _apply(resources, decision)
            out = msg.SerializeToString()
        call.rewritten = Rewritten(msg, decision, record)
        return out

    def describe(self, d: Decision, owns, into: dict | None = None, settings: ContainerSettings | None = None,
                 choice: ClassChoice = NO_CLASS) -> dict:
        """The decision as the audit record says it (both front ends), added to ``into`` (a new
        dict when None) and returned. ``settings``: the container's (its class's, else the
        node's); on a node with classes the record says the class (``class``, null for none) and
        why an annotation was refused (``class_refused``, ``class_note``)."""
        settings = settings or self.base
        r = {} if into is None else into
        r["event"] = "rewrite" if d.changed else "unchanged"
        r["qos"] = d.qos.value
        r["qos_source"] = d.qos_reason
        request = d.request
        r["request"] = request.bytes
        r["request_source"] = request.source.value
        if request.note:
            r["request_note"] = request.note
        node = settings.node
        r["limit"] = d.limit
        r["allocatable"] = node.allocatable
        r["factor"] = node.factor
        r["page_size"] = node.page_size
        r["policy"] = settings.policy.value
        if self.classes:
            r.update(choice.record())
        if owns:
            r["kubelet_owns"] = sorted(owns)
        r["unified_before"] = dict(d.unified_before)
        r["unified_after"] = dict(d.unified_after)
        r["reasons"] = dict(d.reasons)
        if d.notes:
            r["notes"] = list(d.notes)
        return r
