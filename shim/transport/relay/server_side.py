"""Server to client: ``ServerSide``, what the relay does with the runtime's bytes.

A chunk goes to the client as it came, except for frames the relay cuts out or adds: DATA and
RST_STREAM of streams the relay ended itself (cut; the DATA's window given back upstream), a
connection WINDOW_UPDATE that would let the client send more than the server takes (cut to
``room``). On the way every header block is decoded (the HPACK state, each answer's status),
the messages are reassembled for ``finished``, and a call's end is noted (``CallEnded``, after
the chunk's writes in the same ``Output``).

Two fast paths: a large chunk's leading DATA (and response headers) goes out before it is
copied for the observers (the connection pauses after it: ``leading_data``, ``resume``), and a
DATA frame that has not fully arrived is forwarded as far as it has, the rest as it comes
(``partial_left``), the relay writing nothing else to the client meanwhile (frames it writes
itself wait in ``deferred``).

It works on parts it is given, shared with the client's side: the connection's streams
(``StreamTable``), the client-to-server windows (``Windows``), what the client may send
(``ClientFrames``: the frame size the runtime allows), the request decoder (the table size the
runtime allows).
"""
from __future__ import annotations

from shim.transport.relay.events import LimitHit, Output
from shim.transport.relay.limits import ServerFrames, settings_for_client
from shim.transport.wire.grpc import HTTP_STATUS, RST_STATUS, response_info
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_FLOW_CONTROL,
    GOAWAY,
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
    ProtocolError,
    data_payload,
    frames,
    header_block,
    settings_items,
    u31,
    window_update,
)
from shim.transport.wire.hpack import Decoder, HpackError

EARLY_WRITE_BYTES = 32 * 1024  # a server chunk this large gets its leading DATA written before it is observed


