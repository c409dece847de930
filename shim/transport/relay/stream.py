"""One HTTP/2 stream as the relay follows it (``Stream``: one call, the ``RpcCall`` the hooks
get), the connection's table of streams (``StreamTable``: open ones, the ones the relay ended
itself, how a call ends), what the relay keeps of calls (``StreamSettings``) and the relay-wide
budget of held bytes (``HoldBudget``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shim.transport.hooks import RpcCall
from shim.transport.relay.events import TRIM_HEAP, CallEnded
from shim.transport.wire.grpc import STATUS_NUMBER, Messages, decompress, percent_encode, timeout_seconds
from shim.transport.wire.h2 import END_HEADERS, END_STREAM, ERR_CANCEL, HEADERS, frame, rst_stream
from shim.transport.wire.hpack import CONTENT_TYPE_GRPC, STATUS_200, literal

TRIM_AFTER_BYTES = 4 * 1024 * 1024  # after a call this large, freed heap memory is worth giving back
ENDED_MAX = 10000  # streams the relay ended itself that it remembers


def request_reader(shapes: dict[str, tuple[bool, bool]]) -> Callable[[list], tuple]:
    """The relay's reading of request headers, given the method table (path -> (unary
    request?, unary response?)): (method, grpc-timeout as sent or None, grpc-encoding, unary
    request?, unary response?, the header list) of a request. A method not in the table is a
    stream both ways."""
    not_known = (False, False)

    def request_info(headers: list[tuple[bytes, bytes]]) -> tuple:
        path = timeout = None
        encoding = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
        method = (path or b"").decode("utf-8", "replace")
        unary_req, unary_resp = shapes.get(method, not_known)
        return method, timeout, encoding, unary_req, unary_resp, headers

    return request_info


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """What the relay keeps of calls, the same for every connection: the methods held for the
    rewrite, the reading of request headers (``request_reader``), the largest message either
    way (grpc's limit), the largest held message, what a streaming call's record keeps."""

    held_methods: frozenset
    request_info: Callable[[list], tuple]
    max_message_bytes: int
    hold_max_bytes: int
    stream_record_max_messages: int
    stream_record_max_bytes: int


class HoldBudget:
    """The bytes held at once over every connection of a relay (``held`` of at most ``total``):
    each connection charges what it holds and releases it when the hold ends; beyond it a new
    hold fails open."""

    __slots__ = ("total", "held")

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0


def over_cap(size: int, settings: StreamSettings, budget: HoldBudget) -> str:
    """Why a held request of ``size`` bytes goes upstream unchanged: the hold's caps."""
    return (f"a {size}-byte message is above the hold cap ({settings.hold_max_bytes} bytes each, "
            f"{budget.total} bytes at once)")


class Stream(RpcCall):
    """A stream the client opened: the call's ``RpcCall`` (the hooks get this object itself:
    ``rewrite`` and ``finished`` see the same one) with what the relay keeps of the stream.
    ``hold`` is the held request's bytes (the methods the hooks hold, until END_STREAM or
    fail-open), None otherwise; ``request_known`` says ``request`` holds the message the hook saw
    (a held call); else it is joined from ``req`` when the call ends. ``req`` and ``resp`` are the
    messages of each direction, reassembled. ``up`` and ``down`` are the stream's flow-control
    windows less the initial window each starts from (``limits.py``): the runtime's
    WINDOW_UPDATEs (and the relay's for held DATA) less the client's DATA; the client's
    WINDOW_UPDATEs less the runtime's DATA. ``send_window`` is the runtime's window for DATA the
    relay sends on the stream itself (a held request's message: ``Windows.sending``)."""

    __slots__ = ("sid", "t0", "timeout", "held", "hold", "req", "resp", "resp_headers", "http_status",
                 "req_encoding", "resp_encoding", "request_known", "done", "up", "down", "send_window")

    def __init__(self, sid: int, info: tuple, settings: StreamSettings, start: float, t0: float) -> None:
        method, timeout, encoding, unary_req, unary_resp, headers = info
        limit = settings.max_message_bytes
        # the RpcCall's fields
        self.method = method
        self.start = start  # wall clock
        self.duration_ms = 0.0
        self.request = b""
        self.forwarded = None
        self.responses = []
        self.code = "OK"
        self.details = ""
        self.truncated = False
        self.rewritten = None
        # the relay's
        self.sid = sid
        self.t0 = t0  # the connection's clock
        self.timeout = None if timeout is None else timeout_seconds(timeout)
        self.held = held = method in settings.held_methods
        if held:
            self.hold: bytearray | None = bytearray()
            self.metadata = tuple(headers)
        else:
            self.hold = None
            self.metadata = ()
        if unary_req:
            self.req = Messages(1 << 30, limit, limit)
        else:
            self.req = Messages(settings.stream_record_max_messages, settings.stream_record_max_bytes, limit)
        if unary_resp:
            self.resp = Messages(1 << 30, limit, limit)
        else:
            self.resp = Messages(settings.stream_record_max_messages, settings.stream_record_max_bytes, limit)
        self.resp_headers = False
        self.http_status = b""
        self.req_encoding = encoding
        self.resp_encoding = b""
        self.request_known = False  # set for held calls (the message the hook saw)
        self.done = False
        self.up = 0
        self.down = 0
        self.send_window = 0

    def finished(self, code: str, details: str, now: float) -> RpcCall:
        """This call, completed for ``CallHooks.finished``: ended with ``code`` at ``now``."""
        if not self.request_known:
            msgs = self.req.msgs
            request = msgs[0] if len(msgs) == 1 else b"".join(msgs)
            if self.req.compressed and self.req_encoding:
                request = decompress(self.req_encoding, request) or request
            self.request = request
        responses: list[bytes] = []
        if code == "OK":
            responses = self.resp.msgs
            if self.resp.compressed and self.resp_encoding:
                responses = [decompress(self.resp_encoding, r) or r for r in responses]
        truncated = self.resp.truncated and code == "OK"
        self.req.drop_partial()  # the call outlives the stream in the observers' queues
        self.resp.drop_partial()
        return self.complete((now - self.t0) * 1000.0, self.forwarded, responses, code, details, truncated)

    def ended_code(self, now: float) -> str:
        """A call the client reset: its deadline, or the client cancelled (as grpc-go reports it)."""
        if self.timeout is None:
            return "CANCELLED"
        remaining = self.timeout - (now - self.t0)
        if remaining <= 0.011 * self.timeout + 0.02:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"


class StreamTable:
    """The streams of one connection: the open ones by id (``open``), the ids the relay ended
    itself toward the client (``ended``: what either peer still sends on them is cut), the
    highest stream id the client opened, and how a call ends (``end``, ``fail``). Ending a call
    releases its hold, forgets its windows (``windows``) and adds ``CallEnded`` to the events."""

    __slots__ = ("open", "ended", "last_client_sid", "settings", "windows", "budget", "clock", "wall")

    def __init__(self, settings: StreamSettings, windows, budget: HoldBudget, clock, wall) -> None:
        self.open: dict[int, Stream] = {}
        self.ended: set[int] = set()
        self.last_client_sid = 0
        self.settings = settings
        self.windows = windows
        self.budget = budget
        self.clock = clock
        self.wall = wall

    def open_stream(self, sid: int, info: tuple) -> Stream:
        stream = Stream(sid, info, self.settings, self.wall(), self.clock())
        self.open[sid] = stream
        return stream

    def drop_hold(self, stream: Stream) -> None:
        self.budget.held -= len(stream.hold)
        stream.hold = None

    def end(self, stream: Stream, code: str, details: str, events: list) -> None:
        """``stream``'s call ended with ``code``: ``CallEnded`` (and ``TrimHeap`` after a large one)."""
        if stream.done:
            return
        stream.done = True
        self.open.pop(stream.sid, None)
        if stream.hold is not None:
            self.drop_hold(stream)
        if stream.held:
            self.windows.forget(stream.sid)  # its window, counted from its start
        call = stream.finished(code, details, self.clock())
        events.append(CallEnded(call))
        if stream.resp.kept + stream.req.kept + len(call.request) > TRIM_AFTER_BYTES:
            events.append(TRIM_HEAP)

    def relay_ended(self, sid: int) -> None:
        """The relay ended stream ``sid`` itself: what either peer still sends on it is cut."""
        ended = self.ended
        ended.add(sid)
        if len(ended) > ENDED_MAX:
            ended.clear()

    def fail(self, stream: Stream, code: str, details: str, to_client: list, to_upstream: list | None,
             events: list, rst_code: int = ERR_CANCEL) -> None:
        """End a call for both sides from the relay: trailers with ``code`` to the client,
        RST_STREAM upstream (none when ``to_upstream`` is None: no upstream)."""
        block = b""
        if not stream.resp_headers:
            block = STATUS_200 + CONTENT_TYPE_GRPC
        block += literal(b"grpc-status", str(STATUS_NUMBER[code]).encode())
        block += literal(b"grpc-message", percent_encode(details))
        to_client.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.sid, block))
        if to_upstream is not None:
            to_upstream.append(rst_stream(stream.sid, rst_code))
        self.windows.forget(stream.sid)
        self.relay_ended(stream.sid)
        self.end(stream, code, details, events)

    def too_big(self, stream: Stream, size: int, to_client: list, to_upstream: list | None, events: list) -> None:
        """A message (either way) declared above max_message_bytes: RESOURCE_EXHAUSTED, as grpc."""
        self.fail(stream, "RESOURCE_EXHAUSTED",
                  f"Received message larger than max ({size} vs. {self.settings.max_message_bytes})",
                  to_client, to_upstream, events)
