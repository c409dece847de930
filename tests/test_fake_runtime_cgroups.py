"""The fake runtime's container cgroups: systemd naming (cri-containerd-<id>.scope in the
expanded kubepods-*-pod<uid_>.slice) and cgroupfs (<parent>/<id>), written like runc writes
them (memory.max, every unified key), updated, removed at exit; newer kubelets' requests
(neutral memory.high=max / memory.min=0, memory.oom.group) accepted as sent."""
from __future__ import annotations

import json

import pytest

from shim.cri import pb
from memqos_dev.testing.fake_runtime import FakeRuntime, container_cgroup, expand_slice
from shim.tools.kubelet_requests import create_container, sandbox_config

UID = "b1013052-e446-98fd-e2f5-96c3bd9b3930"
U_ = UID.replace("-", "_")
MI = 2**20
NEWER = {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": "max"}


@pytest.mark.parametrize("name,path", [
    ("kubepods.slice", "kubepods.slice"),
    ("kubepods-burstable.slice", "kubepods.slice/kubepods-burstable.slice"),
    (f"kubepods-burstable-pod{U_}.slice",
     f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice"),
    (f"kubepods-pod{U_}.slice", f"kubepods.slice/kubepods-pod{U_}.slice"),
])
def test_expand_slice(name, path):
    assert expand_slice(name) == path


@pytest.mark.parametrize("bad", ["-.slice", "kubepods", "a--b.slice", "-a.slice", "a-.slice", "a/b.slice"])
def test_expand_slice_refuses(bad):
    with pytest.raises(ValueError):
        expand_slice(bad)


def test_container_cgroup_naming():
    leaf = f"kubepods-burstable-pod{U_}.slice"
    full = f"/kubepods.slice/kubepods-burstable.slice/{leaf}"
    want = f"kubepods.slice/kubepods-burstable.slice/{leaf}/cri-containerd-abc.scope"
    assert container_cgroup(leaf, "abc", "systemd") == want
    assert container_cgroup(full, "abc", "systemd") == want  # only the leaf slice counts
    assert container_cgroup(f"/kubepods/burstable/pod{UID}", "abc", "cgroupfs") == f"kubepods/burstable/pod{UID}/abc"
    with pytest.raises(ValueError, match="slice:prefix:name"):
        container_cgroup(f"/kubepods/burstable/pod{UID}", "abc", "systemd")
    with pytest.raises(ValueError):
        container_cgroup(leaf, "abc", "cgroupfs")


def call(rt, method, req, resp_cls):
    return resp_cls.FromString(rt.handle(method, req.SerializeToString()))


def start_one(rt, driver, *, leaf_only=True, unified=None, limit=128 * MI):
    cfg = sandbox_config("p", UID, "burstable", driver=driver, leaf_only=leaf_only)
    sid = call(rt, "RunPodSandbox", pb.RunPodSandboxRequest(config=cfg), pb.RunPodSandboxResponse).pod_sandbox_id
    req = create_container(sid, cfg, "main", "burstable", request=32 * MI, limit=limit,
                           unified=NEWER if unified is None else unified)
    cid = call(rt, "CreateContainer", req, pb.CreateContainerResponse).container_id
    return sid, cid


def read(d, f):
    return (d / f).read_text().strip()


@pytest.mark.parametrize("driver,leaf_only", [("systemd", True), ("systemd", False), ("cgroupfs", False)])
def test_started_containers_get_their_cgroup(tmp_path, driver, leaf_only):
    rt = FakeRuntime(cgroup_driver=driver, cgroup_root=str(tmp_path))
    _, cid = start_one(rt, driver, leaf_only=leaf_only)
    c = rt.container(cid)
    assert rt.cgroup_dir(c) is not None
    d = tmp_path / container_cgroup(c.sandbox_config.linux.cgroup_parent, cid, driver)
    assert not d.exists()  # runc makes it when the task is created (StartContainer)
    call(rt, "StartContainer", pb.StartContainerRequest(container_id=cid), pb.StartContainerResponse)
    if driver == "systemd":
        assert d.name == f"cri-containerd-{cid}.scope" and d.parent.name == f"kubepods-burstable-pod{U_}.slice"
        assert d.parent.parent.name == "kubepods-burstable.slice" and d.parent.parent.parent.name == "kubepods.slice"
    else:
        assert d.relative_to(tmp_path).as_posix() == f"kubepods/burstable/pod{UID}/{cid}"
    # the newer kubelet's neutral values, as sent
    assert {f: read(d, f) for f in NEWER} == NEWER and read(d, "memory.max") == str(128 * MI)
    # an update merges (memory.high changes, the rest stays)
    u = pb.UpdateContainerResourcesRequest(container_id=cid)
    u.linux.unified["memory.high"] = str(100 * MI)
    call(rt, "UpdateContainerResources", u, pb.UpdateContainerResourcesResponse)
    assert read(d, "memory.high") == str(100 * MI) and read(d, "memory.oom.group") == "1"
    # verbose status: containerd's cgroupsPath and the runc option
    st = rt.handle("ContainerStatus", pb.ContainerStatusRequest(container_id=cid, verbose=True).SerializeToString())
    info = json.loads(pb.ContainerStatusResponse.FromString(st).info["info"])
    if driver == "systemd":
        assert info["runtimeSpec"]["linux"]["cgroupsPath"] == f"kubepods-burstable-pod{U_}.slice:cri-containerd:{cid}"
    # exit: the task goes, and its cgroup with it
    rt.exit_container(cid)
    assert not d.exists()


def test_systemd_driver_refuses_a_cgroupfs_parent_at_start(tmp_path):
    rt = FakeRuntime(cgroup_driver="systemd", cgroup_root=str(tmp_path))
    _, cid = start_one(rt, "cgroupfs")
    with pytest.raises(Exception) as e:
        rt.handle("StartContainer", pb.StartContainerRequest(container_id=cid).SerializeToString())
    assert "slice:prefix:name" in str(e.value)
    assert rt.container(cid).state == pb.CONTAINER_EXITED and rt.container(cid).reason == "StartError"


def test_without_a_cgroup_root_nothing_is_written(tmp_path):
    rt = FakeRuntime(cgroup_driver="systemd")
    _, cid = start_one(rt, "cgroupfs")  # a mismatch is not checked either: the old behaviour
    call(rt, "StartContainer", pb.StartContainerRequest(container_id=cid), pb.StartContainerResponse)
    assert rt.cgroup_dir(rt.container(cid)) is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_the_shims_monitor_finds_the_fakes_container_cgroup(tmp_path, driver):
    """The directory the fake makes is the one the shim's monitor resolves for the container."""
    from shim.decision.guard import GuardConfig
    from shim.guard.monitor import ContainerRef, Monitor
    from shim.node.facts import KubeletFacts

    rt = FakeRuntime(cgroup_driver=driver, cgroup_root=str(tmp_path))
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    _, cid = start_one(rt, driver, leaf_only=driver == "systemd")
    call(rt, "StartContainer", pb.StartContainerRequest(container_id=cid), pb.StartContainerResponse)
    c = rt.container(cid)
    kubelet = KubeletFacts(source="test", cgroup_driver=driver)
    m = Monitor(cgroup_root=str(tmp_path), kubelet=kubelet, guard=GuardConfig(), interval=5, emit=lambda r: None)
    assert m._layout() is None
    ref = ContainerRef(cid, "default", "p", "main", UID, c.sandbox_config.linux.cgroup_parent, "Burstable")
    assert m.resolve(ref) == container_cgroup(c.sandbox_config.linux.cgroup_parent, cid, driver)
