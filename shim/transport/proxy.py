"""The CRI proxy: a grpc.aio server on the kubelet's endpoint, one grpc.aio channel upstream.

Every call is relayed as raw bytes (identity serializers, nothing is parsed here):

* the methods of the table it is given (the 43 runtime.v1 methods, ``shim.cri.methods``) are
  registered once at start, unary ones as unary-unary relays,
  server-streaming ones (GetContainerEvents, Stream*) as unary-stream relays that forward each
  message as it arrives;
* any other method or service (``/runtime.v1alpha2.RuntimeService/Version``,
  ``/runtime.v1.RuntimeService/NoSuch``) goes through a generic stream-stream relay, which
  carries any cardinality on the wire; the upstream's answer, UNIMPLEMENTED included, comes
  back unchanged.

Status code, details, initial and trailing metadata (``grpc-status-details-bin`` included),
request metadata, the client's deadline and cancellation are passed through. The hooks of
``shim.transport.hooks`` are called on the event loop; an exception in either one is logged and
never fails the call.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable, Iterable

try:
    import grpc
except ImportError as e:  # the [grpc] extra
    from shim.transport.grpc_extra import grpc_missing

    raise ImportError(grpc_missing("--transport grpc")) from e

from shim.transport.heap import HeapTrimmer
from shim.transport.hooks import STREAM_RECORD_MAX_BYTES, STREAM_RECORD_MAX_MESSAGES
from shim.transport.hooks import CallHooks, MethodShape, RpcCall, guarded_finished, guarded_rewrite
from shim.transport.unixsock import ThrottledLog, bind_staged, remove_if_ours, resolve_gid, transport_endpoints

log = logging.getLogger(__name__)

# Reconnect quickly when the runtime restarts (grpc's default backoff grows to 120 s, during
# which every call would fail UNAVAILABLE although the runtime is back). A unix socket
# connect is cheap, so probing once a second at worst costs nothing.
# Not grpc.min_reconnect_backoff_ms: despite its name it is the connect *timeout* (default
# 20 s); set low, a runtime slow to send its SETTINGS frame under load is never reached.
_CHANNEL_BACKOFF_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

# Calls served at once over every connection (grpc.aio.server's maximum_concurrent_rpcs: beyond it a
# call is answered RESOURCE_EXHAUSTED before any handler runs), and streams one connection may have
# open (SETTINGS_MAX_CONCURRENT_STREAMS). The kubelet's own concurrency (probes, stats, event and
# exec streams) stays far below both.
MAX_CONCURRENT_RPCS = 1000
MAX_CONCURRENT_STREAMS = 1000

# Metadata the gRPC transport owns: never copied from one call to the other.
_RESERVED_KEYS = frozenset({"user-agent", "content-type", "te", "host", "connection"})
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


# (timeout below, its grid): the steps of grpc core's three-significant-digit timeout encoding.
_TIMEOUT_GRIDS = ((1.0, 0.001), (10.0, 0.01), (100.0, 0.1), (1000.0, 1.0), (10000.0, 10.0), (100000.0, 100.0))


def _upstream_timeout(remaining: float | None) -> float | None:
    """The upstream call's timeout, so that its deadline is not later than the client's.

    grpc core sends a timeout rounded *up* to three significant digits (1 ms below 1 s, 10 ms
    below 10 s, 100 ms below 100 s, 1 s below 1000 s, ...; timeout_encoding.cc), and its clock
    reads a little stale, so forwarding ``remaining`` as is would give the runtime up to 1 %
    more time than the kubelet waits (+1 s on a 2-minute call). Round down to that grid, less a
    few milliseconds, so the round-up lands on or before our own deadline.
    """
    if remaining is None:
        return None
    for below, grid in _TIMEOUT_GRIDS:
        if remaining < below:
            break
    else:
        grid = 3600.0
    timeout = (remaining // grid) * grid - 0.005
    return timeout if timeout > 0.0 else 0.0


def _request_metadata(metadata: Iterable[tuple[str, Any]]) -> tuple:
    """The client's metadata minus what the transport sets itself (grpc-*, user-agent, ...)."""
    return tuple(
        (k, v)
        for k, v in metadata
        if k not in _RESERVED_KEYS and not k.startswith(("grpc-", ":"))
    )


