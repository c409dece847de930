"""The deciding settings: the options of OPTIONS marked ``decides=True``.

A deciding setting changes what the shim decides from the CRI calls for a container, a pod, a
QoS class or the node (the policy, the factor, the allocatable memory, the page size, the
protection headroom, whether the kubelet's memory.min is corrected, the kubelet's version and
so who owns which value, enforce or observe). `serve --record` writes each one's value into the
recording's header as ``shim.settings.<name>`` (`header_settings`), and `memqos-shim replay`
applies each one with the precedence flag > ``--config`` > header > default (`parse_recorded`).
Both walk the table, so a setting marked later is recorded and replayed without more code.

The contract a marked option keeps: its value has a JSON form (`json_form`: an enum's value, a
mapping as an object, a dataclass as an object of its fields, a sequence or set as a list,
scalars as they are) and its ``parse`` takes that form back to the same value
(tests/test_decides.py checks the default of every marked option). A setting whose start
resolves it further (``factor: auto`` to the kubelet's factor, ``node-allocatable`` unset to
MemTotal minus the reservations, ``page-size`` to the system's, ``kubelet-version: auto`` to the
version found) is recorded with the resolved value: a replay must not resolve it again on
another machine.

Not marked: the settings naming a file whose content the decision uses (``kubelet-config``,
``meminfo``, ``cgroup-root``: the header's ``node`` object carries what was read), and the
settings of parts a replay does not run (the reconciler's switch and how it writes, the
monitor, the guard, reclaim, the transport's limits, the audit log, the recorder).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from shim.app.config import OPTIONS, ConfigError, Option
from shim.app.settings import Config
from shim.decision.quantity import QuantityError

DECIDING: tuple[Option, ...] = tuple(o for o in OPTIONS if o.decides)


def attr(o: Option) -> str:
    """The Config field of an option."""
    return o.name.replace("-", "_")


def json_form(value: Any) -> Any:
    """``value`` as JSON types, in the form the option's parse takes back."""
    if isinstance(value, enum.Enum):
        return json_form(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_form(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): json_form(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_form(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_form(v) for v in value), key=str)
    return str(value)


def header_settings(cfg: Config, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{name: JSON value}`` of every deciding setting, for a recording's header: ``resolved``
    (by option name) holds the values the start resolved further, over ``cfg``'s."""
    resolved = resolved or {}
    return {o.name: json_form(resolved[o.name] if o.name in resolved else getattr(cfg, attr(o)))
            for o in DECIDING}


def parse_recorded(o: Option, value: Any) -> Any:
    """A header's value of the deciding option ``o``, parsed as the config file's would be.
    ConfigError names the header key."""
    if value is None and o.default is None:
        return None
    try:
        return o.parse(value)
    except (ConfigError, QuantityError, TypeError, ValueError) as e:
        raise ConfigError(f"the trace header's shim.settings.{o.name} {value!r}: {e}") from None
