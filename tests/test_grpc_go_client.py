"""`memqos-shim serve` driven by a grpc-go client, the HTTP/2 stack the real kubelet uses.

Every other test talks to the shim with grpcio (C-core). The kubelet is grpc-go, whose HTTP/2
differs: its SETTINGS, BDP pings and the window updates that follow them, its HPACK encoder
(dynamic table, Huffman), a separate connection per CRI service, header blocks split into
CONTINUATION frames. tests/grpcgo/main.go is a small CRI client on grpc-go (raw message bytes,
no generated code) built once per session from Debian's Go sources
(``apt-get install golang-go golang-google-grpc-dev``, see scripts/install-test-deps); without
Go these tests skip, unless MEMQOS_REQUIRE_GO=1 (as .ci/run sets), which makes that a failure.

Through the shim (the relay), with grpc-go:

1. every request of the kubelet 1.23 trace (ids mapped) answers byte-identically to the same
   calls sent straight to an identical fake runtime (same codes, messages, bytes);
2. kubelet-shaped CreateContainer requests of every QoS class arrive rewritten at the runtime,
   byte-identical to what the same requests from the grpcio client become;
3. 64 concurrent callers mixing reads and CreateContainer all get correct answers;
4. a 20 MiB response, a 20 MiB request (above the relay's 16 MiB hold cap: passes unchanged) and
   a 12 MiB one (held and rewritten);
5. a server stream arrives whole and in order; a 40 KiB header block (HEADERS + CONTINUATION)
   passes the relay;
6. an error's code, message and binary details pass through;
and a deadline cancels the runtime's call, and the connections recover after a runtime restart
(the relay bugs this found: an idle refused connection kept refusing after the runtime was back;
a 12 MiB held CreateContainer was reset when the runtime raised its initial window mid-transfer,
see tests/test_relay_flow_control.py).
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

import memqos_dev.testing.fake_runtime.records as fake_runtime_records
from shim.cri import pb
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.tools.kubelet_requests import create_container, sandbox_config
from shim.evidence.trace import open_text
from memqos_dev.testing.traces import MEMQOS_OFF, trace_file

try:
    from tests.test_serve import ALLOC, CAPACITY, Shim, expected_high, short_dir
    from tests.upstream_echo import MAX_MESSAGE, EchoUpstream, _Router, length_delimited, response_bytes
except ImportError:  # run from inside tests/
    from test_serve import ALLOC, CAPACITY, Shim, expected_high, short_dir
    from upstream_echo import MAX_MESSAGE, EchoUpstream, _Router, length_delimited, response_bytes

HERE = Path(__file__).resolve().parent
GO_SOURCE = HERE / "grpcgo" / "main.go"
GOPATH = "/usr/share/gocode"
TRACE = trace_file(MEMQOS_OFF)
MI = 2**20

RS = "/runtime.v1.RuntimeService/"
VERSION = RS + "Version"
RUN_POD_SANDBOX = RS + "RunPodSandbox"
STOP_POD_SANDBOX = RS + "StopPodSandbox"
REMOVE_POD_SANDBOX = RS + "RemovePodSandbox"
CREATE_CONTAINER = RS + "CreateContainer"
START_CONTAINER = RS + "StartContainer"
REMOVE_CONTAINER = RS + "RemoveContainer"
LIST_CONTAINERS = RS + "ListContainers"
LIST_POD_SANDBOX = RS + "ListPodSandbox"
CONTAINER_STATUS = RS + "ContainerStatus"
EXEC_SYNC = RS + "ExecSync"
EVENTS = RS + "GetContainerEvents"
LIST_IMAGES = "/runtime.v1.ImageService/ListImages"

CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


# ------------------------------------------------------------------------------ the grpc-go client


def _build_client(out_dir: Path) -> tuple[Path | None, str]:
    """(the binary, "") or (None, why it could not be built)."""
    go = shutil.which("go")
    if go is None:
        return None, "no `go` on PATH (apt-get install golang-go golang-google-grpc-dev; scripts/install-test-deps)"
    if not (Path(GOPATH) / "src/google.golang.org/grpc").is_dir():
        return None, f"grpc-go sources not in {GOPATH} (apt-get install golang-google-grpc-dev)"
    env = dict(os.environ, GO111MODULE="off", GOPATH=GOPATH, GOFLAGS="", CGO_ENABLED="0")
    if "GOCACHE" not in env and not env.get("HOME") and not env.get("XDG_CACHE_HOME"):
        env["GOCACHE"] = str(out_dir / "gocache")
    binary = out_dir / "grpcgo"
    try:
        p = subprocess.run([go, "build", "-o", str(binary), str(GO_SOURCE)], env=env, cwd=out_dir,
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "go build did not finish within 300 s"
    if p.returncode != 0:
        return None, f"go build failed ({p.returncode}):\n{p.stdout}{p.stderr}"
    return binary, ""


@pytest.fixture(scope="session")
def grpcgo(tmp_path_factory) -> Path:
    binary, why = _build_client(tmp_path_factory.mktemp("grpcgo"))
    if binary is None:
        if os.environ.get("MEMQOS_REQUIRE_GO") == "1":
            pytest.fail(f"MEMQOS_REQUIRE_GO=1 but the grpc-go test client cannot be built: {why}", pytrace=False)
        pytest.skip(f"grpc-go test client not built: {why}")
    return binary


@dataclass
class Result:
    method: str
    code: str
    message: str
    responses: list[bytes]
    details: bytes = b""
    header: dict = field(default_factory=dict)
    trailer: dict = field(default_factory=dict)

    @property
    def answer(self) -> tuple:
        """What the client saw of the call, to compare two paths."""
        return self.code, self.message, self.responses, self.details

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def _result(line: str) -> tuple[int, Result]:
    d = json.loads(line)
    if d["code"] < 0:
        raise AssertionError(f"grpcgo refused a call: {d['message']}")
    return d["id"], Result(d["method"], CODE_NAMES.get(d["code"], str(d["code"])), d["message"],
                           [base64.b64decode(r) for r in d["responses"]], base64.b64decode(d["details"]),
                           d["header"], d["trailer"])


def _call_line(i: int, method: str, request: bytes, timeout: float, stream: bool, metadata: dict | None) -> str:
    c = {"id": i, "method": method, "request": base64.b64encode(request).decode(), "timeout": timeout}
    if stream:
        c["stream"] = True
    if metadata:
        c["metadata"] = metadata
    return json.dumps(c) + "\n"


def _client_args(binary: Path, target: str, max_recv: int | None, max_send: int | None) -> list[str]:
    args = [str(binary), "-target", target]
    if max_recv:
        args += ["-max-recv", str(max_recv)]
    if max_send:
        args += ["-max-send", str(max_send)]
    return args


class GoClient:
    """One grpc-go client process (its two connections stay up), driven one call at a time."""

    def __init__(self, binary: Path, target: str, *, max_recv: int | None = None, max_send: int | None = None):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(_client_args(binary, target, max_recv, max_send), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1)
        self.ids = itertools.count(1)

    def call(self, method: str, request: bytes = b"", *, timeout: float = 10.0, stream: bool = False,
             metadata: dict | None = None) -> Result:
        i = next(self.ids)
        self.proc.stdin.write(_call_line(i, method, request, timeout, stream, metadata))
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise AssertionError(f"grpcgo exited ({self.proc.wait()}): {self.stderr.read().decode()}")
        got, result = _result(line)
        assert got == i
        return result

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


def go_batch(binary: Path, target: str, calls: list[tuple], *, workers: int, max_recv: int | None = None,
             max_send: int | None = None, timeout: float = 60) -> list[Result]:
    """Run ``calls`` ((method, request[, call timeout]) ...) on ``workers`` parallel callers of
    one client process; the results in the order of ``calls``."""
    lines = "".join(_call_line(i, c[0], c[1], c[2] if len(c) > 2 else 10.0, False, None) for i, c in enumerate(calls))
    p = subprocess.run(_client_args(binary, target, max_recv, max_send) + ["-workers", str(workers)],
                       input=lines, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    results = dict(_result(line) for line in p.stdout.splitlines())
    assert sorted(results) == list(range(len(calls)))
    return [results[i] for i in range(len(calls))]


# ------------------------------------------------------------------------------ kubelet-shaped pods


def run_pod(go: GoClient, name: str, qos: str, annotations: dict | None = None) -> tuple[str, pb.PodSandboxConfig]:
    uid = hashlib.sha256(name.encode()).hexdigest()[:8] + "-0000-4000-8000-000000000000"
    sb = sandbox_config(name, uid, qos, annotations=annotations)
    r = go.call(RUN_POD_SANDBOX, pb.RunPodSandboxRequest(config=sb).SerializeToString())
    assert r.ok, r
    return pb.RunPodSandboxResponse.FromString(r.responses[0]).pod_sandbox_id, sb


def create_request(sid: str, sb: pb.PodSandboxConfig, name: str, qos: str, request: int, limit: int) -> bytes:
    return create_container(sid, sb, name, qos, request=request, limit=limit, capacity=CAPACITY).SerializeToString()


def expected_unified(qos: str, request: int, limit: int) -> dict:
    """Burstable requests are given exactly through the pod annotation (as in test_serve)."""
    if qos == "guaranteed":  # memory.min max(ceil(10%), 8Mi) under the limit, page-rounded; memory.low the request
        cap = limit - max(-(-limit // 10), 8 * 2**20)
        return {"memory.min": str(cap // 4096 * 4096), "memory.low": str(limit)}
    if qos == "burstable":
        return {"memory.min": str(request), "memory.high": str(expected_high(request, limit or ALLOC))}
    return {"memory.high": str(expected_high(0, ALLOC))}


def container_id(r: Result) -> str:
    assert r.ok, r
    return pb.CreateContainerResponse.FromString(r.responses[0]).container_id


def received_unified(runtime, cid: str) -> dict:
    return dict(runtime.container(cid).create_request.config.linux.resources.unified)


# ------------------------------------------------------------------------------ stacks


class Stack:
    """The fake runtime, `memqos-shim serve` in front of it, and grpc-go clients
    through the shim (``go``) and straight to the runtime (``direct``)."""

    def __init__(self, binary: Path, upstream_server=None, *, cgroup_v2: bool = True):
        self.binary = binary
        self.base = short_dir()
        self.server = upstream_server or FakeRuntimeServer(self.base / "runtime.sock")
        if isinstance(self.server, FakeRuntimeServer):
            self.server.start()
            self.runtime = self.server.runtime
        self.upstream_path = self.server.path
        self.shim = Shim(self.base, "unix://" + self.upstream_path, cgroup_v2=cgroup_v2)
        self.shim_path = str(self.shim.sock)
        self.clients: list[GoClient] = []
        self.go = self.client()
        self.direct = self.client(direct=True)

    def client(self, *, direct: bool = False, **kw) -> GoClient:
        c = GoClient(self.binary, self.upstream_path if direct else self.shim_path, **kw)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.shim.stop()
        self.server.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(grpcgo):
    s = Stack(grpcgo)
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------------------------------ 1: the kubelet trace


def _trace_calls() -> list[dict]:
    with open_text(str(TRACE)) as f:
        return [c for c in map(json.loads, f) if "method" in c]


def _replay(go: GoClient, calls: list[dict], clock: list[int], creates: list[bytes] | None = None):
    """Send the trace's requests in order with the recorded sandbox and container ids replaced
    by the new ones (same length, so the bytes stay valid protobuf); with ``creates``, the k-th
    CreateContainer sends ``creates[k]`` instead. Returns [(method, request sent, Result)]."""
    ids: dict[bytes, bytes] = {}
    out = []
    k = 0
    for c in calls:
        method = c["method"]
        request = base64.b64decode(c["request"])
        for old, new in ids.items():
            request = request.replace(old, new)
        if method == CREATE_CONTAINER and creates is not None:
            request = creates[k]
            k += 1
        clock[0] = int(c["start"] * 1e9)  # the fake runtime's timestamps: the trace's, in both runs
        r = go.call(method, request)
        out.append((method, request, r))
        if r.ok and c["code"] == "OK" and method in (RUN_POD_SANDBOX, CREATE_CONTAINER):
            cls = pb.RunPodSandboxResponse if method == RUN_POD_SANDBOX else pb.CreateContainerResponse
            recorded = cls.FromString(base64.b64decode(c["responses"][0])).ListFields()[0][1]
            new = cls.FromString(r.responses[0]).ListFields()[0][1]
            assert len(recorded) == len(new) == 64
            ids[recorded.encode()] = new.encode()
    return out


def test_kubelet_trace_answers_like_the_runtime(grpcgo, monkeypatch):
    """Every kubelet request of the trace, through the shim, gets the answer the runtime gives
    the same call directly. Two identical fake runtimes (ids and clock made deterministic): one
    behind the shim, one called directly with the requests exactly as the shim forwarded them
    (its CreateContainer rewritten), so every answer must be byte-identical."""
    calls = _trace_calls()
    serial = itertools.count()
    clock = [0]
    monkeypatch.setattr(fake_runtime_records, "generate_id", lambda: hashlib.sha256(b"%d" % next(serial)).hexdigest())
    monkeypatch.setattr(fake_runtime_records, "now_ns", lambda: clock[0])

    s = Stack(grpcgo)
    try:
        through = _replay(s.go, calls, clock)
        forwarded = list(s.runtime.received_create_requests)
        records = s.shim.records(len(forwarded))
    finally:
        s.close()
    serial = itertools.count()
    base = short_dir()
    try:
        with FakeRuntimeServer(base / "runtime.sock") as direct_server:
            go = GoClient(grpcgo, direct_server.path)
            try:
                direct = _replay(go, calls, clock, creates=forwarded)
            finally:
                go.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    assert len(through) == len(direct) == len(calls)
    differ = [(i, m, r.answer, d.answer) for i, ((m, _, r), (_, _, d)) in enumerate(zip(through, direct))
              if r.answer != d.answer]
    assert differ == [], f"{len(differ)} answers differ; first: {differ[0]}"
    # every call succeeded, as it did for the kubelet, on each of the 17 methods it used
    assert [r.code for _, _, r in through] == [c["code"] for c in calls] == ["OK"] * len(calls)
    assert len({m for m, _, _ in through}) == 17
    # the creates were rewritten (the shim added memory.min / memory.high) and audited
    sent_creates = [req for m, req, _ in through if m == CREATE_CONTAINER]
    assert len(forwarded) == len(sent_creates) == 8
    assert all(f != s for f, s in zip(forwarded, sent_creates))
    assert [r["code"] for r in records] == ["OK"] * 8


# ------------------------------------------------------------------------------ 2: rewritten creates


QOS_CASES = [
    # name, qos, request, limit
    ("guaranteed", "guaranteed", 256 * MI, 256 * MI),
    ("burstable-limit", "burstable", 128 * MI, 512 * MI),
    ("burstable-nolimit", "burstable", 64 * MI, 0),
    ("besteffort", "besteffort", 0, 0),
]


@pytest.mark.parametrize("name,qos,req,limit", QOS_CASES, ids=[c[0] for c in QOS_CASES])
def test_create_container_is_rewritten_as_from_the_python_client(stack, name, qos, req, limit):
    """The same kubelet-shaped pod, created through the shim by grpcio and then (after the first
    is removed) by grpc-go: the runtime receives the same rewritten bytes (but for the new
    sandbox id), with the expected memory.min / memory.high."""
    runtime = stack.runtime
    ann = {"memqos.io/requests": json.dumps({"main": str(req)})} if qos == "burstable" else None
    uid = hashlib.sha256(name.encode()).hexdigest()[:8] + "-1111-4000-8000-000000000000"
    sb = sandbox_config(f"py-go-{name}", uid, qos, annotations=ann)

    rt = stack.shim.rt  # grpcio
    sid_py = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id
    cid_py = rt.CreateContainer(create_container(sid_py, sb, "main", qos, request=req, limit=limit,
                                                 capacity=CAPACITY), timeout=10).container_id
    from_python = runtime.container(cid_py).create_request_bytes
    rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid_py), timeout=10)
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid_py), timeout=10)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid_py), timeout=10)

    r = stack.go.call(RUN_POD_SANDBOX, pb.RunPodSandboxRequest(config=sb).SerializeToString())
    sid_go = pb.RunPodSandboxResponse.FromString(r.responses[0]).pod_sandbox_id
    sent = create_request(sid_go, sb, "main", qos, req, limit)
    cid_go = container_id(stack.go.call(CREATE_CONTAINER, sent))
    from_go = runtime.container(cid_go).create_request_bytes

    assert sid_go != sid_py and len(sid_go) == len(sid_py)
    assert from_go != sent
    assert from_go.replace(sid_go.encode(), sid_py.encode()) == from_python
    assert received_unified(runtime, cid_go) == expected_unified(qos, req, limit)
    record = stack.shim.record_for(cid_go)
    assert record["qos"].lower() == qos and record["code"] == "OK"


# ------------------------------------------------------------------------------ 3: 64 callers


def test_64_concurrent_callers(stack):
    """64 grpc-go callers on the kubelet's two connections: reads of a pod that does not change
    answer exactly like the runtime does; 128 concurrent CreateContainer calls into three pods
    (one per QoS class) are each rewritten for their own container."""
    go, runtime = stack.go, stack.runtime
    tag = "conc"
    names = [f"c{i}" for i in range(128)]
    sizes = {n: ((i % 7) + 1) * 32 * MI for i, n in enumerate(names)}  # request; limit 2x (0 for every 3rd)
    pods = {
        "guaranteed": run_pod(go, f"{tag}-g", "guaranteed"),
        "burstable": run_pod(go, f"{tag}-b", "burstable",
                             {"memqos.io/requests": json.dumps({n: str(sizes[n]) for n in names})}),
        "besteffort": run_pod(go, f"{tag}-be", "besteffort"),
    }
    still_sid, still_sb = run_pod(go, f"{tag}-still", "burstable")
    still = [container_id(go.call(CREATE_CONTAINER, create_request(still_sid, still_sb, f"s{i}", "burstable",
                                                                 64 * MI, 128 * MI))) for i in range(4)]
    reads = [(VERSION, b""), (LIST_POD_SANDBOX, b""), (LIST_IMAGES, b""),
             (LIST_CONTAINERS, pb.ListContainersRequest(
                 filter=pb.ContainerFilter(pod_sandbox_id=still_sid)).SerializeToString())]
    reads += [(CONTAINER_STATUS, pb.ContainerStatusRequest(container_id=c, verbose=True).SerializeToString())
              for c in still]
    baseline = {m + repr(q): stack.direct.call(m, q).answer for m, q in reads}

    calls: list[tuple] = []
    expected: list = []
    qos_of = list(pods)
    for i in range(640):
        if i % 5 == 4:
            n = names[i // 5]
            qos = qos_of[(i // 5) % 3]
            req = 0 if qos == "besteffort" else sizes[n]
            limit = 0 if qos == "besteffort" else req if qos == "guaranteed" else (0 if i % 3 == 0 else 2 * req)
            sid, sb = pods[qos]
            calls.append((CREATE_CONTAINER, create_request(sid, sb, n, qos, req, limit)))
            expected.append((qos, req, limit))
        else:
            m, q = reads[i % len(reads)]
            calls.append((m, q))
            expected.append(baseline[m + repr(q)])
    results = go_batch(stack.binary, stack.shim_path, calls, workers=64)

    created = 0
    for (m, q), want, r in zip(calls, expected, results):
        if m == CREATE_CONTAINER:
            cid = container_id(r)
            assert runtime.container(cid).create_request.config.metadata.name in names
            assert received_unified(runtime, cid) == expected_unified(*want), (want, cid)
            created += 1
        else:
            assert r.answer == want, m
    assert created == 128
    assert len(set(runtime.received_create_requests)) == len(runtime.received_create_requests)


# ------------------------------------------------------------------------------ 4: 20 MiB both ways


def test_20mib_response(stack):
    """A 20 MiB ExecSync answer: identical through the shim and direct with the client's limit
    raised; with the kubelet's 16 MiB limit, the same RESOURCE_EXHAUSTED either way."""
    go, runtime = stack.go, stack.runtime
    sid, sb = run_pod(go, "big", "besteffort")
    cid = container_id(go.call(CREATE_CONTAINER, create_request(sid, sb, "main", "besteffort", 0, 0)))
    assert go.call(START_CONTAINER, pb.StartContainerRequest(container_id=cid).SerializeToString()).ok
    stdout = os.urandom(20 * MI)
    runtime.exec_sync_result = (stdout, b"err", 0)
    try:
        exec_req = pb.ExecSyncRequest(container_id=cid, cmd=["cat", "big"], timeout=10).SerializeToString()
        big_through = stack.client(max_recv=32 * MI)
        big_direct = stack.client(direct=True, max_recv=32 * MI)
        r = big_through.call(EXEC_SYNC, exec_req, timeout=30)
        d = big_direct.call(EXEC_SYNC, exec_req, timeout=30)
        assert r.ok, r.message
        assert r.answer == d.answer
        assert pb.ExecSyncResponse.FromString(r.responses[0]).stdout == stdout
        small_r = go.call(EXEC_SYNC, exec_req, timeout=30)
        small_d = stack.direct.call(EXEC_SYNC, exec_req, timeout=30)
        assert small_r.code == small_d.code == "RESOURCE_EXHAUSTED"
        assert small_r.answer == small_d.answer
        assert go.call(VERSION).ok  # the connection is still good
    finally:
        runtime.exec_sync_result = (b"", b"", 0)


