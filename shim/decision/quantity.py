"""Kubernetes resource quantities ("128Mi", "1G", "1.5Gi", "2e9") as integer bytes, and the
bounds every byte count the shim writes stays within (int64, the node's capacity, allocatable).

Follows resource.Quantity: binary suffixes Ki..Ei, decimal suffixes n u m k M G T P E,
or a decimal exponent; fractional byte counts round up (Quantity.Value()).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, ROUND_CEILING, localcontext

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
# Anything bigger than this is not a memory size on any node; refusing it keeps
# hostile annotations from producing absurd values (and Decimal from huge exponents).
MAX_BYTES = 2**63 - 1


class QuantityError(ValueError):
    pass


def parse_bytes(text: object) -> int:
    """Parse a quantity into a non-negative integer number of bytes, or raise QuantityError."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise QuantityError(f"quantity must be a string, got {type(text).__name__}")
    if isinstance(text, int):
        value = Decimal(text)
    else:
        s = text.strip()
        if len(s) > 64:
            raise QuantityError("quantity too long")
        m = _RE.match(s)
        if not m:
            raise QuantityError(f"not a quantity: {text!r}")
        number, suffix = m.group(1), m.group(2) or ""
        with localcontext() as ctx:
            ctx.prec = 60
            try:
                value = Decimal(number)
                if suffix in _BINARY:
                    value *= _BINARY[suffix]
                elif suffix in _DECIMAL:
                    value *= _DECIMAL[suffix]
                else:
                    exp = int(suffix[1:])
                    if abs(exp) > 30:
                        raise QuantityError(f"exponent out of range: {text!r}")
                    value = value.scaleb(exp)
            except InvalidOperation as e:  # pragma: no cover - regex keeps this out
                raise QuantityError(f"not a quantity: {text!r}") from e
    if value < 0:
        raise QuantityError(f"negative quantity: {text!r}")
    result = int(value.to_integral_value(rounding=ROUND_CEILING))
    if result > MAX_BYTES:
        raise QuantityError(f"quantity out of range: {text!r}")
    return result


def format_bytes(n: int) -> str:
    """Human form for logs and tables: exact binary unit when it divides, else bytes."""
    for suffix, mult in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


# -- bounds ----------------------------------------------------------------------------------
def capacity_bound(capacity: int) -> tuple[int, str]:
    """The most memory any one value may name on this node, and its name: the capacity
    (MemTotal), or MAX_BYTES (int64) when the capacity is not known (0)."""
    return (capacity, "capacity") if 0 < capacity <= MAX_BYTES else (MAX_BYTES, "int64 max")


def allocatable_bound(allocatable: int, capacity: int) -> tuple[int, str]:
    """The most memory the node can give its pods, and its name: allocatable (when known and
    not above the capacity), else the capacity bound."""
    top = capacity_bound(capacity)
    return (allocatable, "allocatable") if 0 < allocatable <= top[0] else top


def clamp(value: int, bound: tuple[int, str], what: str) -> tuple[int, str]:
    """(value, "") when 0 <= value <= the bound; else the value clamped into [0, bound] and the
    note saying so, e.g. "clamped: request 9223372036854775807 above allocatable 8589934592"."""
    ceiling, name = bound
    if 0 <= value <= ceiling:
        return value, ""
    what = f"{what} " if what else ""
    if value > ceiling:
        return ceiling, f"clamped: {what}{value} above {name} {ceiling}"
    return 0, f"clamped: {what}{value} below 0"


#: the base page sizes Linux is built with on the architectures Kubernetes runs on: 4 KiB
#: everywhere, 16 KiB or 64 KiB on arm64, 64 KiB on ppc64le; a huge page is never a base page
PAGE_SIZE_MIN, PAGE_SIZE_MAX = 4096, 65536


def parse_page_size(text: object) -> int:
    """A base page size (a number of bytes or a quantity: 4096, 16Ki) that is a power of two
    from PAGE_SIZE_MIN to PAGE_SIZE_MAX, or QuantityError."""
    try:
        page = parse_bytes(text)
    except QuantityError:
        raise QuantityError(f"not a number of bytes: {text!r}") from None
    if not PAGE_SIZE_MIN <= page <= PAGE_SIZE_MAX or page & (page - 1):
        raise QuantityError(f"{text} is not a page size: a power of two from {PAGE_SIZE_MIN} to {PAGE_SIZE_MAX} "
                            "(4096 on x86-64; 4096, 16384 or 65536 on arm64)")
    return page
