"""A fake NRI runtime: the runtime's side of NRI (containerd/nri's adaptation), for tests.

It listens on a unix socket in a fresh 0700 directory and, for each plugin that connects, does
what containerd does: waits ``registration_timeout`` for RegisterPlugin on mux connection 2
(checking the index is two digits and the name's characters), sends Configure on connection 1
(before it answers RegisterPlugin, as a Go runtime may), refuses an event mask with bits its
NRI version does not know, then Synchronize (in ``sync_chunk``-sized pieces with ``more`` if
set, refusing a plugin that answers a piece with ``more`` false or with updates), all under
``request_timeout``. After that the test drives events (``PluginConn.call``). A plugin that
times out, answers out of protocol or sends a mux frame above 4096 bytes (what a Go reader's
4096-byte bufio cannot take) is closed and dropped, and the runtime carries on.

The framing here is its own (struct and the generated ttrpc envelope), not the plugin's code,
and writes are cut the way Go's are: a message up to 4096 bytes in one mux frame, a larger one
as a 4096-byte frame (bufio's buffer) and then the rest in one frame.
"""
from __future__ import annotations

import asyncio
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field

from shim.nri import api_pb2 as pb
from shim.nri import ttrpc_pb2

MUX = struct.Struct(">II")
TTRPC = struct.Struct(">IIBB")
GO_BUFIO = 4096
MUX_MAX = 10 + (4 << 20)
PLUGIN_SVC, RUNTIME_SVC = "nri.pkg.api.v1alpha1.Plugin", "nri.pkg.api.v1alpha1.Runtime"


class PluginClosed(Exception):
    """The plugin was closed by the runtime (or went away); ``reason`` says why."""


class CallFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"status {code}: {message}")
        self.code, self.message = code, message


