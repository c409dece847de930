#!/usr/bin/env python3
"""A read-only OCI distribution registry serving an image store (e2e/critest_images.py's output).

The store is an OCI image layout: index.json names each image (annotation
io.containerd.image.name, a full reference such as gcr.io/k8s-staging-cri-tools/test-image-tag:test)
and blobs/sha256/ holds manifests, configs and layers. It is read once at start; a manifest is
checked against its digest then, a blob's file only by name (its hex digest).

  GET /v2/                                       200 {}
  GET|HEAD /v2/<name>/manifests/<tag|digest>     the manifest, Content-Type its media type,
                                                 Docker-Content-Digest, Content-Length
  GET|HEAD /v2/<name>/blobs/<digest>             a config or layer of one of <name>'s manifests

<name> is a repository path of a registry host: the request `?ns=<host>` (what containerd adds
when a hosts.toml mirror serves another host's images) picks the host; without ns, <name> may
begin with the host (gcr.io/k8s-staging-cri-tools/...) or be a path only one host has. Unknown
names, tags and digests get 404 with the distribution error body ({"errors": [{"code": ...}]});
malformed ones 400. Nothing of a request becomes a filesystem path: names, tags and hosts are
keys of the index read at start, digests must be sha256:<64 hex> and one of the repository's.

Bounds (each a flag): --max-connections concurrent connections (more are closed at once and
counted), --timeout seconds a connection may stay idle, request line and header sizes (a longer
request line gets 414, larger headers 431). Counts of these are logged at exit and in --log.

Usage: registry.py --store DIR --listen 127.0.0.1:PORT [--log FILE] [--port-file FILE]
prints "listening on HOST:PORT" when ready (PORT 0: a free port, written to --port-file).
stdlib only.
"""
from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit

COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
NAME_RE = re.compile(rf"{COMPONENT}(?:/{COMPONENT})*")
HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(?::[0-9]{1,5})?")
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
PATH_RE = re.compile(r"/v2/(?P<name>[^?#]+)/(?P<kind>manifests|blobs)/(?P<ref>[^/?#]+)")
MAX_NAME = 255
CHUNK = 1 << 16


class StoreError(Exception):
    pass


