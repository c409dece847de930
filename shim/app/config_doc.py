"""What is generated from the options table OPTIONS: docs/configuration.md's table of settings
and the field block of shim/app/settings.py (``settings_source``).

`scripts/gen-config` writes the rows between the page's BEGIN_TABLE and END_TABLE lines anew
(the prose around them is kept), as it writes the field block of shim/app/settings.py;
tests/test_config.py fails when the committed page is not what this makes.
"""
from __future__ import annotations

import json
import textwrap
from typing import Any

from shim.app.config import FLAG, OPTIONS, Option
from shim.decision import Policy

BEGIN_TABLE = "<!-- the table below is generated from OPTIONS (shim/app/config.py) by scripts/gen-config: begin -->\n"
END_TABLE = "<!-- generated table: end -->\n"

_UNITS = (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def _quantity(n: int) -> str:
    for suffix, size in _UNITS:
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def default_text(o: Option) -> str:
    """A default as the config file would spell it: `Hard`, `64Mi`, `30`, `true`, none."""
    value: Any = o.default
    if value is None:
        return "none"
    if isinstance(value, Policy):
        value = value.value
    elif isinstance(value, bool):
        value = "true" if value else "false"
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, int) and o.metavar == "Q":
        value = _quantity(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


FILE_ONLY = "file only"  # the flag cell of a setting that is a config-file key only


def flag_cell(o: Option) -> str:
    """`--NAME` for a setting that is also a flag of serve and nri, else FILE_ONLY."""
    return f"`--{o.name}`" if o.where == FLAG else FILE_ONLY


def table_rows(options: tuple[Option, ...] = OPTIONS) -> list[str]:
    rows = ["| YAML key | flag | type | default | meaning |", "|---|---|---|---|---|"]
    for o in options:
        rows.append(f"| `{o.name}` | {flag_cell(o)} | `{_cell(o.type)}` | {default_text(o)} | {_cell(o.help)} |")
    return rows


def configuration_doc(text: str, options: tuple[Option, ...] = OPTIONS) -> str:
    """`text` (docs/configuration.md) with the rows between BEGIN_TABLE and END_TABLE made anew
    from the options table; the rest of the page is kept as it is."""
    head, begin, rest = text.partition(BEGIN_TABLE)
    _, end, tail = rest.partition(END_TABLE)
    if not begin or not end:
        raise ValueError("configuration.md: the lines that mark the generated table are missing")
    return head + begin + "\n".join(table_rows(options)) + "\n" + end + tail


def _literal(value: Any) -> str:
    """A default as Python source: Policy.HARD, 64 * 1024 * 1024, "auto"."""
    if isinstance(value, Policy):
        return f"Policy.{value.name}"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int) and not isinstance(value, bool) and value and value % (1024 * 1024) == 0:
        return f"{value // (1024 * 1024)} * 1024 * 1024"
    return repr(value)


BEGIN_FIELDS = "    # -- fields generated from OPTIONS by scripts/gen-config: begin\n"
END_FIELDS = "    # -- fields generated from OPTIONS by scripts/gen-config: end\n"


def settings_source(text: str, options: tuple[Option, ...] = OPTIONS) -> str:
    """`text` (shim/app/settings.py) with the Config fields between its BEGIN_FIELDS and
    END_FIELDS lines made anew from the options table; the rest of the file is kept as it is."""
    head, begin, rest = text.partition(BEGIN_FIELDS)
    _, end, tail = rest.partition(END_FIELDS)
    if not begin or not end:
        raise ValueError("settings.py: the lines that mark the generated fields are missing")
    body = []
    for o in options:
        said = f"--{o.name}" if o.where == FLAG else f"{o.name} (config file only)"
        body += textwrap.wrap(f"{said}: {o.help}", 100, initial_indent="    #: ", subsequent_indent="    #: ")
        body.append(f"    {o.name.replace('-', '_')}: {o.type} = {_literal(o.default)}")
    return head + begin + "\n".join(body) + "\n" + end + tail
