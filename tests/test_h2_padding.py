"""Padded HEADERS and DATA frames whose padding (or priority fields) leave no room, from either
peer: a PROTOCOL_ERROR (RFC 9113 6.1, 6.2), so the relay closes the connection through its
documented path (``wire.h2.ProtocolError``), and the wire helpers raise it.

Found by tests/test_fuzz.py: such a frame raised IndexError inside the relay's ``Connection``
(logged as an unexpected exception with a traceback), or read the next frame's first byte as the
pad length, or was taken as an empty payload and the call went on."""
from __future__ import annotations

import contextlib
import logging

import hpack
import pytest

from shim.cri.methods import CREATE_CONTAINER
from shim.transport.relay import PREFACE, Closed
from shim.transport.wire.h2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PRIORITY_FLAG,
    SETTINGS,
    ProtocolError,
    data_payload,
    frame,
    header_block,
)

try:
    from tests.relay_driver import new_driver
except ImportError:
    from relay_driver import new_driver

VERSION = "/runtime.v1.RuntimeService/Version"


class _Held:
    """Holds CreateContainer, changes nothing, observes nothing."""

    held_methods = frozenset({CREATE_CONTAINER})

    def rewrite(self, call):
        return call.request

    def finished(self, call):
        return None

    def not_rewritten(self, method, reason):
        return None


def _connection():
    driver = new_driver(_Held())
    return driver, None, driver.client, driver.upstream


@contextlib.contextmanager
def relay_errors():
    """ERROR records of the relay's logger (an unexpected exception inside the Connection)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("shim.transport.relay")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _headers_block(path: str) -> bytes:
    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "localhost"), ("content-type", "application/grpc"),
                                   ("te", "trailers")])


BAD_PADDING = [
    ("DATA, empty", lambda sid: frame(DATA, PADDED | END_STREAM, sid, b"")),
    ("DATA, pad length past the payload", lambda sid: frame(DATA, PADDED | END_STREAM, sid, b"\xff\x00\x00")),
    ("DATA, pad length equal to the payload", lambda sid: frame(DATA, PADDED | END_STREAM, sid, b"\x03ab")),
    ("HEADERS, empty", lambda sid: frame(HEADERS, PADDED | END_HEADERS, sid, b"")),
    ("HEADERS, pad length past the block", lambda sid: frame(HEADERS, PADDED | END_HEADERS, sid, b"\x09\x82")),
    ("HEADERS, priority without its 5 bytes", lambda sid: frame(HEADERS, PRIORITY_FLAG | END_HEADERS, sid, b"\x00\x00")),
]


@pytest.mark.parametrize("method", [CREATE_CONTAINER, VERSION], ids=["held", "passthrough"])
@pytest.mark.parametrize("what,bad", BAD_PADDING, ids=[b[0] for b in BAD_PADDING])
def test_bad_padding_from_the_client_is_a_protocol_error(what, bad, method):
    conn, relay, client, upstream = _connection()
    conn.from_server(frame(SETTINGS, 0, 0))
    opening = b"" if what.startswith("HEADERS") else frame(HEADERS, END_HEADERS, 1, _headers_block(method))
    with relay_errors() as errors:
        conn.from_client(PREFACE + frame(SETTINGS, 0, 0) + opening)
        conn.from_client(bad(1))  # alone in its read: nothing follows the frame in the buffer
    assert not errors, [r.getMessage() for r in errors]
    assert conn.conn.mode == "closed" and conn.of(Closed)


@pytest.mark.parametrize("what,bad", BAD_PADDING, ids=[b[0] for b in BAD_PADDING])
def test_bad_padding_from_the_runtime_is_a_protocol_error(what, bad):
    conn, relay, client, upstream = _connection()
    conn.from_server(frame(SETTINGS, 0, 0))
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                            _headers_block(VERSION)))
    opening = b"" if what.startswith("HEADERS") else frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(
        [(":status", "200"), ("content-type", "application/grpc")]))
    with relay_errors() as errors:
        conn.from_server(opening)
        conn.from_server(bad(1))
    assert not errors, [r.getMessage() for r in errors]
    assert conn.conn.mode == "closed" and conn.of(Closed)


@pytest.mark.parametrize("what,bad", BAD_PADDING, ids=[b[0] for b in BAD_PADDING])
def test_bad_padding_in_the_wire_helpers_raises_protocol_error(what, bad):
    f = bad(1)
    ftype, flags = f[3], f[4]
    with pytest.raises(ProtocolError):
        if ftype == DATA:
            data_payload(f, flags, 0, len(f))
        else:
            header_block(f, ftype, flags, 0, len(f))