@pytest.mark.parametrize("pad_mib", [12, 20])
def test_large_create_container(stack, pad_mib):
    """A CreateContainer padded with an unknown field to 12 or 20 MiB: below the relay's 16 MiB
    hold cap it is held and rewritten (the padding kept); above it the relay forwards it
    unchanged (fail-open)."""
    go_big = stack.client(max_send=32 * MI)
    runtime = stack.runtime
    sid, sb = run_pod(go_big, f"pad{pad_mib}", "guaranteed")
    pad = length_delimited(1000, os.urandom(pad_mib * MI))
    sent = create_request(sid, sb, "main", "guaranteed", 256 * MI, 256 * MI) + pad
    cid = container_id(go_big.call(CREATE_CONTAINER, sent, timeout=30))
    received = runtime.container(cid).create_request_bytes
    assert pad in received
    if pad_mib > 16:
        assert received == sent
    else:
        assert received_unified(runtime, cid) == expected_unified("guaranteed", 256 * MI, 256 * MI)
    assert go_big.call(VERSION).ok


# ------------------------------------------------------------------------------ 5, 6: streams, errors


class _Echo(EchoUpstream):
    """tests/upstream_echo.py's generic runtime, with room for large header blocks."""

    async def start(self) -> None:
        server = grpc.aio.server(options=(
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_metadata_size", 256 * 1024), ("grpc.absolute_max_metadata_size", 256 * 1024)))
        server.add_generic_rpc_handlers([_Router(self._handlers)])
        server.add_insecure_port("unix:" + self.path)
        await server.start()
        self._server = server


class EchoServer:
    """The echo upstream on its own event loop thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.echo = _Echo(path)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="echo upstream", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.echo.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.echo.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def echo_stack(grpcgo):
    base = short_dir()
    server = EchoServer(str(base / "echo.sock"))
    s = Stack(grpcgo, server)
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(base, ignore_errors=True)


def test_server_stream_in_order(echo_stack):
    """GetContainerEvents: 3000 messages, the first 4 MiB, in order and identical to the direct
    answer."""
    echo = echo_stack.server.echo
    echo.behave(EVENTS, stream_messages=3000, response_size=4 * MI)
    request = b"\n\x03abc"
    r = echo_stack.go.call(EVENTS, request, stream=True, timeout=30)
    d = echo_stack.direct.call(EVENTS, request, stream=True, timeout=30)
    assert r.ok, r.message
    assert r.responses == [response_bytes(EVENTS, request, i, 4 * MI if i == 0 else None) for i in range(3000)]
    assert r.answer == d.answer


def test_stream_error_after_messages_and_error_details(echo_stack):
    """A stream failing after 5 messages, and a unary error with grpc-status-details-bin and a
    non-ASCII message: code, message, details and trailing metadata as sent."""
    echo = echo_stack.server.echo
    detail = pb.VersionResponse(version="detail").SerializeToString()
    # google.rpc.Status{code 9, message, details [Any{type_url, value}]}
    any_ = length_delimited(1, b"type.googleapis.com/runtime.v1.VersionResponse") + length_delimited(2, detail)
    message = "pod sandbox \u00e9chec: 100% \u2713"
    status = b"\x08\x09" + length_delimited(2, message.encode()) + length_delimited(3, any_)
    trailing = (("grpc-status-details-bin", status), ("x-why", "because"))
    echo.behave(VERSION, fail=(grpc.StatusCode.FAILED_PRECONDITION, message, trailing))
    echo.behave(EVENTS, stream_messages=10, fail=(grpc.StatusCode.ABORTED, "gone", ()), fail_after=5)
    try:
        r = echo_stack.go.call(VERSION, b"\n\x05x.y.z")
        d = echo_stack.direct.call(VERSION, b"\n\x05x.y.z")
        assert (r.code, r.message, r.details) == ("FAILED_PRECONDITION", message, status)
        assert r.answer == d.answer
        assert r.trailer.get("x-why") == ["because"] == d.trailer.get("x-why")
        s = echo_stack.go.call(EVENTS, b"", stream=True)
        assert (s.code, s.message) == ("ABORTED", "gone")
        assert s.responses == [response_bytes(EVENTS, b"", i) for i in range(5)]
        assert s.answer == echo_stack.direct.call(EVENTS, b"", stream=True).answer
    finally:
        echo.behaviours.clear()


def test_large_header_block_in_continuation_frames(echo_stack):
    """40 KiB of request metadata: grpc-go sends the header block as HEADERS + CONTINUATION
    frames; the call and the HPACK state after it are fine."""
    echo = echo_stack.server.echo
    value = "v" * (40 * 1024)
    r = echo_stack.go.call(VERSION, b"\n\x01a", metadata={"x-big": value})
    assert r.ok, r.message
    assert r.responses == [response_bytes(VERSION, b"\n\x01a")]
    assert echo.calls(VERSION)[-1].md("x-big") == [value]
    for i in range(3):  # the header table both sides share is intact
        assert echo_stack.go.call(VERSION, b"\n\x01b", metadata={"x-big": value, "x-i": str(i)}).ok


# ------------------------------------------------------------------------------ deadlines, runtime restart


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_deadline_cancels_the_runtime_call(stack):
    """grpc-go's grpc-timeout (its own encoding) reaches the runtime, and at the deadline its
    RST_STREAM cancels the runtime's call: DEADLINE_EXCEEDED as when calling directly, audited
    as DEADLINE_EXCEEDED for a held CreateContainer."""
    go, runtime = stack.go, stack.runtime
    name = "slow"
    sid, sb = run_pod(go, name, "guaranteed")
    runtime.delays["CreateContainer"] = 2.0
    try:
        r = go.call(CREATE_CONTAINER, create_request(sid, sb, "main", "guaranteed", 64 * MI, 64 * MI), timeout=0.3)
        through = runtime.calls_of("CreateContainer")[-1]
        d = stack.direct.call(CREATE_CONTAINER, create_request(sid, sb, "main2", "guaranteed", 64 * MI, 64 * MI),
                              timeout=0.3)
    finally:
        runtime.delays.clear()
    assert r.code == d.code == "DEADLINE_EXCEEDED"
    # grpc-go's own timer or the runtime's (grpc-core) answer, whichever came first, either way
    assert {r.message, d.message} <= {"context deadline exceeded", "Deadline Exceeded"}
    assert _wait_for(lambda: through.code == "CANCELLED"), through
    assert runtime.containers_in(sid) == []
    assert _wait_for(lambda: any(x.get("pod") == f"default/{name}" for x in stack.shim.records(0, timeout=0)))
    record = next(x for x in stack.shim.records(0, timeout=0) if x.get("pod") == f"default/{name}")
    assert record["code"] == "DEADLINE_EXCEEDED"
    assert container_id(go.call(CREATE_CONTAINER, create_request(sid, sb, "main", "guaranteed", 64 * MI, 64 * MI)))


def test_runtime_restart(stack):
    """The runtime goes away and comes back: grpc-go's calls fail UNAVAILABLE meanwhile, and its
    connections recover on their own (as the kubelet's must) once the runtime is back -- also
    the ImageService connection, which had no call during the outage. grpc-go reconnects at once
    when the relay closes a connection, so that connection was a refused one, idle; the relay
    closes those after a second (REFUSED_IDLE_CLOSE), else the first call on it after the
    runtime is back would still be answered "cannot reach the runtime"."""
    go = stack.go
    assert go.call(VERSION).ok and go.call(LIST_IMAGES).ok
    stack.server.stop()
    try:
        time.sleep(0.3)  # both connections were closed with the runtime's and reconnected
        for _ in range(3):
            r = go.call(VERSION)
            assert r.code == "UNAVAILABLE", r
    finally:
        stack.server.start()
    assert _wait_for(lambda: go.call(VERSION).ok, 15)
    time.sleep(1.5)
    r = go.call(LIST_IMAGES)
    assert r.ok, r
