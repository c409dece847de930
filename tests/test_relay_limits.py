"""The relay's HTTP/2 limits (shim/transport/relay/limits.py), with raw frames over real unix
sockets to a real RelayProxy in front of a runtime that accepts, sends its SETTINGS and
answers nothing else (so no WINDOW_UPDATE opens a window behind the test's back): each limit
ends the connection with GOAWAY and the right error code, or refuses the stream, and what the
relay keeps of the offending bytes stays within the limit. The header-block assembly is checked
for linear work by counting the bytes the relay's scans look at (no timing)."""
from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import tempfile
import threading
import time

import pytest

from shim.cri.methods import CREATE_CONTAINER, CRI_METHODS
from shim.transport.relay import PREFACE, Connection, RelayProxy
from shim.transport.wire.h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from shim.transport.wire.hpack import literal

try:
    from tests.relay_driver import new_driver
except ImportError:
    from relay_driver import new_driver

PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 1, 3, 6, 7, 8, 11
VERSION = "/runtime.v1.RuntimeService/Version"
MiB = 1024 * 1024


def block(path: str = VERSION, pad: int = 0) -> bytes:
    """A request's header block in literal fields (no HPACK table state), ``pad`` bytes longer."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"x"),
              (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    out = b"".join(literal(n, v) for n, v in fields)
    while pad > 0:
        n = min(pad, 100)
        out += literal(b"x-pad", b"p" * n)
        pad -= n
    return out


def rst(sid: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, sid, code.to_bytes(4, "big"))


def window_update(sid: int, inc: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, inc.to_bytes(4, "big"))


def parse(buf: bytearray) -> list[tuple[int, int, int, bytes]]:
    out = []
    while len(buf) >= 9:
        n = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + n:
            break
        out.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, bytes(buf[9:9 + n])))
        del buf[:9 + n]
    return out


def goaway_code(frames) -> int | None:
    codes = [int.from_bytes(p[4:8], "big") for t, _, _, p in frames if t == GOAWAY]
    return codes[-1] if codes else None


class SilentRuntime:
    """The runtime's side: accepts, sends an empty SETTINGS, keeps what it reads, sends
    nothing else unless told (``send``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.received = bytearray()
        self.writers: list[asyncio.StreamWriter] = []
        self.server = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, self.path)

    async def _serve(self, reader, writer) -> None:
        self.writers.append(writer)
        writer.write(frame(SETTINGS, 0, 0))
        try:
            while data := await reader.read(65536):
                self.received += data
        except ConnectionError:
            pass

    async def send(self, data: bytes) -> None:
        self.writers[-1].write(data)

    def frames(self) -> list:
        raw = bytearray(self.received)
        if raw.startswith(PREFACE):
            del raw[:len(PREFACE)]
        return parse(raw)


class Hooks:
    held_methods = frozenset({CREATE_CONTAINER})

    def rewrite(self, call):
        return call.request

    def finished(self, call):
        pass

    def not_rewritten(self, method, reason):
        pass


