"""The CRI transport: an HTTP/2 connection relay.

Each kubelet connection gets one upstream connection, and the bytes of both directions are
forwarded as they come, frame by frame: SETTINGS, PING, WINDOW_UPDATE, GOAWAY, stream ids and
the HPACK state stay the two peers' own, so there is no HTTP/2 stack and no gRPC call object in
between (grpcio's per-call cost, about half a millisecond here, is what this avoids). What the
relay does on top of forwarding:

* It reads every frame header both ways and decodes every header block (one HPACK decoder per
  direction, ``shim.transport.wire.hpack``) to learn each stream's ``:path`` and
  ``grpc-timeout``, and each answer's ``grpc-status`` / ``grpc-message``. A block that does not
  decode means the HPACK state is lost: the connection is closed (the kubelet reconnects).
* It reassembles the gRPC messages of both directions from DATA frames (a copy to the side,
  never delaying the forward) so that ``CallHooks.finished`` gets the whole ``RpcCall``:
  request, responses (server streams capped), code, details, ``forwarded``. ``finished`` runs
  right after the frame that ends the call was written to the kubelet, in the same event-loop
  callback: off the call's latency, yet before the relay reads anything more from any
  connection (so before the kubelet's next call).
* Bytes that need no change go out before the relay looks at them closely: a client chunk that
  holds no held, dropped or queued DATA is written upstream first and observed after; a large
  server chunk's leading DATA is written before it is copied for the observers, and a DATA
  frame that has not fully arrived is forwarded as far as it has.
* CreateContainer and UpdateContainerResources are held: their HEADERS go upstream at once
  (so the runtime's deadline starts when the kubelet's did), their DATA frames are kept until
  END_STREAM, ``CallHooks.rewrite`` runs on the message and the result is sent re-framed (16 KiB
  frames, the size every peer accepts) within the server's flow-control windows (see "Flow
  control"). Fail-open: a message above
  ``hold_max_bytes`` (or beyond the relay-wide budget ``hold_total_bytes``), a compressed one
  with an unknown encoding, more than one message, a hook that raises or returns no bytes:
  the kubelet's bytes go upstream unchanged.
* ``max_message_bytes`` is enforced like grpc does: a message declared larger (request or
  reply) ends the call with RESOURCE_EXHAUSTED for the kubelet and RST_STREAM upstream.
* When the runtime cannot be reached, the relay answers the connection's calls itself with
  UNAVAILABLE (a minimal HTTP/2 server side), then sends GOAWAY and closes it, so the kubelet's
  next call opens a new connection and tries the runtime again. A refused connection that gets
  no call is closed the same way after ``REFUSED_IDLE_CLOSE`` seconds: grpc-go (the kubelet)
  reconnects at once when a connection closes, so an idle refused one would otherwise still
  refuse its first call long after the runtime is back (grpc-core clients reconnect lazily).

Limits. What a connection may send is bounded (``limits.py``: header block size and
CONTINUATIONs, frame size, flow-control windows, resets per second, concurrent streams, the
preface and an opt-in idle timeout); past a limit the client gets GOAWAY with the RFC 9113 error
code and the connection is closed (a stream over the concurrency limit is refused alone, a
stream whose flow control a peer broke is reset alone), and ``RelayProxy.limit_hits`` counts it
by limit.

Layout: ``connection.py`` is the relay of one kubelet connection without I/O, a state machine
that takes bytes from either side and returns what to write each way and a short list of typed
events (``events.py``: ``Output``; a held request complete, a call ended, a fail-open, a limit
hit, heap worth trimming, the connection closed); it holds the client's side and the held
requests itself and is composed of ``stream.py`` (each ``Stream``: one call's state, held bytes,
windows and messages; the ``StreamTable``; the ``HoldBudget`` every connection is given),
``windows.py`` (the client-to-server windows), ``limits.py`` (what each peer sent that is not
complete yet, the HTTP/2 limits), ``server_side.py`` (the runtime's side) and ``refuse.py`` (the
UNAVAILABLE server side). ``aio.py`` is the asyncio layer (sockets, ``RelayProxy``: it acts on
the events and runs the hooks), ``listener.py`` its accept loop. A connection is taken only
with both its descriptors (the kubelet's side and the runtime's socket, made at accept); at
``max_connections`` or its process's ``max_connections_per_peer`` an idle open connection is
closed for it (``shedding.py``: GOAWAY NO_ERROR, never one with a call in flight, a leaking
client's before the kubelet's); otherwise it gets the server preface and GOAWAY
ENHANCE_YOUR_CALM saying why, is closed, and the open connections go on being served. Each is
counted (``shed_idle``, ``shed_peer_idle``, ``shed_limit``, ``shed_peer_limit``,
``shed_descriptors``).
Frames and gRPC messages are read and built by ``shim.transport.wire``.

Flow control. The relay only touches the client-to-server direction's windows, and only because
of held streams (``windows.py``). It tracks the server's connection window
(``upstream_window``: what the relay may still send) and the client's view of it
(``client_window``). Bytes the client sends on a held stream never reach the server, so the
relay gives them back to the client (connection and stream WINDOW_UPDATE) while holding, else a
request larger than the window would stall until its deadline. The rewritten message (N' bytes
instead of N) is then sent only within the server's windows (the stream's is tracked for held
streams), and any client DATA that the server's window cannot take yet is queued. A raised
SETTINGS_INITIAL_WINDOW_SIZE from the server counts for those stream windows only once the
client's ACK of it has gone upstream (grpc-core resets a stream whose DATA exceeds the
acknowledged window); a lowered one counts at once. Server WINDOW_UPDATEs on the connection are
passed on only as far as the server's window exceeds what the client may already send plus what
is queued (``room``), so the client's view never drifts above the server's; when ``room`` grows
(held, dropped or cancelled bytes), the relay grants it to the client itself. The other
direction's connection window is only counted (``Windows.to_client``), to refuse a client
WINDOW_UPDATE that takes it past 2^31-1. Each open stream's windows are counted both ways, for
the limits only (``Stream.up``, ``Stream.down``; ``limits.py``): client DATA beyond a stream's
window and a WINDOW_UPDATE taking one past 2^31-1 reset that stream. Everything else is
forwarded verbatim: what the relay does not understand, it does not touch.
"""
from __future__ import annotations

from shim.transport.relay.aio import (
    HOLD_MAX_BYTES,
    HOLD_TOTAL_BYTES,
    READ_PAUSE_BYTES,
    REFUSED_IDLE_CLOSE,
    UPSTREAM_CONNECT_TIMEOUT,
    RelayProxy,
    trim_heap,
)
from shim.transport.relay.connection import Connection
from shim.transport.relay.events import CallEnded, Closed, HeldRequest, LimitHit, NotRewritten, Output, TrimHeap
from shim.transport.relay.limits import LIMIT_NAMES, H2Limits
from shim.transport.relay.stream import HoldBudget, Stream, StreamSettings
from shim.transport.wire.h2 import PREFACE

__all__ = ["HOLD_MAX_BYTES", "HOLD_TOTAL_BYTES", "LIMIT_NAMES", "H2Limits", "PREFACE", "READ_PAUSE_BYTES", "REFUSED_IDLE_CLOSE",
           "UPSTREAM_CONNECT_TIMEOUT", "CallEnded", "Closed", "Connection", "HeldRequest", "HoldBudget", "LimitHit",
           "NotRewritten", "Output", "RelayProxy", "Stream", "StreamSettings", "TrimHeap", "trim_heap"]
