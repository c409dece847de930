"""`scripts/bench`: the shim's cost, measured side by side with a direct connection.

One run starts a fake CRI runtime (``python -m shim.tools.bench upstream``: shim.testing.fake_runtime with
ExecSync answering a requested number of stdout bytes) and one ``memqos-shim serve`` process per
transport in front of it, each in its own process, so that the shim's CPU and RSS are read from
``/proc/<pid>``. This process is the client (grpcio: a sync channel for latencies, grpc.aio for
concurrency). Every latency measurement rotates between the targets (direct, then each shim)
call by call, so machine drift hits them alike; the figures are medians over ``--runs`` runs,
each with fresh processes.

Measured per target: p50/p99 of a small unary call (Version); p50 of 200 KB and 16 MiB
replies (ExecSync); calls/s with 32 concurrent callers; a quick call's latency while 100 slow
calls (PullImage, delayed 2 s by the runtime) are in flight; a CreateContainer (rewritten by the
shim) against a passthrough call of the same request size; shim CPU per 1000 small calls; shim
RSS idle, after 20k and 100k calls (RSS growth) and at the end; and a kubelet-like steady
load for a 110-pod node (the relist/status/stats mix of the recorded kubelet traces in tests/data/traces, per-container and
per-pod calls scaled to 110 pods, list replies as large as 110 pods make them), reporting the
shim's CPU share of one core during it.

    python -m shim.tools.bench [--quick] [--runs N] [--transport grpc,relay] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shim.cri.methods import CREATE_CONTAINER, EXEC_SYNC, PULL_IMAGE, VERSION
from shim.evidence.trace import open_text
from shim.testing.traces import MEMQOS_OFF, TRACES_DIR

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = TRACES_DIR / f"{MEMQOS_OFF}.jsonl.xz"

MiB = 1024 * 1024
CLIENT_MAX = 64 * MiB
SLOW_DELAY = 2.0  # seconds the runtime holds every PullImage
EXEC_MAGIC = "memqos-bench-output"  # ExecSync cmd [EXEC_MAGIC, "<bytes>"] answers that many stdout bytes

# Steady-state call rates of tests/data/traces/kubelet-1.23-cgroupfs-memqos-off.jsonl.xz (6 pods,
# 8 containers, seconds 25-100), used when --trace names no readable file.
BUILTIN_RATES = {
    "ListContainers": 1.99, "ListPodSandbox": 1.87, "ContainerStatus": 0.70, "Status": 0.20,
    "Version": 0.17, "ImageFsInfo": 0.09, "ListContainerStats": 0.09, "ListImages": 0.03,
}
TRACE_PODS, TRACE_CONTAINERS = 6, 8
PER_CONTAINER = {"ContainerStatus", "ContainerStats"}
PER_POD = {"PodSandboxStatus", "PodSandboxStats"}

# targets of issue E: metric -> (kind, limit); "added" limits are over direct, same run
TARGETS = {
    "small_p50_us": ("added", 150.0),
    "reply200k_p50_us": ("added", 300.0),
    "cpu_ms_per_1000": ("abs", 150.0),
    "rewrite_extra_us": ("abs", 50.0),
    "quick_under_slow_p50_ms": ("abs", 10.0),
    "throughput32_ratio": ("min", 0.7),
    "rss_idle_mib": ("abs", 35.0),
    "rss_100k_mib": ("abs", 45.0),
    "rss_growth_mib": ("abs", 2.0),
}


@dataclass
class Sizes:
    runs: int = 3
    small: int = 3000
    reply200k: int = 300
    reply16m: int = 12
    throughput_seconds: float = 2.0
    throughput_blocks: int = 2
    load_calls: int = 100_000
    quick_calls: int = 10
    creates: int = 300
    replay_seconds: float = 10.0
    replay_pods: int = 110


QUICK = Sizes(runs=1, small=800, reply200k=100, reply16m=4, throughput_seconds=1.0, throughput_blocks=1,
              load_calls=10_000, quick_calls=5, creates=100, replay_seconds=4.0)


# ------------------------------------------------------------------------------------------ upstream


def run_upstream(listen: str) -> int:
    """The benchmark's upstream: shim.testing.fake_runtime with ExecSync output of a requested size and
    PullImage delayed; calls are not kept (100k calls would grow the runtime, not the shim)."""
    from shim.cri import pb
    from shim.testing.fake_runtime.runtime import FakeRuntime
    from shim.testing.fake_runtime.server import serve_fake_runtime

    class BenchRuntime(FakeRuntime):
        _outputs: dict[int, bytes] = {}

        def _exec_sync(self, req):
            if len(req.cmd) == 2 and req.cmd[0] == EXEC_MAGIC:
                n = int(req.cmd[1])
                out = self._outputs.get(n)
                if out is None:
                    out = self._outputs[n] = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
                self._find_container(req.container_id, "no such container")
                return pb.ExecSyncResponse(stdout=out, exit_code=0)
            return super()._exec_sync(req)

        def record_call(self, method, request):
            call = super().record_call(method, request)
            with self.lock:
                self.calls.clear()
                self.received_create_requests.clear()
                self.received_update_requests.clear()
            return call

    async def main() -> None:
        runtime = BenchRuntime(delays={"PullImage": SLOW_DELAY})
        server, _ = await serve_fake_runtime(listen, runtime)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"bench upstream listening on unix://{listen}", flush=True)
        await stop.wait()
        await server.stop(0)

    asyncio.run(main())
    return 0


# ------------------------------------------------------------------------------------------ processes


def _has_transport_option() -> bool:
    from shim.app.config import OPTIONS

    return any(o.name == "transport" for o in OPTIONS)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of the process, dead ones included (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Processes:
    """The upstream and one shim per transport, in a temporary directory. ``sources`` (name ->
    (transport, checkout)) serves other checkouts instead (scripts/bench-ab)."""

    def __init__(self, transports: list[str], sources: dict[str, tuple[str, Path]] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mqsb-"))
        self.upstream_sock = self.dir / "rt.sock"
        self.upstream: subprocess.Popen | None = None
        self.shims: dict[str, subprocess.Popen] = {}
        self.socks: dict[str, Path] = {}
        self.transports = transports
        self.sources = sources or {t: (t, REPO) for t in transports}

    @staticmethod
    def env(src: Path) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # as installed on a node: modules load from bytecode (compiling them at every start would
        # add the compiler's memory to the shim's RSS)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return env

    def start(self) -> None:
        env = self.env(REPO)
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "shim.tools.bench", "upstream", "--listen", str(self.upstream_sock)],
            stdout=subprocess.PIPE, stderr=open(self.dir / "upstream.log", "w"), env=env, text=True)
        line = self.upstream.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"bench upstream did not start: {(self.dir / 'upstream.log').read_text()}")
        cg = self.dir / "cgroup"
        cg.mkdir()
        (cg / "cgroup.controllers").write_text("cpu memory pids\n")
        (self.dir / "meminfo").write_text(f"MemTotal: {16 * 1024 * 1024} kB\n")
        for t, (transport, src) in self.sources.items():
            sock = self.dir / f"shim-{t}.sock"
            cmd = [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}",
                   "--upstream", f"unix://{self.upstream_sock}", "--kubelet-config", "none",
                   "--cgroup-root", str(cg), "--meminfo", str(self.dir / "meminfo"), "--page-size", "4096",
                   "--audit-log", str(self.dir / f"audit-{t}.jsonl"), "--reconcile", "false",
                   "--monitor-interval", "0", "--log-level", "warning"]
            if src != REPO or _has_transport_option():
                cmd += ["--transport", transport]
            elif transport != "grpc":
                raise SystemExit(f"this checkout's shim has only the grpc transport, not {transport!r}")
            self.shims[t] = subprocess.Popen(cmd, stdout=open(self.dir / f"shim-{t}.log", "w"),
                                             stderr=subprocess.STDOUT, env=self.env(src), cwd=str(src))
            self.socks[t] = sock
        deadline = time.monotonic() + 60
        for t, sock in self.socks.items():
            while not sock.exists():
                if self.shims[t].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"shim ({t}) did not start: {(self.dir / f'shim-{t}.log').read_text()}")
                time.sleep(0.02)

    def defaults_rss(self, transport: str) -> float:
        """RSS of a `serve` with every default (reconciler and monitor on) 2 s after its first
        call: what the measured shims leave out (they run the transport path alone)."""
        sock = self.dir / f"defaults-{transport}.sock"
        cmd = [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}",
               "--upstream", f"unix://{self.upstream_sock}", "--kubelet-config", "none",
               "--cgroup-root", str(self.dir / "cgroup"), "--meminfo", str(self.dir / "meminfo"),
               "--audit-log", str(self.dir / f"audit-defaults-{transport}.jsonl"), "--log-level", "warning"]
        if _has_transport_option():
            cmd += ["--transport", transport]
        proc = subprocess.Popen(cmd, stdout=open(self.dir / f"defaults-{transport}.log", "w"),
                                stderr=subprocess.STDOUT, env=self.env(REPO))
        try:
            import grpc

            deadline = time.monotonic() + 30
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve with defaults did not start: "
                                       f"{(self.dir / f'defaults-{transport}.log').read_text()}")
                time.sleep(0.02)
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                ch.unary_unary(VERSION)(b"", timeout=10)
            time.sleep(2.0)
            return proc_rss_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def targets(self) -> dict[str, str]:
        out = {"direct": f"unix://{self.upstream_sock}"}
        out.update({t: f"unix://{s}" for t, s in self.socks.items()})
        return out

    def stop(self) -> None:
        for p in list(self.shims.values()) + ([self.upstream] if self.upstream else []):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in list(self.shims.values()) + ([self.upstream] if self.upstream else []):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ workload


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def padded(size: int) -> bytes:
    """A VersionRequest of ``size`` bytes: version field plus an unknown field as padding."""
    body = b"\n\x02v1"
    pad = max(0, size - len(body) - 4)
    return body + _varint(15 << 3 | 2) + _varint(pad) + b"p" * pad


def exec_request(container_id: str, size: int) -> bytes:
    from shim.cri import pb

    return pb.ExecSyncRequest(container_id=container_id, cmd=[EXEC_MAGIC, str(size)], timeout=30).SerializeToString()


@dataclass
class Workload:
    """Fake-runtime state the measurements use, created directly on the upstream."""

    exec_container: str = ""
    create_template: Any = None  # pb.CreateContainerRequest
    create_sandbox: str = ""
    replay_containers: list[str] = field(default_factory=list)
    replay_sandboxes: list[str] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)
    trace_requests: dict[str, list[bytes]] = field(default_factory=dict)
    rates_source: str = ""


def trace_calls(path: Path) -> list[dict]:
    with open_text(str(path)) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return [c for c in lines[1:] if "method" in c]


def steady_rates(calls: list[dict]) -> dict[str, float]:
    """Calls per second per method between the last StartContainer (+5 s) and the first stop."""
    starts = [c["start"] for c in calls if c["method"].endswith("/StartContainer")]
    stops = [c["start"] for c in calls if c["method"].endswith(("/StopContainer", "/StopPodSandbox"))]
    lo = max(starts) + 5.0
    hi = min(stops) - 1.0
    counts: dict[str, int] = {}
    for c in calls:
        if lo <= c["start"] < hi:
            name = c["method"].rsplit("/", 1)[1]
            counts[name] = counts.get(name, 0) + 1
    return {k: v / (hi - lo) for k, v in counts.items()}


def prepare(target: str, sizes: Sizes, trace: Path | None) -> Workload:
    """Pods and containers on the upstream: one running container for ExecSync, a sandbox for
    the CreateContainer measurement, ``replay_pods`` pods with a running container each."""
    import grpc

    from shim.cri import api_pb2_grpc, pb
    from shim.testing.kubelet_requests import create_container, sandbox_config

    w = Workload()
    calls = trace_calls(trace) if trace is not None and trace.exists() else []
    ch = grpc.insecure_channel(target)
    rt = api_pb2_grpc.RuntimeServiceStub(ch)
    try:
        sb = sandbox_config("bench-exec", "0" * 31 + "e", "besteffort")
        sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id
        cid = rt.CreateContainer(create_container(sid, sb, "exec", "besteffort"), timeout=10).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=10)
        w.exec_container = cid

        template = None
        for c in calls:  # a real kubelet's CreateContainerRequest (1.6 KB), Burstable with a limit
            if c["method"] == CREATE_CONTAINER:
                req = pb.CreateContainerRequest.FromString(base64.b64decode(c["request"]))
                if req.config.linux.resources.memory_limit_in_bytes and req.config.linux.resources.oom_score_adj > 0:
                    template = req
                    break
        uid = "b" * 32
        if template is None:
            sbc = sandbox_config("bench-create", uid, "burstable")
            template = create_container("", sbc, "main", "burstable", request=32 * MiB, limit=128 * MiB)
        sbc = template.sandbox_config
        w.create_sandbox = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sbc), timeout=10).pod_sandbox_id
        template.pod_sandbox_id = w.create_sandbox
        w.create_template = template

        for i in range(sizes.replay_pods):
            puid = f"{i:032x}"
            qos = ("burstable", "besteffort", "guaranteed")[i % 3]
            psb = sandbox_config(f"pod-{i}", puid, qos)
            psid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=psb), timeout=10).pod_sandbox_id
            lim = 256 * MiB if qos != "besteffort" else 0
            req = 64 * MiB if qos == "burstable" else lim
            pcid = rt.CreateContainer(create_container(psid, psb, "main", qos, request=req, limit=lim),
                                      timeout=10).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=pcid), timeout=10)
            w.replay_sandboxes.append(psid)
            w.replay_containers.append(pcid)
    finally:
        ch.close()

    if calls:
        w.rates = steady_rates(calls)
        w.rates_source = f"{trace.name}, steady state"
        for c in calls:
            name = c["method"].rsplit("/", 1)[1]
            if name in w.rates and name not in PER_CONTAINER and name not in PER_POD:
                w.trace_requests.setdefault(name, []).append(base64.b64decode(c["request"]))
    else:
        w.rates = dict(BUILTIN_RATES)
        w.rates_source = "built-in rates of kubelet-1.23-cgroupfs-memqos-off.jsonl"
    return w


def replay_schedule(w: Workload, pods: int, seconds: float) -> list[tuple[float, str, bytes]]:
    """(offset, method path, request) for ``seconds`` of kubelet-like steady load on ``pods`` pods:
    per-container and per-pod calls scaled from the trace's node, the rest as recorded."""
    from shim.cri import pb
    from shim.cri.methods import CRI_METHODS

    paths = {m.name: m.path for m in CRI_METHODS}
    out: list[tuple[float, str, bytes]] = []
    for name, rate in sorted(w.rates.items()):
        if name not in paths:
            continue
        if name in PER_CONTAINER:
            rate *= len(w.replay_containers) / TRACE_CONTAINERS
        elif name in PER_POD:
            rate *= len(w.replay_sandboxes) / TRACE_PODS
        n = int(round(rate * seconds))
        for i in range(n):
            if name in ("ContainerStatus", "ContainerStats"):
                cid = w.replay_containers[i % len(w.replay_containers)]
                req = (pb.ContainerStatusRequest(container_id=cid) if name == "ContainerStatus"
                       else pb.ContainerStatsRequest(container_id=cid)).SerializeToString()
            elif name in ("PodSandboxStatus", "PodSandboxStats"):
                sid = w.replay_sandboxes[i % len(w.replay_sandboxes)]
                req = (pb.PodSandboxStatusRequest(pod_sandbox_id=sid) if name == "PodSandboxStatus"
                       else pb.PodSandboxStatsRequest(pod_sandbox_id=sid)).SerializeToString()
            else:
                reqs = w.trace_requests.get(name) or [b""]
                req = reqs[i % len(reqs)]
            out.append(((i + 0.5) * seconds / n, paths[name], req))
    out.sort(key=lambda x: x[0])
    return out


