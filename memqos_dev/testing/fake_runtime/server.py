"""gRPC (grpc.aio) server for FakeRuntime on a unix socket, plus a thread-hosted variant.

Every method of runtime.v1 RuntimeService and ImageService is registered with raw-bytes
(de)serializers, so the runtime sees -- and records -- the exact request bytes a client or a
proxy sent. Methods the fake does not implement answer UNIMPLEMENTED "method X not
implemented" (grpc-go's Unimplemented*Server text, as containerd answers); methods or services
that do not exist at all answer UNIMPLEMENTED "unknown method X for service S" / "unknown
service S", grpc-go's texts (recorder-smoke.jsonl seq 12 shows containerd's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import stat
import threading
from typing import Any

import grpc

from shim.cri import pb
from memqos_dev.testing.fake_runtime.errors import CriError, go_duration
from memqos_dev.testing.fake_runtime.methods import METHODS, SERVICES
from memqos_dev.testing.fake_runtime.runtime import FakeRuntime
from shim.transport.loop_thread import host_loop

DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024


def socket_path(listen: str) -> str:
    """'unix:///run/x.sock', 'unix:/run/x.sock' or '/run/x.sock' -> absolute filesystem path."""
    if listen.startswith("unix://"):
        path = listen[len("unix://"):]
    elif listen.startswith("unix:"):
        path = listen[len("unix:"):]
    else:
        path = listen
    if not path:
        raise ValueError(f"no socket path in {listen!r}")
    return os.path.abspath(path)


def socket_address(listen: str) -> str:
    """The gRPC target for a socket path: 'unix:///abs/path'."""
    return "unix://" + socket_path(listen)


def remove_stale_socket(path: str) -> None:
    """Unlink a socket file left by an earlier server; FileExistsError if the path is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode):
        os.unlink(path)
    else:
        raise FileExistsError(f"{path} exists and is not a socket")


def _unary_behavior(runtime: FakeRuntime, path: str):
    name = path.rsplit("/", 1)[-1]

    async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = runtime.record_call(path, request)
        try:
            if name == "ExecSync":
                response = await _exec_sync(runtime, path, request)
            else:
                delay = runtime.delay_for(path)
                if delay > 0:
                    await asyncio.sleep(delay)
                failure = runtime.failure_for(path)
                if failure is not None:
                    raise CriError(*failure)
                response = runtime.handle(path, request)
        except CriError as err:
            call.code, call.details = err.code.name, err.details
            await context.abort(err.code, err.details)
        except asyncio.CancelledError:
            call.code, call.details = "CANCELLED", "cancelled by the client"
            raise
        call.code = "OK"
        return response

    return behavior


async def _exec_sync(runtime: FakeRuntime, path: str, request: bytes) -> bytes:
    """ExecSync with containerd's timeout: a delay longer than req.timeout (> 0) ends in
    DEADLINE_EXCEEDED after req.timeout seconds (execInternal's execCtx)."""
    response = runtime.handle(path, request)  # existence / state checks come first
    delay = runtime.delay_for(path)
    if delay > 0:
        timeout = pb.ExecSyncRequest.FromString(request).timeout
        if 0 < timeout < delay:
            await asyncio.sleep(timeout)
            raise CriError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"failed to exec in container: timeout {go_duration(timeout)} exceeded: context deadline exceeded",
            )
        await asyncio.sleep(delay)
    failure = runtime.failure_for(path)
    if failure is not None:
        raise CriError(*failure)
    return response


def _streaming_behavior(runtime: FakeRuntime, path: str):
    name = path.rsplit("/", 1)[-1]

    async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> None:
        call = runtime.record_call(path, request)
        call.code, call.details = "UNIMPLEMENTED", f"method {name} not implemented"
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, call.details)

    return behavior


class _UnknownMethodHandler(grpc.GenericRpcHandler):
    """Last-resort handler: grpc-go's answers for methods/services the server does not have."""

    def __init__(self, runtime: FakeRuntime):
        self._runtime = runtime

    def service(self, handler_call_details: Any):
        method = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode("utf-8", "replace")
        service, _, name = method.lstrip("/").partition("/")
        if service in SERVICES:
            details = f"unknown method {name} for service {service}"
        else:
            details = f"unknown service {service}"
        runtime = self._runtime

        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = runtime.record_call(method, request)
            call.code, call.details = "UNIMPLEMENTED", details
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)

        return grpc.unary_unary_rpc_method_handler(behavior)


