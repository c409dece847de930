"""Bounded fuzzing (hypothesis, derandomized: the same examples on every run) of what the
shim reads from its peers: HTTP/2 byte streams through the wire parsers (``wire.h2``,
``wire.hpack``) and the relay's sans-I/O ``Connection`` from both sides, and CRI messages
(random bytes, mutated kubelet requests, hostile field values) through the rewrite hook as the
transports call it (``transport.hooks.guarded_rewrite`` around the ``HookChain`` `serve` builds).

Properties: the parsers raise nothing but their documented errors (``ProtocolError``,
``HpackError``); the ``Connection`` lets no exception out and hits no unexpected one inside
(those are logged as "cannot follow" with a traceback and close the connection: a bug), and it
buffers no more than it was fed; the rewrite either forwards the kubelet's bytes unchanged
or sends bytes that parse as the same message and differ only in ``unified`` and the shim's
annotation, every value in ``unified`` one runc accepts; the guarded path never raises and
never hangs (an alarm bounds each example)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading

import hpack
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from shim.app.service import build_container_qos
from shim.container.chain import HookChain
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER, UPDATE_CONTAINER_RESOURCES
from shim.decision import NodeFacts, Policy
from shim.tools.kubelet_requests import create_container, sandbox_config, update_resources
from shim.transport.hooks import RpcCall, guarded_rewrite
from shim.transport.relay import PREFACE
from shim.transport.unary_client import CallError, UnaryClient

try:
    from tests.relay_driver import new_driver
except ImportError:
    from relay_driver import new_driver
from shim.transport.wire.h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    SETTINGS,
    ProtocolError,
    data_payload,
    frame,
    frames,
    header_block,
)
from shim.transport.wire.hpack import Decoder, HpackError

MI = 2**20
GI = 2**30
CAPACITY = 16 * GI
NODE = NodeFacts(capacity=CAPACITY, allocatable=CAPACITY - 200 * MI, page_size=4096, factor=0.9)
INT64_MAX = 2**63 - 1
ANNOTATION = "memqos.io/request"

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def alarm(seconds: float):
    """Fail an example that takes longer than ``seconds`` (a hang) instead of waiting forever."""
    def ring(signum, frame_):
        raise TimeoutError(f"example took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Errors(logging.Handler):
    """Unexpected exceptions inside a Connection, as its logger reports them: an ERROR record
    ("cannot follow ... stream" with a traceback), or a "cannot follow" warning naming an
    exception other than the protocol errors (``ProtocolError``, ``HpackError``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.records.append(record)
        elif isinstance(record.args, tuple) and len(record.args) == 2 and isinstance(record.args[1], Exception) \
                and not isinstance(record.args[1], (ProtocolError, HpackError)):
            self.records.append(record)


@contextlib.contextmanager
def relay_errors():
    handler = Errors()
    logger = logging.getLogger("shim.transport.relay")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


# -- HTTP/2 byte streams ----------------------------------------------------------------------

def _headers_block(path: str = CREATE_CONTAINER) -> bytes:
    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "localhost"), ("content-type", "application/grpc"),
                                   ("te", "trailers"), ("grpc-timeout", "2S")])


VALID_BLOCKS = [_headers_block(CREATE_CONTAINER), _headers_block("/runtime.v1.RuntimeService/Version"),
                _headers_block(UPDATE_CONTAINER_RESOURCES)]


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """``base`` with a few bytes flipped, cut, inserted or removed."""
    data = bytearray(base)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if op == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        elif op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=12))
        elif op == "delete" and data:
            i = draw(st.integers(0, len(data) - 1))
            del data[i:i + draw(st.integers(1, 8))]
    return bytes(data)


hpack_garbage = st.one_of(st.binary(max_size=300), st.sampled_from(VALID_BLOCKS).flatmap(mutated))


@st.composite
def raw_frame(draw) -> bytes:
    """One frame: a random or a plausible type, flags, stream id and payload; sometimes a
    header block (valid or mutated), sometimes a length field that lies."""
    ftype = draw(st.one_of(st.integers(0, 12), st.sampled_from([DATA, HEADERS, CONTINUATION, SETTINGS])))
    flags = draw(st.one_of(st.integers(0, 255), st.sampled_from([0, END_STREAM, END_HEADERS, END_HEADERS | END_STREAM,
                                                                 PADDED, PADDED | END_STREAM])))
    sid = draw(st.one_of(st.sampled_from([0, 1, 3, 5]), st.integers(0, 2**32 - 1)))
    if ftype in (HEADERS, CONTINUATION):
        payload = draw(hpack_garbage)
    elif ftype == DATA:
        body = draw(st.binary(max_size=200))
        payload = draw(st.sampled_from([b"\x00" + len(body).to_bytes(4, "big") + body, body]))
    else:
        payload = draw(st.binary(max_size=64))
    out = frame(ftype, flags, sid, payload)
    if draw(st.integers(0, 9)) == 0:  # a length field that says more or less than follows
        n = draw(st.integers(0, 2**24 - 1))
        out = n.to_bytes(3, "big") + out[3:]
    return out


