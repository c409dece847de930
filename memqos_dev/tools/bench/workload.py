"""The benchmark's workload: its sizes and targets, the requests it sends and the kubelet-like call
schedule drawn from a recorded trace."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.cri.methods import CREATE_CONTAINER
from shim.evidence.trace import open_text
from memqos_dev.testing.traces import MEMQOS_OFF, TRACES_DIR


REPO = Path(__file__).resolve().parents[3]
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

# the performance targets: metric -> (kind, limit); "added" limits are over direct, same run
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
    "b2b_added_ratio": ("abs", 2.0),
    "b2b_cpu_ms_per_create": ("abs", 0.4),
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
    back_to_back: int = 600  # calls per target and kind, sent back to back in blocks of back_to_back_block
    back_to_back_block: int = 50
    replay_seconds: float = 10.0
    replay_pods: int = 110


QUICK = Sizes(runs=1, small=800, reply200k=100, reply16m=4, throughput_seconds=1.0, throughput_blocks=1,
              load_calls=10_000, quick_calls=5, creates=100, back_to_back=200, replay_seconds=4.0)


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


BACK_TO_BACK_BYTES = 4096


def kubelet_sized_create(sandbox_id: str, sandbox: Any, name: str, size: int = BACK_TO_BACK_BYTES) -> Any:
    """A Burstable CreateContainerRequest as a kubelet fills it for a container in a namespace with
    a few services (their environment variables, the usual mounts and annotations), at least
    ``size`` bytes: the kind of create ``serve`` rewrites, at a size real pods reach."""
    from shim.tools.kubelet_requests import create_container

    req = create_container(sandbox_id, sandbox, name, "burstable", request=128 * MiB, limit=256 * MiB)
    c = req.config
    uid = sandbox.metadata.uid
    c.annotations.update({
        "io.kubernetes.container.hash": "5d3f0a1c", "io.kubernetes.container.restartCount": "0",
        "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
        "io.kubernetes.container.terminationMessagePolicy": "File", "io.kubernetes.pod.terminationGracePeriod": "30",
        "io.kubernetes.container.ports": '[{"name":"http","containerPort":8080,"protocol":"TCP"}]',
    })
    c.log_path = f"{name}/0.log"
    pod_dir = f"/var/lib/kubelet/pods/{uid}"
    for container_path, host_path, ro in (
            ("/var/run/secrets/kubernetes.io/serviceaccount", f"{pod_dir}/volumes/kubernetes.io~projected/kube-api-access-x7k2p", True),
            ("/etc/hosts", f"{pod_dir}/etc-hosts", False),
            ("/dev/termination-log", f"{pod_dir}/containers/{name}/0d1e2f3a", False),
            ("/data", f"{pod_dir}/volumes/kubernetes.io~empty-dir/data", False)):
        c.mounts.add(container_path=container_path, host_path=host_path, readonly=ro)
    k = 0
    while req.ByteSize() < size:
        svc = f"SERVICE_{k}"
        host, port = f"10.96.{k // 250}.{k % 250 + 1}", str(8000 + k)
        for key, value in ((f"{svc}_SERVICE_HOST", host), (f"{svc}_SERVICE_PORT", port),
                           (f"{svc}_PORT", f"tcp://{host}:{port}"), (f"{svc}_PORT_{port}_TCP", f"tcp://{host}:{port}"),
                           (f"{svc}_PORT_{port}_TCP_PROTO", "tcp"), (f"{svc}_PORT_{port}_TCP_PORT", port),
                           (f"{svc}_PORT_{port}_TCP_ADDR", host)):
            c.envs.add(key=key, value=value.encode())
        k += 1
    return req


@dataclass
class Workload:
    """Fake-runtime state the measurements use, created directly on the upstream."""

    exec_container: str = ""
    create_template: Any = None  # pb.CreateContainerRequest
    create_sandbox: str = ""
    large_create: Any = None  # pb.CreateContainerRequest of about BACK_TO_BACK_BYTES, same sandbox
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

    from memqos_dev.testing import cri_grpc as api_pb2_grpc
    from shim.cri import pb
    from shim.tools.kubelet_requests import create_container, sandbox_config

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
        w.large_create = kubelet_sized_create(w.create_sandbox, sbc, "app")

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
