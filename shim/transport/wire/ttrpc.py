"""ttrpc (containerd/ttrpc) framing, sans I/O: bytes of one connection in, events out, bytes to
send queued, in the manner of python-hyper/h2. Unary calls only: the NRI protocol has no streams.

A message is a 10-byte header (data length u32, stream id u32, type u8, flags u8; big-endian)
and its data: a ``ttrpc.Request`` in a frame of type 1, a ``ttrpc.Response`` in type 2. The two
envelopes are encoded here by hand (five fields and three); what their payloads mean is the
caller's business. Client-initiated stream ids are odd, start at 1 and go up by 2; a server
refuses an even id or one not above the last with InvalidArgument. Data above ``MAX_DATA``
(4 MiB) is discarded as it arrives, never buffered: a server answers that stream with
ResourceExhausted, a client fails that call, and the connection lives on, as Go's ttrpc does.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER = struct.Struct(">IIBB")
HEADER_SIZE = HEADER.size  # 10
MAX_DATA = 4 << 20
REQUEST, RESPONSE, DATA = 1, 2, 3
FLAG_REMOTE_CLOSED, FLAG_REMOTE_OPEN, FLAG_NO_DATA = 0x1, 0x2, 0x4
# the status codes this module and its callers use (grpc's numbering)
OK, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 2, 3, 4
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14


class OversizedMessage(ValueError):
    """An outgoing message whose data is above the peer's limit (ttrpc >= 1.2.6 refuses too)."""


@dataclass(frozen=True)
class Request:
    service: str
    method: str
    payload: bytes = b""
    timeout_nano: int = 0
    metadata: tuple = ()  # (key, value) pairs


@dataclass(frozen=True)
class Response:
    payload: bytes = b""
    code: int = OK
    message: str = ""


@dataclass(frozen=True)
class RequestReceived:
    stream_id: int
    request: Request


@dataclass(frozen=True)
class ResponseReceived:
    stream_id: int
    response: Response


@dataclass(frozen=True)
class MessageDiscarded:
    """A message that was not delivered: too large, not decodable, a refused stream id, a data
    frame. A server has already queued the error status for it where one is due; a client
    should fail the call waiting on ``stream_id`` with ``code``."""
    stream_id: int
    msg_type: int
    code: int
    reason: str


# -- the protobuf envelope, by hand ------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 / int32: ten bytes of two's complement
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(num: int, value: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(value)) + value


def _fields(data: bytes):
    """(field number, wire type, value) of each field of a protobuf message; value is an int
    for varints and fixed widths, bytes for length-delimited fields."""
    i, n = 0, len(data)

    def varint():
        nonlocal i
        shift = result = 0
        while True:
            if i >= n or shift > 63:
                raise ValueError("truncated or overlong varint")
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    while i < n:
        key = varint()
        num, wtype = key >> 3, key & 7
        if wtype == 0:
            yield num, 0, varint()
        elif wtype in (1, 5):
            width = 8 if wtype == 1 else 4
            if i + width > n:
                raise ValueError("truncated fixed-width field")
            yield num, wtype, int.from_bytes(data[i:i + width], "little")
            i += width
        elif wtype == 2:
            length = varint()
            if i + length > n:
                raise ValueError("truncated length-delimited field")
            yield num, 2, bytes(data[i:i + length])
            i += length
        else:
            raise ValueError(f"unsupported wire type {wtype}")


def _signed(n: int, bits: int = 64) -> int:
    n &= (1 << bits) - 1
    return n - (1 << bits) if n >> (bits - 1) else n


def encode_request(req: Request) -> bytes:
    out = bytearray()
    if req.service:
        out += _field(1, req.service.encode())
    if req.method:
        out += _field(2, req.method.encode())
    if req.payload:
        out += _field(3, req.payload)
    if req.timeout_nano:
        out += _varint(4 << 3) + _varint(req.timeout_nano)
    for key, value in req.metadata:
        kv = (_field(1, key.encode()) if key else b"") + (_field(2, value.encode()) if value else b"")
        out += _field(5, kv)
    return bytes(out)


def decode_request(data: bytes) -> Request:
    service = method = ""
    payload = b""
    timeout = 0
    metadata = []
    for num, wtype, value in _fields(data):
        if num == 1 and wtype == 2:
            service = value.decode()
        elif num == 2 and wtype == 2:
            method = value.decode()
        elif num == 3 and wtype == 2:
            payload = value
        elif num == 4 and wtype == 0:
            timeout = _signed(value)
        elif num == 5 and wtype == 2:
            kv = {n: v.decode() for n, w, v in _fields(value) if w == 2 and n in (1, 2)}
            metadata.append((kv.get(1, ""), kv.get(2, "")))
    return Request(service, method, payload, timeout, tuple(metadata))


def encode_response(resp: Response) -> bytes:
    out = bytearray()
    if resp.code or resp.message:
        status = (_varint(1 << 3) + _varint(resp.code) if resp.code else b"") + \
            (_field(2, resp.message.encode()) if resp.message else b"")
        out += _field(1, status)
    if resp.payload:
        out += _field(2, resp.payload)
    return bytes(out)