REPLAY_SLICE_SECONDS = 1.0


def replay_slices(schedule: list[tuple[float, str, bytes]], seconds: float) -> list[list[tuple[float, str, bytes]]]:
    """The schedule cut into consecutive ``seconds``-long slices, each with offsets from 0."""
    out: list[list[tuple[float, str, bytes]]] = []
    for offset, method, req in schedule:
        k = int(offset // seconds)
        while len(out) <= k:
            out.append([])
        out[k].append((offset - k * seconds, method, req))
    return [part for part in out if part]


# ------------------------------------------------------------------------------------------ measuring


class Client:
    def __init__(self, targets: dict[str, str]) -> None:
        import grpc

        self.grpc = grpc
        self.targets = targets
        opts = [("grpc.max_receive_message_length", CLIENT_MAX), ("grpc.max_send_message_length", CLIENT_MAX)]
        self.opts = opts
        self.channels = {n: grpc.insecure_channel(t, options=opts) for n, t in targets.items()}
        self._mc: dict[tuple[str, str], Callable] = {}

    def unary(self, name: str, method: str) -> Callable:
        key = (name, method)
        mc = self._mc.get(key)
        if mc is None:
            mc = self._mc[key] = self.channels[name].unary_unary(method)
        return mc

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def alternate(self, method: str, requests: Callable[[int, str], bytes], n: int,
                  timeout: float = 30.0) -> dict[str, list[float]]:
        """n calls per target, the target order cycling through every permutation (so each
        target follows each other one equally often: what the previous call leaves running,
        e.g. a shim's finished() after a CreateContainer, hits them alike); latencies in
        seconds."""
        names = list(self.targets)
        out: dict[str, list[float]] = {x: [] for x in names}
        calls = {x: self.unary(x, method) for x in names}
        clock = time.perf_counter
        orders = list(itertools.permutations(names))
        for i in range(n):
            for name in orders[i % len(orders)]:
                req = requests(i, name)
                t0 = clock()
                calls[name](req, timeout=timeout)
                out[name].append(clock() - t0)
        return out

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for name in self.targets:
            while True:
                try:
                    self.unary(name, VERSION)(b"", timeout=2)
                    break
                except self.grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


async def _aio_closed_loop(target: str, opts, seconds: float | None, total: int | None, callers: int,
                           method: str = VERSION, request: bytes = b"") -> tuple[int, float]:
    import grpc

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        mc = ch.unary_unary(method)
        await mc(request, timeout=10)
        done = 0
        t_end = None if seconds is None else time.perf_counter() + seconds
        remaining = [total or 0]

        async def caller():
            nonlocal done
            while True:
                if t_end is not None:
                    if time.perf_counter() >= t_end:
                        return
                else:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                await mc(request, timeout=30)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return done, time.perf_counter() - t0


def throughput(client: Client, sizes: Sizes) -> dict[str, float]:
    names = list(client.targets)
    per: dict[str, list[float]] = {x: [] for x in names}
    for b in range(sizes.throughput_blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            n, dt = asyncio.run(_aio_closed_loop(client.targets[name], client.opts, sizes.throughput_seconds,
                                                 None, 32))
            per[name].append(n / dt)
    return {x: statistics.median(v) for x, v in per.items()}


def load_calls(target: str, opts, n: int) -> None:
    asyncio.run(_aio_closed_loop(target, opts, None, n, 32))


async def _quick_under_slow(target: str, opts, quick: int) -> list[float]:
    import grpc

    from shim.cri import pb

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        pull = ch.unary_unary(PULL_IMAGE)
        version = ch.unary_unary(VERSION)
        await version(b"", timeout=10)
        slow = [asyncio.ensure_future(pull(pb.PullImageRequest(image=pb.ImageSpec(image=f"localhost/slow:{i}"))
                                           .SerializeToString(), timeout=60)) for i in range(100)]
        await asyncio.sleep(0.5)  # all 100 reach the runtime, which holds them SLOW_DELAY s
        lat = []
        for _ in range(quick):
            t0 = time.perf_counter()
            await version(b"", timeout=30)
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
        assert not all(f.done() for f in slow), "the slow calls ended before the quick ones"
        await asyncio.gather(*slow)
        return lat


async def _replay(target: str, opts, schedule: list[tuple[float, str, bytes]]) -> list[float]:
    import grpc

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        mcs: dict[str, Any] = {}
        lat: list[float] = []
        errors = 0

        async def one(method: str, req: bytes) -> None:
            nonlocal errors
            mc = mcs.get(method) or mcs.setdefault(method, ch.unary_unary(method))
            t0 = time.perf_counter()
            try:
                await mc(req, timeout=10)
            except grpc.aio.AioRpcError:
                errors += 1
            lat.append(time.perf_counter() - t0)

        await ch.unary_unary(VERSION)(b"", timeout=10)
        t0 = time.perf_counter()
        tasks = []
        for offset, method, req in schedule:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(method, req)))
        await asyncio.gather(*tasks)
        if errors:
            raise RuntimeError(f"{errors} replayed calls failed on {target}")
        return lat


