"""Server to client: the part of ``Connection`` that takes the runtime's bytes.

A chunk goes to the client as it came, except for frames the relay cuts out or adds: DATA and
RST_STREAM of streams the relay ended itself (cut; the DATA's window given back upstream), a
connection WINDOW_UPDATE that would let the client send more than the server takes (cut to
``room``). On the way every header block is decoded (the HPACK state, each answer's status),
the messages are reassembled for ``finished``, and a call's end is noted; ``finished`` runs
after the chunk's writes (``Connection.from_server``).

Two fast paths: a large chunk's leading DATA (and response headers) is written before it is
copied for the observers (``_write_leading_data``), and a DATA frame that has not fully arrived
is forwarded as far as it has, the rest as it comes (``s_data_left``), the relay writing nothing
else to the client meanwhile (``Connection._to_client``).

While a chunk is processed, ``s_out`` is where its not yet written verbatim part starts,
``s_pending`` what goes to the client before it, ``s_upstream`` frames for the server.
"""
from __future__ import annotations

from shim.transport.wire.hpack import HpackError
from shim.transport.relay.writes import send
from shim.transport.wire.grpc import HTTP_STATUS, RST_STATUS, response_info
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_FLOW_CONTROL,
    GOAWAY,
    MAX_WINDOW,
    HEADERS,
    PADDED,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    ProtocolError,
    data_payload,
    frames,
    header_block,
    TRIMMED,
    settings_items,
    u31,
    window_update,
)

EARLY_WRITE_BYTES = 32 * 1024  # a server chunk this large gets its leading DATA written before it is observed


