"""The side threads' common base: a named daemon thread working through its own queue.

Every thread beside the CRI path is a ``Worker``: the reconciler, the monitor, the audit writer
and the trace recorder. ``start()`` starts the thread; ``stop()`` puts a stop mark on the queue
and joins the thread (at most ``timeout`` seconds); ``sync()`` waits until everything queued
before it is processed, and ``probe()`` puts the same mark without waiting (its age tells how
far behind the worker is). A bounded queue (``max_pending``) never blocks a producer on the CRI
path: the producer puts without waiting and drops and counts what does not fit.

Errors are said (a warning, and an optional report such as an audit record) at most once per
key and interval (``ThrottledErrors``); the idle state is said once when the worker goes idle
for a reason and once when it is active again (``say_idle``).

Nothing here imports from the shim: every room may use it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

_STOP = object()
_UNSET = object()


class Probe(threading.Event):
    """A mark on a worker's queue, set once everything queued before it is processed.
    ``put_at`` / ``done_at``: time.monotonic() when it was queued / reached."""

    def __init__(self) -> None:
        super().__init__()
        self.put_at = time.monotonic()
        self.done_at: float | None = None

    def set(self) -> None:
        self.done_at = time.monotonic()
        super().set()


class ThrottledErrors:
    """Errors said at most once per key and interval: a warning ``"<label>: <message>"`` and,
    with ``report``, ``report(key, message)`` (an audit record, a counter)."""

    def __init__(self, logger: logging.Logger, label: str, report: Callable[[str, str], None] | None = None,
                 every: float = 60.0, max_keys: int = 10000):
        self._log = logger
        self.label = label
        self._report = report
        self.every = every
        self.max_keys = max_keys
        self._at: dict[str, float] = {}

    def __call__(self, key: str, message: str, every: float | None = None) -> bool:
        """Say the error unless the same key was said less than ``every`` seconds ago.
        Returns whether it was said."""
        now = time.monotonic()
        if now - self._at.get(key, -1e9) < (self.every if every is None else every):
            return False
        if len(self._at) > self.max_keys:
            self._at.clear()
        self._at[key] = now
        self._log.warning("%s: %s", self.label, message)
        if self._report is not None:
            self._report(key, message)
        return True


class Worker:
    """A side thread named ``name`` that handles what is put on its queue.

    Subclasses implement ``handle(items)`` (called in the thread with what was taken from the
    queue: one item, or with ``batch`` everything queued at once; an empty list when
    ``wait_time()`` ran out) and may implement ``on_start()`` (first thing in the thread),
    ``on_sync()`` (before sync marks are set) and ``on_idle(reason)`` / ``on_active()``.
    While the last batch before a stop is handled, ``stopping`` is True."""

    #: take everything queued at once (one handle() per batch) instead of one item at a time
    batch = False

    def __init__(self, name: str, *, max_pending: int = 0, logger: logging.Logger | None = None,
                 label: str | None = None, report_error: Callable[[str, str], None] | None = None):
        self.name = name
        # unbounded: the C SimpleQueue (cheapest put for a producer on the CRI path)
        self._queue: queue.Queue | queue.SimpleQueue = (
            queue.Queue(maxsize=max_pending) if max_pending > 0 else queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._logger = logger or log
        self._error = ThrottledErrors(self._logger, label or name, report_error)
        self._idle: Any = _UNSET
        self.stopping = False

    # -- lifecycle
    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        """The thread runs (False before start, after stop, and when it ended on its own)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> "Worker":
        self.stopping = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread once what is queued before the stop mark is handled; wait for it
        at most ``timeout`` seconds. False when it was not running."""
        thread = self._thread
        if thread is None:
            return False
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        thread.join(timeout)
        self._thread = None
        return True

    def probe(self) -> Probe | None:
        """Put a mark on the queue without waiting; it is set once everything queued before
        it is processed. None when a bounded queue is full."""
        p = Probe()
        try:
            self._queue.put_nowait(p)
        except queue.Full:
            return None
        return p

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is processed. False on timeout."""
        p = Probe()
        try:
            self._queue.put(p, timeout=timeout)
        except queue.Full:
            return False
        return p.wait(timeout)

    # -- what subclasses implement
    def on_start(self) -> None:
        """Called first in the thread."""

    def wait_time(self) -> float | None:
        """Seconds to wait for the next item before handle([]) is called (None: no limit)."""
        return None

    def handle(self, items: list) -> None:
        raise NotImplementedError

    def on_sync(self) -> None:
        """Called before the sync marks of a batch are set."""

    # -- the idle state
    def say_idle(self, reason: str | None) -> bool:
        """Say once that the worker is idle and why (reason), or active again (None).
        Returns whether the state changed."""
        if reason == self._idle:
            return False
        self._idle = reason
        if reason is None:
            self.on_active()
        else:
            self.on_idle(reason)
        return True

    def on_idle(self, reason: str) -> None:
        self._logger.info("%s idle: %s", self._error.label, reason)

    def on_active(self) -> None:
        self._logger.info("%s active", self._error.label)

    # -- the thread
    def _take(self, timeout: float | None) -> list:
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        if self.batch:
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        return items

    def _run(self) -> None:
        try:
            self.on_start()
        except Exception:  # the thread must survive anything
            self._logger.exception("%s: start failed", self.name)
        while True:
            work, marks, stop = [], [], False
            for it in self._take(self.wait_time()):
                if it is _STOP:
                    stop = True
                elif isinstance(it, Probe):
                    marks.append(it)
                elif not stop:
                    work.append(it)
            self.stopping = stop
            if work or not stop:
                try:
                    self.handle(work)
                except Exception:  # the thread must survive anything
                    self._logger.exception("%s: failed", self.name)
            if marks:
                try:
                    self.on_sync()
                finally:
                    for m in marks:
                        m.set()
            if stop:
                return
