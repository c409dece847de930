"""The refusal server: ``Refusal``, what answers a connection when the runtime cannot be reached.

A minimal HTTP/2 server side: SETTINGS and PING acknowledged, every call answered with a
trailers-only UNAVAILABLE once its request has ended (the request is still observed, so
``finished`` sees it), the DATA's windows given back, then GOAWAY and close once every call is
answered -- so the kubelet's next call opens a new connection and tries the runtime again.
"""
from __future__ import annotations

from shim.transport.relay.events import Output
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
from shim.transport.wire.hpack import CONTENT_TYPE_GRPC, STATUS_200, HeaderListTooLarge, HpackError, literal


class Refusal:
    """Answers the client's calls UNAVAILABLE with ``details``, on the connection's streams
    (``StreamTable``), what the client sent so far (``ClientFrames``) and its request decoder."""

    __slots__ = ("details", "streams", "incoming", "decoder", "answered")

    def __init__(self, details: str, streams, incoming, decoder) -> None:
        self.details = details
        self.streams = streams
        self.incoming = incoming
        self.decoder = decoder
        self.answered = 0

    def receive(self, data: bytes, out: Output) -> bool:
        """The client's bytes; True once every call is answered (GOAWAY written: close)."""
        incoming = self.incoming
        if incoming.tail:
            data = incoming.join(data)
            if data is None:
                return False
        n = len(data)
        pos = incoming.preface(data) if incoming.preface_left else 0
        table = self.streams
        answers = out.to_client
        events = out.events
        for ftype, flags, sid, fpos, end in frames(data, pos, n):
            if ftype == SETTINGS and not flags & ACK:
                answers.append(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                answers.append(frame(PING, ACK, 0, data[fpos + 9:end]))
            elif ftype == HEADERS:
                try:
                    info = self.decoder.info(header_block(data, ftype, flags, fpos, end), table.settings.request_info)
                except HeaderListTooLarge as e:
                    raise H2Error(ERR_ENHANCE_YOUR_CALM, "header_block", f"request headers: {e}") from None
                except HpackError as e:
                    raise ProtocolError(str(e)) from None
                if sid > table.last_client_sid:
                    table.last_client_sid = sid
                    stream = table.open_stream(sid, info)
                    if stream.hold is not None:
                        table.drop_hold(stream)
                    if flags & END_STREAM:
                        answers.append(self._refusal(stream, events))
            elif ftype == DATA:
                stream = table.open.get(sid)
                length = end - fpos - 9
                if length:
                    answers.append(window_update(0, length))
                    if stream is not None and not flags & END_STREAM:
                        answers.append(window_update(sid, length))
                if stream is not None:
                    stream.req.feed(data_payload(data, flags, fpos, end))
                    if flags & END_STREAM:
                        answers.append(self._refusal(stream, events))
            elif ftype == RST_STREAM:
                stream = table.open.get(sid)
                if stream is not None:
                    table.end(stream, stream.ended_code(table.clock()), "", events)
            pos = end
        if pos < n:
            incoming.keep(data, pos, n)
        if self.answered and not table.open:
            answers.append(goaway(table.last_client_sid))
            return True
        return False

    def _refusal(self, stream, events: list) -> bytes:
        """The trailers-only UNAVAILABLE answer to ``stream`` (which ends here)."""
        self.answered += 1
        block = (STATUS_200 + CONTENT_TYPE_GRPC + literal(b"grpc-status", b"14")
                 + literal(b"grpc-message", percent_encode(self.details)))
        self.streams.end(stream, "UNAVAILABLE", self.details, events)
        return frame(HEADERS, END_HEADERS | END_STREAM, stream.sid, block)
