"""The plugin's side of the NRI protocol: ``NriProtocol`` answers the runtime's calls on one
connection, ``NriPlugin`` connects, registers and reconnects.

Mux connection 1 carries the runtime's calls to the plugin (Configure, Synchronize, the
events), connection 2 the plugin's calls to the runtime (RegisterPlugin). The runtime may call
Configure before it answers RegisterPlugin, so connection 1 is served from the start.

Every answer is built so the pod never fails because of us: a handler that raises, or a
request that does not parse, gets an empty reply of the right type. Only methods we do not
implement get a status, Unimplemented (12): a v0.12 runtime then falls back to StateChange.
Split sync: each chunk with ``more`` is answered ``{more: true}`` with no update, and the
handler sees all chunks' pods and containers at once with the last one. Runtimes before
containerd 1.7.26 (ttrpc <= 1.2.5, no split sync) send a Synchronize above ttrpc's 4 MiB in one
message: the runtime's requests are accepted up to ``MAX_REQUEST`` (16 MiB, the most the old
mux carried in one frame) rather than refused, which would fail the sync at every reconnect.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from functools import partial

from shim.nri import api_pb2 as pb
from shim.nri.events import event_mask, nri_version
from shim.nri.handler import Handler
from shim.transport.ttrpc_mux import TtrpcMux, TtrpcStatus, open_socket
from shim.transport.wire import ttrpc

log = logging.getLogger("shim.nri")

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
PLUGIN_CONN, RUNTIME_CONN = 1, 2
DEFAULT_SOCKET = "/var/run/nri/nri.sock"
PLUGIN_NAME = "memqos"
MAX_REQUEST = 1 << 24
STOPPING = "plugin stopping"
_NAME = re.compile(r"^[a-zA-Z0-9_.+-]+$")

# dedicated lifecycle RPCs (NRI v0.12; StopContainer since v0.2): (request type, response type, event)
LIFECYCLE = {
    "RunPodSandbox": (pb.RunPodSandboxRequest, pb.RunPodSandboxResponse, pb.RUN_POD_SANDBOX),
    "StopPodSandbox": (pb.StopPodSandboxRequest, pb.StopPodSandboxResponse, pb.STOP_POD_SANDBOX),
    "RemovePodSandbox": (pb.RemovePodSandboxRequest, pb.RemovePodSandboxResponse, pb.REMOVE_POD_SANDBOX),
    "PostUpdatePodSandbox": (pb.PostUpdatePodSandboxRequest, pb.PostUpdatePodSandboxResponse,
                             pb.POST_UPDATE_POD_SANDBOX),
    "PostCreateContainer": (pb.PostCreateContainerRequest, pb.PostCreateContainerResponse, pb.POST_CREATE_CONTAINER),
    "StartContainer": (pb.StartContainerRequest, pb.StartContainerResponse, pb.START_CONTAINER),
    "PostStartContainer": (pb.PostStartContainerRequest, pb.PostStartContainerResponse, pb.POST_START_CONTAINER),
    "PostUpdateContainer": (pb.PostUpdateContainerRequest, pb.PostUpdateContainerResponse, pb.POST_UPDATE_CONTAINER),
    "StopContainer": (pb.StopContainerRequest, pb.StopContainerResponse, pb.STOP_CONTAINER),
    "RemoveContainer": (pb.RemoveContainerRequest, pb.RemoveContainerResponse, pb.REMOVE_CONTAINER),
}


def check_identity(name: str, index: str) -> None:
    """The checks a runtime makes on RegisterPlugin (index: two digits; name: [a-zA-Z0-9_.+-])."""
    if not (len(index) == 2 and index.isdigit()):
        raise ValueError(f"NRI plugin index must be two digits, not {index!r}")
    if not _NAME.match(name):
        raise ValueError(f"NRI plugin name must match [a-zA-Z0-9_.+-]+, not {name!r}")


def register_request(name: str, index: str) -> bytes:
    return pb.RegisterPluginRequest(plugin_name=name, plugin_idx=index).SerializeToString()


@dataclass
class CallTimes:
    """One method's calls: seconds from the request's bytes read to the handler's return
    (``handler``), from there to the reply written (``write``), and the hand-over to the side
    threads after it (``after``); sums and maxima."""

    count: int = 0
    handler: float = 0.0
    handler_max: float = 0.0
    write: float = 0.0
    write_max: float = 0.0
    after: float = 0.0
    after_max: float = 0.0

    def add(self, handler: float, write: float, after: float) -> None:
        self.count += 1
        self.handler += handler
        self.write += write
        self.after += after
        self.handler_max = max(self.handler_max, handler)
        self.write_max = max(self.write_max, write)
        self.after_max = max(self.after_max, after)


@dataclass
class ProtocolStats:
    calls: int = 0
    handler_errors: int = 0
    undecodable: int = 0
    unimplemented: int = 0
    times: dict[str, CallTimes] = field(default_factory=dict)  # per implemented method (a fixed set)


class NriProtocol:
    """Answers one connection's runtime calls through ``handler``; ``serve`` is the ttrpc handler."""

    def __init__(self, handler: Handler, stats: ProtocolStats | None = None):
        self.handler = handler
        self.stats = stats or ProtocolStats()
        self.runtime: pb.ConfigureRequest | None = None
        self.version: tuple[int, int, int] | None = None
        self.events = 0  # the mask answered to Configure
        self.synchronized = False
        self.shut_down = False
        self._sync_pods: list = []
        self._sync_containers: list = []

    def serve(self, request: ttrpc.Request) -> ttrpc.Response:
        self.stats.calls += 1
        method = request.method
        if request.service != PLUGIN_SERVICE or not (method in self._METHODS or method in LIFECYCLE):
            self.stats.unimplemented += 1
            raise TtrpcStatus(ttrpc.UNIMPLEMENTED, f"{request.service}/{method} is not implemented by {PLUGIN_NAME}")
        self.handler.answering()
        if method in LIFECYCLE:
            req_type, resp_type, event = LIFECYCLE[method]
            answer = partial(NriProtocol._lifecycle, event=event, resp_type=resp_type)
        else:
            req_type, resp_type, answer = self._METHODS[method]
        try:
            message = req_type.FromString(request.payload)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            self.stats.undecodable += 1
            log.warning("NRI %s request does not parse (%s): answering with an empty reply", method, e)
            try:
                self.handler.undecodable(method, f"{e.__class__.__name__}: {e}")
            except Exception:  # noqa: BLE001 - the empty reply goes out whatever the handler does
                log.exception("NRI handler's undecodable() failed")
            return ttrpc.Response(resp_type().SerializeToString())
        try:
            reply = answer(self, message)
        except Exception:  # noqa: BLE001 - fail open: the runtime gets an empty reply
            self.stats.handler_errors += 1
            log.exception("NRI %s handler failed: answering with an empty reply", method)
            reply = self._fallback(method, resp_type, message)
        return ttrpc.Response(reply.SerializeToString(deterministic=True))

    def replied(self, request: ttrpc.Request, received: float, decided: float, written: float) -> None:
        """After the reply is written (TtrpcMux's ``replied``): the handler's hand-overs, then the
        call's times, per method, and one debug line (received, decided, replied, and what was
        left of the runtime's deadline when it sent the request)."""
        try:
            self.handler.replied()
        finally:
            done = time.monotonic()
            method = request.method
            if request.service == PLUGIN_SERVICE and (method in self._METHODS or method in LIFECYCLE):
                times = self.stats.times.get(method)
                if times is None:
                    times = self.stats.times[method] = CallTimes()
                times.add(decided - received, written - decided, done - written)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("NRI %s: handler %.1f ms after the read, reply written %.1f ms later, hand-over %.1f ms; "
                          "runtime deadline %.0f ms from its send", method, (decided - received) * 1e3,
                          (written - decided) * 1e3, (done - written) * 1e3, request.timeout_nano / 1e6)

    def _fallback(self, method, resp_type, message):
        if method == "Configure":  # still subscribe: being present is what the handler would want
            return pb.ConfigureResponse(events=self.events)
        if method == "Synchronize" and message.more:
            return pb.SynchronizeResponse(more=True)
        return resp_type()

    # -- the methods ------------------------------------------------------------------------
    def _configure(self, req: pb.ConfigureRequest) -> pb.ConfigureResponse:
        self.runtime = req
        self.version, source = nri_version(req.NRI_version, req.runtime_name, req.runtime_version)
        self.events = event_mask(self.handler.events, self.version) or event_mask({pb.CREATE_CONTAINER}, self.version)
        log.info("NRI runtime %s %s (NRI %s from %s): subscribing to events %#x", req.runtime_name,
                 req.runtime_version, ".".join(map(str, self.version)), source, self.events)
        self.handler.configure(req)
        return pb.ConfigureResponse(events=self.events)

    def _synchronize(self, req: pb.SynchronizeRequest) -> pb.SynchronizeResponse:
        self._sync_pods.extend(req.pods)
        self._sync_containers.extend(req.containers)
        if req.more:
            return pb.SynchronizeResponse(more=True)
        pods, containers = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        self.synchronized = True
        return pb.SynchronizeResponse(update=self.handler.synchronize(pods, containers))

    def _shutdown(self, _req: pb.Empty) -> pb.Empty:
        self.shut_down = True
        self.handler.shutdown()
        return pb.Empty()

    def _create_container(self, req: pb.CreateContainerRequest) -> pb.CreateContainerResponse:
        adjust = self.handler.create_container(req.pod, req.container)
        return pb.CreateContainerResponse(adjust=adjust) if adjust is not None else pb.CreateContainerResponse()

    def _update_container(self, req: pb.UpdateContainerRequest) -> pb.UpdateContainerResponse:
        return pb.UpdateContainerResponse(update=self.handler.update_container(req.pod, req.container,
                                                                               req.linux_resources))

    def _update_pod_sandbox(self, req: pb.UpdatePodSandboxRequest) -> pb.UpdatePodSandboxResponse:
        self.handler.update_pod_sandbox(req.pod, req.overhead_linux_resources, req.linux_resources)
        return pb.UpdatePodSandboxResponse()

    def _state_change(self, req: pb.StateChangeEvent) -> pb.Empty:
        self.handler.event(req.event, req.pod, req.container if req.HasField("container") else None)
        return pb.Empty()

    def _lifecycle(self, req, *, event: int, resp_type):
        has_container = "container" in req.DESCRIPTOR.fields_by_name and req.HasField("container")
        self.handler.event(event, req.pod, req.container if has_container else None)
        return resp_type()

    _METHODS = {
        "Configure": (pb.ConfigureRequest, pb.ConfigureResponse, _configure),
        "Synchronize": (pb.SynchronizeRequest, pb.SynchronizeResponse, _synchronize),
        "Shutdown": (pb.Empty, pb.Empty, _shutdown),
        "CreateContainer": (pb.CreateContainerRequest, pb.CreateContainerResponse, _create_container),
        "UpdateContainer": (pb.UpdateContainerRequest, pb.UpdateContainerResponse, _update_container),
        "UpdatePodSandbox": (pb.UpdatePodSandboxRequest, pb.UpdatePodSandboxResponse, _update_pod_sandbox),
        "StateChange": (pb.StateChangeEvent, pb.Empty, _state_change),
    }


