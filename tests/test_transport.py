"""The transport, end to end: a real proxy on a real unix socket, in front of a real
grpc.aio upstream (tests/upstream_echo.py), called by a real grpc.aio client with raw bytes.

The transport is the HTTP/2 relay (``RelayProxy``); ``Proxy(...)`` builds it with the CRI
method table.

No pytest-asyncio: one event loop per module, each test runs its coroutine on it.
"""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import time

import grpc
import pytest

from shim.transport.endpoints import socket_path
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri.methods import CREATE_CONTAINER, CRI_METHODS, UPDATE_CONTAINER_RESOURCES
from shim.transport.hooks import RpcCall

REWRITTEN_METHODS = ContainerMemoryQoS.held_methods
from shim.transport.relay import RelayProxy

try:
    from tests.upstream_echo import METHODS, V1ALPHA2_VERSION, EchoUpstream, length_delimited, response_bytes
except ImportError:  # tests/ not importable as a package: pytest put tests/ itself on sys.path
    from upstream_echo import METHODS, V1ALPHA2_VERSION, EchoUpstream, length_delimited, response_bytes

VERSION = "/runtime.v1.RuntimeService/Version"
EXEC_SYNC = "/runtime.v1.RuntimeService/ExecSync"
CONTAINER_STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"
PULL_IMAGE = "/runtime.v1.ImageService/PullImage"
CLIENT_MAX = 64 * 1024 * 1024
MiB = 1024 * 1024


# ---------------------------------------------------------------------------- harness

def Proxy(*args, **kw):
    """The transport under test, with the CRI method table."""
    kw.setdefault("methods", CRI_METHODS)
    return RelayProxy(*args, **kw)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def run(loop, aw, timeout: float = 30.0):
    """Run a coroutine, or a function returning an awaitable (so that grpc calls are created
    inside the running loop), on the module's loop."""
    async def main():
        return await (aw() if callable(aw) else aw)

    return loop.run_until_complete(asyncio.wait_for(main(), timeout))


class RecordingHooks:
    held_methods = REWRITTEN_METHODS

    def __init__(self) -> None:
        self.rewrites: list[tuple[str, bytes]] = []
        self.finished_calls: list[RpcCall] = []
        self.rewrite_fn = None
        self.finished_raises = False

    def rewrite(self, call: RpcCall) -> bytes:
        method, request = call.method, call.request
        self.rewrites.append((method, request))
        return request if self.rewrite_fn is None else self.rewrite_fn(method, request)

    def not_rewritten(self, method: str, reason: str) -> None:
        return None

    def finished(self, call: RpcCall) -> None:
        self.finished_calls.append(call)
        if self.finished_raises:
            raise RuntimeError("finished hook bug")

    def calls(self, method: str) -> list[RpcCall]:
        return [c for c in self.finished_calls if c.method == method]


class Stack:
    """echo upstream + proxy + client, all on unix sockets under tmp_path."""

    def __init__(self, tmp_path, **proxy_kw) -> None:
        self.dir = tmp_path
        self.upstream_path = str(tmp_path / "containerd.sock")
        self.listen_path = str(tmp_path / "run" / "shim.sock")
        self.echo = EchoUpstream(self.upstream_path)
        self.hooks = RecordingHooks()
        self.proxy = Proxy(
            "unix://" + self.listen_path, "unix://" + self.upstream_path, self.hooks, **proxy_kw
        )
        self.channel: grpc.aio.Channel | None = None

    async def start(self, upstream: bool = True) -> "Stack":
        if upstream:
            await self.echo.start()
        await self.proxy.start()
        self.channel = grpc.aio.insecure_channel(
            "unix://" + self.listen_path,
            options=(
                ("grpc.max_receive_message_length", CLIENT_MAX),
                ("grpc.max_send_message_length", CLIENT_MAX),
            ),
        )
        return self

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.proxy.stop(0)
        await self.echo.stop()

    def unary(self, method: str):
        return self.channel.unary_unary(method)

    def stream(self, method: str):
        return self.channel.unary_stream(method)


@pytest.fixture
def stack(loop, tmp_path):
    s = Stack(tmp_path)
    run(loop, s.start())
    yield s
    run(loop, s.stop())


def request_for(method: str, tag: str = "") -> bytes:
    """Distinct, valid protobuf bytes per method (field 15: unknown to every request)."""
    return length_delimited(15, f"{method}|{tag}".encode()) + length_delimited(1, b"\x00\xffid")


async def collect(call) -> list[bytes]:
    return [m async for m in call]


async def read_rest(call) -> list[bytes]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


# ---------------------------------------------------------------------------- endpoints


