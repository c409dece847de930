"""Restart recovery with a real `memqos-shim serve` process killed with SIGKILL: the node state
is rebuilt from the runtime, the pod / QoS / node values come out the same, and nothing is
written when nothing changed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc

from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from tests.reconciler_support import FakeCgroupTree, Kubelet, read_audit, serve_args, wait_for

MI = 2**20
# name -> request of each container, for the expectation (independent of the shim's code)
REQUESTS = {"main": 32 * MI, "init": 16 * MI, "a": 24 * MI, "b": 8 * MI}


class ShimProcess:
    def __init__(self, tmp, tree, runtime_path, n):
        self.audit = tmp / f"audit-{n}.jsonl"
        self.listen = str(tmp / "shim.sock")
        args = serve_args(tmp, tree, runtime_path, self.listen, resync=0.2, audit=self.audit)
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        self.proc = subprocess.Popen([sys.executable, "-m", "shim", "serve", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: self.started() or self.proc.poll() is not None, timeout=20)
        assert self.proc.poll() is None, self.proc.stderr.read().decode()

    def records(self):
        return read_audit(self.audit)

    def started(self):
        return [r for r in self.records() if r.get("event") == "resync" and r.get("reason") == "startup"]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stderr.close()


def expected(runtime, tree):
    """pod / burstable / kubepods values from the runtime's state (every pod here is Burstable;
    in multi, init exits before a is created)."""
    out = {}
    total = 0
    with runtime.lock:
        for sb in runtime.sandboxes.values():
            names = {c.config.metadata.name for c in runtime.containers_in(sb.id)}
            if names == {"main"}:
                req = REQUESTS["main"]
            else:
                regular = sum(REQUESTS[n] for n in names & {"a", "b"})
                req = max(regular, REQUESTS["init"] if "init" in names else 0)
            req += sb.config.linux.overhead.memory_limit_in_bytes
            out[tree.pod("burstable", sb.config.metadata.uid)] = req
            total += req
    out[tree.burstable] = total
    out[tree.kubepods] = total
    return out


def current(tree, paths):
    return {p: tree.get(p) for p in paths}


def test_sigkill_restart_gives_the_same_values_and_writes_nothing(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    rt = FakeRuntimeServer(str(tmp_path / "containerd.sock")).start()
    shim = ShimProcess(tmp_path, tree, rt.path, 1)
    k = Kubelet(shim.listen, tree, rt.runtime)
    try:
        for i in range(3):
            sid = k.run_pod(f"p{i}", f"0a{i:02d}", "burstable", overhead=i * MI)
            k.create(sid, "main", "burstable", request=32 * MI)
        m = k.run_pod("multi", "0b00", "burstable", overhead=10 * MI)
        init = k.create(m, "init", "burstable", request=16 * MI)
        k.exit(init)
        k.create(m, "a", "burstable", request=24 * MI, limit=64 * MI)
        k.create(m, "b", "burstable", request=8 * MI)
        want = expected(rt.runtime, tree)
        assert want[tree.pod("burstable", "0b00")] == 42 * MI
        wait_for(lambda: current(tree, want) == want, timeout=5)
        shim.kill()

        tree_before = tree.values()
        shim = ShimProcess(tmp_path, tree, rt.path, 2)
        start = shim.started()[0]
        assert start["writes"] == 0 and start["pods"] == 4 and start["containers"] == 6
        time.sleep(0.5)  # a couple of periodic resyncs
        assert tree.values() == tree_before
        assert [r for r in shim.records() if r["event"] == "cgroup-write"] == []
    finally:
        k.close()
        if shim.proc.poll() is None:
            shim.kill()
        rt.stop()


def test_sigkill_mid_load_then_one_resync_gives_exact_values(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cgroup")
    rt = FakeRuntimeServer(str(tmp_path / "containerd.sock")).start()
    shim = ShimProcess(tmp_path, tree, rt.path, 1)
    k = Kubelet(shim.listen, tree, rt.runtime)
    created = []
    stop = threading.Event()

    def load():
        i = 0
        while not stop.is_set() and i < 200:
            try:
                sid = k.run_pod(f"load{i}", f"0c{i:04d}", "burstable")
                k.create(sid, "main", "burstable", request=32 * MI)
                created.append(sid)
            except grpc.RpcError:
                return  # the shim is gone
            i += 1

    t = threading.Thread(target=load)
    try:
        t.start()
        wait_for(lambda: len(created) >= 10, timeout=20)
        shim.kill()  # mid-load: calls in flight fail, the reconciler may be behind
        stop.set()
        t.join(10)
        k.close()
        shim = ShimProcess(tmp_path, tree, rt.path, 2)
        want = expected(rt.runtime, tree)
        assert len(want) >= 12
        assert current(tree, want) == want
        # a third start: nothing left to write
        shim.kill()
        shim = ShimProcess(tmp_path, tree, rt.path, 3)
        assert shim.started()[0]["writes"] == 0
        assert [r for r in shim.records() if r["event"] == "cgroup-write"] == []
    finally:
        stop.set()
        if shim.proc.poll() is None:
            shim.kill()
        rt.stop()
