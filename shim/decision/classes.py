"""Memory QoS classes: named sets of per-container settings the operator defines (config key
``classes``), which a pod asks for by annotation within what its namespace may use (config key
``namespace-classes``). Pure: no I/O, no protobuf, no clock.

A pod asks with ``memqos.io/class`` (every container of the pod) or
``memqos.io/class.<container>`` (one container; wins over the pod's). Only those two keys are
looked up (one dict lookup each, whatever else the pod carries). What is asked is tenant input:
a value that is not a class name (longer than ``MAX_VALUE``, not a DNS label), a class the node
does not define or one the pod's namespace may not use is refused, and the container gets the
node's settings with a note naming why (``ClassChoice.refused``, ``ClassChoice.note``). A class
changes only how the request is protected and throttled (policy, factor, headroom), the guard's
action, reclaim and swap: never the request itself, so no annotation buys memory.min /
memory.low above the container's request (docs/memory-qos.md, "Classes").
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from shim.decision.facts import Decision, NodeFacts, PodFacts, Policy

CLASS_ANNOTATION = "memqos.io/class"  # every container of the pod
CONTAINER_CLASS_PREFIX = "memqos.io/class."  # + container name: that container only
ALL_NAMESPACES = "*"  # the namespace-classes key for every namespace
MAX_VALUE = 253  # an annotation value longer than this is malformed, whatever it holds
MAX_NAME = 63  # a class name is a DNS label: [a-z0-9]([-a-z0-9]*[a-z0-9])?, at most 63
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
NOTE_VALUE_CHARS = 64  # how much of a refused value an audit note quotes

# where a choice came from
FROM_POD = "pod-annotation"
FROM_CONTAINER = "container-annotation"
FROM_MEMORY = "remembered"  # an update or a restart: the class the container was created with

# why an annotation was refused (the reason label of memqos_class_refused_total)
UNKNOWN_CLASS = "unknown-class"
NAMESPACE_NOT_ALLOWED = "namespace-not-allowed"
MALFORMED = "malformed"
REFUSAL_REASONS = (UNKNOWN_CLASS, NAMESPACE_NOT_ALLOWED, MALFORMED)

GUARD_ACTIONS = ("relax", "none")
SWAP_KEY = "memory.swap.max"

# The settings a class may set, named as the config file's keys.
CLASS_KEYS = ("policy", "factor", "protection-headroom-ratio", "protection-headroom-min", "guard-action",
              "reclaim", "swap")


def valid_name(value: str) -> bool:
    """Whether ``value`` is a class name: a DNS label (lower-case letters, digits, '-')."""
    return len(value) <= MAX_NAME and value.isascii() and _NAME.fullmatch(value) is not None


@dataclass(frozen=True)
class ContainerClass:
    """One class as the operator wrote it. A field left at None (``factor``: ``factor_set``
    False) is the node's setting."""

    name: str
    policy: Policy | None = None
    factor_set: bool = False  # whether the class sets factor (None then means no memory.high)
    factor: float | None = None
    headroom_ratio: float | None = None
    headroom_min: int | None = None
    guard_action: str | None = None
    reclaim: bool | None = None
    swap: bool = False

    def settings(self) -> dict[str, Any]:
        """What the class sets, by config key, as the file would say it."""
        out: dict[str, Any] = {}
        if self.policy is not None:
            out["policy"] = self.policy.value
        if self.factor_set:
            out["factor"] = "none" if self.factor is None else self.factor
        if self.headroom_ratio is not None:
            out["protection-headroom-ratio"] = self.headroom_ratio
        if self.headroom_min is not None:
            out["protection-headroom-min"] = self.headroom_min
        if self.guard_action is not None:
            out["guard-action"] = self.guard_action
        if self.reclaim is not None:
            out["reclaim"] = self.reclaim
        if self.swap:
            out["swap"] = True
        return out


