"""A small blocking gRPC client for unary calls over HTTP/2 on a unix socket: the relay's wire
code (``wire/``) driven from a socket, for the reconciler's runtime client, ``reset``,
``doctor``, ``demo`` and ``replay``.

The request is ``wire.grpc.request_headers`` (HPACK literals, the runtime's decoder table never
touched) and the message in DATA frames within the runtime's flow-control windows. The answer's
units come from ``wire.h2.frames``; every header block is decoded (``wire.hpack.Decoder``: the
runtime's table must be followed) and read by ``wire.grpc.response_info``, the messages are
reassembled by ``wire.grpc.Messages``, the status is the trailers' or ``ended_status`` /
``reset_status``, as the relay reads them. SETTINGS are acknowledged, PING answered, GOAWAY
and a lost connection are UNAVAILABLE, the timeout DEADLINE_EXCEEDED.

Bounded: a message above ``max_message_bytes`` ends the call at its prefix (RESOURCE_EXHAUSTED,
the stream reset); a header block is at most ``max_header_list`` bytes, raw (in at most
``MAX_CONTINUATIONS`` CONTINUATIONs, ``wire.h2.continuations`` as the relay checks it) and
decoded, and a frame at most HTTP/2's default size (no other is advertised): past either the
connection is closed (RESOURCE_EXHAUSTED). We advertise windows large enough for any answer up
to ``max_message_bytes`` and give the connection window back after each call.

One connection, opened on the first call and again after any failure; calls one at a time.
``CallError.code`` is the status name. No compression, no TLS, no client streaming;
``call_messages`` collects a server-streaming answer whole (``replay`` sends recorded calls
with it).
"""
from __future__ import annotations

import socket
import time

from shim.transport.endpoints import socket_path
from shim.transport.wire.grpc import Messages, ended_status, message, request_headers, reset_status, response_info
from shim.transport.wire.h2 import (
    ACK,
    DATA,
    DEFAULT_MAX_FRAME,
    END_HEADERS,
    END_STREAM,
    ERR_CANCEL,
    ERR_FRAME_SIZE,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    WINDOW_UPDATE,
    H2Error,
    ProtocolError,
    continuations,
    data_payload,
    frame,
    frame_length,
    frames,
    header_block,
    rst_stream,
    setting,
    settings_items,
    u31,
    window_update,
)
from shim.transport.wire.hpack import Decoder, HeaderListTooLarge, HpackError

MAX_HEADER_LIST = 1024 * 1024  # the relay's h2-max-header-block default
MAX_CONTINUATIONS = 128  # the relay's h2-max-continuations default


class CallError(Exception):
    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}" if details else code)
        self.code = code
        self.details = details


class _Broken(Exception):
    """The connection cannot be used any more (its HTTP/2 state is lost or it closed)."""


class _NotProcessed(_Broken):
    """The runtime is going away and did not take our stream (GOAWAY below its id)."""


