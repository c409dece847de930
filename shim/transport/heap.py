"""Giving freed C heap memory back to the system.

glibc keeps memory that was freed (in its arenas, one per thread that allocated) until
``malloc_trim`` is called. The relay trims after start-up and after large messages.
"""
from __future__ import annotations

_malloc_trim = None


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
