"""The relay's HTTP/2 limits: what a kubelet connection may send before the relay closes it.

The relay forwards a peer's frames rather than terminating HTTP/2, but whatever it has to
keep in memory or work through on the way is bounded here (``H2Limits``, one per
``RelayProxy``, from the shim's settings):

* a header block (HEADERS + CONTINUATION) above ``max_header_block`` bytes or in more than
  ``max_continuations`` CONTINUATION frames: GOAWAY ENHANCE_YOUR_CALM, closed (the block is
  walked frame by frame as it arrives, ``wire.h2.continuations``: linear in its size, and
  never kept beyond the limit); a block that decodes to a header list above the same size
  (``hpack.Decoder.max_list``) is refused the same way, the size being advertised to the client
  as SETTINGS_MAX_HEADER_LIST_SIZE. The
  runtime's header blocks are walked the same way (linear), not limited;
* a frame above the SETTINGS_MAX_FRAME_SIZE the client was given (16384 until the runtime
  advertises more, at most ``max_frame_size``): GOAWAY FRAME_SIZE_ERROR, judged from the
  9-byte frame header before its payload is kept;
* client DATA beyond the connection window the client was given, a connection WINDOW_UPDATE
  or SETTINGS_INITIAL_WINDOW_SIZE that takes a window past 2^31-1 (RFC 9113 6.9.1, 6.9.2):
  GOAWAY FLOW_CONTROL_ERROR to the peer that broke it;
* the same on a stream (``stream_flow_control``), a stream error: client DATA beyond the
  stream's window, a client WINDOW_UPDATE taking it past 2^31-1 (RST_STREAM FLOW_CONTROL_ERROR
  to the client, CANCEL upstream, the stream's frames from there dropped: ``StreamLimits``);
  the runtime's WINDOW_UPDATE taking it past 2^31-1 (RST_STREAM FLOW_CONTROL_ERROR upstream,
  INTERNAL to the client: ``server_side.py``). Each open call keeps its two windows less the
  initial window they start from (``Stream.up``: the runtime's WINDOW_UPDATEs and the relay's for
  held DATA, less the client's DATA; ``Stream.down``: the client's WINDOW_UPDATEs less the
  runtime's DATA), so a SETTINGS_INITIAL_WINDOW_SIZE change moves every stream's window at once
  and the state goes with the call. The bounds are the most a compliant peer may use
  (``Windows``): client DATA against the largest initial window the client may be using (the
  acknowledged one or a newer one it may have applied on receipt), the runtime's
  WINDOW_UPDATEs against the smallest, the client's against its own latest value. A held
  request's DATA is bounded by the hold's caps instead while held; the runtime's window of a
  stream the relay sends on itself is the relay's count of what it sent (``Stream.send_window``);
* more RST_STREAM from the client than ``reset_rate`` per second over a burst of
  ``reset_burst`` (rapid reset): GOAWAY ENHANCE_YOUR_CALM;
* more than ``max_concurrent_streams`` open streams: the new one is refused (RST_STREAM
  REFUSED_STREAM to the client, which retries; its HEADERS still reach the runtime, followed by
  RST_STREAM CANCEL, since the HPACK state is the two peers'); the value is advertised;
* a connection that has not sent the HTTP/2 preface after ``preface_timeout`` seconds, and
  (only when set) one without an open stream or a byte either way for ``idle_timeout``
  seconds: closed (``aio.py``).

Here: ``H2Limits``, what arrives of each peer's frames kept and judged before it is complete
(``ClientFrames``, ``ServerFrames``), the judgement of one complete unit (``check_unit``), the
rapid-reset allowance (``ResetRate``) and the runtime's SETTINGS as the client gets them
(``settings_for_client``). The connection applies the rest (``connection.py``: stream windows,
concurrent streams; ``server_side.py``: the runtime's stream windows) and reports each hit as a
``LimitHit`` event (``RelayProxy`` counts it in ``limit_hits`` and logs it, throttled).
"""
from __future__ import annotations

from dataclasses import dataclass