def generic_handlers(runtime: FakeRuntime) -> tuple[grpc.GenericRpcHandler, ...]:
    """The handlers serving ``runtime``: one per service, then the unknown-method fallback."""
    per_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {s: {} for s in SERVICES}
    for name, (path, _req, _resp, streaming) in METHODS.items():
        service = path.lstrip("/").split("/", 1)[0]
        if streaming:
            handler = grpc.unary_stream_rpc_method_handler(_streaming_behavior(runtime, path))
        else:
            handler = grpc.unary_unary_rpc_method_handler(_unary_behavior(runtime, path))
        per_service[service][name] = handler
    handlers = [grpc.method_handlers_generic_handler(s, h) for s, h in per_service.items()]
    handlers.append(_UnknownMethodHandler(runtime))
    return tuple(handlers)


async def serve_fake_runtime(
    listen_path: str,
    runtime: FakeRuntime | None = None,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    **runtime_kwargs: Any,
) -> tuple[grpc.aio.Server, FakeRuntime]:
    """Start a grpc.aio server for ``runtime`` on a unix socket; returns (server, runtime).

    ``listen_path`` is a path or 'unix:///path'; a stale socket file there is replaced (as
    containerd does). Without ``runtime`` a FakeRuntime(**runtime_kwargs) is created. The
    server is started; stop it with ``await server.stop(grace)``.
    """
    if runtime is None:
        runtime = FakeRuntime(**runtime_kwargs)
    elif runtime_kwargs:
        raise TypeError("pass either a runtime or FakeRuntime keyword arguments, not both")
    path = socket_path(listen_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_socket(path)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    )
    server.add_generic_rpc_handlers(generic_handlers(runtime))
    server.add_insecure_port("unix:" + path)
    await server.start()
    return server, runtime


class FakeRuntimeServer:
    """The aio server running in its own thread and event loop, for tests without asyncio.

        with FakeRuntimeServer(tmp_path / "rt.sock") as srv:
            stub = api_pb2_grpc.RuntimeServiceStub(grpc.insecure_channel(srv.address))
            ...
            srv.runtime.container(cid).create_request_bytes
    """

    def __init__(
        self,
        listen_path: str | os.PathLike,
        runtime: FakeRuntime | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        **runtime_kwargs: Any,
    ):
        if runtime is None:
            runtime = FakeRuntime(**runtime_kwargs)
        elif runtime_kwargs:
            raise TypeError("pass either a runtime or FakeRuntime keyword arguments, not both")
        self.runtime = runtime
        self.path = socket_path(os.fspath(listen_path))
        self.address = "unix://" + self.path
        self._max_message_bytes = max_message_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> "FakeRuntimeServer":
        if self.running:
            return self
        loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        serve = functools.partial(serve_fake_runtime, self.path, self.runtime,
                                  max_message_bytes=self._max_message_bytes)
        self._loop = loop
        self._thread = threading.Thread(target=host_loop, args=(loop, serve, ready),
                                        name=f"fake-runtime {self.path}", daemon=True)
        self._thread.start()
        try:
            error = ready.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"fake runtime did not start on {self.path} within {timeout}s") from None
        if error is not None:
            self._thread.join(timeout)
            self._thread = None
            raise error
        self._server, _ = ready.result()
        return self

    def stop(self, grace: float | None = None, timeout: float = 10.0) -> None:
        loop, thread, server = self._loop, self._thread, self._server
        if thread is None or loop is None:
            return
        if server is not None and thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(server.stop(grace), loop)
            fut.result(timeout)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = self._server = self._loop = None
        try:
            remove_stale_socket(self.path)
        except OSError:
            pass

    def channel(self, **kwargs: Any) -> grpc.Channel:
        """A new sync channel to this server (the caller closes it)."""
        return grpc.insecure_channel(self.address, **kwargs)

    def __enter__(self) -> "FakeRuntimeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
