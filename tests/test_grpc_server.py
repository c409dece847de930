"""shim/tools/grpc_server.py (the stand-in runtimes' server, no grpcio) on a real unix socket,
against the unary client and raw frames: answers within the client's flow-control windows,
its bounds, statuses, details and metadata."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from shim.tools.grpc_server import GrpcServer, split_messages
from shim.transport.unary_client import CallError, UnaryClient
from shim.transport.wire.grpc import message
from shim.transport.wire.h2 import (DATA, END_HEADERS, END_STREAM, ERR_REFUSED_STREAM, HEADERS, PREFACE, RST_STREAM,
                                    SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, frame, frames, setting, window_update)
from shim.transport.wire.hpack import literal


class Served:
    """A GrpcServer on its own event loop thread."""

    def __init__(self, handler, path: str, **kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = GrpcServer(handler, **kw)
        asyncio.run_coroutine_threadsafe(self.server.start(path), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(handler, **kw) -> Served:
        s = Served(handler, str(tmp_path / f"s{len(started)}.sock"), **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


async def echo(path, headers, messages):
    if path.endswith("/Fail"):
        return [], "NOT_FOUND", "container \"c1\" not found: ünïcode 100%"
    if path.endswith("/Meta"):
        return [headers.get(b"x-seq", b"")], "OK", ""
    if path.endswith("/Big"):
        return [b"x" * (300 << 10)], "OK", ""
    if path.endswith("/Stream"):
        return [b"a", b"", b"bc"], "OK", ""
    return messages, "OK", ""


def test_an_answer_larger_than_the_clients_windows_is_sent_within_them(serve):
    """Raw frames: a client with a 1000-byte stream window (and the default 65535 for the
    connection) that gives back what it read after each DATA frame: 300 KiB arrive whole and no
    DATA frame ever exceeds what the windows allow."""
    s = serve(echo)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(s.server.path)
    block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", b"/t.S/Big")
             + literal(b":authority", b"x") + literal(b"content-type", b"application/grpc"))
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0, setting(SETTINGS_INITIAL_WINDOW_SIZE, 1000))
                 + frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, message(b"")))
    conn_window, stream_window, body, buf, done = 65535, 1000, b"", b"", False
    try:
        while not done:
            buf += sock.recv(65536)
            n = 0
            for ftype, flags, sid, pos, end in frames(buf, 0, len(buf)):
                n = end
                if ftype == DATA and sid == 1:
                    size = end - pos - 9
                    conn_window -= size
                    stream_window -= size
                    assert conn_window >= 0 and stream_window >= 0 and size <= 16384
                    body += buf[pos + 9:end]
                    sock.sendall(window_update(0, size) + window_update(1, size))
                    conn_window += size
                    stream_window += size
                elif ftype == HEADERS and sid == 1 and flags & END_STREAM:
                    done = True
            buf = buf[n:]
    finally:
        sock.close()
    assert body == message(b"x" * (300 << 10))


def test_statuses_details_metadata_and_streams(serve):
    s = serve(echo)
    client = UnaryClient(s.server.endpoint)
    try:
        with pytest.raises(CallError) as e:
            client.call("/t.S/Fail", b"", 10)
        assert (e.value.code, e.value.details) == ("NOT_FOUND", "container \"c1\" not found: ünïcode 100%")
        assert client.call("/t.S/Meta", b"", 10, metadata=(("x-seq", "42"),)) == b"42"
        assert client.call_messages("/t.S/Stream", b"", 10) == [b"a", b"", b"bc"]
        assert client.call("/t.S/Echo", b"", 10) == b""  # one empty message, after the others
    finally:
        client.close()


def test_a_request_above_the_message_bound_is_refused(serve):
    s = serve(echo, max_message_bytes=1024)
    client = UnaryClient(s.server.endpoint)
    try:
        assert client.call("/t.S/Echo", b"z" * 1024, 10) == b"z" * 1024
        with pytest.raises(CallError) as e:
            client.call("/t.S/Echo", b"z" * 1025, 10)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert client.call("/t.S/Echo", b"ok", 10) == b"ok"  # the connection goes on
    finally:
        client.close()


def test_a_handler_that_raises_fails_its_call_only(serve):
    async def broken(path, headers, messages):
        raise RuntimeError("boom")

    s = serve(broken)
    client = UnaryClient(s.server.endpoint)
    try:
        for _ in range(2):
            with pytest.raises(CallError) as e:
                client.call("/t.S/X", b"", 10)
            assert e.value.code == "INTERNAL" and "boom" in e.value.details
    finally:
        client.close()


def test_streams_beyond_the_concurrency_bound_are_refused(serve):
    """Raw frames: two streams opened (HEADERS without END_STREAM), a third refused with
    RST_STREAM REFUSED_STREAM; the first two still answered."""
    s = serve(echo, max_concurrent_streams=2)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(s.server.path)
    block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", b"/t.S/Echo")
             + literal(b":authority", b"x") + literal(b"content-type", b"application/grpc"))
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + b"".join(frame(HEADERS, END_HEADERS, sid, block) for sid in (1, 3, 5)))
    got, buf = [], b""
    try:
        while not any(f[0] == RST_STREAM for f in got):
            buf += sock.recv(65536)
            n = 0
            for ftype, flags, sid, pos, end in frames(buf, 0, len(buf)):
                got.append((ftype, sid, buf[pos + 9:end]))
                n = end
            buf = buf[n:]
        assert (RST_STREAM, 5, ERR_REFUSED_STREAM.to_bytes(4, "big")) in got
        sock.sendall(b"".join(frame(DATA, END_STREAM, sid, message(b"m%d" % sid)) for sid in (1, 3)))
        answered = set()
        while answered != {1, 3}:
            buf += sock.recv(65536)
            n = 0
            for ftype, flags, sid, pos, end in frames(buf, 0, len(buf)):
                if ftype == HEADERS and flags & END_STREAM:
                    answered.add(sid)
                n = end
            buf = buf[n:]
    finally:
        sock.close()


def test_split_messages():
    assert split_messages(message(b"a") + message(b"") + message(b"bc")) == ([b"a", b"", b"bc"], "")
    assert split_messages(b"\x01\x00\x00\x00\x01a")[1].startswith("compressed")
    assert split_messages(message(b"abc")[:-1])[1] == "a message longer than the request body"
    assert split_messages(b"\x00\x00")[1] == "a truncated message prefix"
