"""The benchmark's processes: the fake runtime upstream and one ``memqos-shim serve`` per transport,
with the CPU time and RSS read from ``/proc``."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.cri.methods import VERSION
from memqos_dev.tools.bench.workload import EXEC_MAGIC, REPO, SLOW_DELAY


def run_upstream(listen: str) -> int:
    """The benchmark's upstream: memqos_dev.testing.fake_runtime with ExecSync output of a requested size and
    PullImage delayed; calls are not kept (100k calls would grow the runtime, not the shim)."""
    from memqos_dev.testing.fake_runtime.runtime import FakeRuntime
    from memqos_dev.testing.fake_runtime.server import serve_fake_runtime

    outputs: dict[int, bytes] = {}

    def exec_output(cmd: list[str]) -> tuple[bytes, bytes, int] | None:
        if len(cmd) != 2 or cmd[0] != EXEC_MAGIC:
            return None
        n = int(cmd[1])
        out = outputs.get(n)
        if out is None:
            out = outputs[n] = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
        return out, b"", 0

    class BenchRuntime(FakeRuntime):
        def record_call(self, method, request):
            call = super().record_call(method, request)
            with self.lock:
                self.calls.clear()
                self.received_create_requests.clear()
                self.received_update_requests.clear()
            return call

    async def main() -> None:
        runtime = BenchRuntime(delays={"PullImage": SLOW_DELAY})
        runtime.exec_sync_output = exec_output
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


def has_transport_option(tree: Path = REPO) -> bool:
    """Whether the `serve` of the checkout ``tree`` has a --transport option (read from its
    options table's source, so that another checkout is not imported)."""
    try:
        source = (tree / "shim" / "app" / "config.py").read_text()
    except OSError:
        return False
    return 'Option("transport"' in source


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of the process, dead ones included (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_precise_s(pid: int) -> float:
    """The CPU time of the process's living threads in nanoseconds (``/proc/<pid>/task/*/schedstat``,
    the scheduler's own count, not 10 ms ticks), as seconds; ``proc_cpu_s`` where there is no
    schedstat. A thread that ended between two readings is not counted (``serve``'s threads
    live as long as it does)."""
    if not os.path.exists(f"/proc/{pid}/schedstat"):
        return proc_cpu_s(pid)
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return total / 1e9


def proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Processes:
    """The upstream and one shim per transport, in a temporary directory. ``sources`` (name ->
    (transport, checkout)) serves other checkouts instead (scripts/bench-ab). The shims run the
    transport path alone (``--reconcile false --monitor-interval 0``) unless ``serve_defaults``:
    then with the reconciler and the monitor as `serve` runs by default (on the temporary
    directory's cgroup tree)."""

    def __init__(self, transports: list[str], sources: dict[str, tuple[str, Path]] | None = None, *,
                 serve_defaults: bool = False) -> None:
        self.serve_defaults = serve_defaults
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
            [sys.executable, "-m", "memqos_dev.tools.bench", "upstream", "--listen", str(self.upstream_sock)],
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
                   "--audit-log", str(self.dir / f"audit-{t}.jsonl"), "--log-level", "warning"]
            if not self.serve_defaults:
                cmd += ["--reconcile", "false", "--monitor-interval", "0"]
            if has_transport_option(src):
                cmd += ["--transport", transport]
            elif transport != "relay":
                raise SystemExit(f"the shim of {src} has no --transport option (it relays), not {transport!r}")
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
        if has_transport_option():
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
