"""An in-place resize on a runtime that leaves `unified` out of UpdateContainerResources (CRI-O
before 1.36): the shim writes the container's memory.* values itself after the runtime answered
OK, and the monitor reports a container whose cgroup holds other values than its decision.

The stack is real: the fake runtime as CRI-O names and updates containers (crio-<id> cgroups in a
real directory tree, `unified` dropped on update before 1.36) behind the real `serve` Service,
driven through the shim's socket the way crictl and the kubelet call it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from memqos_dev.testing.fake_runtime import FakeRuntime, FakeRuntimeServer, container_cgroup
from shim.cri import pb
from tests.reconciler_support import (
    PAGE,
    FakeCgroupTree,
    Kubelet,
    ServiceThread,
    read_audit,
    serve_args,
)

MI = 2**20
UID = "7f1c2a9e-0b3d-4e5f-8a6b-1c2d3e4f5a6b"
# memory.high = floor(req + (limit - req) * 0.9) to a page, request 32Mi
HIGH_128MI = 124149760
HIGH_256MI = 244944896


class Stack:
    def __init__(self, tmp: Path, runtime: FakeRuntime, tree: FakeCgroupTree, extra: tuple = ()):
        self.tmp, self.runtime, self.tree = tmp, runtime, tree
        self.audit = tmp / "audit.jsonl"
        self.server = FakeRuntimeServer(tmp / "runtime.sock", runtime=runtime)
        self.listen = str(tmp / "shim.sock")
        self.extra = extra

    def __enter__(self) -> "Stack":
        self.server.__enter__()
        args = serve_args(self.tmp, self.tree, str(self.tmp / "runtime.sock"), self.listen, audit=self.audit,
                          extra=("--monitor-interval", "0", *self.extra))
        self.service = ServiceThread(args).start()
        self.kubelet = Kubelet(self.listen, self.tree, self.runtime)
        return self

    def __exit__(self, *exc) -> None:
        self.kubelet.close()
        self.service.stop()
        self.server.__exit__(*exc)

    def version(self) -> None:
        self.kubelet.call("Version", pb.VersionRequest(version="v1"), pb.VersionResponse)

    def start_container(self, limit: int = 128 * MI) -> str:
        sid = self.kubelet.run_pod("web", UID, "burstable")
        return self.kubelet.create(sid, "app", "burstable", request=32 * MI, limit=limit)

    def crictl_update(self, cid: str, memory: int) -> None:
        """`crictl update --memory N <id>`: the limit alone, nothing in unified."""
        u = pb.UpdateContainerResourcesRequest(container_id=cid)
        u.linux.memory_limit_in_bytes = memory
        self.kubelet.call("UpdateContainerResources", u, pb.UpdateContainerResourcesResponse)
        self.service.sync()

    def cgroup(self, cid: str) -> Path:
        c = self.runtime.container(cid)
        return self.tree.root / container_cgroup(c.sandbox_config.linux.cgroup_parent, cid, "cgroupfs",
                                                 self.runtime.cgroup_prefix)

    def read(self, cid: str, file: str) -> str:
        return (self.cgroup(cid) / file).read_text().strip()

    def records(self, event: str) -> list[dict]:
        self.service.sync()
        return [r for r in read_audit(self.audit) if r.get("event") == event]


@pytest.fixture
def tree(tmp_path):
    return FakeCgroupTree(tmp_path / "cgroup")


@pytest.mark.parametrize("ask_version", [True, False], ids=["version-seen", "version-not-seen"])
def test_crio_before_136_resize_gets_the_new_memory_high(tmp_path, tree, ask_version):
    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    with Stack(tmp_path, runtime, tree) as s:
        if ask_version:
            s.version()
        cid = s.start_container()
        assert s.cgroup(cid).name == f"crio-{cid}"
        assert s.read(cid, "memory.high") == str(HIGH_128MI)
        s.crictl_update(cid, 256 * MI)
        assert s.read(cid, "memory.max") == str(256 * MI)  # the runtime applied the limit itself
        assert s.read(cid, "memory.high") == str(HIGH_256MI)  # the shim wrote the new memory.high
        assert s.read(cid, "memory.min") == str(32 * MI)
        (rec,) = s.records("update-write")
        assert rec["written"] == {"memory.high": {"old": str(HIGH_128MI), "new": str(HIGH_256MI)}}
        assert rec["unchanged"] == {"memory.min": str(32 * MI), "memory.low": "0"}
        assert rec["container_id"] == cid and rec["pod"] == "default/web" and rec["container"] == "app"
        assert rec["path"] == str(s.cgroup(cid))
        if ask_version:
            assert "1.34.11" in rec["runtime"] and "toOCIResources" in rec["why"]
            (seen,) = s.records("runtime")
            assert seen["runtime"] == "cri-o" and seen["unified_on_update"] == "written by the shim"
        else:
            assert rec["runtime"] == "unknown runtime" and "not known yet" in rec["why"]
        # the next update with the same values writes nothing
        s.crictl_update(cid, 256 * MI)
        assert s.records("update-write")[-1]["written"] == {}


@pytest.mark.parametrize("name,version", [("cri-o", "1.36.0"), ("containerd", "1.7.24"), ("containerd", "2.1.9")])
def test_runtimes_that_apply_unified_are_left_to_it(tmp_path, tree, name, version):
    if name == "cri-o":
        runtime = FakeRuntime.crio(version, cgroup_root=str(tree.root), kernel_files=True)
    else:
        runtime = FakeRuntime(runtime_name=name, runtime_version=version, cgroup_root=str(tree.root),
                              kernel_files=True)
    with Stack(tmp_path, runtime, tree) as s:
        s.version()
        cid = s.start_container()
        s.crictl_update(cid, 256 * MI)
        assert s.read(cid, "memory.high") == str(HIGH_256MI)  # the runtime applied it
        assert s.records("update-write") == []
        (seen,) = s.records("runtime")
        assert seen["unified_on_update"] == "applied by the runtime"


def test_a_failed_write_is_audited_and_the_call_still_succeeds(tmp_path, tree):
    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    with Stack(tmp_path, runtime, tree) as s:
        s.version()
        cid = s.start_container()
        d = s.cgroup(cid)
        elsewhere = tmp_path / "elsewhere"
        d.rename(elsewhere)
        os.symlink(elsewhere, d)  # a symlink where the container's cgroup was: refused, not followed
        s.crictl_update(cid, 256 * MI)  # answered OK
        (err,) = s.records("update-write-error")
        assert err["container_id"] == cid and err["wanted"]["memory.high"] == str(HIGH_256MI)
        assert "symlink" in err["error"] or "refused" in err["error"].lower()
        assert (elsewhere / "memory.high").read_text().strip() == str(HIGH_128MI)
        assert s.service.service.update_follower.errors == 1
        assert s.records("update-write") == []


def test_observe_writes_nothing(tmp_path, tree):
    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    with Stack(tmp_path, runtime, tree, extra=("--mode", "observe")) as s:
        s.version()
        cid = s.start_container()
        before = s.read(cid, "memory.high")  # the kubelet's bytes went upstream: no memory.high
        s.crictl_update(cid, 256 * MI)
        assert s.read(cid, "memory.high") == before
        (rec,) = s.records("update-write")
        assert rec["rollout"] == "observe" and rec["written"]["memory.high"]["new"] == str(HIGH_256MI)


def test_the_monitor_reports_a_cgroup_holding_other_values_than_decided(tmp_path, tree):
    """Without the write after the update (the follower taken out), the monitor finds the old
    memory.high: reported once, cleared when the cgroup holds the decision again."""
    from shim.guard.monitor import Monitor, known_values, refs_from_container_qos
    from shim.guard.monitor import guard_config

    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    with Stack(tmp_path, runtime, tree) as s:
        svc = s.service.service
        svc.hooks.observers.remove(svc.update_follower)
        svc.hooks.defer_to(svc.finisher)
        cid = s.start_container()
        records: list[dict] = []
        qos = svc.container_qos
        monitor = Monitor(cgroup_root=str(tree.root), kubelet=svc.kubelet, guard=guard_config(s.service.cfg),
                          interval=5.0, emit=records.append, sources=[lambda: refs_from_container_qos(qos)],
                          page_size=PAGE, expected=lambda c: known_values(qos, c))
        monitor.tick()
        assert [r for r in records if r["event"].startswith("kernel-mismatch")] == []
        s.crictl_update(cid, 256 * MI)
        assert s.read(cid, "memory.high") == str(HIGH_128MI)  # CRI-O 1.34 kept the old value
        monitor.tick()
        monitor.tick()
        (rec,) = [r for r in records if r["event"] == "kernel-mismatch"]
        assert rec["container_id"] == cid
        assert rec["differences"] == {"memory.high": {"decided": str(HIGH_256MI), "kernel": str(HIGH_128MI)}}
        (s.cgroup(cid) / "memory.high").write_text(f"{HIGH_256MI}\n")
        monitor.tick()
        assert [r["event"] for r in records if r["event"].startswith("kernel-mismatch")] == [
            "kernel-mismatch", "kernel-mismatch-cleared"]


def test_page_rounding_is_no_mismatch():
    from shim.guard.update_follow import KernelCheck

    check = KernelCheck(lambda c: None, lambda r: None, 4096)
    want = {"memory.min": "1000000000", "memory.low": "0", "memory.high": "max"}
    files = {"memory.min": "999997440\n", "memory.low": "0\n", "memory.high": "max\n"}
    assert check.differences(want, files) == {}
    files["memory.high"] = "12288\n"
    assert check.differences(want, files) == {"memory.high": {"decided": "max", "kernel": "12288"}}
    assert check.differences(want, files, skip_high=True) == {}
    assert check.differences(want, {"memory.min": None}) == {}  # unreadable: nothing compared


@pytest.mark.parametrize("name,version,applies", [
    ("cri-o", "1.34.11", False), ("cri-o", "1.35.6", False), ("cri-o", "1.26.0", False),
    ("cri-o", "1.36.0", True), ("cri-o", "v1.36.3", True), ("cri-o", "1.37.0-rc.1", True),
    ("cri-o", "", False), ("cri-o", "main", False), ("CRI-O", "1.36.1", True),
    ("containerd", "1.7.24", True), ("containerd", "v2.1.9+unknown", True), ("containerd", "", True),
    ("", "", False), ("podman", "5.0", False),
])
def test_which_runtimes_apply_unified_on_update(name, version, applies):
    from shim.decision.runtime import Runtime

    assert Runtime(name, version).applies_unified_on_update() is applies


def test_version_parsing():
    from shim.decision.runtime import parse_version

    assert parse_version("1.34.11") == (1, 34, 11)
    assert parse_version("v2.1.9+unknown") == (2, 1, 9)
    assert parse_version("1.36") == (1, 36, 0)
    assert parse_version("x1.2") is None


def test_a_container_created_before_the_shim_is_found_in_the_node_state(tmp_path, tree):
    """The rewriter never saw it created: the reconciler's node state (rebuilt from the runtime)
    places its cgroup, and the update's decision (QoS and request from the update) is written."""
    from tests.reconciler_support import seed_runtime, wait_for

    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    tree.make_pod("burstable", UID)
    ids = seed_runtime(runtime, [("old", UID, "burstable", [("app", 32 * MI, 128 * MI)])])
    cid = ids["app"]
    with Stack(tmp_path, runtime, tree) as s:
        s.version()
        wait_for(lambda: any(r.id == cid for r in s.service.reconciler.view.containers))
        assert cid not in s.service.service.container_qos.containers
        before = s.read(cid, "memory.high")
        u = pb.UpdateContainerResourcesRequest(container_id=cid)
        u.linux.memory_limit_in_bytes = 256 * MI
        u.linux.oom_score_adj = runtime.container(cid).resources.oom_score_adj
        u.linux.unified["memory.min"] = str(32 * MI)  # a kubelet with the MemoryQoS gate on
        s.kubelet.call("UpdateContainerResources", u, pb.UpdateContainerResourcesResponse)
        s.service.sync()
        (rec,) = s.records("update-write")
        assert rec["pod"] == "default/old" and rec["written"]["memory.high"]["old"] == before
        assert s.read(cid, "memory.high") == str(HIGH_256MI)


