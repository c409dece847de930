"""One kubelet connection and its upstream connection, sans I/O: ``Connection``.

It is fed the bytes each peer sent (``receive_client``, ``receive_server``) and returns an
``Output`` (``events.py``): what to write to each peer and a short list of typed events for the
I/O layer (``aio.py``) to act on -- a held request is complete (``HeldRequest``: the I/O layer
runs the hook's rewrite and answers with ``send_request``), a call ended (``CallEnded``), a held
request went upstream unchanged (``NotRewritten``), a limit was hit (``LimitHit``), heap memory
is worth giving back (``TrimHeap``), the connection is over (``Closed``). It calls nothing of
its owner and reads no clock of its own (``clock`` and ``wall`` are passed in).

What it is made of: the streams (``stream.py``: each ``Stream`` its own state, held bytes,
windows and reassembled messages, in a ``StreamTable``), the client-to-server windows
(``windows.py``), what each peer sent that is not complete yet and the HTTP/2 limits
(``limits.py``), the runtime's side (``server_side.py``: ``ServerSide``), the refusal server
when the runtime cannot be reached (``refuse.py``: ``Refusal``). It charges held bytes to the
relay-wide ``HoldBudget`` it is given.

The client's side is here. A chunk is scanned once: header blocks are decoded (new calls), and
the chunk is classified. When it can go upstream as it is -- the common case: no DATA of a
held, ended or relay-sent stream, no queue, the server's connection window takes its DATA --
the connection returns it to be written first (``paused``) and does the bookkeeping (messages
reassembled, windows counted, control frames followed) in ``resume``, so the runtime starts on
the call while the relay observes it. Otherwise the chunk is rebuilt: held DATA kept, DATA of
streams the relay ended dropped, DATA the windows cannot take yet queued, the rest forwarded in
order. At a held request's END_STREAM the connection stops (``HeldRequest``, with the writes
before it: the stream's HEADERS reach the runtime before the hook runs) and goes on with the
rest of the chunk in ``send_request``.
"""
from __future__ import annotations

import logging
import time

from shim.transport.relay.events import CLOSED, HeldRequest, LimitHit, NotRewritten, Output
from shim.transport.relay.limits import ClientFrames, H2Limits, ResetRate, StreamLimits, check_unit
from shim.transport.relay.refuse import Refusal
from shim.transport.relay.server_side import ServerSide
from shim.transport.relay.stream import HoldBudget, Stream, StreamSettings, StreamTable, over_cap
from shim.transport.relay.windows import Windows
from shim.transport.wire.grpc import decompress
from shim.transport.wire.h2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_ENHANCE_YOUR_CALM,
    ERR_FLOW_CONTROL,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    TRIMMED,
    WINDOW_UPDATE,
    H2Error,
    ProtocolError,
    data_payload,
    frame,
    goaway,
    header_block,
    settings_items,
    unit_end,
    window_update,
)
from shim.transport.wire.hpack import Decoder, HeaderListTooLarge, HpackError

log = logging.getLogger("shim.transport.relay")


