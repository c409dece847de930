"""A local client that opens connections to the shim's socket and never closes them.

``open_settled(path)``: one connection, HTTP/2 preface sent, the peer's SETTINGS acknowledged
and a PING answered, so every byte of the setup has gone both ways when it returns (a relay
that orders connections by their last byte sees them in the order they were opened); then the
connection stays silent.

Run as a script (``python leaky_client.py PATH N``) it is the leaking client in a process of
its own: N such connections, one after the other, then ``open`` on stdout; on a line on stdin it
prints, as JSON, for each connection in the order they were opened, whether the peer closed it
and the error codes of the GOAWAY frames it got; it exits on the next line.
"""
from __future__ import annotations

import json
import socket
import sys

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY = 4, 6, 7
ACK = 1


def frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """The whole frames in ``data``: (type, flags, payload)."""
    out = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], data[9:9 + n]))
        data = data[9 + n:]
    return out


def _read_until(sock: socket.socket, data: bytes, done) -> bytes:
    while not done(frames(data)):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed during the setup; frames so far {frames(data)}")
        data += chunk
    return data


def open_settled(path: str, timeout: float = 10.0) -> tuple[socket.socket, bytes]:
    """A connection set up as above, and the bytes it got during the setup."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(PREFACE + frame(SETTINGS, 0))
        data = _read_until(sock, b"", lambda fs: {(SETTINGS, 0), (SETTINGS, ACK)} <= {(t, f & ACK) for t, f, _ in fs})
        sock.sendall(frame(SETTINGS, ACK) + frame(PING, 0, b"leaky-cl"))
        data = _read_until(sock, data, lambda fs: (PING, ACK, b"leaky-cl") in [(t, f & ACK, p) for t, f, p in fs])
    except BaseException:
        sock.close()
        raise
    return sock, data


def state(sock: socket.socket, data: bytes) -> dict:
    """Whether the peer closed ``sock`` (what it sent is read without waiting) and the error codes
    of the GOAWAY frames in ``data`` and after."""
    sock.setblocking(False)
    closed = False
    while True:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        data += chunk
    return {"closed": closed, "goaway": [int.from_bytes(p[4:8], "big") for t, _, p in frames(data) if t == GOAWAY]}


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2])
    opened = [open_settled(path) for _ in range(n)]
    print("open", flush=True)
    sys.stdin.readline()
    print(json.dumps([state(sock, data) for sock, data in opened]), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
