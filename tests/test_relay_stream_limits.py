"""Stream-level flow control in the relay (RFC 9113 6.9.1, 6.9.2; shim/transport/relay/limits.py),
with raw frames over real unix sockets to a real RelayProxy in front of a runtime that sends its
SETTINGS and nothing else unless the test says so (tests/test_relay_limits.py's harness): a
client's DATA beyond a stream's window, and a WINDOW_UPDATE from either peer that takes a
stream's window past 2^31-1, reset that stream alone -- the connection and its other streams go
on -- while DATA a client sent within the window it may still have been using when the runtime
lowered SETTINGS_INITIAL_WINDOW_SIZE passes."""
from __future__ import annotations

from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    HEADERS,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    setting,
)
from shim.transport.wire.hpack import literal

try:
    from tests.test_relay_limits import (CANCEL, FLOW_CONTROL_ERROR, Client, block, goaway_code, harness,
                                         wait_for, window_update)
except ImportError:  # run from inside tests/
    from test_relay_limits import (CANCEL, FLOW_CONTROL_ERROR, Client, block, goaway_code, harness,  # noqa: F401
                                   wait_for, window_update)

MAX = (1 << 31) - 1
__all__ = ["harness"]  # the fixture


def data(sid: int, n: int, size: int = 16384) -> bytes:
    """``n`` bytes of DATA on ``sid`` (one gRPC message) in frames of at most ``size``."""
    payload = b"\x00" + (n - 5).to_bytes(4, "big") + b"d" * (n - 5)
    return b"".join(frame(DATA, 0, sid, payload[i:i + size]) for i in range(0, n, size))


def resets(frames, sid: int | None = None) -> list[tuple[int, int]]:
    """The RST_STREAM frames among ``frames``: (stream, error code)."""
    return [(f[2], int.from_bytes(f[3], "big")) for f in frames if f[0] == RST_STREAM and sid in (None, f[2])]


def data_bytes(frames, sid: int) -> int:
    return sum(len(f[3]) for f in frames if f[0] == DATA and f[2] == sid)


def open_connection_window(h, c: Client) -> None:
    """The runtime opens its connection window by 1 MiB (only the stream windows stay 65535)."""
    assert wait_for(lambda: h.runtime.writers)
    h.call(h.runtime.send(window_update(0, 1 << 20)))
    assert wait_for(lambda: any(f[0] == WINDOW_UPDATE and f[2] == 0 for f in c.read(0.1, until_closed=False)))


def test_data_beyond_a_stream_window_resets_that_stream_alone(harness):
    """65535 bytes on stream 1 fill its window (the runtime gave no stream WINDOW_UPDATE): one
    more byte gets RST_STREAM FLOW_CONTROL_ERROR to the client and RST_STREAM CANCEL upstream,
    the byte is not forwarded; stream 3 and the connection go on."""
    h = harness()
    c = Client(h.listen)
    open_connection_window(h, c)
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + data(1, 65535))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 1) == 65535)
    c.read(0.2, until_closed=False)
    assert resets(c.frames) == []
    c.send(frame(DATA, 0, 1, b"x"))
    assert wait_for(lambda: resets(c.read(0.1, until_closed=False)))
    assert resets(c.frames) == [(1, FLOW_CONTROL_ERROR)]
    assert wait_for(lambda: resets(h.runtime.frames()) == [(1, CANCEL)])
    assert data_bytes(h.runtime.frames(), 1) == 65535  # the byte beyond stayed with the relay
    assert wait_for(lambda: h.relay.limit_hits["stream_flow_control"] == 1)  # counted right after the reset is written
    # another stream on the same connection: forwarded, its own window whole
    c.send(frame(HEADERS, END_HEADERS, 3, block()) + data(3, 65535))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 3) == 65535)
    c.read(0.2, until_closed=False)
    assert not c.closed and goaway_code(c.frames) is None
    assert resets(c.frames) == [(1, FLOW_CONTROL_ERROR)]
    assert [sid for conn in h.conns() for sid in conn.streams.open] == [3]  # stream 1's state is gone


def test_a_client_window_update_past_2_31_on_a_stream_resets_that_stream(harness):
    """The client's stream WINDOW_UPDATEs less the runtime's DATA on the stream, from 65535:
    exactly 2^31-1 is allowed, one more resets the stream (the WINDOW_UPDATE is not forwarded);
    the connection stays."""
    h = harness()
    c = Client(h.listen)
    assert wait_for(lambda: h.runtime.writers)
    c.send(frame(HEADERS, END_HEADERS, 1, block()))
    assert wait_for(lambda: any(f[0] == HEADERS for f in h.runtime.frames()))
    # the runtime answers 1000 bytes on the stream: the window the client gave it is 64535
    answer = literal(b":status", b"200") + literal(b"content-type", b"application/grpc")
    h.call(h.runtime.send(frame(HEADERS, END_HEADERS, 1, answer) + frame(DATA, 0, 1, b"\x00" +
                                                                          (995).to_bytes(4, "big") + b"r" * 995)))
    assert wait_for(lambda: data_bytes(c.read(0.1, until_closed=False), 1) == 1000)
    c.send(window_update(1, MAX - 64535))  # exactly the maximum
    assert wait_for(lambda: (WINDOW_UPDATE, 1) in [(f[0], f[2]) for f in h.runtime.frames()])
    c.read(0.2, until_closed=False)
    assert resets(c.frames) == []
    c.send(window_update(1, 1))
    assert wait_for(lambda: resets(c.read(0.1, until_closed=False)))
    assert resets(c.frames) == [(1, FLOW_CONTROL_ERROR)]
    assert wait_for(lambda: resets(h.runtime.frames()) == [(1, CANCEL)])
    assert [f[3] for f in h.runtime.frames() if f[0] == WINDOW_UPDATE and f[2] == 1] == [
        (MAX - 64535).to_bytes(4, "big")]  # the one past 2^31-1 was not forwarded
    assert wait_for(lambda: h.relay.limit_hits["stream_flow_control"] == 1)  # counted right after the reset is written
    c.send(frame(HEADERS, END_HEADERS, 3, block()) + data(3, 100))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 3) == 100)
    assert not c.closed and goaway_code(c.read(0.1, until_closed=False)) is None


