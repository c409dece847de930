"""The soak's processes: the fake runtime (killed with SIGKILL and restarted on the same socket
by ``Faults``) and one ``memqos-shim serve`` in front of it, in a temporary directory holding a
cgroup tree of plain files, a meminfo and a KubeletConfiguration."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GI = 2**30
MI = 2**20
CAPACITY = 16 * GI
KUBELET_CONFIG = "cgroupDriver: cgroupfs\nkubeReserved: {memory: 100Mi}\nsystemReserved: {memory: 100Mi}\n"
KUBELET_VERSION = "1.33"  # given, so that `serve` does not look for a kubelet binary
PAGE = 4096


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def make_cgroup_dir(path: Path) -> None:
    """A cgroup directory as the kubelet leaves it before the shim writes to it."""
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (("memory.min", "0\n"), ("memory.low", "0\n"), ("memory.high", "max\n")):
        f = path / name
        if not f.exists():
            f.write_text(value)


class Stack:
    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mqsoak-"))  # unix socket paths must stay short
        self.extra_args = extra_args
        self.runtime_sock = self.dir / "rt.sock"
        self.shim_sock = self.dir / "shim.sock"
        self.cgroot = self.dir / "cgroup"
        self.kubelet_config = self.dir / "kubelet.yaml"
        self.meminfo = self.dir / "meminfo"
        self.audit = self.dir / "audit.jsonl"
        self.upstream: subprocess.Popen | None = None
        self.shim: subprocess.Popen | None = None
        self.upstream_starts = 0
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    # -- files
    def prepare(self) -> None:
        self.cgroot.mkdir()
        (self.cgroot / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
        for d in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
            make_cgroup_dir(self.cgroot / d)
        self.meminfo.write_text(f"MemTotal:       {CAPACITY // 1024} kB\n")
        self.kubelet_config.write_text(KUBELET_CONFIG)

    def shim_args(self) -> list[str]:
        return ["--listen", f"unix://{self.shim_sock}", "--upstream", f"unix://{self.runtime_sock}",
                "--kubelet-config", str(self.kubelet_config), "--kubelet-version", KUBELET_VERSION,
                "--cgroup-root", str(self.cgroot), "--meminfo", str(self.meminfo), "--page-size", str(PAGE),
                "--audit-log", str(self.audit), "--log-level", "warning",
                *self.extra_args]

    # -- the runtime
    def start_upstream(self, timeout: float = 30) -> None:
        log = open(self.dir / "runtime.log", "a")
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "memqos_dev.tools.soak", "upstream", "--listen", str(self.runtime_sock)],
            stdout=subprocess.PIPE, stderr=log, env=self.env, text=True)
        log.close()
        line = _readline(self.upstream, timeout)
        if "listening" not in line:
            raise RuntimeError(f"the fake runtime did not start: {(self.dir / 'runtime.log').read_text()[-2000:]}")
        self.upstream_starts += 1

    def kill_upstream(self) -> None:
        p = self.upstream
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()

    # -- the shim
    def start_shim(self, timeout: float = 60) -> None:
        self.shim = subprocess.Popen([sys.executable, "-m", "shim", "serve", *self.shim_args()],
                                     stdout=open(self.dir / "shim.log", "w"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while not self.shim_sock.exists():
            if self.shim.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"memqos-shim did not start: {(self.dir / 'shim.log').read_text()[-2000:]}")
            time.sleep(0.02)

    def shim_rss_kib(self) -> int:
        return rss_kib(self.shim.pid) if self.shim is not None else 0

    def shim_alive(self) -> bool:
        return self.shim is not None and self.shim.poll() is None

    def shim_log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "shim.log").read_text()[-n:]
        except OSError:
            return ""

    def stop(self, keep: bool = False) -> None:
        for p in (self.shim, self.upstream):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (self.shim, self.upstream):
            if p is None:
                continue
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.upstream is not None and self.upstream.stdout:
            self.upstream.stdout.close()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ""


class Faults(threading.Thread):
    """Kills the runtime every ``every`` seconds (SIGKILL) and starts it again on the same socket
    after ``down`` seconds. ``epoch`` counts the kills (raised before each one: an answer given
    while ``epoch`` is unchanged came from the runtime that holds the objects made in that
    epoch); ``windows`` are the outages, (killed at, answering again at) in ``time.monotonic``."""

    def __init__(self, stack: Stack, every: float, down: float) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.stack, self.every, self.down = stack, every, down
        self.epoch = 0
        self.windows: list[list[float]] = []
        self.stop_event = threading.Event()
        self.error: str = ""

    def run(self) -> None:
        if self.every <= 0:
            return
        while not self.stop_event.wait(self.every):
            self.epoch += 1
            window = [time.monotonic(), float("inf")]
            self.windows.append(window)
            self.stack.kill_upstream()
            time.sleep(self.down)
            try:
                self.stack.start_upstream()
            except RuntimeError as e:
                self.error = str(e)
                return
            window[1] = time.monotonic()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)

    def in_outage(self, start: float, end: float, grace: float) -> bool:
        """Did [start, end] overlap an outage (extended by ``grace`` after the runtime was back)?"""
        for killed, back in reversed(self.windows):
            if start <= back + grace and end >= killed:
                return True
            if back + grace < start:
                break
        return False