def test_endpoint_forms():
    assert socket_path("unix:///run/containerd/containerd.sock") == "/run/containerd/containerd.sock"
    assert socket_path("/run/containerd/containerd.sock") == "/run/containerd/containerd.sock"
    assert socket_path("unix:/run/x.sock") == "/run/x.sock"
    for bad in ("tcp://127.0.0.1:1234", "npipe:////./pipe/containerd", "http://x/y", "unix://host/x.sock",
                "x.sock", "", "unix:///", "/" + "a" * 200):
        with pytest.raises(ValueError):
            socket_path(bad)
    with pytest.raises(ValueError, match="tcp"):
        socket_path("tcp://127.0.0.1:1234")


# ---------------------------------------------------------------------------- passthrough


def test_method_table_has_43_methods():
    assert len(METHODS) == 43
    assert sum(METHODS.values()) == 7  # GetContainerEvents and the six Stream* methods


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_is_byte_identical(loop, stack, method):
    request = request_for(method)

    async def body():
        if METHODS[method]:
            return await collect(stack.stream(method)(request, timeout=10))
        return [await stack.unary(method)(request, timeout=10)]

    responses = run(loop, body())
    [seen] = stack.echo.calls(method)
    assert seen.request == request
    n = 3 if METHODS[method] else 1
    assert responses == [response_bytes(method, request, i) for i in range(n)]
    [fc] = stack.hooks.calls(method)
    assert (fc.request, fc.forwarded, fc.responses, fc.code, fc.details, fc.truncated) == (
        request, None, responses, "OK", "", False)


def test_empty_request_and_empty_response_pass(loop, stack):
    # Version with no fields set: b"" both ways is a valid message and must not be confused
    # with "no message".
    stack.echo.behave(VERSION, response_size=None)
    resp = run(loop, lambda: stack.unary(VERSION)(b"", timeout=5))
    assert resp == response_bytes(VERSION, b"")
    assert stack.echo.calls(VERSION)[0].request == b""


def test_server_stream_relays_messages_in_order_as_they_arrive(loop, stack):
    gate = asyncio.Event()
    stack.echo.behave(EVENTS, stream_messages=6, gate=gate)
    request = request_for(EVENTS)

    async def body():
        call = stack.stream(EVENTS)(request, timeout=10)
        # the upstream holds the stream open after its first message until the gate opens:
        # a relay that buffered the stream would never deliver this one
        first = await asyncio.wait_for(call.read(), 5)
        assert not stack.hooks.calls(EVENTS)  # the call has not finished yet
        gate.set()
        rest = await read_rest(call)
        return [first] + rest

    msgs = run(loop, body())
    assert msgs == [response_bytes(EVENTS, request, i) for i in range(6)]
    assert stack.hooks.calls(EVENTS)[0].responses == msgs


# ---------------------------------------------------------------------------- errors


def test_error_passes_code_details_and_binary_details_trailer(loop, stack):
    status_bin = b"\x08\x05\x12\x09not found\x00\xff\x80"  # arbitrary bytes, not UTF-8
    stack.echo.behave(
        CONTAINER_STATUS,
        fail=(grpc.StatusCode.NOT_FOUND, 'an error occurred when try to find container "x": not found',
              (("grpc-status-details-bin", status_bin), ("x-runtime", "containerd"))),
    )
    request = request_for(CONTAINER_STATUS)

    async def body():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.unary(CONTAINER_STATUS)(request, timeout=5)
        return info.value

    err = run(loop, body())
    assert err.code() is grpc.StatusCode.NOT_FOUND
    assert err.details() == 'an error occurred when try to find container "x": not found'
    trailing = list(err.trailing_metadata())
    assert ("grpc-status-details-bin", status_bin) in trailing
    assert ("x-runtime", "containerd") in trailing
    [fc] = stack.hooks.calls(CONTAINER_STATUS)
    assert (fc.request, fc.responses, fc.code, fc.details) == (
        request, [], "NOT_FOUND", 'an error occurred when try to find container "x": not found')


def test_stream_error_after_messages(loop, stack):
    method = "/runtime.v1.RuntimeService/StreamContainers"
    stack.echo.behave(method, stream_messages=5, fail_after=2,
                      fail=(grpc.StatusCode.INTERNAL, "boom", (("grpc-status-details-bin", b"\x01\x02"),)))
    request = request_for(method)

    async def body():
        call = stack.stream(method)(request, timeout=5)
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for m in call:
                got.append(m)
        return got, info.value

    got, err = run(loop, body())
    assert got == [response_bytes(method, request, i) for i in range(2)]
    assert err.code() is grpc.StatusCode.INTERNAL and err.details() == "boom"
    assert ("grpc-status-details-bin", b"\x01\x02") in list(err.trailing_metadata())
    [fc] = stack.hooks.calls(method)
    assert (fc.code, fc.details, fc.responses) == ("INTERNAL", "boom", [])


