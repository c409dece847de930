"""The relay's accept loop on its listening socket, with what happens when the process has no
file descriptor left.

The event loop's own server (``create_unix_server``) cannot be told what to do when ``accept``
fails with EMFILE / ENFILE: asyncio logs an error and stops accepting for a second (the
connection waits in the backlog), libuv (uvloop) accepts and closes it unseen. Here the
connection that cannot be taken is taken anyway with a descriptor kept in reserve for that
(``/dev/null``, opened at start), answered with the server preface and a GOAWAY that says why,
closed, and reported to the owner (``shed``) to be counted and logged; the connections already
open are not touched. Every accepted socket is handed to the owner's ``serve``.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from typing import Callable

log = logging.getLogger("shim.transport.relay")

ACCEPT_BATCH = 128  # accepts per readiness callback (the backlog bind_private listens with)
RETRY_DELAY = 1.0  # seconds without accepting after an error that a retry cannot fix at once
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


class Listener:
    """Accept connections on ``sock`` (listening, non-blocking) on the running loop.

    ``serve(conn)`` gets each accepted socket (non-blocking); ``shed(error)`` is told of each
    connection answered ``refusal(error)`` and closed for want of a descriptor."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket], None],
                 shed: Callable[[OSError], bytes]) -> None:
        self.sock = sock
        self._serve = serve
        self._shed = shed
        self._loop = asyncio.get_running_loop()
        self._reserve: int | None = None
        self._retry: asyncio.TimerHandle | None = None
        self.closed = False

    def start(self) -> None:
        self._reserve = _open_reserve()
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in OUT_OF_DESCRIPTORS and self._shed_one(e):
                    continue
                log.warning("accept on %s failed: %s; not accepting for %.0f s", self.sock.getsockname(), e,
                            RETRY_DELAY)
                self._pause()
                return
            try:
                conn.setblocking(False)
                self._serve(conn)
            except Exception:  # noqa: BLE001 - one connection's failure is not the listener's
                log.exception("cannot serve an accepted connection")
                conn.close()

    def _shed_one(self, error: OSError) -> bool:
        """Take the waiting connection with the reserve descriptor, answer and close it. False
        when there is no reserve (it could not be opened again yet)."""
        if self._reserve is None:
            self._reserve = _open_reserve()
            if self._reserve is None:
                return False
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, _ = self.sock.accept()
        except OSError:  # the client gave up meanwhile, or the descriptor went elsewhere
            conn = None
        if conn is not None:
            try:
                conn.setblocking(False)
                conn.send(self._shed(error))
            except OSError:
                pass
            finally:
                conn.close()
        self._reserve = _open_reserve()
        return True

    def _pause(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self._retry = self._loop.call_later(RETRY_DELAY, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self.closed:
            self._loop.add_reader(self.sock.fileno(), self._accept)


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
