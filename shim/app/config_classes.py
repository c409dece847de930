"""The config-file keys ``classes`` and ``namespace-classes``: memory QoS classes a pod may ask
for by annotation (shim.decision.classes), parsed and checked strictly at load. An error names
the file, line and key (``config.yaml:4: classes: class 'batch': factor: must be in (0, 1]``),
like every other setting.

``classes`` is a map from a class name (a DNS label) to the settings it changes, named as the
file's keys: ``policy``, ``factor`` (a number in (0, 1] or ``none`` for no memory.high),
``protection-headroom-ratio``, ``protection-headroom-min``, ``guard-action``, ``reclaim``,
``swap``. ``namespace-classes`` maps a namespace (``"*"``: every namespace) to the classes its
pods may use; a namespace listing a class ``classes`` does not define is an error.
"""
from __future__ import annotations

from typing import Any, Callable

from shim.app.config_file import ConfigError
from shim.app.config_parsers import boolean, factor, guard_action, headroom_ratio, policy, quantity
from shim.decision.classes import (
    ALL_NAMESPACES,
    CLASS_KEYS,
    EMPTY_TABLE,
    MAX_NAME,
    ClassTable,
    ContainerClass,
    make_table,
    valid_name,
)

# The settings of this module that change a decision: a recording's header keeps them and replay
# applies them. Each parser also takes back the JSON form of its own result (a dataclass as an
# object of its fields, a tuple as a list), which is how a recording's header holds them.
DECISION_SETTINGS = ("classes", "namespace-classes")
_FIELD_KEYS = {"policy": "policy", "headroom_ratio": "protection-headroom-ratio",
               "headroom_min": "protection-headroom-min", "guard_action": "guard-action", "reclaim": "reclaim",
               "swap": "swap"}

MAX_CLASSES = 64  # classes a node may define
MAX_NAMESPACES = 4096  # namespaces namespace-classes may name


def _parsers() -> dict[str, Callable[[Any], Any]]:
    # (the node's own parsers, so a class's value is read exactly as the node's key is)
    def class_factor(v: Any) -> float | None:
        f = factor(v)
        if f == "auto":
            raise ConfigError("a class's factor is a number in (0, 1] or 'none' ('auto' is the node's)")
        return f

    return {"policy": policy, "factor": class_factor, "protection-headroom-ratio": headroom_ratio,
            "protection-headroom-min": quantity, "guard-action": guard_action, "reclaim": boolean, "swap": boolean}


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not valid_name(v):
        raise ConfigError(f"{what} {v!r} is not a class name: lower-case letters, digits and '-', "
                          f"starting and ending with a letter or digit, at most {MAX_NAME} characters")
    return v


def _from_fields(items: list) -> dict[str, Any]:
    """The JSON form of a parsed ``classes`` (a list of ContainerClass field objects) as the file's map."""
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"expected a map of class name -> settings, not a list holding {item!r:.80}")
        settings = {key: item[f] for f, key in _FIELD_KEYS.items() if item.get(f) is not None}
        if item.get("factor_set"):
            settings["factor"] = "none" if item.get("factor") is None else item["factor"]
        out[item["name"]] = settings
    return out


def parse_classes(v: Any) -> tuple[ContainerClass, ...] | None:
    """The ``classes`` map as a tuple of ContainerClass (sorted by name); None for an empty key."""
    if v is None:
        return None
    if isinstance(v, list):
        v = _from_fields(v)
    if not isinstance(v, dict):
        raise ConfigError(f"expected a map of class name -> settings, not {type(v).__name__}")
    if len(v) > MAX_CLASSES:
        raise ConfigError(f"at most {MAX_CLASSES} classes, not {len(v)}")
    parsers = _parsers()
    out = []
    for name, settings in v.items():
        _name(name, "class")
        if settings is None:
            settings = {}
        if not isinstance(settings, dict):
            raise ConfigError(f"class {name!r}: expected a map of settings, not {type(settings).__name__}")
        fields: dict[str, Any] = {}
        for key, raw in settings.items():
            norm = key.replace("_", "-") if isinstance(key, str) else key
            if norm not in CLASS_KEYS:
                raise ConfigError(f"class {name!r}: unknown setting {key!r}; a class may set {list(CLASS_KEYS)}")
            try:
                value = parsers[norm](raw)
            except ConfigError as e:
                raise ConfigError(f"class {name!r}: {key}: {e}") from None
            if norm == "factor":
                fields["factor_set"], fields["factor"] = True, value
            else:
                fields[{"protection-headroom-ratio": "headroom_ratio", "protection-headroom-min": "headroom_min",
                        "guard-action": "guard_action"}.get(norm, norm)] = value
        out.append(ContainerClass(name, **fields))
    return tuple(sorted(out, key=lambda c: c.name))


def parse_namespace_classes(v: Any) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """The ``namespace-classes`` map as (namespace, class names) pairs; None for an empty key."""
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):  # the JSON form of the result
        v = {p[0]: p[1] for p in v}
    if not isinstance(v, dict):
        raise ConfigError(f"expected a map of namespace -> list of class names, not {type(v).__name__}")
    if len(v) > MAX_NAMESPACES:
        raise ConfigError(f"at most {MAX_NAMESPACES} namespaces, not {len(v)}")
    out = []
    for ns, names in v.items():
        if not isinstance(ns, str) or not (ns == ALL_NAMESPACES or valid_name(ns)):
            raise ConfigError(f"{ns!r} is not a namespace name (a DNS label) or '{ALL_NAMESPACES}'")
        if names is None:
            names = []
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list):
            raise ConfigError(f"namespace {ns!r}: expected a list of class names, not {type(names).__name__}")
        out.append((ns, tuple(sorted({_name(n, f'namespace {ns!r}: class') for n in names}))))
    return tuple(sorted(out))


def class_table(cfg: Any) -> ClassTable:
    """The ClassTable of a Config (EMPTY_TABLE without classes)."""
    classes = getattr(cfg, "classes", None)
    if not classes:
        return EMPTY_TABLE
    return make_table({c.name: c for c in classes}, dict(getattr(cfg, "namespace_classes", None) or ()))


def checked(cfg: Any) -> Any:
    """``cfg`` when its namespace-classes name only classes it defines; else a ConfigError naming
    the namespace-classes key as given."""
    defined = {c.name for c in (cfg.classes or ())}
    for ns, names in cfg.namespace_classes or ():
        missing = [n for n in names if n not in defined]
        if missing:
            raise ConfigError(f"{cfg.setting('namespace-classes')}: namespace {ns!r} lists {missing}, which "
                              f"classes does not define (defined: {sorted(defined)})")
    return cfg


def class_options(cfg: Any) -> dict[str, Any]:
    """The rewriter's (and the NRI handler's) class keyword arguments from a Config: the class
    table and the node's guard action and reclaim, which a class's own override."""
    return {"classes": class_table(cfg), "guard_action": cfg.guard_action, "reclaim": cfg.reclaim}


def unprotected_classes(settings: Any) -> frozenset[str]:
    """The classes whose containers are not protected (their policy None over the node's): they
    count 0 in the reconciler's pod / QoS / kubepods sums."""
    return frozenset(name for name, s in settings.items() if name is not None and not s.protects)
