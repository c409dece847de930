"""Parsers of settings of the options table (shim/app/config.py): the socket, HTTP/2 and NRI
settings', and those of the per-container settings a class may set too (shim/app/config_classes
reads a class's value with the node's parser of the same key). Each takes a flag's text or the
config file's value and returns the setting, or raises a ConfigError that the table's caller
prefixes with the flag or the file, line and key."""
from __future__ import annotations

import re
from typing import Any

from shim.app.config_file import ConfigError
from shim.decision import Policy
from shim.decision.quantity import QuantityError, parse_bytes


def octal_mode(v: Any) -> int:
    """Permission bits written in octal (0600, 600, 0o600); an int is taken as the bits. From the
    config file it gets the text as written (Option.file_text): YAML would read 0600 as 384."""
    if isinstance(v, int) and not isinstance(v, bool):
        mode = v
    else:
        text = str(v).strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{1,4}", text):
            raise ConfigError(f"must be an octal mode, e.g. 0600, not {v!r}")
        mode = int(text, 8)
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"must be permission bits 0000..0777, not {mode:#o}")
    if mode & 0o007:
        raise ConfigError(f"{mode:04o} gives access to other users; refused")
    return mode


def frame_size(v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not an integer: {v!r}")
    if not 16384 <= n <= 16777215:
        raise ConfigError(f"an HTTP/2 frame size is 16384..16777215 (RFC 9113 6.5.2), not {n}")
    return n


def nri_socket(v: Any) -> str:
    text = str(v).strip()
    if text.startswith("unix://"):
        text = text[len("unix://"):]
    if not text.startswith("/"):
        raise ConfigError(f"the NRI socket must be an absolute path, not {v!r}")
    return text


def nri_index(v: Any) -> int:
    try:
        n = int(str(v).strip(), 10)
    except ValueError:
        raise ConfigError(f"an NRI plugin index is a number 0..99, not {v!r}")
    if not 0 <= n <= 99:
        raise ConfigError(f"an NRI plugin index is 0..99 (two digits), not {n}")
    return n


def factor(v: Any) -> float | None | str:
    if v is None or (isinstance(v, str) and v.strip().lower() == "none"):
        return None
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"must be a number in (0, 1], 'auto' or 'none', not {v!r}")
    if not 0 < f <= 1:
        raise ConfigError(f"must be in (0, 1], not {f}")
    return f


def quantity(v: Any) -> int:
    try:
        return parse_bytes(v if isinstance(v, (str, int)) else str(v))
    except QuantityError as e:
        raise ConfigError(str(e))


def boolean(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    t = str(v).strip().lower()
    if t in ("true", "yes", "on", "1"):
        return True
    if t in ("false", "no", "off", "0"):
        return False
    raise ConfigError(f"expected true or false, not {v!r}")


def headroom_ratio(v: Any) -> float:
    try:
        n = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not a number: {v!r}")
    if not 0 <= n < 1:
        raise ConfigError(f"must be in [0, 1): {v!r}")
    return n


def guard_action(v: Any) -> str:
    t = str(v).strip().lower()
    if t not in ("relax", "none"):
        raise ConfigError(f"guard action must be 'relax' or 'none', not {v!r}")
    return t


def policy(v: Any) -> Policy:
    """An upstream memoryReservationPolicy name (Hard, Soft, TieredReservation, None; any case)."""
    try:
        return Policy(str(v))
    except ValueError:
        raise ConfigError(f"policy must be one of {[p.value for p in Policy]} (in any case), not {v!r}")
