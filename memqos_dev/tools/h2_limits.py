"""`scripts/h2-limits`: the relay's HTTP/2 limits under attack, measured.

The relay runs in a subprocess in front of the in-repo fake runtime (``memqos_dev.testing.fake_runtime``),
both on unix sockets in a temporary directory. For each attack, ``--conns`` raw connections
send it at once while a well-behaved gRPC client calls Version in a loop; per attack the table
gives: how many attack connections the relay closed, the GOAWAY codes they got, the bytes sent
and the time until then (the largest over the connections), the relay's RSS growth (VmRSS peak
during the attack less the value before it), and the well-behaved client's calls, errors, median
and largest latency meanwhile. The first row is that client alone (the baseline, same run).
``--tree DIR`` runs the relay from another checkout (e.g. the main branch) for a side-by-side
run. Every attack stops by itself: at the relay's answer, or at ``--max-bytes`` per connection,
or after ``--seconds``.

Attacks: ``continuation`` (HEADERS then CONTINUATION frames without END_HEADERS), ``oversize``
(a DATA frame of 16 MiB - 1 byte, the largest a frame header can say), ``window-overflow`` (connection WINDOW_UPDATEs past 2^31-1),
``beyond-window`` (DATA past the 65535-byte connection window), ``rapid-reset`` (HEADERS +
RST_STREAM pairs).

API: ``run_probes(attacks=..., conns=..., seconds=..., max_bytes=..., tree=None) -> list[dict]``
(what the table prints, one dict per row), ``format_table(rows)``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shim.transport.wire.grpc import request_headers
from shim.transport.wire.h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PREFACE,
    SETTINGS,
    frame,
    rst_stream,
    window_update,
)

ATTACKS = ("continuation", "oversize", "window-overflow", "beyond-window", "rapid-reset")
VERSION = "/runtime.v1.RuntimeService/Version"
ERROR_NAMES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 3: "FLOW_CONTROL_ERROR", 6: "FRAME_SIZE_ERROR",
               9: "COMPRESSION_ERROR", 11: "ENHANCE_YOUR_CALM"}
ROOT = Path(__file__).resolve().parents[2]

# the relay alone, as `serve` builds it, hooks that change nothing
_SERVE = """
import asyncio, sys
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
    print("ready", flush=True)
    await relay.wait_for_termination()

try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
"""


def request_block(path: str = VERSION) -> bytes:
    """A gRPC request's header block in literals (no HPACK table state)."""
    return request_headers(path.encode())