class Harness:
    """A RelayProxy (``limits`` if given) and a SilentRuntime on an event loop in a thread."""

    def __init__(self, limits=None) -> None:
        self.dir = tempfile.mkdtemp(prefix="mqlim-")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runtime = SilentRuntime(f"{self.dir}/rt.sock")
        kw = {} if limits is None else {"limits": limits}
        self.listen = f"{self.dir}/relay.sock"
        self.relay = RelayProxy(self.listen, self.runtime.path, Hooks(), methods=CRI_METHODS, **kw)
        self.call(self.runtime.start())
        self.call(self.relay.start())

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def conns(self) -> list[Connection]:
        async def get():
            return [c.conn for c in self.relay.connections]
        return self.call(get())

    def close(self) -> None:
        async def shut():  # on the loop's thread
            await self.relay.stop(0)
            self.runtime.server.close()
            for w in self.runtime.writers:
                w.close()

        self.call(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Client:
    """A raw HTTP/2 client on the relay's socket."""

    def __init__(self, path: str, preface: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = bytearray()
        self.frames: list = []
        self.closed = False
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes) -> bool:
        """False if the relay closed the connection meanwhile."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def read(self, seconds: float, until_closed: bool = True) -> list:
        """The frames that come within ``seconds`` (until the connection closes, if it does)."""
        deadline = time.monotonic() + seconds
        while not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self.buf += data
            self.frames += parse(self.buf)
            if not until_closed:
                break
        return self.frames

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def harness():
    made = []

    def make(**limits):
        if limits:
            from shim.transport.relay.limits import H2Limits
            h = Harness(H2Limits(**limits))
        else:
            h = Harness()
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def wait_for(pred, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


# ------------------------------------------------------------------------------ header blocks


def test_continuation_flood_gets_goaway_and_is_not_buffered_past_the_limit(harness):
    """HEADERS then CONTINUATION frames without END_HEADERS (CVE-2024-28182's class): the relay
    keeps at most the 1 MiB default of the block, then GOAWAY ENHANCE_YOUR_CALM and closes."""
    h = harness()
    c = Client(h.listen)
    assert c.send(frame(HEADERS, 0, 1, block()))
    assert wait_for(h.conns)
    piece = frame(CONTINUATION, 0, 1, b"\x40\x01a\x01b" * 3200)  # 16000 bytes of literal fields
    sent = 0
    while sent < 4 * MiB and c.send(piece):
        sent += len(piece)
        conns = h.conns()
        for conn in conns:  # what the relay keeps of the block stays within the limit
            assert len(conn.client_frames.tail) <= MiB + 2 * 16393
        if not conns:
            break
    frames = c.read(10)
    assert goaway_code(frames) == ENHANCE_YOUR_CALM
    assert c.closed
    assert sent <= MiB + 64 * 1024  # the relay read no more than the limit (and what was in flight)
    assert h.relay.limit_hits["header_block"] == 1
    # the runtime got the preface and SETTINGS, never a piece of the block
    assert [f[0] for f in h.runtime.frames()] == [SETTINGS]


def test_a_block_in_too_many_continuation_frames_is_refused(harness):
    """Empty CONTINUATIONs grow no block but cost a frame each: 128 at most by default."""
    h = harness()
    c = Client(h.listen)
    c.send(frame(HEADERS, 0, 1, block()) + frame(CONTINUATION, 0, 1) * 129)
    frames = c.read(10)
    assert goaway_code(frames) == ENHANCE_YOUR_CALM and c.closed
    assert h.relay.limit_hits["continuations"] == 1


def test_a_large_block_within_the_limit_still_goes_through(harness):
    """A 300 KiB header block in 16 KiB frames (HEADERS + CONTINUATION), sent in small pieces:
    forwarded whole, the call opened."""
    h = harness()
    c = Client(h.listen)
    b = block(pad=300 * 1024)
    parts = [b[i:i + 16384] for i in range(0, len(b), 16384)]
    raw = frame(HEADERS, 0, 1, parts[0]) + b"".join(
        frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, 1, p) for i, p in enumerate(parts[1:], 1))
    for i in range(0, len(raw), 1000):
        c.send(raw[i:i + 1000])
    assert wait_for(lambda: any(f[0] == CONTINUATION and f[1] & END_HEADERS for f in h.runtime.frames()))
    assert not c.read(0.3) or goaway_code(c.frames) is None
    assert not c.closed
    assert [1] == [sid for conn in h.conns() for sid in conn.streams.open]


def test_a_small_block_that_decodes_to_a_huge_header_list_is_refused(harness):
    """An HPACK bomb: one 4000-byte field put in the dynamic table, then referenced 300 times
    (1 byte each): a 4.3 KB block whose header list is 1.2 MB, above the advertised
    SETTINGS_MAX_HEADER_LIST_SIZE (1 MiB). GOAWAY ENHANCE_YOUR_CALM, nothing forwarded."""
    h = harness()
    c = Client(h.listen)
    value = b"v" * 4000
    bomb = block() + b"\x40\x05x-big" + bytes([0x7F, 4000 - 127 - 128 * ((4000 - 127) // 128) | 0x80,
                                                 (4000 - 127) // 128]) + value + b"\xbe" * 300
    c.send(frame(HEADERS, END_HEADERS, 1, bomb))
    assert goaway_code(c.read(10)) == ENHANCE_YOUR_CALM and c.closed
    assert h.relay.limit_hits["header_block"] == 1
    assert HEADERS not in [f[0] for f in h.runtime.frames()]
    # the same block with 200 references (0.8 MB) is a header list within the limit
    h2 = harness()
    c2 = Client(h2.listen)
    c2.send(frame(HEADERS, END_HEADERS, 1, bomb[:-100]))
    assert wait_for(lambda: HEADERS in [f[0] for f in h2.runtime.frames()])
    assert not c2.read(0.2, until_closed=False) or goaway_code(c2.frames) is None


def test_the_client_is_told_the_header_list_size_and_stream_limits(harness):
    """The runtime's first SETTINGS reaches the client with SETTINGS_MAX_HEADER_LIST_SIZE and
    SETTINGS_MAX_CONCURRENT_STREAMS (the relay's limits) added."""
    h = harness()
    c = Client(h.listen)
    frames = c.read(2, until_closed=False)
    assert wait_for(lambda: any(f[0] == SETTINGS for f in c.read(0.1, until_closed=False)))
    settings = [f for f in c.frames if f[0] == SETTINGS and not f[1] & 1][0][3]
    items = {int.from_bytes(settings[i:i + 2], "big"): int.from_bytes(settings[i + 2:i + 6], "big")
             for i in range(0, len(settings), 6)}
    assert items == {6: MiB, 3: 1000}
    assert frames is not None


def count_scans(monkeypatch, side_module: str) -> list[int]:
    """Count the bytes the relay's scans look at on one side: its frame scans, the buffers it
    joins, the header-block walk (where they exist: the test also runs on older trees)."""
    looked = [0]
    side = importlib.import_module(side_module)
    scan = getattr(side, "frames", None)
    if scan is not None:  # a side that scans with wire.h2.frames
        def counting_frames(data, pos, n):
            looked[0] += n - pos
            return scan(data, pos, n)

        monkeypatch.setattr(side, "frames", counting_frames)
    conn_class = getattr(side, "Connection", None)
    if conn_class is not None and hasattr(conn_class, "_scan_client"):  # the client's scan, inline
        def counting_scan(self, data, pos, n, _scan=conn_class._scan_client):
            looked[0] += n - pos
            return _scan(self, data, pos, n)

        monkeypatch.setattr(conn_class, "_scan_client", counting_scan)
    for mod_name in (side_module, "shim.transport.relay.limits"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, "joined"):
            def counting_joined(*a, _orig=mod.joined, **kw):
                out = _orig(*a, **kw)
                if out is not None:
                    looked[0] += len(out)
                return out

            monkeypatch.setattr(mod, "joined", counting_joined)
        if hasattr(mod, "continuations"):
            def counting_walk(data, p, n, *a, _walk=mod.continuations):
                out = _walk(data, p, n, *a)
                looked[0] += out[0] - p + 9
                return out

            monkeypatch.setattr(mod, "continuations", counting_walk)
    return looked


def in_frames(ftype: int, sid: int, b: bytes, size: int, flags: int = 0) -> list[bytes]:
    """A header block as a HEADERS frame and CONTINUATION frames of ``size`` bytes."""
    parts = [b[i:i + size] for i in range(0, len(b), size)]
    return [frame(ftype, flags, sid, parts[0])] + [
        frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, sid, p) for i, p in enumerate(parts[1:], 1)]


def test_header_block_assembly_is_linear(monkeypatch):
    """A header block arriving one CONTINUATION per read: the bytes the relay's scans look at
    stay a small multiple of the block, where a rescan from the block's start on every read
    would look at ~frames/2 times it."""
    looked = count_scans(monkeypatch, "shim.transport.relay.connection")
    conn = new_driver(Hooks())
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    b = block(pad=24000)
    pieces = in_frames(HEADERS, 1, b, 240)
    assert 100 < len(pieces) <= 129  # within the default CONTINUATION count
    for piece in pieces:
        conn.from_client(piece)
    assert list(conn.conn.streams.open) == [1]  # the block decoded, the call opened
    total = sum(map(len, pieces))
    assert looked[0] <= 4 * total, f"looked at {looked[0]} bytes for a {total}-byte block"


def test_the_runtimes_header_block_assembly_is_linear(monkeypatch):
    """The same for the runtime's answer headers in many CONTINUATIONs, one per read: forwarded
    whole to the client, with linear work."""
    looked = count_scans(monkeypatch, "shim.transport.relay.server_side")
    conn = new_driver(Hooks())
    client = conn.client
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS | END_STREAM, 1, block()))
    client.take()
    answer = literal(b":status", b"200") + literal(b"content-type", b"application/grpc")
    for _ in range(300):
        answer += literal(b"x-pad", b"p" * 100)
    pieces = in_frames(HEADERS, 1, answer, 200)
    assert len(pieces) > 150
    for piece in pieces:
        conn.from_server(piece)
    assert client.take() == b"".join(pieces)  # forwarded whole, in order
    total = sum(map(len, pieces))
    assert looked[0] <= 4 * total, f"looked at {looked[0]} bytes for a {total}-byte block"


