"""The relay's limits on connections and file descriptors, on real unix sockets: its
max-connections and max-connections-per-peer (at a limit the idle connection quiet longest is
closed for the new one, a leaking client's before the kubelet's, never one with a call in
flight; the new one is refused only when every connection is busy), the relay out of file
descriptors
(a subprocess with a low RLIMIT_NOFILE: what cannot be paired is shed and counted, the open
connections are served, new ones again once descriptors are free), and `serve` raising its
soft RLIMIT_NOFILE to the hard limit at start."""
from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shim.evidence.metrics import Metrics
from shim.transport.relay import PREFACE
from shim.transport.unary_client import CallError, UnaryClient
from shim.transport.wire.h2 import frame

try:
    from tests.leaky_client import open_settled
    from tests.test_grpc_go_client import GoClient, grpcgo  # noqa: F401 - grpcgo: the fixture
    from tests.test_relay import Hooks, Stack, _frames_until_closed, base, loop, run  # noqa: F401
    from tests.upstream_echo import EchoUpstream, response_bytes
except ImportError:
    from leaky_client import open_settled
    from test_grpc_go_client import GoClient, grpcgo  # noqa: F401
    from test_relay import Hooks, Stack, _frames_until_closed, base, loop, run  # noqa: F401
    from upstream_echo import EchoUpstream, response_bytes

REPO = Path(__file__).resolve().parents[1]
LEAKY_CLIENT = Path(__file__).resolve().parent / "leaky_client.py"
VERSION = "/runtime.v1.RuntimeService/Version"
STATUS = "/runtime.v1.RuntimeService/Status"
SETTINGS_FRAME, GOAWAY_FRAME = 4, 7


def _open_raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    try:
        s.sendall(PREFACE + frame(SETTINGS_FRAME, 0, 0))
    except (BrokenPipeError, ConnectionResetError):
        pass  # a connection beyond the limit may be shed before its preface is sent; its frames are still read
    return s


async def _rest(call) -> list[bytes]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------ relay: connections

EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)  # a channel with a connection of its own

class LeakyClient:
    """A leaking local client in a process of its own (``leaky_client.py``): its connections are
    served, then silent and never closed; driven from the test's executor threads."""

    def __init__(self, path: str, n: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(LEAKY_CLIENT), path, str(n)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def opened(self) -> None:
        line = self.proc.stdout.readline().strip()
        assert line == "open", f"the leaking client failed: {line} {self.proc.stderr.read() if not line else ''}"

    def report(self) -> list[dict]:
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=20)


def test_a_leaking_client_does_not_lock_the_kubelet_out(loop, base):
    """The kubelet holds a connection; a leaking client opens 4 more connections than the limit
    and never closes them. Each one beyond the limit is served and the leaking client's idle
    connection quiet longest is closed (GOAWAY NO_ERROR) instead, never the kubelet's, though
    that was quiet longer; a new connection of the kubelet's is served the same way, and its
    first one still is."""
    s = Stack(base, max_connections=8)
    path = f"{base}/shim.sock"
    metrics = Metrics()

    async def body():
        await s.start()
        metrics.attach(transport=s.relay)
        in_loop = asyncio.get_running_loop().run_in_executor
        leaky = LeakyClient(path, 12)
        try:
            first = await s.unary(VERSION)(b"0", timeout=10)  # the kubelet's connection: 1 of 8
            await in_loop(None, leaky.opened)
            peers_after_leak = dict(s.relay.peers)
            async with grpc.aio.insecure_channel(f"unix://{path}", options=OWN_CONNECTION) as ch:
                fresh = await ch.unary_unary(VERSION)(b"1", timeout=10)  # the kubelet's new connection
                again = await s.unary(VERSION)(b"2", timeout=10)  # its first one
                await _until(lambda: len(s.relay.connections) == 8)
                report = await in_loop(None, leaky.report)
                scraped = metrics.render().decode()
                peers = dict(s.relay.peers)
            return first, fresh, again, report, scraped, peers_after_leak, peers, leaky.proc.pid
        finally:
            await in_loop(None, leaky.end)
            await s.stop()

    first, fresh, again, report, scraped, peers_after_leak, peers, leaky_pid = run(loop, body())
    assert (first, fresh, again) == tuple(response_bytes(VERSION, t) for t in (b"0", b"1", b"2"))
    # 1 + 12 connections for 8 places: the leaking client's 5 oldest went for its own last 5,
    # its 6th oldest for the kubelet's new one
    assert [r["closed"] for r in report] == [True] * 6 + [False] * 6
    assert all(r["goaway"] == [0] for r in report[:6]) and all(r["goaway"] == [] for r in report[6:])
    assert peers_after_leak == {os.getpid(): 1, leaky_pid: 7}
    assert peers == {os.getpid(): 2, leaky_pid: 6}
    assert (s.relay.shed_idle, s.relay.shed_limit, s.relay.shed_peer_idle) == (6, 0, 0)
    assert 'memqos_transport_connections_shed_total{reason="idle"} 6.0' in scraped
    assert 'memqos_transport_connections_shed_total{reason="limit"} 0.0' in scraped
    assert "memqos_transport_connections 8.0" in scraped