streams = st.lists(raw_frame(), max_size=12).map(b"".join)


@FUZZ
@given(hpack_garbage)
def test_hpack_decoder_raises_only_hpack_errors(block):
    dec = Decoder()
    try:
        headers = dec.decode(block)
    except HpackError:
        return
    assert all(isinstance(n, bytes) and isinstance(v, bytes) for n, v in headers)
    assert dec.size <= dec.max_size


@FUZZ
@given(st.one_of(streams, st.binary(max_size=400)))
def test_frame_scan_raises_only_protocol_errors_and_stays_in_bounds(data):
    n = len(data)
    last = 0
    try:
        for ftype, flags, sid, pos, end in frames(data, 0, n):
            assert last == pos < end <= n and 0 <= sid < 2**31
            if ftype in (HEADERS, 5):
                header_block(data, ftype, flags, pos, end)
            elif ftype == DATA:
                data_payload(data, flags, pos, end)
            last = end
    except ProtocolError:
        pass


def _connection(connected: bool = True):
    """A relay Connection with the rewrite hook `serve` builds, driven (tests/relay_driver.py)."""
    driver = new_driver(_hooks(), connected=connected)
    return driver, driver.conn, driver.client, driver.upstream


@st.composite
def chunks(draw, data: bytes) -> list[bytes]:
    """``data`` cut into reads at random places."""
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=6))))
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def _buffered(driver, conn) -> int:
    """What the connection keeps of the peers' bytes: incomplete units, held requests (counted
    in the hold budget), frames waiting for a partly forwarded DATA frame."""
    return len(conn.client_frames.tail) + len(conn.server.incoming.tail) + driver.budget.held \
        + sum(len(f) for f in conn.server.deferred)


@FUZZ
@given(st.data())
def test_relay_connection_survives_any_client_stream(data):
    """A valid preface and SETTINGS, then random frames from the kubelet's side, in random
    reads; the runtime's SETTINGS in between."""
    stream = PREFACE + frame(SETTINGS, 0, 0) + data.draw(streams, "frames")
    conn, relay, client, upstream = _connection()
    with relay_errors() as errors, alarm(5):
        conn.from_server(frame(SETTINGS, 0, 0))
        for piece in data.draw(chunks(stream), "reads"):
            conn.from_client(piece)
    assert not errors, [r.getMessage() for r in errors]
    assert _buffered(conn, relay) <= len(stream)


@FUZZ
@given(st.data())
def test_relay_connection_survives_any_server_stream(data):
    """A kubelet call in progress, then random frames from the runtime's side."""
    conn, relay, client, upstream = _connection()
    req = create_container("s" * 64, sandbox_config("p", "u-1", "burstable"), "c", "burstable",
                           request=64 * MI, limit=128 * MI).SerializeToString()
    call = frame(HEADERS, END_HEADERS, 1, VALID_BLOCKS[0]) + \
        frame(DATA, END_STREAM, 1, b"\x00" + len(req).to_bytes(4, "big") + req)
    stream = frame(SETTINGS, 0, 0) + data.draw(streams, "frames")
    with relay_errors() as errors, alarm(5):
        conn.from_client(PREFACE + frame(SETTINGS, 0, 0) + call)
        for piece in data.draw(chunks(stream), "reads"):
            conn.from_server(piece)
    assert not errors, [r.getMessage() for r in errors]
    assert _buffered(conn, relay) <= len(stream) + len(call) + 64


@FUZZ
@given(st.data())
def test_refused_connection_survives_any_client_stream(data):
    """The runtime cannot be reached: the relay answers the calls UNAVAILABLE itself."""
    stream = PREFACE + frame(SETTINGS, 0, 0) + data.draw(streams, "frames")
    conn, core, client, _ = _connection(connected=False)
    conn.refuse("the runtime is down")
    with relay_errors() as errors, alarm(5):
        for piece in data.draw(chunks(stream), "reads"):
            conn.from_client(piece)
    assert not errors, [r.getMessage() for r in errors]
    assert len(core.client_frames.tail) <= len(stream)


