"""Room for a new connection at the relay's connection limits: which open connection goes.

The relay serves at most ``max_connections`` connections, and at most
``max_connections_per_peer`` from one peer process (its pid, read from the socket's
``SO_PEERCRED`` at accept). A client that opens connections and never closes them must not lock
every other client out, the kubelet first: at a limit, the newcomer is taken and an idle open
connection goes instead (GOAWAY, then closed: its client opens a new one when it has a call to
make). Only when no open connection is idle is the newcomer itself refused.

Idle: the connection is relaying or refusing (not still connecting upstream, with what it sent
so far unread), has no open stream, and is not closed. A connection with a call in flight is
never chosen. At ``max_connections`` the idle connections of the peer holding the most
connections go first (a leaking client's, not the kubelet's one or two), and among those the
one without a byte either way for the longest time; at a peer's own limit, that peer's idle
connection quiet longest.
"""
from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Iterable, Protocol

from shim.transport.wire.h2 import GOAWAY, SETTINGS, frame

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
ENHANCE_YOUR_CALM = 0xB


class Candidate(Protocol):
    peer: int | None  # the client's pid, None when unknown
    active: float  # loop time of the last byte either way

    def idle(self) -> bool: ...


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected unix socket, None when the kernel
    does not say (not in this pid namespace: 0)."""
    try:
        pid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
    except (OSError, struct.error):
        return None
    return pid if pid > 0 else None


def peer_name(pid: int | None) -> str:
    """``pid 1234 (critest)`` for the log, as far as /proc tells."""
    if pid is None:
        return "an unknown process"
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f"pid {pid} ({f.read(64).strip()})"
    except OSError:
        return f"pid {pid}"


def idlest(connections: Iterable[Candidate], peers: dict[int, int], peer: int | None = None) -> Candidate | None:
    """The connection to close for a newcomer: with ``peer``, that peer's idle connection quiet
    longest; without, an idle connection of the peer holding the most (``peers``: connections
    by pid), quiet longest among them. None when no connection (of the peer) is idle."""
    best, best_key = None, None
    for c in connections:
        if peer is not None and c.peer != peer:
            continue
        if not c.idle():
            continue
        held = peers.get(c.peer, 1) if c.peer is not None else 1
        key = (-held, c.active)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


def shed_frames(why: str) -> bytes:
    """What a connection the relay will not serve gets before it is closed: the server preface
    (an empty SETTINGS) and GOAWAY ENHANCE_YOUR_CALM, last stream 0 (no stream was processed, so
    a client may retry every one), with ``why`` as its debug data."""
    return frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, bytes(4) + ENHANCE_YOUR_CALM.to_bytes(4, "big")
                                         + why.encode()[:256])


def shed(sock: socket.socket, frames: bytes) -> None:
    """Send a new connection ``frames`` and close it."""
    try:
        sock.send(frames)  # a new socket's buffer takes these few bytes at once
    except OSError:
        pass
    finally:
        sock.close()


def make_room(relay: Any, sock: socket.socket, peer: int | None) -> bool:
    """A new connection (``sock``) at the relay's ``max_connections`` (``peer`` None) or at its
    peer's ``max_connections_per_peer``: close the idle connection ``idlest`` picks and say True;
    with none idle, refuse the new one (GOAWAY, closed) and say False. Counted in the relay's
    shed counters and logged (throttled)."""
    victim = idlest(relay.connections, relay.peers, peer)
    if peer is None:
        limit = f"{len(relay.connections) + relay.pending} connections open, the limit is {relay.max_connections}"
    else:
        limit = (f"{relay.peers.get(peer, 0)} connections open from {peer_name(peer)}, the limit per process is "
                 f"{relay.max_connections_per_peer}")
    if victim is None:
        if peer is None:
            relay.shed_limit += 1
        else:
            relay.shed_peer_limit += 1
        why = f"memqos-shim: {limit}, none of them idle"
        relay.over_limit("a new connection", why)
        shed(sock, shed_frames(why))
        return False
    if peer is None:
        relay.shed_idle += 1
    else:
        relay.shed_peer_idle += 1
    held = relay.peers.get(victim.peer, 0) if victim.peer is not None else 1
    quiet = asyncio.get_running_loop().time() - victim.active
    relay.made_room("a new connection", f"{limit}; closed an idle connection of {peer_name(victim.peer)} (which "
                                        f"holds {held}), quiet for {quiet:.0f} s")
    victim.shed(f"memqos-shim: {limit}; this connection was idle longest")
    return True
