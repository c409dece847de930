"""The client-to-server direction's flow-control windows as the relay keeps them.

The relay forwards both peers' WINDOW_UPDATEs, so most of the time it only counts. It takes a
part of its own only because of held streams: bytes the client sends on a held stream never
reach the server (the relay gives them back to the client while holding), and the rewritten
message it sends instead (N' bytes for N) must fit the server's windows. So it tracks:

* ``upstream_window``: the server's connection window, what may still go upstream; ``client_window``: the
  client's view of it. The client's view never exceeds what the server allows minus what is
  queued: ``room`` is the difference the relay may grant the client itself.
* the streams the relay sends DATA on itself (held, then re-sent: ``sending``), each with the
  server's window for it on the stream itself (``Stream.send_window``): the initial window plus
  the server's WINDOW_UPDATEs minus what was sent.
* the server's SETTINGS_INITIAL_WINDOW_SIZE as far as the relay may use it for its own DATA:
  a raised value counts only once the client's ACK of that SETTINGS frame went upstream
  (grpc-core checks a stream's DATA against the value the peer acknowledged, and resets the
  stream otherwise), a lowered one at once (the server may apply it on sending). The same
  values give the bounds of the client's stream windows (``Stream.up``, see ``limits.py``): the
  largest the client may be using (``peak``: acknowledged or not yet) for its DATA, the
  smallest (``initial``) for a WINDOW_UPDATE's overflow; and the client's own value starts
  the windows it gives the server (``Stream.down``, at most ``down_max``).
* the queue: DATA (and trailers behind it) that the server's windows cannot take yet, in
  order, with the flow-controlled length of each entry.

No I/O: ``send_owned`` and ``drain`` give the frames that may go now.
"""
from __future__ import annotations

from collections import deque

from shim.transport.wire.h2 import DATA, END_STREAM, ERR_FLOW_CONTROL, HEADERS, MAX_WINDOW, H2Error

DEFAULT_WINDOW = 65535


