"""One kubelet connection and its upstream connection, sans I/O.

``Connection`` is fed the bytes each peer sent (``from_client``, ``from_server``) and writes
what each peer must get to two writers it was given (``client``, and ``upstream`` once
``relay_to`` is called; ``writes.py``): the asyncio layer (``aio.py``) gives its transports,
tests give buffers (``Buffer``). It does no other I/O and reads no clock of its own (``clock``
and ``wall`` are passed in); what happens to a call is told to its ``owner`` (``RelayProxy``
in the shim; these calls are the connection's events):

* ``owner.rewritten(RpcCall) -> bytes``: the hook's rewrite of a held request;
* ``owner.finished(RpcCall)``: a call ended (after the chunk that ended it was written);
* ``owner.hold_skipped(method, size, why)``: a held request goes upstream unchanged (fail-open);
* ``owner.trim_soon()``: a large call ended (give freed heap memory back);
* ``owner.held_methods`` (the methods held for the rewrite) and ``owner.request_info`` (what
  a request's headers say, from the method table: ``calls.request_reader``);
* the limits ``max_message_bytes``, ``hold_max_bytes``, ``hold_total_bytes``,
  ``stream_record_max_messages``, ``stream_record_max_bytes`` and the relay-wide budget of
  held bytes ``held_total`` (shared by all of the owner's connections).

``on_closed`` (set by whoever owns the sockets) is called once when the connection is over:
the relay closed it (a peer broke the protocol, a refused connection answered its calls) or
``close`` was called.

Where the work is, by direction (each a part of this class, in its own module):
``client_side.py`` (client to server: new calls, the verbatim fast path, rebuilt chunks),
``server_side.py`` (server to client: answers observed, windows cut, partial DATA streamed),
``hold.py`` (held requests rewritten and re-sent within the windows, ``windows.py``),
``refuse.py`` (the UNAVAILABLE server side when the runtime cannot be reached).
"""
from __future__ import annotations

import logging
import time

from shim.transport.wire.hpack import CONTENT_TYPE_GRPC, STATUS_200, Decoder, literal
from shim.transport.relay.calls import Call
from shim.transport.relay.client_side import ClientToServer
from shim.transport.relay.hold import Holding
from shim.transport.relay.limits import Guarded
from shim.transport.relay.refuse import Refusing
from shim.transport.relay.server_side import ServerToClient
from shim.transport.relay.windows import Windows
from shim.transport.wire.grpc import STATUS_NUMBER, percent_encode
from shim.transport.wire.h2 import (
    END_HEADERS,
    END_STREAM,
    ERR_CANCEL,
    HEADERS,
    PREFACE,
    SETTINGS,
    DEFAULT_MAX_FRAME,
    H2Error,
    ProtocolError,
    frame,
    goaway,
    rst_stream,
    window_update,
)

log = logging.getLogger("shim.transport.relay")

TRIM_AFTER_BYTES = 4 * 1024 * 1024  # after a call this large, give freed heap memory back (trim_soon)
ENDED_MAX = 10000  # streams the relay ended itself that it remembers


