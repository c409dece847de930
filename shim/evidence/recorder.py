"""The recorder: every finished CRI call, appended to a file in the cri-trace format.

``Recorder`` is an observer of the service's HookChain. ``finished()`` runs after each answer
(in ``serve`` on the call-finisher thread, with the other calls of its batch), so it only
checks the method filter and puts the call on a bounded queue; a
writer thread base64-encodes, writes one JSON line and flushes it. A shim killed with
SIGKILL therefore loses only the calls still in flight (and, at worst, the few the writer
had not reached yet); every line already written is complete. If the writer falls behind
(more than ``max_pending`` calls or ``max_pending_bytes`` of payload queued), calls are
dropped and counted rather than slowing the kubelet down.

Files: ``path`` is the current file. Before a call line would push it past ``max_bytes`` it
is rotated: ``path`` -> ``path.1`` -> ... -> ``path.<keep>`` (the oldest is deleted; with
``keep=0`` the file simply starts over). A recording already at ``path`` when the recorder
starts is rotated the same way, so every file is one recording session. Each file starts
with its own header line (node facts and the shim's settings), so each is a complete trace
that ``memqos-shim replay`` and ``trace show`` can read on its own. Files are opened without
following a symlink (shim.effects.files; new files 0600: they hold whole requests); a symlink
at ``path`` refuses the start, rotation renames (a rename never writes through a symlink).
``reopen()`` (SIGHUP) makes the writer close the file and open ``path`` again before its next
line (for logrotate); a new file gets its header.

Which calls: by default every method except the high-volume polling calls in
``HIGH_VOLUME_METHODS`` (the kubelet's once-a-second relist, stats and status calls; in
the recorded kubelet traces they are ~95% of all calls). A ``methods`` regex replaces that
default: a call is recorded when ``re.search(regex, method_path)`` matches, so ``.``
records everything and ``Create|Update`` only the rewritten methods. ``seq`` counts every
finished call, recorded or not, so gaps in ``seq`` show where calls were left out.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from typing import Any, Callable

from shim.effects.files import RotatingFile, check_not_symlink, rotate_names
from shim.evidence.trace import TraceCall, utc_now
from shim.worker import Worker

log = logging.getLogger(__name__)

# Left out by default (matched on the method name, for every service version).
HIGH_VOLUME_METHODS = frozenset({
    "ListContainerStats",
    "ListPodSandboxStats",
    "ContainerStats",
    "PodSandboxStats",
    "ListContainers",
    "ListPodSandbox",
    "ContainerStatus",
    "PodSandboxStatus",
    "ImageFsInfo",
    "Status",
    "Version",
    "ListImages",
    "ImageStatus",
})
ALL_METHODS = "."
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_KEEP = 3
_REOPEN = object()  # on the queue: wakes the writer to reopen its file


class MethodFilter:
    """Which method paths to record: ``None`` = all but HIGH_VOLUME_METHODS, else a regex
    searched in the full path ("all" is accepted for ".")."""

    def __init__(self, pattern: str | None = None):
        if pattern is not None and pattern.strip().lower() == "all":
            pattern = ALL_METHODS
        self.pattern = pattern
        self._regex = re.compile(pattern) if pattern is not None else None
        self._cache: dict[str, bool] = {}

    def __call__(self, method: str) -> bool:
        keep = self._cache.get(method)
        if keep is None:
            if self._regex is None:
                keep = method.rsplit("/", 1)[-1] not in HIGH_VOLUME_METHODS
            else:
                keep = self._regex.search(method) is not None
            if len(self._cache) < 4096:  # method paths come from clients: bound the cache
                self._cache[method] = keep
        return keep

    def describe(self) -> str:
        if self.pattern is None:
            return "all methods except " + ", ".join(sorted(HIGH_VOLUME_METHODS))
        return f"methods matching {self.pattern!r}"


class Recorder(Worker):
    """HookChain observer that writes finished calls to a rotating cri-trace file (writer
    thread ``trace-recorder``)."""

    def __init__(
        self,
        path: str,
        header: dict[str, Any],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        methods: str | None = None,
        max_pending: int = 10000,
        max_pending_bytes: int = 64 * 1024 * 1024,
    ):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0, not {keep}")
        super().__init__("trace-recorder", max_pending=max_pending, logger=log, label="recorder")
        self.path = path
        self.header = dict(header)
        self.max_bytes = max_bytes
        self.keep = keep
        self.filter = MethodFilter(methods)
        self.max_pending_bytes = max_pending_bytes
        self._seq = itertools.count(1)
        self._pending_bytes = 0
        self._lock = threading.Lock()
        # new files 0600: they hold whole requests
        self._out = RotatingFile(path, 0o600, max_bytes=max_bytes, keep=keep, header=self._header_bytes)
        self._reopen = False
        self._listeners: list[Callable[[TraceCall], None]] = []
        # counters
        self.recorded = 0
        self.filtered = 0
        self.dropped = 0
        self.write_errors = 0
        self.reopens = 0

    @property
    def rotations(self) -> int:
        """Size rotations since start (the one of a previous recording at start not counted)."""
        return self._out.rotations

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "Recorder":
        """Open the file (rotating a previous recording away) and start the writer.
        Raises OSError when the file cannot be created: recording was asked for; UnsafeFile
        when the path is a symlink or not a regular file."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        check_not_symlink(self.path)  # UnsafeFile: refused at start, never followed
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            rotate_names(self.path, self.keep)
        self._out.open()
        super().start()
        log.info("recording %s to %s (rotate at %d bytes, keep %d)",
                 self.filter.describe(), self.path, self.max_bytes, self.keep)
        return self

    def add_listener(self, fn: Callable[[TraceCall], None]) -> None:
        """fn(trace_call) in the writer thread after each line is written (tests, metrics)."""
        self._listeners.append(fn)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every call queued so far is written. False on timeout."""
        return not self.running or self.sync(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if not self.stop(timeout):
            return
        self._out.close()
        if self.dropped:
            log.warning("recorder: %d calls were dropped (writer behind)", self.dropped)

    # -- observer ----------------------------------------------------------------
    def finished(self, call: Any) -> None:
        """After the answer: filter, number, enqueue. Never blocks."""
        seq = next(self._seq)
        if not self.filter(call.method):
            self.filtered += 1
            return
        size = len(call.request) + sum(len(r) for r in call.responses)
        if call.forwarded is not None:
            size += len(call.forwarded)
        with self._lock:
            if self._pending_bytes + size > self.max_pending_bytes and self._pending_bytes > 0:
                self._drop()
                return
            self._pending_bytes += size
        try:
            self._queue.put_nowait((seq, size, call))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= size
            self._drop()

    def reopen(self) -> None:
        """Have the writer close its file and open ``path`` again before its next line (SIGHUP,
        after logrotate renamed the file). Sets a flag and puts a mark on the queue: no I/O
        here, safe from a signal handler's callback."""
        self._reopen = True
        try:
            self._queue.put_nowait(_REOPEN)  # wakes an idle writer; when full, the flag suffices
        except queue.Full:
            pass

    def _drop(self) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("recorder writer behind: %d calls dropped", self.dropped)

    # -- writer thread -------------------------------------------------------------
    def handle(self, items: list) -> None:
        for item in items:
            if self._reopen:
                self._reopen_file()
            if item is _REOPEN:
                continue
            seq, size, call = item
            with self._lock:
                self._pending_bytes -= size
            try:
                tc = TraceCall.from_finished(call, seq)
                self._out.write(tc.to_line().encode("utf-8"))
                self.recorded += 1
                for fn in self._listeners:
                    fn(tc)
            except Exception:
                self.write_errors += 1
                if self.write_errors == 1 or self.write_errors % 1000 == 0:
                    log.exception("recorder: call %d could not be written (%d errors so far)",
                                  seq, self.write_errors)

    def _header_bytes(self) -> bytes:
        header = dict(self.header)
        header["created"] = utc_now()
        return (json.dumps(header, default=str) + "\n").encode("utf-8")

    def _reopen_file(self) -> None:
        self._reopen = False
        self.reopens += 1
        try:
            self._out.reopen()
            log.info("recorder: %s reopened", self.path)
        except OSError as e:  # UnsafeFile among them: the next call tries again (a write error)
            log.warning("recorder: cannot reopen %s: %s", self.path, e)


