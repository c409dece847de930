"""What `memqos-shim nri` adds to a CreateContainer at the runtime (``scripts/nri-latency``).

The runtime is the in-repo fake (``memqos_dev.testing.fake_nri_runtime``: containerd's side of NRI,
its framing written apart from the plugin's) in this process; the plugins are processes of
their own, each on its own runtime socket, as on a node:

* ``no-op``: an NRI plugin with the no-op ``Handler`` (register, Configure, Synchronize, empty
  answers): the protocol's and the interpreter's cost, the baseline;
* ``memqos``: ``memqos-shim nri`` itself (a temporary config, cgroup tree of plain files and
  audit log; the reconciler writes pod values there as the events come).

Each round runs one pod of one container through both: RunPodSandbox, CreateContainer (timed),
RemoveContainer, RemovePodSandbox (as StateChange, containerd 2.1's NRI).

Calls alternate between the two, one at a time (the runtime relays NRI events under one
node-wide lock), so the machine's drift hits both alike; the first ``--warmup`` calls of each
are not counted. Reported: p50 / p99 / mean of the CreateContainer round trip as the runtime
sees it, and what memqos adds over the no-op plugin. Then, in this process, the handler's own
time (``NriProtocol.serve`` on one CreateContainer: parse, decide, audit record, events,
answer) beside proxy mode's rewrite of the same container (parse, decide, serialize, record)
as its baseline. Bounded: ``--calls`` per plugin (2000), unix sockets under a temporary
directory, everything stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.nri import api_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
MI = 1 << 20
PODS = 20
REQUESTS = json.dumps({"app": "64Mi"})


def uid(i: int) -> str:
    return f"6b3f1a2e-0000-4000-8000-{i:012d}"


def pod(i: int) -> pb.PodSandbox:
    return pb.PodSandbox(id=f"sb{i}", name=f"p{i}", uid=uid(i), namespace="bench",
                         annotations={"memqos.io/requests": REQUESTS},
                         linux=pb.LinuxPodSandbox(cgroup_parent=f"/kubepods/burstable/pod{uid(i)}"))


def container(n: int, p: pb.PodSandbox) -> pb.Container:
    c = pb.Container(id=f"c{n}", pod_sandbox_id=p.id, name="app", state=pb.CONTAINER_CREATED,
                     annotations={"io.kubernetes.container.restartCount": "0"})
    c.linux.oom_score_adj.value = 968
    c.linux.cgroups_path = f"{p.linux.cgroup_parent}/c{n}"
    c.linux.resources.memory.limit.value = 256 * MI
    return c


def node_files(tmp: Path) -> list[str]:
    """A cgroup v2 tree of plain files, a kubelet config and a meminfo: `memqos-shim nri`'s flags."""
    root = tmp / "cgroup"
    for rel in ["kubepods", "kubepods/burstable", "kubepods/besteffort",
                *(f"kubepods/burstable/pod{uid(i)}" for i in range(PODS))]:
        (root / rel).mkdir(parents=True, exist_ok=True)
        for f in ("memory.min", "memory.low"):
            (root / rel / f).write_text("0\n")
    (root / "cgroup.controllers").write_text("memory\n")
    kubelet = tmp / "kubelet.json"
    kubelet.write_text(json.dumps({"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
                                   "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True,
                                   "kubeReserved": {"memory": "100Mi"}, "systemReserved": {"memory": "100Mi"}}))
    meminfo = tmp / "meminfo"
    meminfo.write_text("MemTotal:       8388608 kB\n")
    return ["--kubelet-config", str(kubelet), "--cgroup-root", str(root), "--meminfo", str(meminfo),
            "--kubelet-version", "1.33", "--monitor-interval", "0", "--audit-log", str(tmp / "audit.jsonl"),
            "--log-level", "warning"]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(calls: int, warmup: int, tmp: Path, extra: tuple = ()) -> dict[str, list[float]]:
    from memqos_dev.testing.fake_nri_runtime import FakeNriRuntime

    socks = {"no-op": str(tmp / "noop" / "nri.sock"), "memqos": str(tmp / "memqos" / "nri.sock")}
    commands = {
        "no-op": [sys.executable, "-m", "memqos_dev.tools.nri_latency", "--serve-noop", socks["no-op"]],
        "memqos": [sys.executable, "-m", "shim", "nri", "--nri-socket", socks["memqos"], *node_files(tmp), *extra],
    }
    times: dict[str, list[float]] = {name: [] for name in socks}
    async with FakeNriRuntime(socks["no-op"]) as rt_noop, FakeNriRuntime(socks["memqos"]) as rt_memqos:
        runtimes = {"no-op": rt_noop, "memqos": rt_memqos}
        procs = {name: subprocess.Popen(cmd, cwd=REPO) for name, cmd in commands.items()}
        try:
            conns = {name: await rt.next_plugin(timeout=60) for name, rt in runtimes.items()}
            for n in range(warmup + calls):
                p = pod(n % PODS)
                c = container(n, p)
                for name in (("no-op", "memqos") if n % 2 else ("memqos", "no-op")):
                    conn = conns[name]
                    # a pod of one container comes and goes (its start and end not timed)
                    await conn.call("StateChange", pb.StateChangeEvent(event=pb.RUN_POD_SANDBOX, pod=p), pb.Empty)
                    t = time.perf_counter()
                    await conn.create_container(p, c)
                    if n >= warmup:
                        times[name].append((time.perf_counter() - t) * 1e6)
                    for event in (pb.REMOVE_CONTAINER, pb.REMOVE_POD_SANDBOX):
                        await conn.call("StateChange", pb.StateChangeEvent(event=event, pod=p, container=c), pb.Empty)
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return times


