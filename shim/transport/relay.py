"""The fast CRI transport: an HTTP/2 connection relay (``--transport relay``).

Each kubelet connection gets one upstream connection, and the bytes of both directions are
forwarded as they come, frame by frame: SETTINGS, PING, WINDOW_UPDATE, GOAWAY, stream ids and
the HPACK state stay the two peers' own, so there is no HTTP/2 stack and no gRPC call object in
between (grpcio's per-call cost, about half a millisecond here, is what this avoids). What the
relay does on top of forwarding:

* It reads every frame header both ways and decodes every header block (one HPACK decoder per
  direction, ``shim.transport.hpack_lite``) to learn each stream's ``:path`` and
  ``grpc-timeout``, and each answer's ``grpc-status`` / ``grpc-message``. A block that does not
  decode means the HPACK state is lost: the connection is closed (the kubelet reconnects).
* It reassembles the gRPC messages of both directions from DATA frames (a copy to the side,
  never delaying the forward) so that ``CallHooks.finished`` gets the same ``FinishedCall`` as
  from the grpcio transport: request, responses (server streams capped like there), code,
  details, ``forwarded``. ``finished`` runs right after the frame that ends the call was
  written to the kubelet, in the same event-loop callback: off the call's latency, yet before
  the relay reads anything more from any connection (so before the kubelet's next call).
* Bytes that need no change go out before the relay looks at them closely: a client chunk that
  holds no held, dropped or queued DATA is written upstream first and observed after; a large
  server chunk's leading DATA is written before it is copied for the observers, and a DATA
  frame that has not fully arrived is forwarded as far as it has.
* CreateContainer and UpdateContainerResources are held: their HEADERS go upstream at once
  (so the runtime's deadline starts when the kubelet's did), their DATA frames are kept until
  END_STREAM, ``CallHooks.rewrite`` runs on the message and the result is sent re-framed (16 KiB
  frames, the size every peer accepts) within the server's flow-control windows (see "Flow
  control"). Fail-open: a message above
  ``hold_max_bytes`` (or beyond the relay-wide budget ``hold_total_bytes``), a compressed one
  with an unknown encoding, more than one message, a hook that raises or returns no bytes:
  the kubelet's bytes go upstream unchanged.
* ``max_message_bytes`` is enforced like grpc does: a message declared larger (request or
  reply) ends the call with RESOURCE_EXHAUSTED for the kubelet and RST_STREAM upstream.
* When the runtime cannot be reached, the relay answers the connection's calls itself with
  UNAVAILABLE (a minimal HTTP/2 server side), then sends GOAWAY and closes it, so the kubelet's
  next call opens a new connection and tries the runtime again. A refused connection that gets
  no call is closed the same way after ``REFUSED_IDLE_CLOSE`` seconds: grpc-go (the kubelet)
  reconnects at once when a connection closes, so an idle refused one would otherwise still
  refuse its first call long after the runtime is back (grpc-core clients reconnect lazily).

Flow control. The relay only touches the client-to-server direction's windows, and only
because of held streams. It tracks the server's connection window (``s_conn``: what the relay
may still send) and the client's view of it (``c_conn``). Bytes the client sends on a held
stream never reach the server, so the relay gives them back to the client (connection and
stream WINDOW_UPDATE) while holding, else a request larger than the window would stall until
its deadline. The rewritten message (N' bytes instead of N) is then sent only within the
server's windows (the stream's is tracked for held streams), and any client DATA that the
server's window cannot take yet is queued. A raised SETTINGS_INITIAL_WINDOW_SIZE from the server
counts for those stream windows only once the client's ACK of it has gone upstream (grpc-core
resets a stream whose DATA exceeds the acknowledged window); a lowered one counts at once. Server WINDOW_UPDATEs on the connection are passed
on only as far as the server's window exceeds what the client may already send plus what is
queued (``room``), so the client's view never drifts above the server's; when ``room`` grows
(held, dropped or cancelled bytes), the relay grants it to the client itself. Everything else
is forwarded verbatim: what the relay does not understand, it does not touch.
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque

from shim.transport.endpoints import socket_path
from shim.transport.hooks import REWRITTEN_METHODS, CallHooks, FinishedCall, guarded_finished, guarded_rewrite
from shim.transport.wire.grpc import (
    HTTP_STATUS,
    RST_STATUS,
    STATUS_NAMES,
    STATUS_NUMBER,
    percent_decode,
    percent_encode,
)
from shim.transport.wire.h2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_CANCEL,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    window_update,
)
from shim.transport.hpack_lite import CONTENT_TYPE_GRPC, STATUS_200, Decoder, HpackError, literal
from shim.transport.methods import CRI_METHODS_BY_PATH
from shim.transport.unixsock import (
    ThrottledLog,
    bind_private,
    check_socket_mode,
    remove_if_ours,
    resolve_gid,
)

log = logging.getLogger(__name__)

# What FinishedCall keeps of one server stream (as the grpcio transport); the client always
# gets every message.
STREAM_RECORD_MAX_MESSAGES = 1000
STREAM_RECORD_MAX_BYTES = 16 * 1024 * 1024
# A held CreateContainer / UpdateContainerResources up to this size is rewritten: 16 MiB is the
# largest message the kubelet sends (its grpc MaxCallSendMsgSize).
HOLD_MAX_BYTES = 16 * 1024 * 1024
# All streams held at once, over every connection; beyond it new holds fail open.
HOLD_TOTAL_BYTES = 64 * 1024 * 1024
UPSTREAM_CONNECT_TIMEOUT = 10.0
REFUSED_IDLE_CLOSE = 1.0  # seconds a refused connection may stay open without a call
READ_PAUSE_BYTES = 4 * 1024 * 1024  # client bytes buffered while the upstream connects
TRIM_AFTER_BYTES = 4 * 1024 * 1024  # after a call this large, give freed heap memory back (trim_heap)
EARLY_WRITE_BYTES = 32 * 1024  # a server chunk this large gets its leading DATA written before it is observed

TIMEOUT_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


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


_malloc_trim = None


def _header_unit(data: bytes, pos: int, end: int, n: int) -> tuple[bytes, int] | None:
    """A HEADERS / PUSH_PROMISE frame at ``pos`` and its CONTINUATION frames: (the block's
    fragments after the first frame's, the end of the last frame), or None when not all of it
    has arrived. The unit is forwarded whole, so nothing is ever written between its frames."""
    block = bytearray()
    p = end
    while True:
        if n - p < 9:
            return None
        length = (data[p] << 16) | (data[p + 1] << 8) | data[p + 2]
        q = p + 9 + length
        if q > n:
            return None
        if data[p + 3] != CONTINUATION:
            raise _ProtocolBroken("header block interrupted by another frame")
        block += data[p + 9:q]
        if data[p + 4] & END_HEADERS:
            return bytes(block), q
        p = q


def _joined(buf: bytearray, data: bytes, preface_left: int, stream_data: bool = False) -> bytes | None:
    """``buf`` + ``data`` as bytes, or None while the frame at the start of ``buf`` is still
    incomplete (``data`` is then kept in ``buf``). With ``stream_data``, an unpadded DATA frame
    counts as soon as its header is there (the caller forwards it piece by piece)."""
    buf += data
    if not preface_left:
        n = len(buf)
        if n < 9:
            return None
        if n < 9 + ((buf[0] << 16) | (buf[1] << 8) | buf[2]):
            if not (stream_data and buf[3] == DATA and not buf[4] & PADDED):
                return None
    return bytes(buf)


def _timeout_seconds(value: bytes) -> float | None:
    if len(value) < 2 or not value[:-1].isdigit():
        return None
    unit = TIMEOUT_UNITS.get(value[-1])
    return None if unit is None else int(value[:-1]) * unit


def _decompress(encoding: bytes, data: bytes) -> bytes | None:
    try:
        if encoding == b"gzip":
            return zlib.decompress(data, 16 + zlib.MAX_WBITS)
        if encoding == b"deflate":
            return zlib.decompress(data)
    except zlib.error:
        return None
    return None


def _request_info(headers: list[tuple[bytes, bytes]]) -> tuple:
    """(method, timeout seconds, grpc-encoding, unary request?, unary response?) of a request."""
    path = b""
    timeout = None
    encoding = b""
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b"grpc-timeout":
            timeout = _timeout_seconds(value)
        elif name == b"grpc-encoding":
            encoding = value
    method = path.decode("utf-8", "replace")
    m = CRI_METHODS_BY_PATH.get(method)
    return (method, timeout, encoding, m is not None and not m.client_streaming,
            m is not None and not m.server_streaming)


def _response_info(headers: list[tuple[bytes, bytes]]) -> tuple:
    """(:status, grpc-encoding, status name or None, details) of response headers or trailers."""
    http_status = b""
    encoding = b""
    status = None
    message = b""
    for name, value in headers:
        if name == b":status":
            http_status = value
        elif name == b"grpc-status":
            status = value
        elif name == b"grpc-message":
            message = value
        elif name == b"grpc-encoding":
            encoding = value
    code = None
    details = ""
    if status is not None:
        try:
            code = STATUS_NAMES[int(status)]
        except (ValueError, IndexError):
            code = "UNKNOWN"
        details = percent_decode(message) if message else ""
    return http_status, encoding, code, details


class _Messages:
    """gRPC messages reassembled from one direction's DATA payloads, kept within caps."""

    __slots__ = ("msgs", "kept", "max_n", "max_bytes", "limit", "truncated", "head", "left", "cur",
                 "flag", "compressed")

    def __init__(self, max_n: int, max_bytes: int, limit: int) -> None:
        self.msgs: list[bytes] = []
        self.kept = 0
        self.max_n = max_n
        self.max_bytes = max_bytes
        self.limit = limit
        self.truncated = False
        self.head = b""  # a partial 5-byte prefix
        self.left = -1  # body bytes of the current message still to come; -1: at a prefix
        self.cur: list | None = None  # pieces of the current message
        self.flag = 0
        self.compressed = False

    def _keep(self, size: int) -> bool:
        if self.truncated:
            return False
        if len(self.msgs) < self.max_n and self.kept + size <= self.max_bytes:
            return True
        self.truncated = True
        return False

    def feed(self, data) -> int:
        """Take a DATA payload (bytes or a memoryview, kept by reference until its message is
        complete); returns 0, or the declared size of a message above ``limit``."""
        n = len(data)
        if self.left < 0 and not self.head and n >= 5:  # fast path: exactly one whole message
            size = int.from_bytes(data[1:5], "big")
            if n == 5 + size:
                if size > self.limit:
                    return size
                if data[0]:
                    self.compressed = True
                if self._keep(size):
                    self.msgs.append(bytes(data[5:]))
                    self.kept += size
                return 0
        i = 0
        while i < n:
            if self.left < 0:
                take = 5 - len(self.head)
                self.head += bytes(data[i:i + take])
                i += take
                if len(self.head) < 5:
                    break
                head, self.head = self.head, b""
                size = int.from_bytes(head[1:5], "big")
                if size > self.limit:
                    return size
                if head[0]:
                    self.compressed = True
                self.left = size
                self.cur = [] if self._keep(size) else None
            take = min(self.left, n - i)
            if self.cur is not None and take:
                self.cur.append(data[i:i + take])
            i += take
            self.left -= take
            if self.left == 0:
                if self.cur is not None:
                    message = b"".join(self.cur)
                    self.msgs.append(message)
                    self.kept += len(message)
                self.cur = None
                self.left = -1
        return 0


class _Call:
    __slots__ = ("sid", "method", "start", "t0", "timeout", "held", "hold", "req", "resp", "forwarded",
                 "resp_headers", "http_status", "req_encoding", "resp_encoding", "request", "done")

    def __init__(self, sid: int, method: str, timeout: float | None, held: bool, req: _Messages,
                 resp: _Messages) -> None:
        self.sid = sid
        self.method = method
        self.start = time.time()
        self.t0 = time.perf_counter()
        self.timeout = timeout
        self.held = held
        self.hold: bytearray | None = bytearray() if held else None
        self.req = req
        self.resp = resp
        self.forwarded: bytes | None = None
        self.resp_headers = False
        self.http_status = b""
        self.req_encoding = b""
        self.resp_encoding = b""
        self.request: bytes | None = None  # set for held calls (the message the hook saw)
        self.done = False


class _ProtocolBroken(Exception):
    """A peer sent something the relay cannot follow (HPACK, preface): close the connection."""


class _ClientSide(asyncio.Protocol):
    __slots__ = ("conn",)

    def __init__(self, relay: "RelayProxy") -> None:
        self.conn = _Connection(relay)

    def connection_made(self, transport) -> None:
        self.conn.client_made(transport)

    def data_received(self, data: bytes) -> None:
        self.conn.from_client(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.conn.client_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause(upstream=True)

    def resume_writing(self) -> None:
        self.conn.resume(upstream=True)


class _UpstreamSide(asyncio.Protocol):
    __slots__ = ("conn",)

    def __init__(self, conn: "_Connection") -> None:
        self.conn = conn

    def connection_made(self, transport) -> None:
        self.conn.upstream_made(transport)

    def data_received(self, data: bytes) -> None:
        self.conn.from_server(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.conn.upstream_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause(upstream=False)

    def resume_writing(self) -> None:
        self.conn.resume(upstream=False)


class _Connection:
    """One kubelet connection and its upstream connection."""

    def __init__(self, relay: "RelayProxy") -> None:
        self.relay = relay
        self.client = None  # transports
        self.upstream = None
        self.mode = "connecting"  # -> "relay" | "refuse" | "closed"
        self.early: list[bytes] = []
        self.early_bytes = 0
        # the unprocessed tail of each direction (an incomplete frame); it grows in place until
        # the frame is whole, so a large frame arriving in many reads is copied once, not per read
        self.cbuf = bytearray()
        self.sbuf = bytearray()
        self.preface_left = len(PREFACE)
        self.streams: dict[int, _Call] = {}
        self.last_client_sid = 0
        self.cdec = Decoder()
        self.sdec = Decoder()
        # client -> server flow control (see the module docstring)
        self.s_conn = 65535
        self.c_conn = 65535
        # the server's SETTINGS_INITIAL_WINDOW_SIZE as the relay may use it for its own DATA: a
        # value counts once the client's ACK of that SETTINGS frame went upstream (grpc-core checks
        # stream DATA against the acknowledged value), a decrease at once (``_server_initial``)
        self.s_initial = 65535
        self.s_initial_acked = 65535
        self.s_settings_unacked: deque = deque()  # per server SETTINGS frame not yet acked: its value or None
        # DATA the relay frames itself stays within 16384 bytes, the size every peer accepts: a
        # larger SETTINGS_MAX_FRAME_SIZE from the server counts only once the client acknowledged it
        self.s_max_frame = 16384
        self.swin: dict[int, int] = {}  # server stream windows of streams the relay sends on itself
        self.queue: deque = deque()  # (sid, frame, flow-controlled length)
        self.queued = 0
        self.qsids: dict[int, int] = {}  # sid -> frames in the queue
        self.repay_streams: dict[int, int] = {}
        self.ended: set[int] = set()  # streams the relay ended itself toward the client
        # a server DATA frame partly forwarded: bytes still to come, its call, dropped or not;
        # frames the relay writes to the client itself wait in client_deferred meanwhile
        self.s_data_left = 0
        self.s_data_call: _Call | None = None
        self.s_data_drop = False
        self.client_deferred: list[bytes] = []
        self.held_bytes = 0
        self.paused_client = False
        self.refused_details = ""
        self.answered = 0
        # while a server chunk is processed (deferring): the FinishedCalls of the calls it ends,
        # reported once the chunk's answers are written to the client (from_server)
        self.deferring = False
        self.defer: list[FinishedCall] = []

    # ------------------------------------------------------------------------ lifecycle

    def client_made(self, transport) -> None:
        self.client = transport
        relay = self.relay
        relay.connections.add(self)
        if relay.stopping:
            transport.close()
            return
        self.connect_task = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _UpstreamSide(self), self.relay.upstream_path),
                UPSTREAM_CONNECT_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to connect means UNAVAILABLE
            if self.mode == "closed":
                return
            self.mode = "refuse"
            self.refused_details = f"memqos-shim: cannot reach the runtime at unix://{self.relay.upstream_path}: {e}"
            self.relay.upstream_down(self.refused_details)
            self.client.write(frame(SETTINGS, 0, 0))
            early, self.early = self.early, []
            for chunk in early:
                self._refuse(chunk)
            if self.paused_client:
                self.paused_client = False
                self.client.resume_reading()
            if self.mode == "refuse":
                loop.call_later(REFUSED_IDLE_CLOSE, self._refused_idle)
            return
        if self.mode == "closed":
            transport.close()

    def _refused_idle(self) -> None:
        """A refused connection with no call: GOAWAY and close it, so that the client's new
        connection tries the runtime again (a call in progress is answered and closes it then)."""
        if self.mode != "refuse":
            return
        if self.streams:
            asyncio.get_running_loop().call_later(REFUSED_IDLE_CLOSE, self._refused_idle)
            return
        self.client.write(frame(GOAWAY, 0, 0, self.last_client_sid.to_bytes(4, "big") + bytes(4)))
        self._close("UNAVAILABLE", self.refused_details)

    def upstream_made(self, transport) -> None:
        """The upstream connection exists (before any of its data is delivered)."""
        if self.mode == "closed":
            transport.close()
            return
        self.upstream = transport
        self.mode = "relay"
        early, self.early = self.early, []
        try:
            for chunk in early:
                self._relay_client(chunk)
        except Exception as e:  # noqa: BLE001
            self._broken("client", e)
            return
        if self.paused_client:
            self.paused_client = False
            self.client.resume_reading()

    def client_lost(self, exc) -> None:
        self._close("CANCELLED", "")

    def upstream_lost(self, exc) -> None:
        if self.mode == "closed":
            return
        detail = f": {exc}" if exc else ""
        self._close("UNAVAILABLE", f"memqos-shim: the runtime closed the connection{detail}")

    def _close(self, code: str, details: str) -> None:
        if self.mode == "closed":
            return
        self.mode = "closed"
        self.relay.connections.discard(self)
        for call in list(self.streams.values()):
            self._finish(call, code, details)
        self.streams.clear()
        self._release_holds()
        for t in (self.client, self.upstream):
            if t is not None:
                t.close()
        task = getattr(self, "connect_task", None)
        if task is not None and not task.done():
            task.cancel()

    def abort(self) -> None:
        self._close("CANCELLED", "memqos-shim stopped")

    def goaway(self) -> None:
        """Stop: tell the kubelet that no new streams go on this connection."""
        if self.client is not None and self.mode != "closed":
            self._to_client(frame(GOAWAY, 0, 0, self.last_client_sid.to_bytes(4, "big") + bytes(4)))

    def pause(self, upstream: bool) -> None:
        t = self.upstream if upstream else self.client
        if t is not None:
            try:
                t.pause_reading()
            except Exception:  # noqa: BLE001 - closing
                pass

    def resume(self, upstream: bool) -> None:
        t = self.upstream if upstream else self.client
        if t is not None:
            try:
                t.resume_reading()
            except Exception:  # noqa: BLE001
                pass

    def _broken(self, side: str, e: Exception | None) -> None:
        if e is None:
            log.exception("relay: cannot follow the %s's HTTP/2 stream; closing the connection", side)
        else:
            log.warning("relay: cannot follow the %s's HTTP/2 stream (%s); closing the connection", side, e)
        self._close("UNAVAILABLE" if side == "server" else "CANCELLED",
                    f"memqos-shim: protocol error on the {side} side")

    def _release_holds(self) -> None:
        if self.held_bytes:
            self.relay.held_total -= self.held_bytes
            self.held_bytes = 0

    # ------------------------------------------------------------------------ calls

    def _new_call(self, sid: int, info: tuple) -> _Call:
        method, timeout, encoding, known_unary_req, known_unary_resp = info
        relay = self.relay
        limit = relay.max_message_bytes
        if known_unary_resp:
            resp = _Messages(1 << 30, limit, limit)
        else:
            resp = _Messages(relay.stream_record_max_messages, relay.stream_record_max_bytes, limit)
        if known_unary_req:
            req = _Messages(1 << 30, limit, limit)
        else:
            req = _Messages(relay.stream_record_max_messages, relay.stream_record_max_bytes, limit)
        call = _Call(sid, method, timeout, method in REWRITTEN_METHODS, req, resp)
        call.req_encoding = encoding
        self.streams[sid] = call
        return call

    def _finish(self, call: _Call, code: str, details: str) -> None:
        if call.done:
            return
        call.done = True
        self.streams.pop(call.sid, None)
        if call.hold is not None:
            self._drop_hold(call)
        request = call.request
        if request is None:
            msgs = call.req.msgs
            request = msgs[0] if len(msgs) == 1 else b"".join(msgs)
            if call.req.compressed and call.req_encoding:
                request = _decompress(call.req_encoding, request) or request
        responses: list[bytes] = []
        if code == "OK":
            responses = call.resp.msgs
            if call.resp.compressed and call.resp_encoding:
                responses = [_decompress(call.resp_encoding, r) or r for r in responses]
        fc = FinishedCall(
            call.method, call.start, (time.perf_counter() - call.t0) * 1000.0, request, call.forwarded,
            responses, code, details, call.resp.truncated and code == "OK")
        if self.deferring:
            self.defer.append(fc)
        else:
            self.relay.finished(fc)
        if call.resp.kept + call.req.kept + len(request) > TRIM_AFTER_BYTES:
            self.relay.trim_soon()

    def _ended_code(self, call: _Call) -> str:
        """A call the client reset: its deadline, or the client cancelled (as CriProxy)."""
        if call.timeout is None:
            return "CANCELLED"
        remaining = call.timeout - (time.perf_counter() - call.t0)
        if remaining <= 0.011 * call.timeout + 0.02:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"

    def _fail_call(self, call: _Call, code: str, details: str, to_upstream: list | None) -> None:
        """End a call for both sides from the relay: trailers to the client, RST upstream."""
        block = b""
        if not call.resp_headers:
            block = STATUS_200 + CONTENT_TYPE_GRPC
        block += literal(b"grpc-status", str(STATUS_NUMBER[code]).encode())
        block += literal(b"grpc-message", percent_encode(details))
        self._to_client(frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block))
        rst = frame(RST_STREAM, 0, call.sid, ERR_CANCEL.to_bytes(4, "big"))
        if to_upstream is not None:
            to_upstream.append(rst)
        elif self.upstream is not None:
            self.upstream.write(rst)
        self._drop_queued(call.sid)
        self.swin.pop(call.sid, None)
        self.ended.add(call.sid)
        if len(self.ended) > 10000:
            self.ended.clear()
        self._finish(call, code, details)

    # ------------------------------------------------------------------------ client -> server

    def from_client(self, data: bytes) -> None:
        mode = self.mode
        if mode == "relay":
            try:
                self._relay_client(data)
            except _ProtocolBroken as e:
                self._broken("client", e)
            except Exception:  # noqa: BLE001 - a bug here must not take the shim down
                self._broken("client", None)
        elif mode == "connecting":
            self.early.append(data)
            self.early_bytes += len(data)
            if self.early_bytes > READ_PAUSE_BYTES and not self.paused_client:
                self.paused_client = True
                self.client.pause_reading()
        elif mode == "refuse":
            try:
                self._refuse(data)
            except Exception as e:  # noqa: BLE001
                self._broken("client", e)

    def _preface(self, data: bytes) -> int:
        done = len(PREFACE) - self.preface_left
        take = min(self.preface_left, len(data))
        if data[:take] != PREFACE[done:done + take]:
            raise _ProtocolBroken("not an HTTP/2 connection preface")
        self.preface_left -= take
        return take

    def _relay_client(self, data: bytes) -> None:
        """Client bytes: find the frames, decode header blocks (new calls). When the chunk can go
        upstream as it is -- the common case -- write it first and do the bookkeeping after, so
        the runtime starts on the call while the relay observes it; else rebuild it."""
        if self.cbuf:
            data = _joined(self.cbuf, data, self.preface_left)
            if data is None:
                return
            self.cbuf = bytearray()
        n = len(data)
        pos = 0
        if self.preface_left:
            pos = self._preface(data)
        streams = self.streams
        frames = []
        verbatim = not self.queue
        need = 0
        while n - pos >= 9:
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            end = pos + 9 + length
            if end > n:
                break
            ftype = data[pos + 3]
            flags = data[pos + 4]
            if ftype == DATA:
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                call = streams.get(sid)
                if (call is not None and call.hold is not None) or sid in self.ended or sid in self.swin:
                    verbatim = False
                need += length
            elif ftype == HEADERS:
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                start = pos + 9
                stop = end
                if flags & PADDED:
                    stop -= data[start]
                    start += 1
                if flags & PRIORITY_FLAG:
                    start += 5
                if flags & END_HEADERS:
                    block = data[start:stop]
                else:
                    unit = _header_unit(data, pos, end, n)
                    if unit is None:
                        break  # wait for the rest of the header block
                    block = data[start:stop] + unit[0]
                    end = unit[1]
                try:
                    info = self.cdec.info(block, _request_info)
                except HpackError as e:
                    raise _ProtocolBroken(f"request headers: {e}") from None
                if sid > self.last_client_sid:  # else trailers (gRPC clients send none)
                    self.last_client_sid = sid
                    call = self._new_call(sid, info)
                    if flags & END_STREAM and call.hold is not None:
                        verbatim = False
                if sid in self.qsids:
                    verbatim = False
            elif ftype == CONTINUATION:
                raise _ProtocolBroken("CONTINUATION without HEADERS")
            else:
                sid = 0
            frames.append((ftype, flags, sid, pos, end))
            pos = end
        if pos < n:
            self.cbuf = bytearray(memoryview(data)[pos:])
        if verbatim and need <= self.s_conn:
            if pos:
                self.upstream.write(data if pos == n else memoryview(data)[:pos])
            for ftype, flags, sid, fpos, fend in frames:
                if ftype == DATA:
                    length = fend - fpos - 9
                    self.c_conn -= length
                    self.s_conn -= length
                    call = streams.get(sid)
                    if call is not None:
                        if flags & PADDED:
                            payload = memoryview(data)[fpos + 10:fend - data[fpos + 9]]
                        else:
                            payload = memoryview(data)[fpos + 9:fend]
                        too_big = call.req.feed(payload)
                        if too_big:
                            self._fail_call(call, "RESOURCE_EXHAUSTED",
                                            f"Received message larger than max ({too_big} vs. "
                                            f"{self.relay.max_message_bytes})", None)
                elif ftype != HEADERS:
                    self._client_control(ftype, flags, sid, data, fpos, fend)
        else:
            self._rebuild_client(data, frames, pos)
        self._after()

    def _client_control(self, ftype: int, flags: int, sid: int, data: bytes, pos: int, end: int) -> None:
        if ftype == RST_STREAM:
            sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            self.ended.discard(sid)
            if sid in self.qsids:
                self._drop_queued(sid)
            self.swin.pop(sid, None)
            call = self.streams.get(sid)
            if call is not None:
                self._finish(call, self._ended_code(call), "")
        elif ftype == SETTINGS:
            if flags & ACK:
                # the client acknowledged the server's oldest unacknowledged SETTINGS, and this ACK
                # is upstream before anything the relay sends from now on
                if self.s_settings_unacked:
                    initial = self.s_settings_unacked.popleft()
                    if initial is not None:
                        self.s_initial_acked = initial
                        self._server_initial()
                return
            for i in range(pos + 9, end - 5, 6):
                if int.from_bytes(data[i:i + 2], "big") == SETTINGS_HEADER_TABLE_SIZE:
                    value = int.from_bytes(data[i + 2:i + 6], "big")
                    self.sdec.max_allowed = max(self.sdec.max_allowed, value)

    def _server_initial(self) -> None:
        """The server's initial stream window as far as the relay may use it for DATA it sends
        itself: the acknowledged value, or lower while a lower one waits for its ACK. An
        increase the client has not acknowledged yet does not count: grpc-core checks a
        stream's DATA against the initial window the peer acknowledged, so DATA sent on the
        strength of an unacknowledged increase is reset (RST_STREAM PROTOCOL_ERROR). Changes
        move the windows of the streams the relay sends on (RFC 9113 6.9.2)."""
        value = self.s_initial_acked
        for v in self.s_settings_unacked:
            if v is not None and v < value:
                value = v
        delta = value - self.s_initial
        if delta:
            self.s_initial = value
            for k in self.swin:
                self.swin[k] += delta

    def _rebuild_client(self, data: bytes, frames: list, done: int) -> None:
        """The chunk needs changes: held, dropped or queued DATA, a held stream's end."""
        streams = self.streams
        pending: list[bytes] = []  # pieces to write upstream, in order
        out_start = 0
        for ftype, flags, sid, pos, end in frames:
            if ftype == DATA:
                length = end - pos - 9
                self.c_conn -= length
                call = streams.get(sid)
                if call is not None and call.hold is not None:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    self._held_data(call, data, pos, end, length, flags, pending)
                elif sid in self.ended:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    if flags & END_STREAM:
                        self.ended.discard(sid)
                else:
                    if call is not None:
                        if flags & PADDED:
                            payload = memoryview(data)[pos + 10:end - data[pos + 9]]
                        else:
                            payload = memoryview(data)[pos + 9:end]
                        too_big = call.req.feed(payload)
                        if too_big:
                            if out_start < pos:
                                pending.append(memoryview(data)[out_start:pos])
                            out_start = end
                            self._flush(pending)
                            self._fail_call(call, "RESOURCE_EXHAUSTED",
                                            f"Received message larger than max ({too_big} vs. "
                                            f"{self.relay.max_message_bytes})", None)
                            continue
                    if self.queue or length > self.s_conn or sid in self.swin:
                        if out_start < pos:
                            pending.append(memoryview(data)[out_start:pos])
                        out_start = end
                        self._flush(pending)
                        self._enqueue(sid, data[pos:end], length)
                    else:
                        self.s_conn -= length
            elif ftype == HEADERS:
                if sid in self.qsids:  # trailers behind queued DATA of the same stream
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    self._flush(pending)
                    self._enqueue(sid, data[pos:end], 0)
                elif flags & END_STREAM:
                    call = streams.get(sid)
                    if call is not None and call.hold is not None:  # a held call without a message
                        pending.append(memoryview(data)[out_start:end])
                        out_start = end
                        self._flush(pending)
                        self._end_hold(call, pending)
            else:
                self._client_control(ftype, flags, sid, data, pos, end)
        if out_start < done:
            pending.append(memoryview(data)[out_start:done])
        self._flush(pending)

    def _flush(self, pending: list) -> None:
        if pending:
            if len(pending) == 1:
                self.upstream.write(pending[0])
            else:
                self.upstream.writelines(pending)
            pending.clear()

    def _held_data(self, call: _Call, data: bytes, pos: int, end: int, length: int, flags: int,
                   pending: list[bytes]) -> None:
        """A DATA frame of a held stream: keep its payload; at END_STREAM rewrite and send."""
        if flags & PADDED:
            payload = memoryview(data)[pos + 10:end - data[pos + 9]]
        else:
            payload = memoryview(data)[pos + 9:end]
        hold = call.hold
        relay = self.relay
        before = len(hold)
        hold += payload
        grown = len(hold) - before
        self.held_bytes += grown
        relay.held_total += grown
        if before < 5 <= len(hold):
            declared = int.from_bytes(hold[1:5], "big")
            if declared > relay.max_message_bytes:
                self._flush(pending)
                self._fail_call(call, "RESOURCE_EXHAUSTED",
                                f"Received message larger than max ({declared} vs. {relay.max_message_bytes})", None)
                return
            if declared + 5 > relay.hold_max_bytes or relay.held_total + declared > relay.hold_total_bytes:
                relay.hold_skipped(call.method, declared)
                self._flush(pending)
                self._unhold(call, bool(flags & END_STREAM))
                return
        elif len(hold) > relay.hold_max_bytes + 5:
            relay.hold_skipped(call.method, len(hold))
            self._flush(pending)
            self._unhold(call, bool(flags & END_STREAM))
            return
        if flags & END_STREAM:
            # the stream's HEADERS go first, before the hook runs: the runtime starts on the call
            # (and its deadline) while the relay rewrites the message -- measured faster than one
            # write of HEADERS and DATA together after the hook
            self._flush(pending)
            self._end_hold(call, pending)
        elif length:
            self.repay_streams[call.sid] = self.repay_streams.get(call.sid, 0) + length

    def _drop_hold(self, call: _Call) -> None:
        n = len(call.hold)
        self.held_bytes -= n
        self.relay.held_total -= n
        call.hold = None

    def _unhold(self, call: _Call, end_stream: bool) -> None:
        """Fail open: stop holding, send what was held unchanged; the rest of the stream's DATA
        goes through the queue within the server's stream window."""
        data = bytes(call.hold)
        self._drop_hold(call)
        call.held = False
        call.req.feed(data)
        self.swin[call.sid] = self.swin.get(call.sid, self.s_initial)
        self._send_owned(call.sid, data, end_stream)

    def _end_hold(self, call: _Call, pending: list[bytes]) -> None:
        data = bytes(call.hold)
        self._drop_hold(call)
        relay = self.relay
        out = data
        request = None
        if len(data) >= 5 and int.from_bytes(data[1:5], "big") == len(data) - 5:
            body = data[5:]
            if data[0] & 1:  # compressed
                body = _decompress(call.req_encoding, body)
            if body is not None:
                request = body
                new = relay.rewritten(call.method, body)
                if new is not body and new != body:
                    call.forwarded = new
                    n = len(new)
                    out = b"\x00" + n.to_bytes(4, "big") + new
                elif data[0] & 1:
                    out = data  # unchanged: the kubelet's compressed bytes
            else:
                relay.hold_skipped(call.method, len(data), "compressed with an unknown encoding")
        elif data:
            relay.hold_skipped(call.method, len(data), "not exactly one gRPC message")
        if request is None:
            call.req.feed(data)
        else:
            call.request = request
        self.swin[call.sid] = self.swin.get(call.sid, self.s_initial)
        self._send_owned(call.sid, out, True, pending)

    def _send_owned(self, sid: int, payload: bytes, end_stream: bool, pending: list | None = None) -> None:
        """DATA the relay sends on a stream itself, in frames of at most 16384 bytes: straight
        into ``pending`` (what goes upstream next) when the server's windows take all of it now,
        else through the queue (flow control)."""
        step = self.s_max_frame
        n = len(payload)
        w = self.swin.get(sid)
        if pending is not None and not self.queue and n <= self.s_conn and (w is None or n <= w):
            self.s_conn -= n
            if w is not None:
                if end_stream:
                    del self.swin[sid]
                else:
                    self.swin[sid] = w - n
            if n <= step:
                pending.append(frame(DATA, END_STREAM if end_stream else 0, sid, payload))
                return
            for off in range(0, n, step):
                last = off + step >= n
                pending.append(frame(DATA, END_STREAM if (end_stream and last) else 0, sid, payload[off:off + step]))
            return
        if n == 0:
            self._enqueue(sid, frame(DATA, END_STREAM if end_stream else 0, sid), 0)
        for off in range(0, n, step):
            chunk = payload[off:off + step]
            last = off + step >= n
            flags = END_STREAM if (end_stream and last) else 0
            self._enqueue(sid, frame(DATA, flags, sid, chunk), len(chunk))
        if pending is not None:
            self._flush(pending)
        self._drain()

    def _enqueue(self, sid: int, frame: bytes, flow: int) -> None:
        self.queue.append((sid, frame, flow))
        self.queued += flow
        self.qsids[sid] = self.qsids.get(sid, 0) + 1

    def _drop_queued(self, sid: int) -> None:
        if sid not in self.qsids:
            return
        keep = deque()
        for entry in self.queue:
            if entry[0] == sid:
                self.queued -= entry[2]
            else:
                keep.append(entry)
        self.queue = keep
        del self.qsids[sid]

    def _drain(self) -> None:
        q = self.queue
        if not q or self.upstream is None:
            return
        out = []
        swin = self.swin
        while q:
            sid, frame, flow = q[0]
            if flow:
                if flow > self.s_conn:
                    break
                w = swin.get(sid)
                if w is not None:
                    if flow > w:
                        break
                    swin[sid] = w - flow
                self.s_conn -= flow
            q.popleft()
            self.queued -= flow
            left = self.qsids[sid] - 1
            if left:
                self.qsids[sid] = left
            else:
                del self.qsids[sid]
            if frame[4] & END_STREAM and frame[3] in (DATA, HEADERS):
                swin.pop(sid, None)
            out.append(frame)
        if out:
            self.upstream.write(b"".join(out))

    def _after(self) -> None:
        """Give the client back what it may send (room) and stream windows of held streams."""
        if self.mode != "relay":
            return
        if self.queue:
            self._drain()
        room = self.s_conn - self.queued - self.c_conn
        frames = []
        if room > 0:
            frames.append(window_update(0, room))
            self.c_conn += room
        if self.repay_streams:
            for sid, n in self.repay_streams.items():
                if sid in self.streams:
                    frames.append(window_update(sid, n))
            self.repay_streams.clear()
        if frames:
            self._to_client(b"".join(frames))

    # ------------------------------------------------------------------------ server -> client

    def from_server(self, data: bytes) -> None:
        if self.mode != "relay":
            return
        self.deferring = True  # calls that end in this chunk: finished() after the client has the answer
        try:
            self._relay_server(data)
        except _ProtocolBroken as e:
            self._broken("server", e)
        except Exception:  # noqa: BLE001
            self._broken("server", None)
        finally:
            self.deferring = False
            if self.defer:
                done, self.defer = self.defer, []
                for fc in done:
                    self.relay.finished(fc)

    def _relay_server(self, data: bytes) -> None:
        """Server bytes: forwarded frame by frame; responses observed; a call's end (trailers,
        RST_STREAM) reaches the client only after finished() ran. A DATA frame that has not
        fully arrived is forwarded as far as it has (it cannot be changed any more), and a large
        chunk's leading DATA goes out before the relay copies it for the observers."""
        if self.sbuf:
            data = _joined(self.sbuf, data, 0, stream_data=True)
            if data is None:
                return
            self.sbuf = bytearray()
        n = len(data)
        pos = 0
        out_start = 0
        streams = self.streams
        pending: list[bytes] = []
        upstream_out: list[bytes] = []
        if self.s_data_left:  # the rest of a DATA frame already partly forwarded
            take = min(self.s_data_left, n)
            call = self.s_data_call
            if self.s_data_drop:
                out_start = take
            elif call is not None and not call.done:
                too_big = call.resp.feed(memoryview(data)[:take])
                if too_big:  # its trailers wait for the frame's end (client_deferred)
                    self._fail_call(call, "RESOURCE_EXHAUSTED", f"Received message larger than max "
                                    f"({too_big} vs. {self.relay.max_message_bytes})", upstream_out)
            self.s_data_left -= take
            pos = take
            if self.s_data_left:
                if not self.s_data_drop:
                    self.client.write(data)
                self._flush_upstream(upstream_out)
                return
            if out_start < pos:
                pending.append(memoryview(data)[out_start:pos])
            out_start = pos
            self.s_data_call = None
            if self.client_deferred:
                pending.extend(self.client_deferred)
                self.client_deferred.clear()
        elif n >= EARLY_WRITE_BYTES:
            out_start = pos = self._write_leading_data(data, n)
        while n - pos >= 9:
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            end = pos + 9 + length
            ftype = data[pos + 3]
            if end > n:
                if ftype == DATA and not data[pos + 4] & PADDED:
                    self._stream_partial_data(data, pos, n, length, pending, out_start, upstream_out)
                    out_start = pos = n
                break
            if ftype == DATA:
                flags = data[pos + 4]
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                call = streams.get(sid)
                if call is not None:
                    if flags & PADDED:
                        payload = memoryview(data)[pos + 10:end - data[pos + 9]]
                    else:
                        payload = memoryview(data)[pos + 9:end]
                    too_big = call.resp.feed(payload)
                    if too_big:
                        if out_start < pos:
                            pending.append(memoryview(data)[out_start:pos])
                        out_start = end
                        self._write_client(pending)
                        if length:
                            upstream_out.append(window_update(0, length))
                        self._fail_call(call, "RESOURCE_EXHAUSTED",
                                        f"Received message larger than max ({too_big} vs. "
                                        f"{self.relay.max_message_bytes})", upstream_out)
                    elif flags & END_STREAM:
                        self._finish(call, "INTERNAL", "server closed the stream without sending trailers")
                elif sid in self.ended:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    if length:
                        upstream_out.append(window_update(0, length))
            elif ftype == HEADERS:
                flags = data[pos + 4]
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                start = pos + 9
                stop = end
                if flags & PADDED:
                    stop -= data[start]
                    start += 1
                if flags & PRIORITY_FLAG:
                    start += 5
                if flags & END_HEADERS:
                    block = data[start:stop]
                else:
                    unit = _header_unit(data, pos, end, n)
                    if unit is None:
                        break
                    block = data[start:stop] + unit[0]
                    end = unit[1]
                self._server_headers(sid, block, bool(flags & END_STREAM))
            elif ftype == CONTINUATION:
                raise _ProtocolBroken("CONTINUATION without HEADERS")
            elif ftype == WINDOW_UPDATE:
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                inc = int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.s_conn += inc
                    room = self.s_conn - self.queued - self.c_conn
                    if room >= inc:
                        self.c_conn += inc  # passes on unchanged
                    else:  # cut to what the client may have (a rewrite made the request larger)
                        if out_start < pos:
                            pending.append(memoryview(data)[out_start:pos])
                        out_start = end
                        if room > 0:
                            pending.append(window_update(0, room))
                            self.c_conn += room
                elif sid in self.swin:
                    self.swin[sid] += inc
            elif ftype == RST_STREAM:
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                if sid in self.ended:
                    self.ended.discard(sid)
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                else:
                    if sid in self.qsids:
                        self._drop_queued(sid)
                    self.swin.pop(sid, None)
                    call = streams.get(sid)
                    if call is not None:
                        code = int.from_bytes(data[pos + 9:pos + 13], "big")
                        self._finish(call, RST_STATUS.get(code, "INTERNAL"),
                                     f"stream reset by the runtime (HTTP/2 error code {code})")
            elif ftype == SETTINGS:
                if not data[pos + 4] & ACK:
                    initial = None
                    for i in range(pos + 9, end - 5, 6):
                        ident = int.from_bytes(data[i:i + 2], "big")
                        value = int.from_bytes(data[i + 2:i + 6], "big")
                        if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                            initial = value
                        elif ident == SETTINGS_HEADER_TABLE_SIZE:
                            self.cdec.max_allowed = max(self.cdec.max_allowed, value)
                    self.s_settings_unacked.append(initial)
                    if initial is not None:
                        self._server_initial()
            elif ftype == GOAWAY:
                last = int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF
                for sid in [s for s in streams if s > last]:
                    self._finish(streams[sid], "UNAVAILABLE", "the runtime is going away (GOAWAY)")
            elif ftype == PUSH_PROMISE:
                flags = data[pos + 4]
                start = pos + 9
                stop = end
                if flags & PADDED:
                    stop -= data[start]
                    start += 1
                start += 4
                if flags & END_HEADERS:
                    block = data[start:stop]
                else:
                    unit = _header_unit(data, pos, end, n)
                    if unit is None:
                        break
                    block = data[start:stop] + unit[0]
                    end = unit[1]
                self._decode_server(block)
            pos = end
        self._flush_upstream(upstream_out)
        if out_start == 0 and pos == n and not pending:
            self.client.write(data)
        else:
            if out_start < pos:
                pending.append(memoryview(data)[out_start:pos])
            self._write_client(pending)
        if pos < n:
            self.sbuf = bytearray(memoryview(data)[pos:])
        self._after()

    def _flush_upstream(self, out: list[bytes]) -> None:
        if out:
            self.upstream.write(b"".join(out))
            out.clear()

    def _write_leading_data(self, data: bytes, n: int) -> int:
        """A large chunk: write its leading DATA frames (and response headers) at once, before
        observing them; returns where the rest starts. Nothing a DATA frame carries can change
        what the relay forwards before it, and its observation follows right after."""
        pos = 0
        streams = self.streams
        while n - pos >= 9:
            end = pos + 9 + ((data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2])
            if end > n:
                break
            ftype = data[pos + 3]
            flags = data[pos + 4]
            if ftype == DATA:
                sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                if flags & (END_STREAM | PADDED) or sid in self.ended or sid not in streams:
                    break
            elif ftype != HEADERS or flags & (END_STREAM | PADDED) or not flags & END_HEADERS:
                break
            pos = end
        if pos >= EARLY_WRITE_BYTES:
            self.client.write(memoryview(data)[:pos])
            self._observe_leading(data, pos)
            return pos
        return 0

    def _observe_leading(self, data: bytes, stop: int) -> None:
        """Header blocks and DATA of frames ``_write_leading_data`` already wrote."""
        pos = 0
        upstream_out: list[bytes] = []
        while pos < stop:
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            end = pos + 9 + length
            sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if data[pos + 3] == HEADERS:
                start = pos + 9 + (5 if data[pos + 4] & PRIORITY_FLAG else 0)
                self._server_headers(sid, data[start:end], False)
            else:
                call = self.streams.get(sid)
                if call is not None and not call.done:
                    too_big = call.resp.feed(memoryview(data)[pos + 9:end])
                    if too_big:
                        self._fail_call(call, "RESOURCE_EXHAUSTED", f"Received message larger than max "
                                        f"({too_big} vs. {self.relay.max_message_bytes})", upstream_out)
            pos = end
        self._flush_upstream(upstream_out)

    def _stream_partial_data(self, data: bytes, pos: int, n: int, length: int, pending: list[bytes],
                             out_start: int, upstream_out: list[bytes]) -> None:
        """An unpadded DATA frame whose end has not arrived: forward (or drop) what has, and the
        rest as it comes (``s_data_left``); the relay writes nothing else to the client until the
        frame is complete."""
        sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        call = self.streams.get(sid)
        drop = sid in self.ended
        if call is not None and not drop:
            too_big = call.resp.feed(memoryview(data)[pos + 9:n])
            if too_big:
                drop = True
                if out_start < pos:
                    pending.append(memoryview(data)[out_start:pos])
                self._write_client(pending)
                self._fail_call(call, "RESOURCE_EXHAUSTED", f"Received message larger than max "
                                f"({too_big} vs. {self.relay.max_message_bytes})", upstream_out)
        if drop:
            if out_start < pos:
                pending.append(memoryview(data)[out_start:pos])
            if length:
                upstream_out.append(window_update(0, length))
        else:
            pending.append(memoryview(data)[out_start:n])
        self.s_data_left = pos + 9 + length - n
        self.s_data_call = call
        self.s_data_drop = drop

    def _to_client(self, frames: bytes) -> None:
        """Frames the relay writes to the client itself: never inside a partly forwarded frame."""
        if self.s_data_left:
            self.client_deferred.append(frames)
        else:
            self.client.write(frames)

    def _write_client(self, pending: list) -> None:
        if pending:
            if len(pending) == 1:
                self.client.write(pending[0])
            else:
                self.client.writelines(pending)
            pending.clear()

    def _decode_server(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self.sdec.decode(block)
        except HpackError as e:
            raise _ProtocolBroken(f"response headers: {e}") from None

    def _server_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        try:
            http_status, encoding, code, details = self.sdec.info(block, _response_info)
        except HpackError as e:
            raise _ProtocolBroken(f"response headers: {e}") from None
        call = self.streams.get(sid)
        if call is None:
            return
        if not call.resp_headers:
            call.resp_headers = True
            call.http_status = http_status
            call.resp_encoding = encoding
        if not end_stream:
            return
        if code is None:
            if call.http_status and call.http_status != b"200":
                code = HTTP_STATUS.get(call.http_status, "UNKNOWN")
                details = f"HTTP status {call.http_status.decode('ascii', 'replace')} from the runtime"
            else:
                code, details = "UNKNOWN", "the runtime's answer has no grpc-status"
        self._finish(call, code, details)

    # ------------------------------------------------------------------------ no upstream

    def _refuse(self, data: bytes) -> None:
        """The runtime is unreachable: answer every call UNAVAILABLE, then GOAWAY and close."""
        if self.cbuf:
            data = bytes(self.cbuf + data)
            self.cbuf = bytearray()
        n = len(data)
        pos = self._preface(data) if self.preface_left else 0
        out: list[bytes] = []
        while n - pos >= 9:
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            end = pos + 9 + length
            if end > n:
                break
            ftype = data[pos + 3]
            flags = data[pos + 4]
            sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if ftype == SETTINGS and not flags & ACK:
                out.append(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                out.append(frame(PING, ACK, 0, data[pos + 9:end]))
            elif ftype == HEADERS:
                start, stop = pos + 9, end
                if flags & PADDED:
                    stop -= data[start]
                    start += 1
                if flags & PRIORITY_FLAG:
                    start += 5
                if flags & END_HEADERS:
                    block = data[start:stop]
                else:
                    unit = _header_unit(data, pos, end, n)
                    if unit is None:
                        break
                    block = data[start:stop] + unit[0]
                    end = unit[1]
                try:
                    info = self.cdec.info(block, _request_info)
                except HpackError as e:
                    raise _ProtocolBroken(str(e)) from None
                if sid > self.last_client_sid:
                    self.last_client_sid = sid
                    call = self._new_call(sid, info)
                    call.hold = None
                    if flags & END_STREAM:
                        out.append(self._refusal(call))
            elif ftype == DATA:
                call = self.streams.get(sid)
                if length:
                    out.append(window_update(0, length))
                    if call is not None and not flags & END_STREAM:
                        out.append(window_update(sid, length))
                if call is not None:
                    if flags & PADDED:
                        payload = memoryview(data)[pos + 10:end - data[pos + 9]]
                    else:
                        payload = memoryview(data)[pos + 9:end]
                    call.req.feed(payload)
                    if flags & END_STREAM:
                        out.append(self._refusal(call))
            elif ftype == RST_STREAM:
                call = self.streams.get(sid)
                if call is not None:
                    self._finish(call, self._ended_code(call), "")
            pos = end
        if pos < n:
            self.cbuf = bytearray(memoryview(data)[pos:])
        if self.answered and not self.streams:
            out.append(frame(GOAWAY, 0, 0, self.last_client_sid.to_bytes(4, "big") + bytes(4)))
            self.client.write(b"".join(out))
            self._close("UNAVAILABLE", self.refused_details)
            return
        if out:
            self.client.write(b"".join(out))

    def _refusal(self, call: _Call) -> bytes:
        self.answered += 1
        block = (STATUS_200 + CONTENT_TYPE_GRPC + literal(b"grpc-status", b"14")
                 + literal(b"grpc-message", percent_encode(self.refused_details)))
        self._finish(call, "UNAVAILABLE", self.refused_details)
        return frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block)


class RelayProxy:
    """Serve the CRI on ``listen`` and relay every connection to ``upstream`` (same interface
    as ``shim.transport.proxy.CriProxy``)."""

    def __init__(
        self,
        listen: str,
        upstream: str,
        hooks: CallHooks,
        *,
        socket_mode: int = 0o600,
        socket_group: str | int | None = None,
        max_message_bytes: int = 128 * 1024 * 1024,
        hold_max_bytes: int = HOLD_MAX_BYTES,
        hold_total_bytes: int = HOLD_TOTAL_BYTES,
    ) -> None:
        self.listen_path = socket_path(listen)
        self.upstream_path = socket_path(upstream)
        if self.listen_path == self.upstream_path:
            raise ValueError(f"listen and upstream are the same socket: {self.listen_path}")
        self.socket_mode = check_socket_mode(socket_mode, socket_group)
        self.socket_group = socket_group
        for name, value in (("max_message_bytes", max_message_bytes), ("hold_max_bytes", hold_max_bytes),
                            ("hold_total_bytes", hold_total_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.max_message_bytes = max_message_bytes
        self.hold_max_bytes = hold_max_bytes
        self.hold_total_bytes = hold_total_bytes
        self.hooks = hooks
        self.stream_record_max_messages = STREAM_RECORD_MAX_MESSAGES
        self.stream_record_max_bytes = STREAM_RECORD_MAX_BYTES
        self.connections: set[_Connection] = set()
        self.held_total = 0
        self.stopping = False
        self._trim_pending = False
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None
        self._terminated: asyncio.Event | None = None
        self._rewrite_failed = ThrottledLog("rewrite hook failed")
        self._finished_failed = ThrottledLog("finished hook failed")
        self._skipped = ThrottledLog("not rewritten (fail-open)", level=logging.WARNING,
                                     outcome="the kubelet's bytes went upstream unchanged")
        self._down = ThrottledLog("runtime unreachable", level=logging.WARNING,
                                  outcome="the connection's calls are answered UNAVAILABLE")

    # ----------------------------------------------------------------- hooks

    def rewritten(self, method: str, request: bytes) -> bytes:
        """What goes upstream: the hook's bytes, or the original ones if the hook fails."""
        return guarded_rewrite(self.hooks, method, request, self._rewrite_failed)

    def finished(self, call: FinishedCall) -> None:
        guarded_finished(self.hooks, call, self._finished_failed)

    def trim_soon(self) -> None:
        """trim_heap() a second from now (once for a burst of large calls)."""
        if not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(1.0, self._trim)

    def _trim(self) -> None:
        self._trim_pending = False
        trim_heap()

    def hold_skipped(self, method: str, size: int, why: str = "") -> None:
        reason = why or (f"a {size}-byte message is above the hold cap ({self.hold_max_bytes} "
                         f"bytes each, {self.hold_total_bytes} bytes at once)")
        self._skipped(method, reason)
        tell = getattr(self.hooks, "not_rewritten", None)
        if tell is not None:
            try:
                tell(method, f"transport: {reason}")
            except Exception:
                self._finished_failed(method)

    def upstream_down(self, details: str) -> None:
        self._down("a new kubelet connection", details)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("RelayProxy.start() called twice")
        gid = None if self.socket_group is None else resolve_gid(self.socket_group)
        loop = asyncio.get_running_loop()
        sock, self._socket_id = bind_private(self.listen_path, self.socket_mode, gid)
        try:
            self._server = await loop.create_unix_server(lambda: _ClientSide(self), sock=sock)
        except BaseException:
            sock.close()
            remove_if_ours(self.listen_path, self._socket_id)
            self._socket_id = None
            raise
        self._terminated = asyncio.Event()
        trim_heap()
        log.info("CRI relay serving on %s (mode %#o%s), upstream unix://%s, event loop %s",
                 self.listen_path, self.socket_mode, "" if gid is None else f", group {gid}",
                 self.upstream_path, type(loop).__module__)

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting connections, tell clients to open no new streams (GOAWAY), give calls
        in flight ``grace`` seconds, close every connection, remove the socket if it is ours."""
        if self._server is None or self.stopping:
            return
        self.stopping = True
        try:
            self._server.close()
            for conn in list(self.connections):
                conn.goaway()
            if grace:
                deadline = time.monotonic() + grace
                while any(c.streams for c in self.connections) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            for conn in list(self.connections):
                conn.abort()
        finally:
            remove_if_ours(self.listen_path, self._socket_id)
            self._socket_id = None
            if self._terminated is not None:
                self._terminated.set()

    async def wait_for_termination(self) -> None:
        if self._server is None or self._terminated is None:
            raise RuntimeError("RelayProxy is not started")
        await self._terminated.wait()
