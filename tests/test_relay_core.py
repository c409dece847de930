"""The relay's connection core (``shim.transport.relay.Connection``) on its own: bytes in, the
``Output`` it returns asserted -- the bytes for each side and the typed events -- with nothing
behind it: no hooks, no sockets, no driver."""
from __future__ import annotations

import hpack

from shim.cri.methods import CREATE_CONTAINER, CRI_METHODS, VERSION
from shim.transport.hooks import STREAM_RECORD_MAX_BYTES, STREAM_RECORD_MAX_MESSAGES, unary_shapes
from shim.transport.relay import (
    PREFACE,
    CallEnded,
    Closed,
    Connection,
    H2Limits,
    HeldRequest,
    HoldBudget,
    LimitHit,
    NotRewritten,
    StreamSettings,
)
from shim.transport.relay.stream import request_reader
from shim.transport.wire.h2 import DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, SETTINGS, frame

HELLO = PREFACE + frame(SETTINGS, 0, 0)


def connection(budget: HoldBudget | None = None, hold_max_bytes: int = 1 << 20, connected: bool = True):
    settings = StreamSettings(held_methods=frozenset({CREATE_CONTAINER}),
                              request_info=request_reader(unary_shapes(CRI_METHODS)), max_message_bytes=1 << 24,
                              hold_max_bytes=hold_max_bytes, stream_record_max_messages=STREAM_RECORD_MAX_MESSAGES,
                              stream_record_max_bytes=STREAM_RECORD_MAX_BYTES)
    conn = Connection(settings, H2Limits(), budget or HoldBudget(1 << 24))
    if connected:
        conn.connected()
        conn.receive_server(frame(SETTINGS, 0, 0))
    return conn


def headers(sid: int, method: str, end_stream: bool = False) -> bytes:
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", method),
                                    (":authority", "x"), ("content-type", "application/grpc")])
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)


def message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


def joined(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def test_an_unchanged_chunk_goes_out_first_and_is_observed_on_resume():
    conn = connection()
    conn.receive_client(HELLO)
    chunk = headers(1, VERSION) + frame(DATA, END_STREAM, 1, message(b"hi"))
    out = conn.receive_client(chunk)
    assert out.to_upstream == [chunk] and out.to_upstream[0] is chunk  # the bytes read, not a copy
    assert out.paused and out.events == [] and out.to_client == []
    out = conn.resume()
    assert (out.to_upstream, out.to_client, out.events, out.paused) == ([], [], [], False)
    answer = (frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode([(":status", "200")]))
              + frame(DATA, 0, 1, message(b"v1"))
              + frame(HEADERS, END_HEADERS | END_STREAM, 1, hpack.Encoder().encode([("grpc-status", "0")])))
    out = conn.receive_server(answer)
    assert joined(out.to_client) == answer
    [ended] = out.events
    assert type(ended) is CallEnded
    call = ended.call
    assert (call.method, call.request, call.responses, call.code) == (VERSION, b"hi", [b"v1"], "OK")


def test_a_held_request_stops_the_connection_until_its_bytes_are_handed_back():
    conn = connection()
    conn.receive_client(HELLO)
    head = headers(1, CREATE_CONTAINER)
    out = conn.receive_client(head + frame(DATA, END_STREAM, 1, message(b"request")))
    assert joined(out.to_upstream) == head  # the HEADERS reach the runtime before the hook runs
    [held] = out.events
    assert type(held) is HeldRequest and held.stream.request == b"request" and not out.paused
    out = conn.send_request(held.stream, b"rewritten")
    assert joined(out.to_upstream) == frame(DATA, END_STREAM, 1, message(b"rewritten"))
    assert held.stream.forwarded == b"rewritten"
    # the rewrite is larger than what the client sent: no window to give back
    assert out.events == [] and out.to_client == []


def test_a_held_request_above_the_cap_goes_upstream_unchanged_with_why():
    conn = connection(hold_max_bytes=10)
    conn.receive_client(HELLO)
    data = frame(DATA, END_STREAM, 1, message(b"x" * 100))
    out = conn.receive_client(headers(1, CREATE_CONTAINER) + data)
    [skipped] = out.events
    assert type(skipped) is NotRewritten and skipped.method == CREATE_CONTAINER and skipped.size == 100
    assert "hold cap" in skipped.why
    assert joined(out.to_upstream).endswith(data)


def test_the_hold_budget_is_shared_by_the_connections_given_it():
    budget = HoldBudget(200)
    first, second = connection(budget), connection(budget)
    for conn in (first, second):
        conn.receive_client(HELLO)
    out = first.receive_client(headers(1, CREATE_CONTAINER) + frame(DATA, 0, 1, message(b"a" * 100)[:60]))
    assert out.events == [] and budget.held == 60
    out = second.receive_client(headers(1, CREATE_CONTAINER) + frame(DATA, END_STREAM, 1, message(b"b" * 100)))
    [skipped] = out.events
    assert type(skipped) is NotRewritten  # 60 held elsewhere, 105 here, 100 declared: > 200
    out = first.close("CANCELLED", "")
    assert budget.held == 0 and [type(e) for e in out.events] == [CallEnded, Closed]


def test_a_limit_hit_closes_with_goaway_and_says_which():
    conn = connection()
    conn.receive_client(HELLO)
    n = 1 << 20
    out = conn.receive_client(headers(1, VERSION) + bytes((n >> 16, n >> 8 & 0xFF, n & 0xFF, DATA, 0, 0, 0, 0, 1)))
    assert [type(e) for e in out.events] == [LimitHit, CallEnded, Closed]
    assert out.events[0].name == "frame_size"
    [goaway] = out.to_client
    assert goaway[3] == GOAWAY and int.from_bytes(goaway[13:17], "big") == 6  # FRAME_SIZE_ERROR
    assert conn.mode == "closed"


def test_a_refused_connection_answers_unavailable_then_closes():
    conn = connection(connected=False)
    out = conn.refuse("the runtime is down")
    assert out.to_client == [frame(SETTINGS, 0, 0)]
    out = conn.receive_client(HELLO + headers(1, VERSION) + frame(DATA, END_STREAM, 1, message(b"")))
    kinds = [type(e) for e in out.events]
    assert kinds == [CallEnded, Closed]
    call = out.events[0].call
    assert (call.code, call.details) == ("UNAVAILABLE", "the runtime is down")
    frames_out = joined(out.to_client)
    assert frames_out.endswith(frame(GOAWAY, 0, 0, (1).to_bytes(4, "big") + bytes(4)))
    assert out.to_upstream == []