def test_the_metrics_count_the_writes_and_the_failures():
    from shim.evidence.metrics import Metrics
    from tests.test_metrics import value

    m = Metrics()
    m.on_audit({"event": "update-write", "written": {"memory.high": {"old": "1", "new": "2"}}, "unchanged": {}})
    m.on_audit({"event": "update-write", "written": {"memory.high": {"old": "1", "new": "2"}}, "rollout": "observe"})
    m.on_audit({"event": "update-write-error", "error": "x"})
    m.on_audit({"event": "kernel-mismatch", "differences": {}})
    text = m.render().decode()
    assert value(text, "memqos_cgroup_writes_total", level="container", file="memory.high") == 1
    assert value(text, "memqos_update_write_errors_total") == 1
    assert value(text, "memqos_kernel_mismatches_total") == 1


def test_the_nri_handler_remembers_the_values_to_hold():
    """NRI mode: the monitor's KernelCheck reads the same memory as in proxy mode."""
    from shim.container.nri_handler import NriMemoryQoS
    from shim.decision import Policy
    from shim.guard.monitor import known_values
    from tests.test_nri_front import NODE, nri_container, nri_pod

    handler = NriMemoryQoS(NODE, Policy.HARD, lambda r: None)
    pod = nri_pod("web", UID, "burstable")
    c = nri_container("c1", pod, "app", "burstable", request=32 * MI, limit=128 * MI,
                      unified={"memory.min": str(32 * MI)})
    handler.create_container(pod, c)
    assert dict(known_values(handler, "c1")) == {"memory.min": str(32 * MI), "memory.low": "0",
                                                 "memory.high": str(HIGH_128MI)}
    from shim.nri import api_pb2 as npb

    resources = npb.LinuxResources()
    resources.memory.limit.value = 256 * MI
    handler.update_container(pod, c, resources)
    assert known_values(handler, "c1")["memory.high"] == str(HIGH_256MI)


def test_an_update_without_a_memory_limit_is_not_followed(tmp_path, tree):
    """The CPU manager's update carries the cpuset alone: the runtime keeps the limit, and the
    values decided from an update without it (memory.high from allocatable) are not written."""
    runtime = FakeRuntime.crio("1.34.11", cgroup_root=str(tree.root), kernel_files=True)
    with Stack(tmp_path, runtime, tree) as s:
        s.version()
        cid = s.start_container()
        u = pb.UpdateContainerResourcesRequest(container_id=cid)
        u.linux.cpuset_cpus = "0"
        s.kubelet.call("UpdateContainerResources", u, pb.UpdateContainerResourcesResponse)
        s.service.sync()
        assert s.read(cid, "memory.high") == str(HIGH_128MI)
        assert s.records("update-write") == []
        known = s.service.service.container_qos.containers[cid]
        assert known.limit == 128 * MI and known.unified["memory.high"] == str(HIGH_128MI)
        s.crictl_update(cid, 256 * MI)  # a limit again: followed
        assert s.read(cid, "memory.high") == str(HIGH_256MI)
        assert s.service.service.container_qos.containers[cid].limit == 256 * MI