class HostileRuntime:
    """A unix socket server that answers every connection with the bytes it is given."""

    def __init__(self, path: str) -> None:
        self.reply = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                try:
                    c.settimeout(2)
                    c.recv(65536)
                    c.sendall(self.reply)
                    c.shutdown(socket.SHUT_WR)
                    c.recv(65536)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def hostile_runtime():
    d = tempfile.mkdtemp(prefix="mqfz-")
    server = HostileRuntime(os.path.join(d, "rt.sock"))
    yield server, "unix://" + os.path.join(d, "rt.sock")
    server.sock.close()
    shutil.rmtree(d, ignore_errors=True)


@settings(FUZZ, max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(streams)
@example(frame(DATA, PADDED, 1, b""))  # raised IndexError out of call() (tests/test_h2_padding.py)
def test_unary_client_gives_a_status_whatever_the_runtime_sends(hostile_runtime, stream):
    """The reconciler's client against a runtime that sends anything after its SETTINGS: an
    answer or a CallError (a gRPC status), nothing else, within the call's timeout."""
    server, address = hostile_runtime
    server.reply = frame(SETTINGS, 0, 0) + stream
    client = UnaryClient(address)
    try:
        with alarm(10):
            client.call("/runtime.v1.RuntimeService/Version", b"", 2.0)
    except CallError:
        pass
    finally:
        client.close()


# The relay's default bounds (shim/transport/relay/limits.py): a header block is at most 1 MiB
# (HEADERS + CONTINUATION), a frame at most the advertised SETTINGS_MAX_FRAME_SIZE (16 KiB);
# past either the connection is closed.
HEADER_BLOCK_BOUND = 1 << 20
MAX_FRAME = 16384


@st.composite
def flood(draw) -> tuple[bytes, bool]:
    """Small frames, then a header block that never ends or a frame larger than allowed; and
    whether that is past a bound."""
    head = b"".join(draw(st.lists(raw_frame(), max_size=3)))
    if draw(st.booleans()):
        size = draw(st.sampled_from([1024, 16384]))
        count = draw(st.integers(1, (2 * HEADER_BLOCK_BOUND) // size))
        tail = frame(HEADERS, 0, 1, VALID_BLOCKS[1]) + frame(CONTINUATION, 0, 1, bytes(size)) * count
        return head + tail, size * count > HEADER_BLOCK_BOUND
    else:
        declared = draw(st.integers(MAX_FRAME + 1, 2**24 - 1))
        tail = frame(DATA, 0, 1, b"")[:9]
        tail = declared.to_bytes(3, "big") + tail[3:] + bytes(min(declared, draw(st.integers(0, 2 * HEADER_BLOCK_BOUND))))
        tail = frame(HEADERS, END_HEADERS, 1, VALID_BLOCKS[1]) + tail
        return head + tail, True


@settings(FUZZ, max_examples=20, phases=[Phase.explicit, Phase.generate])
@given(flood())
def test_a_client_cannot_make_the_relay_buffer_past_the_bounds(case):
    stream, past_a_bound = case
    conn, relay, client, upstream = _connection()
    conn.from_server(frame(SETTINGS, 0, 0))
    conn.from_client(PREFACE + frame(SETTINGS, 0, 0))
    most = 0
    for i in range(0, len(stream), 65536):
        conn.from_client(stream[i:i + 65536])
        most = max(most, len(relay.client_frames.tail))
        if relay.mode == "closed":
            break
    assert most <= HEADER_BLOCK_BOUND + MAX_FRAME + 9
    assert relay.mode == "closed" or not past_a_bound


# -- CRI messages through the rewrite hook ----------------------------------------------------

def _hooks() -> HookChain:
    return HookChain(build_container_qos(NODE, Policy.HARD, lambda record: None))


quantities = st.one_of(st.integers(-(2**63), INT64_MAX), st.sampled_from([0, 1, 4095, 4096, 2**62, INT64_MAX, -1]))
text = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), st.sampled_from(["", "0", "max", "64Mi", "1e100", "99999999999999999999Ei",
                                                        "-5Mi", "NaN", "Infinity", "0x10", "\x00", "１２"]))
hostile_json = st.one_of(
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), text),
                 lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
                 max_leaves=20).map(lambda v: json.dumps(v)),
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),  # deep nesting
    st.integers(1, 5000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.sampled_from(['{"c": "64Mi"', '{"c": 1e400}', '{"c": "64Mi", "c": "1Gi"}', "{}" * 1000, "\u00e9\u0000\uffff"]),
)
annotations = st.dictionaries(st.sampled_from(["memqos.io/requests", "memqos.io/request", "x", ""]) | text,
                              hostile_json | text, max_size=3)
unified = st.dictionaries(st.sampled_from(["memory.min", "memory.low", "memory.high", "memory.max",
                                           "memory.oom.group"]) | text, text | quantities.map(str), max_size=4)