def attack_chunks(kind: str):
    """The bytes of an attack after the preface, in pieces (endless where the attack is)."""
    if kind == "continuation":
        yield frame(HEADERS, 0, 1, request_block())
        junk = frame(CONTINUATION, 0, 1, b"\x40\x01a\x01b" * 3276)  # literal fields, never ended
        while True:
            yield junk * 4
    elif kind == "oversize":
        yield frame(HEADERS, END_HEADERS, 1, request_block())
        n = (1 << 24) - 1  # the largest a frame header can say
        yield bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, DATA, END_STREAM)) + (1).to_bytes(4, "big")
        piece = bytes(65536)
        for _ in range(n // len(piece)):
            yield piece
    elif kind == "window-overflow":
        yield window_update(0, (1 << 31) - 1) + window_update(0, (1 << 31) - 1)
    elif kind == "beyond-window":
        yield frame(HEADERS, END_HEADERS, 1, request_block())
        piece = frame(DATA, 0, 1, bytes(16384)) * 64  # 1 MiB at once: past the 64 KiB window before any
        while True:  # WINDOW_UPDATE can come (the runtime's raise the window it lets the client fill)
            yield piece
    elif kind == "rapid-reset":
        block = request_block()
        sid = 1
        while True:
            out = []
            for _ in range(64):
                out.append(frame(HEADERS, END_HEADERS, sid, block) + rst_stream(sid, 8))
                sid += 2
            yield b"".join(out)
    else:
        raise ValueError(f"unknown attack {kind!r}")


def read_frames(sock: socket.socket, until: float) -> tuple[int | None, bool, list[tuple[int, int, int, bytes]]]:
    """What the relay sends back until it closes the connection or ``until``: (the GOAWAY's
    error code or None, closed?, the frames)."""
    buf = bytearray()
    frames = []
    code = None
    closed = False
    while time.monotonic() < until:
        sock.settimeout(max(0.01, min(0.2, until - time.monotonic())))
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
        if not data:
            closed = True
            break
        buf += data
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            f = (buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, bytes(buf[9:9 + n]))
            del buf[:9 + n]
            frames.append(f)
            if f[0] == GOAWAY:
                code = int.from_bytes(f[3][4:8], "big")
    return code, closed, frames


def attack(listen: str, kind: str, seconds: float, max_bytes: int) -> dict:
    """One attack connection: bytes sent until the relay closed it (or the budget ran out)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(listen)
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    result = {"sent": 0, "trip_s": None, "goaway": None, "closed": False}
    done = threading.Event()
    t0 = time.monotonic()
    until = t0 + seconds

    def reader() -> None:
        code, closed, _ = read_frames(sock, until)
        result["goaway"], result["closed"] = code, closed
        if closed or code is not None:
            result["trip_s"] = time.monotonic() - t0
        done.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    sock.settimeout(0.2)
    for chunk in attack_chunks(kind):
        view = memoryview(chunk)
        while view and not done.is_set() and result["sent"] < max_bytes and time.monotonic() < until:
            try:
                k = sock.send(view)
            except socket.timeout:
                continue  # the relay does not read: that is an answer of a kind, wait for it
            except OSError:
                done.set()
                break
            result["sent"] += k
            view = view[k:]
        if view:
            break
    th.join(seconds + 1)
    sock.close()
    return result


_GOOD = """
import sys, time, grpc
call = grpc.insecure_channel("unix://" + sys.argv[1]).unary_unary(sys.argv[2])
while True:
    t = time.perf_counter()
    try:
        call(b"", timeout=5)
        print(time.perf_counter() - t, flush=True)
    except grpc.RpcError as e:
        print("error", e.code(), flush=True)
    time.sleep(0.005)
"""


class GoodClient:
    """A well-behaved client in a process of its own (so the attackers' threads do not slow it
    down) calling Version in a loop: the latency of every call."""

    def __init__(self, listen: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _GOOD, listen, VERSION], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.latencies: list[float] = []
        self.errors = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("error"):
                self.errors += 1
            else:
                self.latencies.append(float(line))

    def take(self) -> tuple[list[float], int]:
        lat, self.latencies = self.latencies, []
        err, self.errors = self.errors, 0
        return lat, err

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssPeak:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, vm_rss_kib(self.pid))
            except OSError:
                return
            time.sleep(0.01)


def _wait_for_socket(path: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        if os.path.exists(path):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                s.close()
                return
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not accept connections in {timeout:g} s")


def _row(name: str, conns: int, results: list[dict], rss_before: int, rss_peak: int,
         lat: list[float], errors: int) -> dict:
    tripped = [r for r in results if r["trip_s"] is not None]
    return {
        "attack": name,
        "conns": conns,
        "closed": sum(1 for r in results if r["closed"]),
        "goaway": sorted({ERROR_NAMES.get(r["goaway"], str(r["goaway"])) for r in results if r["goaway"] is not None}),
        "bytes_sent_max": max((r["sent"] for r in results), default=0),
        "trip_ms_max": round(max(r["trip_s"] for r in tripped) * 1000, 1) if len(tripped) == len(results) and results
        else None,
        "rss_before_kib": rss_before,
        "rss_growth_kib": max(0, rss_peak - rss_before),
        "good_calls": len(lat),
        "good_errors": errors,
        "good_p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
        "good_max_ms": round(max(lat) * 1000, 2) if lat else None,
    }


def run_probes(attacks=ATTACKS, conns: int = 4, seconds: float = 5.0, max_bytes: int = 32 * 1024 * 1024,
               tree: str | None = None, baseline_seconds: float = 1.0) -> list[dict]:
    """Start the fake runtime and the relay (from ``tree``, default this checkout), run each
    attack with ``conns`` connections at once while a well-behaved client calls, and return one
    dict per attack (after a baseline row ``attack='none'``). Loopback only; bounded by
    ``seconds`` and ``max_bytes`` per connection."""
    tmp = tempfile.mkdtemp(prefix="h2lim-")
    runtime_sock, relay_sock = f"{tmp}/runtime.sock", f"{tmp}/relay.sock"
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve() if tree else ROOT))  # and its cwd: -c puts it first
    procs = []
    rows: list[dict] = []
    try:
        rt = subprocess.Popen([sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", runtime_sock],
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        procs.append(rt)
        _wait_for_socket(runtime_sock, rt)
        relay = subprocess.Popen([sys.executable, "-c", _SERVE, relay_sock, runtime_sock], env=env,
                                 cwd=env["PYTHONPATH"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(relay)
        _wait_for_socket(relay_sock, relay)
        good = GoodClient(relay_sock)
        procs.append(good.proc)
        deadline = time.monotonic() + 30
        while not good.latencies and time.monotonic() < deadline:  # warm: connected, calls answered
            time.sleep(0.05)
        time.sleep(0.2)
        good.take()
        rss0 = vm_rss_kib(relay.pid)
        time.sleep(baseline_seconds)
        lat, err = good.take()
        rows.append(_row("none", 0, [], rss0, rss0, lat, err))
        for kind in attacks:
            before = vm_rss_kib(relay.pid)
            peak = RssPeak(relay.pid)
            peak.thread.start()
            results: list[dict] = [{}] * conns

            def one(i: int) -> None:
                try:
                    results[i] = attack(relay_sock, kind, seconds, max_bytes)
                except OSError as e:
                    results[i] = {"sent": 0, "trip_s": None, "goaway": None, "closed": False, "error": str(e)}

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(conns)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(seconds + 5)
            time.sleep(0.2)  # the relay's answer to the last attack bytes
            peak.stop.set()
            peak.thread.join()
            lat, err = good.take()
            rows.append(_row(kind, conns, results, before, max(peak.peak, before), lat, err))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


COLUMNS = (("attack", "attack"), ("conns", "conns"), ("closed", "closed"), ("goaway", "GOAWAY"),
           ("bytes_sent_max", "sent (max)"), ("trip_ms_max", "trip ms (max)"), ("rss_growth_kib", "RSS +KiB"),
           ("good_calls", "good calls"), ("good_errors", "errors"), ("good_p50_ms", "p50 ms"),
           ("good_max_ms", "max ms"))


def format_table(rows: list[dict]) -> str:
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return ",".join(v) or "-"
        return str(v)

    table = [[h for _, h in COLUMNS]] + [[cell(r.get(k)) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/h2-limits", description=__doc__.split("\n\n")[1])
    p.add_argument("--attack", action="append", choices=ATTACKS, help="one attack (repeatable; default: all)")
    p.add_argument("--conns", type=int, default=4, help="attack connections at once (default 4)")
    p.add_argument("--seconds", type=float, default=5.0, help="at most this long per attack (default 5)")
    p.add_argument("--max-bytes", type=int, default=32 * 1024 * 1024,
                   help="at most this many bytes per attack connection (default 32 MiB)")
    p.add_argument("--tree", help="run the relay from this checkout (e.g. /work/main), the rest from this one")
    a = p.parse_args(argv)
    rows = run_probes(tuple(a.attack or ATTACKS), a.conns, a.seconds, a.max_bytes, a.tree)
    print(f"relay from {a.tree or ROOT}; {a.conns} attack connection(s) at once, at most {a.seconds:g} s and "
          f"{a.max_bytes} bytes each; a well-behaved client calls Version meanwhile")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