def one_run(transports: list[str], sizes: Sizes, trace: Path | None, log: Callable[[str], None]) -> dict:
    procs = Processes(transports)
    procs.start()
    client = None
    try:
        targets = procs.targets()
        client = Client(targets)
        client.wait_ready()
        shims = {t: p.pid for t, p in procs.shims.items()}
        m: dict[str, dict[str, float]] = {name: {} for name in targets}
        w = prepare(targets["direct"], sizes, trace)
        client.alternate(VERSION, lambda i, n: b"", 200)  # warm up every path
        time.sleep(0.3)
        for t, pid in shims.items():
            m[t]["rss_idle_mib"] = proc_rss_mib(pid)

        log("  small calls")
        cpu0 = {t: proc_cpu_s(pid) for t, pid in shims.items()}
        lat = client.alternate(VERSION, lambda i, n: b"", sizes.small)
        cpu1 = {t: proc_cpu_s(pid) for t, pid in shims.items()}
        for name, v in lat.items():
            m[name]["small_p50_us"] = pct(v, 50) * 1e6
            m[name]["small_p99_us"] = pct(v, 99) * 1e6
        for t in shims:
            m[t]["cpu_ms_per_1000"] = (cpu1[t] - cpu0[t]) * 1000.0 / sizes.small * 1000.0

        log("  200 KB replies")
        req200 = exec_request(w.exec_container, 200 * 1024)
        lat = client.alternate(EXEC_SYNC, lambda i, n: req200, sizes.reply200k)
        for name, v in lat.items():
            m[name]["reply200k_p50_us"] = pct(v, 50) * 1e6

        log("  throughput, 32 callers")
        for name, cps in throughput(client, sizes).items():
            m[name]["throughput32_cps"] = cps

        for t, pid in shims.items():
            log(f"  {sizes.load_calls} calls through {t}")
            first = sizes.load_calls // 5
            load_calls(targets[t], client.opts, first)
            m[t]["rss_20k_mib"] = proc_rss_mib(pid)
            c0 = proc_cpu_s(pid)
            t0 = time.perf_counter()
            load_calls(targets[t], client.opts, sizes.load_calls - first)
            dt = time.perf_counter() - t0
            m[t]["load_cpu_ms_per_1000"] = (proc_cpu_s(pid) - c0) * 1e6 / (sizes.load_calls - first)
            m[t]["load_cps"] = (sizes.load_calls - first) / dt
            m[t]["rss_100k_mib"] = proc_rss_mib(pid)
            m[t]["rss_growth_mib"] = m[t]["rss_100k_mib"] - m[t]["rss_20k_mib"]

        log("  quick call with 100 slow calls in flight")
        for name, target in targets.items():
            lat = asyncio.run(_quick_under_slow(target, client.opts, sizes.quick_calls))
            m[name]["quick_under_slow_p50_ms"] = pct(lat, 50) * 1e3
            m[name]["quick_under_slow_max_ms"] = max(lat) * 1e3

        log(f"  kubelet-like load, {sizes.replay_pods} pods (call mix: {w.rates_source})")
        schedule = replay_schedule(w, sizes.replay_pods, sizes.replay_seconds)
        m["direct"]["replay_calls_per_s"] = len(schedule) / sizes.replay_seconds
        # the schedule in 1 s slices, each replayed through every target in turn (the order
        # rotating): drift on the machine hits all targets alike, as in the alternating tests
        slices = replay_slices(schedule, REPLAY_SLICE_SECONDS)
        lats: dict[str, list[float]] = {name: [] for name in targets}
        cpu = {name: 0.0 for name in targets}
        wall = {name: 0.0 for name in targets}
        names = list(targets)
        for k, part in enumerate(slices):
            for name in names[k % len(names):] + names[:k % len(names)]:
                pid = shims.get(name)
                c0 = proc_cpu_s(pid) if pid else 0.0
                t0 = time.perf_counter()
                lats[name] += asyncio.run(_replay(targets[name], client.opts, part))
                wall[name] += time.perf_counter() - t0
                if pid:
                    cpu[name] += proc_cpu_s(pid) - c0
        for name in targets:
            m[name]["replay_p50_us"] = pct(lats[name], 50) * 1e6
            if name in shims:
                m[name]["replay_cpu_pct"] = cpu[name] / wall[name] * 100.0

        log("  16 MiB replies")
        req16 = exec_request(w.exec_container, 16 * MiB)
        lat = client.alternate(EXEC_SYNC, lambda i, n: req16, sizes.reply16m, timeout=60)
        for name, v in lat.items():
            m[name]["reply16m_p50_ms"] = pct(v, 50) * 1e3

        log("  CreateContainer (rewritten) against a passthrough call of the same size")
        template = w.create_template
        size = template.ByteSize()
        pad = padded(size)
        counter = [0]

        def create_req(i: int, name: str) -> bytes:
            counter[0] += 1
            template.config.metadata.attempt = counter[0]
            return template.SerializeToString()

        lat_create = client.alternate(CREATE_CONTAINER, create_req, sizes.creates)
        lat_pad = client.alternate(VERSION, lambda i, n: pad, sizes.creates)
        for name in targets:
            m[name]["create_p50_us"] = pct(lat_create[name], 50) * 1e6
            m[name]["passthrough_same_size_p50_us"] = pct(lat_pad[name], 50) * 1e6
        m["direct"]["create_request_bytes"] = float(size)
        m["direct"]["hook_rewrite_us"] = hook_cost(template, sizes.creates)

        time.sleep(1.5)
        for t, pid in shims.items():
            m[t]["rss_end_mib"] = proc_rss_mib(pid)
        for t in shims:
            m[t]["rss_defaults_mib"] = procs.defaults_rss(t)
            if procs.shims[t].poll() is not None:
                raise RuntimeError(f"shim ({t}) died during the run")
        return derive(m)
    finally:
        if client is not None:
            client.close()
        procs.stop()


