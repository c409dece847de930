"""The asyncio layer of the relay: sockets in, ``Connection`` fed, its writes to the sockets.

``RelayProxy`` listens on the CRI socket; each kubelet connection gets a ``_ClientSide``
protocol, which opens the upstream connection (``_UpstreamSide``) and, once it exists, hands
both transports' bytes to the connection's sans-I/O ``Connection``, whose writers are the
transports themselves (no copy in between). What it keeps for itself: what the kubelet sends
while the upstream connects (reading paused beyond ``READ_PAUSE_BYTES``), the switch to the
refusal server when the runtime cannot be reached (and closing an idle refused connection
after ``REFUSED_IDLE_CLOSE``), back-pressure (a side that cannot write pauses the other's
reading), closing, and giving freed heap memory back (``trim_heap``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

from shim.transport.hooks import STREAM_RECORD_MAX_BYTES, STREAM_RECORD_MAX_MESSAGES
from shim.transport.hooks import (
    CallHooks,
    MethodShape,
    RpcCall,
    guarded_finished,
    guarded_not_rewritten,
    guarded_rewrite,
    unary_shapes,
)
from shim.transport.relay.calls import request_reader
from shim.transport.relay.connection import Connection
from shim.transport.relay.limits import LIMIT_NAMES, H2Limits
from shim.transport.wire.h2 import PREFACE
from shim.transport.unixsock import ThrottledLog, bind_private, remove_if_ours, resolve_gid, transport_endpoints

log = logging.getLogger("shim.transport.relay")

# A held CreateContainer / UpdateContainerResources up to this size is rewritten: 16 MiB is the
# largest message the kubelet sends (its grpc MaxCallSendMsgSize).
HOLD_MAX_BYTES = 16 * 1024 * 1024
# All streams held at once, over every connection; beyond it new holds fail open.
HOLD_TOTAL_BYTES = 64 * 1024 * 1024
UPSTREAM_CONNECT_TIMEOUT = 10.0
REFUSED_IDLE_CLOSE = 1.0  # seconds a refused connection may stay open without a call
READ_PAUSE_BYTES = 4 * 1024 * 1024  # client bytes buffered while the upstream connects


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


class _ClientSide(asyncio.Protocol):
    """A kubelet connection: its transport, the upstream connection's, and their Connection."""

    def __init__(self, relay: "RelayProxy") -> None:
        self.relay = relay
        self.client = None
        self.upstream = None
        self.conn: Connection | None = None
        self.early: list[bytes] | None = []  # None once the upstream is connected or refused
        self.early_bytes = 0
        self.paused = False
        self.connect_task = None
        self.active = 0.0  # with an idle timeout: when a byte last came either way (loop time)

    def connection_made(self, transport) -> None:
        self.client = transport
        self.conn = Connection(self.relay, transport)
        self.conn.on_closed = self._closed
        relay = self.relay
        relay.connections.add(self)
        if relay.stopping:
            transport.close()
            return
        self.connect_task = asyncio.ensure_future(self._connect())
        loop = asyncio.get_running_loop()
        loop.call_later(relay.limits.preface_timeout, self._preface_due)
        if relay.limits.idle_timeout:
            self.active = loop.time()
            loop.call_later(relay.limits.idle_timeout, self._idle_due)

    def data_received(self, data: bytes) -> None:
        if self.active:
            self.active = asyncio.get_running_loop().time()
        if self.early is None:
            self.conn.from_client(data)
            return
        self.early.append(data)
        self.early_bytes += len(data)
        if self.early_bytes > READ_PAUSE_BYTES and not self.paused:
            self.paused = True
            self.client.pause_reading()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.conn.close("CANCELLED", "")

    def pause_writing(self) -> None:
        _pause(self.upstream)

    def resume_writing(self) -> None:
        _resume(self.upstream)

    # ------------------------------------------------------------------------ the upstream

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _UpstreamSide(self), self.relay.upstream_path),
                UPSTREAM_CONNECT_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to connect means UNAVAILABLE
            if self.conn.mode == "closed":
                return
            details = f"memqos-shim: cannot reach the runtime at unix://{self.relay.upstream_path}: {e}"
            self.conn.refuse(details)
            self.relay.upstream_down(details)
            self._feed_early()
            if self.conn.mode == "refuse":
                loop.call_later(REFUSED_IDLE_CLOSE, self._refused_idle)
            return
        if self.conn.mode == "closed":
            transport.close()

    def upstream_made(self, transport) -> None:
        """The upstream connection exists (before any of its data is delivered)."""
        if self.conn.mode == "closed":
            transport.close()
            return
        self.upstream = transport
        self.conn.relay_to(transport)
        self._feed_early()

    def _feed_early(self) -> None:
        early, self.early = self.early, None
        for chunk in early:
            self.conn.from_client(chunk)
        if self.paused:
            self.paused = False
            self.client.resume_reading()

    def _preface_due(self) -> None:
        """``preface_timeout`` after the accept: a connection without its preface is closed."""
        conn = self.conn
        if self.early is not None and self.early_bytes >= len(PREFACE):
            return  # the upstream is still connecting: the Connection checks the preface when fed
        if conn.mode != "closed" and conn.preface_left:
            self.relay.limit_hit("preface_timeout", f"no HTTP/2 preface after {self.relay.limits.preface_timeout:g} s")
            conn.close("CANCELLED", "memqos-shim: no HTTP/2 preface")

    def _idle_due(self) -> None:
        """With an idle timeout: a connection without an open stream or a byte for that long is
        told GOAWAY and closed; else look again when it could be due."""
        conn = self.conn
        if conn.mode == "closed":
            return
        loop = asyncio.get_running_loop()
        idle = self.relay.limits.idle_timeout
        due = self.active + idle
        if conn.streams or due > loop.time():
            loop.call_later(max(due - loop.time(), idle / 10), self._idle_due)
            return
        self.relay.limit_hit("idle_timeout", f"no stream and no byte for {idle:g} s")
        conn.goaway()
        conn.close("CANCELLED", "memqos-shim: idle connection closed")

    def _refused_idle(self) -> None:
        if not self.conn.close_refused_idle():
            asyncio.get_running_loop().call_later(REFUSED_IDLE_CLOSE, self._refused_idle)

    def upstream_lost(self, exc) -> None:
        if self.conn.mode == "closed":
            return
        detail = f": {exc}" if exc else ""
        self.conn.close("UNAVAILABLE", f"memqos-shim: the runtime closed the connection{detail}")

    # ------------------------------------------------------------------------ the end

    def abort(self) -> None:
        self.conn.close("CANCELLED", "memqos-shim stopped")

    def _closed(self) -> None:
        self.relay.connections.discard(self)
        for t in (self.client, self.upstream):
            if t is not None:
                t.close()
        task = self.connect_task
        if task is not None and not task.done():
            task.cancel()