# ---------------------------------------------------------------------------- sizes


def test_20mib_response(loop, stack):
    stack.echo.behave(PULL_IMAGE, response_size=20 * MiB)
    request = request_for(PULL_IMAGE)
    resp = run(loop, lambda: stack.unary(PULL_IMAGE)(request, timeout=20))
    assert len(resp) > 20 * MiB
    assert resp == response_bytes(PULL_IMAGE, request, 0, 20 * MiB)


def test_20mib_request(loop, stack):
    method = "/runtime.v1.RuntimeService/UpdateRuntimeConfig"
    request = length_delimited(1, os.urandom(20 * MiB))
    resp = run(loop, lambda: stack.unary(method)(request, timeout=20))
    assert stack.echo.calls(method)[0].request == request
    assert resp == response_bytes(method, request)


def test_message_limit_applies(loop, tmp_path):
    s = Stack(tmp_path, max_message_bytes=1 * MiB)

    async def body():
        await s.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as big_req:
                await s.unary(VERSION)(length_delimited(1, b"x" * (2 * MiB)), timeout=10)
            s.echo.behave(PULL_IMAGE, response_size=2 * MiB)
            with pytest.raises(grpc.aio.AioRpcError) as big_resp:
                await s.unary(PULL_IMAGE)(b"", timeout=10)
            ok = await s.unary(VERSION)(b"", timeout=10)
            return big_req.value, big_resp.value, ok
        finally:
            await s.stop()

    big_req, big_resp, ok = run(loop, body())
    assert big_req.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert big_resp.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ok == response_bytes(VERSION, b"")


# ---------------------------------------------------------------------------- deadlines, cancellation


TIMEOUTS = (0.7, 3.0, 10.0, 30.0, 150.0)


def _client_rounding_step(t: float) -> float:
    """grpc-core's grpc-timeout encoding keeps 3 significant digits (timeout_encoding.cc)."""
    return 0.001 if t < 1 else 0.01 if t < 10 else 0.1 if t < 100 else 1.0 if t < 1000 else 10.0


def test_deadline_is_propagated_and_never_extended(loop, stack):
    """The upstream gets the client's deadline, never a later one than a direct call gives.

    Deadlines are compared as points in time (the client's send time + timeout against the
    upstream's deadline), so how late a handler runs on a busy machine does not matter. A
    grpc-core client (this test's) already rounds its timeout up on the wire, by up to 1 %
    (1 s at 150 s): the baseline is the deadline the upstream sees when the same client calls
    it directly. Forwarding the proxy's remaining time unrounded would add that step again."""
    sent: dict[tuple[bytes, float], float] = {}

    async def call(mc, tag: bytes, t: float) -> None:
        sent[tag, t] = time.time()
        await mc(tag + str(t).encode(), timeout=t)

    async def body():
        direct = grpc.aio.insecure_channel("unix://" + stack.upstream_path)
        try:
            for t in TIMEOUTS:
                await call(direct.unary_unary(VERSION), b"direct", t)
                await call(stack.unary(VERSION), b"proxied", t)
        finally:
            await direct.close()
        await stack.unary(VERSION)(b"none")  # no deadline
        await collect(stack.stream(EVENTS)(b"", timeout=7))

    run(loop, body())
    seen = {r.request: r for r in stack.echo.calls(VERSION)}
    for t in TIMEOUTS:
        d = seen[b"direct" + str(t).encode()]
        p = seen[b"proxied" + str(t).encode()]
        assert p.deadline is not None, "no deadline reached the upstream"
        direct_extra = d.deadline - (sent[b"direct", t] + t)
        proxied_extra = p.deadline - (sent[b"proxied", t] + t)
        # The relay forwards the client's grpc-timeout header byte for byte (tests/
        # test_relay.py compares the bytes), so the upstream's deadline is exactly the one the
        # client's own encoding gives: one sample of what a direct call gives. The client
        # rounds up by one step of its 3-significant-digit encoding on some calls (its clock
        # reads stale) and not on others, so the bound is that step.
        limit = max(direct_extra + 0.03, _client_rounding_step(t) + 0.03)
        assert proxied_extra <= limit, (
            f"timeout {t}: the upstream's deadline is {proxied_extra:+.3f} s from the client's "
            f"through the proxy, {direct_extra:+.3f} s directly")
        assert proxied_extra >= -0.012 * t - 0.02, f"timeout {t}: deadline cut by {-proxied_extra:.3f} s"
    assert seen[b"none"].time_remaining is None
    [ev] = stack.echo.calls(EVENTS)
    assert ev.time_remaining is not None and 5 < ev.time_remaining <= 7.1


