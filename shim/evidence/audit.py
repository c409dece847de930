"""The audit log: one JSON object per line for every rewrite, fail-open and cgroup write.

`emit()` is called on the CRI path, so it only puts the record on a bounded queue;
a writer thread serializes and writes. If the writer falls behind by more than
`max_pending` records, new records are dropped and counted (never block a call).

A file target is opened without following a symlink (shim.effects.files): a symlink or a
non-regular file there raises UnsafeFile at start. A new file is created 0640.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import time
from typing import Any, Callable, TextIO

from shim.effects.files import open_append
from shim.worker import Worker

log = logging.getLogger(__name__)


class AuditLog(Worker):
    """The audit log and its writer thread (``audit-writer``)."""

    def __init__(self, target: str | TextIO | None, *, max_pending: int = 10000):
        """target: a file path (appended; never through a symlink), "-" for stdout, an open text stream, or None (discard)."""
        super().__init__("audit-writer", max_pending=max_pending, logger=log)
        self._target = target
        self.dropped = 0
        self.written = 0
        self._listeners: list[Callable[[dict], None]] = []
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
            self._stream = open(open_append(self._target, 0o640), "a", encoding="utf-8", buffering=1)
            self._owns_stream = True
        else:
            self._stream = self._target
        super().start()
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
        self.sync(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self.stop(timeout) and self._owns_stream and self._stream is not None:
            self._stream.close()

    def on_sync(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def handle(self, items: list) -> None:
        for item in items:
            try:
                line = json.dumps(item, sort_keys=False, default=str)
                if self._stream is not None:
                    self._stream.write(line + "\n")
                self.written += 1
                for fn in self._listeners:
                    fn(item)
            except Exception:  # never let one bad record stop the writer
                log.exception("audit record could not be written")
