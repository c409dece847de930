"""The transport's ``CallHooks`` as ``serve`` builds them: one rewriter in front of any number
of observers (the recorder, the reconciler's observer, the metrics observer).

The transport calls ``rewrite`` on the chain; it is the rewriter's own bound method (or, with
the metrics on, that method timed), so no frame sits between the transport and the rewriter.

``finished`` runs on the transport's thread right after the kubelet has its answer, while the
kubelet may already be sending its next call. With a ``CallFinisher`` (``serve``), it does only
what cannot wait (the rewriter's ``remember``: a created container's id) and appends the call
to a bounded batch; the rest (the rewriter's audit record, then each observer) runs on the
finisher's thread, call after call in the order the calls ended, for every call the batch
gathered while it waited a few milliseconds: one wake-up of one thread for a burst of calls
instead of work on the transport's thread and a wake-up of the audit writer per call.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from shim.transport.hooks import CallHooks, RpcCall
from shim.worker import Worker

log = logging.getLogger(__name__)

# seconds the first call of a batch waits on the finisher's thread for the calls ending after it
FINISH_DELAY = 0.02
DEFAULT_FINISH_MAX_PENDING = 10000
# seconds of work after which the finisher lets go of the interpreter (a call waiting on the
# transport's thread would otherwise wait up to the interpreter's switch interval, 5 ms)
YIELD_EVERY = 0.0002
_WAKE = object()


class HookChain:
    """One rewriter and any number of observers behind the transport's CallHooks."""

    def __init__(self, rewriter: CallHooks, observers: list[Any] | None = None):
        self.rewriter = rewriter
        self.observers = list(observers or [])
        self.held_methods = rewriter.held_methods
        self.rewrite: Callable[[RpcCall], bytes] = rewriter.rewrite
        # the rewriter's two parts of finished(): what cannot wait, and what can (its audit record)
        self._remember: Callable[[RpcCall], None] | None = getattr(rewriter, "remember", None)
        self._account: Callable[[RpcCall], None] = getattr(rewriter, "account", rewriter.finished)
        self.finisher: CallFinisher | None = None
        self._wants: tuple | None = None  # who wants which calls after the answer (defer_to)

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

    def defer_to(self, finisher: "CallFinisher | None") -> None:
        """Run the work after each answer on ``finisher``'s thread (None: in ``finished`` again).
        Only the calls someone has work for are handed over: each part says so with
        ``wants(call)`` (the rewriter, the reconciler's observer); a part without it wants every
        call. Called once the observers are all there."""
        parts = [self.rewriter, *self.observers]
        wants = tuple(getattr(part, "wants", None) for part in parts)
        self._wants = None if any(w is None for w in wants) else wants
        self.finisher = finisher

    def not_rewritten(self, method: str, reason: str) -> None:
        finisher = self.finisher
        if finisher is not None:  # its record in order with the records of the calls before it
            finisher.submit(_NotRewritten(method, reason))
        else:
            self.rewriter.not_rewritten(method, reason)

    def finished(self, call: RpcCall) -> None:
        remember = self._remember
        if remember is not None:
            remember(call)
        finisher = self.finisher
        if finisher is not None:
            wants = self._wants
            wanted = wants is None
            if not wanted:
                for want in wants:  # each one asked: a part may keep track of what it saw
                    if want(call):
                        wanted = True
            if wanted:
                finisher.submit(call)
            return
        self.after(call)

    def after(self, call: "RpcCall | _NotRewritten") -> None:
        """What a finished call leaves for later: the rewriter's audit record, then each observer
        (an observer that raises is logged; the next one still runs)."""
        if type(call) is _NotRewritten:
            self.rewriter.not_rewritten(call.method, call.reason)
            return
        self._account(call)
        for observer in self.observers:
            try:
                observer.finished(call)
            except Exception:
                log.exception("observer %r failed on %s", observer, call.method)


class _NotRewritten:
    __slots__ = ("method", "reason")

    def __init__(self, method: str, reason: str) -> None:
        self.method, self.reason = method, reason


class CallFinisher(Worker):
    """The work after each answer, in batches on its own thread (``call-finisher``).

    ``submit`` (the transport's thread) appends to a deque and wakes the thread only when it
    was not woken yet; the thread waits ``delay`` seconds for more calls to join, then runs
    ``work`` for every call in the deque, oldest first, letting go of the interpreter between
    two calls every ``YIELD_EVERY`` seconds. At most ``max_pending`` calls wait: beyond, a
    call's work is dropped and counted (``dropped``; the rewriter's ``remember`` has run). ``stop`` and
    ``sync`` run what is submitted before they return, without waiting out the delay."""

    batch = True

    def __init__(self, work: Callable[[Any], None], *, max_pending: int = DEFAULT_FINISH_MAX_PENDING,
                 delay: float = FINISH_DELAY):
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, not {max_pending!r}")
        super().__init__("call-finisher", logger=log)
        self._work = work
        self._calls: deque = deque()
        self._awake = False
        self._hurry = threading.Event()  # set by stop and sync: the batch runs without waiting longer
        self.max_pending = max_pending
        self.delay = delay
        self.dropped = 0  # calls whose work was dropped: more than max_pending waited
        self.done = 0
        self.batches = 0
        self.largest_batch = 0

    def submit(self, call: Any) -> None:
        """From the transport's thread: never waits."""
        calls = self._calls
        if len(calls) >= self.max_pending:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("the work after the answers is behind (%d calls waiting): %d calls' audit records, "
                            "recordings and reconciler events dropped so far", len(calls), self.dropped)
            return
        calls.append(call)
        if not self._awake:
            self._awake = True
            self._queue.put(_WAKE)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop once every call submitted before is done; what is left when the thread ended
        before (it never does on its own) runs here."""
        thread = self._thread
        self._hurry.set()
        stopped = super().stop(timeout)
        if thread is not None and not thread.is_alive() and self._calls:
            self.handle([])
        return stopped

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until every call submitted so far is done (tests; without the batch's delay)."""
        self._hurry.set()
        return super().sync(timeout)

    @property
    def pending(self) -> int:
        return len(self._calls)

    def handle(self, items: list) -> None:
        if items and self.delay > 0 and not self.stopping:
            self._hurry.wait(self.delay)  # the calls ending meanwhile join this batch
        self._hurry.clear()
        # cleared before the deque is read: a call submitted from now on wakes the thread again
        self._awake = False
        calls, work, pause, clock = self._calls, self._work, time.sleep, time.perf_counter
        n = 0
        due = clock() + YIELD_EVERY
        while calls:
            call = calls.popleft()
            try:
                work(call)
            except Exception:  # the thread must survive anything
                log.exception("the work after the answer failed on %s", getattr(call, "method", call))
            n += 1
            if clock() >= due:
                pause(0)  # the transport's thread, if it waits for the interpreter, may take it here
                due = clock() + YIELD_EVERY
        if n:
            self.done += n
            self.batches += 1
            if n > self.largest_batch:
                self.largest_batch = n


def build_request_hooks(rewriter: CallHooks, observers: list[Any] | None = None) -> HookChain:
    """The transport's CallHooks: the rewriter, then the observers (recorder, ...)."""
    return HookChain(rewriter, observers)