@dataclass(frozen=True)
class ContainerSettings:
    """The per-container settings a decision uses: the node's, or a class's over them."""

    cls: str | None  # the class name, None for the node's settings
    node: NodeFacts  # factor, headroom: the class's where it sets them
    policy: Policy
    guard_action: str = "relax"
    reclaim: bool = False
    swap: bool = False

    @property
    def protects(self) -> bool:
        """Whether the container's request is protected (counts in the pod / QoS / kubepods sums)."""
        return self.policy is not Policy.NONE


def apply_class(cls: ContainerClass | None, base: ContainerSettings) -> ContainerSettings:
    """The node's settings ``base`` with what ``cls`` sets over them (``base`` itself for None)."""
    if cls is None:
        return base
    node = base.node
    changes: dict[str, Any] = {}
    if cls.factor_set:
        changes["factor"] = cls.factor
    if cls.headroom_ratio is not None:
        changes["headroom_ratio"] = cls.headroom_ratio
    if cls.headroom_min is not None:
        changes["headroom_min"] = cls.headroom_min
    return ContainerSettings(
        cls=cls.name,
        node=replace(node, **changes) if changes else node,
        policy=cls.policy if cls.policy is not None else base.policy,
        guard_action=cls.guard_action if cls.guard_action is not None else base.guard_action,
        reclaim=cls.reclaim if cls.reclaim is not None else base.reclaim,
        swap=cls.swap,
    )


@dataclass(frozen=True)
class ClassTable:
    """The classes the node defines and which namespaces may use them (frozen)."""

    classes: Mapping[str, ContainerClass] = field(default_factory=lambda: MappingProxyType({}))
    # namespace (or "*") -> the class names its pods may use
    namespaces: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))

    def __bool__(self) -> bool:
        return bool(self.classes)

    def allowed(self, namespace: str, name: str) -> bool:
        """Whether pods of ``namespace`` may use the class ``name``."""
        ns = self.namespaces
        return name in ns.get(namespace, ()) or name in ns.get(ALL_NAMESPACES, ())

    def allowed_in(self, namespace: str) -> tuple[str, ...]:
        """The classes pods of ``namespace`` may use, sorted."""
        return tuple(sorted(set(self.namespaces.get(namespace, ())) | set(self.namespaces.get(ALL_NAMESPACES, ()))))

    def resolve(self, base: ContainerSettings) -> Mapping[str | None, ContainerSettings]:
        """Every class's settings over the node's ``base`` (key None: the node's own), made once."""
        out: dict[str | None, ContainerSettings] = {None: base}
        for name, cls in self.classes.items():
            out[name] = apply_class(cls, base)
        return MappingProxyType(out)


EMPTY_TABLE = ClassTable()


def make_table(classes: Mapping[str, ContainerClass] | None,
               namespaces: Mapping[str, Any] | None) -> ClassTable:
    """A ClassTable from the parsed config keys (names already checked by the config)."""
    return ClassTable(MappingProxyType(dict(classes or {})),
                      MappingProxyType({ns: frozenset(names) for ns, names in (namespaces or {}).items()}))


@dataclass(frozen=True)
class ClassChoice:
    """The class a container gets, where it came from, and why an annotation was refused."""

    name: str | None = None  # the class chosen; None: the node's settings
    source: str = ""  # FROM_POD, FROM_CONTAINER, FROM_MEMORY; "" when none was asked
    refused: str = ""  # UNKNOWN_CLASS, NAMESPACE_NOT_ALLOWED, MALFORMED; "" when not refused
    note: str = ""  # for the audit record: what was asked and why it was refused

    def record(self) -> dict[str, Any]:
        """The audit record's fields for this choice: ``class`` (null when none) and, when an
        annotation was refused, ``class_refused`` and ``class_note``."""
        out: dict[str, Any] = {"class": self.name}
        if self.source and self.name is not None:
            out["class_source"] = self.source
        if self.refused:
            out["class_refused"] = self.refused
            out["class_note"] = self.note
        return out


NO_CLASS = ClassChoice()


def _quoted(value: str) -> str:
    """A refused value as a note quotes it: at most NOTE_VALUE_CHARS characters, escaped."""
    if len(value) <= NOTE_VALUE_CHARS:
        return ascii(value)
    return f"{ascii(value[:NOTE_VALUE_CHARS])}... ({len(value)} characters)"