def test_a_runtime_window_update_past_2_31_on_a_forwarded_stream_resets_that_stream(harness):
    """A stream the relay forwards frame by frame (not held): the runtime's WINDOW_UPDATEs less
    the client's DATA, from 65535, past 2^31-1 -> RST_STREAM FLOW_CONTROL_ERROR upstream,
    INTERNAL to the client, the WINDOW_UPDATE not forwarded; the connection stays."""
    h = harness()
    c = Client(h.listen)
    assert wait_for(lambda: h.runtime.writers)
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + data(1, 1000))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 1) == 1000)
    h.call(h.runtime.send(window_update(1, MAX - 64535)))  # the client's window: exactly 2^31-1
    assert wait_for(lambda: (WINDOW_UPDATE, 1) in [(f[0], f[2]) for f in c.read(0.1, until_closed=False)])
    h.call(h.runtime.send(window_update(1, 1)))
    assert wait_for(lambda: resets(h.runtime.frames()))
    assert resets(h.runtime.frames()) == [(1, FLOW_CONTROL_ERROR)]
    assert wait_for(lambda: any(f[0] == HEADERS and f[2] == 1 for f in c.read(0.1, until_closed=False)))
    trailers = [f[3] for f in c.frames if f[0] == HEADERS and f[2] == 1][-1]
    assert literal(b"grpc-status", b"13") in trailers
    assert [f[3] for f in c.frames if f[0] == WINDOW_UPDATE and f[2] == 1] == [(MAX - 64535).to_bytes(4, "big")]
    assert wait_for(lambda: h.relay.limit_hits["stream_flow_control"] == 1)  # counted right after the reset is written
    c.send(frame(HEADERS, END_HEADERS, 3, block()) + data(3, 100))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 3) == 100)
    assert not c.closed and goaway_code(c.read(0.1, until_closed=False)) is None


def test_data_sent_before_a_lowered_initial_window_was_seen_passes(harness):
    """The runtime lowers SETTINGS_INITIAL_WINDOW_SIZE to 16384; the client sends 65535 bytes on
    a stream before it has seen (acknowledged) that: within the window it was using, forwarded.
    Once its ACK has gone by, the lowered window counts: a new stream may have 16384 bytes and
    the first stream (now 49151 in debt) none."""
    h = harness()
    c = Client(h.listen)
    assert wait_for(lambda: any(f[0] == SETTINGS for f in c.read(0.1, until_closed=False)))
    c.send(frame(SETTINGS, ACK, 0))  # for the runtime's first SETTINGS
    h.call(h.runtime.send(frame(SETTINGS, 0, 0, setting(SETTINGS_INITIAL_WINDOW_SIZE, 16384))
                          + window_update(0, 1 << 20)))
    assert wait_for(lambda: any(f[0] == WINDOW_UPDATE and f[2] == 0 for f in c.read(0.1, until_closed=False)))
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + data(1, 65535))  # the race: not acknowledged yet
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 1) == 65535)
    c.read(0.2, until_closed=False)
    assert resets(c.frames) == [] and not c.closed
    assert h.relay.limit_hits.get("stream_flow_control", 0) == 0
    c.send(frame(SETTINGS, ACK, 0) + frame(HEADERS, END_HEADERS, 3, block()) + data(3, 16384))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 3) == 16384)
    c.send(frame(DATA, 0, 3, b"x") + frame(DATA, 0, 1, b"y"))
    assert wait_for(lambda: len(resets(c.read(0.1, until_closed=False))) == 2)
    assert sorted(resets(c.frames)) == [(1, FLOW_CONTROL_ERROR), (3, FLOW_CONTROL_ERROR)]
    assert data_bytes(h.runtime.frames(), 1) == 65535 and data_bytes(h.runtime.frames(), 3) == 16384
    assert wait_for(lambda: h.relay.limit_hits["stream_flow_control"] == 2)  # counted right after the reset is written
    assert not c.closed


def test_data_within_a_raised_initial_window_before_its_ack_passes(harness):
    """A raised SETTINGS_INITIAL_WINDOW_SIZE applies for the client once it has it, before its
    ACK (RFC 9113 6.9.2): 200000 bytes on a stream right after the runtime raised it to 1 MiB."""
    h = harness()
    c = Client(h.listen)
    assert wait_for(lambda: h.runtime.writers)
    h.call(h.runtime.send(frame(SETTINGS, 0, 0, setting(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20))
                          + window_update(0, 1 << 20)))
    assert wait_for(lambda: any(f[0] == WINDOW_UPDATE and f[2] == 0 for f in c.read(0.1, until_closed=False)))
    c.send(frame(HEADERS, END_HEADERS, 1, block()) + data(1, 200_000))
    assert wait_for(lambda: data_bytes(h.runtime.frames(), 1) == 200_000)
    c.read(0.2, until_closed=False)
    assert resets(c.frames) == [] and not c.closed
