"""shim.transport.unary_client (the reconciler's runtime client) against real grpcio servers on
unix sockets: answers byte-identical to a grpcio client's, status codes and details, deadlines,
large answers, the connection window given back, a runtime that goes away and comes back.
(The reconciler's own tests drive it against the fake runtime, and the VM suite against
containerd.)"""
from __future__ import annotations

import grpc
import pytest

from shim.cri import pb
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.node.runtime_client import RuntimeClient, RuntimeUnavailable
from shim.transport.unary_client import CallError, UnaryClient

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