def choose_class(table: ClassTable, pod: PodFacts, container_name: str) -> ClassChoice:
    """The class a container asks for by annotation, checked against ``table``: the container's
    key ``memqos.io/class.<container>`` wins over the pod's ``memqos.io/class``. Two dict lookups,
    whatever the pod carries; a node without classes looks at nothing (NO_CLASS)."""
    if not table.classes:
        return NO_CLASS
    annotations = pod.annotations
    source = FROM_CONTAINER
    key = CONTAINER_CLASS_PREFIX + container_name if container_name else ""
    value = annotations.get(key) if key else None
    if value is None:
        key, source = CLASS_ANNOTATION, FROM_POD
        value = annotations.get(key)
        if value is None:
            return NO_CLASS
    if not isinstance(value, str) or len(value) > MAX_VALUE or not valid_name(value):
        shown = _quoted(value) if isinstance(value, str) else type(value).__name__
        return ClassChoice(None, source, MALFORMED,
                           f"{key}: {shown} is not a class name (a DNS label of at most {MAX_NAME} "
                           f"characters): the node's settings")
    if value not in table.classes:
        return ClassChoice(None, source, UNKNOWN_CLASS,
                           f"{key}: class {value!r} is not defined on this node: the node's settings")
    namespace = pod.namespace
    if not table.allowed(namespace, value):
        return ClassChoice(None, source, NAMESPACE_NOT_ALLOWED,
                           f"{key}: class {value!r} is not allowed in namespace {_quoted(namespace)} "
                           f"(namespace-classes): the node's settings")
    return ClassChoice(value, source)


def remembered(table: ClassTable, name: Any, namespace: str | None = None) -> ClassChoice:
    """The class a container was created with (its annotation ``memqos.io/request``, the
    rewriter's memory), for an update or a restart: NO_CLASS when none; the node's settings,
    refused with a note, when the node no longer defines it or (``namespace`` given) no longer
    allows it there: the configuration changed since."""
    if name is None:
        return NO_CLASS
    if not isinstance(name, str) or not valid_name(name):
        return ClassChoice(None, FROM_MEMORY, MALFORMED, "the class recorded at creation is not a class name: "
                           "the node's settings")
    if name not in table.classes:
        return ClassChoice(None, FROM_MEMORY, UNKNOWN_CLASS,
                           f"created with class {name!r}, which this node no longer defines: the node's settings")
    if namespace is not None and not table.allowed(namespace, name):
        return ClassChoice(None, FROM_MEMORY, NAMESPACE_NOT_ALLOWED,
                           f"created with class {name!r}, which namespace {_quoted(namespace)} may no longer use: "
                           "the node's settings")
    return ClassChoice(name, FROM_MEMORY)


def with_swap(decision: Decision, settings: ContainerSettings) -> Decision:
    """``decision`` for a container of a swap class (``settings.swap``): ``memory.swap.max: max``
    added when the kubelet sent no memory.swap.max (it left swap to the runtime); a value the
    kubelet sent is kept as sent, never removed, lowered or raised (its NoSwap "0" and its
    LimitedSwap share are the node's swap policy). ``decision`` itself when the class does not
    swap (docs/memory-qos.md, "Swap")."""
    if not settings.swap:
        return decision
    before = decision.unified_before
    reasons = dict(decision.reasons)
    if SWAP_KEY in before:
        reasons[SWAP_KEY] = (f"kubelet's {before[SWAP_KEY][:40]!r} kept: class {settings.cls} allows swap only where "
                             "the kubelet sends no memory.swap.max")
        return replace(decision, reasons=MappingProxyType(reasons))
    after = dict(decision.unified_after)
    after[SWAP_KEY] = "max"
    reasons[SWAP_KEY] = f"max: class {settings.cls} allows swap and the kubelet sent no memory.swap.max"
    return replace(decision, unified_after=MappingProxyType(after), reasons=MappingProxyType(reasons))