def test_upstream_gets_the_remaining_time_not_the_original_timeout(loop, stack):
    def slow_rewrite(method, request):
        time.sleep(0.5)  # a (misbehaving) blocking hook eats into the call's time
        return request

    stack.hooks.rewrite_fn = slow_rewrite
    t_send = time.time()
    run(loop, lambda: stack.unary(CREATE_CONTAINER)(b"", timeout=5))
    [seen] = stack.echo.calls(CREATE_CONTAINER)
    # forwarding the original 5 s after the hook's 0.5 s would move the deadline by 0.5 s
    assert seen.deadline is not None and t_send + 4.9 < seen.deadline <= t_send + 5.06
    assert seen.time_remaining <= 4.56


def test_slow_call_ends_deadline_exceeded_near_its_deadline(loop, stack):
    stack.echo.behave(EXEC_SYNC, delay=5)

    async def body():
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.unary(EXEC_SYNC)(request_for(EXEC_SYNC), timeout=1)
        elapsed = time.monotonic() - t0
        [seen] = stack.echo.calls(EXEC_SYNC)
        await asyncio.wait_for(seen.done.wait(), 3)  # the upstream handler is gone, not sleeping on
        return info.value, elapsed, seen

    err, elapsed, seen = run(loop, body())
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.8 <= elapsed < 2.5
    assert seen.cancelled
    [fc] = stack.hooks.calls(EXEC_SYNC)
    assert fc.code == "DEADLINE_EXCEEDED" and fc.responses == []


@pytest.mark.parametrize("method", [EXEC_SYNC, EVENTS])
def test_client_cancel_cancels_upstream_call(loop, stack, method):
    stack.echo.behave(method, delay=30)

    async def body():
        rpc = stack.stream(method) if METHODS[method] else stack.unary(method)
        call = rpc(request_for(method))  # no deadline: only the cancellation can end it
        while not stack.echo.calls(method):
            await asyncio.sleep(0.01)
        call.cancel()
        [seen] = stack.echo.calls(method)
        await asyncio.wait_for(seen.done.wait(), 5)
        for _ in range(200):  # the proxy's handler records the call when it unwinds
            if stack.hooks.calls(method):
                break
            await asyncio.sleep(0.01)
        return seen

    seen = run(loop, body())
    assert seen.cancelled
    [fc] = stack.hooks.calls(method)
    assert fc.code == "CANCELLED"


# ---------------------------------------------------------------------------- metadata


def test_request_metadata_and_response_metadata_pass(loop, stack):
    stack.echo.behave(VERSION, initial_metadata=(("x-initial", "i"),),
                      trailing_metadata=(("x-trailing", "t"), ("x-trailing-bin", b"\x00\x01")))
    sent = (("x-request-id", "abc"), ("x-multi", "1"), ("x-multi", "2"), ("x-blob-bin", b"\x00\xff\x10"))

    async def body():
        call = stack.unary(VERSION)(b"", metadata=sent, timeout=5)
        await call
        return list(await call.initial_metadata()), list(await call.trailing_metadata())

    initial, trailing = run(loop, body())
    [seen] = stack.echo.calls(VERSION)
    assert seen.md("x-request-id") == ["abc"]
    assert seen.md("x-multi") == ["1", "2"]
    assert seen.md("x-blob-bin") == [b"\x00\xff\x10"]
    assert len(seen.md("user-agent")) == 1  # the proxy's own, not a duplicate of the client's
    assert ("x-initial", "i") in initial
    assert ("x-trailing", "t") in trailing and ("x-trailing-bin", b"\x00\x01") in trailing


# ---------------------------------------------------------------------------- unknown methods