def decode_response(data: bytes) -> Response:
    code, message, payload = OK, "", b""
    for num, wtype, value in _fields(data):
        if num == 1 and wtype == 2:
            for snum, swtype, svalue in _fields(value):
                if snum == 1 and swtype == 0:
                    code = _signed(svalue, 32)
                elif snum == 2 and swtype == 2:
                    message = svalue.decode("utf-8", "replace")
        elif num == 2 and wtype == 2:
            payload = value
    return Response(payload, code, message)


def frame(stream_id: int, msg_type: int, data: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(len(data), stream_id, msg_type, flags) + data


# -- one connection ------------------------------------------------------------------------------

class Connection:
    """One ttrpc connection (one side: ``client`` sends requests, otherwise it serves them).

    ``receive_data`` reassembles messages from any cut of the byte stream; at most one message
    of at most ``max_data`` bytes is buffered (a larger one is discarded). Messages sent are
    held to ``max_send``, what a Go peer accepts. ``data_to_send`` returns what is queued."""

    def __init__(self, client: bool, max_data: int = MAX_DATA, max_send: int = MAX_DATA):
        self.client = client
        self.max_data = max_data
        self.max_send = max_send
        self._buf = bytearray()
        self._header: tuple | None = None  # (length, stream id, type, flags) of the message in progress
        self._discard = 0  # bytes of an oversized message still to skip
        self._out = bytearray()
        self._next_stream = 1
        self._last_seen = 0  # server: the highest request stream id accepted
        self.pending: set[int] = set()  # client: streams waiting for their response
        self.discarded = 0  # messages not delivered (MessageDiscarded events and stray responses)

    # sending
    def send_request(self, req: Request) -> int:
        data = encode_request(req)
        if len(data) > self.max_send:
            raise OversizedMessage(f"ttrpc request of {len(data)} bytes is above {self.max_send}")
        stream_id = self._next_stream
        self._next_stream += 2
        self._out += frame(stream_id, REQUEST, data)
        self.pending.add(stream_id)
        return stream_id

    def send_response(self, stream_id: int, resp: Response) -> None:
        data = encode_response(resp)
        if len(data) > self.max_send:
            data = encode_response(Response(code=RESOURCE_EXHAUSTED, message=(
                f"ttrpc: response of {len(data)} bytes is above the limit of {self.max_send}")))
        self._out += frame(stream_id, RESPONSE, data)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    # receiving
    def receive_data(self, data: bytes) -> list:
        events: list = []
        view = memoryview(data)
        if self._discard:
            skip = min(self._discard, len(view))
            self._discard -= skip
            view = view[skip:]
        buf = self._buf
        buf += view
        pos = 0
        while True:
            if self._header is None:
                if len(buf) - pos < HEADER_SIZE:
                    break
                self._header = HEADER.unpack_from(buf, pos)
                pos += HEADER_SIZE
                length, stream_id, msg_type, _ = self._header
                if length > self.max_data:
                    self._header = None
                    skip = min(length, len(buf) - pos)
                    pos += skip
                    self._discard = length - skip
                    events.append(self._refuse(stream_id, msg_type, RESOURCE_EXHAUSTED, (
                        f"ttrpc: message of {length} bytes is above the limit of {self.max_data}")))
                    if self._discard:
                        break
                    continue
            length, stream_id, msg_type, flags = self._header
            if len(buf) - pos < length:
                break
            body = bytes(buf[pos:pos + length])
            pos += length
            self._header = None
            event = self._message(stream_id, msg_type, flags, body)
            if event is not None:
                events.append(event)
        if pos:
            del buf[:pos]
        return events

    def _refuse(self, stream_id: int, msg_type: int, code: int, reason: str) -> MessageDiscarded:
        self.discarded += 1
        if not self.client and msg_type == REQUEST:
            self.send_response(stream_id, Response(code=code, message=reason))
        if self.client:
            self.pending.discard(stream_id)
        return MessageDiscarded(stream_id, msg_type, code, reason)

    def _message(self, stream_id: int, msg_type: int, flags: int, body: bytes):
        if self.client:
            if msg_type != RESPONSE or stream_id not in self.pending:
                self.discarded += 1  # a stray message: Go's client drops it too
                return None
            self.pending.discard(stream_id)
            try:
                return ResponseReceived(stream_id, decode_response(body))
            except ValueError as e:
                return self._refuse(stream_id, msg_type, INTERNAL, f"ttrpc: undecodable response: {e}")
        if msg_type != REQUEST:
            return self._refuse(stream_id, msg_type, UNIMPLEMENTED,
                                f"ttrpc: message type {msg_type} (streams) is not supported")
        if stream_id % 2 != 1:
            return self._refuse(stream_id, msg_type, INVALID_ARGUMENT,
                                "StreamID must be odd for client initiated streams")
        if stream_id <= self._last_seen:
            return self._refuse(stream_id, msg_type, INVALID_ARGUMENT,
                                "StreamID cannot be re-used and must increment")
        self._last_seen = stream_id
        try:
            return RequestReceived(stream_id, decode_request(body))
        except ValueError as e:  # UnicodeDecodeError too
            return self._refuse(stream_id, msg_type, INVALID_ARGUMENT, f"ttrpc: undecodable request: {e}")