def test_a_connection_with_a_call_in_flight_is_never_shed(loop, base):
    """At the limit the oldest connection has a call in flight: the idle one after it goes for
    the newcomer, and the call goes on to its end."""
    s = Stack(base, max_connections=3)
    path = f"{base}/shim.sock"
    gate = asyncio.Event()
    s.echo.behave(EVENTS, stream_messages=4, gate=gate)

    async def body():
        await s.start()
        in_loop = asyncio.get_running_loop().run_in_executor
        raw: list[socket.socket] = []
        try:
            call = s.channel.unary_stream(EVENTS)(b"e", timeout=20)
            messages = [await call.read()]  # in flight: the runtime holds the stream open
            raw += [(await in_loop(None, open_settled, path))[0] for _ in range(2)]
            raw.append(await in_loop(None, _open_raw, path))  # one too many
            shed = await in_loop(None, _frames_until_closed, raw[0], 10)
            gate.set()
            messages += await _rest(call)
            return messages, await call.code(), shed
        finally:
            for r in raw:
                r.close()
            await s.stop()

    messages, code, shed = run(loop, body())
    assert code == grpc.StatusCode.OK
    assert messages == [response_bytes(EVENTS, b"e", i) for i in range(4)]
    assert shed[-1][0] == GOAWAY_FRAME and int.from_bytes(shed[-1][2][4:8], "big") == 0  # NO_ERROR
    assert (s.relay.shed_idle, s.relay.shed_limit) == (1, 0)


def test_every_connection_busy_the_newcomer_is_refused(loop, base):
    """At the limit with a call in flight on every connection, the new connection gets GOAWAY
    ENHANCE_YOUR_CALM and is closed; the calls go on."""
    s = Stack(base, max_connections=2)
    path = f"{base}/shim.sock"
    metrics = Metrics()
    gate = asyncio.Event()
    s.echo.behave(EVENTS, stream_messages=2, gate=gate)

    async def body():
        await s.start()
        metrics.attach(transport=s.relay)
        in_loop = asyncio.get_running_loop().run_in_executor
        async with grpc.aio.insecure_channel(f"unix://{path}", options=OWN_CONNECTION) as other:
            calls = [s.channel.unary_stream(EVENTS)(b"a", timeout=20), other.unary_stream(EVENTS)(b"b", timeout=20)]
            firsts = [await c.read() for c in calls]
            assert len(s.relay.connections) == 2
            extra = await in_loop(None, _open_raw, path)
            shed = await in_loop(None, _frames_until_closed, extra, 10)
            extra.close()
            scraped = metrics.render().decode()
            gate.set()
            rests = [await _rest(c) for c in calls]
            codes = [await c.code() for c in calls]
        await s.stop()
        return firsts, rests, codes, shed, scraped

    firsts, rests, codes, shed, scraped = run(loop, body())
    assert codes == [grpc.StatusCode.OK] * 2
    assert [[f] + r for f, r in zip(firsts, rests)] == [[response_bytes(EVENTS, t, i) for i in range(2)]
                                                         for t in (b"a", b"b")]
    assert [f[0] for f in shed] == [SETTINGS_FRAME, GOAWAY_FRAME]
    goaway = shed[1][2]
    assert goaway[:4] == bytes(4) and int.from_bytes(goaway[4:8], "big") == 0xB  # last stream 0, ENHANCE_YOUR_CALM
    assert b"the limit is 2, none of them idle" in goaway[8:]
    assert (s.relay.shed_limit, s.relay.shed_idle, s.relay.shed_descriptors) == (1, 0, 0)
    assert 'memqos_transport_connections_shed_total{reason="limit"} 1.0' in scraped


