"""The event mask a plugin may subscribe to, per the runtime's NRI version.

ConfigureResponse.events has bit ``1 << (event - 1)`` for each event. A runtime refuses the
plugin ("invalid plugin events") when a bit lies outside its ``ValidEvents``,
``(1 << (LAST - 1)) - 1``: LAST is 12 up to NRI v0.9 (0x7ff) and 15 from v0.10 (0x3fff). A mask
of 0 means "every valid event" to the runtime, so it is never sent.

The version comes from ConfigureRequest.NRI_version (sent from NRI v0.12 on), else from the
runtime's name and version through the tables below (which NRI release each containerd and
CRI-O release ships, from their go.mod files), else it is taken to be the oldest one. What each
of those releases does with ``unified`` on each path (CreateContainer adjustments, UpdateContainer
replies, Synchronize updates) is the table of docs/nri-mode.md, "What the runtimes do with
unified"; the switch the shim takes from it is shim.decision.runtime.
"""
from __future__ import annotations

import re

from shim.nri import api_pb2 as pb

OLDEST = (0, 2, 0)
# (first runtime version, the NRI release it ships), newest first
CONTAINERD = (
    ((2, 3, 0), (0, 12, 0)), ((2, 2, 1), (0, 11, 0)), ((2, 2, 0), (0, 10, 0)), ((2, 0, 0), (0, 8, 0)),
    ((1, 7, 26), (0, 8, 0)), ((1, 7, 16), (0, 6, 1)), ((1, 7, 14), (0, 6, 0)), ((1, 7, 7), (0, 4, 0)),
    ((1, 7, 0), (0, 3, 0)),
)
CRIO = (
    ((1, 35, 0), (0, 11, 0)), ((1, 34, 0), (0, 10, 0)), ((1, 32, 0), (0, 9, 0)), ((1, 31, 0), (0, 6, 1)),
    ((1, 30, 0), (0, 6, 0)), ((1, 29, 0), (0, 5, 0)), ((1, 27, 0), (0, 3, 0)), ((1, 26, 0), (0, 2, 0)),
)
RUNTIMES = {"containerd": CONTAINERD, "cri-o": CRIO, "crio": CRIO}
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = _VERSION.match(text.strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def nri_version(nri: str, runtime_name: str, runtime_version: str) -> tuple[tuple[int, int, int], str]:
    """(the NRI version the runtime speaks, how it was found)."""
    if nri and (v := parse_version(nri)):
        return v, "NRI_version"
    table = RUNTIMES.get(runtime_name.strip().lower())
    rv = parse_version(runtime_version) if table else None
    if rv:
        for first, shipped in table:
            if rv >= first:
                return shipped, f"{runtime_name} {runtime_version}"
    return OLDEST, f"unknown runtime {runtime_name!r} {runtime_version!r}: the oldest NRI assumed"


def last_event(version: tuple[int, int, int]) -> int:
    return pb.LAST if version >= (0, 10, 0) else 12


def valid_events(version: tuple[int, int, int]) -> int:
    return (1 << (last_event(version) - 1)) - 1


def event_bit(event: int) -> int:
    return 1 << (event - 1)


def event_mask(wanted, version: tuple[int, int, int]) -> int:
    """The bits of the ``wanted`` events this runtime knows (those it does not are left out)."""
    mask = 0
    for event in wanted:
        if 0 < event < last_event(version):
            mask |= event_bit(event)
    return mask & valid_events(version)