def test_unknown_method_gets_upstreams_unimplemented(loop, stack):
    async def body():
        errs = []
        for method in ("/runtime.v1.RuntimeService/NoSuch", "/runtime.v1alpha3.RuntimeService/Version"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stack.unary(method)(b"\n\x02v1", timeout=5)
            errs.append(info.value)
        return errs

    no_such, no_service = run(loop, body())
    # the wording is the upstream's (containerd's), not the proxy's own "Method not found!"
    assert no_such.code() is grpc.StatusCode.UNIMPLEMENTED
    assert no_such.details() == "unknown method NoSuch for service runtime.v1.RuntimeService"
    assert no_service.code() is grpc.StatusCode.UNIMPLEMENTED
    assert no_service.details() == "unknown service runtime.v1alpha3.RuntimeService"
    [fc] = stack.hooks.calls("/runtime.v1.RuntimeService/NoSuch")
    assert (fc.request, fc.code) == (b"\n\x02v1", "UNIMPLEMENTED")


def test_unknown_service_v1alpha2_is_forwarded(loop, stack):
    resp = run(loop, lambda: stack.unary(V1ALPHA2_VERSION)(b"\n\x02v1", timeout=5))
    [seen] = stack.echo.calls(V1ALPHA2_VERSION)
    assert seen.request == b"\n\x02v1"
    assert b"v1alpha2" in resp and b"containerd" in resp
    [fc] = stack.hooks.calls(V1ALPHA2_VERSION)
    assert (fc.request, fc.responses, fc.code) == (b"\n\x02v1", [resp], "OK")


# ---------------------------------------------------------------------------- upstream failures


OUTAGE = 6.0


def test_upstream_down_then_back(loop, tmp_path):
    s = Stack(tmp_path)

    async def version_code():
        try:
            await s.unary(VERSION)(b"", timeout=3)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def until_ok(limit: float) -> float:
        t0 = time.monotonic()
        while await version_code() is not grpc.StatusCode.OK:
            assert time.monotonic() - t0 < limit, "proxy did not recover after the upstream came back"
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    async def body():
        await s.start(upstream=False)
        try:
            assert await version_code() is grpc.StatusCode.UNAVAILABLE
            assert await version_code() is grpc.StatusCode.UNAVAILABLE
            await s.echo.start()
            await until_ok(5)
            # the runtime restarts under the proxy and stays away for a while (kubelet keeps
            # calling): once it is back, calls succeed again within about a second, not after
            # grpc's default reconnect backoff, which grows towards 120 s
            await s.echo.stop()
            t0 = time.monotonic()
            while time.monotonic() - t0 < OUTAGE:
                assert await version_code() is grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.2)
            s.echo = EchoUpstream(s.upstream_path)
            await s.echo.start()
            recovery = await until_ok(10)
            assert recovery < 2.5, f"{recovery:.1f} s to reach the runtime again"
            assert s.hooks.calls(VERSION)[0].code == "UNAVAILABLE"
        finally:
            await s.stop()

    run(loop, body(), timeout=60)


def test_runtime_slow_to_accept_a_connection_is_waited_for(loop, tmp_path):
    """A busy runtime may take a while to send its HTTP/2 SETTINGS: the proxy's first call
    must wait for it, not give up on the connection (grpc.min_reconnect_backoff_ms is the
    connect timeout)."""
    s = Stack(tmp_path)
    slow_front = str(tmp_path / "slow.sock")
    s.proxy = Proxy(s.listen_path, slow_front, s.hooks)
    pipes = []

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def slow_accept(reader, writer):
        await asyncio.sleep(0.6)  # nothing, not even SETTINGS, for 0.6 s
        up_reader, up_writer = await asyncio.open_unix_connection(s.upstream_path)
        pipes.append(asyncio.ensure_future(pipe(reader, up_writer)))
        pipes.append(asyncio.ensure_future(pipe(up_reader, writer)))

    async def body():
        front = await asyncio.start_unix_server(slow_accept, slow_front)
        await s.start()
        try:
            return await s.unary(VERSION)(b"", timeout=10)
        finally:
            await s.stop()
            front.close()
            for p in pipes:
                p.cancel()

    assert run(loop, body()) == response_bytes(VERSION, b"")


# ---------------------------------------------------------------------------- concurrency


def test_quick_call_not_delayed_by_100_slow_calls(loop, stack):
    stack.echo.behave(EXEC_SYNC, delay=3)
    stack.echo.behave(PULL_IMAGE, delay=3)
    stack.echo.behave("/runtime.v1.RuntimeService/StopContainer", delay=3)
    slow_methods = [EXEC_SYNC] * 90 + [PULL_IMAGE] * 5 + ["/runtime.v1.RuntimeService/StopContainer"] * 5

    async def body():
        slow = [asyncio.ensure_future(stack.unary(m)(request_for(m, str(i)), timeout=20))
                for i, m in enumerate(slow_methods)]
        t_wait = time.monotonic()
        while len(stack.echo.received) < len(slow):  # all 100 in flight at the upstream
            assert time.monotonic() - t_wait < 10
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        resp = await stack.unary(VERSION)(b"", timeout=10)
        quick = time.monotonic() - t0
        results = await asyncio.gather(*slow)
        return resp, quick, results

    resp, quick, results = run(loop, body())
    assert resp == response_bytes(VERSION, b"")
    assert quick < 1.5, f"Version took {quick:.2f} s behind 100 slow calls"
    assert results == [response_bytes(m, request_for(m, str(i))) for i, m in enumerate(slow_methods)]