def test_one_process_keeps_at_most_its_per_peer_limit(loop, base):
    """With room left under max-connections, a process beyond max-connections-per-peer has its
    own idle connections quiet longest closed for its new ones; nobody else's is touched."""
    s = Stack(base, max_connections=100, max_connections_per_peer=4)
    path = f"{base}/shim.sock"

    async def body():
        await s.start()
        in_loop = asyncio.get_running_loop().run_in_executor
        leaky = LeakyClient(path, 7)
        try:
            first = await s.unary(VERSION)(b"0", timeout=10)
            await in_loop(None, leaky.opened)
            again = await s.unary(VERSION)(b"1", timeout=10)
            await _until(lambda: len(s.relay.connections) == 5)
            return first, again, await in_loop(None, leaky.report), dict(s.relay.peers), leaky.proc.pid
        finally:
            await in_loop(None, leaky.end)
            await s.stop()

    first, again, report, peers, leaky_pid = run(loop, body())
    assert (first, again) == (response_bytes(VERSION, b"0"), response_bytes(VERSION, b"1"))
    assert [r["closed"] for r in report] == [True] * 3 + [False] * 4
    assert peers == {os.getpid(): 1, leaky_pid: 4}
    assert (s.relay.shed_peer_idle, s.relay.shed_idle, s.relay.shed_limit, s.relay.shed_peer_limit) == (3, 0, 0, 0)


def test_a_grpc_go_client_whose_idle_connection_was_closed_calls_again(loop, base, grpcgo):
    """grpc-go, the kubelet's HTTP/2 stack, takes the GOAWAY of an idle connection closed at the
    limit in its stride: its next call on that service opens a new connection and is answered.
    Three places; the grpc-go client (one connection per service, as the kubelet) holds the most
    when a third process connects, so its quieter one (the image service's) is closed; every call
    it makes after that is answered."""
    s = Stack(base, max_connections=3)
    path = f"{base}/shim.sock"
    list_images = "/runtime.v1.ImageService/ListImages"

    async def body():
        await s.start()
        in_loop = asyncio.get_running_loop().run_in_executor
        go = await in_loop(None, GoClient, grpcgo, path)
        leaky = LeakyClient(path, 1)
        raw = None
        try:
            first = await in_loop(None, go.call, VERSION, b"v1")
            await in_loop(None, leaky.opened)
            raw, _ = await in_loop(None, open_settled, path)  # the third process: one too many
            shed_before = s.relay.shed_idle
            images = await in_loop(None, go.call, list_images, b"i")
            version = await in_loop(None, go.call, VERSION, b"v2")
            return first, images, version, shed_before
        finally:
            if raw is not None:
                raw.close()
            await in_loop(None, go.close)
            await in_loop(None, leaky.end)
            await s.stop()

    first, images, version, shed_before = run(loop, body())
    assert (first.code, first.responses) == ("OK", [response_bytes(VERSION, b"v1")])
    assert (images.code, images.responses) == ("OK", [response_bytes(list_images, b"i")])
    assert (version.code, version.responses) == ("OK", [response_bytes(VERSION, b"v2")])
    # grpc-go 1.33 (Debian's) reconnects a closed connection at once, before any call: each
    # reconnect closes the idle connection quiet longest, until the ones that do not reconnect went
    assert shed_before >= 1 and (s.relay.shed_limit, s.relay.shed_peer_idle) == (0, 0)