def read_kubelet_config_doc(path: str | None) -> dict[str, Any]:
    """The KubeletConfiguration as read (for the trace header); {} when none or unreadable."""
    if not path:
        return {}
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except Exception:
        return {}
    if not isinstance(doc, dict):
        return {}
    # round-trip through JSON so the header holds only JSON types (YAML dates become text)
    return json.loads(json.dumps(doc, default=str))


def shim_header(
    *,
    version: str,
    mem_total_bytes: int,
    page_size: int,
    cgroup_driver: str,
    kubelet_config: dict[str, Any],
    allocatable: int,
    factor: float | None,
    policy: str,
    cgroup_v2: bool,
    listen: str = "",
    upstream: str = "",
    methods: str = "",
    kubelet_version: str | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The header the shim writes: the format's node facts plus what the shim decided with,
    so that a replay of its recording reproduces its audit records. ``settings``: every
    deciding setting by name, JSON values (shim.app.decides.header_settings), as
    ``shim.settings``; ``policy``, ``allocatable``, ``factor`` and ``kubelet_version`` are also
    written on their own, as recordings before ``shim.settings`` had them (older replays read those)."""
    from shim.evidence.trace import make_header

    host = os.uname().nodename
    return make_header(
        source=f"memqos-shim {version} serve --record on {host}: {listen} -> {upstream}; recording {methods}",
        mem_total_bytes=mem_total_bytes,
        page_size=page_size,
        cgroup_driver=cgroup_driver,
        kubelet_config=kubelet_config,
        node_extra={"cgroup_v2": cgroup_v2},
        extra={"shim": {"version": version, "policy": policy, "allocatable": allocatable, "factor": factor,
                        "enabled": cgroup_v2, "started": time.time(),
                        **({"kubelet_version": kubelet_version} if kubelet_version else {}),
                        **({"settings": dict(settings)} if settings is not None else {})}},
    )
