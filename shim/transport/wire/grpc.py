"""gRPC over HTTP/2 as the relay and the unary client read and write it: status names and
grpc's mappings (RST_STREAM code, HTTP status), the status of an answer's header block
(``response_info``) and of an answer that ended without one (``ended_status``), a client's
request header block (``request_headers``), grpc-message percent-encoding, grpc-timeout, the
5-byte message prefix and the messages reassembled from DATA payloads (``Messages``), and the
two compressions."""
from __future__ import annotations

import zlib

from shim.transport.wire.hpack import literal

STATUS_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)
STATUS_NUMBER = {name: i for i, name in enumerate(STATUS_NAMES)}
# RST_STREAM error code -> the status a grpc client reports (grpc's http2 mapping)
RST_STATUS = {
    0x0: "INTERNAL", 0x1: "INTERNAL", 0x2: "INTERNAL", 0x3: "INTERNAL", 0x4: "INTERNAL", 0x5: "INTERNAL",
    0x6: "INTERNAL", 0x7: "UNAVAILABLE", 0x8: "CANCELLED", 0x9: "INTERNAL", 0xA: "INTERNAL",
    0xB: "RESOURCE_EXHAUSTED", 0xC: "PERMISSION_DENIED", 0xD: "INTERNAL",
}
# HTTP status of an answer without grpc-status -> status (grpc's http-to-grpc mapping)
HTTP_STATUS = {b"400": "INTERNAL", b"401": "UNAUTHENTICATED", b"403": "PERMISSION_DENIED",
               b"404": "UNIMPLEMENTED", b"429": "UNAVAILABLE", b"502": "UNAVAILABLE",
               b"503": "UNAVAILABLE", b"504": "UNAVAILABLE"}




