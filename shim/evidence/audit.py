"""The audit log: one JSON object per line for every rewrite, fail-open and cgroup write.

`emit()` is called on the CRI path, so it only puts the record on a bounded queue;
a writer thread serializes and writes. If the writer falls behind by more than
`max_pending` records, new records are dropped and counted (never block a call).

A file target is opened without following a symlink (shim.effects.files): a symlink or a
non-regular file there raises UnsafeFile at start. A new file is created 0640. An existing file
is appended to. Before a record would push the file past ``max_bytes`` (0: never by size) it is
rotated: FILE -> FILE.1 -> ... -> FILE.<keep>, the oldest deleted (``keep`` 0: FILE starts
over). The single writer thread rotates between two records, so every record is whole in one
file, and the files read oldest to newest hold the records in the order they were written.
``reopen()`` (SIGHUP) makes the writer close the file and open FILE again before its next
record: logrotate's ``create`` mode renames the file and signals.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import time
from typing import Any, Callable, TextIO

from shim.effects.files import RotatingFile
from shim.worker import Worker

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_KEEP = 5
_REOPEN = object()  # on the queue: wakes the writer to reopen its file
_encode = json.JSONEncoder(default=str).encode  # one encoder (json.dumps with default= makes one per call)


class AuditLog(Worker):
    """The audit log and its writer thread (``audit-writer``), which takes every record queued
    at once."""

    batch = True

    def __init__(self, target: str | TextIO | None, *, max_pending: int = 10000,
                 max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP):
        """target: a file path (appended and rotated; never through a symlink), "-" for stdout,
        an open text stream, or None (discard). max_bytes and keep apply to a file path."""
        super().__init__("audit-writer", max_pending=max_pending, logger=log)
        self._target = target
        self.dropped = 0
        self.written = 0
        self.write_errors = 0
        self.reopens = 0
        self._listeners: list[Callable[[dict], None]] = []
        self._stream: TextIO | None = None
        self._file: RotatingFile | None = None
        if isinstance(target, str) and target != "-":
            self._file = RotatingFile(target, 0o640, max_bytes=max_bytes, keep=keep)
        self._reopen = False

    @property
    def rotations(self) -> int:
        """Size rotations of the audit file since start."""
        return self._file.rotations if self._file is not None else 0

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call fn(record) in the writer thread for every record (metrics, tests)."""
        self._listeners.append(fn)

    def start(self) -> "AuditLog":
        if self._file is not None:
            self._file.open()
        elif self._target == "-":
            self._stream = sys.stdout
        elif self._target is not None and not isinstance(self._target, str):
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

    def reopen(self) -> None:
        """Have the writer close the file and open it again by name before its next record
        (SIGHUP, after logrotate renamed it). Sets a flag and puts a mark on the queue: no I/O
        here, safe from a signal handler's callback."""
        if self._file is None:
            return
        self._reopen = True
        try:
            self._queue.put_nowait(_REOPEN)  # wakes an idle writer; when full, the flag suffices
        except queue.Full:
            pass

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every record emitted so far is written (tests, shutdown)."""
        self.sync(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self.stop(timeout) and self._file is not None:
            self._file.close()

    def on_sync(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def handle(self, items: list) -> None:
        """Everything queued at once: serialized, then written in one write when the lines fit
        in the file as it is (one by one otherwise, and when that write fails), in order."""
        lines: list[str] = []
        done: list[dict] = []
        for item in items:
            if item is _REOPEN:
                self._write(lines, done)
                lines, done = [], []
                continue
            try:
                lines.append(_encode(item) + "\n")
            except Exception as e:  # never let one bad record stop the writer
                self._write_error(e)
                continue
            done.append(item)
        self._write(lines, done)

    def _write(self, lines: list[str], records: list[dict]) -> None:
        if self._reopen:
            self._reopen_file()
        if not lines:
            return
        f = self._file
        if f is not None and len(lines) > 1:
            data = "".join(lines).encode("utf-8")
            try:
                fits = f.fits(len(data))
                if fits:
                    f.write(data)
            except Exception:  # taken back by the file: written one by one below, each error its own
                fits = False
            if fits:
                self.written += len(lines)
                self._tell(records)
                return
        for line, record in zip(lines, records):
            try:
                if f is not None:
                    f.write(line.encode("utf-8"))
                elif self._stream is not None:
                    self._stream.write(line)
                self.written += 1
            except Exception as e:  # never let one bad record stop the writer
                self._write_error(e)
                continue
            self._tell((record,))

    def _tell(self, records) -> None:
        for fn in self._listeners:
            for record in records:
                try:
                    fn(record)
                except Exception:
                    log.exception("audit listener failed")

    def _write_error(self, e: Exception) -> None:
        self.write_errors += 1
        if self.write_errors == 1 or self.write_errors % 1000 == 0:
            log.warning("audit record could not be written (%d so far): %s", self.write_errors, e)

    def _reopen_file(self) -> None:
        self._reopen = False
        self.reopens += 1
        try:
            self._file.reopen()
            log.info("audit log %s reopened", self._file.path)
        except OSError as e:  # UnsafeFile among them: the next record tries again (a write error)
            log.warning("audit log: cannot reopen %s: %s", self._file.path, e)