# ---------------------------------------------------------------------------- hooks


def test_the_transport_holds_exactly_the_methods_the_hooks_declare(loop, tmp_path):
    """The transport knows no method names: hooks that hold ExecSync get it rewritten, and
    CreateContainer passes through untouched; rewrite() and finished() get the same call."""
    s = Stack(tmp_path)

    class ExecHooks(RecordingHooks):
        held_methods = frozenset({EXEC_SYNC})

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[RpcCall] = []

        def rewrite(self, call: RpcCall) -> bytes:
            self.seen.append(call)
            call.rewritten = "tagged"
            return super().rewrite(call)

    s.hooks = ExecHooks()
    s.hooks.rewrite_fn = lambda method, request: request + length_delimited(99, b"rewritten")
    s.proxy = Proxy("unix://" + s.listen_path, "unix://" + s.upstream_path, s.hooks)

    async def body():
        await s.start()
        try:
            for method in (EXEC_SYNC, CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES, VERSION):
                await s.unary(method)(request_for(method), timeout=5)
        finally:
            await s.stop()

    run(loop, body())
    assert s.hooks.rewrites == [(EXEC_SYNC, request_for(EXEC_SYNC))]
    expected = request_for(EXEC_SYNC) + length_delimited(99, b"rewritten")
    assert s.echo.calls(EXEC_SYNC)[0].request == expected
    [fc] = s.hooks.calls(EXEC_SYNC)
    assert fc is s.hooks.seen[0] and fc.rewritten == "tagged" and fc.forwarded == expected
    for method in (CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES, VERSION):
        assert s.echo.calls(method)[0].request == request_for(method)
        [fc] = s.hooks.calls(method)
        assert fc.forwarded is None and fc.rewritten is None


def test_rewrite_hook_gets_exactly_the_rewritten_methods(loop, stack):
    stack.hooks.rewrite_fn = lambda method, request: request + length_delimited(99, b"rewritten")

    async def body():
        for method, streaming in METHODS.items():
            if streaming:
                await collect(stack.stream(method)(request_for(method), timeout=5))
            else:
                await stack.unary(method)(request_for(method), timeout=5)

    run(loop, body())
    assert REWRITTEN_METHODS == {CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES}
    assert sorted(stack.hooks.rewrites) == sorted(
        (m, request_for(m)) for m in (CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES))
    for method in METHODS:
        [seen] = stack.echo.calls(method)
        [fc] = stack.hooks.calls(method)
        assert fc.request == request_for(method)
        if method in REWRITTEN_METHODS:
            expected = request_for(method) + length_delimited(99, b"rewritten")
            assert seen.request == expected
            assert fc.forwarded == expected
            assert fc.responses == [response_bytes(method, expected)]
        else:
            assert seen.request == request_for(method)
            assert fc.forwarded is None


def test_rewrite_returning_equal_bytes_records_no_forwarded(loop, stack):
    stack.hooks.rewrite_fn = lambda method, request: bytes(bytearray(request))  # equal, not identical
    request = request_for(CREATE_CONTAINER)
    run(loop, lambda: stack.unary(CREATE_CONTAINER)(request, timeout=5))
    assert stack.echo.calls(CREATE_CONTAINER)[0].request == request
    assert stack.hooks.calls(CREATE_CONTAINER)[0].forwarded is None


@pytest.mark.parametrize("bad", ["raises", "returns None"])
def test_failing_rewrite_hook_forwards_original(loop, stack, bad):
    def broken(method, request):
        if bad == "raises":
            raise ValueError("rewrite bug")
        return None

    stack.hooks.rewrite_fn = broken
    request = request_for(UPDATE_CONTAINER_RESOURCES)
    resp = run(loop, lambda: stack.unary(UPDATE_CONTAINER_RESOURCES)(request, timeout=5))
    assert resp == response_bytes(UPDATE_CONTAINER_RESOURCES, request)
    assert stack.echo.calls(UPDATE_CONTAINER_RESOURCES)[0].request == request
    [fc] = stack.hooks.calls(UPDATE_CONTAINER_RESOURCES)
    assert (fc.forwarded, fc.code) == (None, "OK")


