"""The HTTP/2 relay transport (shim.transport.relay) beyond the shared transport suite
(tests/test_transport.py runs every passthrough and hook test on it too): byte identity of
what it forwards, held and rewritten requests near the size cap and beyond it, flow control
with many held streams, frames split across reads, CONTINUATION and padding from a raw HTTP/2
client, the runtime going away, and uvloop in a thread (tests/test_replay.py replays the kubelet
traces through it)."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import grpc
import hpack
import pytest

from shim.cri.methods import CREATE_CONTAINER, CRI_METHODS, UPDATE_CONTAINER_RESOURCES
from shim.transport.hooks import RpcCall
from shim.transport.wire.h2 import frame as _frame
from shim.transport.relay import PREFACE, RelayProxy

try:
    from tests.upstream_echo import EchoUpstream, length_delimited, response_bytes
except ImportError:
    from upstream_echo import EchoUpstream, length_delimited, response_bytes

VERSION = "/runtime.v1.RuntimeService/Version"
EXEC_SYNC = "/runtime.v1.RuntimeService/ExecSync"
PULL_IMAGE = "/runtime.v1.ImageService/PullImage"
STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"
MiB = 1024 * 1024
CLIENT_MAX = 64 * MiB


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def run(loop, aw, timeout: float = 60.0):
    async def main():
        return await (aw() if callable(aw) else aw)

    return loop.run_until_complete(asyncio.wait_for(main(), timeout))


class Hooks:
    held_methods = frozenset({CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES})

    def __init__(self, rewrite=None) -> None:
        self.rewrite_fn = rewrite
        self.rewrites: list[tuple[str, bytes]] = []
        self.finished_calls: list[RpcCall] = []
        self.not_rewritten_calls: list[tuple[str, str]] = []

    def not_rewritten(self, method: str, reason: str) -> None:
        self.not_rewritten_calls.append((method, reason))

    def rewrite(self, call: RpcCall) -> bytes:
        method, request = call.method, call.request
        self.rewrites.append((method, request))
        return request if self.rewrite_fn is None else self.rewrite_fn(method, request)

    def finished(self, call: RpcCall) -> None:
        self.finished_calls.append(call)

    def calls(self, method: str) -> list[RpcCall]:
        return [c for c in self.finished_calls if c.method == method]


class Tap:
    """A unix-socket pipe in front of ``target`` that records both directions; with ``split``
    it cuts what it forwards into small pieces (so the next hop reads partial frames)."""

    def __init__(self, path: str, target: str, split: random.Random | None = None) -> None:
        self.path = path
        self.target = target
        self.split = split
        self.c2s = bytearray()
        self.s2c = bytearray()
        self.writers: list[asyncio.StreamWriter] = []
        self.server = None

    async def start(self) -> "Tap":
        self.server = await asyncio.start_unix_server(self._handle, self.path)
        return self

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        self.writers += [writer, up_writer]
        await asyncio.gather(self._pump(reader, up_writer, self.c2s), self._pump(up_reader, writer, self.s2c),
                             return_exceptions=True)

    async def _pump(self, reader, writer, record: bytearray) -> None:
        try:
            while data := await reader.read(65536):
                record += data
                if self.split is None:
                    writer.write(data)
                else:
                    i = 0
                    while i < len(data):
                        n = self.split.randrange(1, 300) if i < 20000 else len(data) - i
                        writer.write(data[i:i + n])
                        i += n
                        await asyncio.sleep(0)
                await writer.drain()
        finally:
            writer.close()

    def kill(self) -> None:
        for w in self.writers:
            w.transport.abort()

    async def stop(self) -> None:
        self.server.close()
        self.kill()


class Stack:
    """client -> [tap] -> relay -> [tap] -> echo upstream, on unix sockets."""

    def __init__(self, base: str, *, hooks: Hooks | None = None, front_split=None, back_split=None,
                 taps: bool = False, **relay_kw) -> None:
        self.base = base
        self.echo = EchoUpstream(f"{base}/up.sock")
        self.hooks = hooks or Hooks()
        self.taps = taps or front_split is not None or back_split is not None
        upstream = f"{base}/up.sock"
        self.back = self.front = None
        if self.taps:
            self.back = Tap(f"{base}/back.sock", upstream, back_split)
            upstream = f"{base}/back.sock"
        self.relay = RelayProxy(f"{base}/shim.sock", upstream, self.hooks, methods=CRI_METHODS, **relay_kw)
        target = f"{base}/shim.sock"
        if self.taps:
            self.front = Tap(f"{base}/front.sock", target, front_split)
            target = f"{base}/front.sock"
        self.target = "unix://" + target
        self.channel = None

    async def start(self) -> "Stack":
        await self.echo.start()
        if self.back:
            await self.back.start()
        await self.relay.start()
        if self.front:
            await self.front.start()
        self.channel = grpc.aio.insecure_channel(self.target, options=(
            ("grpc.max_receive_message_length", CLIENT_MAX), ("grpc.max_send_message_length", CLIENT_MAX)))
        return self

    async def stop(self) -> None:
        await self.channel.close()
        if self.front:
            await self.front.stop()
        await self.relay.stop(0)
        if self.back:
            await self.back.stop()
        await self.echo.stop()

    def unary(self, method: str):
        return self.channel.unary_unary(method)


@pytest.fixture
def base(tmp_path):
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="mqr-")  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def request_for(method: str, tag: str = "", size: int = 0) -> bytes:
    return length_delimited(15, f"{method}|{tag}".encode() + b"p" * size) + length_delimited(1, b"\x00\xffid")


def added(method: str, request: bytes) -> bytes:
    return request + length_delimited(99, b"rewritten by the test")


# ------------------------------------------------------------------------------------ identity


def test_passthrough_is_byte_identical_both_ways(loop, base):
    """What the relay writes upstream is exactly what the client wrote, and the other way
    round: frames, stream ids, HPACK state, grpc-timeout, window updates, pings."""
    s = Stack(base, taps=True)
    status_bin = b"\x08\x05\x12\x03err\x00\xff"

    async def body():
        await s.start()
        try:
            s.echo.behave(STATUS, fail=(grpc.StatusCode.NOT_FOUND, "no such container",
                                        (("grpc-status-details-bin", status_bin),)))
            s.echo.behave(PULL_IMAGE, response_size=5 * MiB)
            rnd = random.Random(1)
            for i in range(60):
                md = (("x-request-id", f"r{i}"), ("x-big", "v" * rnd.randrange(3000)))
                await s.unary(VERSION)(request_for(VERSION, str(i)), metadata=md, timeout=rnd.choice([3, 30, 300]))
            with pytest.raises(grpc.aio.AioRpcError):
                await s.unary(STATUS)(b"", timeout=5)
            assert len(await s.unary(PULL_IMAGE)(b"", timeout=20)) > 5 * MiB
            big = length_delimited(1, os.urandom(5 * MiB))
            await s.unary("/runtime.v1.RuntimeService/UpdateRuntimeConfig")(big, timeout=20)
            msgs = [m async for m in s.channel.unary_stream(EVENTS)(b"", timeout=5)]
            assert len(msgs) == 3
            # compared before the channel closes (its goodbye may still be in flight at stop),
            # once what is in flight between the taps has arrived
            deadline = time.monotonic() + 5
            while (len(s.front.c2s), len(s.front.s2c)) != (len(s.back.c2s), len(with_limits(s.back.s2c))):
                assert time.monotonic() < deadline, "the relay holds bytes back"
                await asyncio.sleep(0.01)
            return bytes(s.front.c2s), bytes(s.back.c2s), bytes(s.front.s2c), bytes(s.back.s2c)
        finally:
            await s.stop()

    front_c2s, back_c2s, front_s2c, back_s2c = run(loop, body())
    assert len(front_c2s) > 10 * MiB // 2
    assert front_c2s == back_c2s
    assert front_s2c == with_limits(back_s2c)


def with_limits(s2c: bytes) -> bytes:
    """The runtime's bytes as the relay forwards them: its first SETTINGS frame (the first
    frame) carries the relay's SETTINGS_MAX_HEADER_LIST_SIZE (1 MiB) and
    SETTINGS_MAX_CONCURRENT_STREAMS (1000) when it did not say them, values above those lowered
    (the relay's HTTP/2 limits); every other byte is the runtime's."""
    s2c = bytes(s2c)
    if len(s2c) < 9 or s2c[3] != 4 or s2c[4] & 1:
        return s2c
    n = int.from_bytes(s2c[:3], "big")
    caps = {3: 1000, 5: 16384, 6: 1024 * 1024}
    items = []
    for i in range(9, 9 + n, 6):
        ident, value = int.from_bytes(s2c[i:i + 2], "big"), int.from_bytes(s2c[i + 2:i + 6], "big")
        items.append((ident, min(value, caps.get(ident, value))))
    for ident in (6, 3):
        if ident not in dict(items):
            items.append((ident, caps[ident]))
    payload = b"".join(i.to_bytes(2, "big") + v.to_bytes(4, "big") for i, v in items)
    return _frame(4, 0, 0, payload) + s2c[9 + n:]


# ------------------------------------------------------------------------------------ rewrites


@pytest.mark.parametrize("size,rewrite", [
    (16 * MiB - 64 * 1024, added),                                   # just under the hold cap
    (6 * MiB, lambda m, r: r + length_delimited(98, r[:3 * MiB])),   # grows by half: beyond any window
    (3 * MiB, lambda m, r: r[-100:]),                                # shrinks
])
def test_large_held_request_is_rewritten_within_flow_control(loop, base, size, rewrite):
    s = Stack(base, hooks=Hooks(rewrite))
    request = request_for(CREATE_CONTAINER, size=size)

    async def body():
        await s.start()
        try:
            small = [s.unary(VERSION)(b"", timeout=30) for _ in range(20)]
            resp = await s.unary(CREATE_CONTAINER)(request, timeout=60)
            await asyncio.gather(*small)
            again = await s.unary(VERSION)(b"", timeout=10)  # the connection's windows are sound
            return resp, again
        finally:
            await s.stop()

    resp, again = run(loop, body(), timeout=120)
    expected = rewrite(CREATE_CONTAINER, request)
    [seen] = s.echo.calls(CREATE_CONTAINER)
    assert seen.request == expected
    assert resp == response_bytes(CREATE_CONTAINER, expected)
    assert again == response_bytes(VERSION, b"")
    [fc] = s.hooks.calls(CREATE_CONTAINER)
    assert fc.request == request and fc.forwarded == expected and fc.responses == [resp]


def test_request_above_the_hold_cap_is_forwarded_unchanged(loop, base):
    s = Stack(base, hooks=Hooks(added), hold_max_bytes=1 * MiB)
    request = request_for(UPDATE_CONTAINER_RESOURCES, size=3 * MiB)
    near = request_for(CREATE_CONTAINER, size=MiB - 1000)

    async def body():
        await s.start()
        try:
            return (await s.unary(UPDATE_CONTAINER_RESOURCES)(request, timeout=30),
                    await s.unary(CREATE_CONTAINER)(near, timeout=30))
        finally:
            await s.stop()

    resp, resp_near = run(loop, body())
    assert s.echo.calls(UPDATE_CONTAINER_RESOURCES)[0].request == request  # fail-open
    assert resp == response_bytes(UPDATE_CONTAINER_RESOURCES, request)
    [fc] = s.hooks.calls(UPDATE_CONTAINER_RESOURCES)
    assert (fc.request, fc.forwarded, fc.code) == (request, None, "OK")
    assert [m for m, _ in s.hooks.rewrites] == [CREATE_CONTAINER]  # the one under the cap, rewritten
    [(method, reason)] = s.hooks.not_rewritten_calls  # the fail-open is reported, to be audited
    assert method == UPDATE_CONTAINER_RESOURCES and "hold cap" in reason
    assert s.echo.calls(CREATE_CONTAINER)[0].request == added(CREATE_CONTAINER, near)
    assert resp_near == response_bytes(CREATE_CONTAINER, added(CREATE_CONTAINER, near))


def test_many_concurrent_held_streams_and_the_relay_wide_budget(loop, base):
    """Held bytes count against the connection window: the relay gives them back while holding
    and takes the difference back from the server's updates; beyond the relay-wide budget new
    holds fail open. Everything completes, the right bytes reach the runtime."""
    s = Stack(base, hooks=Hooks(added), hold_total_bytes=5 * MiB)
    creates = [request_for(CREATE_CONTAINER, str(i), size=MiB + i * 1000) for i in range(10)]

    async def body():
        await s.start()
        try:
            calls = [s.unary(CREATE_CONTAINER)(r, timeout=60) for r in creates]
            calls += [s.unary(VERSION)(str(i).encode(), timeout=60) for i in range(50)]
            return await asyncio.gather(*calls)
        finally:
            await s.stop()

    results = run(loop, body(), timeout=120)
    seen = {r.request for r in s.echo.calls(CREATE_CONTAINER)}
    rewritten = {r for r in creates if added(CREATE_CONTAINER, r) in seen}
    unchanged = {r for r in creates if r in seen}
    assert rewritten | unchanged == set(creates) and len(seen) == 10
    assert rewritten, "no held stream was rewritten"
    for r, resp in zip(creates, results):
        assert resp == response_bytes(CREATE_CONTAINER, added(CREATE_CONTAINER, r) if r in rewritten else r)
    assert s.relay.hold_budget.held == 0


def test_frames_split_across_reads_both_ways(loop, base):
    rnd = random.Random(5)
    s = Stack(base, hooks=Hooks(added), front_split=rnd, back_split=random.Random(6))

    async def body():
        await s.start()
        try:
            s.echo.behave(PULL_IMAGE, response_size=700 * 1024)  # large chunks, frames cut anywhere
            out = []
            for i in range(40):
                method = rnd.choice([VERSION, CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES, EXEC_SYNC, PULL_IMAGE])
                req = request_for(method, str(i), size=rnd.choice([0, 10, 5000, 70000]))
                out.append((method, req, await s.unary(method)(req, metadata=(("x-i", "v" * i * 50),), timeout=20)))
            return out
        finally:
            await s.stop()

    results = run(loop, body(), timeout=120)
    for method, req, resp in results:
        sent = added(method, req) if method in (CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES) else req
        assert resp == response_bytes(method, sent, 0, 700 * 1024 if method == PULL_IMAGE else None)
    assert PULL_IMAGE in {m for m, _, _ in results}
    for fc in s.hooks.finished_calls:  # what the observers got is what the client got
        [resp] = [r for m, q, r in results if m == fc.method and q == fc.request]
        assert fc.responses == [resp]


def test_response_size_limit_keeps_the_connection_usable(loop, base):
    s = Stack(base, max_message_bytes=1 * MiB)

    async def body():
        await s.start()
        try:
            s.echo.behave(PULL_IMAGE, response_size=3 * MiB)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await s.unary(PULL_IMAGE)(b"", timeout=10)
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            return [await s.unary(VERSION)(str(i).encode(), timeout=10) for i in range(20)]
        finally:
            await s.stop()

    assert run(loop, body()) == [response_bytes(VERSION, str(i).encode()) for i in range(20)]
    assert [c.code for c in s.hooks.calls(PULL_IMAGE)] == ["RESOURCE_EXHAUSTED"] * 3


# ------------------------------------------------------------------------------------ raw HTTP/2


def _read_stream(sock: socket.socket, sid: int, timeout: float = 10.0):
    """Read frames until END_STREAM on ``sid``: (headers blocks decoded, data bytes)."""
    sock.settimeout(timeout)
    dec = hpack.Decoder()
    buf = b""
    headers, data = [], b""
    while True:
        while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
            chunk = sock.recv(65536)
            assert chunk, "connection closed"
            buf += chunk
        n = int.from_bytes(buf[:3], "big")
        ftype, flags, fsid, payload = buf[3], buf[4], int.from_bytes(buf[5:9], "big"), buf[9:9 + n]
        buf = buf[9 + n:]
        if ftype == 1:
            headers.append(dict(dec.decode(payload, raw=True)))
        elif ftype == 0 and fsid == sid:
            data += payload
        elif ftype in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledge
            try:
                sock.sendall(_frame(ftype, 1, 0, payload if ftype == 6 else b""))
            except BrokenPipeError:  # the relay already answered and closed
                pass
        if fsid == sid and flags & 1 and ftype in (0, 1):
            return headers, data


def _raw_request(method: str, message: bytes, *, pad_headers: bool, pad_data: bool) -> bytes:
    """A connection preface and one call: HEADERS split over two CONTINUATION frames, the
    message over three DATA frames; optionally padded."""
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "x"),
                                    ("content-type", "application/grpc"), ("te", "trailers"),
                                    ("grpc-timeout", "10S"), ("x-long", "y" * 500)], huffman=True)
    third = len(block) // 3
    if pad_headers:
        first = _frame(1, 0x8, 1, b"\x05" + block[:third] + b"\x00" * 5)  # HEADERS, padded, no END_HEADERS
    else:
        first = _frame(1, 0, 1, block[:third])
    cut = len(framed) // 3
    pieces = [framed[:cut], framed[cut:2 * cut], framed[2 * cut:]]
    data = b""
    for i, piece in enumerate(pieces):
        flags = 0x1 if i == 2 else 0
        if pad_data:
            data += _frame(0, flags | 0x8, 1, bytes((i + 1,)) + piece + b"\x00" * (i + 1))
        else:
            data += _frame(0, flags, 1, piece)
    return (PREFACE + _frame(4, 0, 0, b"") + first
            + _frame(9, 0, 1, block[third:2 * third])                    # CONTINUATION
            + _frame(9, 0x4, 1, block[2 * third:])                       # CONTINUATION, END_HEADERS
            + data)


def _raw_call(path: str, raw: bytes):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        for i in range(0, len(raw), 777):  # in pieces, so frames arrive split
            sock.sendall(raw[i:i + 777])
            time.sleep(0.001)
        return _read_stream(sock, 1)


@pytest.mark.parametrize("method", [VERSION, CREATE_CONTAINER])
def test_continuation_and_multi_frame_messages_from_a_raw_client(loop, base, method):
    """Padding only where the relay re-frames (a held call): the grpc-core upstream here does
    not take padded frames even directly (the relay forwards the others byte for byte)."""
    s = Stack(base, hooks=Hooks(added))
    message = request_for(method, size=40000)
    raw = _raw_request(method, message, pad_headers=False, pad_data=method == CREATE_CONTAINER)

    async def body():
        await s.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _raw_call, f"{base}/shim.sock", raw)
        finally:
            await s.stop()

    headers, data = run(loop, body())
    sent = added(method, message) if method == CREATE_CONTAINER else message
    assert headers[-1][b"grpc-status"] == b"0", headers
    assert data[5:] == response_bytes(method, sent)
    assert s.echo.calls(method)[0].request == sent
    [fc] = s.hooks.calls(method)
    assert fc.request == message and fc.code == "OK"


def test_padded_headers_and_data_are_parsed(loop, base):
    """The relay's own parsing of padded HEADERS and DATA, seen through its UNAVAILABLE answer
    (no runtime) and what finished() gets."""
    hooks = Hooks()
    relay = RelayProxy(f"{base}/shim.sock", f"{base}/nobody.sock", hooks, methods=CRI_METHODS)
    message = request_for(EXEC_SYNC, size=30000)
    raw = _raw_request(EXEC_SYNC, message, pad_headers=True, pad_data=True)

    async def body():
        await relay.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _raw_call, f"{base}/shim.sock", raw)
        finally:
            await relay.stop(0)

    headers, data = run(loop, body())
    assert headers[-1][b"grpc-status"] == b"14" and data == b""
    [fc] = hooks.finished_calls
    assert (fc.method, fc.request, fc.code) == (EXEC_SYNC, message, "UNAVAILABLE")


# ------------------------------------------------------------------------------------ failures


def test_runtime_connection_lost_mid_call(loop, base):
    s = Stack(base, taps=True)
    s.echo.behave(EXEC_SYNC, delay=10)

    async def body():
        await s.start()
        try:
            call = s.unary(EXEC_SYNC)(request_for(EXEC_SYNC), timeout=20)
            while not s.echo.calls(EXEC_SYNC):
                await asyncio.sleep(0.01)
            s.back.kill()  # the runtime's connection breaks
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            deadline = time.monotonic() + 10
            while True:  # the kubelet's next calls go through a new connection
                try:
                    ok = await s.unary(VERSION)(b"", timeout=5)
                    break
                except grpc.aio.AioRpcError as e:  # sent before the client saw the old one close
                    assert e.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            return info.value, ok
        finally:
            await s.stop()

    err, ok = run(loop, body())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert ok == response_bytes(VERSION, b"")
    [fc] = s.hooks.calls(EXEC_SYNC)
    assert fc.code == "UNAVAILABLE" and fc.request == request_for(EXEC_SYNC)


def test_runtime_down_answers_unavailable_with_the_request_observed(loop, base):
    hooks = Hooks()
    relay = RelayProxy(f"{base}/shim.sock", f"{base}/nobody.sock", hooks, methods=CRI_METHODS)

    async def body():
        await relay.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{base}/shim.sock") as ch:
                errs = []
                for i in range(3):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await ch.unary_unary(CREATE_CONTAINER)(request_for(CREATE_CONTAINER, str(i)), timeout=5)
                    errs.append(info.value)
                return errs
        finally:
            await relay.stop(0)

    errs = run(loop, body())
    assert {e.code() for e in errs} == {grpc.StatusCode.UNAVAILABLE}
    assert "nobody.sock" in errs[0].details()
    assert [c.request for c in hooks.calls(CREATE_CONTAINER)] == [request_for(CREATE_CONTAINER, str(i))
                                                                  for i in range(3)]
    assert hooks.rewrites == []  # nothing went upstream, nothing was rewritten


def _frames_until_closed(sock: socket.socket, timeout: float) -> list[tuple[int, int, bytes]]:
    """(type, flags, payload) of every frame until the peer closes, answering SETTINGS. The
    relay may close before our SETTINGS ACK arrives (it answers and closes a refused connection
    in one go): the ACK then fails or makes the close a reset, which counts as the close."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while True:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            raise AssertionError(f"still open after {timeout} s; frames so far {out}") from None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return out
        buf += chunk
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            n = int.from_bytes(buf[:3], "big")
            out.append((buf[3], buf[4], buf[9:9 + n]))
            if buf[3] == 4 and not buf[4] & 1:
                try:
                    sock.sendall(_frame(4, 1, 0, b""))
                except (BrokenPipeError, ConnectionResetError):
                    pass
            buf = buf[9 + n:]


def test_idle_refused_connection_is_closed(loop, base, monkeypatch):
    """Regression (found with the grpc-go client, tests/test_grpc_go_client.py): grpc-go
    reconnects as soon as a connection closes, so after the runtime went away the kubelet's
    quieter connection (ImageService) sat refused and idle, and its first call after the runtime
    was back still got "cannot reach the runtime". A refused connection without a call now
    gets GOAWAY and is closed after REFUSED_IDLE_CLOSE; one with a call in progress is not."""
    import shim.transport.relay.aio as relay_module

    monkeypatch.setattr(relay_module, "REFUSED_IDLE_CLOSE", 0.3)
    hooks = Hooks()
    relay = RelayProxy(f"{base}/shim.sock", f"{base}/nobody.sock", hooks, methods=CRI_METHODS)
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", VERSION),
                                    (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])

    def clients():
        with socket.socket(socket.AF_UNIX) as idle, socket.socket(socket.AF_UNIX) as busy:
            idle.connect(f"{base}/shim.sock")
            idle.sendall(PREFACE + _frame(4, 0, 0, b""))
            busy.connect(f"{base}/shim.sock")
            busy.sendall(PREFACE + _frame(4, 0, 0, b"") + _frame(1, 0x4, 1, block))  # no END_STREAM yet
            t0 = time.monotonic()
            idle_frames = _frames_until_closed(idle, 5)
            idle_after = time.monotonic() - t0
            time.sleep(0.5)
            busy.sendall(_frame(0, 0x1, 1, b"\x00" * 5))  # the call's (empty) message
            busy_frames = _frames_until_closed(busy, 5)
            return idle_frames, idle_after, busy_frames

    async def body():
        await relay.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, clients)
        finally:
            await relay.stop(0)

    idle_frames, idle_after, busy_frames = run(loop, body())
    assert [f[0] for f in idle_frames] == [4, 4, 7]  # SETTINGS, its ACK, GOAWAY
    assert idle_frames[-1][2] == bytes(8)  # last stream 0, NO_ERROR
    assert 0.25 < idle_after < 3
    headers = [hpack.Decoder().decode(f[2], raw=True) for f in busy_frames if f[0] == 1]
    assert (b"grpc-status", b"14") in headers[-1]  # the call was answered, not cut by the timer
    assert busy_frames[-1][0] == 7
    [fc] = hooks.finished_calls
    assert (fc.method, fc.code) == (VERSION, "UNAVAILABLE")


