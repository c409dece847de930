"""Held requests (CreateContainer / UpdateContainerResources) through the sans-I/O relay
``Connection``, no sockets: the socket tests of tests/test_relay.py (large rewrites, the hold
cap, the relay-wide budget) with both peers modelled frame by frame. The client sends DATA only
within the windows the relay gives it (so a relay that does not give held bytes back stalls the
test), the runtime checks every DATA frame against its windows (``Runtime`` of
tests/test_relay_flow_control.py), gives back what it read and answers each call once its
request has ended."""
from __future__ import annotations

import hpack
import pytest

from shim.cri.methods import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES
from shim.transport.relay import PREFACE
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_STREAM,
    HEADERS,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    window_update,
)

try:
    from tests.test_relay import added, length_delimited, request_for
    from tests.test_relay_flow_control import Runtime, answer, create_container_call, new_connection, parse, settings
except ImportError:
    from test_relay import added, length_delimited, request_for
    from test_relay_flow_control import Runtime, answer, create_container_call, new_connection, parse, settings

MiB = 1024 * 1024


class Client:
    """The kubelet's side: calls' frames sent in order per stream, DATA only within the
    connection and stream windows the relay granted; answers collected."""

    def __init__(self, conn, out) -> None:
        self.conn = conn
        self.out = out  # the relay's writer toward the client
        self.seen = 0
        self.window = 65535
        self.stream_windows: dict[int, int] = {}
        self.waiting: list[list] = []  # [sid, frames not yet sent]
        self.last_frames: list[list] = []  # held back until every call's other frames are sent
        self.answers: dict[int, list] = {}  # sid -> frames of the answer
        self.encoder = hpack.Encoder()
        self.conn.from_client(PREFACE + frame(SETTINGS, 0, 0))

    def call(self, method: str, message: bytes, sid: int, last_frame_later: bool = False) -> None:
        headers, data = create_container_call(message, sid, self.encoder, method=method)
        self.stream_windows[sid] = 65535
        if last_frame_later:
            self.waiting.append([sid, [headers] + data[:-1]])
            self.last_frames.append([sid, data[-1:]])
        else:
            self.waiting.append([sid, [headers] + data])

    def read(self) -> None:
        for ftype, flags, sid, payload in parse(bytes(self.out.out[self.seen:])):
            if ftype == WINDOW_UPDATE:
                inc = int.from_bytes(payload, "big")
                if sid:
                    self.stream_windows[sid] += inc
                else:
                    self.window += inc
            elif ftype == SETTINGS and not flags & ACK:
                self.conn.from_client(frame(SETTINGS, ACK, 0))
            elif ftype in (HEADERS, DATA) and sid:
                self.answers.setdefault(sid, []).append((ftype, flags))
        self.seen = len(self.out.out)

    def send(self) -> bool:
        """What the windows allow, stream after stream; True if anything was sent."""
        if not self.waiting:
            self.waiting, self.last_frames = self.last_frames, []
        sent = False
        progress = True
        while progress:
            progress = False
            for entry in self.waiting:
                sid, frames = entry
                while frames:
                    f = frames[0]
                    n = int.from_bytes(f[:3], "big") if f[3] == DATA else 0
                    if n > self.window or n > self.stream_windows[sid]:
                        break
                    self.window -= n
                    self.stream_windows[sid] -= n
                    self.conn.from_client(frames.pop(0))
                    sent = progress = True
                if frames:
                    break  # streams open in order
            self.waiting = [e for e in self.waiting if e[1]]
        return sent

    def answered(self, sid: int) -> bool:
        return any(ftype == HEADERS and flags & END_STREAM for ftype, flags in self.answers.get(sid, []))


def serve(conn, runtime: Runtime, upstream, client: Client, sids: list[int]) -> None:
    """Both peers in turn until every call is answered; the runtime gives back what it read."""
    answered: set[int] = set()
    for _ in range(100_000):
        client.read()
        sent = client.send()
        before = dict(runtime.received)
        runtime.check(upstream)
        assert not runtime.errors, runtime.errors[:3]
        grants = b""
        for sid, n in runtime.received.items():
            got = n - before.get(sid, 0)
            if got:
                grants += window_update(0, got)
                runtime.sends_window_update(0, got)
                if sid not in runtime.ended_streams:
                    grants += window_update(sid, got)
                    runtime.sends_window_update(sid, got)
        for sid in sorted(runtime.ended_streams - answered):
            answered.add(sid)
            grants += answer(sid, b"ok " + str(sid).encode())
        if grants:
            conn.from_server(grants)
        if all(client.answered(s) for s in sids):
            return
        assert sent or grants, "no progress: the client waits for windows the relay does not give"
    raise AssertionError("too many rounds")