class Connection(ClientToServer, ServerToClient, Holding, Refusing, Guarded):
    def __init__(self, owner, client, clock=time.perf_counter, wall=time.time) -> None:
        self.relay = owner
        self.limits = owner.limits  # H2Limits (limits.py)
        self.client = client  # writers
        self.upstream = None
        self.clock = clock
        self.wall = wall
        self.on_closed = _nothing
        self.mode = "connecting"  # -> "relay" | "refuse" | "closed"
        # the unprocessed tail of each direction (an incomplete frame); it grows in place until
        # the frame is whole, so a large frame arriving in many reads is copied once, not per read
        self.cbuf = bytearray()
        self.sbuf = bytearray()
        # limits.py: a header block arriving at the start of cbuf (walked so far, its size and
        # CONTINUATIONs) or None; the largest frame the client may send; streams refused in the
        # chunk at hand; the rapid-reset allowance; whether the runtime's first SETTINGS went by
        self.c_block: tuple[int, int, int] | None = None
        self.s_block: int | None = None  # the same for the runtime's header block in sbuf: walked so far
        self.max_frame_in = DEFAULT_MAX_FRAME
        self.refused_sids: list[int] = []
        self.stream_errors: list = []  # (call, why): streams whose flow control the client broke
        self.reset_tokens = float(self.limits.reset_burst)
        self.reset_at = clock()
        self.server_settings_seen = False
        self.preface_left = len(PREFACE)
        self.streams: dict[int, Call] = {}
        self.last_client_sid = 0
        self.cdec = Decoder(max_list=self.limits.max_header_block)  # what SETTINGS_MAX_HEADER_LIST_SIZE says
        self.sdec = Decoder()
        self.windows = Windows()
        self.repay_streams: dict[int, int] = {}  # held streams' DATA to give back to the client
        self.ended: set[int] = set()  # streams the relay ended itself toward the client
        # a server DATA frame partly forwarded: bytes still to come, its call, dropped or not;
        # frames the relay writes to the client itself wait in client_deferred meanwhile
        self.s_data_left = 0
        self.s_data_call: Call | None = None
        self.s_data_drop = False
        self.client_deferred: list[bytes] = []
        self.held_bytes = 0
        self.refused_details = ""
        self.answered = 0
        # while a server chunk is processed (deferring): the finished calls of the calls it ends,
        # reported once the chunk's answers are written to the client (from_server)
        self.deferring = False
        self.defer: list = []
        # the server chunk being forwarded (server_side.py): where the verbatim part starts, the
        # pieces to write to the client before it, frames for upstream
        self.s_out = 0
        self.s_pending: list = []
        self.s_upstream: list = []

    # ------------------------------------------------------------------------ lifecycle

    def relay_to(self, upstream) -> None:
        """The upstream connection exists: relay from now on (feed what came meanwhile)."""
        self.upstream = upstream
        self.mode = "relay"

    def refuse(self, details: str) -> None:
        """The runtime cannot be reached: answer the connection's calls UNAVAILABLE."""
        self.mode = "refuse"
        self.refused_details = details
        self.client.write(frame(SETTINGS, 0, 0))  # our (empty) SETTINGS

    def close(self, code: str, details: str) -> None:
        """The connection is over: every open call ends with ``code``."""
        if self.mode == "closed":
            return
        self.mode = "closed"
        for call in list(self.streams.values()):
            self._finish(call, code, details)
        self.streams.clear()
        if self.held_bytes:
            self.relay.held_total -= self.held_bytes
            self.held_bytes = 0
        self.on_closed()

    def goaway(self) -> None:
        """Tell the client that no new streams go on this connection (the shim stops)."""
        if self.mode != "closed":
            self._to_client(goaway(self.last_client_sid))

    def close_refused_idle(self) -> bool:
        """A refused connection with no call in progress: GOAWAY and close (so the client's new
        connection tries the runtime again); False while a call is in progress."""
        if self.mode != "refuse":
            return True
        if self.streams:
            return False
        self.client.write(goaway(self.last_client_sid))
        self.close("UNAVAILABLE", self.refused_details)
        return True

    def _broken(self, side: str, e: Exception | None) -> None:
        if isinstance(e, H2Error):
            self._limit_broken(side, e)
            return
        if e is None:
            log.exception("relay: cannot follow the %s's HTTP/2 stream; closing the connection", side)
        else:
            log.warning("relay: cannot follow the %s's HTTP/2 stream (%s); closing the connection", side, e)
        self.close("UNAVAILABLE" if side == "server" else "CANCELLED",
                   f"memqos-shim: protocol error on the {side} side")

    # ------------------------------------------------------------------------ bytes in

    def from_client(self, data: bytes) -> None:
        mode = self.mode
        if mode == "relay":
            try:
                self._relay_client(data)
            except ProtocolError as e:
                self._broken("client", e)
            except Exception:  # noqa: BLE001 - a bug here must not take the shim down
                self._broken("client", None)
        elif mode == "refuse":
            try:
                self._refuse(data)
            except Exception as e:  # noqa: BLE001
                self._broken("client", e)

    def from_server(self, data: bytes) -> None:
        if self.mode != "relay":
            return
        self.deferring = True  # calls that end in this chunk: finished() after the client has the answer
        try:
            self._relay_server(data)
        except ProtocolError as e:
            self._broken("server", e)
        except Exception:  # noqa: BLE001
            self._broken("server", None)
        finally:
            self.deferring = False
            if self.defer:
                done, self.defer = self.defer, []
                for fc in done:
                    self.relay.finished(fc)

    def _preface(self, data: bytes) -> int:
        done = len(PREFACE) - self.preface_left
        take = min(self.preface_left, len(data))
        if data[:take] != PREFACE[done:done + take]:
            raise ProtocolError("not an HTTP/2 connection preface")
        self.preface_left -= take
        return take

    # ------------------------------------------------------------------------ calls

    def _new_call(self, sid: int, info: tuple) -> Call:
        call = Call(sid, info, self.relay, self.wall(), self.clock())
        self.streams[sid] = call
        return call

    def _finish(self, call: Call, code: str, details: str) -> None:
        if call.done:
            return
        call.done = True
        self.streams.pop(call.sid, None)
        if call.hold is not None:
            self._drop_hold(call)
        if call.held:
            self.windows.forget(call.sid)  # its window, counted from its start (client_side.py)
        fc = call.finished(code, details, self.clock())
        if self.deferring:
            self.defer.append(fc)
        else:
            self.relay.finished(fc)
        if call.resp.kept + call.req.kept + len(fc.request) > TRIM_AFTER_BYTES:
            self.relay.trim_soon()

    def _fail_call(self, call: Call, code: str, details: str, to_upstream: list | None,
                   rst_code: int = ERR_CANCEL) -> None:
        """End a call for both sides from the relay: trailers to the client, RST upstream."""
        block = b""
        if not call.resp_headers:
            block = STATUS_200 + CONTENT_TYPE_GRPC
        block += literal(b"grpc-status", str(STATUS_NUMBER[code]).encode())
        block += literal(b"grpc-message", percent_encode(details))
        self._to_client(frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block))
        rst = rst_stream(call.sid, rst_code)
        if to_upstream is not None:
            to_upstream.append(rst)
        elif self.upstream is not None:
            self.upstream.write(rst)
        self.windows.forget(call.sid)
        self._ended(call.sid)
        self._finish(call, code, details)

    def _ended(self, sid: int) -> None:
        """The relay ended stream ``sid`` itself: what either peer still sends on it is cut."""
        self.ended.add(sid)
        if len(self.ended) > ENDED_MAX:
            self.ended.clear()

    def _too_big(self, call: Call, size: int, to_upstream: list | None) -> None:
        """A message (either way) declared above max_message_bytes: RESOURCE_EXHAUSTED, as grpc."""
        self._fail_call(call, "RESOURCE_EXHAUSTED",
                        f"Received message larger than max ({size} vs. {self.relay.max_message_bytes})",
                        to_upstream)

    # ------------------------------------------------------------------------ bytes out

    def _to_client(self, frames: bytes) -> None:
        """Frames the relay writes to the client itself: never inside a partly forwarded frame."""
        if self.s_data_left:
            self.client_deferred.append(frames)
        else:
            self.client.write(frames)

    def _flush_upstream(self, out: list[bytes]) -> None:
        if out:
            self.upstream.write(b"".join(out))
            out.clear()

    def _drain(self) -> None:
        if self.windows.queue and self.upstream is not None:
            out = self.windows.drain()
            if out:
                self.upstream.write(b"".join(out))

    def _after(self) -> None:
        """After each chunk: queued DATA the windows now take goes upstream; the client gets
        back what it may send (room) and the stream windows of held streams."""
        if self.mode != "relay":
            return
        win = self.windows
        if win.queue:
            self._drain()
        if win.s_conn - win.queued <= win.c_conn and not self.repay_streams:
            return  # nothing to give back (the usual case)
        room = win.grant()
        frames = [window_update(0, room)] if room else []
        streams = self.streams
        for sid, n in self.repay_streams.items():
            call = streams.get(sid)
            if call is not None:
                frames.append(window_update(sid, n))
                call.up += n  # the client's window for the stream grows by it too
        self.repay_streams.clear()
        if frames:
            self._to_client(b"".join(frames))


def _nothing() -> None:
    pass
