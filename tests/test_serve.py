"""`memqos-shim serve` as an operator runs it (a real process on a real unix socket) in
front of the in-repo fake runtime: what the runtime receives is what the shim decided."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from shim.cri import api_pb2_grpc, pb
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.tools.kubelet_requests import create_container, oom_score_adj, sandbox_config, update_resources

MI = 2**20
GI = 2**30
CAPACITY = 16 * GI
RESERVED = 200 * MI
ALLOC = CAPACITY - RESERVED
PAGE = 4096
FACTOR = 0.9


def complete_lines(path) -> list[str]:
    """The audit log's complete lines: the writer thread may be in the middle of one."""
    text = path.read_text() if path.exists() else ""
    return text.split("\n")[:-1]


def expected_high(req: int, ceiling: int) -> int:
    """The reference formula, written out here independently of shim.decision."""
    return int(req + (ceiling - req) * FACTOR) // PAGE * PAGE


class Shim:
    """memqos-shim serve in a subprocess, with its audit log in a file."""

    def __init__(self, base: Path, upstream: str, *, cgroup_v2: bool = True, extra: tuple = ()):
        self.base = base
        cg = base / "cgroup"
        cg.mkdir(parents=True, exist_ok=True)
        if cgroup_v2:
            (cg / "cgroup.controllers").write_text("cpu memory pids\n")
        (base / "meminfo").write_text(f"MemTotal: {CAPACITY // 1024} kB\n")
        (base / "kubelet.yaml").write_text("kubeReserved: {memory: 100Mi}\nsystemReserved: {memory: 100Mi}\n")
        self.sock = base / "shim.sock"
        self.audit = base / "audit.jsonl"
        self.log = open(base / "shim.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{self.sock}", "--upstream", upstream,
             "--kubelet-config", str(base / "kubelet.yaml"), "--cgroup-root", str(cg),
             "--meminfo", str(base / "meminfo"), "--page-size", str(PAGE), "--audit-log", str(self.audit),
             *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shim did not start: {(base / 'shim.log').read_text()}")
            time.sleep(0.02)
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)

    def records(self, n: int, timeout: float = 10) -> list[dict]:
        """The decision records (CreateContainer / UpdateContainerResources), waiting for n of them."""
        deadline = time.monotonic() + timeout
        while True:
            lines = complete_lines(self.audit)
            recs = [json.loads(x) for x in lines]
            decisions = [r for r in recs if r.get("method") in ("CreateContainer", "UpdateContainerResources")]
            if len(decisions) >= n or time.monotonic() > deadline:
                return decisions
            time.sleep(0.02)

    def record_for(self, container_id: str, timeout: float = 10) -> dict:
        """The audit record of a container's creation (written asynchronously: wait for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.records(0, timeout=0):
                if r.get("container_id") == container_id and r["method"] == "CreateContainer":
                    return r
            time.sleep(0.02)
        raise AssertionError(f"no audit record for {container_id}")

    def stop(self):
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="mqs-"))  # unix socket paths must stay short


@pytest.fixture(scope="module")
def stack():
    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        shim = Shim(base, runtime.address)
        try:
            yield shim, runtime.runtime
        finally:
            shim.stop()


def run_pod(shim: Shim, name: str, uid: str, qos: str, *, driver="cgroupfs", leaf_only=False, annotations=None):
    sb = sandbox_config(name, uid, qos, driver=driver, leaf_only=leaf_only, annotations=annotations)
    sid = shim.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id
    return sid, sb


def create(shim, runtime, sid, sb, ctr, qos, *, request=0, limit=0, unified=None):
    req = create_container(sid, sb, ctr, qos, request=request, limit=limit, unified=unified, capacity=CAPACITY)
    cid = shim.rt.CreateContainer(req, timeout=10).container_id
    received = runtime.container(cid).create_request
    return cid, dict(received.config.linux.resources.unified), received, req


CASES = [
    # name, qos, driver, leaf_only, request, limit
    ("g-cgroupfs", "guaranteed", "cgroupfs", False, 256 * MI, 256 * MI),
    ("g-systemd", "guaranteed", "systemd", True, 256 * MI, 256 * MI),
    ("b-limit-cgroupfs", "burstable", "cgroupfs", False, 128 * MI, 512 * MI),
    ("b-limit-systemd", "burstable", "systemd", False, 128 * MI, 512 * MI),
    ("b-nolimit-cgroupfs", "burstable", "cgroupfs", False, 64 * MI, 0),
    ("b-nolimit-systemd-leaf", "burstable", "systemd", True, 64 * MI, 0),
    ("be-cgroupfs", "besteffort", "cgroupfs", False, 0, 0),
    ("be-systemd", "besteffort", "systemd", True, 0, 0),
]


@pytest.mark.parametrize("name,qos,driver,leaf_only,req,limit", CASES, ids=[c[0] for c in CASES])
def test_create_container_rewritten(stack, name, qos, driver, leaf_only, req, limit):
    request = req
    shim, runtime = stack
    uid = f"{abs(hash(name)) % 16**12:012x}-aaaa-bbbb-cccc-000000000000"
    # the request is given exactly through the annotation, so expected values are exact
    ann = {"memqos.io/requests": json.dumps({"main": f"{request}"})} if qos == "burstable" else None
    sid, sb = run_pod(shim, name, uid, qos, driver=driver, leaf_only=leaf_only, annotations=ann)
    cid, unified, received, sent = create(shim, runtime, sid, sb, "main", qos, request=request, limit=limit)
    if qos == "guaranteed":  # memory.min max(ceil(10%), 8Mi) under the limit, page-rounded; memory.low the request
        cap = limit - max(-(-limit // 10), 8 * 2**20)
        assert unified == {"memory.min": str(cap // 4096 * 4096), "memory.low": str(limit)}
    elif qos == "burstable":
        assert unified == {"memory.min": str(request), "memory.high": str(expected_high(request, limit or ALLOC))}
    else:
        assert unified == {"memory.high": str(expected_high(0, ALLOC))}
    # nothing but unified and the shim's annotation differs from what the kubelet sent
    assert json.loads(received.config.annotations.pop("memqos.io/request"))["qos"].lower() == qos
    received.config.linux.resources.unified.clear()
    sent.config.linux.resources.unified.clear()
    assert received == sent
    rec = shim.record_for(cid)
    assert rec["pod"] == f"default/{name}" and rec["qos"].lower() == qos and rec["unified_after"] == unified


def test_newer_kubelet_values_overridden_and_other_keys_kept(stack):
    shim, runtime = stack
    sid, sb = run_pod(shim, "newer", "0000000000000000000000000000000a", "burstable",
                      annotations={"memqos.io/requests": '{"app": "32Mi"}'})
    _, unified, _, _ = create(shim, runtime, sid, sb, "app", "burstable", request=32 * MI, limit=256 * MI,
                              unified={"memory.high": "max", "memory.min": "0", "memory.oom.group": "1"})
    assert unified == {"memory.min": str(32 * MI), "memory.high": str(expected_high(32 * MI, 256 * MI)),
                       "memory.oom.group": "1"}


def test_update_container_resources_recomputed(stack):
    shim, runtime = stack
    sid, sb = run_pod(shim, "resize", "0000000000000000000000000000000b", "burstable",
                      annotations={"memqos.io/requests": '{"app": "100Mi"}'})
    cid, unified, _, _ = create(shim, runtime, sid, sb, "app", "burstable", request=100 * MI, limit=200 * MI)
    assert unified["memory.high"] == str(expected_high(100 * MI, 200 * MI))
    shim.rt.UpdateContainerResources(
        update_resources(cid, limit=400 * MI, oom_score_adj=oom_score_adj("burstable", 100 * MI, CAPACITY)), timeout=10)
    forwarded = runtime.container(cid).update_request_messages[-1]
    assert forwarded.linux.unified["memory.high"] == str(expected_high(100 * MI, 400 * MI))
    assert forwarded.linux.unified["memory.min"] == str(100 * MI)
    # and what the runtime has in force now
    status = shim.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=10)
    assert status.status.resources.linux.unified["memory.high"] == str(expected_high(100 * MI, 400 * MI))


def test_garbage_create_container_forwarded_unchanged_with_audit(stack):
    shim, runtime = stack
    garbage = b"\xff\xfe\xfd not a CreateContainerRequest"
    call = shim.channel.unary_unary("/runtime.v1.RuntimeService/CreateContainer")
    before = len(runtime.received_create_requests)
    with pytest.raises(grpc.RpcError) as e:
        call(garbage, timeout=10)
    # the fake runtime could not parse it either: it got exactly the kubelet's bytes
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT)
    got = [c.request for c in runtime.calls_of("CreateContainer")][-1]
    assert got == garbage and len(runtime.received_create_requests) >= before
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        recs = [json.loads(x) for x in complete_lines(shim.audit)]
        fail_open = [r for r in recs if r.get("event") == "fail-open"]
        if fail_open:
            break
        time.sleep(0.05)
    assert fail_open and "DecodeError" in fail_open[-1]["error"]


def test_socket_is_not_accessible_to_others(stack):
    shim, _ = stack
    mode = stat.S_IMODE(os.stat(shim.sock).st_mode)
    assert mode & 0o077 == 0, oct(mode)
    assert stat.S_ISSOCK(os.stat(shim.sock).st_mode)


def test_no_injection_without_cgroup_v2():
    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock") as srv:
        shim = Shim(base, srv.address, cgroup_v2=False)
        try:
            sid, sb = run_pod(shim, "v1", "0000000000000000000000000000000c", "burstable")
            _, unified, received, sent = create(shim, srv.runtime, sid, sb, "app", "burstable",
                                                request=32 * MI, limit=64 * MI, unified={"memory.oom.group": "1"})
            assert unified == {"memory.oom.group": "1"}
            assert received == sent  # byte-for-byte what the kubelet sent
            assert srv.runtime.received_create_requests[-1] == sent.SerializeToString()
            assert "cgroup.controllers not found" in (base / "shim.log").read_text()
        finally:
            shim.stop()


def test_quick_call_answered_while_100_slow_calls_in_flight():
    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock", delays={"ExecSync": 4.0}) as srv:
        shim = Shim(base, srv.address)
        try:
            sid, sb = run_pod(shim, "slow", "0000000000000000000000000000000d", "besteffort")
            cid, *_ = create(shim, srv.runtime, sid, sb, "app", "besteffort")
            shim.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=10)
            futures = [shim.rt.ExecSync.future(pb.ExecSyncRequest(container_id=cid, cmd=["sleep"], timeout=30),
                                               timeout=60) for _ in range(100)]
            time.sleep(0.5)  # let them all reach the runtime
            t0 = time.monotonic()
            shim.rt.Version(pb.VersionRequest(version="v1"), timeout=10)
            quick = time.monotonic() - t0
            assert not any(f.done() for f in futures)  # the slow calls really are still in flight
            assert quick < 2.0, f"Version took {quick:.2f}s behind 100 slow calls"
            assert all(f.result().exit_code == 0 for f in futures)
        finally:
            shim.stop()
