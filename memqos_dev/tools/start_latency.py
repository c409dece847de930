"""How long `memqos-shim serve` takes from exec to its first forwarded call (``scripts/start-latency``).

One fake runtime (``python -m memqos_dev.testing.fake_runtime``) serves as the upstream. Each round
execs, in turn:

* ``python -c pass``: the interpreter alone (the floor);
* ``runtime``: a second fake runtime, exec -> its first Version answered (a Python gRPC server
  started from nothing: the baseline the shim is compared with);
* ``shim``: ``serve`` in front of the upstream (a tmp socket, the audit log in a tmp file, no
  kubelet executable on PATH), exec -> the first Version answered *through the shim* (the call
  is forwarded to the upstream and back);
* ``shim, slow kubelet``: the same with a ``kubelet`` on PATH whose ``--version`` sleeps
  ``--kubelet-sleep`` seconds (5) the first time it runs and answers at once afterwards: a
  kubelet binary read from a cold page cache. The time until the audit log's
  ``kubelet-version-known`` record is reported too (a shim that gives up leaves none).

Each call is retried every 2 ms (a new connection each time) until it is answered. Rounds
alternate the cases so the machine's drift hits all alike; the first round warms the page
cache and bytecode and is not counted. ``--ref REF`` adds the same two shim cases for a git ref
(``git archive``'d into a temporary directory) side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.cri.methods import VERSION
from shim.transport.unary_client import CallError, UnaryClient

REPO = Path(__file__).resolve().parents[2]
GOAL = 1.0  # seconds from exec to the first forwarded call


def first_answer(sock: Path, proc: subprocess.Popen, t0: float, limit: float = 60.0) -> float:
    """Seconds from t0 until a Version call on sock is answered OK."""
    while True:
        client = UnaryClient(f"unix://{sock}", connect_timeout=0.2)
        try:
            client.call(VERSION, b"", 2.0)
            return time.monotonic() - t0
        except CallError:
            pass
        finally:
            client.close()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before answering")
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"{proc.args[:4]} did not answer within {limit} s")
        time.sleep(0.002)


def cpu_s(pid: int) -> float:
    """utime + stime of the process so far, every thread (10 ms ticks): the work it did, which a
    loaded machine does not inflate the way it inflates wall time."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_record(path: Path, event: str, t0: float, limit: float) -> float | None:
    while time.monotonic() - t0 < limit:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("event") == event:
                        return time.monotonic() - t0
                except ValueError:
                    pass
        time.sleep(0.01)
    return None


class Bench:
    def __init__(self, work: Path, kubelet_sleep: float):
        self.work = work
        self.kubelet_sleep = kubelet_sleep
        self.upstream = work / "rt.sock"
        (work / "cg").mkdir()
        (work / "cg" / "cgroup.controllers").write_text("cpu memory pids\n")
        (work / "meminfo").write_text(f"MemTotal: {16 * 1024 * 1024} kB\n")
        self.empty_bin = work / "bin-none"
        self.empty_bin.mkdir()
        self.slow_bin = work / "bin-slow"
        self.slow_bin.mkdir()
        self.runs = 0

    def env(self, src: Path, path_dir: Path) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(src))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        # no kubelet from the machine: only the stub directory and what python needs
        env["PATH"] = f"{path_dir}:/usr/bin:/bin"
        return env

    def slow_kubelet(self) -> Path:
        """A fresh `kubelet` stub: its first --version sleeps, later ones answer at once."""
        self.runs += 1
        d = self.slow_bin / str(self.runs)
        d.mkdir()
        mark = d / "warm"
        (d / "kubelet").write_text(
            "#!/bin/sh\n"
            f"if [ ! -e '{mark}' ]; then : > '{mark}'; exec sleep {self.kubelet_sleep}; fi\n"
            "echo 'Kubernetes v1.30.2'\n")
        (d / "kubelet").chmod(0o755)
        return d

    def start_upstream(self) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", str(self.upstream)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=self.env(REPO, self.empty_bin))
        if "listening" not in p.stdout.readline():
            raise RuntimeError("the fake runtime did not start")
        return p

    def floor(self) -> float:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        return time.monotonic() - t0

    def runtime(self) -> float:
        sock = self.work / "rt2.sock"
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", str(sock)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env(REPO, self.empty_bin))
        try:
            return first_answer(sock, p, t0), cpu_s(p.pid)
        finally:
            stop(p)

    def shim(self, src: Path, slow: bool) -> tuple[float, float, float | None]:
        """(exec -> first forwarded call, CPU seconds used by then, exec -> kubelet-version-known
        or None)."""
        sock = self.work / "shim.sock"
        audit = self.work / "audit.jsonl"
        audit.unlink(missing_ok=True)
        path_dir = self.slow_kubelet() if slow else self.empty_bin
        cmd = [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}",
               "--upstream", f"unix://{self.upstream}", "--kubelet-config", "none",
               "--cgroup-root", str(self.work / "cg"), "--meminfo", str(self.work / "meminfo"),
               "--audit-log", str(audit), "--log-level", "warning"]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.work / "shim.log", "a"),
                             env=self.env(src, path_dir), cwd=str(src))
        try:
            first = first_answer(sock, p, t0)
            cpu = cpu_s(p.pid)
            known = wait_record(audit, "kubelet-version-known", t0, self.kubelet_sleep + 4.0) if slow else None
            return first, cpu, known
        finally:
            stop(p)


