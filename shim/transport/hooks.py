"""The contract between the transport and the rest of the shim.

The transport knows nothing about memory QoS, nor which methods matter: it forwards every call
as raw bytes, holds the methods its hooks declare (``held_methods``), and hands each call to
the hooks as one ``RpcCall`` object:

* ``rewrite(call)`` -- only for the methods in ``held_methods``, before forwarding; ``call``
  carries the method, the request metadata the transport has, the request bytes and the start
  time. It returns the bytes to send upstream (the same object when nothing changes) and may
  leave what it parsed and decided on the call (``rewritten``, one record of the hook's type)
  for ``finished``: the same object comes back there. It runs on the event loop, so it must be
  quick and must not block; the transport forwards the original bytes if it raises.
* ``finished(call)`` -- once per call, after the upstream answered, and before the
  transport handles the kubelet's next call: right after the answer is written, in the
  same event-loop callback (off the call's latency). Must not block (enqueue, dict update).
  Consumers: the audit/record writer, the reconciler's node state, the memory
  of containers that UpdateContainerResources needs.
* ``not_rewritten(method, reason)`` -- a transport that could not hand a held call to
  ``rewrite`` (e.g. the relay's hold cap, a compressed message) says so, so that the
  fail-open is audited like any other. Must not block.

Which methods exist and whether each is unary or streaming is not the transport's either: the
wiring passes the method table (``MethodShape`` rows, ``shim.cri.methods.CRI_METHODS``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

# What an RpcCall keeps of one server stream, in either transport; the client always gets every
# message.
STREAM_RECORD_MAX_MESSAGES = 1000
STREAM_RECORD_MAX_BYTES = 16 * 1024 * 1024


class MethodShape(Protocol):
    """One row of the method table a transport is given."""

    path: str  # "/runtime.v1.RuntimeService/Version", exactly as on the wire
    service: str
    name: str
    client_streaming: bool
    server_streaming: bool


@dataclass(slots=True)
class RpcCall:
    """One RPC through the proxy, the one call object of the shim: created by the transport
    when the call starts (the relay's per-stream ``Stream`` is this record with the relay's own
    fields added) or ends, given to ``rewrite`` and, completed, to ``finished``; shaped like a
    line of the trace format. ``rewritten`` belongs to the rewrite hook (one typed record,
    ``shim.cri.rewritten.Rewritten``): the transport never reads it."""

    method: str
    start: float  # time.time() when the call arrived
    duration_ms: float = 0.0
    request: bytes = b""  # as the client sent it
    forwarded: bytes | None = None  # what went upstream, when it differs from request
    responses: list[bytes] = field(default_factory=list)  # [] when the call failed
    code: str = "OK"  # grpc.StatusCode name
    details: str = ""
    # True when a server stream sent more than the transport keeps (responses holds the first ones)
    truncated: bool = False
    metadata: tuple = ()  # the request's metadata as the transport has it (may be empty)
    rewritten: Any = None  # what the rewrite hook left for finished and the observers

    def complete(self, duration_ms: float, forwarded: bytes | None, responses: list[bytes], code: str,
                 details: str, truncated: bool = False) -> "RpcCall":
        """The call as it ended (the transport's side of the fields)."""
        self.duration_ms, self.forwarded, self.responses = duration_ms, forwarded, responses
        self.code, self.details, self.truncated = code, details, truncated
        return self


class CallHooks(Protocol):
    held_methods: frozenset[str]  # the methods held for rewrite(); every other one passes through

    def rewrite(self, call: RpcCall) -> bytes: ...

    def finished(self, call: RpcCall) -> None: ...

    def not_rewritten(self, method: str, reason: str) -> None: ...


def unary_shapes(methods: Iterable[MethodShape]) -> dict[str, tuple[bool, bool]]:
    """path -> (unary request?, unary response?) of a method table."""
    return {m.path: (not m.client_streaming, not m.server_streaming) for m in methods}


# -- how a transport calls the hooks: failures never reach the call ------------------
OnHookError = Callable[..., None]  # (method) inside an except block, or (method, problem)


def guarded_rewrite(hooks: CallHooks, call: RpcCall, on_error: OnHookError) -> bytes:
    """What goes upstream: the hook's bytes, or the original ones if the hook raises or
    answers something that is not bytes (fail open)."""
    request = call.request
    try:
        out = hooks.rewrite(call)
    except Exception:
        on_error(call.method)
        return request
    if type(out) is bytes:
        return out
    if isinstance(out, (bytearray, memoryview)):
        return bytes(out)
    on_error(call.method, f"returned {type(out).__name__}, not bytes; forwarding the original")
    return request


def guarded_finished(hooks: CallHooks, call: RpcCall, on_error: OnHookError) -> None:
    try:
        hooks.finished(call)
    except Exception:
        on_error(call.method)


def guarded_not_rewritten(hooks: CallHooks, method: str, reason: str, on_error: OnHookError) -> None:
    try:
        hooks.not_rewritten(method, reason)
    except Exception:
        on_error(method)
