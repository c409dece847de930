"""shim/transport/ttrpc_mux.py over a real socketpair, the peer written with struct and the
generated ttrpc envelope: answers come back in frames a Go reader takes, a handler's status and
its exceptions become statuses, calls fail cleanly on close and on a frame above the bound."""
from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from shim.nri import ttrpc_pb2
from shim.transport.ttrpc_mux import TtrpcMux, TtrpcStatus
from shim.transport.wire import ttrpc

MUX, TT = struct.Struct(">II"), struct.Struct(">IIBB")


def handler(req: ttrpc.Request) -> ttrpc.Response:
    if req.method == "Echo":
        return ttrpc.Response(req.payload * 3)
    if req.method == "Nope":
        raise TtrpcStatus(ttrpc.UNIMPLEMENTED, "no Nope here")
    raise ValueError("handler bug")


async def read_message(reader, conn_id):
    """One ttrpc message from the mux stream (asserting every frame is <= 4096 bytes)."""
    data = b""
    while len(data) < TT.size or len(data) < TT.size + TT.unpack_from(data)[0]:
        cid, n = MUX.unpack(await reader.readexactly(MUX.size))
        assert n <= 4096 and cid == conn_id
        data += await reader.readexactly(n)
    length, sid, mtype, _ = TT.unpack_from(data)
    return sid, mtype, data[TT.size:TT.size + length]


def request(conn_id, sid, method, payload=b""):
    body = ttrpc_pb2.Request(service="svc", method=method, payload=payload).SerializeToString()
    return MUX.pack(conn_id, TT.size + len(body)) + TT.pack(len(body), sid, 1, 0) + body


async def pair(**kw):
    a, b = socket.socketpair()
    r, w = await asyncio.open_connection(sock=a)
    peer_r, peer_w = await asyncio.open_connection(sock=b)
    m = TtrpcMux(r, w, serve_conn=1, client_conn=2, handler=handler, **kw)
    return m, asyncio.ensure_future(m.run()), peer_r, peer_w


def test_served_requests_and_their_statuses():
    async def main():
        m, task, pr, pw = await pair()
        pw.write(request(1, 1, "Echo", b"x" * 3000) + request(1, 3, "Nope") + request(1, 5, "Boom"))
        sid, mtype, body = await read_message(pr, 1)  # 9000 bytes of payload: three frames
        assert (sid, mtype, ttrpc_pb2.Response.FromString(body).payload) == (1, 2, b"x" * 9000)
        statuses = []
        for _ in range(2):
            sid, _, body = await read_message(pr, 1)
            st = ttrpc_pb2.Response.FromString(body).status
            statuses.append((sid, st.code, st.message))
        assert statuses == [(3, 12, "no Nope here"), (5, 2, "handler bug")]
        m.close()
        await task
    asyncio.run(asyncio.wait_for(main(), 30))


def test_calls_get_answers_statuses_and_fail_on_close():
    async def main():
        m, task, pr, pw = await pair()
        call = asyncio.ensure_future(m.call("svc", "M", b"ask", timeout=5))
        sid, mtype, body = await read_message(pr, 2)
        req = ttrpc_pb2.Request.FromString(body)
        assert (sid, mtype, req.method, req.payload, req.timeout_nano) == (1, 1, "M", b"ask", 5_000_000_000)
        ok = ttrpc_pb2.Response(status=ttrpc_pb2.Status(), payload=b"fine").SerializeToString()
        pw.write(MUX.pack(2, TT.size + len(ok)) + TT.pack(len(ok), 1, 2, 0) + ok)
        assert await call == b"fine"

        call = asyncio.ensure_future(m.call("svc", "M", b"", timeout=5))
        await read_message(pr, 2)
        bad = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=9, message="no")).SerializeToString()
        pw.write(MUX.pack(2, TT.size + len(bad)) + TT.pack(len(bad), 3, 2, 0) + bad)
        with pytest.raises(TtrpcStatus) as err:
            await call
        assert (err.value.code, err.value.message) == (9, "no")

        call = asyncio.ensure_future(m.call("svc", "M", b"", timeout=5))
        await read_message(pr, 2)
        pw.close()  # the peer goes away with a call in flight
        with pytest.raises(ConnectionError):
            await call
        await task
        assert m.closed and m.close_reason == "closed by the peer"
        with pytest.raises(ConnectionError):
            await m.call("svc", "M", b"", timeout=5)
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_frame_above_the_bound_closes_the_connection():
    async def main():
        m, task, pr, pw = await pair(max_incoming_frame=1024)  # a small bound, same code path
        pw.write(MUX.pack(1, 2048))
        await asyncio.wait_for(task, 10)
        assert m.closed and "2048 bytes for connection 1 is above the limit of 1024" in m.close_reason
    asyncio.run(asyncio.wait_for(main(), 30))