class _UpstreamSide(asyncio.Protocol):
    __slots__ = ("side", "conn")

    def __init__(self, side: _ClientSide) -> None:
        self.side = side
        self.conn = side.conn

    def connection_made(self, transport) -> None:
        self.side.upstream_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.side.active:
            self.side.active = asyncio.get_running_loop().time()
        self.conn.from_server(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.side.upstream_lost(exc)

    def pause_writing(self) -> None:
        _pause(self.side.client)

    def resume_writing(self) -> None:
        _resume(self.side.client)


def _pause(transport) -> None:
    if transport is not None:
        try:
            transport.pause_reading()
        except Exception:  # noqa: BLE001 - closing
            pass


def _resume(transport) -> None:
    if transport is not None:
        try:
            transport.resume_reading()
        except Exception:  # noqa: BLE001
            pass


class RelayProxy:
    """Serve the CRI on ``listen`` and relay every connection to ``upstream`` (same interface
    as ``shim.transport.proxy.CriProxy``). ``methods``: the method table (which methods are
    unary); the methods held for the rewrite are the hooks' ``held_methods``."""

    def __init__(
        self,
        listen: str,
        upstream: str,
        hooks: CallHooks,
        *,
        methods: Iterable[MethodShape],
        socket_mode: int = 0o600,
        socket_group: str | int | None = None,
        max_message_bytes: int = 128 * 1024 * 1024,
        hold_max_bytes: int = HOLD_MAX_BYTES,
        hold_total_bytes: int = HOLD_TOTAL_BYTES,
        limits: H2Limits | None = None,
    ) -> None:
        self.listen_path, self.upstream_path, self.socket_mode = transport_endpoints(
            listen, upstream, socket_mode, socket_group
        )
        self.socket_group = socket_group
        for name, value in (("max_message_bytes", max_message_bytes), ("hold_max_bytes", hold_max_bytes),
                            ("hold_total_bytes", hold_total_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.max_message_bytes = max_message_bytes
        self.hold_max_bytes = hold_max_bytes
        self.hold_total_bytes = hold_total_bytes
        self.limits = limits if limits is not None else H2Limits()
        # times each HTTP/2 limit was hit (limits.py), by name: read by the shim's metrics
        self.limit_hits: dict[str, int] = dict.fromkeys(LIMIT_NAMES, 0)
        self._limit_logs = {name: ThrottledLog(f"HTTP/2 limit {name}", level=logging.WARNING,
                                               outcome="the connection was closed (after GOAWAY once HTTP/2 had "
                                               "started) or the stream refused")
                            for name in LIMIT_NAMES}
        self.hooks = hooks
        self.held_methods = frozenset(hooks.held_methods)
        self.request_info = request_reader(unary_shapes(methods))
        self.stream_record_max_messages = STREAM_RECORD_MAX_MESSAGES
        self.stream_record_max_bytes = STREAM_RECORD_MAX_BYTES
        self.connections: set[_ClientSide] = set()
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

    def rewritten(self, call: RpcCall) -> bytes:
        """What goes upstream: the hook's bytes, or the original ones if the hook fails."""
        return guarded_rewrite(self.hooks, call, self._rewrite_failed)

    def finished(self, call: RpcCall) -> None:
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
        guarded_not_rewritten(self.hooks, method, f"transport: {reason}", self._finished_failed)

    def limit_hit(self, name: str, detail: str) -> None:
        """A connection hit the HTTP/2 limit ``name`` (limits.py): counted and logged."""
        self.limit_hits[name] += 1
        self._limit_logs[name]("a kubelet connection", detail)

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
                conn.conn.goaway()
            if grace:
                deadline = time.monotonic() + grace
                while any(c.conn.streams for c in self.connections) and time.monotonic() < deadline:
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
