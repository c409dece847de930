"""Held requests: the part of ``Connection`` that rewrites the methods the hooks hold
(``CallHooks.held_methods``: CreateContainer and UpdateContainerResources in the shim).

Their HEADERS go upstream at once (the runtime's deadline starts when the kubelet's did); their
DATA is kept (``Call.hold``) and given back to the client (connection and stream
WINDOW_UPDATE) so a request larger than the window does not stall. At END_STREAM the hook
rewrites the message and the result is sent re-framed in 16 KiB frames within the server's
windows (``Windows``), queued where they do not take it yet. Fail-open -- the kubelet's bytes go
upstream unchanged, the owner told through ``hold_skipped`` -- for a message above
``hold_max_bytes`` or beyond the relay-wide ``hold_total_bytes``, compressed with an unknown
encoding, or not exactly one message; a hook that fails is the owner's (``rewritten``).
"""
from __future__ import annotations

from shim.transport.relay.writes import send
from shim.transport.wire.grpc import decompress, message
from shim.transport.wire.h2 import DATA, END_STREAM, PADDED, data_payload, frame


class Holding:
    def _held_data(self, call, data: bytes, pos: int, end: int, length: int, flags: int,
                   pending: list[bytes]) -> None:
        """A DATA frame of a held stream: keep its payload; at END_STREAM rewrite and send."""
        hold = call.hold
        relay = self.relay
        before = len(hold)
        hold += data_payload(data, flags, pos, end) if flags & PADDED else memoryview(data)[pos + 9:end]
        grown = len(hold) - before
        self.held_bytes += grown
        relay.held_total += grown
        if before < 5 <= len(hold):
            declared = int.from_bytes(hold[1:5], "big")  # the message's 5-byte prefix
            if declared > relay.max_message_bytes:
                send(self.upstream, pending)
                self._too_big(call, declared, None)
                return
            if declared + 5 > relay.hold_max_bytes or relay.held_total + declared > relay.hold_total_bytes:
                relay.hold_skipped(call.method, declared)
                send(self.upstream, pending)
                self._unhold(call, bool(flags & END_STREAM))
                return
        elif len(hold) > relay.hold_max_bytes + 5:
            relay.hold_skipped(call.method, len(hold))
            send(self.upstream, pending)
            self._unhold(call, bool(flags & END_STREAM))
            return
        if flags & END_STREAM:
            # the stream's HEADERS go first, before the hook runs: the runtime starts on the call
            # (and its deadline) while the relay rewrites the message -- measured faster than one
            # write of HEADERS and DATA together after the hook
            send(self.upstream, pending)
            self._end_hold(call, pending)
        elif length:
            self.repay_streams[call.sid] = self.repay_streams.get(call.sid, 0) + length

    def _drop_hold(self, call) -> None:
        n = len(call.hold)
        self.held_bytes -= n
        self.relay.held_total -= n
        call.hold = None

    def _unhold(self, call, end_stream: bool) -> None:
        """Fail open: stop holding, send what was held unchanged; the rest of the stream's DATA
        goes through the queue within the server's stream window."""
        data = bytes(call.hold)
        self._drop_hold(call)
        call.held = False
        call.req.feed(data)
        self.windows.own_stream(call.sid)
        self._send_owned(call.sid, data, end_stream)

    def _end_hold(self, call, pending: list[bytes]) -> None:
        """END_STREAM of a held call: the hook's rewrite (or the kubelet's bytes) goes upstream."""
        hold = call.hold
        self._drop_hold(call)
        relay = self.relay
        n = len(hold)
        out = None
        request = None
        if n >= 5 and int.from_bytes(hold[1:5], "big") == n - 5:  # one message
            body = bytes(memoryview(hold)[5:])
            if hold[0] & 1:  # compressed
                body = decompress(call.req_encoding, body)
            if body is not None:
                request = body
                call.request = body
                new = relay.rewritten(call)
                if new is not body and new != body:
                    call.forwarded = new
                    out = message(new)
            else:
                relay.hold_skipped(call.method, n, "compressed with an unknown encoding")
        elif n:
            relay.hold_skipped(call.method, n, "not exactly one gRPC message")
        if out is None:
            out = bytes(hold)  # unchanged: the kubelet's bytes
        if request is None:
            call.req.feed(out)
        else:
            call.request_known = True
        self.windows.own_stream(call.sid)
        self._send_owned(call.sid, out, True, pending)

    def _send_owned(self, sid: int, payload: bytes, end_stream: bool, pending: list | None = None) -> None:
        """DATA the relay sends on a stream itself, in frames of at most 16384 bytes: straight
        into ``pending`` (what goes upstream next) when the server's windows take all of it now,
        else through the queue (flow control)."""
        win = self.windows
        step = win.max_frame
        n = len(payload)
        if pending is not None and win.take(sid, n):
            if end_stream:
                win.streams.pop(sid, None)
            if n <= step:
                pending.append(frame(DATA, END_STREAM if end_stream else 0, sid, payload))
                return
            for off in range(0, n, step):
                last = off + step >= n
                pending.append(frame(DATA, END_STREAM if (end_stream and last) else 0, sid, payload[off:off + step]))
            return
        if n == 0:
            win.enqueue(sid, frame(DATA, END_STREAM if end_stream else 0, sid), 0)
        for off in range(0, n, step):
            chunk = payload[off:off + step]
            last = off + step >= n
            win.enqueue(sid, frame(DATA, END_STREAM if (end_stream and last) else 0, sid, chunk), len(chunk))
        if pending is not None:
            send(self.upstream, pending)
        self._drain()