@dataclass
class PluginStats:
    connects: int = 0  # connections opened
    registrations: int = 0  # RegisterPlugin answered OK
    failures: int = 0  # connections that failed before or during registration
    last_error: str = ""
    protocol: ProtocolStats = field(default_factory=ProtocolStats)
    loop_lag_max: float = 0.0  # seconds the event loop was held up at most (watch_loop)
    loop_stalls: int = 0  # times it was held up more than STALL seconds


STALL = 0.1  # seconds: a hold-up of the loop worth counting (a runtime call waits as long)


def other_threads() -> str:
    """Where each thread but this one is (name: function file:line of its innermost frame, and of
    the innermost one in the shim's own code when that is another): after a hold-up of the loop,
    the thread that held the interpreter is among them."""
    import sys
    import threading

    def at(f) -> str:
        return f"{f.f_code.co_name} {os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"

    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == here:
            continue
        ours = frame
        while ours is not None and f"{os.sep}shim{os.sep}" not in ours.f_code.co_filename:
            ours = ours.f_back
        out.append(f"{names.get(ident, ident)}: {at(frame)}" + (f" in {at(ours)}" if ours not in (None, frame) else ""))
    return "; ".join(sorted(out))


async def watch_loop(stats: PluginStats, interval: float = 0.1, say_every: float = 60.0) -> None:
    """Measure how late the event loop wakes up (a sleep of ``interval`` that takes longer): the
    time a runtime call's bytes may sit unread while something else holds the loop or the
    process gets no CPU. Counted in ``stats``; a hold-up above 0.5 s is logged, at most once per
    ``say_every`` seconds, and at debug level every hold-up counted, with where the other threads are."""
    loop = asyncio.get_running_loop()
    said = -say_every
    while True:
        t = loop.time()
        await asyncio.sleep(interval)
        now = loop.time()
        lag = now - t - interval
        if lag > STALL:
            stats.loop_stalls += 1
            stats.loop_lag_max = max(stats.loop_lag_max, lag)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("NRI: the event loop was held up %.3f s; the other threads now: %s", lag, other_threads())
            if lag > 0.5 and now - said >= say_every:
                said = now
                log.warning("NRI: the event loop was held up %.2f s (a runtime call waits as long; the runtime "
                            "drops a plugin whose answer takes over its request timeout, 2 s by default)", lag)


