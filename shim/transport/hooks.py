"""The contract between the transport and the rest of the shim.

The transport knows nothing about memory QoS. It forwards every call as raw
bytes and calls two hooks:

* ``rewrite(method, request)`` -- only for the methods in ``REWRITTEN_METHODS``,
  before forwarding. It returns the bytes to send upstream (the same object
  when nothing changes). It runs on the event loop, so it must be quick and
  must not block; the transport forwards the original bytes if it raises.
* ``finished(call)`` -- once per call, after the upstream answered, and before the
  transport handles the kubelet's next call: the grpc transport calls it before the
  answer goes back, the relay right after writing the answer, in the same event-loop
  callback (off the call's latency). Must not block (enqueue, dict update).
  Consumers: the audit/record writer, the reconciler's node state, the memory
  of containers that UpdateContainerResources needs.
* ``not_rewritten(method, reason)`` -- optional: a transport that could not hand a
  rewritable call to ``rewrite`` (e.g. the relay's hold cap, a compressed message)
  says so, so that the fail-open is audited like any other. Must not block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

CREATE_CONTAINER = "/runtime.v1.RuntimeService/CreateContainer"
UPDATE_CONTAINER_RESOURCES = "/runtime.v1.RuntimeService/UpdateContainerResources"
REWRITTEN_METHODS = frozenset({CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES})


@dataclass
class FinishedCall:
    """One finished RPC, shaped like a line of the trace format."""

    method: str
    start: float  # time.time() when the call arrived
    duration_ms: float
    request: bytes  # as the client sent it
    forwarded: bytes | None  # what went upstream, when it differs from request
    responses: list[bytes] = field(default_factory=list)  # [] when the call failed
    code: str = "OK"  # grpc.StatusCode name
    details: str = ""
    # True when a server stream sent more than the transport keeps (responses holds the first ones)
    truncated: bool = False


class CallHooks(Protocol):
    def rewrite(self, method: str, request: bytes) -> bytes: ...

    def finished(self, call: FinishedCall) -> None: ...


class PassthroughHooks:
    """Hooks that change nothing and observe nothing."""

    def rewrite(self, method: str, request: bytes) -> bytes:
        return request

    def finished(self, call: FinishedCall) -> None:
        return None

    def not_rewritten(self, method: str, reason: str) -> None:
        return None


# -- how a transport calls the hooks: failures never reach the call ------------------
OnHookError = Callable[..., None]  # (method) inside an except block, or (method, problem)


def guarded_rewrite(hooks: CallHooks, method: str, request: bytes, on_error: OnHookError) -> bytes:
    """What goes upstream: the hook's bytes, or the original ones if the hook raises or
    answers something that is not bytes (fail open)."""
    try:
        out = hooks.rewrite(method, request)
    except Exception:
        on_error(method)
        return request
    if type(out) is bytes:
        return out
    if isinstance(out, (bytearray, memoryview)):
        return bytes(out)
    on_error(method, f"returned {type(out).__name__}, not bytes; forwarding the original")
    return request


def guarded_finished(hooks: CallHooks, call: FinishedCall, on_error: OnHookError) -> None:
    try:
        hooks.finished(call)
    except Exception:
        on_error(call.method)
