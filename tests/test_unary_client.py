"""shim.transport.unary_client (the reconciler's runtime client) against real grpcio servers on
unix sockets: answers byte-identical to a grpcio client's, status codes and details, deadlines,
large answers, the connection window given back, a runtime that goes away and comes back; and
against raw HTTP/2 answers: its bounds on header blocks, answers without a usable status.
(The reconciler's own tests drive it against the fake runtime, and the VM suite against
containerd.)"""
from __future__ import annotations

import socket
import threading

import grpc
import pytest

from shim.cri import pb
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.node.runtime_client import RuntimeClient, RuntimeUnavailable
from shim.transport.unary_client import CallError, UnaryClient
from shim.transport.wire.grpc import message, request_headers
from shim.transport.wire.h2 import (CONTINUATION, DATA, END_HEADERS, END_STREAM, ERR_REFUSED_STREAM, HEADERS, SETTINGS,
                                    frame, rst_stream)
from shim.transport.wire.hpack import Decoder, literal

try:
    from tests.test_grpc_go_client import EchoServer
    from tests.test_serve import short_dir
    from tests.upstream_echo import response_bytes
except ImportError:
    from test_grpc_go_client import EchoServer
    from test_serve import short_dir
    from upstream_echo import response_bytes

VERSION = "/runtime.v1.RuntimeService/Version"
STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
EXEC_SYNC = "/runtime.v1.RuntimeService/ExecSync"
MI = 2**20


@pytest.fixture
def echo():
    base = short_dir()
    server = EchoServer(str(base / "echo.sock"))
    yield server
    server.stop()


def test_answers_are_the_runtimes_bytes(echo):
    c = UnaryClient("unix://" + echo.path)
    ch = grpc.insecure_channel("unix://" + echo.path, options=[("grpc.max_receive_message_length", 64 * MI)])
    try:
        for request in (b"", b"\x0a\x03abc", bytes(range(256)) * 300):
            assert c.call(VERSION, request, 5) == response_bytes(VERSION, request)
            assert c.call(VERSION, request, 5) == ch.unary_unary(VERSION)(request, timeout=5)
        echo.echo.behave(EXEC_SYNC, response_size=20 * MI)  # far above every window's default
        assert c.call(EXEC_SYNC, b"big", 30) == response_bytes(EXEC_SYNC, b"big", 0, 20 * MI)
    finally:
        c.close()
        ch.close()


def test_errors_carry_code_and_details(echo):
    echo.echo.behave(STATUS, fail=(grpc.StatusCode.NOT_FOUND, "no such container: ünïcødé 100% \n", ()))
    c = UnaryClient("unix://" + echo.path)
    try:
        with pytest.raises(CallError) as e:
            c.call(STATUS, b"x", 5)
        assert e.value.code == "NOT_FOUND" and e.value.details == "no such container: ünïcødé 100% \n"
        assert c.call(VERSION, b"", 5) == response_bytes(VERSION, b"")  # the connection is still good
        with pytest.raises(CallError) as e:
            c.call("/runtime.v1.RuntimeService/NoSuchMethod", b"", 5)
        assert e.value.code == "UNIMPLEMENTED"
    finally:
        c.close()


def test_deadline_then_the_next_call_works(echo):
    echo.echo.behave(EXEC_SYNC, delay=3.0)
    c = UnaryClient("unix://" + echo.path)
    try:
        with pytest.raises(CallError) as e:
            c.call(EXEC_SYNC, b"slow", 0.3)
        assert e.value.code == "DEADLINE_EXCEEDED"
        assert c.call(VERSION, b"after", 5) == response_bytes(VERSION, b"after")
    finally:
        c.close()


def test_connection_window_is_given_back(echo):
    """With a 1 MiB receive window, 40 answers of 200 KB fit only if each call gives back what
    it used: without that the runtime would stall at the fifth and the call time out."""
    echo.echo.behave(EXEC_SYNC, response_size=200_000)
    c = UnaryClient("unix://" + echo.path, receive_window=1 << 20)
    try:
        for i in range(40):
            req = str(i).encode()
            assert c.call(EXEC_SYNC, req, 5) == response_bytes(EXEC_SYNC, req, 0, 200_000)
    finally:
        c.close()


def test_answer_above_the_limit(echo):
    echo.echo.behave(EXEC_SYNC, response_size=3 * MI)
    c = UnaryClient("unix://" + echo.path, max_message_bytes=MI)
    try:
        with pytest.raises(CallError) as e:
            c.call(EXEC_SYNC, b"big", 10)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert c.call(VERSION, b"", 5) == response_bytes(VERSION, b"")
    finally:
        c.close()


def test_runtime_down_then_back():
    base = short_dir()
    path = base / "runtime.sock"
    rc = RuntimeClient("unix://" + str(path), timeout=5)
    with pytest.raises(RuntimeUnavailable) as e:
        rc.list_containers()
    assert e.value.code == "UNAVAILABLE"
    server = FakeRuntimeServer(path)
    server.start()
    try:
        assert rc.list_containers() == []
        assert rc.container_status("f" * 64) is None  # NOT_FOUND from the runtime
        version = rc._call("Version", pb.VersionRequest(), pb.VersionResponse)
        assert version.runtime_api_version == "v1"
    finally:
        server.stop()
    with pytest.raises(RuntimeUnavailable) as e:
        rc.list_sandboxes()
    assert e.value.code == "UNAVAILABLE"
    server = FakeRuntimeServer(path)
    server.start()
    try:
        assert rc.list_sandboxes() == []  # reconnected
    finally:
        server.stop()
        rc.close()