def export(ref: str, into: Path) -> Path:
    """The tree of a git ref, unpacked (read-only use of the repository)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:7.0f} ms   max {max(xs) * 1000:7.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/start-latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--rounds", type=int, default=5, help="counted rounds (one more warms up)")
    ap.add_argument("--kubelet-sleep", type=float, default=5.0, metavar="S",
                    help="how long the stub kubelet's first --version takes")
    ap.add_argument("--ref", action="append", default=[], help="also measure the shim of this git ref")
    ap.add_argument("--no-slow", action="store_true", help="leave out the slow-kubelet cases")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mqsl-"))
    bench = Bench(work, args.kubelet_sleep)
    sources = {"this tree": REPO}
    for i, ref in enumerate(args.ref):
        sources[ref] = export(ref, work / f"ref{i}")
    upstream = bench.start_upstream()
    results: dict[str, list[float]] = {}
    cpu_results: dict[str, list[float]] = {}
    known: dict[str, list[float | None]] = {}
    try:
        for rnd in range(args.rounds + 1):
            wall, cpu = bench.runtime()
            row = {"python -c pass": bench.floor(), "fake runtime (baseline)": wall}
            crow = {"fake runtime (baseline)": cpu}
            for name, src in sources.items():
                row[f"shim [{name}]"], crow[f"shim [{name}]"], _ = bench.shim(src, False)
                if not args.no_slow:
                    key = f"shim [{name}], slow kubelet"
                    row[key], crow[key], k = bench.shim(src, True)
                    if rnd:
                        known.setdefault(name, []).append(k)
            if rnd == 0:
                continue  # warm-up
            for k, v in row.items():
                results.setdefault(k, []).append(v)
            for k, v in crow.items():
                cpu_results.setdefault(k, []).append(v)
            print(f"round {rnd}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in row.items()), flush=True)
    finally:
        stop(upstream)
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(results["fake runtime (baseline)"])
    cbase = statistics.median(cpu_results["fake runtime (baseline)"])
    print(f"\nexec -> first Version answered, {args.rounds} rounds (goal for the shim: <= {GOAL:g} s); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'':40} {'wall time':{len(fmt([0.0]))}}   {'':14}   CPU used by then (utime+stime)")
    for k, xs in results.items():
        cpu = cpu_results.get(k)
        cpu_text = f"median {statistics.median(cpu) * 1000:5.0f} ms  x{statistics.median(cpu) / cbase:4.2f}" \
            if cpu else ""
        print(f"  {k:40} {fmt(xs)}   x{statistics.median(xs) / base:4.2f} baseline   {cpu_text}")
    for name, ks in known.items():
        got = [k for k in ks if k is not None]
        said = f"median {statistics.median(got) * 1000:.0f} ms" if got else "never"
        print(f"  kubelet-version-known [{name}]: {len(got)}/{len(ks)} runs, {said} after exec "
              f"(the stub's first --version would sleep {args.kubelet_sleep:g} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
