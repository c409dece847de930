"""Client to server: the part of ``Connection`` that takes the kubelet's bytes.

A chunk is scanned once (``wire.h2.frames``): header blocks are decoded (new calls), and the
chunk is classified. When it can go upstream as it is -- the common case: no DATA of a held,
ended or relay-sent stream, no queue, the server's connection window takes its DATA -- it is
written first and the bookkeeping (messages reassembled, windows counted, control frames
followed) is done after, so the runtime starts on the call while the relay observes it.
Otherwise the chunk is rebuilt: held DATA kept (``hold.py``), DATA of streams the relay ended
dropped, DATA the windows cannot take yet queued, the rest forwarded in order.
"""
from __future__ import annotations

from shim.transport.wire.hpack import HeaderListTooLarge, HpackError
from shim.transport.relay.writes import send
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_ENHANCE_YOUR_CALM,
    ERR_FLOW_CONTROL,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    TRIMMED,
    WINDOW_UPDATE,
    H2Error,
    ProtocolError,
    data_payload,
    frames,
    header_block,
    settings_items,
    u31,
)


class ClientToServer:
    def _relay_client(self, data: bytes) -> None:
        if self.cbuf:
            data = self._client_bytes(data)  # limits.py
            if data is None:
                return
        n = len(data)
        pos = self._preface(data) if self.preface_left else 0
        units, pos, verbatim, need = self._scan_client(data, pos, n)
        if pos < n:
            self._client_tail(data, pos, n)
        if verbatim and need <= self.windows.s_conn:
            if pos:
                self.upstream.write(data if pos == n else memoryview(data)[:pos])
            self._observe_client(data, units)
        else:
            self._rebuild_client(data, units, pos)
        if self.refused_sids:
            self._refuse_streams()
        if self.stream_errors:
            self._reset_streams()  # limits.py
        self._after()

    def _scan_client(self, data: bytes, pos: int, n: int) -> tuple:
        """The chunk's complete units, new calls opened from their header blocks; returns
        (units, where the rest starts, can go upstream verbatim?, DATA bytes in it)."""
        streams = self.streams
        ended = self.ended
        win = self.windows
        owned = win.streams
        qsids = win.qsids
        units = []
        verbatim = not win.queue
        need = 0
        max_frame = self.max_frame_in
        floor = -win.peak  # a stream's window less its initial one may not go below (limits.py)
        for unit in frames(data, pos, n):
            ftype, flags, sid, fpos, end = unit
            if ftype == DATA:
                length = end - fpos - 9
                call = streams.get(sid)
                if call is not None:
                    up = call.up - length
                    call.up = up
                    # a held request's DATA is bounded by the hold's caps instead (hold.py)
                    if up < floor and call.hold is None and sid not in ended:
                        self._stream_error(call, f"{length} bytes of DATA beyond stream {sid}'s window "
                                                 f"({up + length - floor})")
                    if call.hold is not None:
                        verbatim = False
                if sid in ended or sid in owned:
                    verbatim = False
                need += length
                if length > max_frame:
                    self._check_unit(data, ftype, flags, fpos, end)
            elif ftype == HEADERS:
                if end - fpos - 9 > max_frame or not flags & END_HEADERS:
                    self._check_unit(data, ftype, flags, fpos, end)
                try:
                    info = self.cdec.info(data[fpos + 9:end] if flags & TRIMMED == END_HEADERS
                                          else header_block(data, ftype, flags, fpos, end), self.relay.request_info)
                except HeaderListTooLarge as e:
                    raise H2Error(ERR_ENHANCE_YOUR_CALM, "header_block", f"request headers: {e}") from None
                except HpackError as e:
                    raise ProtocolError(f"request headers: {e}") from None
                if sid > self.last_client_sid:  # else trailers (gRPC clients send none)
                    self.last_client_sid = sid
                    if len(streams) >= self.limits.max_concurrent_streams:
                        ended.add(sid)  # refused (_refuse_streams): its DATA is dropped
                        self.refused_sids.append(sid)
                    else:
                        call = self._new_call(sid, info)
                        if call.hold is not None:
                            # the relay sends its DATA itself: the runtime's window for it counts
                            # from now (a WINDOW_UPDATE may come before the message is complete)
                            self.windows.own_stream(sid)
                            if flags & END_STREAM:
                                verbatim = False
                if sid in qsids:
                    verbatim = False
            else:
                if end - fpos - 9 > max_frame:
                    self._check_unit(data, ftype, flags, fpos, end)
                if ftype == RST_STREAM:
                    self._client_reset()
                elif ftype == WINDOW_UPDATE and end - fpos == 13:
                    self._client_window_update(sid, u31(data, fpos + 9))  # limits.py
                elif ftype == SETTINGS and not flags & ACK:
                    self._client_settings(data, fpos, end)
            units.append(unit)
            pos = end
        if need > win.c_conn:
            raise H2Error(ERR_FLOW_CONTROL, "flow_control",
                          f"{need} bytes of DATA beyond the connection window ({win.c_conn})")
        if self.stream_errors:
            verbatim = False
        return units, pos, verbatim, need

    def _client_settings(self, data: bytes, pos: int, end: int) -> None:
        """The client's SETTINGS (not an ACK), taken in the chunk's order: the values that
        apply to what follows it (its initial window: to the stream windows it gives)."""
        for ident, value in settings_items(data, pos + 9, end):
            if ident == SETTINGS_HEADER_TABLE_SIZE:
                self.sdec.max_allowed = max(self.sdec.max_allowed, value)
            elif ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(ERR_FLOW_CONTROL, "window_overflow", f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                self.windows.c_over = MAX_WINDOW - value

    def _observe_client(self, data: bytes, units: list) -> None:
        """A chunk already written upstream unchanged: count its DATA, reassemble messages,
        follow its control frames."""
        win = self.windows
        streams = self.streams
        for ftype, flags, sid, pos, end in units:
            if ftype == DATA:
                length = end - pos - 9
                win.c_conn -= length
                win.s_conn -= length
                call = streams.get(sid)
                if call is not None:
                    too_big = call.req.feed(data_payload(data, flags, pos, end) if flags & PADDED
                                            else memoryview(data)[pos + 9:end])
                    if too_big:
                        self._too_big(call, too_big, None)
            elif ftype != HEADERS:
                self._client_control(ftype, flags, sid, data, pos, end)

    def _client_control(self, ftype: int, flags: int, sid: int, data: bytes, pos: int, end: int) -> None:
        if ftype == RST_STREAM:
            self.ended.discard(sid)
            self.windows.forget(sid)
            call = self.streams.get(sid)
            if call is not None:
                self._finish(call, call.ended_code(self.clock()), "")
        elif ftype == SETTINGS and flags & ACK:  # other SETTINGS: _client_settings, in the scan
            self.windows.client_acked()

    def _rebuild_client(self, data: bytes, units: list, done: int) -> None:
        """The chunk needs changes: held, dropped or queued DATA, a held stream's end."""
        streams = self.streams
        win = self.windows
        pending: list[bytes] = []  # pieces to write upstream, in order
        out_start = 0
        for ftype, flags, sid, pos, end in units:
            if ftype == DATA:
                length = end - pos - 9
                win.c_conn -= length
                call = streams.get(sid)
                if call is not None and call.hold is not None:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    self._held_data(call, data, pos, end, length, flags, pending)
                elif sid in self.ended:
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    if flags & END_STREAM:
                        self.ended.discard(sid)
                else:
                    if call is not None:
                        too_big = call.req.feed(data_payload(data, flags, pos, end))
                        if too_big:
                            if out_start < pos:
                                pending.append(memoryview(data)[out_start:pos])
                            out_start = end
                            send(self.upstream, pending)
                            self._too_big(call, too_big, None)
                            continue
                    if win.queue or length > win.s_conn or sid in win.streams:
                        if out_start < pos:
                            pending.append(memoryview(data)[out_start:pos])
                        out_start = end
                        send(self.upstream, pending)
                        win.enqueue(sid, data[pos:end], length)
                    else:
                        win.s_conn -= length
            elif ftype == HEADERS:
                if sid in win.qsids:  # trailers behind queued DATA of the same stream
                    if out_start < pos:
                        pending.append(memoryview(data)[out_start:pos])
                    out_start = end
                    send(self.upstream, pending)
                    win.enqueue(sid, data[pos:end], 0)
                elif flags & END_STREAM:
                    call = streams.get(sid)
                    if call is not None and call.hold is not None:  # a held call without a message
                        pending.append(memoryview(data)[out_start:end])
                        out_start = end
                        send(self.upstream, pending)
                        self._end_hold(call, pending)
            elif ftype == WINDOW_UPDATE and sid in self.ended:  # of a stream the relay ended: dropped
                if out_start < pos:
                    pending.append(memoryview(data)[out_start:pos])
                out_start = end
            else:
                self._client_control(ftype, flags, sid, data, pos, end)
        if out_start < done:
            pending.append(memoryview(data)[out_start:done])
        send(self.upstream, pending)
