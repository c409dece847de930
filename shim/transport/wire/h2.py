"""HTTP/2 frames as the relay (``shim.transport.relay``) and the reconciler's unary client
(``unary_client.py``) read and write them: frame types, flags, settings, frame building, the
frame scan (``frames``; the relay's client side reads the 9-byte frame headers in its own loop
and takes a header block's CONTINUATIONs with ``unit_end``), the header-block trim
(``header_block``) and the DATA payload (``data_payload``).

A *unit* is what ``frames`` yields: one frame, or a HEADERS / PUSH_PROMISE frame together with
its CONTINUATION frames (a header block is decoded and forwarded whole, so nothing is ever
written between its frames). Positions are offsets into the caller's buffer; nothing is
copied until the caller asks for a payload."""
from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# error codes (RFC 9113 section 7)
ERR_PROTOCOL = 0x1
ERR_FLOW_CONTROL = 0x3
ERR_FRAME_SIZE = 0x6
ERR_REFUSED_STREAM = 0x7
ERR_CANCEL = 0x8
ERR_ENHANCE_YOUR_CALM = 0xB
MAX_WINDOW = (1 << 31) - 1
DEFAULT_MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE until a peer says otherwise

def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, ftype, flags)) + sid.to_bytes(4, "big") + payload


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, increment.to_bytes(4, "big"))


def setting(ident: int, value: int) -> bytes:
    return ident.to_bytes(2, "big") + value.to_bytes(4, "big")




class ProtocolError(Exception):
    """A peer sent something that cannot be followed (a broken header block, a stray
    CONTINUATION, an undecodable HPACK block, a wrong preface): the connection is lost."""


