"""HTTP/2 and gRPC-over-HTTP/2 wire facts shared by the relay (``relay.py``) and the
reconciler's unary client (``unary_client.py``): frame types, flags, settings, frame
building, gRPC status names and grpc's mappings, grpc-message percent-encoding."""
from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
ERR_CANCEL = 0x8
MAX_WINDOW = (1 << 31) - 1

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


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, ftype, flags)) + sid.to_bytes(4, "big") + payload


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, increment.to_bytes(4, "big"))


def setting(ident: int, value: int) -> bytes:
    return ident.to_bytes(2, "big") + value.to_bytes(4, "big")


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