def start(**relay_kw):
    conn, out, upstream, hooks = new_connection("/nonexistent", **relay_kw)
    client = Client(conn, out)
    runtime = Runtime()
    runtime.sends_settings(None)
    conn.from_server(settings())
    client.read()
    runtime.check(upstream)
    return conn, client, upstream, hooks, runtime


def rewritten_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("size,rewrite", [
    (16 * MiB - 64 * 1024, added),                                   # just under the hold cap
    (6 * MiB, lambda m, r: r + length_delimited(98, r[:3 * MiB])),   # grows by half: beyond any window
    (3 * MiB, lambda m, r: r[-100:]),                                # shrinks
])
def test_large_held_request_is_rewritten_within_flow_control(size, rewrite):
    conn, client, upstream, hooks, runtime = start()
    hooks.rewrite_fn = rewrite
    request = request_for(CREATE_CONTAINER, size=size)
    client.call(CREATE_CONTAINER, request, 1)
    serve(conn, runtime, upstream, client, [1])
    expected = rewrite(CREATE_CONTAINER, request)
    assert bytes(runtime.messages[1]) == rewritten_message(expected)
    [fc] = hooks.calls(CREATE_CONTAINER)
    assert fc.request == request and fc.forwarded == expected and fc.responses == [b"ok 1"]
    assert conn.budget.held == 0


def test_request_above_the_hold_cap_is_forwarded_unchanged():
    conn, client, upstream, hooks, runtime = start(hold_max_bytes=1 * MiB)
    request = request_for(UPDATE_CONTAINER_RESOURCES, size=3 * MiB)
    near = request_for(CREATE_CONTAINER, size=MiB - 1000)
    client.call(UPDATE_CONTAINER_RESOURCES, request, 1)
    client.call(CREATE_CONTAINER, near, 3)
    serve(conn, runtime, upstream, client, [1, 3])
    assert bytes(runtime.messages[1]) == rewritten_message(request)  # fail-open
    [fc] = hooks.calls(UPDATE_CONTAINER_RESOURCES)
    assert (fc.request, fc.forwarded, fc.code) == (request, None, "OK")
    assert [m for m, _ in hooks.rewrites] == [CREATE_CONTAINER]  # the one under the cap, rewritten
    [(method, reason)] = hooks.not_rewritten_calls  # the fail-open is reported, to be audited
    assert method == UPDATE_CONTAINER_RESOURCES and "hold cap" in reason
    assert bytes(runtime.messages[3]) == rewritten_message(added(CREATE_CONTAINER, near))


def test_many_concurrent_held_streams_and_the_relay_wide_budget():
    """Held bytes count against the connection window: the relay gives them back while holding
    and takes the difference back from the server's updates; beyond the relay-wide budget new
    holds fail open. Everything completes, the right bytes reach the runtime."""
    conn, client, upstream, hooks, runtime = start(hold_total_bytes=5 * MiB)
    creates = [request_for(CREATE_CONTAINER, str(i), size=MiB + i * 1000) for i in range(10)]
    sids = [2 * i + 1 for i in range(10)]
    for sid, r in zip(sids, creates):
        client.call(CREATE_CONTAINER, r, sid, last_frame_later=True)  # all held at once
    serve(conn, runtime, upstream, client, sids)
    rewritten = {r for sid, r in zip(sids, creates)
                 if bytes(runtime.messages[sid]) == rewritten_message(added(CREATE_CONTAINER, r))}
    unchanged = {r for sid, r in zip(sids, creates) if bytes(runtime.messages[sid]) == rewritten_message(r)}
    assert rewritten | unchanged == set(creates)
    assert rewritten, "no held stream was rewritten"
    assert unchanged, "the relay-wide budget never applied"
    assert conn.budget.held == 0 and not any(s.hold for s in conn.conn.streams.open.values())


def test_too_large_answer_in_a_partial_data_frame_behind_its_headers():
    """The runtime's chunk holds the answer's HEADERS and the start of a DATA frame whose message
    is declared above max_message_bytes: the client gets the HEADERS once, then the relay's
    RESOURCE_EXHAUSTED trailers, and none of the DATA frame (its rest dropped as it comes)."""
    conn, client, upstream, hooks, runtime = start(max_message_bytes=1000)
    client.call("/runtime.v1.RuntimeService/Version", b"", 1)
    client.send()
    enc = hpack.Encoder()
    head = frame(HEADERS, 0x4, 1, enc.encode([(":status", "200"), ("content-type", "application/grpc")]))
    body = b"\x00" + (5000).to_bytes(4, "big") + b"x" * 5000
    data = frame(DATA, 0, 1, body)
    before = len(client.out.out)
    conn.from_server(head + data[:100])
    conn.from_server(data[100:])
    got = parse(bytes(client.out.out[before:]))
    assert [(f[0], f[2]) for f in got] == [(HEADERS, 1), (HEADERS, 1)]
    assert got[0][3] == head[9:]
    [fc] = hooks.finished_calls
    assert fc.code == "RESOURCE_EXHAUSTED"