def hook_cost(template, n: int) -> float:
    """µs per call of the decision code's rewrite() on the benchmark's CreateContainer, in this
    process, built as `serve` builds it: the share of a rewrite no transport can save."""
    from shim.decision import Policy
    from shim.node.facts import load_kubelet_config, node_facts
    from shim.app.service import build_container_qos, build_request_hooks
    from shim.transport.hooks import RpcCall

    node = node_facts(16 * 1024 * MiB, load_kubelet_config(None), page_size=4096, allocatable=None, factor="auto")
    hooks = build_request_hooks(build_container_qos(node, Policy.REQUEST, lambda record: None))
    requests = []
    for i in range(n):
        template.config.metadata.attempt = 10_000_000 + i
        requests.append(template.SerializeToString())
    t0 = time.perf_counter()
    for r in requests:
        hooks.rewrite(RpcCall(CREATE_CONTAINER, 0.0, request=r))
    return (time.perf_counter() - t0) / n * 1e6


def derive(m: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    d = m["direct"]
    for name, v in m.items():
        if name == "direct":
            continue
        for k in ("small_p50_us", "small_p99_us", "reply200k_p50_us", "reply16m_p50_ms", "replay_p50_us",
                  "create_p50_us", "passthrough_same_size_p50_us"):
            v["added_" + k] = v[k] - d[k]
        v["throughput32_ratio"] = v["throughput32_cps"] / d["throughput32_cps"]
        v["hook_rewrite_us"] = d.get("hook_rewrite_us", float("nan"))
        v["rewrite_extra_us"] = ((v["create_p50_us"] - d["create_p50_us"])
                                 - (v["passthrough_same_size_p50_us"] - d["passthrough_same_size_p50_us"]))
    return m


def median_runs(runs: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in runs[0]:
        out[name] = {}
        for k in runs[0][name]:
            vals = [r[name][k] for r in runs if k in r.get(name, {})]
            out[name][k] = statistics.median(vals)
    return out


# ------------------------------------------------------------------------------------------ report


ROWS = [
    # label, key, unit, added-over-direct?
    ("small call p50", "small_p50_us", "µs", True),
    ("small call p99", "small_p99_us", "µs", True),
    ("200 KB reply p50", "reply200k_p50_us", "µs", True),
    ("16 MiB reply p50", "reply16m_p50_ms", "ms", True),
    ("calls/s, 32 callers", "throughput32_cps", "", "ratio"),
    ("quick call, 100 slow in flight, p50", "quick_under_slow_p50_ms", "ms", False),
    ("  same, max", "quick_under_slow_max_ms", "ms", False),
    ("CreateContainer p50 (rewritten)", "create_p50_us", "µs", True),
    ("same-size passthrough p50", "passthrough_same_size_p50_us", "µs", True),
    ("rewrite extra over passthrough", "rewrite_extra_us", "µs", None),
    ("  the decision code's rewrite() alone (in-process)", "hook_rewrite_us", "µs", None),
    ("shim CPU per 1000 small calls", "cpu_ms_per_1000", "ms", None),
    ("shim CPU per 1000 calls, 32 callers", "load_cpu_ms_per_1000", "ms", None),
    ("shim RSS idle", "rss_idle_mib", "MiB", None),
    ("shim RSS after the load calls", "rss_100k_mib", "MiB", None),
    ("shim RSS growth over the last 80% of them", "rss_growth_mib", "MiB", None),
    ("serve RSS idle with every default (reconciler, monitor)", "rss_defaults_mib", "MiB", None),
    ("shim RSS at the end (16 MiB replies, creates, 1.5 s idle)", "rss_end_mib", "MiB", None),
    ("110-pod kubelet load: call p50", "replay_p50_us", "µs", True),
    ("110-pod kubelet load: shim CPU", "replay_cpu_pct", "% of a core", None),
]
TARGET_KEY = {"small_p50_us": "small_p50_us", "reply200k_p50_us": "reply200k_p50_us",
              "throughput32_cps": "throughput32_ratio"}


def _fmt(v: float | None, unit: str) -> str:
    if v is None or v != v:
        return "-"
    if unit in ("µs",):
        return f"{v:.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def verdict(key: str, v: dict[str, float]) -> tuple[str, str]:
    tkey = TARGET_KEY.get(key, key)
    if tkey not in TARGETS:
        return "", ""
    kind, limit = TARGETS[tkey]
    if kind == "added":
        value = v.get("added_" + tkey)
        return f"≤ +{limit:g}", ("met" if value is not None and value <= limit else "NOT met")
    if kind == "min":
        value = v.get(tkey)
        return f"≥ {limit:g}×", ("met" if value is not None and value >= limit else "NOT met")
    value = v.get(tkey)
    return f"≤ {limit:g}", ("met" if value is not None and value <= limit else "NOT met")


def table(result: dict) -> str:
    med = result["median"]
    shims = [n for n in med if n != "direct"]
    head = ["metric", "unit", "direct"]
    for s in shims:
        head += [f"{s}", f"{s} added", "target", "met?"]
    rows = [head]
    for label, key, unit, added in ROWS:
        d = med["direct"].get(key)
        row = [label, unit, _fmt(d, unit) if added is not None else ""]
        for s in shims:
            v = med[s]
            val = v.get(key)
            if added is True:
                extra = v.get("added_" + key)
                ratio = f" ({val / d:.2f}×)" if d and val is not None else ""
                add = ("+" + _fmt(extra, unit) if extra is not None and extra >= 0 else _fmt(extra, unit)) + ratio
            elif added == "ratio":
                add = f"{v.get('throughput32_ratio', float('nan')):.2f}× direct"
            else:
                add = ""
            t, ok = verdict(key, v)
            row += [_fmt(val, unit), add, t, ok]
        rows.append(row)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("| " + " | ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["upstream"]:
        p = argparse.ArgumentParser(prog="python -m shim.tools.bench upstream")
        p.add_argument("--listen", required=True)
        return run_upstream(p.parse_args(argv[1:]).listen)
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one short run (about a minute)")
    p.add_argument("--runs", type=int, help="runs to take medians over (default 3, --quick 1)")
    p.add_argument("--transport", default=None,
                   help="comma-separated transports of `serve` to put side by side (default: every one)")
    p.add_argument("--load-calls", type=int, help="calls for the RSS-after-load measurement (default 100000)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="kubelet trace for the steady-state mix")
    p.add_argument("--json", default=str(REPO / "out" / "bench" / "bench.json"), help="where to write the JSON")
    args = p.parse_args(argv)
    sizes = Sizes(**vars(QUICK)) if args.quick else Sizes()
    if args.runs:
        sizes.runs = args.runs
    if args.load_calls:
        sizes.load_calls = args.load_calls
    if args.transport is None:
        transports = ["grpc", "relay"] if _has_transport_option() else ["grpc"]
    else:
        transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    trace = Path(args.trace) if args.trace else None

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import compileall

    compileall.compile_dir(str(REPO / "shim"), quiet=1)  # bytecode, as `pip install` leaves it
    runs = []
    t_start = time.time()
    load = [os.getloadavg()[0]]
    for r in range(sizes.runs):
        log(f"run {r + 1}/{sizes.runs}")
        runs.append(one_run(transports, sizes, trace, log))
        load.append(os.getloadavg()[0])
    result = {
        "command": "scripts/bench " + " ".join(argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "duration_s": round(time.time() - t_start, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "loadavg_1min_before_and_after_each_run": [round(x, 2) for x in load]},
        "sizes": vars(sizes),
        "targets": {k: {"kind": v[0], "limit": v[1]} for k, v in TARGETS.items()},
        "runs": runs,
        "median": median_runs(runs),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"memqos-shim bench: {sizes.runs} run(s), medians; added = via shim − direct, same run "
          f"(calls alternate between targets); {sizes.load_calls} load calls; "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, 1-min load average "
          f"{' → '.join(f'{x:.1f}' for x in load)} (other work on the machine adds noise)")
    print(table(result))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