def test_raising_finished_hook_never_fails_a_call(loop, stack):
    stack.hooks.finished_raises = True
    stack.echo.behave(CONTAINER_STATUS, fail=(grpc.StatusCode.NOT_FOUND, "nope", ()))

    async def body():
        ok = await stack.unary(VERSION)(b"", timeout=5)
        streamed = await collect(stack.stream(EVENTS)(b"", timeout=5))
        alpha = await stack.unary(V1ALPHA2_VERSION)(b"", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.unary(CONTAINER_STATUS)(b"", timeout=5)
        return ok, streamed, alpha, info.value

    ok, streamed, alpha, err = run(loop, body())
    assert ok == response_bytes(VERSION, b"")
    assert streamed == [response_bytes(EVENTS, b"", i) for i in range(3)]
    assert alpha
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "nope")
    assert len(stack.hooks.finished_calls) == 4


def test_finished_call_fields(loop, stack):
    stack.hooks.rewrite_fn = lambda method, request: request + b"\x08\x01"
    stack.echo.behave(CONTAINER_STATUS, fail=(grpc.StatusCode.NOT_FOUND, "no such container", ()))
    create = request_for(CREATE_CONTAINER)
    status = request_for(CONTAINER_STATUS)

    async def body():
        t0 = time.time()
        resp = await stack.unary(CREATE_CONTAINER)(create, timeout=5)
        # finished() ran before the client saw the answer (the relay: right after writing it, in
        # the same callback of the loop this client runs on)
        assert len(stack.hooks.calls(CREATE_CONTAINER)) == 1
        t1 = time.time()
        with pytest.raises(grpc.aio.AioRpcError):
            await stack.unary(CONTAINER_STATUS)(status, timeout=5)
        assert len(stack.hooks.calls(CONTAINER_STATUS)) == 1
        return t0, t1, resp

    t0, t1, resp = run(loop, body())
    [ok] = stack.hooks.calls(CREATE_CONTAINER)
    assert ok.method == CREATE_CONTAINER
    assert ok.request == create and ok.forwarded == create + b"\x08\x01"
    assert ok.responses == [resp] == [response_bytes(CREATE_CONTAINER, create + b"\x08\x01")]
    assert (ok.code, ok.details, ok.truncated) == ("OK", "", False)
    assert t0 - 0.01 <= ok.start <= t1 and 0 < ok.duration_ms < (t1 - t0) * 1000 + 10
    [err] = stack.hooks.calls(CONTAINER_STATUS)
    assert (err.method, err.request, err.forwarded, err.responses, err.code, err.details) == (
        CONTAINER_STATUS, status, None, [], "NOT_FOUND", "no such container")


def test_stream_record_is_capped_but_client_gets_everything(loop, stack):
    stack.proxy.stream_record_max_messages = 5
    stack.echo.behave(EVENTS, stream_messages=8)
    msgs = run(loop, lambda: collect(stack.stream(EVENTS)(b"", timeout=5)))
    assert msgs == [response_bytes(EVENTS, b"", i) for i in range(8)]
    [fc] = stack.hooks.calls(EVENTS)
    assert fc.responses == msgs[:5] and fc.truncated and fc.code == "OK"