# ------------------------------------------------------------------------------ frame size


def test_a_frame_above_the_max_frame_size_is_refused_from_its_header(harness):
    """A DATA frame saying 16 MiB - 1: FRAME_SIZE_ERROR as soon as its 9-byte header is read,
    nothing of it kept or forwarded."""
    h = harness()
    c = Client(h.listen)
    n = (1 << 24) - 1
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + bytes((n >> 16, n >> 8 & 0xFF, n & 0xFF, DATA, 0)) +
           (1).to_bytes(4, "big") + bytes(1000))
    frames = c.read(10)
    assert goaway_code(frames) == FRAME_SIZE_ERROR and c.closed
    assert h.relay.limit_hits["frame_size"] == 1
    assert DATA not in [f[0] for f in h.runtime.frames()]


def test_a_complete_frame_just_above_the_limit_is_refused_too(harness):
    h = harness()
    c = Client(h.listen)
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + frame(DATA, 0, 1, bytes(16385)))
    assert goaway_code(c.read(10)) == FRAME_SIZE_ERROR and c.closed


# ------------------------------------------------------------------------------ flow control


def test_data_beyond_the_connection_window_is_a_flow_control_error(harness):
    """The runtime never opens its 65535-byte window: a 65536th byte of DATA is refused."""
    h = harness()
    c = Client(h.listen)
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + frame(DATA, 0, 1, bytes(16383)) * 4)  # 65532: within
    c.read(0.3, until_closed=False)
    assert not c.closed and goaway_code(c.frames) is None
    c.send(frame(DATA, 0, 1, bytes(4)))
    assert goaway_code(c.read(10)) == FLOW_CONTROL_ERROR and c.closed
    assert h.relay.limit_hits["flow_control"] == 1


