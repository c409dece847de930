"""NRI's connection multiplexer (containerd/nri pkg/net/multiplex), sans I/O: one stream socket
carries several logical connections, each a byte stream cut into frames.

A frame is an 8-byte header, the connection id (u32 big-endian; 0 is reserved) and the payload
length (u32 big-endian), then the payload. Frames and the messages riding on a connection are
not 1:1: a receiver reassembles each connection's bytes itself.

Outgoing payloads are cut into frames of at most ``SEND_FRAME`` (4096) payload bytes. A Go peer
reads each connection through a 4096-byte ``bufio.Reader``, and its mux refuses (ENOMEM, the
connection dies) a frame larger than the buffer it is reading into, so 4096 is what a Go runtime
can always take. Incoming frames may be anything up to ``MAX_FRAME``: runtimes with NRI v0.8+
send up to 10 + 4 MiB, older ones up to 1 << 24, and Go writers do split large messages.
"""
from __future__ import annotations

import struct

HEADER = struct.Struct(">II")
HEADER_SIZE = HEADER.size  # 8
SEND_FRAME = 4096
MAX_FRAME = 1 << 24  # the largest payload any NRI mux version writes in one frame


class MuxError(Exception):
    """The byte stream cannot be a multiplexer stream (a frame above the limit): close it."""


def encode(conn_id: int, payload: bytes, max_frame: int = SEND_FRAME) -> bytes:
    """``payload`` for ``conn_id`` as frames of at most ``max_frame`` payload bytes each, ready
    to be written in one piece (so frames of two messages on one connection never interleave)."""
    if not 0 < conn_id <= 0xFFFFFFFF:
        raise ValueError(f"mux connection id {conn_id} is out of range (0 is reserved)")
    if max_frame <= 0:
        raise ValueError("max_frame must be positive")
    view = memoryview(payload)
    out = bytearray()
    for start in range(0, len(view), max_frame):
        chunk = view[start:start + max_frame]
        out += HEADER.pack(conn_id, len(chunk))
        out += chunk
    return bytes(out)


class MuxDecoder:
    """Bytes of the socket in, ``(conn_id, payload)`` pairs out, for the connection ids it knows.

    At most one frame is buffered (its header announces the size, checked against
    ``max_frame`` before a byte of the payload is kept), so the buffer never holds more than
    ``HEADER_SIZE + max_frame`` bytes. Frames for other connection ids are dropped and counted,
    as the Go mux does."""

    def __init__(self, conn_ids, max_frame: int = MAX_FRAME):
        self.conn_ids = frozenset(conn_ids)
        self.max_frame = max_frame
        self.dropped_frames = 0  # frames for a connection id nobody reads
        self._buf = bytearray()
        self._want: int | None = None  # payload length of the frame in progress
        self._conn = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def receive_data(self, data: bytes) -> list[tuple[int, bytes]]:
        """Feed socket bytes; returns the complete frames' payloads in order. Raises
        ``MuxError`` on a frame larger than ``max_frame`` (nothing of it is kept)."""
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos = 0
        while True:
            if self._want is None:
                if len(buf) - pos < HEADER_SIZE:
                    break
                conn, length = HEADER.unpack_from(buf, pos)
                if length > self.max_frame:
                    buf.clear()
                    raise MuxError(f"mux frame of {length} bytes for connection {conn} is above the "
                                   f"limit of {self.max_frame}")
                pos += HEADER_SIZE
                self._conn, self._want = conn, length
            if len(buf) - pos < self._want:
                break
            end = pos + self._want
            if self._conn in self.conn_ids:
                if self._want:
                    out.append((self._conn, bytes(buf[pos:end])))
            else:
                self.dropped_frames += 1
            pos, self._want = end, None
        if pos:
            del buf[:pos]
        return out
