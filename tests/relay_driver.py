"""The relay's sans-I/O ``Connection`` driven with bytes, as ``aio.py`` drives it but without
sockets: ``Driver`` feeds it what each peer sends, keeps what it returns -- the bytes for each
side (``Buffer``) and every event, in order -- and answers what the connection asks for in the
same way the asyncio layer does (a held request's rewrite handed back with ``send_request``, a
paused connection resumed). The hooks, when given, get what the asyncio layer gives them."""
from __future__ import annotations

import time

from shim.cri.methods import CRI_METHODS
from shim.transport.hooks import STREAM_RECORD_MAX_BYTES, STREAM_RECORD_MAX_MESSAGES, unary_shapes
from shim.transport.hooks import guarded_finished, guarded_not_rewritten, guarded_rewrite
from shim.transport.relay import (
    HOLD_MAX_BYTES,
    HOLD_TOTAL_BYTES,
    CallEnded,
    Closed,
    Connection,
    H2Limits,
    HeldRequest,
    HoldBudget,
    LimitHit,
    NotRewritten,
    StreamSettings,
)
from shim.transport.relay.stream import request_reader


class Buffer:
    """What the connection wrote to one side: ``out`` (``take()`` returns and forgets it);
    ``writes`` counts the writes."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0

    def write_pieces(self, pieces) -> None:
        for p in pieces:
            self.out += p
        self.writes += 1

    def take(self) -> bytes:
        out = bytes(self.out)
        self.out.clear()
        return out


def _failed(*args) -> None:
    pass


class Driver:
    """One ``Connection`` and what it returned: ``client`` and ``upstream`` (``Buffer``), ``events``
    (every event), ``limit_hits`` (by limit), ``closed``; ``hooks`` (optional) get rewrite,
    finished and not_rewritten as from the asyncio layer."""

    def __init__(self, conn: Connection, hooks=None, budget: HoldBudget | None = None) -> None:
        self.conn = conn
        self.hooks = hooks
        self.budget = budget
        self.client = Buffer()
        self.upstream = Buffer()
        self.events: list = []
        self.limit_hits: dict[str, int] = {}
        self.closed = False

    # what the peers send
    def from_client(self, data: bytes) -> None:
        self.act(self.conn.receive_client(data))

    def from_server(self, data: bytes) -> None:
        self.act(self.conn.receive_server(data))

    def refuse(self, details: str) -> None:
        self.act(self.conn.refuse(details))

    def close(self, code: str, details: str) -> None:
        self.act(self.conn.close(code, details))

    def act(self, out) -> None:
        conn = self.conn
        while True:
            if out.to_upstream:
                self.upstream.write_pieces(out.to_upstream)
            if out.to_client:
                self.client.write_pieces(out.to_client)
            held = None
            for event in out.events:
                self.events.append(event)
                if type(event) is HeldRequest:
                    held = event.stream
                elif self.hooks is not None and type(event) is CallEnded:
                    guarded_finished(self.hooks, event.call, _failed)
                elif self.hooks is not None and type(event) is NotRewritten:
                    guarded_not_rewritten(self.hooks, event.method, f"transport: {event.why}", _failed)
                elif type(event) is LimitHit:
                    self.limit_hits[event.name] = self.limit_hits.get(event.name, 0) + 1
                elif type(event) is Closed:
                    self.closed = True
            if held is not None:
                payload = held.request if self.hooks is None else guarded_rewrite(self.hooks, held, _failed)
                out = conn.send_request(held, payload)
            elif out.paused:
                out = conn.resume()
            else:
                return

    def of(self, kind) -> list:
        """The events of type ``kind``, in order."""
        return [e for e in self.events if type(e) is kind]


def new_driver(hooks=None, *, held_methods=None, methods=CRI_METHODS, max_message_bytes: int = 128 * 1024 * 1024,
               hold_max_bytes: int = HOLD_MAX_BYTES, hold_total_bytes: int = HOLD_TOTAL_BYTES,
               limits: H2Limits | None = None, budget: HoldBudget | None = None, clock=time.perf_counter,
               connected: bool = True) -> Driver:
    """A Connection with the relay's settings (the hooks' held methods), driven; connected to
    the runtime unless ``connected`` is False."""
    if held_methods is None:
        held_methods = hooks.held_methods if hooks is not None else frozenset()
    settings = StreamSettings(held_methods=frozenset(held_methods), request_info=request_reader(unary_shapes(methods)),
                              max_message_bytes=max_message_bytes, hold_max_bytes=hold_max_bytes,
                              stream_record_max_messages=STREAM_RECORD_MAX_MESSAGES,
                              stream_record_max_bytes=STREAM_RECORD_MAX_BYTES)
    budget = budget if budget is not None else HoldBudget(hold_total_bytes)
    conn = Connection(settings, limits if limits is not None else H2Limits(), budget, clock=clock)
    if connected:
        conn.connected()
    return Driver(conn, hooks, budget)