def handler_cost(rounds: int = 15, n: int = 1000) -> tuple[float, float]:
    """(proxy mode's rewrite, the NRI handler) in microseconds per CreateContainer, medians."""
    from shim.app.service import build_container_qos
    from shim.container.nri_handler import NriMemoryQoS
    from shim.decision import NodeFacts, Policy
    from shim.nri.plugin import PLUGIN_SERVICE, NriProtocol
    from shim.tools.kubelet_requests import create_container, sandbox_config
    from shim.transport.hooks import RpcCall
    from shim.transport.wire import ttrpc

    node = NodeFacts(capacity=8 << 30, allocatable=(8 << 30) - 200 * MI, page_size=4096, factor=0.9)
    events: list = []
    handler = NriMemoryQoS(node, Policy.HARD, lambda r: None, enqueue=events.append)
    proto = NriProtocol(handler)
    p = pod(0)
    payload = pb.CreateContainerRequest(pod=p, container=container(0, p)).SerializeToString()
    sb = sandbox_config("p0", uid(0), "burstable", annotations={"memqos.io/requests": REQUESTS})
    request = create_container("sb0", sb, "app", "burstable", request=64 * MI, limit=256 * MI).SerializeToString()
    rewriter = build_container_qos(node, Policy.HARD, lambda r: None)
    path = "/runtime.v1.RuntimeService/CreateContainer"

    def nri():
        proto.serve(ttrpc.Request(PLUGIN_SERVICE, "CreateContainer", payload))
        handler.replied()  # the hand-over to the side threads, after the reply
        events.clear()

    def proxy():
        call = RpcCall(path, time.time(), request=request)
        rewriter.rewrite(call)
        call.rewritten.audit()

    def per_call(fn) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    per_call(proxy), per_call(nri)  # warm up
    pairs = [(per_call(proxy), per_call(nri)) for _ in range(rounds)]  # alternating: drift hits both
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def serve_noop(sock: str) -> int:
    from shim.nri.handler import Handler
    from shim.nri.plugin import NriPlugin

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await NriPlugin(Handler(), index="50", socket_path=sock, env={}).run(stop)

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/nri-latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="CreateContainer calls per plugin (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="calls of each not counted (default 200)")
    p.add_argument("--no-reconcile", action="store_true",
                   help="run memqos-shim nri with reconcile false (the handler's path alone)")
    p.add_argument("--serve-noop", metavar="SOCK", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_noop:
        return serve_noop(args.serve_noop)
    calls = max(1, min(args.calls, 100_000))
    with tempfile.TemporaryDirectory(prefix="nri-latency-") as d:
        extra = ("--reconcile", "false") if args.no_reconcile else ()
        times = asyncio.run(measure(calls, max(0, args.warmup), Path(d), extra))
    print(f"CreateContainer round trip at the runtime (fake NRI runtime, unix socket), {calls} calls each, "
          f"alternating, microseconds:")
    print(f"  {'plugin':<8} {'p50':>8} {'p99':>8} {'mean':>8}")
    for name, values in times.items():
        print(f"  {name:<8} {pct(values, 0.5):8.0f} {pct(values, 0.99):8.0f} {statistics.fmean(values):8.0f}")
    a, b = times["no-op"], times["memqos"]
    print(f"  memqos over no-op: p50 +{pct(b, 0.5) - pct(a, 0.5):.0f} us (x{pct(b, 0.5) / pct(a, 0.5):.2f}), "
          f"p99 +{pct(b, 0.99) - pct(a, 0.99):.0f} us")
    proxy, nri = handler_cost()
    print(f"handler's own time per CreateContainer, in process, medians: NRI handler {nri:.1f} us, proxy mode's "
          f"rewrite of the same container {proxy:.1f} us (x{nri / proxy:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
