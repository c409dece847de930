"""The relay's own DATA (a held, rewritten request) against the runtime's flow-control windows,
frame by frame, with the runtime's checks modelled as grpc-core (containerd's and the fake
runtime's HTTP/2 stack here) makes them: a stream may receive at most the initial window the
peer has *acknowledged* plus the stream's WINDOW_UPDATEs; the connection at most its window.

The bug this pins down (found with a grpc-go client and a 12 MiB CreateContainer): the runtime
raised SETTINGS_INITIAL_WINDOW_SIZE in the middle of the relay's re-send, the relay counted the
increase at once, and the DATA it sent before the kubelet's SETTINGS ACK reached the runtime
overflowed the stream's acknowledged window: RST_STREAM PROTOCOL_ERROR, CreateContainer failed.

No sockets: a sans-I/O ``Connection`` is fed bytes as its two asyncio protocols would feed them
(``tests/relay_driver.py``), and what it returns for each side is parsed back into frames.
"""
from __future__ import annotations

import hpack
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    setting,
    window_update,
)
from shim.cri.methods import CREATE_CONTAINER
from shim.transport.relay import PREFACE

try:
    from tests.relay_driver import Buffer, new_driver
    from tests.test_relay import Hooks, added, request_for
except ImportError:
    from relay_driver import Buffer, new_driver
    from test_relay import Hooks, added, request_for

SID = 1


def settings(**values: int) -> bytes:
    ids = {"initial_window": SETTINGS_INITIAL_WINDOW_SIZE}
    return frame(SETTINGS, 0, 0, b"".join(setting(ids[k], v) for k, v in values.items()))


def settings_ack() -> bytes:
    return frame(SETTINGS, ACK, 0)


