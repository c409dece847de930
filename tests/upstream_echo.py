"""A fake CRI runtime for the transport tests: a real grpc.aio server on a unix socket.

It serves every runtime.v1 method generically (the method table comes straight from the
descriptor, independent of the code under test), records what it received per call (raw
request bytes, invocation metadata, remaining deadline, whether the call was cancelled), and
answers with deterministic bytes derived from the method and the request. Tests steer it per
method with ``Behaviour``: delay, failure (code, details, trailing metadata), response size,
number of stream messages, extra metadata.

Unknown services and methods get UNIMPLEMENTED with containerd's wording; like containerd 1.6
it also serves ``/runtime.v1alpha2.RuntimeService/Version``.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from shim.cri import pb

SERVICES = ("RuntimeService", "ImageService")
# path -> server_streaming, for all 43 runtime.v1 methods
METHODS: dict[str, bool] = {
    f"/{pb.DESCRIPTOR.services_by_name[s].full_name}/{m.name}": m.server_streaming
    for s in SERVICES
    for m in pb.DESCRIPTOR.services_by_name[s].methods
}
V1ALPHA2_VERSION = "/runtime.v1alpha2.RuntimeService/Version"
MAX_MESSAGE = 64 * 1024 * 1024
RESPONSE_FIELD = 1000  # unknown to every CRI message, so the answer parses as any response type


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """One protobuf LEN field: valid wire format for any message type (kept as unknown)."""
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


def response_bytes(method: str, request: bytes, index: int = 0, size: int | None = None) -> bytes:
    """The deterministic answer to ``request`` (message ``index`` of a stream)."""
    digest = hashlib.sha256(f"{method}#{index}#".encode() + request).digest()
    if size is not None and size > len(digest):
        digest = (digest * (size // len(digest) + 1))[:size]
    return length_delimited(RESPONSE_FIELD, digest)


@dataclass
class Behaviour:
    delay: float = 0.0  # seconds before answering (cancellable)
    fail: tuple[grpc.StatusCode, str, tuple] | None = None  # code, details, trailing metadata
    fail_after: int = 0  # streams: messages sent before failing
    response_size: int | None = None  # payload size of the (first) response
    stream_messages: int = 3
    gate: asyncio.Event | None = None  # streams: wait for it after the first message
    initial_metadata: tuple = ()
    trailing_metadata: tuple = ()  # on success


@dataclass
class Received:
    method: str
    request: bytes
    metadata: tuple[tuple[str, Any], ...]
    time_remaining: float | None
    deadline: float | None  # time.time() of the deadline, independent of when the handler ran
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def md(self, key: str) -> list[Any]:
        return [v for k, v in self.metadata if k == key]


class EchoUpstream:
    def __init__(self, path: str) -> None:
        self.path = path
        self.received: list[Received] = []
        self.behaviours: dict[str, Behaviour] = {}
        self._server: grpc.aio.Server | None = None
        self._handlers = {
            path: (
                grpc.unary_stream_rpc_method_handler(self._stream_handler(path))
                if streaming
                else grpc.unary_unary_rpc_method_handler(self._unary_handler(path))
            )
            for path, streaming in METHODS.items()
        }
        self._handlers[V1ALPHA2_VERSION] = grpc.unary_unary_rpc_method_handler(self._v1alpha2_version)

    # -------------------------------------------------------------- control

    def behave(self, method: str, **kw: Any) -> Behaviour:
        b = self.behaviours[method] = Behaviour(**kw)
        return b

    def calls(self, method: str) -> list[Received]:
        return [r for r in self.received if r.method == method]

    async def start(self) -> None:
        server = grpc.aio.server(
            options=(
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
            )
        )
        server.add_generic_rpc_handlers([_Router(self._handlers)])
        server.add_insecure_port("unix:" + self.path)
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    # -------------------------------------------------------------- handlers

    def _record(self, method: str, request: bytes, context) -> Received:
        remaining = context.time_remaining()
        rec = Received(method, request, tuple(context.invocation_metadata()), remaining,
                       None if remaining is None else time.time() + remaining)
        self.received.append(rec)
        return rec

    def _unary_handler(self, method: str):
        async def handle(request: bytes, context) -> bytes:
            rec = self._record(method, request, context)
            b = self.behaviours.get(method) or Behaviour()
            try:
                if b.delay:
                    await asyncio.sleep(b.delay)
            except asyncio.CancelledError:
                rec.cancelled = True
                raise
            finally:
                rec.done.set()
            if b.initial_metadata:
                await context.send_initial_metadata(b.initial_metadata)
            if b.fail is not None:
                code, details, trailing = b.fail
                await context.abort(code, details, trailing)
            if b.trailing_metadata:
                context.set_trailing_metadata(b.trailing_metadata)
            return response_bytes(method, request, 0, b.response_size)

        return handle

    def _stream_handler(self, method: str):
        async def handle(request: bytes, context) -> None:
            rec = self._record(method, request, context)
            b = self.behaviours.get(method) or Behaviour()
            try:
                if b.initial_metadata:
                    await context.send_initial_metadata(b.initial_metadata)
                if b.delay:
                    await asyncio.sleep(b.delay)
                for i in range(b.stream_messages):
                    if b.fail is not None and i == b.fail_after:
                        break
                    await context.write(
                        response_bytes(method, request, i, b.response_size if i == 0 else None)
                    )
                    if i == 0 and b.gate is not None:
                        await b.gate.wait()
            except asyncio.CancelledError:
                rec.cancelled = True
                raise
            finally:
                rec.done.set()
            if b.fail is not None:
                code, details, trailing = b.fail
                await context.abort(code, details, trailing)
            if b.trailing_metadata:
                context.set_trailing_metadata(b.trailing_metadata)

        return handle

    async def _v1alpha2_version(self, request: bytes, context) -> bytes:
        rec = self._record(V1ALPHA2_VERSION, request, context)
        rec.done.set()
        return pb.VersionResponse(
            version="0.1.0", runtime_name="containerd", runtime_version="1.6.20",
            runtime_api_version="v1alpha2",
        ).SerializeToString()


def _unimplemented(message: str):
    async def handle(request_iterator, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    return grpc.stream_stream_rpc_method_handler(handle)


KNOWN_SERVICES = {p.rsplit("/", 1)[0].lstrip("/") for p in METHODS} | {"runtime.v1alpha2.RuntimeService"}


class _Router(grpc.GenericRpcHandler):
    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._handlers = handlers

    def service(self, details):
        h = self._handlers.get(details.method)
        if h is not None:
            return h
        service, _, name = details.method.lstrip("/").partition("/")
        if service in KNOWN_SERVICES:  # containerd's (grpc-go's) wording
            return _unimplemented(f"unknown method {name} for service {service}")
        return _unimplemented(f"unknown service {service}")
