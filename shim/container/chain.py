"""The transport's ``CallHooks`` as ``serve`` builds them: one rewriter in front of any number
of observers (the recorder, the reconciler's observer, the metrics observer).

The transport calls ``rewrite`` on the chain; it is the rewriter's own bound method (or, with
the metrics on, that method timed), so no frame sits between the transport and the rewriter.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from shim.transport.hooks import CallHooks, RpcCall

log = logging.getLogger(__name__)


class HookChain:
    """One rewriter and any number of observers behind the transport's CallHooks."""

    def __init__(self, rewriter: CallHooks, observers: list[Any] | None = None):
        self.rewriter = rewriter
        self.observers = list(observers or [])
        self.held_methods = rewriter.held_methods
        self.rewrite: Callable[[RpcCall], bytes] = rewriter.rewrite

    def time_rewrites(self, timer_for: Callable[[str], Callable[[float], None]]) -> None:
        """Time each ``rewrite`` (perf_counter seconds) into the timer of its method, asked of
        ``timer_for(method)`` here, once per held method."""
        inner = self.rewriter.rewrite
        timers = {method: timer_for(method) for method in self.held_methods}
        clock = time.perf_counter

        def rewrite(call: RpcCall) -> bytes:
            t0 = clock()
            try:
                return inner(call)
            finally:
                timer = timers.get(call.method)
                if timer is not None:
                    timer(clock() - t0)

        self.rewrite = rewrite

    def not_rewritten(self, method: str, reason: str) -> None:
        self.rewriter.not_rewritten(method, reason)

    def finished(self, call: RpcCall) -> None:
        self.rewriter.finished(call)
        for observer in self.observers:
            try:
                observer.finished(call)
            except Exception:
                log.exception("observer %r failed on %s", observer, call.method)


def build_request_hooks(rewriter: CallHooks, observers: list[Any] | None = None) -> HookChain:
    """The transport's CallHooks: the rewriter, then the observers (recorder, ...)."""
    return HookChain(rewriter, observers)