def test_a_window_update_past_2_31_from_the_client_is_a_flow_control_error(harness):
    h = harness()
    c = Client(h.listen)
    c.send(window_update(0, (1 << 31) - 1 - 65535))  # exactly the maximum: fine
    c.read(0.3, until_closed=False)
    assert not c.closed
    c.send(window_update(0, 1))
    assert goaway_code(c.read(10)) == FLOW_CONTROL_ERROR and c.closed
    assert h.relay.limit_hits["window_overflow"] == 1


def test_a_window_update_past_2_31_from_the_runtime_is_a_flow_control_error(harness):
    """The relay counts the runtime's connection window: past 2^31-1 it sends the runtime
    GOAWAY FLOW_CONTROL_ERROR and closes both connections."""
    h = harness()
    c = Client(h.listen)
    assert wait_for(lambda: h.runtime.writers)
    h.call(h.runtime.send(window_update(0, (1 << 31) - 1)))
    c.read(10)
    assert c.closed
    assert wait_for(lambda: goaway_code(h.runtime.frames()) == FLOW_CONTROL_ERROR)
    assert h.relay.limit_hits["window_overflow"] == 1


def test_a_runtime_window_update_past_2_31_on_a_held_stream_resets_that_stream(harness):
    """The relay sends a held (rewritten) request within the runtime's stream window, which it
    counts: a WINDOW_UPDATE taking that window past 2^31-1 resets the stream alone
    (RST_STREAM FLOW_CONTROL_ERROR upstream, INTERNAL to the client), the connection stays."""
    h = harness()
    c = Client(h.listen)
    message = b"\x00" + (100_000).to_bytes(4, "big") + b"m" * 100_000
    chunks = [message[i:i + 16384] for i in range(0, len(message), 16384)]
    c.send(frame(HEADERS, END_HEADERS, 1, block(CREATE_CONTAINER)) + b"".join(frame(DATA, 0, 1, x) for x in chunks[:3]))
    # the relay gives the held bytes' window back to the client
    assert wait_for(lambda: any(f[0] == WINDOW_UPDATE and f[2] == 0 for f in c.read(0.1, until_closed=False)))
    c.send(b"".join(frame(DATA, END_STREAM if i == len(chunks) - 1 else 0, 1, x)
                    for i, x in enumerate(chunks) if i >= 3))
    # the message goes upstream in 16 KiB frames as far as the runtime's 65535-byte windows take it
    assert wait_for(lambda: sum(len(f[3]) for f in h.runtime.frames() if f[0] == DATA) == 3 * 16384)
    left = 65535 - 3 * 16384
    h.call(h.runtime.send(window_update(1, (1 << 31) - 1 - left)))  # the stream's window: 2^31-1 exactly
    time.sleep(0.2)
    assert RST_STREAM not in [f[0] for f in h.runtime.frames()]
    h.call(h.runtime.send(window_update(1, 1)))  # one past
    assert wait_for(lambda: (RST_STREAM, 1) in [(f[0], f[2]) for f in h.runtime.frames()])
    rst_codes = [int.from_bytes(f[3], "big") for f in h.runtime.frames() if f[0] == RST_STREAM]
    assert rst_codes == [FLOW_CONTROL_ERROR]
    assert wait_for(lambda: any(f[0] == HEADERS and f[2] == 1 and f[1] & END_STREAM
                                for f in c.read(0.1, until_closed=False)))
    trailers = [f[3] for f in c.frames if f[0] == HEADERS and f[2] == 1][-1]
    assert literal(b"grpc-status", b"13") in trailers
    assert not c.closed
    assert wait_for(lambda: h.relay.limit_hits["stream_flow_control"] == 1)  # counted right after the reset is written