# ------------------------------------------------------------------------------------ uvloop thread


def test_threaded_relay_on_uvloop(loop, base):
    uvloop = pytest.importorskip("uvloop")
    from shim.transport.loop_thread import ThreadedProxy

    echo = EchoUpstream(f"{base}/up.sock")
    hooks = Hooks(added)
    proxy = ThreadedProxy(RelayProxy(f"{base}/shim.sock", f"{base}/up.sock", hooks, methods=CRI_METHODS), uvloop.new_event_loop)

    async def body():
        await echo.start()
        await proxy.start()
        waiter = asyncio.ensure_future(proxy.wait_for_termination())
        try:
            async with grpc.aio.insecure_channel(f"unix://{base}/shim.sock") as ch:
                resp = await ch.unary_unary(CREATE_CONTAINER)(b"\n\x01x", timeout=5)
                assert proxy.listen_path == f"{base}/shim.sock"
        finally:
            await proxy.stop(1)
            await echo.stop()
        await asyncio.wait_for(waiter, 5)
        return resp

    resp = run(loop, body())
    assert resp == response_bytes(CREATE_CONTAINER, added(CREATE_CONTAINER, b"\n\x01x"))
    assert [c.method for c in hooks.finished_calls] == [CREATE_CONTAINER]
    assert not os.path.exists(f"{base}/shim.sock")