class H2Error(ProtocolError):
    """A connection error the relay answers with GOAWAY ``code`` before closing: a limit the
    peer went past (``limit`` names it, for the metric and the log) or a flow-control breach."""

    def __init__(self, code: int, limit: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit


def frame_length(data, pos: int) -> int:
    """The payload length in the frame header at ``pos``."""
    return (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]


def continuations(data, p: int, n: int, size: int, count: int, max_frame: int, max_block: int,
                  max_count: int) -> tuple[int, int, int, bool]:
    """Walk the CONTINUATION frames of a header block from ``p`` on (``data[:n]`` arrived so far,
    ``size`` block bytes and ``count`` CONTINUATIONs before ``p``): returns (where the walk
    stopped, size, count, END_HEADERS seen). Each frame is looked at once, as soon as its
    header is there, so a block assembled over many reads costs time linear in its size; a
    frame above ``max_frame``, a block above ``max_block`` bytes or ``max_count``
    CONTINUATIONs raise H2Error before their bytes are kept."""
    while n - p >= 9:
        length = frame_length(data, p)
        if data[p + 3] != CONTINUATION:
            raise ProtocolError("header block interrupted by another frame")
        if length > max_frame:
            raise H2Error(ERR_FRAME_SIZE, "frame_size", f"a {length}-byte CONTINUATION frame (max {max_frame})")
        size += length
        count += 1
        if size > max_block:
            raise H2Error(ERR_ENHANCE_YOUR_CALM, "header_block",
                          f"a header block of more than {max_block} bytes")
        if count > max_count:
            raise H2Error(ERR_ENHANCE_YOUR_CALM, "continuations",
                          f"a header block in more than {max_count} CONTINUATION frames")
        if p + 9 + length > n:
            # counted now, its payload still to come: resume at the frame (counted again then)
            return p, size - length, count - 1, False
        ended = data[p + 4] & END_HEADERS
        p += 9 + length
        if ended:
            return p, size, count, True
    return p, size, count, False


def joined(buf: bytearray, data: bytes, check: bool = True, stream_data: bool = False) -> bytes | None:
    """The kept tail ``buf`` of a peer's earlier bytes followed by ``data``, as bytes; or None
    while the frame at the start of ``buf`` is still incomplete (``data`` is then kept in
    ``buf``: it grows in place, so a large frame arriving in many reads is copied once).
    ``check`` False: no frame to wait for (the connection preface is still being read). With
    ``stream_data``, an unpadded DATA frame counts as soon as its header is there."""
    buf += data
    if check:
        n = len(buf)
        if n < 9:
            return None
        if n < 9 + ((buf[0] << 16) | (buf[1] << 8) | buf[2]):
            if not (stream_data and buf[3] == DATA and not buf[4] & PADDED):
                return None
    return bytes(buf)


def frames(data, pos: int, n: int):
    """The complete units in ``data[pos:n]``, in order: ``(type, flags, stream id, start, end)``
    each, ``end`` past the unit's last frame. Stops before the first unit that has not fully
    arrived; the caller keeps the ``end`` of the last unit it took, which is where the rest
    starts."""
    while n - pos >= 9:
        end = pos + 9 + ((data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2])
        if end > n:
            return
        ftype = data[pos + 3]
        flags = data[pos + 4]
        if ftype == HEADERS or ftype == PUSH_PROMISE:
            if not flags & END_HEADERS:
                end = unit_end(data, end, n)
                if end < 0:
                    return
        elif ftype == CONTINUATION:
            raise ProtocolError("CONTINUATION without HEADERS")
        yield ftype, flags, int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF, pos, end
        pos = end


def unit_end(data, p: int, n: int) -> int:
    """The end of the CONTINUATION frames from ``p`` on up to END_HEADERS, -1 if not all arrived."""
    while True:
        if n - p < 9:
            return -1
        q = p + 9 + ((data[p] << 16) | (data[p + 1] << 8) | data[p + 2])
        if q > n:
            return -1
        if data[p + 3] != CONTINUATION:
            raise ProtocolError("header block interrupted by another frame")
        if data[p + 4] & END_HEADERS:
            return q
        p = q


# flags & TRIMMED == END_HEADERS: a HEADERS frame's payload is its whole header block
TRIMMED = END_HEADERS | PADDED | PRIORITY_FLAG


def header_block(data, ftype: int, flags: int, pos: int, end: int) -> bytes:
    """The header block fragment of the HEADERS / PUSH_PROMISE unit at ``pos``..``end``: the
    first frame's without padding, priority or promised stream id, then every CONTINUATION's.
    A slice of ``data`` (bytes for bytes)."""
    if flags & TRIMMED == END_HEADERS and ftype == HEADERS:  # the usual block: the payload
        return data[pos + 9:end]
    first_end = pos + 9 + ((data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2])
    start = pos + 9
    stop = first_end
    if flags & PADDED:
        if start == stop:
            raise ProtocolError("padded header frame without a pad length")
        stop -= data[start]
        start += 1
    if ftype == PUSH_PROMISE:
        start += 4
    elif flags & PRIORITY_FLAG:
        start += 5
    if start > stop:  # RFC 9113 6.2, 6.6: padding or priority beyond the frame
        raise ProtocolError("header frame padding or priority longer than the frame")
    if first_end == end:
        return data[start:stop]
    block = bytearray(data[start:stop])
    p = first_end
    while p < end:
        q = p + 9 + ((data[p] << 16) | (data[p + 1] << 8) | data[p + 2])
        block += data[p + 9:q]
        p = q
    return bytes(block)


def data_payload(data, flags: int, pos: int, end: int) -> memoryview:
    """A DATA frame's payload without padding, by reference. Padding that leaves no room (or
    no pad length) is a PROTOCOL_ERROR (RFC 9113 6.1)."""
    if flags & PADDED:
        if end - pos < 10 or data[pos + 9] >= end - pos - 9:
            raise ProtocolError("DATA padding as long as the frame or longer")
        return memoryview(data)[pos + 10:end - data[pos + 9]]
    return memoryview(data)[pos + 9:end]


def settings_items(data, start: int, end: int):
    """(identifier, value) of each setting in the SETTINGS payload ``data[start:end]``."""
    for i in range(start, end - 5, 6):
        yield int.from_bytes(data[i:i + 2], "big"), int.from_bytes(data[i + 2:i + 6], "big")


def u31(data, pos: int) -> int:
    """The 31-bit number at ``pos`` (a stream id, a window increment)."""
    return int.from_bytes(data[pos:pos + 4], "big") & 0x7FFFFFFF


def goaway(last_sid: int, code: int = 0) -> bytes:
    """GOAWAY (NO_ERROR unless ``code``) with the last stream id the sender processes."""
    return frame(GOAWAY, 0, 0, last_sid.to_bytes(4, "big") + code.to_bytes(4, "big"))


def rst_stream(sid: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, sid, code.to_bytes(4, "big"))
