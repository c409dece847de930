"""A CRI runtime driven by a trace: every call is answered with the recorded answer.

``TraceRuntime`` is a gRPC server on a unix socket (``shim.tools.grpc_server``: no grpcio) that
accepts any method path (the 43 runtime.v1 methods, anything else -- runtime.v1alpha2, a method
that does not exist -- with every message of its request taken together) and answers each call
with the ``responses``, ``code`` and ``details`` of one recorded call. Container and sandbox
ids, statuses and errors are therefore exactly the recorded ones.

Which recorded call answers a received call (each recorded call answers at most once):

1. ``memqos-replay-seq`` request metadata (the replayer sends it; the proxy passes request
   metadata through): the recorded call with that seq, when it has the same method.
2. Otherwise the earliest unused recorded call of the same method whose upstream bytes are
   exactly the received ones (``forwarded`` when the recorder rewrote the request, else
   ``request``). Identical requests (``ListContainers`` with the same filter, every second)
   are answered in recorded start order, which is the order the replayer sends them in.
3. Otherwise, for the methods the shim rewrites, the earliest unused call whose request is
   the same *apart from what the shim owns*: both sides are parsed, the ``unified`` map and
   the shim's ``memqos.io/request`` annotation are cleared, and the deterministic
   serializations compared. This is how a kubelet trace (no ``forwarded``: the recorded
   request is what the kubelet sent) matches the rewritten bytes a replaying shim forwards.
4. Otherwise the earliest unused call of the method (order within the method), counted as a
   request mismatch.

Steps 2-4 make the runtime usable without the replayer (any client sending the trace's
requests in order). In every case the received bytes are checked against the matched call:
``mismatches`` lists the calls whose request differs beyond the shim-owned fields, which for a
replay through the proxy means the transport altered a request. When nothing is left to
answer a method with, the call fails with FAILED_PRECONDITION and is listed in ``misses``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from shim.cri.methods import CREATE_CONTAINER, CRI_METHODS_BY_PATH, UPDATE_CONTAINER_RESOURCES
from shim.evidence.trace import TraceCall
from shim.tools.grpc_server import GrpcServer
from shim.transport.wire.grpc import STATUS_NUMBER

log = logging.getLogger(__name__)

REPLAY_SEQ_KEY = "memqos-replay-seq"
SHIM_ANNOTATION = "memqos.io/request"  # shim.container.rewriter.CONTAINER_ANNOTATION
MAX_MESSAGE = 128 * 1024 * 1024


def _normalize_create(data: bytes) -> bytes | None:
    from shim.cri import pb

    msg = pb.CreateContainerRequest.FromString(data)
    if msg.config.HasField("linux") and msg.config.linux.HasField("resources"):
        msg.config.linux.resources.unified.clear()
    if SHIM_ANNOTATION in msg.config.annotations:
        del msg.config.annotations[SHIM_ANNOTATION]
    return msg.SerializeToString(deterministic=True)


def _normalize_update(data: bytes) -> bytes | None:
    from shim.cri import pb

    msg = pb.UpdateContainerResourcesRequest.FromString(data)
    if msg.HasField("linux"):
        msg.linux.unified.clear()
    return msg.SerializeToString(deterministic=True)


_NORMALIZERS = {CREATE_CONTAINER: _normalize_create, UPDATE_CONTAINER_RESOURCES: _normalize_update}


def normalized_request(method: str, data: bytes) -> bytes | None:
    """The request without the fields the shim may change (rewritten methods only);
    None for other methods or bytes that do not parse."""
    fn = _NORMALIZERS.get(method)
    if fn is None:
        return None
    try:
        return fn(data)
    except Exception:
        return None


@dataclass
class Answered:
    """One call the runtime answered."""

    method: str
    request: bytes  # as received (the proxy's forwarded bytes)
    seq: int | None  # the recorded call that answered, None for a miss
    matched_by: str  # "seq", "bytes", "normalized", "order", "miss"
    request_matches: bool  # received == recorded upstream bytes, or equal apart from shim-owned fields


@dataclass
class _Entry:
    call: TraceCall
    used: bool = False
    _normalized: bytes | None = None
    _normalized_done: bool = False

    def normalized(self) -> bytes | None:
        if not self._normalized_done:
            self._normalized = normalized_request(self.call.method, self.call.upstream_request)
            self._normalized_done = True
        return self._normalized


@dataclass
class TraceRuntime:
    calls: Iterable[TraceCall]
    answered: list[Answered] = field(default_factory=list)

    def __post_init__(self) -> None:
        ordered = sorted(self.calls, key=lambda c: (c.start, c.seq))
        self._by_method: dict[str, list[_Entry]] = {}
        self._by_seq: dict[int, _Entry] = {}
        for c in ordered:
            entry = _Entry(c)
            self._by_method.setdefault(c.method, []).append(entry)
            self._by_seq.setdefault(c.seq, entry)
        self._server: GrpcServer | None = None
        self.path: str | None = None

    # -- results -------------------------------------------------------------------
    @property
    def misses(self) -> list[Answered]:
        return [a for a in self.answered if a.seq is None]

    @property
    def mismatches(self) -> list[Answered]:
        return [a for a in self.answered if a.seq is not None and not a.request_matches]

    def unused(self) -> list[TraceCall]:
        return [e.call for entries in self._by_method.values() for e in entries if not e.used]

    def received(self, seq: int) -> bytes | None:
        """The bytes received for the recorded call ``seq`` (e.g. what the shim forwarded)."""
        for a in self.answered:
            if a.seq == seq:
                return a.request
        return None

    # -- matching --------------------------------------------------------------------
    def match(self, method: str, request: bytes, seq_hint: int | None = None) -> Answered:
        entries = self._by_method.get(method, [])
        entry, how = None, "miss"
        if seq_hint is not None:
            e = self._by_seq.get(seq_hint)
            if e is not None and not e.used and e.call.method == method:
                entry, how = e, "seq"
        if entry is None:
            entry = next((e for e in entries if not e.used and e.call.upstream_request == request), None)
            how = "bytes" if entry is not None else how
        if entry is None and method in _NORMALIZERS:
            wanted = normalized_request(method, request)
            if wanted is not None:
                entry = next((e for e in entries if not e.used and e.normalized() == wanted), None)
                how = "normalized" if entry is not None else how
        if entry is None:
            entry = next((e for e in entries if not e.used), None)
            how = "order" if entry is not None else how
        if entry is None:
            answered = Answered(method, request, None, "miss", False)
        else:
            entry.used = True
            answered = Answered(method, request, entry.call.seq, how, self._same_request(entry, request))
        self.answered.append(answered)
        return answered

    @staticmethod
    def _same_request(entry: _Entry, request: bytes) -> bool:
        call = entry.call
        if request == call.upstream_request or request == call.request:
            return True
        if call.method in _NORMALIZERS:
            n = normalized_request(call.method, request)
            return n is not None and n == entry.normalized()
        return False

    def call_for(self, answered: Answered) -> TraceCall | None:
        return None if answered.seq is None else self._by_seq[answered.seq].call

    # -- server ------------------------------------------------------------------------
    async def start(self, path: str) -> None:
        self._server = GrpcServer(self._handle, max_message_bytes=MAX_MESSAGE)
        await self._server.start(path)
        self.path = self._server.path

    async def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    @property
    def endpoint(self) -> str:
        return "unix://" + (self.path or "")

    async def _handle(self, method: str, headers: dict, messages: list) -> tuple[list, str, str]:
        hint = None
        raw = headers.get(REPLAY_SEQ_KEY.encode())
        if raw is not None:
            try:
                hint = int(raw)
            except ValueError:
                pass
        known = CRI_METHODS_BY_PATH.get(method)
        # a known method carries one message; any other call's messages are taken together
        request = messages[0] if known is not None and not known.client_streaming and len(messages) == 1 \
            else b"".join(messages)
        call = self.call_for(self.match(method, request, hint))
        if call is None:
            return [], "FAILED_PRECONDITION", f"trace runtime: no recorded call left to answer {method}"
        if call.code == "OK":
            responses = list(call.responses)
            if known is not None and not known.server_streaming and not responses:
                responses = [b""]
            return responses, "OK", ""
        if call.code not in STATUS_NUMBER:
            return [], "UNKNOWN", f"recorded code {call.code}: {call.details}"
        return [], call.code, call.details