class Connection:
    def __init__(self, settings: StreamSettings, limits: H2Limits, budget: HoldBudget,
                 clock=time.perf_counter, wall=time.time) -> None:
        self.settings = settings
        self.limits = limits
        self.budget = budget
        self.clock = clock
        self.mode = "connecting"  # -> "relay" | "refuse" | "closed"
        self.windows = Windows()
        self.streams = StreamTable(settings, self.windows, budget, clock, wall)
        self.client_frames = ClientFrames(limits)
        # SETTINGS_MAX_HEADER_LIST_SIZE as advertised to the client
        self.request_decoder = Decoder(max_list=limits.max_header_block)
        self.server = ServerSide(limits, self.streams, self.windows, self.client_frames, self.request_decoder)
        self.refusal: Refusal | None = None
        self.resets = ResetRate(limits, clock())
        self.stream_limits = StreamLimits(limits, self.streams, self.windows)
        self.repay_streams: dict[int, int] = {}  # held streams' DATA to give back to the client
        self.out = Output()
        # where the connection stopped: "client" (a chunk written before it is observed: its
        # data and units), "server" (a chunk's leading DATA), "held" (a held request's hook:
        # the stream, its held bytes and the rest of the chunk)
        self.paused: tuple | None = None

    # ------------------------------------------------------------------------ lifecycle

    @property
    def open_calls(self) -> int:
        return len(self.streams.open)

    @property
    def awaiting_preface(self) -> bool:  # the client's preface has not fully arrived
        return bool(self.client_frames.preface_left)

    def connected(self) -> None:
        """The upstream connection exists: relay from now on."""
        if self.mode == "connecting":
            self.mode = "relay"

    def refuse(self, details: str) -> Output:
        """The runtime cannot be reached: answer the connection's calls UNAVAILABLE."""
        out = self._begin()
        if self.mode == "connecting":
            self.mode = "refuse"
            self.refusal = Refusal(details, self.streams, self.client_frames, self.request_decoder)
            out.to_client.append(frame(SETTINGS, 0, 0))  # our (empty) SETTINGS
        return out

    def close(self, code: str, details: str) -> Output:
        """The connection is over: every open call ends with ``code``."""
        out = self._begin()
        self._close(code, details, out)
        return out

    def goaway(self) -> Output:
        """Tell the client that no new streams go on this connection (the shim stops)."""
        out = self._begin()
        if self.mode != "closed":
            self.server.client_list(out).append(goaway(self.streams.last_client_sid))
        return out

    def close_refused_idle(self) -> Output | None:
        """A refused connection with no call in progress: GOAWAY and close (so the client's new
        connection tries the runtime again); None while a call is in progress."""
        out = self._begin()
        if self.mode != "refuse":
            return out
        if self.streams.open:
            return None
        out.to_client.append(goaway(self.streams.last_client_sid))
        self._close("UNAVAILABLE", self.refusal.details, out)
        return out

    def _begin(self) -> Output:
        out = self.out
        if out.to_upstream:
            out.to_upstream.clear()
        if out.to_client:
            out.to_client.clear()
        if out.events:
            out.events.clear()
        out.paused = False
        return out

    def _close(self, code: str, details: str, out: Output) -> None:
        if self.mode == "closed":
            return
        self.mode = "closed"
        self.paused = None
        table = self.streams
        for stream in list(table.open.values()):
            table.end(stream, code, details, out.events)
        table.open.clear()
        out.events.append(CLOSED)

    def _broken(self, side: str, e: Exception | None, out: Output) -> None:
        out.paused = False
        if isinstance(e, H2Error):
            self._limit_broken(side, e, out)
            return
        if e is None:
            log.exception("relay: cannot follow the %s's HTTP/2 stream; closing the connection", side)
        else:
            log.warning("relay: cannot follow the %s's HTTP/2 stream (%s); closing the connection", side, e)
        self._close("UNAVAILABLE" if side == "server" else "CANCELLED",
                    f"memqos-shim: protocol error on the {side} side", out)

    def _limit_broken(self, side: str, e: H2Error, out: Output) -> None:
        """``side`` went past a limit: GOAWAY with the error code to it, the connection closed."""
        out.events.append(LimitHit(e.limit, f"the {side}: {e}"))
        if side == "client":
            if not self.server.partial_left:  # never inside a DATA frame partly forwarded
                out.to_client.append(goaway(self.streams.last_client_sid, e.code))
        elif self.mode == "relay":
            out.to_upstream.append(goaway(0, e.code))
        self._close("CANCELLED" if side == "client" else "UNAVAILABLE",
                    f"memqos-shim: HTTP/2 limit on the {side} side: {e}", out)

    # ------------------------------------------------------------------------ bytes in

    def receive_client(self, data: bytes) -> Output:
        out = self._begin()
        mode = self.mode
        if mode == "relay":
            try:
                self._relay_client(data, out)
            except ProtocolError as e:
                self._broken("client", e, out)
            except Exception:  # noqa: BLE001 - a bug here must not take the shim down
                self._broken("client", None, out)
        elif mode == "refuse":
            try:
                if self.refusal.receive(data, out):
                    self._close("UNAVAILABLE", self.refusal.details, out)
            except Exception as e:  # noqa: BLE001
                self._broken("client", e, out)
        return out

    def receive_server(self, data: bytes) -> Output:
        out = self._begin()
        if self.mode == "relay":
            try:
                if self.server.receive(data, out):
                    out.paused = True
                    self.paused = ("server",)
                else:
                    self._after(out)
            except ProtocolError as e:
                self._broken("server", e, out)
            except Exception:  # noqa: BLE001
                self._broken("server", None, out)
        return out

    def resume(self) -> Output:
        """Go on after a paused Output's writes went out."""
        out = self._begin()
        paused, self.paused = self.paused, None
        if paused is None or self.mode != "relay":
            return out
        side = paused[0]
        if side == "held":  # only send_request goes on from a held request
            self.paused = paused
            return out
        try:
            if side == "client":
                self._observe_client(paused[1], paused[2], out)
                self._client_chunk_end(out)
            else:
                self.server.resume(out)
                self._after(out)
        except ProtocolError as e:
            self._broken(side, e, out)
        except Exception:  # noqa: BLE001
            self._broken(side, None, out)
        return out

    def send_request(self, stream: Stream, payload: bytes) -> Output:
        """The answer to ``HeldRequest``: ``payload`` (the hook's message, or ``stream.request``
        itself) goes upstream, re-framed within the server's windows; then the rest of the
        chunk the request ended in."""
        out = self._begin()
        paused, self.paused = self.paused, None
        if paused is None or paused[0] != "held" or paused[1] is not stream or self.mode != "relay":
            return out
        _, _, held, data, units, index, out_start, done = paused
        try:
            if payload is stream.request or payload == stream.request:
                message = bytes(held)  # unchanged: the kubelet's bytes
            else:
                stream.forwarded = payload
                message = b"\x00" + len(payload).to_bytes(4, "big") + payload
            self.windows.send_owned(stream.sid, message, True, out.to_upstream)
            if not self._rebuild_client(data, units, index, out_start, done, out):
                self._client_chunk_end(out)
        except ProtocolError as e:
            self._broken("client", e, out)
        except Exception:  # noqa: BLE001
            self._broken("client", None, out)
        return out

    # ------------------------------------------------------------------------ the client's side

    def _relay_client(self, data: bytes, out: Output) -> None:
        incoming = self.client_frames
        if incoming.tail:
            data = incoming.join(data)
            if data is None:
                return
        n = len(data)
        pos = incoming.preface(data) if incoming.preface_left else 0
        units, pos, verbatim, need = self._scan_client(data, pos, n)
        if pos < n:
            incoming.keep(data, pos, n)
        if verbatim and need <= self.windows.upstream_window:
            if pos:
                out.to_upstream.append(data if pos == n else memoryview(data)[:pos])
                if need:  # DATA to observe: after the write
                    out.paused = True
                    self.paused = ("client", data, units)
                    return
            self._observe_client(data, units, out)
        elif self._rebuild_client(data, units, 0, 0, pos, out):
            return  # stopped at a held request
        self._client_chunk_end(out)

    def _client_chunk_end(self, out: Output) -> None:
        guard = self.stream_limits
        if guard.refused_sids or guard.stream_errors:
            guard.settle(out, self.server.client_list(out))
        self._after(out)

    def _scan_client(self, data: bytes, pos: int, n: int) -> tuple:
        """The chunk's complete units, new calls opened from their header blocks; returns
        (units, where the rest starts, can go upstream verbatim?, DATA bytes in it)."""
        table = self.streams
        streams = table.open
        ended = table.ended
        win = self.windows
        sending = win.sending
        queued_streams = win.queued_streams
        units = []
        verbatim = not win.queue
        need = 0
        max_frame = self.client_frames.max_frame
        floor = -win.peak  # a stream's window less its initial one may not go below (limits.py)
        stream_limits = self.stream_limits
        while n - pos >= 9:
            end = pos + 9 + ((data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2])
            if end > n:
                break
            ftype = data[pos + 3]
            flags = data[pos + 4]
            if ftype == HEADERS or ftype == PUSH_PROMISE:
                if not flags & END_HEADERS:
                    end = unit_end(data, end, n)
                    if end < 0:
                        break
            elif ftype == CONTINUATION:
                raise ProtocolError("CONTINUATION without HEADERS")
            sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if ftype == DATA:
                length = end - pos - 9
                stream = streams.get(sid)
                if stream is not None:
                    up = stream.up - length
                    stream.up = up
                    # a held request's DATA is bounded by the hold's caps instead
                    if up < floor and stream.hold is None and sid not in ended:
                        stream_limits.stream_error(stream, f"{length} bytes of DATA beyond stream {sid}'s window "
                                                   f"({up + length - floor})")
                    if stream.hold is not None:
                        verbatim = False
                if sid in ended or sid in sending:
                    verbatim = False
                need += length
                if length > max_frame:
                    check_unit(self.limits, max_frame, data, ftype, flags, pos, end)
            elif ftype == HEADERS:
                if end - pos - 9 > max_frame or not flags & END_HEADERS:
                    check_unit(self.limits, max_frame, data, ftype, flags, pos, end)
                try:
                    info = self.request_decoder.info(data[pos + 9:end] if flags & TRIMMED == END_HEADERS
                                                     else header_block(data, ftype, flags, pos, end),
                                                     self.settings.request_info)
                except HeaderListTooLarge as e:
                    raise H2Error(ERR_ENHANCE_YOUR_CALM, "header_block", f"request headers: {e}") from None
                except HpackError as e:
                    raise ProtocolError(f"request headers: {e}") from None
                if sid > table.last_client_sid:  # else trailers (gRPC clients send none)
                    table.last_client_sid = sid
                    if len(streams) >= self.limits.max_concurrent_streams:
                        stream_limits.refuse(sid)  # its DATA is dropped
                    else:
                        stream = table.open_stream(sid, info)
                        if stream.hold is not None:
                            # the relay sends its DATA itself: the runtime's window for it counts
                            # from now (a WINDOW_UPDATE may come before the message is complete)
                            stream.send_window = win.initial
                            sending[sid] = stream
                            if flags & END_STREAM:
                                verbatim = False
                if sid in queued_streams:
                    verbatim = False
            else:
                if end - pos - 9 > max_frame:
                    check_unit(self.limits, max_frame, data, ftype, flags, pos, end)
                if ftype == RST_STREAM:
                    self.resets.reset(self.clock())
                elif ftype == WINDOW_UPDATE and end - pos == 13:
                    stream_limits.window_update(sid, int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF)
                elif ftype == SETTINGS and not flags & ACK:
                    self._client_settings(data, pos, end)
            units.append((ftype, flags, sid, pos, end))
            pos = end
        if need > win.client_window:
            raise H2Error(ERR_FLOW_CONTROL, "flow_control",
                          f"{need} bytes of DATA beyond the connection window ({win.client_window})")
        if stream_limits.stream_errors:
            verbatim = False
        return units, pos, verbatim, need

    def _client_settings(self, data: bytes, pos: int, end: int) -> None:
        """The client's SETTINGS (not an ACK), taken in the chunk's order: the values that
        apply to what follows it (its initial window: to the stream windows it gives)."""
        for ident, value in settings_items(data, pos + 9, end):
            if ident == SETTINGS_HEADER_TABLE_SIZE:
                decoder = self.server.response_decoder
                decoder.max_allowed = max(decoder.max_allowed, value)
            elif ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(ERR_FLOW_CONTROL, "window_overflow", f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                self.windows.down_max = MAX_WINDOW - value

    def _observe_client(self, data: bytes, units: list, out: Output) -> None:
        """A chunk already written upstream unchanged: count its DATA, reassemble messages,
        follow its control frames."""
        win = self.windows
        streams = self.streams.open
        for ftype, flags, sid, pos, end in units:
            if ftype == DATA:
                length = end - pos - 9
                win.client_window -= length
                win.upstream_window -= length
                stream = streams.get(sid)
                if stream is not None:
                    too_big = stream.req.feed(data_payload(data, flags, pos, end) if flags & PADDED
                                              else memoryview(data)[pos + 9:end])
                    if too_big:
                        self.streams.too_big(stream, too_big, self.server.client_list(out), out.to_upstream,
                                             out.events)
            elif ftype != HEADERS:
                self._client_control(ftype, flags, sid, out)

    def _client_control(self, ftype: int, flags: int, sid: int, out: Output) -> None:
        if ftype == RST_STREAM:
            table = self.streams
            table.ended.discard(sid)
            self.windows.forget(sid)
            stream = table.open.get(sid)
            if stream is not None:
                table.end(stream, stream.ended_code(self.clock()), "", out.events)
        elif ftype == SETTINGS and flags & ACK:  # other SETTINGS: _client_settings, in the scan
            self.windows.client_acked()

    def _rebuild_client(self, data: bytes, units: list, index: int, out_start: int, done: int, out: Output) -> bool:
        """The chunk needs changes: held, dropped or queued DATA, a held stream's end. From
        unit ``index`` on; True when it stops at a held request (``HeldRequest``)."""
        table = self.streams
        streams = table.open
        ended = table.ended
        win = self.windows
        pending = out.to_upstream  # pieces to write upstream, in order
        count = len(units)
        while index < count:
            ftype, flags, sid, pos, end = units[index]
            index += 1
            if ftype == DATA:
                length = end - pos - 9
                win.client_window -= length
                stream = streams.get(sid)
                if stream is not None and stream.hold is not None:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    held = self._held_data(stream, data, pos, end, length, flags, out)
                    if held is not None:
                        self.paused = ("held", stream, held, data, units, index, out_start, done)
                        return True
                elif sid in ended:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    if flags & END_STREAM:
                        ended.discard(sid)
                else:
                    if stream is not None:
                        too_big = stream.req.feed(data_payload(data, flags, pos, end))
                        if too_big:
                            if out_start < pos:
                                pending.append(memoryview(data)[out_start:pos])
                            out_start = end
                            table.too_big(stream, too_big, self.server.client_list(out), pending, out.events)
                            continue
                    if win.queue or length > win.upstream_window or sid in win.sending:
                        if out_start < pos:
                            pending.append(memoryview(data)[out_start:pos])
                        out_start = end
                        win.enqueue(sid, data[pos:end], length)
                    else:
                        win.upstream_window -= length
            elif ftype == HEADERS:
                if sid in win.queued_streams:  # trailers behind queued DATA of the same stream
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    win.enqueue(sid, data[pos:end], 0)
                elif flags & END_STREAM:
                    stream = streams.get(sid)
                    if stream is not None and stream.hold is not None:  # a held call without a message
                        table.drop_hold(stream)
                        win.sending.pop(sid, None)  # ended by its HEADERS: the relay sends nothing on it
            elif ftype == WINDOW_UPDATE and sid in ended:  # of a stream the relay ended: dropped
                if out_start < pos:
                    pending.append(memoryview(data)[out_start:pos])
                out_start = end
            else:
                self._client_control(ftype, flags, sid, out)
        if out_start < done:
            pending.append(memoryview(data)[out_start:done])
        return False

    # ------------------------------------------------------------------------ held requests

    def _held_data(self, stream: Stream, data: bytes, pos: int, end: int, length: int, flags: int,
                   out: Output) -> bytearray | None:
        """A DATA frame of a held stream: keep its payload; at END_STREAM the held message when
        it goes to the hook (the connection stops there), else None. Fail-open -- the kubelet's
        bytes go upstream unchanged, ``NotRewritten`` -- for a message above ``hold_max_bytes``
        or beyond the relay-wide budget, compressed with an unknown encoding, or not exactly one
        message."""
        hold = stream.hold
        budget = self.budget
        settings = self.settings
        before = len(hold)
        hold += data_payload(data, flags, pos, end) if flags & PADDED else memoryview(data)[pos + 9:end]
        size = len(hold)
        budget.held += size - before
        end_stream = flags & END_STREAM
        if before < 5 <= size:
            declared = int.from_bytes(hold[1:5], "big")  # the message's 5-byte prefix
            if declared > settings.max_message_bytes:
                self.streams.too_big(stream, declared, self.server.client_list(out), out.to_upstream, out.events)
                return None
            if declared + 5 > settings.hold_max_bytes or budget.held + declared > budget.total:
                self._unhold(stream, declared, over_cap(declared, settings, budget), end_stream, out)
                return None
        elif size > settings.hold_max_bytes + 5:
            self._unhold(stream, size, over_cap(size, settings, budget), end_stream, out)
            return None
        if end_stream:
            return self._end_hold(stream, out)
        if length:
            self.repay_streams[stream.sid] = self.repay_streams.get(stream.sid, 0) + length
        return None

    def _unhold(self, stream: Stream, size: int, why: str, end_stream: int, out: Output) -> None:
        """Fail open: stop holding, send what was held unchanged; the rest of the stream's DATA
        goes through the queue within the server's stream window."""
        out.events.append(NotRewritten(stream.method, size, why))
        held = bytes(stream.hold)
        self.streams.drop_hold(stream)
        stream.held = False
        stream.req.feed(held)
        self.windows.send_owned(stream.sid, held, end_stream, out.to_upstream)

    def _end_hold(self, stream: Stream, out: Output) -> bytearray | None:
        """END_STREAM of a held call: one message goes to the hook (``HeldRequest``; returns the
        held bytes), anything else upstream unchanged."""
        hold = stream.hold
        self.budget.held -= len(hold)
        stream.hold = None
        n = len(hold)
        if n >= 5 and int.from_bytes(hold[1:5], "big") == n - 5:  # one message
            body = bytes(memoryview(hold)[5:])
            if hold[0] & 1:  # compressed
                body = decompress(stream.req_encoding, body)
            if body is not None:
                stream.request = body
                stream.request_known = True
                out.events.append(HeldRequest(stream))
                return hold
            out.events.append(NotRewritten(stream.method, n, "compressed with an unknown encoding"))
        elif n:
            out.events.append(NotRewritten(stream.method, n, "not exactly one gRPC message"))
        held = bytes(hold)
        stream.req.feed(held)
        self.windows.send_owned(stream.sid, held, True, out.to_upstream)
        return None

    def _after(self, out: Output) -> None:
        """After each chunk: queued DATA the windows now take goes upstream; the client gets
        back what it may send (room) and the stream windows of held streams."""
        if self.mode != "relay":
            return
        win = self.windows
        if win.queue:
            out.to_upstream.extend(win.drain())
        room = win.upstream_window - win.queued - win.client_window
        if room <= 0 and not self.repay_streams:
            return  # nothing to give back (the usual case)
        frames = []
        if room > 0:
            win.client_window += room
            frames.append(window_update(0, room))
        streams = self.streams.open
        for sid, n in self.repay_streams.items():
            stream = streams.get(sid)
            if stream is not None:
                frames.append(window_update(sid, n))
                stream.up += n  # the client's window for the stream grows by it too
        self.repay_streams.clear()
        if frames:
            self.server.client_list(out).append(b"".join(frames))