@dataclass
class PluginConn:
    runtime: "FakeNriRuntime"
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    name: str = ""
    idx: str = ""
    events: int = 0
    sync_requests: list = field(default_factory=list)  # SynchronizeRequest pieces sent
    sync_replies: list = field(default_factory=list)  # SynchronizeResponse of each piece
    closed_reason: str = ""
    _next: int = 1
    _waiting: dict = field(default_factory=dict)
    _registered: asyncio.Future | None = None
    register_sid: int = 0

    @property
    def closed(self) -> bool:
        return bool(self.closed_reason)

    def send(self, conn_id: int, stream_id: int, msg_type: int, data: bytes) -> None:
        message = TTRPC.pack(len(data), stream_id, msg_type, 0) + data
        cuts = [message] if len(message) <= GO_BUFIO else [message[:GO_BUFIO], message[GO_BUFIO:]]
        for cut in cuts:
            for i in range(0, len(cut), MUX_MAX):
                piece = cut[i:i + MUX_MAX]
                self.writer.write(MUX.pack(conn_id, len(piece)) + piece)

    async def call(self, method: str, request, response_type, timeout: float | None = None,
                   service: str = PLUGIN_SVC):
        """One Plugin call as the runtime makes it; a timeout closes the plugin (containerd does)."""
        if self.closed:
            raise PluginClosed(self.closed_reason)
        timeout = self.runtime.request_timeout if timeout is None else timeout
        sid, self._next = self._next, self._next + 2
        env = ttrpc_pb2.Request(service=service, method=method, payload=request.SerializeToString(),
                                timeout_nano=int(timeout * 1e9))
        env.metadata.add(key="traceparent", value="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        fut = asyncio.get_running_loop().create_future()
        self._waiting[sid] = fut
        self.send(1, sid, 1, env.SerializeToString())
        try:
            resp = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.close(f"failed to handle {method} request: context deadline exceeded")
            raise
        if resp.status.code:
            raise CallFailed(resp.status.code, resp.status.message)
        return response_type.FromString(resp.payload)

    def subscribed(self, event: int) -> bool:
        return bool(self.events & (1 << (event - 1)))

    async def create_container(self, pod: pb.PodSandbox, container: pb.Container) -> pb.CreateContainerResponse:
        """CreateContainer as the runtime relays it; a plugin not subscribed to it is skipped."""
        if not self.subscribed(pb.CREATE_CONTAINER):
            return pb.CreateContainerResponse()
        return await self.call("CreateContainer", pb.CreateContainerRequest(pod=pod, container=container),
                               pb.CreateContainerResponse)

    def close(self, reason: str) -> None:
        if not self.closed_reason:
            self.closed_reason = reason
            self.writer.close()
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(PluginClosed(reason))
            if self._registered and not self._registered.done():
                self._registered.set_exception(PluginClosed(reason))
            if self in self.runtime.plugins:
                self.runtime.plugins.remove(self)

    async def read_loop(self) -> None:
        streams = {1: bytearray(), 2: bytearray()}
        try:
            while True:
                head = await self.reader.readexactly(MUX.size)
                conn_id, length = MUX.unpack(head)
                if length > GO_BUFIO:
                    self.runtime.oversized_frames += 1
                    raise PluginClosed(f"failed to discard after receiving oversized message: "
                                       f"mux frame of {length} bytes")
                payload = await self.reader.readexactly(length)
                if conn_id not in streams:
                    continue
                buf = streams[conn_id]
                buf += payload
                while len(buf) >= TTRPC.size:
                    n, sid, mtype, _flags = TTRPC.unpack_from(buf)
                    if len(buf) < TTRPC.size + n:
                        break
                    data = bytes(buf[TTRPC.size:TTRPC.size + n])
                    del buf[:TTRPC.size + n]
                    self._message(conn_id, sid, mtype, data)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.close("ttrpc: closed")
        except PluginClosed as e:
            self.close(str(e))

    def _message(self, conn_id: int, sid: int, mtype: int, data: bytes) -> None:
        if conn_id == 1 and mtype == 2:
            fut = self._waiting.pop(sid, None)
            if fut and not fut.done():
                fut.set_result(ttrpc_pb2.Response.FromString(data))
        elif conn_id == 2 and mtype == 1:
            self._runtime_call(sid, ttrpc_pb2.Request.FromString(data))

    def _runtime_call(self, sid: int, req: ttrpc_pb2.Request) -> None:
        if req.service != RUNTIME_SVC or req.method != "RegisterPlugin":
            self._reply(sid, ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=12, message="unimplemented")))
            return
        reg = pb.RegisterPluginRequest.FromString(req.payload)
        error = ""
        if not re.fullmatch(r"[0-9]{2}", reg.plugin_idx):
            error = f"invalid plugin index {reg.plugin_idx!r}, must be 2 digits"
        elif not re.fullmatch(r"[a-zA-Z0-9_.+-]+", reg.plugin_name):
            error = f"invalid plugin name {reg.plugin_name!r}"
        if error:
            self._reply(sid, ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=2, message=error)))
            self.close(error)
            return
        self.name, self.idx = reg.plugin_name, reg.plugin_idx
        self.runtime.registrations.append((reg.plugin_idx, reg.plugin_name))
        self.register_sid = sid  # answered by the handshake, after it has sent Configure
        self._registered.set_result(True)

    def _reply(self, sid: int, resp: ttrpc_pb2.Response) -> None:
        if not self.closed:
            self.send(2, sid, 2, resp.SerializeToString())