parents = st.sampled_from(["/kubepods/podu-1", "/kubepods/burstable/podu-1", "/kubepods/besteffort/podu-1",
                           "kubepods-burstable-podu_1.slice", "", "/", "../../etc", "/kubepods/burstable/"]) | text


quantity_texts = st.one_of(text, quantities.map(str), st.sampled_from(
    ["8Ei", "9Ei", "16Ei", "1e18", "1e19", "9223372036854775807", "9223372036854775808", "18446744073709551616",
     "1E", "0.000001", "1.5Gi", "1Gi ", " 1Gi", "+1Gi", "1gi", "１Gi", "100m", "1e-20"]))


@st.composite
def create_requests(draw) -> bytes:
    qos = draw(st.sampled_from(["guaranteed", "burstable", "besteffort"]))
    name = draw(text) or "c"
    pod_annotations = draw(annotations)
    if draw(st.booleans()):  # the request annotation for this very container, with a hostile quantity
        pod_annotations["memqos.io/requests"] = json.dumps({name: draw(quantity_texts)})
    sb = sandbox_config(draw(text) or "p", "u-1", qos, annotations=pod_annotations)
    sb.linux.cgroup_parent = draw(parents)
    req = create_container("s" * 64, sb, name, qos, request=0, limit=0)
    r = req.config.linux.resources
    r.memory_limit_in_bytes = draw(quantities)
    r.oom_score_adj = draw(st.integers(-(2**31), 2**31 - 1))
    for k, v in draw(unified).items():
        r.unified[k] = v
    for k, v in draw(annotations).items():
        req.config.annotations[k] = v
    if draw(st.booleans()):
        req.config.linux.ClearField("resources")
    return req.SerializeToString()


@st.composite
def update_requests(draw) -> bytes:
    u = update_resources(draw(st.sampled_from(["c" * 64, "", "x"])), limit=0, oom_score_adj=0)
    u.linux.memory_limit_in_bytes = draw(quantities)
    u.linux.oom_score_adj = draw(st.integers(-(2**31), 2**31 - 1))
    for k, v in draw(unified).items():
        u.linux.unified[k] = v
    if draw(st.booleans()):
        u.ClearField("linux")
    return u.SerializeToString()


def _huge_varint(data: bytes) -> bytes:
    """A field 2 (varint) whose value runs over ten bytes, appended."""
    return data + b"\x10" + b"\xff" * 11 + b"\x01"


def cri_bytes(valid):
    return st.one_of(valid, valid.flatmap(mutated), valid.map(_huge_varint), st.binary(max_size=300))


def _runc_value(key: str, value: str) -> bool:
    """A unified memory value runc writes: "max" or a decimal in [0, int64]."""
    if value == "max" and key in ("memory.high", "memory.max"):
        return True
    return value.isdigit() and value.isascii() and int(value) <= INT64_MAX


def _check_rewrite(method: str, request: bytes, out: bytes, call: RpcCall, hook_errors: list) -> None:
    assert type(out) is bytes
    msg_cls = pb.CreateContainerRequest if method == CREATE_CONTAINER else pb.UpdateContainerResourcesRequest
    if out == request:  # forwarded unchanged: a decision that changed nothing, or a fail-open with its record
        try:
            msg_cls.FromString(request)
        except Exception:  # noqa: BLE001
            assert hook_errors or (call.rewritten is not None and isinstance(call.rewritten.audit, dict)
                                   and call.rewritten.audit.get("event") == "fail-open")
        return
    sent, got = msg_cls.FromString(request), msg_cls.FromString(out)
    if method == CREATE_CONTAINER:
        after = dict(got.config.linux.resources.unified)
        assert ANNOTATION in got.config.annotations
        for m in (sent, got):
            m.config.linux.resources.unified.clear()
            m.config.annotations.pop(ANNOTATION, None)
    else:
        after = dict(got.linux.unified)
        for m in (sent, got):
            m.linux.unified.clear()
    assert got == sent, "the rewrite changed more than unified and the shim's annotation"
    changed = {k: v for k, v in after.items() if k.startswith("memory.") and k in ("memory.min", "memory.low", "memory.high")}
    assert all(_runc_value(k, v) for k, v in changed.items()), changed


@FUZZ
@given(st.one_of(cri_bytes(create_requests()).map(lambda b: (CREATE_CONTAINER, b)),
                 cri_bytes(update_requests()).map(lambda b: (UPDATE_CONTAINER_RESOURCES, b))))
def test_rewrite_hook_forwards_or_rewrites_only_unified(case):
    method, request = case
    hooks = _hooks()
    call = RpcCall(method=method, start=0.0, request=request)
    hook_errors: list = []
    with alarm(5):
        out = guarded_rewrite(hooks, call, lambda *a: hook_errors.append(a))
    _check_rewrite(method, request, out, call, hook_errors)
