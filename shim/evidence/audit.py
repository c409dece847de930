"""The audit log: one JSON object per line for every rewrite, fail-open and cgroup write.

`emit()` is called on the CRI path, so it only puts the record on a bounded queue;
a writer thread serializes and writes. If the writer falls behind by more than
`max_pending` records, new records are dropped and counted (never block a call).
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from typing import Any, Callable, TextIO

log = logging.getLogger(__name__)

_STOP = object()


class AuditLog:
    def __init__(self, target: str | TextIO | None, *, max_pending: int = 10000):
        """target: a file path (appended), "-" for stdout, an open text stream, or None (discard)."""
        self._target = target
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.dropped = 0
        self.written = 0
        self._listeners: list[Callable[[dict], None]] = []
        self._thread: threading.Thread | None = None
        self._stream: TextIO | None = None
        self._owns_stream = False

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call fn(record) in the writer thread for every record (metrics, tests)."""
        self._listeners.append(fn)

    def start(self) -> "AuditLog":
        if self._target is None:
            self._stream = None
        elif self._target == "-":
            self._stream = sys.stdout
        elif isinstance(self._target, str):
            self._stream = open(self._target, "a", encoding="utf-8", buffering=1)
            self._owns_stream = True
        else:
            self._stream = self._target
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()
        return self

    def emit(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("audit log writer behind: %d records dropped", self.dropped)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every record emitted so far is written (tests, shutdown)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None
        if self._owns_stream and self._stream is not None:
            self._stream.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                if self._stream is not None:
                    self._stream.flush()
                item.set()
                continue
            try:
                line = json.dumps(item, sort_keys=False, default=str)
                if self._stream is not None:
                    self._stream.write(line + "\n")
                self.written += 1
                for fn in self._listeners:
                    fn(item)
            except Exception:  # never let one bad record stop the writer
                log.exception("audit record could not be written")