class FakeNriRuntime:
    """``async with FakeNriRuntime(path, ...) as rt``: ``rt.plugins`` are the live ones,
    ``await rt.next_plugin()`` the next one through Synchronize."""

    def __init__(self, path, *, runtime_name: str = "containerd", runtime_version: str = "2.1.9",
                 nri_version: tuple = (0, 8, 0), send_timeouts: bool = True, registration_timeout: float = 5.0,
                 request_timeout: float = 2.0, pods=(), containers=(), sync_chunk: int | None = None):
        self.path = os.fspath(path)
        self.runtime_name, self.runtime_version = runtime_name, runtime_version
        self.nri_version = nri_version
        self.send_timeouts = send_timeouts
        self.registration_timeout, self.request_timeout = registration_timeout, request_timeout
        self.pods, self.containers = list(pods), list(containers)
        self.sync_chunk = sync_chunk
        self.plugins: list[PluginConn] = []
        self.registrations: list[tuple[str, str]] = []  # (idx, name) of every RegisterPlugin accepted
        self.refused: list[str] = []  # why plugins were closed during their handshake
        self.oversized_frames = 0
        self._ready: asyncio.Queue = asyncio.Queue()
        self._server = None
        self._tasks: set = set()

    @property
    def valid_events(self) -> int:
        return (1 << ((15 if self.nri_version >= (0, 10, 0) else 12) - 1)) - 1

    async def __aenter__(self):
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.remove(self.path)
        self._server = await asyncio.start_unix_server(self._accept, self.path)
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    async def stop(self) -> None:
        """The runtime goes away: listener and every plugin connection closed (no Shutdown call,
        as seen on a real containerd)."""
        if self._server:
            self._server.close()
            self._server = None
        for plugin in list(self.plugins):
            plugin.close("runtime stopped")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def next_plugin(self, timeout: float = 10.0) -> PluginConn:
        return await asyncio.wait_for(self._ready.get(), timeout)

    async def adopt(self, sock) -> None:
        """Serve a plugin on one end of a socketpair, as for a plugin the runtime starts itself
        (the other end goes to it as fd 3, NRI_PLUGIN_SOCKET=3)."""
        self._accept(*await asyncio.open_connection(sock=sock))

    def _accept(self, reader, writer) -> None:
        task = asyncio.ensure_future(self._handshake(PluginConn(self, reader, writer)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handshake(self, p: PluginConn) -> None:
        p._registered = asyncio.get_running_loop().create_future()
        reading = asyncio.ensure_future(p.read_loop())
        self._tasks.add(reading)
        reading.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait_for(p._registered, self.registration_timeout)
            configure = pb.ConfigureRequest(runtime_name=self.runtime_name, runtime_version=self.runtime_version)
            if self.send_timeouts:
                configure.registration_timeout = int(self.registration_timeout * 1000)
                configure.request_timeout = int(self.request_timeout * 1000)
            if self.nri_version >= (0, 12, 0):
                configure.NRI_version = "v" + ".".join(map(str, self.nri_version))
            configuring = asyncio.ensure_future(p.call("Configure", configure, pb.ConfigureResponse))
            await asyncio.sleep(0)  # Configure is on the wire before the answer to RegisterPlugin
            p._reply(p.register_sid, ttrpc_pb2.Response(status=ttrpc_pb2.Status()))
            reply = await configuring
            events = reply.events or self.valid_events
            if events & ~self.valid_events:
                raise PluginClosed(f"invalid plugin events: {events & ~self.valid_events:#x}")
            p.events = events
            await asyncio.wait_for(self._synchronize(p), self.request_timeout)
        except (PluginClosed, CallFailed, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            self.refused.append(reason)
            p.close(reason)
            return
        self.plugins.append(p)
        await self._ready.put(p)

    async def _synchronize(self, p: PluginConn) -> None:
        pods, ctrs = self.pods, self.containers
        chunk = self.sync_chunk or max(len(pods) + len(ctrs), 1)
        pieces = []
        while pods or ctrs:
            take_pods = pods[:chunk]
            take_ctrs = ctrs[:chunk - len(take_pods)]
            pods, ctrs = pods[len(take_pods):], ctrs[len(take_ctrs):]
            pieces.append(pb.SynchronizeRequest(pods=take_pods, containers=take_ctrs, more=bool(pods or ctrs)))
        for req in pieces or [pb.SynchronizeRequest()]:
            p.sync_requests.append(req)
            reply = await p.call("Synchronize", req, pb.SynchronizeResponse)
            p.sync_replies.append(reply)
            if req.more and (not reply.more or len(reply.update)):
                raise PluginClosed("plugin does not handle split sync requests")


def socket_dir() -> str:
    """A fresh private directory for a test's NRI socket (unix paths are short)."""
    return tempfile.mkdtemp(prefix="nri-")