# ------------------------------------------------------------------------------ streams


def test_rapid_reset_gets_goaway_enhance_your_calm(harness):
    """HEADERS + RST_STREAM pairs (CVE-2023-44487): beyond the burst (400 by default) at
    more than 200 per second, GOAWAY ENHANCE_YOUR_CALM."""
    h = harness()
    c = Client(h.listen)
    b = block()
    c.send(b"".join(frame(HEADERS, END_HEADERS, sid, b) + rst(sid) for sid in range(1, 2 * 300, 2)))
    c.read(0.3, until_closed=False)
    assert not c.closed  # 300 resets at once: within the burst
    c.send(b"".join(frame(HEADERS, END_HEADERS, sid, b) + rst(sid) for sid in range(601, 601 + 2 * 700, 2)))
    assert goaway_code(c.read(10)) == ENHANCE_YOUR_CALM and c.closed
    assert h.relay.limit_hits["rapid_reset"] == 1


def test_streams_beyond_the_concurrency_limit_are_refused(harness):
    """Over ``max_concurrent_streams`` open streams the new one gets RST_STREAM REFUSED_STREAM
    (a gRPC client retries it); its HEADERS reach the runtime (the HPACK state) followed by
    RST_STREAM CANCEL; the connection stays up."""
    h = harness()
    c = Client(h.listen)
    b = block()
    c.send(b"".join(frame(HEADERS, END_HEADERS, sid, b) for sid in range(1, 2 * 1001, 2)))
    assert wait_for(lambda: any(f[0] == RST_STREAM for f in c.read(0.1, until_closed=False)))
    refused = [(f[2], int.from_bytes(f[3], "big")) for f in c.frames if f[0] == RST_STREAM]
    assert refused == [(2001, REFUSED_STREAM)]
    assert not c.closed
    assert wait_for(lambda: (RST_STREAM, 2001) in [(f[0], f[2]) for f in h.runtime.frames()])
    up = [(f[0], f[2]) for f in h.runtime.frames() if f[2] == 2001]
    assert up == [(HEADERS, 2001), (RST_STREAM, 2001)]
    assert wait_for(lambda: h.relay.limit_hits["concurrent_streams"] == 1)  # counted right after the reset is written
    # its DATA in flight is dropped, not forwarded
    c.send(frame(DATA, END_STREAM, 2001, b"x"))
    c.send(frame(DATA, END_STREAM, 1, b"y"))
    assert wait_for(lambda: (DATA, 1) in [(f[0], f[2]) for f in h.runtime.frames()])
    assert (DATA, 2001) not in [(f[0], f[2]) for f in h.runtime.frames()]


