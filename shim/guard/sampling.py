"""What the monitor reads from a container's cgroup: the memory.* parsers and one sample
(``Reading``) per container and round; ``MonitorSnapshot`` is the last round, as /metrics shows it."""
from __future__ import annotations

from dataclasses import dataclass, field

from shim.node.view import ContainerRef

EVENTS = ("low", "high", "max", "oom", "oom_kill")


def parse_memory_value(text: str | None) -> int | None | str:
    """'123' -> 123, 'max' -> None; anything else (or no file) -> '?'."""
    if text is None:
        return "?"
    t = text.strip()
    if t == "max":
        return None
    if t.isascii() and t.isdigit():
        return int(t)
    return "?"


def parse_flat_keyed(text: str | None) -> dict[str, int]:
    """memory.events: 'low 0\\nhigh 12\\n...' -> {'low': 0, 'high': 12, ...}."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_pressure(text: str | None) -> dict[str, dict[str, float]]:
    """memory.pressure: 'some avg10=1.00 avg60=0.50 avg300=0.10 total=1234\\nfull ...' ->
    {'some': {'avg10': 1.0, ..., 'total': 1234.0}, 'full': {...}} (total in microseconds)."""
    out: dict[str, dict[str, float]] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        values = {}
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            try:
                values[k] = float(v)
            except ValueError:
                continue
        out[parts[0]] = values
    return out


@dataclass
class Reading:
    """One container's cgroup files as last sampled (what /metrics shows)."""

    ref: ContainerRef
    path: str  # absolute cgroup directory
    t: float
    current: int | None
    min: int | None
    low: int | None
    high: int | None  # None: "max"
    max: int | None  # None: "max"
    events: dict[str, int] = field(default_factory=dict)
    pressure: dict[str, dict[str, float]] = field(default_factory=dict)
    relaxed: bool = False
    reclaimed: int | None = None  # bytes memory.reclaim freed so far (None: reclaim off)
    swap_current: int | None = None  # memory.swap.current (None: not read, or unreadable)


@dataclass
class MonitorSnapshot:
    readings: list[Reading] = field(default_factory=list)
    taken_at: float = 0.0  # time.time()
    duration: float = 0.0  # seconds the sampling took
    containers: int = 0  # containers known (some may have no cgroup yet)
    read_errors: int = 0  # cumulative
    reconciler_lag: float | None = None  # seconds
    idle_reason: str = ""


def reading_from(ref: ContainerRef, path: str, t: float, files: dict[str, str | None]) -> Reading:
    """A Reading of the container's cgroup directory ``path`` from its files (file -> content);
    a value that is "max", missing or unreadable is None."""

    def num(name: str) -> int | None:
        v = parse_memory_value(files.get(name))
        return v if isinstance(v, int) else None

    return Reading(
        ref=ref, path=path, t=t,
        current=num("memory.current"), min=num("memory.min"), low=num("memory.low"),
        high=num("memory.high"), max=num("memory.max"),
        events=parse_flat_keyed(files.get("memory.events")),
        pressure=parse_pressure(files.get("memory.pressure")),
        swap_current=num("memory.swap.current"),
    )
