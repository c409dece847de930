"""One call (one HTTP/2 stream) as the relay follows it: what its request headers say, the
messages of both directions, the held request; the call is the ``RpcCall`` the hooks get."""
from __future__ import annotations

from typing import Callable

from shim.transport.hooks import RpcCall
from shim.transport.wire.grpc import Messages, decompress, header_values, timeout_seconds


_REQUEST = {b":path": 0, b"grpc-timeout": 1, b"grpc-encoding": 2}


def request_reader(shapes: dict[str, tuple[bool, bool]]) -> Callable[[list], tuple]:
    """The relay's reading of request headers, given the method table (path -> (unary
    request?, unary response?)): (method, timeout seconds, grpc-encoding, unary request?,
    unary response?, the header list) of a request. A method not in the table is a stream
    both ways."""
    not_known = (False, False)

    def request_info(headers: list[tuple[bytes, bytes]]) -> tuple:
        path, timeout, encoding = header_values(headers, _REQUEST)
        method = (path or b"").decode("utf-8", "replace")
        unary_req, unary_resp = shapes.get(method, not_known)
        return (method, None if timeout is None else timeout_seconds(timeout), encoding or b"",
                unary_req, unary_resp, headers)

    return request_info


class Call(RpcCall):
    """A stream the client opened: the call's ``RpcCall`` (the hooks get this object itself:
    ``rewrite`` and ``finished`` see the same one) with what the relay keeps of the stream.
    ``hold`` is the held request's bytes (the methods the hooks hold, until END_STREAM or
    fail-open), None otherwise; ``request_known`` says ``request`` holds the message the hook saw
    (a held call); else it is joined from ``req`` when the call ends. ``up`` and ``down`` are the
    stream's flow-control windows less the initial window each starts from (``limits.py``): the
    runtime's WINDOW_UPDATEs (and the relay's for held DATA) less the client's DATA; the client's
    WINDOW_UPDATEs less the runtime's DATA."""

    __slots__ = ("sid", "t0", "timeout", "held", "hold", "req", "resp", "resp_headers", "http_status",
                 "req_encoding", "resp_encoding", "request_known", "done", "up", "down")

    def __init__(self, sid: int, info: tuple, limits, start: float, t0: float) -> None:
        method, timeout, encoding, unary_req, unary_resp, headers = info
        limit = limits.max_message_bytes
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
        self.timeout = timeout
        self.held = held = method in limits.held_methods
        if held:
            self.hold: bytearray | None = bytearray()
            self.metadata = tuple(headers)
        else:
            self.hold = None
            self.metadata = ()
        if unary_req:
            self.req = Messages(1 << 30, limit, limit)
        else:
            self.req = Messages(limits.stream_record_max_messages, limits.stream_record_max_bytes, limit)
        if unary_resp:
            self.resp = Messages(1 << 30, limit, limit)
        else:
            self.resp = Messages(limits.stream_record_max_messages, limits.stream_record_max_bytes, limit)
        self.resp_headers = False
        self.http_status = b""
        self.req_encoding = encoding
        self.resp_encoding = b""
        self.request_known = False  # set for held calls (the message the hook saw)
        self.done = False
        self.up = 0
        self.down = 0

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
        """A call the client reset: its deadline, or the client cancelled (as CriProxy)."""
        if self.timeout is None:
            return "CANCELLED"
        remaining = self.timeout - (now - self.t0)
        if remaining <= 0.011 * self.timeout + 0.02:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"