def test_a_process_whose_connections_are_all_busy_gets_no_more(loop, base):
    """At max-connections-per-peer with a call in flight on each of its connections, the
    process's new connection is refused (GOAWAY ENHANCE_YOUR_CALM naming the per-process limit)
    and counted; its call goes on."""
    s = Stack(base, max_connections=100, max_connections_per_peer=1)
    path = f"{base}/shim.sock"
    gate = asyncio.Event()
    s.echo.behave(EVENTS, stream_messages=2, gate=gate)

    async def body():
        await s.start()
        in_loop = asyncio.get_running_loop().run_in_executor
        try:
            call = s.channel.unary_stream(EVENTS)(b"a", timeout=20)
            first = await call.read()
            extra = await in_loop(None, _open_raw, path)
            shed = await in_loop(None, _frames_until_closed, extra, 10)
            extra.close()
            gate.set()
            return [first] + await _rest(call), await call.code(), shed
        finally:
            await s.stop()

    messages, code, shed = run(loop, body())
    assert code == grpc.StatusCode.OK and messages == [response_bytes(EVENTS, b"a", i) for i in range(2)]
    assert [f[0] for f in shed] == [SETTINGS_FRAME, GOAWAY_FRAME]
    assert int.from_bytes(shed[1][2][4:8], "big") == 0xB
    assert b"the limit per process is 1, none of them idle" in shed[1][2][8:]
    assert (s.relay.shed_peer_limit, s.relay.shed_peer_idle, s.relay.shed_limit) == (1, 0, 0)


def test_max_connections_is_a_setting_with_a_default():
    from shim.app.config import OPTIONS
    from shim.app.settings import Config

    by_name = {o.name: o for o in OPTIONS}
    assert Config().max_connections == 128
    assert Config().max_connections_per_peer == 64
    for name in ("max-connections", "max-connections-per-peer"):
        assert by_name[name].where == "file"
        with pytest.raises(ValueError):
            by_name[name].parse("0")


# ------------------------------------------------------------------------------------ descriptors