class UnaryClient:
    def __init__(self, endpoint: str, *, max_message_bytes: int = 128 * 1024 * 1024,
                 max_header_list: int = MAX_HEADER_LIST, connect_timeout: float = 5.0,
                 receive_window: int = MAX_WINDOW) -> None:
        self.path = socket_path(endpoint)
        if not 65535 <= receive_window <= MAX_WINDOW:
            raise ValueError(f"receive_window must be in 65535..{MAX_WINDOW}, not {receive_window}")
        self.receive_window = receive_window
        self.max_message_bytes = max_message_bytes
        self.max_header_list = max_header_list
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._fresh_state()

    def _fresh_state(self) -> None:
        """A new connection's HTTP/2 state."""
        self._buf = bytearray()
        self._next_sid = 1
        self._decoder = Decoder(max_list=self.max_header_list)
        self._send_conn = 65535
        self._send_initial = 65535
        self._max_frame = DEFAULT_MAX_FRAME
        self._goaway = False
        self._owed = 0  # connection window to give back to the runtime

    # -- connection
    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def _connect(self, deadline: float) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.001, min(self.connect_timeout, deadline - time.monotonic())))
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise CallError("UNAVAILABLE", f"cannot connect to unix://{self.path}: {e}") from None
        self._sock = s
        self._fresh_state()
        # no server push; stream and connection windows as large as HTTP/2 allows (by default):
        # answers never wait for a WINDOW_UPDATE from us, the connection's is given back after
        # each call
        w = self.receive_window
        settings = (setting(SETTINGS_ENABLE_PUSH, 0) + setting(SETTINGS_INITIAL_WINDOW_SIZE, w)
                    + setting(SETTINGS_MAX_HEADER_LIST_SIZE, self.max_header_list))
        self._send(PREFACE + frame(SETTINGS, 0, 0, settings) + (window_update(0, w - 65535) if w > 65535 else b""))

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise _Broken(f"write: {e}") from None

    def _read_frame(self, deadline: float) -> tuple[int, int, int, bytes, int]:
        """The next unit (``wire.h2.frames``): (type, flags, stream id, payload, flow-controlled
        length); the payload of HEADERS / PUSH_PROMISE is the whole header block, of DATA the
        data without padding (the flow-controlled length counts it). H2Error when the unit
        still arriving is past a bound."""
        buf = self._buf
        while True:
            try:
                for ftype, flags, sid, pos, end in frames(buf, 0, len(buf)):
                    if ftype == HEADERS or ftype == PUSH_PROMISE:
                        payload = bytes(header_block(buf, ftype, flags, 0, end))
                    elif ftype == DATA:
                        payload = bytes(data_payload(buf, flags, 0, end))
                    else:
                        payload = bytes(buf[9:end])
                    del buf[:end]
                    return ftype, flags, sid, payload, end - 9
                self._check_incomplete(buf)
            except H2Error:
                raise
            except ProtocolError as e:
                raise _Broken(str(e)) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(1 << 20)
            except socket.timeout:
                raise TimeoutError from None
            except OSError as e:
                raise _Broken(f"read: {e}") from None
            if not chunk:
                raise _Broken("the runtime closed the connection")
            buf += chunk

    def _check_incomplete(self, buf: bytearray) -> None:
        """The unit at the start of ``buf`` has not fully arrived: H2Error if what is announced
        of it is already past a bound (a frame above the default size, a header block above
        ``max_header_list`` bytes or in more than MAX_CONTINUATIONS frames)."""
        n = len(buf)
        if n < 9:
            return
        length = frame_length(buf, 0)
        if length > DEFAULT_MAX_FRAME:
            raise H2Error(ERR_FRAME_SIZE, "frame_size", f"a {length}-byte frame from the runtime "
                                                        f"(max {DEFAULT_MAX_FRAME})")
        if buf[3] in (HEADERS, PUSH_PROMISE) and not buf[4] & END_HEADERS and n >= 9 + length:
            continuations(buf, 9 + length, n, length, 0, DEFAULT_MAX_FRAME, self.max_header_list, MAX_CONTINUATIONS)

    # -- calls
    def call(self, method: str, request: bytes, timeout: float, metadata: tuple = ()) -> bytes:
        """The answer's one message; CallError with the gRPC status otherwise."""
        messages = self.call_messages(method, request, timeout, metadata)
        if len(messages) != 1:
            raise CallError("INTERNAL", f"{method}: {len(messages)} messages in the answer, not one")
        return messages[0]

    def call_messages(self, method: str, request: bytes, timeout: float, metadata: tuple = ()) -> list[bytes]:
        """Every message of the answer; CallError with the gRPC status otherwise. ``metadata``:
        (name, value) strings sent as request headers.

        A connection that was idle may have been closed by the runtime meanwhile: when a call
        on a reused connection finds it closed (or refused by GOAWAY) before any answer, it is
        made once more on a new connection. Every caller's calls are reads (lists, statuses,
        Version), so a repeat is harmless."""
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            fresh = self._sock is None or self._goaway or self._next_sid > MAX_WINDOW - 2
            if fresh:
                self.close()
                self._connect(deadline)
            try:
                return self._attempt(method, request, timeout, deadline, metadata)
            except _Broken as e:
                self.close()
                if fresh or attempt == 2 or time.monotonic() >= deadline:
                    raise CallError("UNAVAILABLE", f"{method}: connection to unix://{self.path} lost ({e})") from None
        raise AssertionError("unreachable")

    def _attempt(self, method: str, request: bytes, timeout: float, deadline: float,
                 metadata: tuple = ()) -> list[bytes]:
        sid = self._next_sid
        self._next_sid += 2
        try:
            try:
                return self._call(sid, method, request, timeout, deadline, metadata)
            finally:
                if self._sock is not None and self._owed:
                    self._give_back()
        except TimeoutError:
            self.close()  # the stream's state is unknown: start afresh next time
            raise CallError("DEADLINE_EXCEEDED", f"no answer to {method} within {timeout:g} s") from None
        except (H2Error, HeaderListTooLarge) as e:
            self.close()
            raise CallError("RESOURCE_EXHAUSTED", f"{method}: the runtime's answer is past a bound ({e})") from None
        except HpackError as e:
            self.close()
            raise CallError("INTERNAL", f"{method}: undecodable header block from the runtime ({e})") from None

    def _call(self, sid: int, method: str, request: bytes, timeout: float, deadline: float,
              metadata: tuple = ()) -> list[bytes]:
        message_bytes = message(request)
        self._send(frame(HEADERS, END_HEADERS, sid, request_headers(method.encode(), timeout, metadata)))
        stream_window = self._send_initial
        sent = 0
        received = 0  # DATA bytes of the answer, prefixes included
        answer = Messages(1 << 30, self.max_message_bytes, self.max_message_bytes)
        status: str | None = None
        details = ""
        http_status = b""
        while True:
            while sent < len(message_bytes):
                room = min(self._send_conn, stream_window, self._max_frame, len(message_bytes) - sent)
                if room <= 0:
                    break
                last = sent + room == len(message_bytes)
                self._send(frame(DATA, END_STREAM if last else 0, sid, message_bytes[sent:sent + room]))
                sent += room
                self._send_conn -= room
                stream_window -= room
            ftype, flags, fsid, payload, flow = self._read_frame(deadline)
            if ftype == SETTINGS:
                if not flags & ACK:
                    stream_window += self._settings(payload)
                    self._send(frame(SETTINGS, ACK, 0))  # before any more DATA of ours
            elif ftype == PING:
                if not flags & ACK:
                    self._send(frame(PING, ACK, 0, payload))
            elif ftype == WINDOW_UPDATE:
                if fsid == 0:
                    self._send_conn += u31(payload, 0)
                elif fsid == sid:
                    stream_window += u31(payload, 0)
            elif ftype == GOAWAY:
                self._goaway = True
                if u31(payload, 0) < sid:
                    raise _NotProcessed("the runtime is going away (GOAWAY) and did not take the call")
            elif ftype == RST_STREAM and fsid == sid:
                code, reason = reset_status(int.from_bytes(payload[:4], "big"))
                raise CallError(code, f"{method}: {reason}")
            elif ftype in (HEADERS, PUSH_PROMISE):
                info = self._decoder.info(payload, response_info)  # every block: the table must be followed
                if ftype == PUSH_PROMISE or fsid != sid:
                    continue
                got_http, _, got_status, got_details = info
                if got_http:
                    http_status = got_http
                if got_status is not None:
                    status, details = got_status, got_details
                if flags & END_STREAM:
                    break
            elif ftype == DATA:
                self._owed += flow  # flow control counts padding too
                if fsid == sid:
                    received += len(payload)
                    if answer.feed(payload) or received > self.max_message_bytes + 5:
                        self._send(rst_stream(sid, ERR_CANCEL))
                        raise CallError("RESOURCE_EXHAUSTED", f"{method}: answer larger than "
                                                              f"{self.max_message_bytes} bytes")
                    if flags & END_STREAM:
                        break
        status, details = ended_status(http_status, status, details)
        if status != "OK":
            raise CallError(status, details)
        if answer.partial:
            raise CallError("INTERNAL", f"{method}: a truncated message in the answer")
        if answer.compressed:
            raise CallError("INTERNAL", f"{method}: compressed answer (not asked for)")
        return answer.msgs

    def _settings(self, payload: bytes) -> int:
        """Apply the runtime's SETTINGS; returns the change of the initial stream window."""
        delta = 0
        for ident, value in settings_items(payload, 0, len(payload)):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                delta += value - self._send_initial
                self._send_initial = value
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                self._max_frame = max(DEFAULT_MAX_FRAME, min(value, 1 << 24))
        return delta

    def _give_back(self) -> None:
        """The connection window the answers used (each stream's closes with it)."""
        n, self._owed = self._owed, 0
        if n > 0:
            try:
                self._send(window_update(0, n))
            except _Broken:
                self.close()  # the next call reconnects; this one has its answer