class NriPlugin:
    """An external NRI plugin: connect to ``socket_path`` (or the descriptor in
    ``NRI_PLUGIN_SOCKET`` when the runtime started us), register as ``name``/``index``, serve
    until the connection ends, reconnect with backoff. One connection, so one registration, at a
    time: the next connect starts only after the previous socket is closed."""

    def __init__(self, handler: Handler, *, index: str, name: str = PLUGIN_NAME, socket_path: str = DEFAULT_SOCKET,
                 fd: int | None = None, registration_timeout: float = 5.0, backoff: tuple = (1.0, 30.0),
                 env=os.environ):
        if fd is None and env.get("NRI_PLUGIN_SOCKET"):  # started by the runtime: its socketpair end
            fd = int(env["NRI_PLUGIN_SOCKET"])
            name = env.get("NRI_PLUGIN_NAME") or name
            index = env.get("NRI_PLUGIN_IDX") or index
        check_identity(name, index)
        self.handler, self.name, self.index = handler, name, index
        self.socket_path, self.fd = socket_path, fd
        self.registration_timeout = registration_timeout
        self.backoff = backoff
        self.stats = PluginStats()
        self.protocol: NriProtocol | None = None  # of the live connection
        self.mux: TtrpcMux | None = None
        self.registered = False  # the live connection's RegisterPlugin was answered OK
        self._running = False

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set (or, on an inherited descriptor, until it closes)."""
        if self._running:
            raise RuntimeError("NriPlugin.run is already running")
        self._running = True
        stop = stop or asyncio.Event()
        delay = self.backoff[0]
        try:
            while not stop.is_set():
                ok = await self._serve_stopping(stop)
                if self.fd is not None or stop.is_set():
                    return
                if ok:
                    delay = self.backoff[0]
                wait = delay * random.uniform(0.9, 1.1)
                delay = min(delay * 2, self.backoff[1])
                log.info("NRI: reconnecting in %.1fs", wait)
                try:
                    await asyncio.wait_for(stop.wait(), wait)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._running = False

    async def _serve_stopping(self, stop: asyncio.Event) -> bool:
        serve = asyncio.ensure_future(self.serve_once())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serve, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not serve.done():
            if self.mux:
                self.mux.close(STOPPING)
            await asyncio.gather(serve, return_exceptions=True)
            return False
        try:
            return serve.result()
        except Exception as e:  # noqa: BLE001 - a bug in one session must not end the plugin
            log.exception("NRI: session failed")
            self._failed(f"session failed: {type(e).__name__}: {e}")
            return False

    async def serve_once(self) -> bool:
        """One connection: connect, register, serve until it closes. True when it was
        registered and synchronized (a healthy session), for the backoff."""
        try:
            reader, writer = await open_socket(self.socket_path, self.fd)
        except OSError as e:
            self._failed(f"connect to {self.socket_path if self.fd is None else f'fd {self.fd}'}: {e}")
            return False
        self.stats.connects += 1
        protocol = NriProtocol(self.handler, self.stats.protocol)
        m = TtrpcMux(reader, writer, serve_conn=PLUGIN_CONN, client_conn=RUNTIME_CONN, handler=protocol.serve,
                     max_request=MAX_REQUEST, replied=protocol.replied)
        self.protocol, self.mux = protocol, m
        reading = asyncio.ensure_future(m.run())
        try:
            await m.call(RUNTIME_SERVICE, "RegisterPlugin", register_request(self.name, self.index),
                         self.registration_timeout)
            self.stats.registrations += 1
            self.registered = True
            log.info("NRI: registered as %s-%s", self.index, self.name)
            await m.wait_closed()
            (log.info if m.close_reason == STOPPING else log.warning)(
                "NRI: connection to the runtime closed: %s", m.close_reason)
        except (TtrpcStatus, ConnectionError, asyncio.TimeoutError) as e:
            self._failed(f"RegisterPlugin: {type(e).__name__}: {e}")
        finally:
            m.close("plugin closing")
            await reading
            await _closed(writer)
            self.protocol = self.mux = None
            self.registered = False
            try:
                self.handler.disconnected(m.close_reason)
            except Exception:  # noqa: BLE001
                log.exception("NRI handler's disconnected() failed")
        return protocol.synchronized

    def _failed(self, reason: str) -> None:
        self.stats.failures += 1
        self.stats.last_error = reason
        log.warning("NRI: %s", reason)


async def _closed(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