_RELAY_CHILD = r"""
import asyncio, json, os, resource, signal, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from shim.cri.methods import CRI_METHODS
from shim.transport.relay import RelayProxy

class Hooks:
    held_methods = frozenset()
    def rewrite(self, call): return call.request
    def finished(self, call): pass
    def not_rewritten(self, method, reason): pass

async def main():
    relay = RelayProxy(sys.argv[1], sys.argv[2], Hooks(), methods=CRI_METHODS)
    await relay.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    print(json.dumps({"shed_descriptors": relay.shed_descriptors, "shed_limit": relay.shed_limit,
                      "open": len(relay.connections)}), flush=True)
    await relay.stop(0)

if sys.argv[4] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_relay_out_of_descriptors_sheds_and_keeps_serving(loop, base, loop_kind):
    """RLIMIT_NOFILE 64 in the relay's process, 60 more connections than it can pair: the
    connection opened before keeps being answered, what cannot be paired gets GOAWAY and is
    closed and counted, and once the extra connections close new ones are served again."""
    if loop_kind == "uvloop":
        pytest.importorskip("uvloop")
    echo = EchoUpstream(f"{base}/up.sock")
    path = f"{base}/shim.sock"

    def clients(child: subprocess.Popen):
        assert child.stdout.readline().strip() == "ready"
        before = UnaryClient(path)  # one connection, kept open throughout
        first = before.call(VERSION, b"a", 10)
        extra = []
        for _ in range(60):
            extra.append(_open_raw(path))
        shed = 0
        for s in extra:  # each one either is served (the runtime's SETTINGS come through) or is
            s.settimeout(10)  # shed: the relay's SETTINGS and GOAWAY, sent in one write, then closed
            try:
                first_read = s.recv(65536)
            except ConnectionResetError:  # closed with our preface unread, before we read
                first_read = b""
            assert first_read, "a connection closed without a word"
            shed += b"no file descriptor left" in first_read
        during = before.call(VERSION, b"b", 10)
        for s in extra:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # refused-then-idle and closed connections free their descriptors
            fresh = UnaryClient(path)
            try:
                after = fresh.call(VERSION, b"c", 5)
                break
            except CallError:
                assert time.monotonic() < deadline, "no new connection served after the others closed"
                time.sleep(0.2)
            finally:
                fresh.close()
        before.close()
        return first, during, after, shed

    async def body():
        await echo.start()
        child = subprocess.Popen([sys.executable, "-c", _RELAY_CHILD, path, f"{base}/up.sock", "64", loop_kind],
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out = await asyncio.get_running_loop().run_in_executor(None, clients, child)
            child.send_signal(signal.SIGTERM)
            stdout, stderr = await asyncio.get_running_loop().run_in_executor(None, child.communicate, None, 20)
            return out, json.loads(stdout.strip().splitlines()[-1]), stderr
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            await echo.stop()

    (first, during, after, shed), counters, stderr = run(loop, body(), timeout=120)
    assert first == response_bytes(VERSION, b"a")
    assert during == response_bytes(VERSION, b"b")
    assert after == response_bytes(VERSION, b"c")
    assert shed > 0, "no connection was shed: the limit was not reached"
    assert counters["shed_descriptors"] >= shed and counters["shed_limit"] == 0
    assert "out of file descriptors" in stderr
    assert stderr.count("out of file descriptors") <= 2, "the log line is not throttled"


def test_serve_raises_its_soft_nofile_limit_to_the_hard_limit(base):
    tmp_path = Path(base)  # short: unix socket paths are limited
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} leaves no room below it")
    sock = tmp_path / "shim.sock"
    (tmp_path / "meminfo").write_text(f"MemTotal: {8 * 1024 * 1024} kB\n")
    # the limit is lowered in a small exec wrapper, not in a preexec_fn (this process runs grpc threads)
    lower = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (200, int(sys.argv[1]))); "
             "os.execv(sys.executable, [sys.executable, '-m', 'shim'] + sys.argv[2:])")
    cmd = [sys.executable, "-c", lower, str(hard), "serve", "--listen", f"unix://{sock}",
           "--upstream", f"unix://{tmp_path}/rt.sock", "--kubelet-config", "none", "--kubelet-version", "unknown",
           "--cgroup-root", str(tmp_path), "--meminfo", str(tmp_path / "meminfo"), "--page-size", "4096",
           "--audit-log", "none", "--reconcile", "false", "--monitor-interval", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"serve did not start: {proc.stderr.read()}"
            time.sleep(0.05)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    [line] = [ln for ln in limits.splitlines() if ln.startswith("Max open files")]
    soft_now = line.split()[3]
    expected = hard if hard != resource.RLIM_INFINITY else int(Path("/proc/sys/fs/nr_open").read_text())
    assert int(soft_now) == expected
    assert f"soft RLIMIT_NOFILE raised from 200 to {expected}" in stderr


def test_unit_file_sets_a_descriptor_limit():
    unit = (REPO / "deploy" / "memqos-shim.service").read_text()
    [value] = [ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("LimitNOFILE=")]
    assert int(value) >= 4 * 128 + 64  # several times what the default max-connections needs
