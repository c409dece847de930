"""The refusal server: the part of ``Connection`` that answers when the runtime cannot be reached.

A minimal HTTP/2 server side: SETTINGS and PING acknowledged, every call answered with a
trailers-only UNAVAILABLE once its request has ended (the request is still observed, so
``finished`` sees it), the DATA's windows given back, then GOAWAY and close once every call is
answered -- so the kubelet's next call opens a new connection and tries the runtime again.
"""
from __future__ import annotations

from shim.transport.wire.hpack import CONTENT_TYPE_GRPC, STATUS_200, HeaderListTooLarge, HpackError, literal
from shim.transport.wire.grpc import percent_encode
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    H2Error,
    ProtocolError,
    data_payload,
    frame,
    frames,
    goaway,
    header_block,
    window_update,
)


class Refusing:
    def _refuse(self, data: bytes) -> None:
        if self.cbuf:
            data = self._client_bytes(data)  # limits.py
            if data is None:
                return
        n = len(data)
        pos = self._preface(data) if self.preface_left else 0
        out: list[bytes] = []
        for ftype, flags, sid, fpos, end in frames(data, pos, n):
            if ftype == SETTINGS and not flags & ACK:
                out.append(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                out.append(frame(PING, ACK, 0, data[fpos + 9:end]))
            elif ftype == HEADERS:
                try:
                    info = self.cdec.info(header_block(data, ftype, flags, fpos, end), self.relay.request_info)
                except HeaderListTooLarge as e:
                    raise H2Error(ERR_ENHANCE_YOUR_CALM, "header_block", f"request headers: {e}") from None
                except HpackError as e:
                    raise ProtocolError(str(e)) from None
                if sid > self.last_client_sid:
                    self.last_client_sid = sid
                    call = self._new_call(sid, info)
                    call.hold = None
                    if flags & END_STREAM:
                        out.append(self._refusal(call))
            elif ftype == DATA:
                call = self.streams.get(sid)
                length = end - fpos - 9
                if length:
                    out.append(window_update(0, length))
                    if call is not None and not flags & END_STREAM:
                        out.append(window_update(sid, length))
                if call is not None:
                    call.req.feed(data_payload(data, flags, fpos, end))
                    if flags & END_STREAM:
                        out.append(self._refusal(call))
            elif ftype == RST_STREAM:
                call = self.streams.get(sid)
                if call is not None:
                    self._finish(call, call.ended_code(self.clock()), "")
            pos = end
        if pos < n:
            self._client_tail(data, pos, n)
        if self.answered and not self.streams:
            out.append(goaway(self.last_client_sid))
            self.client.write(b"".join(out))
            self.close("UNAVAILABLE", self.refused_details)
            return
        if out:
            self.client.write(b"".join(out))

    def _refusal(self, call) -> bytes:
        """The trailers-only UNAVAILABLE answer to ``call`` (which ends here)."""
        self.answered += 1
        block = (STATUS_200 + CONTENT_TYPE_GRPC + literal(b"grpc-status", b"14")
                 + literal(b"grpc-message", percent_encode(self.refused_details)))
        self._finish(call, "UNAVAILABLE", self.refused_details)
        return frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block)