def percent_encode(text: str) -> bytes:
    out = bytearray()
    for b in text.encode("utf-8", "replace"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def percent_decode(raw: bytes) -> str:
    if b"%" not in raw:
        return raw.decode("utf-8", "replace")
    out = bytearray()
    i, n = 0, len(raw)
    while i < n:
        b = raw[i]
        if b == 0x25 and i + 3 <= n:
            try:
                out.append(int(raw[i + 1:i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(b)
        i += 1
    return out.decode("utf-8", "replace")

def header_values(headers: list[tuple[bytes, bytes]], wanted: dict[bytes, int]) -> list:
    """The value of each header ``wanted`` names, at the index it gives (the last one where a
    name repeats, None where it is absent)."""
    out = [None] * len(wanted)
    for name, value in headers:
        i = wanted.get(name)
        if i is not None:
            out[i] = value
    return out


_RESPONSE = {b":status": 0, b"grpc-encoding": 1, b"grpc-status": 2, b"grpc-message": 3}


def response_info(headers: list[tuple[bytes, bytes]]) -> tuple:
    """(:status, grpc-encoding, status name or None, details) of response headers or trailers:
    the status name is None without grpc-status, UNKNOWN for one that is not a status number."""
    http_status, encoding, status, message = header_values(headers, _RESPONSE)
    code = None
    details = ""
    if status is not None:
        try:
            code = STATUS_NAMES[int(status)]
        except (ValueError, IndexError):
            code = "UNKNOWN"
        details = percent_decode(message) if message else ""
    return http_status or b"", encoding or b"", code, details


def ended_status(http_status: bytes, code: str | None, details: str) -> tuple[str, str]:
    """The status of an answer that ended: its own (``code`` from ``response_info``), or
    without grpc-status the one grpc gives for its HTTP status (UNKNOWN for 200 or none)."""
    if code is not None:
        return code, details
    if http_status and http_status != b"200":
        return (HTTP_STATUS.get(http_status, "UNKNOWN"),
                f"HTTP status {http_status.decode('ascii', 'replace')} from the runtime")
    return "UNKNOWN", "the runtime's answer has no grpc-status"


def reset_status(error_code: int) -> tuple[str, str]:
    """The status of a stream the runtime reset with RST_STREAM ``error_code``."""
    return RST_STATUS.get(error_code, "INTERNAL"), f"stream reset by the runtime (HTTP/2 error code {error_code})"


def request_headers(path: bytes, timeout: float | None = None, metadata: tuple = ()) -> bytes:
    """A gRPC request's header block as a client sends it: HPACK literals without indexing,
    so no table of the server's decoder is touched; ``metadata``: (name, value) strings."""
    block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", path)
             + literal(b":authority", b"localhost") + literal(b"content-type", b"application/grpc")
             + literal(b"te", b"trailers"))
    if timeout is not None:
        block += literal(b"grpc-timeout", timeout_header(timeout))
    for name, value in metadata:
        block += literal(name.lower().encode(), value.encode())
    return block


TIMEOUT_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


def timeout_seconds(value: bytes) -> float | None:
    """A grpc-timeout header value in seconds, None if it is not one."""
    if len(value) < 2 or not value[:-1].isdigit():
        return None
    unit = TIMEOUT_UNITS.get(value[-1])
    return None if unit is None else int(value[:-1]) * unit


def timeout_header(seconds: float) -> bytes:
    ms = max(1, int(seconds * 1000))
    return f"{ms}m".encode() if ms < 10**8 else f"{max(1, int(seconds))}S".encode()


def decompress(encoding: bytes, data: bytes) -> bytes | None:
    """A message body in grpc-encoding ``encoding`` uncompressed; None if it cannot be."""
    try:
        if encoding == b"gzip":
            return zlib.decompress(data, 16 + zlib.MAX_WBITS)
        if encoding == b"deflate":
            return zlib.decompress(data)
    except zlib.error:
        return None
    return None


def message(body: bytes) -> bytes:
    """One uncompressed gRPC message: the 5-byte prefix and the body."""
    return b"\x00" + len(body).to_bytes(4, "big") + body


class Messages:
    """gRPC messages reassembled from one direction's DATA payloads, kept within caps:
    ``max_n`` messages and ``max_bytes`` in all (beyond them ``truncated``); a message declared
    larger than ``limit`` is reported by ``feed``."""

    __slots__ = ("msgs", "kept", "max_n", "max_bytes", "limit", "truncated", "head", "left", "cur",
                 "flag", "compressed")

    def __init__(self, max_n: int, max_bytes: int, limit: int) -> None:
        self.msgs: list[bytes] = []
        self.kept = 0
        self.max_n = max_n
        self.max_bytes = max_bytes
        self.limit = limit
        self.truncated = False
        self.head = b""  # a partial 5-byte prefix
        self.left = -1  # body bytes of the current message still to come; -1: at a prefix
        self.cur: list | None = None  # pieces of the current message
        self.flag = 0
        self.compressed = False

    @property
    def partial(self) -> bool:
        """A message has begun (its prefix or a part of it came) and has not completed."""
        return self.left >= 0 or bool(self.head)

    def drop_partial(self) -> None:
        """Let go of the pieces of a message that will never complete (the stream ended)."""
        if self.cur is not None:
            self.cur = None
            self.left = -1

    def _keep(self, size: int) -> bool:
        if self.truncated:
            return False
        if len(self.msgs) < self.max_n and self.kept + size <= self.max_bytes:
            return True
        self.truncated = True
        return False

    def feed(self, data) -> int:
        """Take a DATA payload (bytes or a memoryview, kept by reference until its message is
        complete); returns 0, or the declared size of a message above ``limit``."""
        n = len(data)
        if self.left < 0 and not self.head and n >= 5:  # fast path: exactly one whole message
            size = int.from_bytes(data[1:5], "big")
            if n == 5 + size:
                if size > self.limit:
                    return size
                if data[0]:
                    self.compressed = True
                if self._keep(size):
                    self.msgs.append(bytes(data[5:]))
                    self.kept += size
                return 0
        i = 0
        while i < n:
            if self.left < 0:
                take = 5 - len(self.head)
                self.head += bytes(data[i:i + take])
                i += take
                if len(self.head) < 5:
                    break
                head, self.head = self.head, b""
                size = int.from_bytes(head[1:5], "big")
                if size > self.limit:
                    return size
                if head[0]:
                    self.compressed = True
                self.left = size
                self.cur = [] if self._keep(size) else None
            take = min(self.left, n - i)
            if self.cur is not None and take:
                self.cur.append(data[i:i + take])
            i += take
            self.left -= take
            if self.left == 0:
                if self.cur is not None:
                    message = b"".join(self.cur)
                    self.msgs.append(message)
                    self.kept += len(message)
                self.cur = None
                self.left = -1
        return 0
