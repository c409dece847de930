"""Writers: what ``Connection`` writes to. In the shim they are the asyncio transports; for
tests and any other sans-I/O use, ``Buffer``. A writer has ``write(bytes)`` and
``writelines(list)``; ``send`` writes gathered pieces with one call."""
from __future__ import annotations


def send(writer, pieces: list) -> None:
    """Write ``pieces`` (bytes or memoryviews, in order) to ``writer`` in one call, and clear
    the list; nothing when it is empty."""
    if pieces:
        if len(pieces) == 1:
            writer.write(pieces[0])
        else:
            writer.writelines(pieces)
        pieces.clear()


class Buffer:
    """A writer that keeps what is written: ``out`` (``take()`` returns and forgets it);
    ``writes`` counts the writes."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0

    def write(self, data) -> None:
        self.out += data
        self.writes += 1

    def writelines(self, pieces) -> None:
        for p in pieces:
            self.out += p
        self.writes += 1

    def take(self) -> bytes:
        out = bytes(self.out)
        self.out.clear()
        return out