from shim.transport.wire.h2 import (
    DEFAULT_MAX_FRAME,
    END_HEADERS,
    ERR_ENHANCE_YOUR_CALM,
    ERR_FLOW_CONTROL,
    ERR_CANCEL,
    ERR_FRAME_SIZE,
    ERR_REFUSED_STREAM,
    HEADERS,
    MAX_WINDOW,
    PUSH_PROMISE,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    PREFACE,
    H2Error,
    ProtocolError,
    continuations,
    frame,
    frame_length,
    joined,
    rst_stream,
    setting,
    settings_items,
)
from shim.transport.relay.events import LimitHit, Output

# the limits by the name their metric label and log line use
LIMIT_NAMES = ("header_block", "continuations", "frame_size", "flow_control", "window_overflow",
               "stream_flow_control", "rapid_reset", "concurrent_streams", "preface_timeout", "idle_timeout")
# what follows a hit, for its log line, where it is not the connection closed
LIMIT_OUTCOMES = {"concurrent_streams": "the stream was refused, the connection goes on",
                  "stream_flow_control": "the stream was reset, the connection goes on"}


@dataclass(frozen=True)
class H2Limits:
    max_header_block: int = 1024 * 1024
    max_continuations: int = 128
    max_frame_size: int = DEFAULT_MAX_FRAME
    max_concurrent_streams: int = 1000
    reset_rate: float = 200.0
    reset_burst: int = 400
    preface_timeout: float = 10.0
    idle_timeout: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        for name in ("max_header_block", "max_continuations", "max_concurrent_streams", "reset_burst"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, not {v!r}")
        if not DEFAULT_MAX_FRAME <= self.max_frame_size <= (1 << 24) - 1:
            raise ValueError(f"max_frame_size must be in 16384..16777215, not {self.max_frame_size!r}")
        if not self.reset_rate > 0 or not self.preface_timeout > 0 or self.idle_timeout < 0:
            raise ValueError("reset_rate and preface_timeout must be positive, idle_timeout not negative")


def _walk(data, p: int, n: int | None = None) -> tuple[int, bool]:
    """The runtime's CONTINUATIONs from ``p``: where the walk stopped, END_HEADERS seen."""
    p, _, _, done = continuations(data, p, len(data) if n is None else n, 0, 0, 1 << 24, 1 << 62, 1 << 62)
    return p, done


class ClientFrames:
    """What the client sent that is not a complete unit yet (``tail``), judged as it arrives:
    the preface (``preface_left`` bytes of it still to come), a frame above ``max_frame`` (the
    SETTINGS_MAX_FRAME_SIZE the client was given) from its 9-byte header, a header block's size
    and CONTINUATIONs walked frame by frame (``block``: walked so far, its size, its count)."""

    __slots__ = ("limits", "tail", "block", "max_frame", "preface_left")

    def __init__(self, limits: H2Limits) -> None:
        self.limits = limits
        # it grows in place until the unit is whole, so a large frame arriving in many reads
        # is copied once, not per read
        self.tail = bytearray()
        self.block: tuple[int, int, int] | None = None
        self.max_frame = DEFAULT_MAX_FRAME
        self.preface_left = len(PREFACE)

    def join(self, data: bytes) -> bytes | None:
        """``data`` after the kept tail of earlier reads, or None while the tail's frame (or
        header block) is not complete: a header block is walked as it arrives, not rescanned."""
        if self.block is not None:
            buf = self.tail
            buf += data
            lim = self.limits
            scan, size, count = self.block
            scan, size, count, done = continuations(buf, scan, len(buf), size, count, self.max_frame,
                                                    lim.max_header_block, lim.max_continuations)
            if not done:
                self.block = (scan, size, count)
                return None
            self.block = None
            self.tail = bytearray()
            return bytes(buf)
        data = joined(self.tail, data, not self.preface_left)
        if data is not None:
            self.tail = bytearray()
        return data

    def keep(self, data: bytes, pos: int, n: int) -> None:
        """Keep ``data[pos:n]``, the start of a unit not complete yet, once its frame header
        passes the limits (frame size; a header block's CONTINUATIONs so far)."""
        if n - pos >= 9 and not self.preface_left:
            length = frame_length(data, pos)
            if length > self.max_frame:
                raise H2Error(ERR_FRAME_SIZE, "frame_size", f"a {length}-byte frame (max {self.max_frame})")
            ftype = data[pos + 3]
            if (ftype == HEADERS or ftype == PUSH_PROMISE) and not data[pos + 4] & END_HEADERS \
                    and pos + 9 + length <= n:
                lim = self.limits
                scan, size, count, _ = continuations(data, pos + 9 + length, n, length, 0, self.max_frame,
                                                     lim.max_header_block, lim.max_continuations)
                self.block = (scan - pos, size, count)
        self.tail = bytearray(memoryview(data)[pos:n])

    def preface(self, data: bytes) -> int:
        """The preface's bytes at the start of ``data`` (checked): how many."""
        done = len(PREFACE) - self.preface_left
        take = min(self.preface_left, len(data))
        if data[:take] != PREFACE[done:done + take]:
            raise ProtocolError("not an HTTP/2 connection preface")
        self.preface_left -= take
        return take


class ServerFrames:
    """The runtime's side of ``ClientFrames``: a header block it sends in many reads is walked
    as it arrives too (linear), though not limited (the runtime is not policed)."""

    __slots__ = ("tail", "block")

    def __init__(self) -> None:
        self.tail = bytearray()
        self.block: int | None = None  # a header block at the start of the tail: walked so far

    def join(self, data: bytes) -> bytes | None:
        if self.block is not None:
            buf = self.tail
            buf += data
            scan, done = _walk(buf, self.block)
            if not done:
                self.block = scan
                return None
            self.block = None
            self.tail = bytearray()
            return bytes(buf)
        data = joined(self.tail, data, stream_data=True)
        if data is not None:
            self.tail = bytearray()
        return data

    def keep(self, data: bytes, pos: int, n: int) -> None:
        """Keep ``data[pos:n]``; a header block whose first frame is there is walked from now on."""
        if n - pos >= 9 and data[pos + 3] in (HEADERS, PUSH_PROMISE) and not data[pos + 4] & END_HEADERS:
            first_end = pos + 9 + frame_length(data, pos)
            if first_end <= n:
                self.block = _walk(data, first_end, n)[0] - pos
        self.tail = bytearray(memoryview(data)[pos:n])


def check_unit(limits: H2Limits, max_frame: int, data: bytes, ftype: int, flags: int, pos: int, end: int) -> None:
    """A complete unit from the client that is larger than a frame may be, or a header block in
    several frames: the frame size, the block's size and CONTINUATIONs."""
    length = frame_length(data, pos)
    if length > max_frame:
        raise H2Error(ERR_FRAME_SIZE, "frame_size", f"a {length}-byte frame (max {max_frame})")
    if (ftype == HEADERS or ftype == PUSH_PROMISE) and not flags & END_HEADERS:
        continuations(data, pos + 9 + length, end, length, 0, max_frame, limits.max_header_block,
                      limits.max_continuations)


class ResetRate:
    """RST_STREAM from the client: within ``reset_rate`` per second over ``reset_burst``."""

    __slots__ = ("limits", "tokens", "at")

    def __init__(self, limits: H2Limits, now: float) -> None:
        self.limits = limits
        self.tokens = float(limits.reset_burst)
        self.at = now

    def reset(self, now: float) -> None:
        lim = self.limits
        tokens = min(lim.reset_burst, self.tokens + (now - self.at) * lim.reset_rate) - 1
        self.at = now
        if tokens < 0:
            raise H2Error(ERR_ENHANCE_YOUR_CALM, "rapid_reset",
                          f"more than {lim.reset_rate:g} streams reset per second (burst {lim.reset_burst})")
        self.tokens = tokens


def settings_for_client(limits: H2Limits, data: bytes, pos: int, end: int, client: ClientFrames,
                        first: bool) -> bytes | None:
    """The runtime's SETTINGS as the client gets it: SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE and SETTINGS_MAX_CONCURRENT_STREAMS at most the relay's
    limits (the last two added to the ``first`` SETTINGS when absent); None when unchanged. The
    frame size the client is given is what ``client.max_frame`` allows from then on."""
    caps = {SETTINGS_MAX_FRAME_SIZE: limits.max_frame_size, SETTINGS_MAX_HEADER_LIST_SIZE: limits.max_header_block,
            SETTINGS_MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams}
    out = []
    seen = set()
    changed = False
    for ident, value in settings_items(data, pos + 9, end):
        cap = caps.get(ident)
        if cap is not None:
            seen.add(ident)
            if value > cap:
                value = cap
                changed = True
            if ident == SETTINGS_MAX_FRAME_SIZE and value > client.max_frame:
                client.max_frame = value
        elif ident == SETTINGS_INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2Error(ERR_FLOW_CONTROL, "window_overflow",
                          f"SETTINGS_INITIAL_WINDOW_SIZE {value} from the runtime")
        out.append(setting(ident, value))
    if first:
        for ident in (SETTINGS_MAX_HEADER_LIST_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS):
            if ident not in seen:
                out.append(setting(ident, caps[ident]))
                changed = True
    if not changed:
        return None
    return frame(SETTINGS, 0, 0, b"".join(out))


class StreamLimits:
    """The limits on one client stream at a time: a stream beyond ``max_concurrent_streams``
    (refused), a stream whose flow control the client broke (reset). Both are noted while a
    chunk is scanned and settled once it is forwarded (``settle``): the connection and the other
    streams go on."""

    __slots__ = ("limits", "streams", "windows", "refused_sids", "stream_errors")

    def __init__(self, limits: H2Limits, streams, windows) -> None:
        self.limits = limits
        self.streams = streams  # StreamTable
        self.windows = windows
        self.refused_sids: list[int] = []  # streams refused in the chunk at hand
        self.stream_errors: list = []  # (stream, why): streams whose flow control the client broke

    def refuse(self, sid: int) -> None:
        """A stream opened beyond ``max_concurrent_streams``: its frames from here on are cut."""
        self.streams.ended.add(sid)
        self.refused_sids.append(sid)

    def window_update(self, sid: int, inc: int) -> None:
        """A WINDOW_UPDATE from the client: what the runtime may send it stays <= 2^31-1, on the
        connection (else a connection error) and on a stream (else a stream error)."""
        win = self.windows
        if not sid:
            win.to_client += inc
            if win.to_client > MAX_WINDOW:
                raise H2Error(ERR_FLOW_CONTROL, "window_overflow",
                              "a connection WINDOW_UPDATE past 2^31-1 from the client")
            return
        stream = self.streams.open.get(sid)
        if stream is not None:
            stream.down += inc
            if stream.down > win.down_max and sid not in self.streams.ended:
                self.stream_error(stream, f"a WINDOW_UPDATE of {inc} takes stream {sid}'s window past 2^31-1")

    def stream_error(self, stream, detail: str) -> None:
        """The client broke a stream's flow control (RFC 9113 6.9.1: a stream error): its DATA and
        WINDOW_UPDATEs from here on are dropped (``ended``), and once the chunk is forwarded the
        stream is reset both ways."""
        self.streams.ended.add(stream.sid)
        if stream.hold is not None:
            self.streams.drop_hold(stream)  # nothing of it goes upstream
        self.stream_errors.append((stream, detail))

    def settle(self, out: Output, to_client: list) -> None:
        """After the chunk: refused streams get RST_STREAM CANCEL upstream and REFUSED_STREAM to
        the client; streams that broke flow control RST_STREAM CANCEL upstream, FLOW_CONTROL_ERROR
        to the client, their calls ended (INTERNAL). Each a ``LimitHit``."""
        table = self.streams
        if self.refused_sids:
            sids, self.refused_sids = self.refused_sids, []
            out.to_upstream.append(b"".join(rst_stream(sid, ERR_CANCEL) for sid in sids))
            to_client.append(b"".join(rst_stream(sid, ERR_REFUSED_STREAM) for sid in sids))
            out.events.append(LimitHit("concurrent_streams", f"{len(sids)} stream(s) refused beyond "
                                       f"{self.limits.max_concurrent_streams} open"))
        if not self.stream_errors:
            return
        errors, self.stream_errors = self.stream_errors, []
        down = []
        for stream, detail in errors:
            if stream.done:  # ended in the same chunk (the client reset it, a message too large)
                continue
            out.to_upstream.append(rst_stream(stream.sid, ERR_CANCEL))
            down.append(rst_stream(stream.sid, ERR_FLOW_CONTROL))
            table.relay_ended(stream.sid)
            self.windows.forget(stream.sid)  # DATA of it still queued for the runtime's windows
            out.events.append(LimitHit("stream_flow_control", f"the client: {detail}"))
            table.end(stream, "INTERNAL", f"memqos-shim: the kubelet broke HTTP/2 flow control: {detail}",
                      out.events)
        if down:
            to_client.append(b"".join(down))
