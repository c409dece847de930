"""The relay's limits on connections and file descriptors, on real unix sockets: its
max-connections (a connection beyond it gets GOAWAY and is closed, the others are served), the
relay out of file descriptors
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
    from tests.test_relay import Hooks, Stack, _frames_until_closed, base, loop, run  # noqa: F401
    from tests.upstream_echo import EchoUpstream, response_bytes
except ImportError:
    from test_relay import Hooks, Stack, _frames_until_closed, base, loop, run  # noqa: F401
    from upstream_echo import EchoUpstream, response_bytes

REPO = Path(__file__).resolve().parents[1]
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


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------ relay: connections


def test_relay_sheds_connections_beyond_the_limit(loop, base):
    s = Stack(base, max_connections=3)
    path = f"{base}/shim.sock"
    metrics = Metrics()

    async def body():
        await s.start()
        metrics.attach(transport=s.relay)
        in_loop = asyncio.get_running_loop().run_in_executor
        raw: list[socket.socket] = []
        try:
            first = await s.unary(VERSION)(b"0", timeout=10)  # the channel's connection: 1 of 3
            raw += [await in_loop(None, _open_raw, path) for _ in range(2)]
            await _until(lambda: len(s.relay.connections) == 3)
            extra = await in_loop(None, _open_raw, path)
            shed = await in_loop(None, _frames_until_closed, extra, 5)
            extra.close()
            served = await s.unary(VERSION)(b"1", timeout=10)  # the open ones are served
            scraped = metrics.render().decode()
            raw.pop().close()
            await _until(lambda: len(s.relay.connections) == 2)
            async with grpc.aio.insecure_channel(f"unix://{path}") as ch:  # a new one is served again
                again = await ch.unary_unary(VERSION)(b"2", timeout=10)
            return first, shed, served, again, scraped
        finally:
            for r in raw:
                r.close()
            await s.stop()

    first, shed, served, again, scraped = run(loop, body())
    assert first == response_bytes(VERSION, b"0") and served == response_bytes(VERSION, b"1")
    assert again == response_bytes(VERSION, b"2")
    assert [f[0] for f in shed] == [SETTINGS_FRAME, GOAWAY_FRAME]
    goaway = shed[1][2]
    assert goaway[:4] == bytes(4) and int.from_bytes(goaway[4:8], "big") == 0xB  # last stream 0, ENHANCE_YOUR_CALM
    assert b"the limit is 3" in goaway[8:]
    assert (s.relay.shed_limit, s.relay.shed_descriptors) == (1, 0)
    assert 'memqos_transport_connections_shed_total{reason="limit"} 1.0' in scraped
    assert "memqos_transport_connections 3.0" in scraped


def test_max_connections_is_a_setting_with_a_default():
    from shim.app.config import OPTIONS
    from shim.app.settings import Config

    by_name = {o.name: o for o in OPTIONS}
    assert Config().max_connections == 128
    with pytest.raises(ValueError):
        by_name["max-connections"].parse("0")


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
