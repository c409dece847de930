"""The HTTP server on --metrics-address: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 while the process and its side threads are alive and the reconciler
works through its queue; ``/readyz`` answers 200 once the front end does its job (serve: the
runtime's socket accepts a connection and the reconciler's first rebuild is done; nri: the
runtime has the plugin registered and its first Synchronize is handled). Either answers 503
with one line per problem otherwise. What each checks is a callable of the front end
(``shim.app``): this module knows only HTTP and the two small helpers the checks share.

The server is a threading WSGI server (one short-lived thread per request, daemon threads);
metrics are rendered from memory, the checks read attributes and at most connect to one unix
socket with a short timeout, so no request waits on the CRI path.
"""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

STUCK_AFTER = 120.0  # seconds a worker may take to reach a probe before /healthz calls it stuck
CONNECT_TIMEOUT = 1.0  # seconds /readyz waits for the runtime's socket to accept

Check = Callable[[], list[str]]  # the problems; an empty list: all well


class StuckWatch:
    """Whether a side thread (a ``shim.worker.Worker``) still works through its queue: one probe
    outstanding at a time, queued when the last one was reached; stuck once the outstanding
    probe is older than ``after`` seconds."""

    def __init__(self, worker, after: float = STUCK_AFTER, clock: Callable[[], float] = time.monotonic):
        self.worker = worker
        self.after = after
        self.clock = clock
        self._probe = None
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        with self._lock:
            p = self._probe
            if p is None or p.is_set():
                self._probe = self.worker.probe()  # None when its bounded queue is full: asked again next time
                return None
            age = self.clock() - p.put_at
        if age > self.after:
            return f"thread {self.worker.name} has not reached a mark queued {age:.0f} s ago (stuck?)"
        return None


def dead_threads(workers: Iterable) -> list[str]:
    """Side threads that were started and have ended (``shim.worker.Worker.alive``)."""
    return [f"thread {w.name} is not running" for w in workers
            if w is not None and w.running and not w.alive]


def unix_socket_problem(path: str, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None when a unix socket at ``path`` accepts a connection, else why not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as e:
            return f"{path}: {e.strerror or e}"
    return None


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - a scrape every few seconds is not news
        pass


def _text(start_response, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                            ("Cache-Control", "no-store")])
    return [data]


def check_app(metrics_app, checks: dict[str, Check]):
    """A WSGI app: the paths in ``checks`` answered from their check (a check that raises is a
    problem too), anything else by ``metrics_app``."""

    def app(environ, start_response):
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics_app(environ, start_response)
        try:
            problems = list(check())
        except Exception as e:  # noqa: BLE001 - the answer is the problem, not a 500
            problems = [f"the check failed: {e.__class__.__name__}: {e}"]
        if problems:
            return _text(start_response, "503 Service Unavailable", "".join(f"{p}\n" for p in problems))
        return _text(start_response, "200 OK", "ok\n")

    return app


class EndpointServer:
    """/metrics from ``registry``, /healthz from ``health``, /readyz from ``ready``."""

    def __init__(self, registry, *, health: Check | None = None, ready: Check | None = None):
        from prometheus_client import make_wsgi_app

        self.app = check_app(make_wsgi_app(registry), {"/healthz": health or (lambda: []),
                                                      "/readyz": ready or (lambda: [])})
        self._httpd = None
        self._thread = None

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve in a daemon thread; the bound (host, port) (port 0: any free port)."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        class Server(_ThreadingServer):
            address_family = family

        self._httpd = make_server(host, port, self.app, Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return host, int(self._httpd.server_address[1])

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
