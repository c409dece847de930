"""The kubelet's version found in the background (``--kubelet-version auto``).

``serve`` binds its socket and forwards calls before it knows the kubelet's version: until then
it decides who owns which value from the configuration alone (the conservative case of
``shim.node.kubelet.kubelet_writes``). This side thread (``kubelet-version``) runs
``kubelet --version`` (``shim.node.kubelet.detect_kubelet_version``) and, when it cannot tell
(no executable yet, a timeout under a cold page cache, an output without a version), tries
again: after ``RETRY_FIRST`` seconds, then twice as long each time up to ``RETRY_MAX``, for as
long as the version is unknown (an attempt without a kubelet executable is a few stat calls;
with one, at most one ``kubelet --version`` a minute). Each attempt may take longer than the
previous one (``TIMEOUTS``: a cold binary is read from disk once, then it is cached). Once a
version is found, ``on_known(version, how)`` is called on this thread and the thread stops
trying. Never on the CRI path.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from shim.node.kubelet import detect_kubelet_version
from shim.worker import Worker

log = logging.getLogger(__name__)

RETRY_FIRST = 1.0  # seconds before the second attempt
RETRY_MAX = 60.0  # the slowest rate, kept while the version is unknown
TIMEOUTS = (3.0, 10.0, 30.0)  # `kubelet --version` timeout per attempt (the last one from then on)
STILL_UNKNOWN_EVERY = 600.0  # a warning at most this often while unknown


class KubeletVersionWatcher(Worker):
    """Finds the kubelet's version in the background, retrying with backoff until it is known."""

    def __init__(self, on_known: Callable[[tuple[int, int], str], None], *,
                 detect: Callable[[float], tuple[tuple[int, int] | None, str]] | None = None,
                 retry_first: float | None = None, retry_max: float | None = None,
                 timeouts: tuple[float, ...] | None = None):
        super().__init__("kubelet-version", logger=log, label="kubelet version")
        self._on_known = on_known
        self._detect = detect or (lambda timeout: detect_kubelet_version("auto", timeout=timeout))
        self.retry_first = RETRY_FIRST if retry_first is None else retry_first
        self.retry_max = RETRY_MAX if retry_max is None else retry_max
        self.timeouts = TIMEOUTS if timeouts is None else timeouts
        self.attempts = 0
        self.version: tuple[int, int] | None = None
        self.how = ""  # the last attempt's answer (how the version was found, or why not)
        self._delay = self.retry_first
        self._next_at: float | None = 0.0  # None: known, no more attempts
        self._started = time.monotonic()
        self._warned_at = 0.0

    def on_start(self) -> None:
        self._started = time.monotonic()
        self._attempt()

    def wait_time(self) -> float | None:
        return None if self._next_at is None else max(0.0, self._next_at - time.monotonic())

    def handle(self, items: list) -> None:
        if self.stopping or self._next_at is None or time.monotonic() < self._next_at:
            return
        self._attempt()

    def _attempt(self) -> None:
        timeout = self.timeouts[min(self.attempts, len(self.timeouts) - 1)]
        self.attempts += 1
        try:
            version, how = self._detect(timeout)
        except Exception as e:  # detect never raises; a bug must not end the retries
            version, how = None, f"{e.__class__.__name__}: {e}"
        self.how = how
        if version is not None:
            self.version, self._next_at = version, None
            log.info("kubelet version %d.%d found after %d attempt(s), %.1f s after start (%s)",
                     version[0], version[1], self.attempts, time.monotonic() - self._started, how)
            self._on_known(version, how)
            return
        now = time.monotonic()
        if self.attempts == 1:
            log.warning("kubelet version not found yet (%s); retrying in the background", how)
        elif now - self._warned_at >= STILL_UNKNOWN_EVERY:
            log.warning("kubelet version still unknown after %d attempts (%s); still retrying every %.0f s "
                        "at most", self.attempts, how, self.retry_max)
        else:
            log.debug("kubelet version still unknown (%s)", how)
        if self.attempts == 1 or now - self._warned_at >= STILL_UNKNOWN_EVERY:
            self._warned_at = now
        self._next_at = now + self._delay
        self._delay = min(self.retry_max, self._delay * 2)