def _response_metadata(metadata: Iterable[tuple[str, Any]] | None) -> tuple:
    """Upstream initial/trailing metadata to hand back; keeps grpc-status-details-bin."""
    if not metadata:
        return ()
    return tuple(
        (k, v)
        for k, v in metadata
        if k == _STATUS_DETAILS_KEY
        or (k not in _RESERVED_KEYS and not k.startswith(("grpc-", ":")))
    )


class CriProxy:
    """Serve the CRI on ``listen`` and relay every call to ``upstream``.

    ``socket_mode`` is the listening socket's mode. It may never grant access to other
    users; group bits need ``socket_group``. With a group and the default mode the socket is
    0660, owned by that group.
    """

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
        max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
        max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
    ) -> None:
        self.listen_path, upstream_path, self.socket_mode = transport_endpoints(
            listen, upstream, socket_mode, socket_group
        )
        self.upstream_target = "unix://" + upstream_path
        self.socket_group = socket_group
        if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be a positive int, not {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        for name, value in (("max_concurrent_rpcs", max_concurrent_rpcs),
                            ("max_concurrent_streams", max_concurrent_streams)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_concurrent_streams = max_concurrent_streams
        # public counters (read by the metrics): calls in a relay handler now, the most at once,
        # and the calls that brought the count to max_concurrent_rpcs (until one of them ends,
        # grpc answers every further call RESOURCE_EXHAUSTED without running a handler)
        self.in_flight = 0
        self.in_flight_peak = 0
        self.rpcs_at_limit = 0
        # grpc core's memory for streams reset before any handler ran (rapid reset) is freed
        # but kept by glibc: given back to the system when the resident size grew
        self.trimmer = HeapTrimmer()
        self._at_limit = ThrottledLog("concurrent call limit reached", level=logging.WARNING,
                                      outcome="further calls are answered RESOURCE_EXHAUSTED until one ends")
        self.hooks = hooks
        self.methods = tuple(methods)
        self.held_methods = frozenset(hooks.held_methods)
        self.stream_record_max_messages = STREAM_RECORD_MAX_MESSAGES
        self.stream_record_max_bytes = STREAM_RECORD_MAX_BYTES

        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file
        self._stopped = False
        self._rewrite_failed = ThrottledLog("rewrite hook failed")
        self._finished_failed = ThrottledLog("finished hook failed")

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("CriProxy.start() called twice")
        gid = None if self.socket_group is None else resolve_gid(self.socket_group)
        size_options = (
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        )
        channel = grpc.aio.insecure_channel(
            self.upstream_target, options=size_options + _CHANNEL_BACKOFF_OPTIONS
        )
        server = grpc.aio.server(
            options=size_options + (("grpc.max_concurrent_streams", self.max_concurrent_streams),),
            maximum_concurrent_rpcs=self.max_concurrent_rpcs)
        try:
            by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
            for m in self.methods:
                by_service.setdefault(m.service, {})[m.name] = self._method_handler(channel, m)
            for service, handlers in by_service.items():
                server.add_registered_method_handlers(service, handlers)
            server.add_generic_rpc_handlers([_GenericRelay(self._counted(self._relay_any_method))])
            self._channel = channel
            self._bind(server, gid)
            await server.start()
        except BaseException:
            self._channel = None
            await server.stop(None)
            await channel.close()
            self._remove_socket()
            raise
        self._server = server
        self.trimmer.start()
        log.info(
            "CRI proxy serving on %s (mode %#o%s), upstream %s, at most %d calls at once and %d streams "
            "per connection",
            self.listen_path,
            self.socket_mode,
            "" if gid is None else f", group {gid}",
            self.upstream_target,
            self.max_concurrent_rpcs,
            self.max_concurrent_streams,
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, give calls in flight ``grace`` seconds, close the channel,
        remove the socket file (only if it is still ours)."""
        if self._server is None or self._stopped:
            return
        self._stopped = True
        self.trimmer.stop()
        try:
            await self._server.stop(grace)
        finally:
            if self._channel is not None:
                await self._channel.close()
            self._remove_socket()

    async def wait_for_termination(self) -> None:
        if self._server is None:
            raise RuntimeError("CriProxy is not started")
        await self._server.wait_for_termination()

    # ----------------------------------------------------------------- socket

    def _bind(self, server: grpc.aio.Server, gid: int | None) -> None:
        """Bind grpcio's listening socket through ``bind_staged``: never open to other users."""

        def add_port(tmp_sock: str) -> None:
            if server.add_insecure_port("unix:" + tmp_sock) == 0:
                raise OSError(f"could not bind a unix socket at {tmp_sock}")

        self._socket_id = bind_staged(self.listen_path, self.socket_mode, gid, add_port)

    def _remove_socket(self) -> None:
        remove_if_ours(self.listen_path, self._socket_id)
        self._socket_id = None

    # ----------------------------------------------------------------- relays

    def _method_handler(self, channel: grpc.aio.Channel, m) -> grpc.RpcMethodHandler:
        counted = self._counted
        if m.client_streaming:  # none in runtime.v1; relay like an unknown method if one appears
            return grpc.stream_stream_rpc_method_handler(counted(functools.partial(self._relay_any_method, m.path)))
        if m.server_streaming:
            upstream = channel.unary_stream(m.path, _registered_method=True)
            return grpc.unary_stream_rpc_method_handler(counted(self._stream_relay(m.path, upstream)))
        upstream = channel.unary_unary(m.path, _registered_method=True)
        return grpc.unary_unary_rpc_method_handler(
            counted(self._unary_relay(m.path, upstream, m.path in self.held_methods))
        )

    def _counted(self, handler: Callable) -> Callable:
        """``handler`` counted in ``in_flight`` while it runs."""

        async def counted(*args):
            n = self.in_flight = self.in_flight + 1
            if n > self.in_flight_peak:
                self.in_flight_peak = n
            if n >= self.max_concurrent_rpcs:
                self.rpcs_at_limit += 1
                self._at_limit("a call", f"{n} calls in progress, the limit is {self.max_concurrent_rpcs}")
            try:
                return await handler(*args)
            finally:
                self.in_flight -= 1

        return counted

    def _rewritten(self, call: RpcCall) -> bytes:
        """What goes upstream: the hook's bytes, or the original ones if the hook fails."""
        return guarded_rewrite(self.hooks, call, self._rewrite_failed)

    def _finished(self, call: RpcCall) -> None:
        guarded_finished(self.hooks, call, self._finished_failed)

    @staticmethod
    def _ended_code(context: grpc.aio.ServicerContext, timeout: float | None) -> str:
        """Why a call the server cancelled under us ended: its deadline or the client.

        A client's own timer fires a little before ours (the timeout reached us rounded up, by
        up to 1 % from a grpc-core client), so "deadline" means "within that margin of it".
        """
        if timeout is None:
            return "CANCELLED"
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0.011 * timeout + 0.02:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"

    def _unary_relay(self, method: str, upstream: grpc.aio.UnaryUnaryMultiCallable, rewrite: bool):
        finished = self._finished
        rewritten = self._rewritten

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            start = time.time()
            t0 = time.perf_counter()
            forwarded = None
            out = request
            held = None
            metadata = context.invocation_metadata()
            if rewrite:
                held = RpcCall(method, start, request=request, metadata=tuple(metadata or ()))
                out = rewritten(held)
                if out is not request and out != request:
                    forwarded = out
                else:
                    out = request

            def ended(responses: list[bytes], code: str, details: str) -> None:
                duration_ms = (time.perf_counter() - t0) * 1000.0
                if held is None:
                    finished(RpcCall(method, start, duration_ms, request, forwarded, responses, code, details))
                else:
                    finished(held.complete(duration_ms, forwarded, responses, code, details))

            timeout = context.time_remaining()
            call = upstream(
                out,
                timeout=_upstream_timeout(timeout),
                metadata=_request_metadata(metadata),
            )
            try:
                response = await call
                initial = _response_metadata(await call.initial_metadata())
                if initial:
                    await context.send_initial_metadata(initial)
                trailing = _response_metadata(await call.trailing_metadata())
            except grpc.aio.AioRpcError as e:
                code = e.code()
                details = e.details() or ""
                ended([], code.name, details)
                initial = _response_metadata(e.initial_metadata())
                if initial:
                    await context.send_initial_metadata(initial)
                await context.abort(code, details, _response_metadata(e.trailing_metadata()))
            except asyncio.CancelledError:
                call.cancel()
                ended([], self._ended_code(context, timeout), "")
                raise
            except Exception as e:  # a bug here, or grpc misbehaving: the client gets UNKNOWN
                call.cancel()
                ended([], "UNKNOWN", f"proxy error: {e!r}")
                raise
            if trailing:
                context.set_trailing_metadata(trailing)
            ended([response], "OK", "")
            return response

        return relay

    def _stream_relay(self, method: str, upstream: grpc.aio.UnaryStreamMultiCallable):
        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> None:
            start = time.time()
            t0 = time.perf_counter()
            timeout = context.time_remaining()
            call = upstream(
                request,
                timeout=_upstream_timeout(timeout),
                metadata=_request_metadata(context.invocation_metadata()),
            )
            await self._pump(method, start, t0, request, call, context, timeout)

        return relay

    async def _relay_any_method(self, method: str, request_iterator, context) -> None:
        """Generic relay: any method, any cardinality, bytes both ways."""
        start = time.time()
        t0 = time.perf_counter()
        requests: list[bytes] = []
        max_n = self.stream_record_max_messages
        budget = self.stream_record_max_bytes

        async def to_upstream():
            nonlocal budget
            async for message in request_iterator:
                if len(requests) < max_n and len(message) <= budget:
                    requests.append(message)
                    budget -= len(message)
                yield message

        timeout = context.time_remaining()
        call = self._channel.stream_stream(method)(
            to_upstream(),
            timeout=_upstream_timeout(timeout),
            metadata=_request_metadata(context.invocation_metadata()),
        )
        await self._pump(method, start, t0, requests, call, context, timeout)

    async def _pump(self, method, start, t0, request, call, context, timeout) -> None:
        """Forward each upstream message as it arrives, then the status; call finished().

        ``request`` is bytes, or the list the generic relay fills while the call runs.
        """
        max_n = self.stream_record_max_messages
        max_bytes = self.stream_record_max_bytes
        kept: list[bytes] = []
        kept_bytes = 0
        truncated = False

        def record(code: str, details: str, responses: list[bytes], truncated: bool) -> None:
            req = request if type(request) is bytes else b"".join(request)
            self._finished(
                RpcCall(method, start, (time.perf_counter() - t0) * 1000.0, req, None,
                             responses, code, details, truncated)
            )

        try:
            initial = _response_metadata(await call.initial_metadata())
            if initial:
                await context.send_initial_metadata(initial)
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                if not truncated:
                    if len(kept) < max_n and kept_bytes + len(message) <= max_bytes:
                        kept.append(message)
                        kept_bytes += len(message)
                    else:
                        truncated = True
                await context.write(message)
            trailing = _response_metadata(await call.trailing_metadata())
            code = await call.code()
        except grpc.aio.AioRpcError as e:
            code = e.code()
            details = e.details() or ""
            record(code.name, details, [], False)
            await context.abort(code, details, _response_metadata(e.trailing_metadata()))
        except asyncio.CancelledError:
            call.cancel()
            record(self._ended_code(context, timeout), "", [], False)
            raise
        except Exception as e:  # a bug here, or grpc misbehaving: the client gets UNKNOWN
            call.cancel()
            record("UNKNOWN", f"proxy error: {e!r}", [], False)
            raise
        if code is not grpc.StatusCode.OK:  # read() raises on errors; this is belt and braces
            details = await call.details() or ""
            record(code.name, details, [], False)
            await context.abort(code, details, trailing)
        if trailing:
            context.set_trailing_metadata(trailing)
        record("OK", "", kept, truncated)


class _GenericRelay(grpc.GenericRpcHandler):
    """Routes every method not registered at start to the generic stream-stream relay."""

    def __init__(self, relay: Callable) -> None:
        self._relay = relay

    def service(self, handler_call_details):
        return grpc.stream_stream_rpc_method_handler(
            functools.partial(self._relay, handler_call_details.method)
        )
