"""ttrpc client and server over one multiplexed stream socket (NRI's layout), on asyncio.

One socket carries two ttrpc connections: on ``serve_conn`` the peer calls us and ``handler``
answers; on ``client_conn`` we call the peer (``call``). The read loop serves requests while
calls are in flight, so a peer may call us before it answers our first call. What requests
mean is the handler's business: this module knows frames, not services.

``handler(request) -> Response`` is a plain function run on the loop, one request at a time in
arrival order, each reply written as soon as it is made; ``replied(request, received, decided,
written)`` (optional) is called after each reply is handed to the socket, with the
``time.monotonic()`` at which the request's bytes were read, the handler returned and the reply
was written; a ``TtrpcStatus`` it raises becomes that status, any other exception UNKNOWN
(as a Go ttrpc service's error does). Everything written for one message goes out in a single
``write`` (frames of two messages never interleave on a connection), cut in mux frames of at
most 4096 payload bytes. Requests served may be allowed above ttrpc's 4 MiB (``max_request``:
runtimes on ttrpc <= 1.2.5 send a large message whole); what is sent stays within 4 MiB.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Callable

from shim.transport.wire import mux, ttrpc

log = logging.getLogger("shim.transport.ttrpc")
READ_CHUNK = 1 << 16


class TtrpcStatus(Exception):
    """A non-OK ttrpc status: raised by a handler to answer with it, raised by ``call`` when the
    peer answered with it."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(f"ttrpc status {code}: {message}")
        self.code = code
        self.message = message


async def open_socket(path: str | None = None, fd: int | None = None):
    """(reader, writer) of a unix stream socket: the inherited descriptor ``fd`` (a runtime's
    socketpair end), or a connection to ``path``."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.detach()
            raise OSError(f"descriptor {fd} is not a unix stream socket")
        return await asyncio.open_connection(sock=sock)
    return await asyncio.open_unix_connection(os.fspath(path))


class TtrpcMux:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, serve_conn: int,
                 client_conn: int, handler: Callable[[ttrpc.Request], ttrpc.Response],
                 max_frame: int = mux.SEND_FRAME, max_incoming_frame: int = mux.MAX_FRAME,
                 max_request: int = ttrpc.MAX_DATA,
                 replied: Callable[[ttrpc.Request, float, float, float], None] | None = None):
        self._reader, self._writer = reader, writer
        self._replied = replied
        self.serve_conn, self.client_conn = serve_conn, client_conn
        self._handler = handler
        self._max_frame = max_frame
        self._demux = mux.MuxDecoder({serve_conn, client_conn}, max_incoming_frame)
        self._server = ttrpc.Connection(client=False, max_data=max_request)
        self._client = ttrpc.Connection(client=True)
        self._calls: dict[int, asyncio.Future] = {}
        self._closed = asyncio.Event()
        self.close_reason = ""

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def _flush(self, conn_id: int, conn: ttrpc.Connection) -> None:
        data = conn.data_to_send()
        if data and not self.closed:
            self._writer.write(mux.encode(conn_id, data, self._max_frame))

    async def call(self, service: str, method: str, payload: bytes, timeout: float) -> bytes:
        """The response payload of one unary call on ``client_conn``; ``TtrpcStatus`` for a non-OK
        answer, ``asyncio.TimeoutError`` after ``timeout`` s, ``ConnectionError`` when closed."""
        if self.closed:
            raise ConnectionError(f"ttrpc connection closed: {self.close_reason}")
        sid = self._client.send_request(ttrpc.Request(service, method, payload, int(timeout * 1e9)))
        fut = asyncio.get_running_loop().create_future()
        self._calls[sid] = fut
        self._flush(self.client_conn, self._client)
        try:
            await self._writer.drain()
            resp: ttrpc.Response = await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            self._calls.pop(sid, None)
            self._client.pending.discard(sid)
        if resp.code != ttrpc.OK:
            raise TtrpcStatus(resp.code, resp.message)
        return resp.payload

    async def run(self) -> None:
        """Read until the peer closes or the stream breaks; then fail the calls in flight."""
        reason = "closed by the peer"
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                received = time.monotonic()
                for conn_id, payload in self._demux.receive_data(data):
                    if conn_id == self.serve_conn:
                        self._served(self._server.receive_data(payload), received)
                    else:
                        self._answered(self._client.receive_data(payload))
        except mux.MuxError as e:
            reason = str(e)
            log.warning("closing the ttrpc connection: %s", e)
        except (ConnectionError, OSError) as e:
            reason = f"read failed: {e}"
        except Exception as e:  # noqa: BLE001 - a bug here closes this connection, not the process
            reason = f"internal error: {type(e).__name__}: {e}"
            log.exception("closing the ttrpc connection")
        finally:
            self.close(reason)

    def _served(self, events: list, received: float = 0.0) -> None:
        for event in events:
            if isinstance(event, ttrpc.RequestReceived):
                response = self._answer(event.request)
                decided = time.monotonic()
                self._server.send_response(event.stream_id, response)
                self._flush(self.serve_conn, self._server)
                if self._replied is not None:
                    try:
                        self._replied(event.request, received, decided, time.monotonic())
                    except Exception:  # noqa: BLE001 - the reply is out; a bug after it closes nothing
                        log.exception("ttrpc: after the reply to %s/%s", event.request.service, event.request.method)
            else:
                log.warning("ttrpc request on stream %d refused: %s", event.stream_id, event.reason)
        self._flush(self.serve_conn, self._server)

    def _answer(self, request: ttrpc.Request) -> ttrpc.Response:
        try:
            return self._handler(request)
        except TtrpcStatus as e:
            return ttrpc.Response(code=e.code, message=e.message)
        except Exception as e:  # noqa: BLE001 - a handler bug answers this call, not the connection
            log.exception("ttrpc handler for %s/%s failed", request.service, request.method)
            return ttrpc.Response(code=ttrpc.UNKNOWN, message=str(e))

    def _answered(self, events: list) -> None:
        for event in events:
            fut = self._calls.get(event.stream_id)
            if fut is None or fut.done():
                continue
            if isinstance(event, ttrpc.ResponseReceived):
                fut.set_result(event.response)
            else:
                fut.set_result(ttrpc.Response(code=event.code, message=event.reason))

    def close(self, reason: str = "closed") -> None:
        """Close the socket and fail every call in flight with ``ConnectionError``."""
        if self.closed:
            return
        self.close_reason = reason
        self._closed.set()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"ttrpc connection closed: {reason}"))
        self._writer.close()