class Store:
    """The images of an OCI layout, keyed by (host, repository path)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        try:
            with open(os.path.join(self.root, "index.json"), encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {root}/index.json: {e}") from e
        # (host, path) -> {"tags": {tag: digest}, "manifests": {digest: (media type, bytes)}, "blobs": {digest: size}}
        self.repos: dict[tuple[str, str], dict] = {}
        for desc in index.get("manifests", []):
            ref = desc.get("annotations", {}).get("io.containerd.image.name", "")
            host, path, tag = split_reference(ref)
            digest = desc.get("digest", "")
            body = self._read(digest)
            manifest = json.loads(body)
            repo = self.repos.setdefault((host, path), {"tags": {}, "manifests": {}, "blobs": {}})
            repo["tags"][tag] = digest
            repo["manifests"][digest] = (manifest.get("mediaType") or desc["mediaType"], body)
            for blob in [manifest["config"], *manifest["layers"]]:
                if not DIGEST_RE.fullmatch(blob["digest"]):
                    raise StoreError(f"{ref}: bad blob digest {blob['digest']!r}")
                size = os.path.getsize(self.blob_path(blob["digest"]))
                if size != blob["size"]:
                    raise StoreError(f"{ref}: blob {blob['digest']} has {size} bytes, not {blob['size']}")
                repo["blobs"][blob["digest"]] = size

    def _read(self, digest: str) -> bytes:
        if not DIGEST_RE.fullmatch(digest):
            raise StoreError(f"bad digest {digest!r} in index.json")
        with open(self.blob_path(digest), "rb") as f:
            body = f.read()
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise StoreError(f"blob {digest} does not match its digest")
        return body

    def blob_path(self, digest: str) -> str:
        """The file of a digest already checked against DIGEST_RE (hex only: no separator)."""
        assert DIGEST_RE.fullmatch(digest)
        return os.path.join(self.root, "blobs", "sha256", digest[7:])

    def repo(self, name: str, ns: str | None) -> dict | None:
        if ns is not None:
            return self.repos.get((ns, name))
        host, _, path = name.partition("/")
        if path and (host, path) in self.repos:
            return self.repos[(host, path)]
        found = [r for (h, p), r in self.repos.items() if p == name]
        return found[0] if len(found) == 1 else None

    def references(self) -> list[str]:
        return sorted(f"{h}/{p}:{t}" for (h, p), r in self.repos.items() for t in r["tags"])


def split_reference(ref: str) -> tuple[str, str, str]:
    m = re.fullmatch(rf"(?P<host>[^/]+)/(?P<path>{NAME_RE.pattern}):(?P<tag>{TAG_RE.pattern})", ref)
    if not m or not HOST_RE.fullmatch(m["host"]):
        raise StoreError(f"index.json: {ref!r} is not a full image reference (host/path:tag)")
    return m["host"], m["path"], m["tag"]


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.values = {"requests": 0, "refused_connections": 0, "oversized_requests": 0, "errors": 0}

    def add(self, key: str) -> None:
        with self.lock:
            self.values[key] += 1


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address, store: Store, *, max_connections: int, timeout: float,
                 max_line: int, max_header_bytes: int, log=None):
        self.store = store
        self.slots = threading.BoundedSemaphore(max_connections)
        self.conn_timeout = timeout
        self.max_line = max_line
        self.max_header_bytes = max_header_bytes
        self.log_file = log
        self.log_lock = threading.Lock()
        self.counters = Counters()
        super().__init__(address, Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.counters.add("refused_connections")
            self.log("connection refused: --max-connections reached")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def log(self, line: str) -> None:
        if self.log_file is not None:
            with self.log_lock:
                self.log_file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
                self.log_file.flush()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def version_string(self) -> str:
        return "memqos-e2e-registry"
    server: Server

    def setup(self):
        self.timeout = self.server.conn_timeout
        super().setup()

    def log_message(self, format, *args):  # noqa: A002 (the stdlib's name)
        self.server.log(f"{self.client_address[0]} {format % args}")

    def handle_one_request(self):
        # the stdlib allows 64 KiB lines; this server's bound is --max-line
        try:
            line = self.rfile.readline(self.server.max_line + 1)
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        if len(line) > self.server.max_line:
            self.server.counters.add("oversized_requests")
            self.server.log(f"{self.client_address[0]} request line over --max-line: 414")
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", "GET"
            self.send_error(414)
            self.close_connection = True
            return
        if not line:
            self.close_connection = True
            return
        self.raw_requestline = line
        if not self.parse_request():
            return
        if sum(len(k) + len(v) for k, v in self.headers.items()) > self.server.max_header_bytes:
            self.server.counters.add("oversized_requests")
            self.server.log(f"{self.client_address[0]} headers over --max-header-bytes: 431")
            self.send_error(431)
            self.close_connection = True
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.reply_error(405, "UNSUPPORTED", "method not allowed")
        else:
            method()
        self.wfile.flush()

    # -- responses --------------------------------------------------------------------------------

    def reply(self, status: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def reply_error(self, status: int, code: str, message: str) -> None:
        self.server.counters.add("errors")
        body = json.dumps({"errors": [{"code": code, "message": message, "detail": {}}]}).encode()
        self.reply(status, body, "application/json")

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        self.server.counters.add("requests")
        url = urlsplit(self.path)
        if url.path in ("/v2", "/v2/"):
            return self.reply(200, b"{}", "application/json")
        m = PATH_RE.fullmatch(url.path)
        if not m:
            return self.reply_error(404, "NOT_FOUND", "no such endpoint")
        name, kind, ref = m["name"], m["kind"], m["ref"]
        if len(name) > MAX_NAME or not NAME_RE.fullmatch(name):
            return self.reply_error(400, "NAME_INVALID", "invalid repository name")
        ns_values = parse_qs(url.query).get("ns")
        ns = ns_values[0] if ns_values else None
        if ns is not None and not HOST_RE.fullmatch(ns):
            return self.reply_error(400, "NAME_INVALID", "invalid ns")
        repo = self.server.store.repo(name, ns)
        if kind == "manifests":
            return self.manifest(repo, ref)
        return self.blob(repo, ref)

    def manifest(self, repo: dict | None, ref: str) -> None:
        if DIGEST_RE.fullmatch(ref):
            digest = ref
        elif TAG_RE.fullmatch(ref):
            digest = repo["tags"].get(ref, "") if repo else ""
        else:
            return self.reply_error(400, "MANIFEST_INVALID", "invalid tag or digest")
        if repo is None:
            return self.reply_error(404, "NAME_UNKNOWN", "repository name not known to registry")
        if digest not in repo["manifests"]:
            return self.reply_error(404, "MANIFEST_UNKNOWN", "manifest unknown")
        media_type, body = repo["manifests"][digest]
        self.reply(200, body, media_type, {"Docker-Content-Digest": digest, "ETag": f'"{digest}"'})

    def blob(self, repo: dict | None, digest: str) -> None:
        if not DIGEST_RE.fullmatch(digest):
            return self.reply_error(400, "DIGEST_INVALID", "invalid digest")
        if repo is None:
            return self.reply_error(404, "NAME_UNKNOWN", "repository name not known to registry")
        if digest in repo["manifests"]:
            media_type, body = repo["manifests"][digest]
            return self.reply(200, body, media_type, {"Docker-Content-Digest": digest})
        if digest not in repo["blobs"]:
            return self.reply_error(404, "BLOB_UNKNOWN", "blob unknown to registry")
        try:
            f = open(self.server.store.blob_path(digest), "rb")
        except OSError:
            return self.reply_error(404, "BLOB_UNKNOWN", "blob unknown to registry")
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("Docker-Content-Digest", digest)
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.end_headers()
            if self.command == "HEAD":
                return
            while chunk := f.read(CHUNK):
                self.wfile.write(chunk)


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Serve an OCI image layout as a read-only registry.")
    p.add_argument("--store", required=True, help="the OCI layout (e2e/critest_images.py OUT_DIR)")
    p.add_argument("--listen", required=True, type=parse_listen, help="HOST:PORT (PORT 0: any free port)")
    p.add_argument("--log", help="append one line per request here")
    p.add_argument("--port-file", help="write the port listened on here once listening")
    p.add_argument("--max-connections", type=int, default=32, help="concurrent connections (default 32)")
    p.add_argument("--timeout", type=float, default=30.0, help="idle seconds before a connection is closed")
    p.add_argument("--max-line", type=int, default=8192, help="request line bytes (default 8192)")
    p.add_argument("--max-header-bytes", type=int, default=32768, help="header bytes (default 32768)")
    args = p.parse_args(argv[1:])
    if args.max_connections < 1 or args.timeout <= 0 or args.max_line < 64 or args.max_header_bytes < 256:
        p.error("--max-connections, --timeout, --max-line and --max-header-bytes must be positive "
                "(at least 64 and 256 bytes for the last two)")
    try:
        store = Store(args.store)
    except (StoreError, OSError, ValueError, KeyError) as e:
        print(f"registry: {e}", file=sys.stderr)
        return 2
    log = open(args.log, "a", encoding="utf-8") if args.log else None
    host, port = args.listen
    Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = Server((host, port), store, max_connections=args.max_connections, timeout=args.timeout,
                    max_line=args.max_line, max_header_bytes=args.max_header_bytes, log=log)
    bound = server.server_address[1]
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(f"{bound}\n")
        os.replace(args.port_file + ".tmp", args.port_file)
    server.log(f"serving {len(store.references())} references from {store.root}")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"listening on {host}:{bound}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.log(f"stopped: {json.dumps(server.counters.values, sort_keys=True)}")
        print(f"registry: stopped {json.dumps(server.counters.values, sort_keys=True)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
