"""Start-up: `serve` forwards calls before the kubelet's version is known (a `kubelet
--version` that is slow under a cold page cache), finds the version in the background with
retries, and then recomputes who owns what for the rewriter and the reconciler, saying so in
the audit log and the log."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from memqos_dev.testing import cri_grpc as api_pb2_grpc
from shim.cri import pb
from shim.node import kubelet_version
from shim.node.kubelet_version import KubeletVersionWatcher
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.tools.kubelet_requests import create_container, sandbox_config
from tests.reconciler_support import MI, wait_for

GI = 2**30
CAPACITY = 16 * GI
PAGE = 4096


def fake_kubelet(d: Path, first_sleep: float, version: str = "v1.30.2", fail_second: bool = False,
                 gated: bool = False) -> Path:
    """A directory with a `kubelet` whose first `--version` sleeps (a binary read from a cold
    page cache); later ones answer at once (``fail_second``: the second fails, without a
    version; ``gated``: every one sleeps until a `release` file exists). It leaves `asked` and
    `answered` marks."""
    d.mkdir(parents=True)
    script = d / "kubelet"
    if gated:
        script.write_text("#!/bin/sh\n"
                          f"if [ ! -e '{d}/release' ]; then exec sleep {first_sleep}; fi\n"
                          f": > '{d}/answered'\n"
                          f"echo 'Kubernetes {version}'\n")
        script.chmod(0o755)
        return d
    second = f"if [ ! -e '{d}/asked2' ]; then : > '{d}/asked2'; echo 'flag provided but not defined' >&2; exit 1; fi\n" \
        if fail_second else ""
    script.write_text("#!/bin/sh\n"
                      f"if [ ! -e '{d}/asked' ]; then : > '{d}/asked'; exec sleep {first_sleep}; fi\n"
                      f"{second}"
                      f": > '{d}/answered'\n"
                      f"echo 'Kubernetes {version}'\n")
    script.chmod(0o755)
    return d


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


# -- the watcher alone -------------------------------------------------------------------------
def test_the_version_search_retries_with_longer_timeouts_and_backoff_until_it_is_known():
    asked, known = [], []
    answers = [(None, "kubelet: TimeoutExpired"), (None, "no kubelet executable found"), ((1, 31), "v1.31.0")]

    def detect(timeout):
        asked.append((timeout, time.monotonic()))
        return answers[len(asked) - 1]

    w = KubeletVersionWatcher(lambda v, how: known.append((v, how)), detect=detect, retry_first=0.05,
                              retry_max=0.1, timeouts=(3.0, 10.0)).start()
    try:
        wait_for(lambda: known, timeout=5)
        time.sleep(0.3)  # nothing more once known
    finally:
        w.stop()
    assert known == [((1, 31), "v1.31.0")]
    assert [t for t, _ in asked] == [3.0, 10.0, 10.0]
    assert w.version == (1, 31) and w.attempts == 3
    gaps = [b - a for (_, a), (_, b) in zip(asked, asked[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # doubled, capped at retry_max


def test_the_version_search_keeps_trying_at_the_slowest_rate():
    asked = []

    def detect(timeout):
        asked.append(time.monotonic())
        return None, "no kubelet executable found"

    w = KubeletVersionWatcher(lambda v, how: None, detect=detect, retry_first=0.01, retry_max=0.04).start()
    try:
        wait_for(lambda: len(asked) >= 8, timeout=5)
    finally:
        w.stop()
    assert w.version is None and "no kubelet" in w.how


# -- serve as a process, a slow kubelet on PATH -------------------------------------------------
def test_serve_forwards_at_once_while_kubelet_version_is_slow_then_revisits_ownership():
    base = Path(tempfile.mkdtemp(prefix="mqst-"))
    # the first --version takes longer than the first attempt's 3 s timeout, the second fails:
    # the third (about 6 s after start) answers
    bindir = fake_kubelet(base / "bin", first_sleep=4.0, fail_second=True)
    (base / "cg").mkdir()
    (base / "cg" / "cgroup.controllers").write_text("memory\n")
    (base / "meminfo").write_text(f"MemTotal: {CAPACITY // 1024} kB\n")
    # memoryThrottlingFactor set, version unknown: assumed a v1.37+ kubelet that sets memory.high
    # itself (the conservative case); a v1.30 kubelet has the gate off: every value is the shim's
    (base / "kubelet.yaml").write_text(json.dumps({"memoryThrottlingFactor": 0.8}))
    audit, sock = base / "audit.jsonl", base / "shim.sock"
    log = open(base / "shim.log", "w")
    with FakeRuntimeServer(base / "rt.sock") as rt:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}", "--upstream", rt.address,
             "--kubelet-config", str(base / "kubelet.yaml"), "--cgroup-root", str(base / "cg"),
             "--meminfo", str(base / "meminfo"), "--page-size", str(PAGE), "--audit-log", str(audit),
             "--reconcile", "false", "--monitor-interval", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PATH=f"{bindir}:/usr/bin:/bin"))
        try:
            wait_for(lambda: sock.exists() or proc.poll() is not None, timeout=30)
            channel = grpc.insecure_channel(f"unix://{sock}")
            stub = api_pb2_grpc.RuntimeServiceStub(channel)
            sb = sandbox_config("web", "0e1d2c3b-0000-4000-8000-000000000001", "burstable",
                                annotations={"memqos.io/requests": json.dumps({"a": "64Mi", "b": "64Mi"})})
            sid = stub.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id

            def create(name):
                req = create_container(sid, sb, name, "burstable", request=64 * MI, limit=256 * MI, capacity=CAPACITY)
                cid = stub.CreateContainer(req, timeout=10).container_id
                return cid, dict(rt.runtime.container(cid).create_request.config.linux.resources.unified)

            first, unified = create("a")
            # answered while the kubelet's version was still being asked for
            assert not (bindir / "answered").exists()
            assert "memory.high" not in unified  # left to the kubelet (conservative case)
            rec = wait_for(lambda: [r for r in read_records(audit) if r.get("container_id") == first])[0]
            assert rec["kubelet_owns"] == ["memory.high"]

            known = wait_for(lambda: [r for r in read_records(audit) if r.get("event") == "kubelet-version-known"],
                             timeout=20)[0]
            assert (bindir / "answered").exists()
            assert known["kubelet_version"] == "1.30"
            assert known["changed"]["container memory.high"]["from"] == "kubelet"
            assert known["changed"]["container memory.high"]["to"] == "shim"
            assert known["containers_decided_without_version"] == 1
            start = [r for r in read_records(audit) if r.get("event") == "start"][0]
            assert start["kubelet_version"] is None and "background" in start["kubelet_version_source"]

            second, unified = create("b")
            high = int(64 * MI + (256 - 64) * MI * 0.8) // PAGE * PAGE
            assert unified["memory.high"] == str(high)
            rec = wait_for(lambda: [r for r in read_records(audit) if r.get("container_id") == second])[0]
            assert "kubelet_owns" not in rec
            channel.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    text = (base / "shim.log").read_text()
    shutil.rmtree(base, ignore_errors=True)
    assert "decided without the kubelet version" in text
    assert "ownership changed now that the kubelet's version is known: container memory.high kubelet -> shim" in text


# -- the reconciler picks the new ownership up ----------------------------------------------------
def test_the_reconciler_writes_the_levels_it_owns_once_the_version_is_known(tmp_path, monkeypatch):
    from tests.test_reconciler import B_UID, Stack

    # every --version times out until the test releases it
    bindir = fake_kubelet(tmp_path / "bin", first_sleep=30.0, version="v1.36.1", gated=True)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setattr(kubelet_version, "TIMEOUTS", (0.2, 0.5))
    monkeypatch.setattr(kubelet_version, "RETRY_FIRST", 0.1)
    monkeypatch.setattr(kubelet_version, "RETRY_MAX", 0.2)
    # memoryReservationPolicy set, version unknown: a v1.36+ kubelet with the gate on is assumed,
    # writing pod / QoS / kubepods values itself; a v1.36 kubelet has the gate off by default
    s = Stack(tmp_path, kubelet_extra={"memoryReservationPolicy": "TieredReservation"})
    try:
        t = s.tree
        assert s.svc.reconciler.kubelet_scopes == {"pod", "qos", "kubepods", "reserved"}
        sid = s.kubelet.run_pod("b", B_UID, "burstable")
        s.kubelet.create(sid, "main", "burstable", request=32 * MI, limit=128 * MI)
        s.sync()
        assert s.writes == []  # stands aside while the kubelet is assumed to write
        assert not (bindir / "answered").exists()
        (bindir / "release").write_text("")
        wait_for(lambda: [r for r in s.records() if r.get("event") == "kubelet-version-known"], timeout=15)
        wait_for(lambda: s.svc.reconciler.kubelet_scopes == frozenset())
        s.sync()
        wait_for(lambda: t.get(t.pod("burstable", B_UID)) == 32 * MI)
        assert t.get(t.burstable) == 32 * MI and t.get(t.kubepods) == 32 * MI
        known = [r for r in s.records() if r.get("event") == "kubelet-version-known"][0]
        assert known["kubelet_version"] == "1.36"
        assert {k for k, c in known["changed"].items() if c["from"] == "kubelet" and c["to"] == "shim"} >= \
            {"pod", "qos", "kubepods"}
        writes = [r for r in s.records() if r.get("event") == "cgroup-write"]
        assert writes and all(r.get("trigger") == "kubelet version known" for r in writes)
    finally:
        s.close()


# -- systemd readiness ------------------------------------------------------------------------------
def test_serve_tells_systemd_it_is_ready_once_its_socket_serves():
    import socket

    from shim.cri.methods import VERSION
    from shim.transport.unary_client import UnaryClient

    base = Path(tempfile.mkdtemp(prefix="mqsn-"))
    (base / "meminfo").write_text(f"MemTotal: {CAPACITY // 1024} kB\n")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(base / "notify"))
    notify.settimeout(30)
    sock = base / "shim.sock"
    with FakeRuntimeServer(base / "rt.sock") as rt:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}", "--upstream", rt.address,
             "--kubelet-config", "none", "--cgroup-root", str(base), "--meminfo", str(base / "meminfo"),
             "--audit-log", "none", "--kubelet-version", "1.30", "--reconcile", "false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, NOTIFY_SOCKET=str(base / "notify")))
        try:
            ready = notify.recv(4096).decode()
            assert ready.splitlines()[0] == "READY=1" and f"serving on unix://{sock}" in ready
            client = UnaryClient(f"unix://{sock}")  # no retry: it serves when it says so
            assert pb.VersionResponse.FromString(client.call(VERSION, b"", 5)).runtime_name
            client.close()
            proc.send_signal(signal.SIGTERM)
            assert notify.recv(4096) == b"STOPPING=1"
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            notify.close()
            shutil.rmtree(base, ignore_errors=True)


def test_the_start_latency_script_runs(capsys):
    from memqos_dev.tools.start_latency import main

    assert main(["-n", "1", "--no-slow"]) == 0
    out = capsys.readouterr().out
    assert "fake runtime (baseline)" in out and "shim [this tree]" in out and "CPU used by then" in out
