"""A small gRPC server over HTTP/2 on a unix socket, on asyncio and without grpcio: the stand-in
runtimes of ``memqos-shim demo`` (``demo_runtime.py``) and ``memqos-shim replay``
(``trace_runtime.py``) answer on it, so neither command needs grpcio.

What a CRI client (the relay, grpcio, the unary client) needs and nothing more:

* one handler for every method: ``await handler(path, headers, messages)`` with the request's
  ``:path``, its header fields (name -> value, the last one where a name repeats) and the
  gRPC messages of its body; it returns ``(responses, status name, details)``. An answer that
  is not OK is sent trailers-only, as grpc-go sends it;
* HTTP/2 as RFC 9113 asks of a server: SETTINGS acknowledged, PING answered, HPACK header
  blocks decoded in order (``wire.hpack.Decoder``), CONTINUATION and padding understood,
  RST_STREAM and GOAWAY honoured; answers sent within the client's flow-control windows and
  frame size; the connection's receive window given back as DATA arrives (each stream's is
  2^31-1, beyond any request this server takes).

Bounds: ``max_message_bytes`` per request body (RESOURCE_EXHAUSTED above it),
``max_concurrent_streams`` per connection (advertised; a stream beyond it is refused). No TLS,
no compression (a compressed request is answered INTERNAL), no client streaming beyond
collecting every message the request carries.
"""
from __future__ import annotations

import asyncio
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from shim.transport.wire.grpc import STATUS_NUMBER, message, percent_encode
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    DEFAULT_MAX_FRAME,
    END_HEADERS,
    END_STREAM,
    ERR_PROTOCOL,
    ERR_REFUSED_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    ProtocolError,
    data_payload,
    frame,
    frames,
    goaway,
    header_block,
    rst_stream,
    setting,
    settings_items,
    window_update,
)
from shim.transport.wire.hpack import CONTENT_TYPE_GRPC, Decoder, HpackError, literal

log = logging.getLogger(__name__)

Handler = Callable[[str, dict, list], Awaitable[tuple[list, str, str]]]
DEFAULT_MAX_MESSAGE = 128 * 1024 * 1024


@dataclass
class _Stream:
    sid: int
    headers: dict
    window: int
    body: bytearray = field(default_factory=bytearray)
    task: asyncio.Task | None = None
    reset: bool = False