def parse(raw: bytes, preface: bool = False) -> list[tuple[int, int, int, bytes]]:
    pos = len(PREFACE) if preface else 0
    out = []
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 3], "big")
        out.append((raw[pos + 3], raw[pos + 4], int.from_bytes(raw[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                    raw[pos + 9:pos + 9 + n]))
        pos += 9 + n
    assert pos == len(raw), "a partial frame"
    return out


class Runtime:
    """The runtime's receiving side of the connection, checking every DATA frame the relay
    sends against the strictest reading of the windows: a stream's is the initial window the
    peer acknowledged (grpc-core's check) or a lower one the runtime has sent and that is not
    acknowledged yet (a peer applying SETTINGS on receipt), plus the stream's WINDOW_UPDATEs."""

    def __init__(self, conn_window: int = 65535) -> None:
        self.acked_initial = 65535  # before the first ACK: the protocol default
        self.unacked: list[int | None] = []
        self.conn = conn_window
        self.updates: dict[int, int] = {}  # WINDOW_UPDATEs the runtime sent per stream
        self.received: dict[int, int] = {}
        self.messages: dict[int, bytearray] = {}
        self.ended_streams: set[int] = set()
        self.seen = 0  # bytes of the relay's upstream output checked so far
        self.errors: list[str] = []

    def sends_settings(self, initial: int | None) -> None:
        self.unacked.append(initial)

    def sends_window_update(self, sid: int, inc: int) -> None:
        if sid == 0:
            self.conn += inc
        else:
            self.updates[sid] = self.updates.get(sid, 0) + inc

    def initial(self) -> int:
        return min([self.acked_initial] + [v for v in self.unacked if v is not None])

    def check(self, up: Buffer) -> None:
        frames = parse(bytes(up.out[self.seen:]), preface=self.seen == 0)
        self.seen = len(up.out)
        for ftype, flags, sid, payload in frames:
            if ftype == SETTINGS and flags & ACK:
                v = self.unacked.pop(0)
                if v is not None:
                    self.acked_initial = v
            elif ftype == DATA:
                if sid in self.ended_streams:
                    self.errors.append(f"DATA on stream {sid} after END_STREAM")
                window = self.initial() + self.updates.get(sid, 0) - self.received.get(sid, 0)
                if len(payload) > window:
                    self.errors.append(f"frame of {len(payload)} overflows the window of stream {sid}: {window}")
                if len(payload) > self.conn:
                    self.errors.append(f"frame of {len(payload)} overflows the connection window of {self.conn}")
                self.received[sid] = self.received.get(sid, 0) + len(payload)
                self.conn -= len(payload)
                self.messages.setdefault(sid, bytearray()).extend(payload)
                if flags & END_STREAM:
                    self.ended_streams.add(sid)

    # stream SID, for the tests of one call
    @property
    def stream_received(self) -> int:
        return self.received.get(SID, 0)

    @property
    def message(self) -> bytearray:
        return self.messages.get(SID, bytearray())

    @property
    def ended(self) -> bool:
        return SID in self.ended_streams


def create_container_call(message: bytes, sid: int = SID, encoder: hpack.Encoder | None = None,
                          method: str = CREATE_CONTAINER) -> tuple[bytes, list[bytes]]:
    """The HEADERS frame and the DATA frames (16 KiB) of a CreateContainer call (or
    ``method``) on a stream."""
    block = (encoder or hpack.Encoder()).encode([(":method", "POST"), (":scheme", "http"), (":path", method),
                                    (":authority", "localhost"), ("content-type", "application/grpc"),
                                    ("te", "trailers")])
    grpc_message = b"\x00" + len(message).to_bytes(4, "big") + message
    chunks = [grpc_message[i:i + 16384] for i in range(0, len(grpc_message), 16384)]
    data = [frame(DATA, END_STREAM if i == len(chunks) - 1 else 0, sid, c) for i, c in enumerate(chunks)]
    return frame(HEADERS, END_HEADERS, sid, block), data


def new_connection(base: str = "", **relay_kw):
    """A driven Connection (``relay_driver.Driver``) with hooks that add a field to each held
    request: (driver, what the client got, what went upstream, the hooks)."""
    hooks = Hooks(added)
    driver = new_driver(hooks, **relay_kw)
    return driver, driver.client, driver.upstream, hooks


@pytest.fixture
def relay_connection(tmp_path):
    return new_connection(str(tmp_path))


@pytest.mark.parametrize("message_kib", [300, 1500])
def test_unacknowledged_window_increase_is_not_spent_on_a_held_request(relay_connection, message_kib):
    """The runtime's SETTINGS raises the initial stream window while a held CreateContainer is
    being rewritten; the relay sends within the acknowledged window until the client's ACK of
    that SETTINGS has gone upstream, then the rest -- and the runtime gets the whole rewritten
    message without a single overflow."""
    conn, client, upstream, hooks = relay_connection
    runtime = Runtime()
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    # the runtime's first SETTINGS: a 64 KiB stream window (acked at once) and a large connection window
    runtime.sends_settings(65535)
    conn.from_server(settings(initial_window=65535) + window_update(0, 64 << 20))
    runtime.conn += 64 << 20
    conn.from_client(settings_ack())
    runtime.check(upstream)

    message = request_for(CREATE_CONTAINER, size=message_kib * 1024)
    headers, data = create_container_call(message)
    conn.from_client(headers + b"".join(data[:-1]))
    # mid-call, before the last DATA: the runtime raises the initial window to 8 MiB (its BDP
    # estimate grew); the client has not acknowledged it yet when the request ends
    runtime.sends_settings(8 << 20)
    conn.from_server(settings(initial_window=8 << 20))
    conn.from_client(data[-1])
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    # as much as the acknowledged window takes in the relay's 16 KiB frames
    assert 65535 - 16384 < runtime.stream_received <= 65535 and not runtime.ended

    conn.from_client(settings_ack())  # now the increase counts
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    assert runtime.ended
    rewritten = added(CREATE_CONTAINER, message)
    assert bytes(runtime.message) == b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten
    assert hooks.rewrites == [(CREATE_CONTAINER, message)]


def test_a_stream_window_update_before_the_held_message_is_complete_counts(relay_connection):
    """The runtime opens a held stream's window (WINDOW_UPDATE on the stream) while the relay
    still holds its message: the relay counts it, and sends the rewritten message whole at its
    end instead of stopping at the initial window and waiting for an update that already came."""
    conn, client, upstream, hooks = relay_connection
    runtime = Runtime()
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    runtime.sends_settings(65535)
    conn.from_server(settings(initial_window=65535) + window_update(0, 64 << 20))
    runtime.conn += 64 << 20
    conn.from_client(settings_ack())
    message = request_for(CREATE_CONTAINER, size=300 * 1024)
    headers, data = create_container_call(message)
    conn.from_client(headers + data[0])
    runtime.sends_window_update(SID, 1 << 20)
    conn.from_server(window_update(SID, 1 << 20))
    conn.from_client(b"".join(data[1:]))
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    assert runtime.ended
    rewritten = added(CREATE_CONTAINER, message)
    assert bytes(runtime.message) == b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten


def test_window_decrease_counts_before_its_acknowledgement(relay_connection):
    """A lower initial window counts at once (the runtime may already apply it): DATA sent
    after the relay saw it stays within the lower window."""
    conn, client, upstream, hooks = relay_connection
    runtime = Runtime()
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    runtime.sends_settings(1 << 20)
    conn.from_server(settings(initial_window=1 << 20) + window_update(0, 64 << 20))
    runtime.conn += 64 << 20
    conn.from_client(settings_ack())
    runtime.check(upstream)

    message = request_for(CREATE_CONTAINER, size=200 * 1024)
    headers, data = create_container_call(message)
    conn.from_client(headers + b"".join(data[:-1]))
    conn.from_server(settings(initial_window=32768))  # lower, not acknowledged yet
    runtime.sends_settings(32768)  # counts at once in the model's strictest reading
    conn.from_client(data[-1])
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    assert runtime.stream_received == 32768 and not runtime.ended

    conn.from_server(window_update(SID, 1 << 20))
    runtime.sends_window_update(SID, 1 << 20)
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    assert runtime.ended


def answer(sid: int, message: bytes) -> bytes:
    """The runtime's answer to a unary call: HEADERS, one DATA, trailers."""
    enc = hpack.Encoder()
    head = enc.encode([(":status", "200"), ("content-type", "application/grpc")])
    trailers = enc.encode([("grpc-status", "0"), ("grpc-message", "")])
    return (frame(HEADERS, END_HEADERS, sid, head)
            + frame(DATA, 0, sid, b"\x00" + len(message).to_bytes(4, "big") + message)
            + frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))


def test_rewritten_call_answer_and_window_update_reach_the_client_in_one_write(relay_connection):
    """After a rewrite that made the request larger, the runtime's connection WINDOW_UPDATE
    (for the bytes it got) is cut to what the client sent, and goes out with the answer in the
    same write: the kubelet's window ends where the runtime's is, and it wakes once. finished()
    runs after that write (off the call's latency) and sees the whole call."""
    conn, client, upstream, hooks = relay_connection
    runtime = Runtime()
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    runtime.sends_settings(None)
    conn.from_server(settings() + window_update(0, 1 << 20))
    conn.from_client(settings_ack())
    runtime.conn += 1 << 20
    runtime.check(upstream)

    message = request_for(CREATE_CONTAINER, size=1000)
    headers, data = create_container_call(message)
    conn.from_client(headers + b"".join(data))
    runtime.check(upstream)
    assert not runtime.errors and runtime.ended
    sent_by_client = 5 + len(message)
    got_by_runtime = len(runtime.message)
    assert got_by_runtime > sent_by_client  # the rewrite added bytes

    seen_at_finished = []
    hooks.finished = lambda call: seen_at_finished.append((bytes(client.out), call))
    before, writes = len(client.out), client.writes
    response = b"created"
    conn.from_server(answer(SID, response) + window_update(0, got_by_runtime))
    assert client.writes == writes + 1
    frames = parse(bytes(client.out[before:]))
    assert [(f[0], f[2]) for f in frames] == [(HEADERS, SID), (DATA, SID), (HEADERS, SID), (WINDOW_UPDATE, 0)]
    assert int.from_bytes(frames[3][3], "big") == sent_by_client
    # the client's view of the connection window equals the runtime's
    assert conn.conn.windows.client_window == conn.conn.windows.upstream_window - conn.conn.windows.queued
    [(out_then, call)] = seen_at_finished
    assert out_then == bytes(client.out)  # the answer was written before finished() ran
    assert call.code == "OK" and call.request == message and call.responses == [response]
    assert call.forwarded == added(CREATE_CONTAINER, message)


@hypothesis_settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_held_requests_never_overflow_the_runtimes_windows(data):
    """Any interleaving of held CreateContainer calls (1 to 3 at once, up to 300 KiB), the
    runtime's SETTINGS raising or lowering the initial window, the client's ACKs of them, and
    the runtime's WINDOW_UPDATEs: no DATA frame the relay sends exceeds a window in the
    strictest reading, and once the runtime opens its windows every call arrives whole and
    rewritten."""
    conn, client, upstream, hooks = new_connection("/nonexistent")
    runtime = Runtime()
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    first = data.draw(st.sampled_from([16384, 65535, 1 << 20]), "initial window")
    conn_grant = data.draw(st.sampled_from([0, 100_000, 1 << 20, 16 << 20]), "connection window grant")
    runtime.sends_settings(first)
    conn.from_server(settings(initial_window=first) + (window_update(0, conn_grant) if conn_grant else b""))
    runtime.sends_window_update(0, conn_grant)
    acks_owed = 1

    encoder = hpack.Encoder()
    sizes = data.draw(st.lists(st.sampled_from([0, 100, 16000, 70000, 300_000]), min_size=1, max_size=3), "sizes")
    calls = []  # [sid, message, frames not yet sent]
    for k, size in enumerate(sizes):
        sid = 2 * k + 1
        message = request_for(CREATE_CONTAINER, tag=str(sid), size=size)
        headers, frames = create_container_call(message, sid, encoder)
        calls.append([sid, message, [headers] + frames])

    # the client keeps to the connection window it was given (the relay refuses DATA beyond it)
    window = {"left": 65535, "seen": 0}

    def client_window() -> int:
        for ftype, _, sid, payload in parse(bytes(client.out[window["seen"]:])):
            if ftype == WINDOW_UPDATE and sid == 0:
                window["left"] += int.from_bytes(payload, "big")
        window["seen"] = len(client.out)
        return window["left"]

    def step(action: str) -> bool:
        nonlocal acks_owed
        if action == "client":
            waiting = [c for c in calls if c[2]]
            if not waiting:
                return False
            # streams open in order: a call's HEADERS only after every earlier call's
            opened = [c for c in waiting if c is waiting[0] or not c[2][0][3] == HEADERS]
            c = data.draw(st.sampled_from(opened), "call")
            n = data.draw(st.integers(1, 4), "frames")
            left = client_window()
            take = 0
            for f in c[2][:n]:
                size = int.from_bytes(f[:3], "big") if f[3] == DATA else 0
                if size > left:
                    break
                left -= size
                take += 1
            if not take:
                return False
            window["left"] = left
            chunk, c[2] = b"".join(c[2][:take]), c[2][take:]
            conn.from_client(chunk)
        elif action == "settings":
            value = data.draw(st.sampled_from([0, 1000, 16384, 65535, 300_000, 1 << 20, (1 << 31) - 1]), "initial")
            runtime.sends_settings(value)
            conn.from_server(settings(initial_window=value))
            acks_owed += 1
        elif action == "ack" and acks_owed:
            conn.from_client(settings_ack())
            acks_owed -= 1
        elif action == "window":
            opened = [c[0] for c in calls if not (c[2] and c[2][0][3] == HEADERS)]
            sid = data.draw(st.sampled_from([0] + opened), "window of")
            inc = data.draw(st.sampled_from([1, 1000, 16384, 100_000, 1 << 20]), "increment")
            if sid and runtime.initial() + runtime.updates.get(sid, 0) + inc > (1 << 31) - 1:
                return
            runtime.sends_window_update(sid, inc)
            conn.from_server(window_update(sid, inc))
        runtime.check(upstream)
        assert not runtime.errors, runtime.errors[:3]
        return True

    def open_wide() -> None:  # the connection and the streams already opened
        for sid in [0] + [c[0] for c in calls if not (c[2] and c[2][0][3] == HEADERS)]:
            inc = (1 << 31) - 1 - (runtime.initial() + runtime.updates.get(sid, 0)) if sid else 64 << 20
            if inc > 0:
                runtime.sends_window_update(sid, inc)
                conn.from_server(window_update(sid, inc))

    for _ in range(data.draw(st.integers(5, 60), "steps")):
        step(data.draw(st.sampled_from(["client", "client", "settings", "ack", "window", "window"]), "action"))
    stuck = 0
    while any(c[2] for c in calls):
        if not step("client"):  # the client's window is spent: the runtime gives more
            stuck += 1
            assert stuck < 100, "the client never gets its window back"
            while acks_owed:
                step("ack")
            open_wide()
    while acks_owed:
        step("ack")
    # the runtime opens its windows wide: everything held must now arrive
    open_wide()
    runtime.check(upstream)
    assert not runtime.errors, runtime.errors[:3]
    for sid, message, _ in calls:
        rewritten = added(CREATE_CONTAINER, message)
        assert bytes(runtime.messages.get(sid, b"")) == b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten
        assert sid in runtime.ended_streams
