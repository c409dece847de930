"""Giving freed C heap memory back to the system.

glibc keeps memory that was freed (in its arenas, one per thread that allocated) until
``malloc_trim`` is called. The relay trims after start-up and after large messages. The grpc
transport cannot see most of what grpc core allocates: a storm of streams opened and reset at
once (rapid reset) is handled inside grpc core, and the tens of MiB it used stay resident after
the connection is gone. ``HeapTrimmer`` watches the resident size on an interval and trims, in
a worker thread (the call releases the GIL and takes the arenas' locks only briefly), whenever
it grew by ``growth`` bytes since the last trim.
"""
from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger("shim.transport")

_malloc_trim = None
_PAGE = os.sysconf("SC_PAGE_SIZE")


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``): start-up and
    large messages leave freed memory that glibc would otherwise keep."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``); 0 when it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


TRIM_INTERVAL = 5.0  # seconds between two looks at the resident size
TRIM_GROWTH = 16 * 1024 * 1024  # growth since the last trim that makes the next look trim


class HeapTrimmer:
    """Trim the heap when the resident size grew by ``growth`` bytes since the last trim (looked
    at every ``interval`` seconds on the running loop). ``trims``: how many (a public counter)."""

    def __init__(self, interval: float = TRIM_INTERVAL, growth: int = TRIM_GROWTH) -> None:
        self.interval = interval
        self.growth = growth
        self.trims = 0
        self.freed = 0  # bytes the trims took off the resident size
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        base = resident_bytes()
        while True:
            await asyncio.sleep(self.interval)
            now = resident_bytes()
            if now - base < self.growth:
                base = min(base, now)
                continue
            try:
                await loop.run_in_executor(None, trim_heap)
            except Exception:  # noqa: BLE001 - a trim that fails costs memory, never a call
                log.exception("malloc_trim failed")
                return
            base = resident_bytes()
            self.trims += 1
            self.freed += max(0, now - base)