# ---------------------------------------------------------------------------- listening socket


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_socket_is_0600_even_with_umask_0_and_parent_is_created(loop, tmp_path):
    s = Stack(tmp_path)
    assert not os.path.exists(os.path.dirname(s.listen_path))
    old = os.umask(0)
    try:
        run(loop, s.start())
    finally:
        os.umask(old)
    try:
        st = os.lstat(s.listen_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        # the private bind directory is gone
        assert os.listdir(os.path.dirname(s.listen_path)) == ["shim.sock"]
        assert run(loop, lambda: s.unary(VERSION)(b"", timeout=5)) == response_bytes(VERSION, b"")
    finally:
        run(loop, s.stop())
    assert not os.path.exists(s.listen_path)  # removed on stop


def test_socket_is_private_until_its_mode_is_final(loop, tmp_path, monkeypatch):
    """Whenever the socket's permissions are being fixed, it is reachable only through a
    directory nobody else may enter, and not yet at the public path."""
    s = Stack(tmp_path)
    seen = []
    real_chmod = os.chmod

    def spy_chmod(path, mode, *a, **kw):
        path = os.fspath(path)
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            seen.append((path, _mode(os.path.dirname(path)), os.path.exists(s.listen_path)))
        return real_chmod(path, mode, *a, **kw)

    monkeypatch.setattr(os, "chmod", spy_chmod)
    old = os.umask(0)
    try:
        run(loop, s.start())
    finally:
        os.umask(old)
        monkeypatch.undo()
    try:
        assert seen, "the socket's mode was never set explicitly"
        for path, dir_mode, public_exists in seen:
            assert path != s.listen_path
            assert dir_mode & 0o077 == 0
            assert not public_exists
        assert _mode(s.listen_path) == 0o600
    finally:
        run(loop, s.stop())


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another group needs root")
def test_socket_group_gives_0660(loop, tmp_path):
    import grp

    group = grp.getgrgid(1).gr_name  # 'daemon' on Debian
    s = Stack(tmp_path, socket_group=group)
    run(loop, s.start())
    try:
        st = os.lstat(s.listen_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 1
    finally:
        run(loop, s.stop())


def test_socket_mode_validation():
    hooks = RecordingHooks()
    for kw in ({"socket_mode": 0o666}, {"socket_mode": 0o602}, {"socket_mode": 0o660},
               {"socket_mode": 0o1600}, {"max_message_bytes": 0}):
        with pytest.raises(ValueError):
            Proxy("/run/a.sock", "/run/b.sock", hooks, **kw)
    with pytest.raises(ValueError):
        Proxy("/run/a.sock", "unix:///run/a.sock", hooks)
    assert Proxy("/run/a.sock", "/run/b.sock", hooks, socket_group=1).socket_mode == 0o660
    assert Proxy("/run/a.sock", "/run/b.sock", hooks, socket_group=1, socket_mode=0o640).socket_mode == 0o640


def test_stale_socket_is_replaced(loop, tmp_path):
    s = Stack(tmp_path)
    os.makedirs(os.path.dirname(s.listen_path))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(s.listen_path)
    stale.close()  # a socket file nobody listens on, as a crashed shim leaves it
    old_ino = os.lstat(s.listen_path).st_ino
    run(loop, s.start())
    try:
        assert os.lstat(s.listen_path).st_ino != old_ino
        assert _mode(s.listen_path) == 0o600
        assert run(loop, lambda: s.unary(VERSION)(b"", timeout=5)) == response_bytes(VERSION, b"")
    finally:
        run(loop, s.stop())


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_non_socket_at_listen_path_is_refused(loop, tmp_path, kind):
    s = Stack(tmp_path)
    os.makedirs(os.path.dirname(s.listen_path))
    if kind == "file":
        with open(s.listen_path, "w") as f:
            f.write("precious")
    elif kind == "directory":
        os.mkdir(s.listen_path)
    else:
        os.symlink(s.upstream_path, s.listen_path)
    with pytest.raises(FileExistsError, match="not a socket"):
        run(loop, s.proxy.start())
    if kind == "file":
        assert open(s.listen_path).read() == "precious"
    elif kind == "directory":
        assert os.path.isdir(s.listen_path)
    else:
        assert os.readlink(s.listen_path) == s.upstream_path
    assert os.listdir(os.path.dirname(s.listen_path)) == ["shim.sock"]  # no leftovers


def test_live_socket_is_not_stolen(loop, tmp_path):
    first = Stack(tmp_path)
    run(loop, first.start())
    try:
        second = Proxy(first.listen_path, first.upstream_path, RecordingHooks())
        with pytest.raises(OSError, match="another process is serving"):
            run(loop, second.start())
        assert run(loop, lambda: first.unary(VERSION)(b"", timeout=5)) == response_bytes(VERSION, b"")
    finally:
        run(loop, first.stop())


def test_stop_leaves_a_socket_that_is_not_ours(loop, tmp_path):
    s = Stack(tmp_path)
    run(loop, s.start())
    os.unlink(s.listen_path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(s.listen_path)  # someone else's socket now
    try:
        run(loop, s.stop())
        assert stat.S_ISSOCK(os.lstat(s.listen_path).st_mode)
    finally:
        other.close()


def test_wait_for_termination_returns_after_stop(loop, tmp_path):
    s = Stack(tmp_path)

    async def body():
        await s.start()
        waiter = asyncio.ensure_future(s.proxy.wait_for_termination())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await s.stop()
        await asyncio.wait_for(waiter, 5)

    run(loop, body())


def test_relay_socket_listens_before_its_path_appears(tmp_path, monkeypatch):
    """The socket is renamed into place only once it listens: a kubelet (or a test) that finds
    the path is never refused."""
    from shim.transport import unixsock

    seen = []
    real_rename = os.rename

    def rename_after_checking(src, dst):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(src)  # ConnectionRefusedError when nothing listens there yet
            seen.append(src)
        finally:
            probe.close()
        real_rename(src, dst)

    monkeypatch.setattr(unixsock.os, "rename", rename_after_checking)
    path = str(tmp_path / "shim.sock")
    sock, _ = unixsock.bind_private(path, 0o600, None)
    try:
        assert seen, "the socket was never renamed into place"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        client.close()
    finally:
        sock.close()