def test_runtime_restarted_between_calls_is_invisible():
    """containerd restarted while the connection sat idle: the next call finds it closed and is
    made again on a new connection, no error for the reconciler."""
    base = short_dir()
    path = base / "runtime.sock"
    server = FakeRuntimeServer(path)
    server.start()
    rc = RuntimeClient("unix://" + str(path), timeout=5)
    try:
        assert rc.list_containers() == []
        server.stop()
        server = FakeRuntimeServer(path)
        server.start()
        assert rc.list_sandboxes() == []
    finally:
        server.stop()
        rc.close()


class RawRuntime:
    """A runtime that answers the first connection with ``reply`` (raw HTTP/2 bytes after its
    SETTINGS) and then waits for the client to close; ``send_failed``: the client closed before
    it took all of ``reply``."""

    def __init__(self, reply: bytes) -> None:
        self.path = str(short_dir() / "raw.sock")
        self.reply = frame(SETTINGS, 0, 0) + reply
        self.send_failed = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        c, _ = self.sock.accept()
        with c:
            c.settimeout(30)
            try:
                c.recv(65536)
                c.sendall(self.reply)
            except OSError:
                self.send_failed = True
                return
            try:
                while c.recv(65536):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(30)


def test_a_header_block_past_the_bound_is_refused_before_it_is_read_whole():
    """HEADERS and 8 MiB of CONTINUATION frames that never end the block: past the 1 MiB bound
    (the default) the call fails with RESOURCE_EXHAUSTED and the connection is closed, so the
    runtime cannot send the rest; the deadline is not what ends it."""
    flood = frame(HEADERS, 0, 1, b"\x88") + frame(CONTINUATION, 0, 1, bytes(16384)) * 512
    runtime = RawRuntime(flood)
    c = UnaryClient("unix://" + runtime.path)
    try:
        with pytest.raises(CallError) as e:
            c.call(VERSION, b"", 60)
        assert e.value.code == "RESOURCE_EXHAUSTED" and "header block of more than 1048576 bytes" in e.value.details
    finally:
        c.close()
        runtime.close()
    assert runtime.send_failed


def test_a_header_list_past_the_bound_once_decoded_is_refused():
    """A 4 KB block that decodes to 1.2 MB (one large field added to the HPACK table, then
    referenced 300 times): past the decoded bound (1 MiB by default, advertised as
    SETTINGS_MAX_HEADER_LIST_SIZE) the call fails with RESOURCE_EXHAUSTED."""
    bomb = b"\x40\x05x-big" + _hpack_length(4000) + b"v" * 4000 + b"\xbe" * 300
    runtime = RawRuntime(frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x88" + bomb))
    c = UnaryClient("unix://" + runtime.path)
    try:
        with pytest.raises(CallError) as e:
            c.call(VERSION, b"", 60)
        assert e.value.code == "RESOURCE_EXHAUSTED" and "header list above 1048576 bytes" in e.value.details
    finally:
        c.close()
        runtime.close()


def _hpack_length(n: int) -> bytes:
    """An HPACK string length (7-bit prefix, no Huffman)."""
    if n < 127:
        return bytes((n,))
    out, n = bytearray((127,)), n - 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out + bytes((n,)))


@pytest.mark.parametrize("reply, code, details", [
    # no grpc-status: grpc's mapping of the HTTP status, as the relay gives it (wire.grpc.ended_status)
    (frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x8d"), "UNIMPLEMENTED", "HTTP status 404 from the runtime"),
    (frame(HEADERS, END_HEADERS, 1, b"\x88") + frame(DATA, END_STREAM, 1, message(b"abc")), "UNKNOWN",
     "the runtime's answer has no grpc-status"),
    # a message cut short before OK trailers
    (frame(HEADERS, END_HEADERS, 1, b"\x88") + frame(DATA, 0, 1, message(b"abc")[:-1])
     + frame(HEADERS, END_HEADERS | END_STREAM, 1, literal(b"grpc-status", b"0")), "INTERNAL",
     f"{VERSION}: a truncated message in the answer"),
    (rst_stream(1, ERR_REFUSED_STREAM), "UNAVAILABLE", f"{VERSION}: stream reset by the runtime (HTTP/2 error code 7)"),
])
def test_answers_without_a_usable_status(reply, code, details):
    runtime = RawRuntime(reply)
    c = UnaryClient("unix://" + runtime.path)
    try:
        with pytest.raises(CallError) as e:
            c.call(VERSION, b"", 10)
        assert (e.value.code, e.value.details) == (code, details)
    finally:
        c.close()
        runtime.close()


def test_the_request_header_block():
    block = request_headers(VERSION.encode(), 1.5, (("X-Seq", "7"),))
    assert Decoder().decode(block) == [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", VERSION.encode()), (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"1500m"), (b"x-seq", b"7")]