class ServerToClient:
    def _relay_server(self, data: bytes) -> None:
        if self.sbuf:
            data = self._server_bytes(data)  # limits.py
            if data is None:
                return
        n = len(data)
        self.s_out = pos = 0
        pending = self.s_pending  # empty: every chunk writes what it gathered
        if self.s_data_left:  # the rest of a DATA frame already partly forwarded
            pos = self._rest_of_partial_data(data, n)
            if self.s_data_left:
                return
        elif n >= EARLY_WRITE_BYTES:
            self.s_out = pos = self._write_leading_data(data, n)
        streams = self.streams
        win = self.windows
        for ftype, flags, sid, fpos, end in frames(data, pos, n):
            if ftype == DATA:
                length = end - fpos - 9
                win.to_client -= length
                call = streams.get(sid)
                if call is not None and not flags & (END_STREAM | PADDED):  # the usual one, inline
                    call.down -= length
                    too_big = call.resp.feed(memoryview(data)[fpos + 9:end])
                    if too_big:
                        self._server_too_big(data, call, too_big, fpos, end)
                else:
                    self._server_data(data, flags, sid, fpos, end)
            elif ftype == HEADERS:
                self._server_headers(sid, data[fpos + 9:end] if flags & TRIMMED == END_HEADERS
                                     else header_block(data, ftype, flags, fpos, end), flags & END_STREAM)
            elif ftype == WINDOW_UPDATE:
                if sid or not self.windows.server_conn_update(
                        int.from_bytes(data[fpos + 9:fpos + 13], "big") & 0x7FFFFFFF):
                    self._server_window_update(data, sid, fpos, end)
            elif ftype == RST_STREAM:
                self._server_rst(data, sid, fpos, end)
            elif ftype == SETTINGS:
                if not flags & ACK:
                    self._server_settings(data, fpos, end)
                    out = self._server_settings_frame(data, fpos, end)  # limits.py
                    if out is not None:
                        self._cut(data, fpos, end)
                        self.s_pending.append(out)
            elif ftype == GOAWAY:
                last = u31(data, fpos + 9)
                streams = self.streams
                for s in [s for s in streams if s > last]:
                    self._finish(streams[s], "UNAVAILABLE", "the runtime is going away (GOAWAY)")
            elif ftype == PUSH_PROMISE:
                self._decode_server(header_block(data, ftype, flags, fpos, end))
            pos = end
        if n - pos >= 9 and data[pos + 3] == DATA and not data[pos + 4] & PADDED:
            self._stream_partial_data(data, pos, n)  # a DATA frame not complete yet
            pos = n
        if self.s_upstream:
            self._flush_upstream(self.s_upstream)
        out_start = self.s_out
        if out_start == 0 and pos == n and not pending:
            self.client.write(data)
        else:
            if out_start < pos:
                pending.append(memoryview(data)[out_start:pos])
            send(self.client, pending)
        if pos < n:
            self._server_tail(data, pos, n)
        self._after()

    def _cut(self, data: bytes, pos: int, end: int) -> None:
        """The frame at ``pos``..``end`` does not go to the client."""
        if self.s_out < pos:
            self.s_pending.append(memoryview(data)[self.s_out:pos])
        self.s_out = end

    # ------------------------------------------------------------------------ frames

    def _server_data(self, data: bytes, flags: int, sid: int, pos: int, end: int) -> None:
        """A DATA frame that is not the usual one (padded, ending the stream, of a stream the
        relay does not follow or ended itself)."""
        call = self.streams.get(sid)
        if call is not None:
            call.down -= end - pos - 9
            too_big = call.resp.feed(data_payload(data, flags, pos, end))
            if too_big:
                self._server_too_big(data, call, too_big, pos, end)
            elif flags & END_STREAM:
                self._finish(call, "INTERNAL", "server closed the stream without sending trailers")
        elif sid in self.ended:
            self._cut(data, pos, end)
            if end - pos - 9:
                self.s_upstream.append(window_update(0, end - pos - 9))

    def _server_too_big(self, data: bytes, call, size: int, pos: int, end: int) -> None:
        """A DATA frame of an answer declared above max_message_bytes: cut, the call ended."""
        self._cut(data, pos, end)
        send(self.client, self.s_pending)
        if end - pos - 9:
            self.s_upstream.append(window_update(0, end - pos - 9))
        self._too_big(call, size, self.s_upstream)

    def _server_window_update(self, data: bytes, sid: int, pos: int, end: int) -> None:
        """A stream's WINDOW_UPDATE, or a connection one the client may not have in full (the
        loop counted it: ``Windows.server_conn_update``)."""
        win = self.windows
        if sid == 0:
            # cut to what the client may have (a rewrite made a request larger)
            self._cut(data, pos, end)
            room = win.grant()
            if room:
                self.s_pending.append(window_update(0, room))
            return
        inc = int.from_bytes(data[pos + 9:pos + 13], "big") & 0x7FFFFFFF
        call = self.streams.get(sid)
        w = win.streams.get(sid)
        if w is not None:  # a stream the relay sends on itself: its own count of the window decides
            w += inc
            win.streams[sid] = w
            if call is None:
                return
            call.up += inc
        elif call is not None:
            w = call.up + inc
            call.up = w
            # the window as the client counts it, with the smallest initial window it may use;
            # a held stream's DATA the relay has sent in full is the relay's, not the client's
            w = MAX_WINDOW if call.held else w + win.initial
        else:
            return
        if w > MAX_WINDOW:  # a stream error: that stream reset
            self._cut(data, pos, end)
            send(self.client, self.s_pending)
            self.relay.limit_hit("stream_flow_control", f"the runtime: a WINDOW_UPDATE of {inc} takes stream "
                                 f"{sid}'s window past 2^31-1")
            self._fail_call(call, "INTERNAL", "memqos-shim: the runtime overflowed the stream's flow-control "
                            "window", self.s_upstream, ERR_FLOW_CONTROL)

    def _server_rst(self, data: bytes, sid: int, pos: int, end: int) -> None:
        if sid in self.ended:
            self.ended.discard(sid)
            self._cut(data, pos, end)
            return
        self.windows.forget(sid)
        call = self.streams.get(sid)
        if call is not None:
            code = int.from_bytes(data[pos + 9:pos + 13], "big")
            self._finish(call, RST_STATUS.get(code, "INTERNAL"),
                         f"stream reset by the runtime (HTTP/2 error code {code})")

    def _server_settings(self, data: bytes, pos: int, end: int) -> None:
        initial = None
        for ident, value in settings_items(data, pos + 9, end):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                initial = value
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                self.cdec.max_allowed = max(self.cdec.max_allowed, value)
        self.windows.server_settings(initial)

    def _decode_server(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self.sdec.decode(block)
        except HpackError as e:
            raise ProtocolError(f"response headers: {e}") from None

    def _server_headers(self, sid: int, block: bytes, end_stream: int) -> None:
        try:
            http_status, encoding, code, details = self.sdec.info(block, response_info)
        except HpackError as e:
            raise ProtocolError(f"response headers: {e}") from None
        call = self.streams.get(sid)
        if call is None:
            return
        if not call.resp_headers:
            call.resp_headers = True
            call.http_status = http_status
            call.resp_encoding = encoding
        if not end_stream:
            return
        if code is None:
            if call.http_status and call.http_status != b"200":
                code = HTTP_STATUS.get(call.http_status, "UNKNOWN")
                details = f"HTTP status {call.http_status.decode('ascii', 'replace')} from the runtime"
            else:
                code, details = "UNKNOWN", "the runtime's answer has no grpc-status"
        self._finish(call, code, details)

    # ------------------------------------------------------------------------ fast paths

    def _write_leading_data(self, data: bytes, n: int) -> int:
        """A large chunk: write its leading DATA frames (and response headers) at once, before
        observing them; returns where the rest starts. Nothing a DATA frame carries can change
        what the relay forwards before it, and its observation follows right after."""
        pos = 0
        streams = self.streams
        units = []
        for unit in frames(data, 0, n):
            ftype, flags, sid, fpos, end = unit
            if ftype == DATA:
                if flags & (END_STREAM | PADDED) or sid in self.ended or sid not in streams:
                    break
            elif ftype != HEADERS or flags & (END_STREAM | PADDED) or not flags & END_HEADERS:
                break
            units.append(unit)
            pos = end
        if pos < EARLY_WRITE_BYTES:
            return 0
        self.client.write(memoryview(data)[:pos])
        win = self.windows
        for ftype, flags, sid, fpos, end in units:
            if ftype == HEADERS:
                self._server_headers(sid, header_block(data, ftype, flags, fpos, end), 0)
            else:
                win.to_client -= end - fpos - 9
                call = streams.get(sid)
                if call is not None:
                    call.down -= end - fpos - 9
                if call is not None and not call.done:
                    too_big = call.resp.feed(memoryview(data)[fpos + 9:end])
                    if too_big:
                        self._too_big(call, too_big, self.s_upstream)
        self._flush_upstream(self.s_upstream)
        return pos

    def _stream_partial_data(self, data: bytes, pos: int, n: int) -> None:
        """An unpadded DATA frame whose end has not arrived: forward (or drop) what has, and the
        rest as it comes (``s_data_left``); the relay writes nothing else to the client until the
        frame is complete."""
        length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
        self.windows.to_client -= length
        sid = u31(data, pos + 5)
        call = self.streams.get(sid)
        if call is not None:
            call.down -= length
        drop = sid in self.ended
        if call is not None and not drop:
            too_big = call.resp.feed(memoryview(data)[pos + 9:n])
            if too_big:
                drop = True
                self._cut(data, pos, n)
                send(self.client, self.s_pending)
                self._too_big(call, too_big, self.s_upstream)
        if drop:
            self._cut(data, pos, n)
            if length:
                self.s_upstream.append(window_update(0, length))
        self.s_data_left = pos + 9 + length - n
        self.s_data_call = call
        self.s_data_drop = drop

    def _rest_of_partial_data(self, data: bytes, n: int) -> int:
        """The chunk starts with the rest of a DATA frame partly forwarded: observe (or drop)
        it; returns where the frames after it start. While the frame is still not complete,
        the chunk is written (or dropped) whole."""
        take = min(self.s_data_left, n)
        call = self.s_data_call
        if self.s_data_drop:
            self.s_out = take
        elif call is not None and not call.done:
            too_big = call.resp.feed(memoryview(data)[:take])
            if too_big:  # its trailers wait for the frame's end (client_deferred)
                self._too_big(call, too_big, self.s_upstream)
        self.s_data_left -= take
        if self.s_data_left:
            if not self.s_data_drop:
                self.client.write(data)
            self._flush_upstream(self.s_upstream)
            return take
        if self.s_out < take:
            self.s_pending.append(memoryview(data)[:take])
        self.s_out = take
        self.s_data_call = None
        if self.client_deferred:
            self.s_pending.extend(self.client_deferred)
            self.client_deferred.clear()
        return take