class GrpcServer:
    def __init__(self, handler: Handler, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE,
                 max_concurrent_streams: int = 100) -> None:
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.path: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        return "unix://" + (self.path or "")

    async def start(self, path: str) -> None:
        path = os.path.abspath(path)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # left by an earlier server
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._accept, path=path)
        self.path = path

    async def stop(self, grace: float | None = None) -> None:
        """Close the socket and every connection (``grace`` is accepted for grpc.aio's
        signature; calls in flight are cancelled)."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._conns):
            conn.close()
        tasks = list(self._tasks)
        if tasks:  # each connection's task ends once its transport is closed
            await asyncio.wait(tasks, timeout=5)
        self._server = None
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):  # a socket only: never what replaced it
                os.unlink(self.path)
        except OSError:
            pass

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        self._conns.add(conn)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass  # the loop is closing: this connection's end, not an error
        finally:
            self._conns.discard(conn)
            self._tasks.discard(task)
            conn.close()


class _Connection:
    def __init__(self, server: GrpcServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.decoder = Decoder()
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.send_window = 65535
        self.initial_window = 65535
        self.max_frame = DEFAULT_MAX_FRAME
        self.window_changed = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for st in self.streams.values():
            st.reset = True
            if st.task is not None:
                st.task.cancel()
        self.window_changed.set()
        self.writer.close()

    def send(self, data: bytes) -> None:
        if not self.closed:
            self.writer.write(data)

    async def run(self) -> None:
        try:
            if await self.reader.readexactly(len(PREFACE)) != PREFACE:
                return
        except (asyncio.IncompleteReadError, OSError):
            return
        self.send(frame(SETTINGS, 0, 0, setting(SETTINGS_MAX_CONCURRENT_STREAMS, self.server.max_concurrent_streams)
                        + setting(SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW))
                  + window_update(0, MAX_WINDOW - 65535))
        buf = bytearray()
        while not self.closed:
            try:
                chunk = await self.reader.read(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            data = bytes(buf)
            taken = 0
            try:
                for ftype, flags, sid, pos, end in frames(data, 0, len(data)):
                    self.on_frame(data, ftype, flags, sid, pos, end)
                    taken = end
            except (ProtocolError, HpackError) as e:
                log.debug("grpc server: closing a connection: %s", e)
                self.send(goaway(self.last_sid, ERR_PROTOCOL))
                return
            del buf[:taken]
            try:
                await self.writer.drain()
            except OSError:
                return

    def on_frame(self, data: bytes, ftype: int, flags: int, sid: int, pos: int, end: int) -> None:
        if ftype == HEADERS:
            headers = dict(self.decoder.decode(header_block(data, ftype, flags, pos, end)))
            st = self.streams.get(sid)
            if st is None:
                if sid <= self.last_sid or not sid & 1:
                    raise ProtocolError(f"HEADERS on stream {sid}")
                self.last_sid = sid
                if len(self.streams) >= self.server.max_concurrent_streams:
                    self.send(rst_stream(sid, ERR_REFUSED_STREAM))
                    return
                st = self.streams[sid] = _Stream(sid, headers, self.initial_window)
            if flags & END_STREAM:
                self.dispatch(st)
        elif ftype == DATA:
            flow = end - pos - 9
            payload = data_payload(data, flags, pos, end)
            if flow:
                self.send(window_update(0, flow))
            st = self.streams.get(sid)
            if st is None or st.task is not None:
                return  # refused or reset meanwhile
            if len(st.body) + len(payload) > self.server.max_message_bytes + 5:
                st.body = bytearray()
                st.task = asyncio.ensure_future(self.answer(st, [], "RESOURCE_EXHAUSTED",
                                                            "request larger than the server takes"))
                return
            st.body += payload
            if flags & END_STREAM:
                self.dispatch(st)
        elif ftype == SETTINGS:
            if flags & ACK:
                return
            for ident, value in settings_items(data, pos + 9, end):
                if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                    for st in self.streams.values():
                        st.window += value - self.initial_window
                    self.initial_window = value
                elif ident == SETTINGS_MAX_FRAME_SIZE:
                    self.max_frame = max(DEFAULT_MAX_FRAME, min(value, (1 << 24) - 1))
            self.send(frame(SETTINGS, ACK, 0))
            self.window_changed.set()
        elif ftype == WINDOW_UPDATE:
            inc = int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif sid in self.streams:
                self.streams[sid].window += inc
            self.window_changed.set()
        elif ftype == PING:
            if not flags & ACK:
                self.send(frame(PING, ACK, 0, data[pos + 9:end]))
        elif ftype == RST_STREAM:
            st = self.streams.pop(sid, None)
            if st is not None:
                st.reset = True
                if st.task is not None:
                    st.task.cancel()
            self.window_changed.set()
        elif ftype == GOAWAY:
            pass  # the client closes when its calls are done

    def dispatch(self, st: _Stream) -> None:
        messages, problem = split_messages(bytes(st.body))
        st.body = bytearray()
        if problem:
            st.task = asyncio.ensure_future(self.answer(st, [], "INTERNAL", problem))
        else:
            st.task = asyncio.ensure_future(self.call(st, messages))

    async def call(self, st: _Stream, messages: list) -> None:
        path = (st.headers.get(b":path") or b"").decode("utf-8", "replace")
        try:
            responses, code, details = await self.server.handler(path, st.headers, messages)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the call fails, the server goes on
            log.exception("grpc server: handler for %s failed", path)
            responses, code, details = [], "INTERNAL", f"{e.__class__.__name__}: {e}"
        await self.answer(st, responses, code, details)

    async def answer(self, st: _Stream, responses: list, code: str, details: str) -> None:
        try:
            status = literal(b"grpc-status", str(STATUS_NUMBER.get(code, 2)).encode())
            if details:
                status += literal(b"grpc-message", percent_encode(details))
            head = literal(b":status", b"200") + CONTENT_TYPE_GRPC
            if code != "OK":
                self.send(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, head + status))
                return
            self.send(frame(HEADERS, END_HEADERS, st.sid, head))
            for m in responses:
                await self.send_data(st, message(m))
            if not st.reset:
                self.send(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, status))
        finally:
            self.streams.pop(st.sid, None)

    async def send_data(self, st: _Stream, payload: bytes) -> None:
        pos = 0
        while pos < len(payload):
            if st.reset or self.closed:
                return
            room = min(self.send_window, st.window, self.max_frame, len(payload) - pos)
            if room <= 0:
                self.window_changed.clear()
                await self.window_changed.wait()
                continue
            self.send(frame(DATA, 0, st.sid, payload[pos:pos + room]))
            pos += room
            self.send_window -= room
            st.window -= room
        try:
            await self.writer.drain()
        except OSError:
            st.reset = True


def split_messages(body: bytes) -> tuple[list, str]:
    """The gRPC messages of a request body, or a problem."""
    out, pos = [], 0
    while pos < len(body):
        if len(body) - pos < 5:
            return [], "a truncated message prefix"
        if body[pos] & 1:
            return [], "compressed request (no compression is offered)"
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        if pos + 5 + n > len(body):
            return [], "a message longer than the request body"
        out.append(body[pos + 5:pos + 5 + n])
        pos += 5 + n
    return out, ""
