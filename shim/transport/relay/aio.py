"""The asyncio layer of the relay: sockets in, ``Connection`` fed, its ``Output`` acted on.

``RelayProxy`` listens on the CRI socket (``listener.py`` accepts); each kubelet connection
gets its upstream socket at once (a connection is taken only with both of its descriptors: what
cannot be paired is sent GOAWAY, closed and counted; at ``max_connections`` or its peer's
``max_connections_per_peer`` an idle open connection is closed to make room, ``shedding.py``,
and only when none is idle is the newcomer refused the same way) and a ``_ClientSide``
protocol, which connects upstream (``_UpstreamSide``) and, once it is, hands both transports'
bytes to the connection's sans-I/O ``Connection``. What the connection returns is done here
(``_ClientSide.act``): its writes go to the transports as they are (the pieces are
the bytes read or views of them: no copy in between), then its events -- ``HeldRequest``: the
hooks' ``rewrite`` (guarded: the original bytes when it fails) handed back with
``send_request``; ``CallEnded``: the hooks' ``finished``; ``NotRewritten``: logged and told to
the hooks; ``LimitHit``: counted; ``TrimHeap``: ``trim_heap`` a second later; ``Closed``: both
sockets closed -- and a paused connection is resumed once its writes are out. The relay-wide
budget of held bytes (``HoldBudget``) is one object every connection is given. What it keeps
for itself: what the kubelet sends
while the upstream connects (reading paused beyond ``READ_PAUSE_BYTES``), the switch to the
refusal server when the runtime cannot be reached (and closing an idle refused connection
after ``REFUSED_IDLE_CLOSE``), back-pressure (a side that cannot write pauses the other's
reading), closing, and giving freed heap memory back (``trim_heap``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Iterable

from shim.transport.heap import trim_heap
from shim.transport.hooks import STREAM_RECORD_MAX_BYTES, STREAM_RECORD_MAX_MESSAGES
from shim.transport.hooks import (
    CallHooks,
    MethodShape,
    guarded_finished,
    guarded_not_rewritten,
    guarded_rewrite,
    unary_shapes,
)
from shim.transport.relay.connection import Connection
from shim.transport.relay.events import CallEnded, Closed, HeldRequest, LimitHit, NotRewritten, Output, TrimHeap
from shim.transport.relay.stream import HoldBudget, StreamSettings, request_reader
from shim.transport.relay.limits import LIMIT_NAMES, LIMIT_OUTCOMES, H2Limits
from shim.transport.relay.listener import OUT_OF_DESCRIPTORS, Listener
from shim.transport.relay.shedding import make_room, peer_pid, shed, shed_frames
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
# Kubelet connections open at once; beyond it an idle one is closed for a new one (the new one is
# refused only when none is idle). The kubelet keeps one or two; crictl, doctor and probes add a
# few each.
MAX_CONNECTIONS = 128
# Connections open at once from one process (SO_PEERCRED pid): one leaking client keeps at most
# this many, so the rest of the limit stays for the others.
MAX_CONNECTIONS_PER_PEER = 64


class _ClientSide(asyncio.Protocol):
    """A kubelet connection: its transport, the upstream connection's, and their Connection."""

    def __init__(self, relay: "RelayProxy", upstream_sock: socket.socket, peer: int | None = None) -> None:
        self.relay = relay
        self.peer = peer  # the client's pid (SO_PEERCRED), None when unknown
        self.counted = peer is not None  # among relay.peers' connections of its peer
        # the upstream connection's socket, made when the kubelet's was accepted (a connection
        # is taken only with both descriptors); connected in _connect
        self.upstream_sock: socket.socket | None = upstream_sock
        self.made = False
        self.client = None
        self.upstream = None
        self.conn: Connection | None = None
        self.early: list[bytes] | None = []  # None once the upstream is connected or refused
        self.early_bytes = 0
        self.paused = False
        self.connect_task = None
        self.active = 0.0  # when a byte last came either way (loop time)
        self._time = None  # the loop's clock

    def connection_made(self, transport) -> None:
        self.client = transport
        relay = self.relay
        self.made = True
        relay.pending -= 1
        self.conn = Connection(relay.stream_settings, relay.limits, relay.hold_budget)
        relay.connections.add(self)
        loop = asyncio.get_running_loop()
        self._time = loop.time
        self.active = loop.time()
        if relay.stopping:
            self.drop_upstream_sock()
            transport.close()
            return
        self.connect_task = asyncio.ensure_future(self._connect())
        loop.call_later(relay.limits.preface_timeout, self._preface_due)
        if relay.limits.idle_timeout:
            loop.call_later(relay.limits.idle_timeout, self._idle_due)

    def data_received(self, data: bytes) -> None:
        self.active = self._time()
        if self.early is None:
            self.act(self.conn.receive_client(data))
            return
        self.early.append(data)
        self.early_bytes += len(data)
        if self.early_bytes > READ_PAUSE_BYTES and not self.paused:
            self.paused = True
            self.client.pause_reading()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.act(self.conn.close("CANCELLED", ""))

    def act(self, out: Output) -> None:
        """Do what the connection returned: its writes, then its events; hand a held request's
        rewrite back, resume a paused connection, until it has nothing more to say."""
        while True:
            pieces = out.to_upstream
            if pieces:  # only once connected: the connection sends nothing upstream before
                if len(pieces) == 1:
                    self.upstream.write(pieces[0])
                else:
                    self.upstream.writelines(pieces)
            pieces = out.to_client
            if pieces:
                if len(pieces) == 1:
                    self.client.write(pieces[0])
                else:
                    self.client.writelines(pieces)
            if out.events:
                out = self._events(out.events)
                if out is None:
                    return
            elif out.paused:
                out = self.conn.resume()
            else:
                return

    def _events(self, events: list) -> Output | None:
        """Act on the events of an Output whose writes went out; the connection's next Output
        when it asked for one (a held request's rewrite handed back, a pause), else None."""
        relay = self.relay
        conn = self.conn
        for event in events:
            kind = type(event)
            if kind is CallEnded:
                guarded_finished(relay.hooks, event.call, relay.finished_failed)
            elif kind is HeldRequest:  # the last event
                stream = event.stream
                return conn.send_request(stream, guarded_rewrite(relay.hooks, stream, relay.rewrite_failed))
            elif kind is NotRewritten:
                relay.not_rewritten(event)
            elif kind is LimitHit:
                relay.limit_hit(event.name, event.detail)
            elif kind is TrimHeap:
                relay.trim_soon()
            elif kind is Closed:  # the last event
                self._closed()
                return None
        return conn.resume() if conn.out.paused else None

    def idle(self) -> bool:
        """Relaying or refusing (what the client sent is read), no open stream, not closed."""
        conn = self.conn
        return self.early is None and conn.mode != "closed" and not conn.open_calls

    def shed(self, why: str) -> None:
        """Closed to make room for a new connection: GOAWAY (the client's next call opens a new
        connection), then closed."""
        self.act(self.conn.goaway())
        self.act(self.conn.close("CANCELLED", why))

    def release(self) -> None:
        """No longer counted among its peer's connections (once)."""
        if self.counted:
            self.counted = False
            peers = self.relay.peers
            left = peers.get(self.peer, 1) - 1
            if left > 0:
                peers[self.peer] = left
            else:
                peers.pop(self.peer, None)

    def drop_upstream_sock(self) -> None:
        sock, self.upstream_sock = self.upstream_sock, None
        if sock is not None:
            sock.close()

    def pause_writing(self) -> None:
        _pause(self.upstream)

    def resume_writing(self) -> None:
        _resume(self.upstream)

    # ------------------------------------------------------------------------ the upstream

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(self._open_upstream(loop), UPSTREAM_CONNECT_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to connect means UNAVAILABLE
            if self.conn.mode == "closed":
                return
            details = f"memqos-shim: cannot reach the runtime at unix://{self.relay.upstream_path}: {e}"
            self.act(self.conn.refuse(details))
            self.relay.upstream_down(details)
            self._feed_early()
            if self.conn.mode == "refuse":
                loop.call_later(REFUSED_IDLE_CLOSE, self._refused_idle)
            return
        if self.conn.mode == "closed":
            transport.close()

    async def _open_upstream(self, loop):
        sock, self.upstream_sock = self.upstream_sock, None
        try:
            await loop.sock_connect(sock, self.relay.upstream_path)
        except BaseException:
            sock.close()
            raise
        return await loop.create_unix_connection(lambda: _UpstreamSide(self), sock=sock)

    def upstream_made(self, transport) -> None:
        """The upstream connection exists (before any of its data is delivered)."""
        if self.conn.mode == "closed":
            transport.close()
            return
        self.upstream = transport
        self.conn.connected()
        self._feed_early()

    def _feed_early(self) -> None:
        early, self.early = self.early, None
        for chunk in early:
            self.act(self.conn.receive_client(chunk))
        if self.paused:
            self.paused = False
            self.client.resume_reading()

    def _preface_due(self) -> None:
        """``preface_timeout`` after the accept: a connection without its preface is closed."""
        conn = self.conn
        if self.early is not None and self.early_bytes >= len(PREFACE):
            return  # the upstream is still connecting: the Connection checks the preface when fed
        if conn.mode != "closed" and conn.awaiting_preface:
            self.relay.limit_hit("preface_timeout", f"no HTTP/2 preface after {self.relay.limits.preface_timeout:g} s")
            self.act(conn.close("CANCELLED", "memqos-shim: no HTTP/2 preface"))

    def _idle_due(self) -> None:
        """With an idle timeout: a connection without an open stream or a byte for that long is
        told GOAWAY and closed; else look again when it could be due."""
        conn = self.conn
        if conn.mode == "closed":
            return
        loop = asyncio.get_running_loop()
        idle = self.relay.limits.idle_timeout
        due = self.active + idle
        if conn.open_calls or due > loop.time():
            loop.call_later(max(due - loop.time(), idle / 10), self._idle_due)
            return
        self.relay.limit_hit("idle_timeout", f"no stream and no byte for {idle:g} s")
        self.act(conn.goaway())
        self.act(conn.close("CANCELLED", "memqos-shim: idle connection closed"))

    def _refused_idle(self) -> None:
        out = self.conn.close_refused_idle()
        if out is None:
            asyncio.get_running_loop().call_later(REFUSED_IDLE_CLOSE, self._refused_idle)
        else:
            self.act(out)

    def upstream_lost(self, exc) -> None:
        if self.conn.mode == "closed":
            return
        detail = f": {exc}" if exc else ""
        self.act(self.conn.close("UNAVAILABLE", f"memqos-shim: the runtime closed the connection{detail}"))

    # ------------------------------------------------------------------------ the end

    def goaway(self) -> None:
        self.act(self.conn.goaway())

    def abort(self) -> None:
        self.act(self.conn.close("CANCELLED", "memqos-shim stopped"))

    def _closed(self) -> None:
        self.relay.connections.discard(self)
        self.release()
        self.drop_upstream_sock()
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
        side = self.side
        side.active = side._time()
        side.act(self.conn.receive_server(data))

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
    """Serve the CRI on ``listen`` and relay every connection to ``upstream``. ``methods``: the method table (which methods are
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
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
        limits: H2Limits | None = None,
    ) -> None:
        self.listen_path, self.upstream_path, self.socket_mode = transport_endpoints(
            listen, upstream, socket_mode, socket_group
        )
        self.socket_group = socket_group
        for name, value in (("max_message_bytes", max_message_bytes), ("hold_max_bytes", hold_max_bytes),
                            ("hold_total_bytes", hold_total_bytes), ("max_connections", max_connections),
                            ("max_connections_per_peer", max_connections_per_peer)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.max_message_bytes = max_message_bytes
        self.hold_max_bytes = hold_max_bytes
        self.hold_total_bytes = hold_total_bytes
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.limits = limits if limits is not None else H2Limits()
        # times each HTTP/2 limit was hit (limits.py), by name: read by the shim's metrics
        self.limit_hits: dict[str, int] = dict.fromkeys(LIMIT_NAMES, 0)
        self._limit_logs = {name: ThrottledLog(f"HTTP/2 limit {name}", level=logging.WARNING,
                                               outcome=LIMIT_OUTCOMES.get(name, "the connection was closed (after "
                                                                           "GOAWAY once HTTP/2 had started)"))
                            for name in LIMIT_NAMES}
        self.hooks = hooks
        self.stream_settings = StreamSettings(
            held_methods=frozenset(hooks.held_methods), request_info=request_reader(unary_shapes(methods)),
            max_message_bytes=max_message_bytes, hold_max_bytes=hold_max_bytes,
            stream_record_max_messages=STREAM_RECORD_MAX_MESSAGES, stream_record_max_bytes=STREAM_RECORD_MAX_BYTES)
        self.hold_budget = HoldBudget(hold_total_bytes)  # the bytes held at once, over every connection
        self.connections: set[_ClientSide] = set()
        self.peers: dict[int, int] = {}  # connections (made or being made) by the client's pid
        self.pending = 0  # accepted connections whose transport is not made yet
        # connections sent GOAWAY and closed (public counters, read by the metrics): a new one
        # refused at max_connections / at its peer's max_connections_per_peer (no open one idle);
        # for want of a file descriptor (for the kubelet's side or the runtime's); an idle open
        # one closed to make room for a new one at max_connections / at its peer's limit
        self.shed_limit = 0
        self.shed_peer_limit = 0
        self.shed_descriptors = 0
        self.shed_idle = 0
        self.shed_peer_idle = 0
        self.upstream_failures = 0  # kubelet connections whose runtime connection could not be made
        self.stopping = False
        self._trim_pending = False
        self._listener: Listener | None = None
        self._accepting: set[asyncio.Future] = set()  # accepted sockets becoming transports
        self._socket_id: tuple[int, int] | None = None
        self._terminated: asyncio.Event | None = None
        self.rewrite_failed = ThrottledLog("rewrite hook failed")
        self.finished_failed = ThrottledLog("finished hook failed")
        self._skipped = ThrottledLog("not rewritten (fail-open)", level=logging.WARNING,
                                     outcome="the kubelet's bytes went upstream unchanged")
        self._down = ThrottledLog("runtime unreachable", level=logging.WARNING,
                                  outcome="the connection's calls are answered UNAVAILABLE")
        self.over_limit = ThrottledLog("connection limit reached", level=logging.WARNING,
                                        outcome="it is sent GOAWAY and closed; the open ones are served")
        self.made_room = ThrottledLog("connection limit reached", level=logging.WARNING,
                                       outcome="it is served; the idle one was sent GOAWAY and closed")
        self._accept_failed = ThrottledLog("cannot set up", outcome="it is closed")
        self._no_fds = ThrottledLog("out of file descriptors", level=logging.WARNING,
                                    outcome="it is sent GOAWAY and closed; the open ones are served")

    # what a streaming call's record keeps (the recorder's limits, set by the wiring);
    # connections made from then on take a new value
    @property
    def stream_record_max_messages(self) -> int:
        return self.stream_settings.stream_record_max_messages

    @stream_record_max_messages.setter
    def stream_record_max_messages(self, value: int) -> None:
        self.stream_settings = dataclasses.replace(self.stream_settings, stream_record_max_messages=value)

    @property
    def stream_record_max_bytes(self) -> int:
        return self.stream_settings.stream_record_max_bytes

    @stream_record_max_bytes.setter
    def stream_record_max_bytes(self, value: int) -> None:
        self.stream_settings = dataclasses.replace(self.stream_settings, stream_record_max_bytes=value)

    # ----------------------------------------------------------------- what connections report

    def trim_soon(self) -> None:
        """trim_heap() a second from now (once for a burst of large calls)."""
        if not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(1.0, self._trim)

    def _trim(self) -> None:
        self._trim_pending = False
        trim_heap()

    def not_rewritten(self, event: NotRewritten) -> None:
        """A held request went upstream unchanged (fail-open): logged, told to the hooks."""
        self._skipped(event.method, event.why)
        guarded_not_rewritten(self.hooks, event.method, f"transport: {event.why}", self.finished_failed)

    def limit_hit(self, name: str, detail: str) -> None:
        """A connection hit the HTTP/2 limit ``name`` (limits.py): counted and logged."""
        self.limit_hits[name] += 1
        self._limit_logs[name]("a kubelet connection", detail)

    def upstream_down(self, details: str) -> None:
        self.upstream_failures += 1
        self._down("a new kubelet connection", details)

    def _shed_unaccepted(self, error: OSError) -> bytes:
        """A connection the listener could not accept for want of a descriptor (it took it with
        its reserve one): counted, logged; the frames it is sent before it is closed."""
        self.shed_descriptors += 1
        why = f"memqos-shim: no file descriptor left to accept a connection: {error}"
        self._no_fds("a new kubelet connection", why)
        return shed_frames(why)

    def _serve(self, sock: socket.socket) -> None:
        """An accepted kubelet connection: its upstream socket, transport and ``_ClientSide``;
        or GOAWAY and closed, when it is one too many and no open one is idle, or its upstream
        socket cannot be made."""
        peer = peer_pid(sock)
        if peer is not None and self.peers.get(peer, 0) >= self.max_connections_per_peer \
                and not make_room(self, sock, peer):
            return
        if len(self.connections) + self.pending >= self.max_connections and not make_room(self, sock, None):
            return
        try:
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:
            if e.errno not in OUT_OF_DESCRIPTORS:
                raise
            self.shed_descriptors += 1
            why = f"memqos-shim: no file descriptor left for the runtime connection: {e}"
            self._no_fds("a new kubelet connection", why)
            shed(sock, shed_frames(why))
            return
        upstream.setblocking(False)
        side = _ClientSide(self, upstream, peer)
        if peer is not None:
            self.peers[peer] = self.peers.get(peer, 0) + 1
        self.pending += 1
        task = asyncio.ensure_future(asyncio.get_running_loop().connect_accepted_socket(lambda: side, sock))
        self._accepting.add(task)
        task.add_done_callback(lambda t: self._accepted(t, side, sock))

    def _accepted(self, task: asyncio.Future, side: _ClientSide, sock: socket.socket) -> None:
        self._accepting.discard(task)
        if side.made:
            return
        self.pending -= 1
        side.release()
        side.drop_upstream_sock()
        sock.close()
        if not task.cancelled() and task.exception() is not None:
            self._accept_failed("a new kubelet connection", repr(task.exception()))

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._listener is not None:
            raise RuntimeError("RelayProxy.start() called twice")
        gid = None if self.socket_group is None else resolve_gid(self.socket_group)
        loop = asyncio.get_running_loop()
        sock, self._socket_id = bind_private(self.listen_path, self.socket_mode, gid)
        try:
            self._listener = Listener(sock, self._serve, self._shed_unaccepted)
            self._listener.start()
        except BaseException:
            self._listener = None
            sock.close()
            remove_if_ours(self.listen_path, self._socket_id)
            self._socket_id = None
            raise
        self._terminated = asyncio.Event()
        trim_heap()
        log.info("CRI relay serving on %s (mode %#o%s), upstream unix://%s, event loop %s, at most %d "
                 "connections (%d per process)", self.listen_path, self.socket_mode,
                 "" if gid is None else f", group {gid}", self.upstream_path, type(loop).__module__,
                 self.max_connections, self.max_connections_per_peer)

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting connections, tell clients to open no new streams (GOAWAY), give calls
        in flight ``grace`` seconds, close every connection, remove the socket if it is ours."""
        if self._listener is None or self.stopping:
            return
        self.stopping = True
        try:
            self._listener.close()
            for task in list(self._accepting):
                task.cancel()
            for conn in list(self.connections):
                conn.goaway()
            if grace:
                deadline = time.monotonic() + grace
                while any(c.conn.open_calls for c in self.connections) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            for conn in list(self.connections):
                conn.abort()
        finally:
            remove_if_ours(self.listen_path, self._socket_id)
            self._socket_id = None
            if self._terminated is not None:
                self._terminated.set()

    async def wait_for_termination(self) -> None:
        if self._listener is None or self._terminated is None:
            raise RuntimeError("RelayProxy is not started")
        await self._terminated.wait()