# ------------------------------------------------------------------------------ timeouts


def test_a_connection_without_a_preface_is_closed_after_the_preface_timeout(harness):
    h = harness(preface_timeout=0.3)
    c = Client(h.listen, preface=False)
    c.send(PREFACE[:10])
    c.read(10)
    assert c.closed
    assert h.relay.limit_hits["preface_timeout"] == 1


def test_the_idle_timeout_is_off_by_default_and_closes_an_idle_connection_when_set(harness):
    h = harness()
    c = Client(h.listen)
    c.read(1.0, until_closed=True)
    assert not c.closed  # the default: the kubelet's one long-lived connection stays
    h2 = harness(idle_timeout=0.3)
    c2 = Client(h2.listen)
    frames = c2.read(10)
    assert c2.closed and goaway_code(frames) == 0
    assert h2.relay.limit_hits["idle_timeout"] == 1


# ------------------------------------------------------------------------------ the shim's settings and metric


def test_serve_settings_reach_the_relay_and_hits_are_a_metric(tmp_path):
    """`serve` with `h2-max-concurrent-streams: 2` in its config: the third open stream is refused, and
    memqos_h2_limit_hits{limit="concurrent_streams"} counts it."""
    from shim.cli.main import build_parser
    from shim.app.config import resolve
    from shim.app.service import Service

    sockets = tempfile.mkdtemp(prefix="mqsv-")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "meminfo").write_text("MemTotal:       8000000 kB\n")
    (tmp_path / "config.yaml").write_text("h2-max-concurrent-streams: 2\n")
    cfg = resolve(build_parser().parse_args([
        "serve", "--listen", f"unix://{sockets}/shim.sock", "--upstream", f"unix://{sockets}/rt.sock",
        "--kubelet-config", "none", "--meminfo", str(tmp_path / "meminfo"), "--cgroup-root", str(tmp_path / "cg"),
        "--page-size", "4096", "--audit-log", str(tmp_path / "audit.jsonl"), "--reconcile", "false",
        "--monitor-interval", "0", "--metrics-address", "127.0.0.1:0", "--config", str(tmp_path / "config.yaml")]))
    assert cfg.h2_max_concurrent_streams == 2 and cfg.h2_max_header_block == MiB

    async def run():
        runtime = SilentRuntime(f"{sockets}/rt.sock")
        await runtime.start()
        service = Service.from_config(cfg)
        await service.start()
        try:
            def client():
                c = Client(f"{sockets}/shim.sock")
                c.send(b"".join(frame(HEADERS, END_HEADERS, sid, block()) for sid in (1, 3, 5)))
                wait_for(lambda: any(f[0] == RST_STREAM for f in c.read(0.1, until_closed=False)))
                c.close()
                return [(f[2], int.from_bytes(f[3], "big")) for f in c.frames if f[0] == RST_STREAM]

            refused = await asyncio.get_running_loop().run_in_executor(None, client)
            return refused, service.metrics.render().decode()
        finally:
            await service.stop()
            runtime.server.close()

    refused, metrics = asyncio.run(run())
    shutil.rmtree(sockets, ignore_errors=True)
    assert refused == [(5, REFUSED_STREAM)]
    assert 'memqos_h2_limit_hits_total{limit="concurrent_streams"} 1.0' in metrics
    assert 'memqos_h2_limit_hits_total{limit="header_block"} 0.0' in metrics


def test_the_h2_limits_probe_runs_on_this_tree():
    """scripts/h2-limits' probe (memqos_dev.tools.h2_limits.run_probes), one short attack: the relay
    in its subprocess trips it and the well-behaved client gets its answers."""
    from memqos_dev.tools.h2_limits import format_table, run_probes

    rows = run_probes(attacks=("window-overflow",), conns=2, seconds=3.0, max_bytes=1 << 20, baseline_seconds=0.3)
    assert [r["attack"] for r in rows] == ["none", "window-overflow"]
    row = rows[1]
    assert row["closed"] == 2 and row["goaway"] == ["FLOW_CONTROL_ERROR"]
    assert rows[0]["good_calls"] > 0 and rows[0]["good_errors"] == 0
    assert "window-overflow" in format_table(rows)