class Windows:
    __slots__ = ("upstream_window", "client_window", "to_client", "initial", "initial_acked", "settings_unacked",
                 "peak", "down_max", "max_frame", "sending", "queue", "queued", "queued_streams")

    def __init__(self) -> None:
        self.upstream_window = DEFAULT_WINDOW
        self.client_window = DEFAULT_WINDOW
        # the other direction: what the server may still send the client on the connection (the
        # client's WINDOW_UPDATEs less the server's DATA), kept only to refuse a window past 2^31-1
        self.to_client = DEFAULT_WINDOW
        self.initial = DEFAULT_WINDOW  # what counts for the relay's own DATA
        self.initial_acked = DEFAULT_WINDOW
        self.settings_unacked: deque = deque()  # per server SETTINGS frame not yet acked: its value or None
        # the largest initial window the client may be using for its DATA: the acknowledged one
        # or one it may have applied on receipt (not acknowledged yet); the client's stream
        # windows are judged against it (``Stream.up``), lower ones against ``initial``
        self.peak = DEFAULT_WINDOW
        # 2^31-1 less the client's own SETTINGS_INITIAL_WINDOW_SIZE (its latest), which the
        # runtime's stream windows start from: a ``Stream.down`` above it is a window past 2^31-1
        self.down_max = MAX_WINDOW - DEFAULT_WINDOW
        # DATA the relay frames itself stays within 16384 bytes, the size every peer accepts: a
        # larger SETTINGS_MAX_FRAME_SIZE from the server would count only once acknowledged
        self.max_frame = 16384
        self.sending: dict = {}  # the streams the relay sends on itself, by id (their send_window)
        self.queue: deque = deque()  # (sid, frame, flow-controlled length)
        self.queued = 0
        self.queued_streams: dict[int, int] = {}  # sid -> its entries in the queue

    # ---------------------------------------------------------------- SETTINGS

    def server_settings(self, initial: int | None) -> None:
        """A server SETTINGS frame (not an ACK) with its SETTINGS_INITIAL_WINDOW_SIZE or None."""
        self.settings_unacked.append(initial)
        if initial is not None:
            self._apply_initial()

    def client_acked(self) -> None:
        """The client's SETTINGS ACK went upstream: it acknowledges the server's oldest
        unacknowledged SETTINGS, before anything the relay sends from now on."""
        if self.settings_unacked:
            initial = self.settings_unacked.popleft()
            if initial is not None:
                self.initial_acked = initial
                self._apply_initial()

    def _apply_initial(self) -> None:
        """The acknowledged initial window, or a lower one still waiting for its ACK; a change
        moves the windows of the streams the relay sends on (RFC 9113 6.9.2)."""
        value = peak = self.initial_acked
        for v in self.settings_unacked:
            if v is not None:
                if v < value:
                    value = v
                elif v > peak:
                    peak = v
        self.peak = peak
        delta = value - self.initial
        if delta:
            self.initial = value
            for stream in self.sending.values():
                # past 2^31-1 only if the runtime broke RFC 9113 6.9.2: sending less is safe
                stream.send_window = min(stream.send_window + delta, MAX_WINDOW)

    # ---------------------------------------------------------------- windows

    def own_stream(self, stream) -> None:
        """The relay sends on ``stream`` itself from now on: track its server window."""
        if stream.sid not in self.sending:
            stream.send_window = self.initial
            self.sending[stream.sid] = stream

    def server_conn_update(self, inc: int) -> bool:
        """The server's connection WINDOW_UPDATE: True when the client may have all of it
        (forward the frame unchanged), False when it must be cut to ``grant()``."""
        self.upstream_window += inc
        if self.upstream_window > MAX_WINDOW:
            raise H2Error(ERR_FLOW_CONTROL, "window_overflow",
                          "a connection WINDOW_UPDATE past 2^31-1 from the runtime")
        if self.upstream_window - self.queued - self.client_window >= inc:
            self.client_window += inc
            return True
        return False

    def grant(self) -> int:
        """What the client may send beyond its view (``room``), now counted as granted."""
        room = self.upstream_window - self.queued - self.client_window
        if room > 0:
            self.client_window += room
            return room
        return 0

    def take(self, sid: int, n: int) -> bool:
        """``n`` bytes of the relay's own DATA on ``sid`` go now if nothing is queued and both
        windows take them (then counted); else False."""
        if self.queue or n > self.upstream_window:
            return False
        stream = self.sending.get(sid)
        if stream is not None:
            if n > stream.send_window:
                return False
            stream.send_window -= n
        self.upstream_window -= n
        return True

    def send_owned(self, sid: int, payload: bytes, end_stream: int, to_upstream: list) -> None:
        """DATA the relay sends on stream ``sid`` itself, in frames of at most 16384 bytes:
        onto ``to_upstream`` when the windows take all of it now, else through the queue."""
        n = len(payload)
        step = self.max_frame
        flags = END_STREAM if end_stream else 0
        if self.take(sid, n):
            if end_stream:
                self.sending.pop(sid, None)
            if n <= step:
                to_upstream.append(_data_frame(flags, sid, payload))
                return
            for off in range(0, n, step):
                last = off + step >= n
                to_upstream.append(_data_frame(flags if last else 0, sid, payload[off:off + step]))
            return
        if n == 0:
            self.enqueue(sid, _data_frame(flags, sid, b""), 0)
        for off in range(0, n, step):
            chunk = payload[off:off + step]
            last = off + step >= n
            self.enqueue(sid, _data_frame(flags if last else 0, sid, chunk), len(chunk))
        to_upstream.extend(self.drain())

    # ---------------------------------------------------------------- the queue

    def enqueue(self, sid: int, frame: bytes, flow: int) -> None:
        self.queue.append((sid, frame, flow))
        self.queued += flow
        self.queued_streams[sid] = self.queued_streams.get(sid, 0) + 1

    def forget(self, sid: int) -> None:
        """Stream ``sid`` ended: its queued frames are dropped, its window forgotten."""
        if sid in self.queued_streams:
            keep = deque()
            for entry in self.queue:
                if entry[0] == sid:
                    self.queued -= entry[2]
                else:
                    keep.append(entry)
            self.queue = keep
            del self.queued_streams[sid]
        self.sending.pop(sid, None)

    def drain(self) -> list[bytes]:
        """The queued frames the windows take now, in order (counted)."""
        q = self.queue
        out = []
        sending = self.sending
        while q:
            sid, frame, flow = q[0]
            if flow:
                if flow > self.upstream_window:
                    break
                stream = sending.get(sid)
                if stream is not None:
                    if flow > stream.send_window:
                        break
                    stream.send_window -= flow
                self.upstream_window -= flow
            q.popleft()
            self.queued -= flow
            left = self.queued_streams[sid] - 1
            if left:
                self.queued_streams[sid] = left
            else:
                del self.queued_streams[sid]
            if frame[4] & END_STREAM and frame[3] in (DATA, HEADERS):
                sending.pop(sid, None)
            out.append(frame)
        return out


def _data_frame(flags: int, sid: int, payload: bytes) -> bytes:
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, DATA, flags)) + sid.to_bytes(4, "big") + payload
