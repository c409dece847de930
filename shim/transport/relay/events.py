"""What a relay ``Connection`` returns: the bytes to write each way (``Output``) and the events
that came with them, for the I/O layer (``aio.py``) to act on. Small typed records, no
behaviour: the connection never calls out, the I/O layer does what an event says.

An ``Output`` belongs to its connection and stays valid until the next call into it. Its
writes go out first, in order (``to_upstream`` to the runtime, ``to_client`` to the kubelet),
then its events are acted on, in order. Then, at most one of:

* the last event is ``HeldRequest``: the I/O layer answers with
  ``Connection.send_request(event.stream, payload)`` (the hook's rewrite, or the request as it
  came) before anything else is fed to the connection;
* ``paused``: the connection stopped so that these writes go out before it goes on (a chunk
  forwarded unchanged before it is observed, a large answer's leading DATA): the I/O layer
  calls ``Connection.resume()`` once they are written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Output:
    to_upstream: list = field(default_factory=list)  # bytes or memoryviews, in order
    to_client: list = field(default_factory=list)
    events: list = field(default_factory=list)
    paused: bool = False


@dataclass(slots=True)
class HeldRequest:
    """A held request is complete: ``stream.request`` is its one message (uncompressed). The
    answer is ``Connection.send_request(stream, payload)``."""

    stream: Any  # stream.Stream, an RpcCall


@dataclass(slots=True)
class CallEnded:
    """A call ended: ``call`` is completed for ``CallHooks.finished`` (the writes that ended it
    are in the same Output, before this event)."""

    call: Any  # an RpcCall


@dataclass(slots=True)
class NotRewritten:
    """A held request goes upstream unchanged (fail-open): ``size`` bytes, and why."""

    method: str
    size: int
    why: str


@dataclass(slots=True)
class LimitHit:
    """A peer went past the HTTP/2 limit ``name`` (``limits.LIMIT_NAMES``)."""

    name: str
    detail: str


@dataclass(slots=True)
class TrimHeap:
    """A large call ended: freed heap memory is worth giving back."""


@dataclass(slots=True)
class Closed:
    """The connection is over (a peer broke the protocol or a limit, a refused connection
    answered its calls, or ``close`` was called): close both sockets."""


TRIM_HEAP = TrimHeap()
CLOSED = Closed()