class ServerSide:
    __slots__ = ("limits", "streams", "windows", "client_frames", "request_decoder", "response_decoder", "incoming",
                 "settings_seen", "partial_left", "partial_stream", "partial_drop", "deferred", "out_start",
                 "leading")

    def __init__(self, limits, streams, windows, client_frames, request_decoder) -> None:
        self.limits = limits
        self.streams = streams  # StreamTable
        self.windows = windows
        self.client_frames = client_frames
        self.request_decoder = request_decoder
        self.response_decoder = Decoder()
        self.incoming = ServerFrames()
        self.settings_seen = False  # the runtime's first SETTINGS went by
        # a server DATA frame partly forwarded: bytes still to come, its stream, dropped or not;
        # frames the relay writes to the client itself wait in ``deferred`` meanwhile
        self.partial_left = 0
        self.partial_stream = None
        self.partial_drop = False
        self.deferred: list[bytes] = []
        self.out_start = 0  # where the chunk's not yet written verbatim part starts
        self.leading: tuple | None = None  # a chunk paused after its leading DATA: (data, units, where the rest starts)

    def client_list(self, out: Output) -> list:
        """Where frames the relay writes to the client itself go: never inside a partly
        forwarded DATA frame."""
        return self.deferred if self.partial_left else out.to_client

    def receive(self, data: bytes, out: Output) -> bool:
        """The runtime's bytes; True when the connection pauses after the chunk's leading DATA."""
        incoming = self.incoming
        if incoming.tail:
            data = incoming.join(data)
            if data is None:
                return False
        n = len(data)
        self.out_start = pos = 0
        if self.partial_left:  # the rest of a DATA frame already partly forwarded
            pos = self._rest_of_partial_data(data, n, out)
            if self.partial_left:
                return False
        elif n >= EARLY_WRITE_BYTES:
            pos, units = self._leading_data(data, n)
            if pos:
                out.to_client.append(memoryview(data)[:pos])
                self.leading = (data, units, pos)
                return True
        self._forward(data, pos, n, out)
        return False

    def resume(self, out: Output) -> None:
        """The chunk's leading DATA went out: observe it, then the rest of the chunk."""
        data, units, pos = self.leading
        self.leading = None
        self._observe_leading(data, units, out)
        self.out_start = pos
        self._forward(data, pos, len(data), out)

    def _forward(self, data: bytes, pos: int, n: int, out: Output) -> None:
        streams = self.streams.open
        win = self.windows
        events = out.events
        for ftype, flags, sid, fpos, end in frames(data, pos, n):
            if ftype == DATA:
                length = end - fpos - 9
                win.to_client -= length
                stream = streams.get(sid)
                if stream is not None and not flags & (END_STREAM | PADDED):  # the usual one, inline
                    stream.down -= length
                    too_big = stream.resp.feed(memoryview(data)[fpos + 9:end])
                    if too_big:
                        self._too_big(data, stream, too_big, fpos, end, out)
                else:
                    self._data(data, flags, sid, fpos, end, out)
            elif ftype == HEADERS:
                self._headers(sid, data[fpos + 9:end] if flags & TRIMMED == END_HEADERS
                              else header_block(data, ftype, flags, fpos, end), flags & END_STREAM, events)
            elif ftype == WINDOW_UPDATE:
                if sid or not win.server_conn_update(int.from_bytes(data[fpos + 9:fpos + 13], "big") & 0x7FFFFFFF):
                    self._window_update(data, sid, fpos, end, out)
            elif ftype == RST_STREAM:
                self._rst(data, sid, fpos, end, out)
            elif ftype == SETTINGS:
                if not flags & ACK:
                    self._settings(data, fpos, end)
                    first = not self.settings_seen
                    self.settings_seen = True
                    capped = settings_for_client(self.limits, data, fpos, end, self.client_frames, first)
                    if capped is not None:
                        self._cut(data, fpos, end, out)
                        out.to_client.append(capped)
            elif ftype == GOAWAY:
                last = u31(data, fpos + 9)
                table = self.streams
                for s in [s for s in streams if s > last]:
                    table.end(streams[s], "UNAVAILABLE", "the runtime is going away (GOAWAY)", events)
            elif ftype == PUSH_PROMISE:
                self._decode(header_block(data, ftype, flags, fpos, end))
            pos = end
        if n - pos >= 9 and data[pos + 3] == DATA and not data[pos + 4] & PADDED:
            self._partial_data(data, pos, n, out)  # a DATA frame not complete yet
            pos = n
        out_start = self.out_start
        if out_start == 0 and pos == n and not out.to_client:
            out.to_client.append(data)
        elif out_start < pos:
            out.to_client.append(memoryview(data)[out_start:pos])
        if pos < n:
            self.incoming.keep(data, pos, n)

    def _cut(self, data: bytes, pos: int, end: int, out: Output) -> None:
        """The frame at ``pos``..``end`` does not go to the client."""
        if self.out_start < pos:
            out.to_client.append(memoryview(data)[self.out_start:pos])
        self.out_start = end

    # ------------------------------------------------------------------------ frames

    def _data(self, data: bytes, flags: int, sid: int, pos: int, end: int, out: Output) -> None:
        """A DATA frame that is not the usual one (padded, ending the stream, of a stream the
        relay does not follow or ended itself)."""
        stream = self.streams.open.get(sid)
        if stream is not None:
            stream.down -= end - pos - 9
            too_big = stream.resp.feed(data_payload(data, flags, pos, end))
            if too_big:
                self._too_big(data, stream, too_big, pos, end, out)
            elif flags & END_STREAM:
                self.streams.end(stream, "INTERNAL", "server closed the stream without sending trailers", out.events)
        elif sid in self.streams.ended:
            self._cut(data, pos, end, out)
            if end - pos - 9:
                out.to_upstream.append(window_update(0, end - pos - 9))

    def _too_big(self, data: bytes, stream, size: int, pos: int, end: int, out: Output) -> None:
        """A DATA frame of an answer declared above max_message_bytes: cut, the call ended."""
        self._cut(data, pos, end, out)
        if end - pos - 9:
            out.to_upstream.append(window_update(0, end - pos - 9))
        self.streams.too_big(stream, size, self.client_list(out), out.to_upstream, out.events)

    def _window_update(self, data: bytes, sid: int, pos: int, end: int, out: Output) -> None:
        """A stream's WINDOW_UPDATE, or a connection one the client may not have in full (the
        loop counted it: ``Windows.server_conn_update``)."""
        win = self.windows
        if sid == 0:
            # cut to what the client may have (a rewrite made a request larger)
            self._cut(data, pos, end, out)
            room = win.grant()
            if room:
                out.to_client.append(window_update(0, room))
            return
        inc = int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF
        stream = self.streams.open.get(sid)
        sending = win.sending.get(sid)
        if sending is not None:  # a stream the relay sends on itself: its own count of the window decides
            sending.send_window += inc
            w = sending.send_window
            if stream is None:
                return
            stream.up += inc
        elif stream is not None:
            w = stream.up + inc
            stream.up = w
            # the window as the client counts it, with the smallest initial window it may use;
            # a held stream's DATA the relay has sent in full is the relay's, not the client's
            w = MAX_WINDOW if stream.held else w + win.initial
        else:
            return
        if w > MAX_WINDOW:  # a stream error: that stream reset
            self._cut(data, pos, end, out)
            out.events.append(LimitHit("stream_flow_control", f"the runtime: a WINDOW_UPDATE of {inc} takes "
                                       f"stream {sid}'s window past 2^31-1"))
            self.streams.fail(stream, "INTERNAL", "memqos-shim: the runtime overflowed the stream's flow-control "
                              "window", self.client_list(out), out.to_upstream, out.events, ERR_FLOW_CONTROL)

    def _rst(self, data: bytes, sid: int, pos: int, end: int, out: Output) -> None:
        table = self.streams
        if sid in table.ended:
            table.ended.discard(sid)
            self._cut(data, pos, end, out)
            return
        self.windows.forget(sid)
        stream = table.open.get(sid)
        if stream is not None:
            code = int.from_bytes(data[pos + 9:pos + 13], "big")
            table.end(stream, RST_STATUS.get(code, "INTERNAL"),
                      f"stream reset by the runtime (HTTP/2 error code {code})", out.events)

    def _settings(self, data: bytes, pos: int, end: int) -> None:
        initial = None
        for ident, value in settings_items(data, pos + 9, end):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                initial = value
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                decoder = self.request_decoder
                decoder.max_allowed = max(decoder.max_allowed, value)
        self.windows.server_settings(initial)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self.response_decoder.decode(block)
        except HpackError as e:
            raise ProtocolError(f"response headers: {e}") from None

    def _headers(self, sid: int, block: bytes, end_stream: int, events: list) -> None:
        try:
            http_status, encoding, code, details = self.response_decoder.info(block, response_info)
        except HpackError as e:
            raise ProtocolError(f"response headers: {e}") from None
        stream = self.streams.open.get(sid)
        if stream is None:
            return
        if not stream.resp_headers:
            stream.resp_headers = True
            stream.http_status = http_status
            stream.resp_encoding = encoding
        if not end_stream:
            return
        if code is None:
            if stream.http_status and stream.http_status != b"200":
                code = HTTP_STATUS.get(stream.http_status, "UNKNOWN")
                details = f"HTTP status {stream.http_status.decode('ascii', 'replace')} from the runtime"
            else:
                code, details = "UNKNOWN", "the runtime's answer has no grpc-status"
        self.streams.end(stream, code, details, events)

    # ------------------------------------------------------------------------ fast paths

    def _leading_data(self, data: bytes, n: int) -> tuple[int, list]:
        """A large chunk: where its leading DATA frames (and response headers) end, and those
        units; 0 when they are fewer than EARLY_WRITE_BYTES. Nothing a DATA frame carries can
        change what the relay forwards before it, and its observation follows right after."""
        pos = 0
        streams = self.streams.open
        ended = self.streams.ended
        units = []
        for unit in frames(data, 0, n):
            ftype, flags, sid, fpos, end = unit
            if ftype == DATA:
                if flags & (END_STREAM | PADDED) or sid in ended or sid not in streams:
                    break
            elif ftype != HEADERS or flags & (END_STREAM | PADDED) or not flags & END_HEADERS:
                break
            units.append(unit)
            pos = end
        if pos < EARLY_WRITE_BYTES:
            return 0, units
        return pos, units

    def _observe_leading(self, data: bytes, units: list, out: Output) -> None:
        win = self.windows
        streams = self.streams.open
        for ftype, flags, sid, fpos, end in units:
            if ftype == HEADERS:
                self._headers(sid, header_block(data, ftype, flags, fpos, end), 0, out.events)
            else:
                win.to_client -= end - fpos - 9
                stream = streams.get(sid)
                if stream is not None:
                    stream.down -= end - fpos - 9
                if stream is not None and not stream.done:
                    too_big = stream.resp.feed(memoryview(data)[fpos + 9:end])
                    if too_big:
                        self.streams.too_big(stream, too_big, self.client_list(out), out.to_upstream, out.events)

    def _partial_data(self, data: bytes, pos: int, n: int, out: Output) -> None:
        """An unpadded DATA frame whose end has not arrived: forward (or drop) what has, and the
        rest as it comes (``partial_left``); the relay writes nothing else to the client until
        the frame is complete."""
        length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
        self.windows.to_client -= length
        sid = u31(data, pos + 5)
        stream = self.streams.open.get(sid)
        if stream is not None:
            stream.down -= length
        drop = sid in self.streams.ended
        if stream is not None and not drop:
            too_big = stream.resp.feed(memoryview(data)[pos + 9:n])
            if too_big:
                drop = True
                self._cut(data, pos, n, out)
                self.streams.too_big(stream, too_big, out.to_client, out.to_upstream, out.events)
        if drop:
            self._cut(data, pos, n, out)
            if length:
                out.to_upstream.append(window_update(0, length))
        self.partial_left = pos + 9 + length - n
        self.partial_stream = stream
        self.partial_drop = drop

    def _rest_of_partial_data(self, data: bytes, n: int, out: Output) -> int:
        """The chunk starts with the rest of a DATA frame partly forwarded: observe (or drop)
        it; returns where the frames after it start. While the frame is still not complete,
        the chunk is written (or dropped) whole."""
        take = min(self.partial_left, n)
        stream = self.partial_stream
        if self.partial_drop:
            self.out_start = take
        elif stream is not None and not stream.done:
            too_big = stream.resp.feed(memoryview(data)[:take])
            if too_big:  # its trailers wait for the frame's end (deferred)
                self.streams.too_big(stream, too_big, self.deferred, out.to_upstream, out.events)
        self.partial_left -= take
        if self.partial_left:
            if not self.partial_drop:
                out.to_client.append(data)
            return take
        if self.out_start < take:
            out.to_client.append(memoryview(data)[:take])
        self.out_start = take
        self.partial_stream = None
        if self.deferred:
            out.to_client.extend(self.deferred)
            self.deferred.clear()
        return take
