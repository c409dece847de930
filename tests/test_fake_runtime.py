"""The fake CRI runtime: real gRPC on a unix socket, driven with the generated stubs.

Expected status codes and messages come from containerd's pkg/cri/server sources and from what
containerd 1.6.20 answered in tests/data/traces (see memqos_dev/testing/fake_runtime/).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from memqos_dev.testing import cri_grpc as api_pb2_grpc
from shim.cri import pb
from memqos_dev.testing.fake_runtime import (
    BUSYBOX_IMAGE_ID,
    FakeRuntime,
    FakeRuntimeServer,
    serve_fake_runtime,
)
from shim.evidence.trace import open_text
from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, trace_file

REPO = Path(__file__).resolve().parents[1]
TRACE_OFF = trace_file(MEMQOS_OFF)
TRACE_ON = trace_file(MEMQOS_ON)
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNKNOWN = grpc.StatusCode.UNKNOWN


def _sock(tmp_path: Path) -> Path:
    """A socket path under tmp_path, or a short temp dir when that would pass sun_path's limit."""
    path = tmp_path / "rt.sock"
    if len(str(path)) > 100:
        path = Path(tempfile.mkdtemp(prefix="fr-")) / "rt.sock"
    return path


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.rs = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def server(tmp_path):
    with FakeRuntimeServer(_sock(tmp_path)) as srv:
        yield srv


@pytest.fixture
def client(server):
    c = Client(server.address)
    yield c
    c.close()


def rpc_error(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    return info.value


def sandbox_config(name="web", uid="0123456789abcdef0123456789abcdef", attempt=0, network=pb.NODE, **labels):
    cfg = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default", attempt=attempt),
        log_directory=f"/var/log/pods/default_{name}_{uid}",
        labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.uid": uid, **labels},
        annotations={"kubernetes.io/config.source": "file"},
    )
    cfg.linux.cgroup_parent = f"/kubepods/burstable/pod{uid}"
    cfg.linux.security_context.namespace_options.network = network
    cfg.linux.security_context.namespace_options.pid = pb.CONTAINER
    return cfg


def container_config(name="main", attempt=0, memory=134217728, **labels):
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=attempt),
        image=pb.ImageSpec(image=BUSYBOX_IMAGE_ID),
        command=["/bin/sh", "-c", "sleep 1000"],
        labels={"io.kubernetes.container.name": name, **labels},
        annotations={"io.kubernetes.container.hash": "41e349b7", "io.kubernetes.container.restartCount": str(attempt)},
        log_path=f"{name}/{attempt}.log",
    )
    r = cfg.linux.resources
    r.cpu_period, r.cpu_shares, r.memory_limit_in_bytes, r.oom_score_adj = 100000, 2, memory, 984
    r.hugepage_limits.add(page_size="2MB")
    return cfg


def run_pod(client: Client, cfg: pb.PodSandboxConfig | None = None) -> tuple[str, pb.PodSandboxConfig]:
    cfg = cfg or sandbox_config()
    return client.rs.RunPodSandbox(pb.RunPodSandboxRequest(config=cfg)).pod_sandbox_id, cfg


def create(client: Client, sid: str, scfg: pb.PodSandboxConfig, cfg: pb.ContainerConfig | None = None) -> str:
    cfg = cfg or container_config()
    req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=cfg, sandbox_config=scfg)
    return client.rs.CreateContainer(req).container_id


# --------------------------------------------------------------------------- basics


def test_version_status_runtime_config(server, client):
    v = client.rs.Version(pb.VersionRequest(version="v1"))
    assert (v.version, v.runtime_name, v.runtime_version, v.runtime_api_version) == ("0.1.0", "fake-runtime", "0.1.0", "v1")
    conds = {c.type: c.status for c in client.rs.Status(pb.StatusRequest()).status.conditions}
    assert conds == {"RuntimeReady": True, "NetworkReady": True}
    verbose = client.rs.Status(pb.StatusRequest(verbose=True))
    assert json.loads(verbose.info["config"])["containerd"]["runtimes"]["runc"]["options"] == {"SystemdCgroup": False}
    assert client.rs.RuntimeConfig(pb.RuntimeConfigRequest()).linux.cgroup_driver == pb.CGROUPFS
    server.runtime.cgroup_driver = "systemd"
    assert client.rs.RuntimeConfig(pb.RuntimeConfigRequest()).linux.cgroup_driver == pb.SYSTEMD
    server.runtime.network_ready = False
    ready = {c.type: (c.status, c.reason) for c in client.rs.Status(pb.StatusRequest()).status.conditions}
    assert ready["NetworkReady"] == (False, "NetworkPluginNotReady")


def test_full_pod_lifecycle(server, client):
    rt = server.runtime
    sid, scfg = run_pod(client)
    assert len(sid) == 64 and all(ch in "0123456789abcdef" for ch in sid)
    sb = rt.sandbox(sid)
    assert sb.config == scfg and sb.state == pb.SANDBOX_READY and sb.created_at > 0

    ccfg = container_config()
    create_req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=ccfg, sandbox_config=scfg)
    create_bytes = create_req.SerializeToString()
    cid = client.rs.CreateContainer(create_req).container_id
    assert len(cid) == 64 and cid != sid
    c = rt.container(cid)
    assert c.create_request_bytes == create_bytes and rt.received_create_requests == [create_bytes]
    assert c.config == ccfg and c.pod_sandbox_id == sid and c.state == pb.CONTAINER_CREATED

    status = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status
    assert status.state == pb.CONTAINER_CREATED and status.started_at == 0 and status.created_at == c.created_at

    client.rs.StartContainer(pb.StartContainerRequest(container_id=cid))
    [listed] = client.rs.ListContainers(pb.ListContainersRequest()).containers
    assert (listed.id, listed.pod_sandbox_id, listed.state) == (cid, sid, pb.CONTAINER_RUNNING)
    assert dict(listed.annotations) == dict(ccfg.annotations) and dict(listed.labels) == dict(ccfg.labels)
    assert listed.image.image == BUSYBOX_IMAGE_ID and listed.image_ref == BUSYBOX_IMAGE_ID

    status = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status
    assert status.state == pb.CONTAINER_RUNNING and status.started_at >= status.created_at > 0
    assert dict(status.annotations) == dict(ccfg.annotations) and status.metadata == ccfg.metadata
    assert status.image.image == "localhost/busybox:latest" and status.image_ref == BUSYBOX_IMAGE_ID
    assert status.log_path == f"{scfg.log_directory}/main/0.log"
    # containerd's view of the spec: swap = limit, no hugepages (no hugetlb controller)
    assert status.resources.linux == pb.LinuxContainerResources(
        cpu_period=100000, cpu_shares=2, memory_limit_in_bytes=134217728, oom_score_adj=984,
        memory_swap_limit_in_bytes=134217728,
    )

    update = pb.UpdateContainerResourcesRequest(container_id=cid)
    update.linux.memory_limit_in_bytes = 268435456
    update.linux.unified["memory.min"] = "33554432"
    update.linux.unified["memory.high"] = "107374182"
    client.rs.UpdateContainerResources(update)
    assert c.update_requests == [update.SerializeToString()] == rt.received_update_requests
    res = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status.resources.linux
    assert (res.memory_limit_in_bytes, res.memory_swap_limit_in_bytes) == (268435456, 268435456)
    assert dict(res.unified) == {"memory.min": "33554432", "memory.high": "107374182"}
    assert (res.cpu_shares, res.cpu_period, res.oom_score_adj) == (2, 100000, 984)  # zero fields keep old values
    assert c.resources == res

    client.rs.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=30))
    status = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status
    assert status.state == pb.CONTAINER_EXITED and status.exit_code == 0 and status.reason == "Completed"
    assert status.finished_at >= status.started_at

    client.rs.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    assert client.rs.ListContainers(pb.ListContainersRequest()).containers == []
    client.rs.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid))
    assert client.rs.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid)).status.state == pb.SANDBOX_NOTREADY
    client.rs.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid))
    assert client.rs.ListPodSandbox(pb.ListPodSandboxRequest()).items == []
    assert [c.name for c in rt.calls][:3] == ["RunPodSandbox", "CreateContainer", "ContainerStatus"]
    assert all(c.code == "OK" for c in rt.calls)


def test_update_merges_like_containerd(server, client):
    sid, scfg = run_pod(client)
    cid = create(client, sid, scfg, container_config(memory=0))
    assert server.runtime.container(cid).resources.memory_swap_limit_in_bytes == 0
    first = pb.UpdateContainerResourcesRequest(container_id=cid)
    first.linux.unified.update({"memory.min": "1", "memory.high": "2"})
    second = pb.UpdateContainerResourcesRequest(container_id=cid)
    second.linux.unified["memory.min"] = "5"
    second.linux.cpu_quota = 20000
    for u in (first, second):
        client.rs.UpdateContainerResources(u)
    res = server.runtime.container(cid).resources
    assert dict(res.unified) == {"memory.min": "5", "memory.high": "2"}  # merged, never removed
    assert (res.cpu_quota, res.cpu_shares, res.memory_limit_in_bytes) == (20000, 2, 0)
    assert [m.linux.cpu_quota for m in server.runtime.container(cid).update_request_messages] == [0, 20000]


def test_pod_network_gets_ip_and_verbose_info(server, client):
    sid, scfg = run_pod(client, sandbox_config(network=pb.POD))
    resp = client.rs.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True))
    assert resp.status.network.ip.startswith("10.88.")
    info = json.loads(resp.info["info"])
    assert info["config"]["metadata"] == {"name": "web", "uid": scfg.metadata.uid, "namespace": "default"}
    assert info["config"]["linux"]["security_context"]["namespace_options"] == {"pid": 1}  # Go JSON: ints, no zeros
    assert info["runtimeSpec"]["linux"]["cgroupsPath"] == f"{scfg.linux.cgroup_parent}/{sid}"
    assert info["processStatus"] == "running" and info["netNamespaceClosed"] is False

    cid = create(client, sid, scfg)
    cinfo = json.loads(client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True)).info["info"])
    assert cinfo["sandboxID"] == sid and cinfo["config"]["metadata"] == {"name": "main"}
    assert cinfo["runtimeSpec"]["linux"]["resources"]["memory"] == {"limit": 134217728, "swap": 134217728}
    assert cinfo["runtimeSpec"]["process"]["oomScoreAdj"] == 984
    assert client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).info == {}

    client.rs.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid))
    stopped = client.rs.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True))
    assert stopped.status.network.ip == "" and json.loads(stopped.info["info"])["netNamespaceClosed"] is True


def test_systemd_cgroups_path(tmp_path):
    rt = FakeRuntime(cgroup_driver="systemd")
    scfg = sandbox_config()
    scfg.linux.cgroup_parent = "kubepods-burstable-pod0123.slice"
    sid = pb.RunPodSandboxResponse.FromString(
        rt.handle("RunPodSandbox", pb.RunPodSandboxRequest(config=scfg).SerializeToString())
    ).pod_sandbox_id
    info = json.loads(rt._sandbox_info(rt.sandbox(sid))["info"])
    assert info["runtimeSpec"]["linux"]["cgroupsPath"] == f"kubepods-burstable-pod0123.slice:cri-containerd:{sid}"
    assert info["runtimeOptions"] == {"systemd_cgroup": True}


# --------------------------------------------------------------------------- errors


def test_not_found_codes_and_messages(server, client):
    rs = client.rs
    cases = [
        # recorder-smoke.jsonl seq 6 and 8 (containerd 1.6.20, verbatim)
        (rs.ContainerStatus, pb.ContainerStatusRequest(container_id="deadbeef", verbose=True),
         NOT_FOUND, 'an error occurred when try to find container "deadbeef": not found'),
        (rs.PodSandboxStatus, pb.PodSandboxStatusRequest(pod_sandbox_id="nonexist", verbose=True),
         NOT_FOUND, "an error occurred when try to find sandbox: not found"),
        (rs.StartContainer, pb.StartContainerRequest(container_id="nope"),
         NOT_FOUND, 'an error occurred when try to find container "nope": not found'),
        (rs.UpdateContainerResources, pb.UpdateContainerResourcesRequest(container_id="nope"),
         NOT_FOUND, "failed to find container: not found"),
        (rs.CreateContainer, pb.CreateContainerRequest(pod_sandbox_id="nope", config=container_config()),
         NOT_FOUND, 'failed to find sandbox id "nope": not found'),
        (rs.ExecSync, pb.ExecSyncRequest(container_id="nope", cmd=["true"]),
         NOT_FOUND, 'failed to exec in container: failed to find container "nope" in store: not found'),
        (rs.ContainerStats, pb.ContainerStatsRequest(container_id="nope"),
         NOT_FOUND, "failed to find container: not found"),
        # containerd 1.6.20 (before the July 2024 backports): stops of unknown ids fail
        (rs.StopContainer, pb.StopContainerRequest(container_id="nope"),
         NOT_FOUND, 'an error occurred when try to find container "nope": not found'),
        (rs.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id="nope"),
         NOT_FOUND, 'an error occurred when try to find sandbox "nope": not found'),
        # truncindex: an empty id is not "not found"
        (rs.ContainerStatus, pb.ContainerStatusRequest(container_id=""),
         UNKNOWN, "an error occurred when try to find container \"\": prefix can't be empty"),
    ]
    for fn, req, code, details in cases:
        err = rpc_error(fn, req)
        assert (err.code(), err.details()) == (code, details), fn
    assert rs.ListContainers(pb.ListContainersRequest()).containers == []


def test_removes_are_idempotent(server, client):
    client.rs.RemoveContainer(pb.RemoveContainerRequest(container_id="nope"))
    client.rs.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id="nope"))
    sid, scfg = run_pod(client)
    cid = create(client, sid, scfg)
    for _ in range(2):
        client.rs.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    for _ in range(2):
        client.rs.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid))
    server.runtime.idempotent_stop = True  # containerd >= the July 2024 backports
    client.rs.StopContainer(pb.StopContainerRequest(container_id=cid))
    client.rs.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid))


def test_remove_pod_sandbox_force_stops_and_removes_containers(server, client):
    sid, scfg = run_pod(client)
    a = create(client, sid, scfg, container_config("a"))
    b = create(client, sid, scfg, container_config("b"))
    client.rs.StartContainer(pb.StartContainerRequest(container_id=a))
    client.rs.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid))
    sa = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=a)).status
    assert (sa.state, sa.exit_code, sa.reason) == (pb.CONTAINER_EXITED, 137, "Error")
    assert client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=b)).status.state == pb.CONTAINER_CREATED
    err = rpc_error(client.rs.CreateContainer,
                    pb.CreateContainerRequest(pod_sandbox_id=sid, config=container_config("c"), sandbox_config=scfg))
    assert err.code() == NOT_FOUND and "no running task found" in err.details()
    err = rpc_error(client.rs.StartContainer, pb.StartContainerRequest(container_id=b))
    assert (err.code(), err.details()) == (UNKNOWN, f'sandbox container "{sid}" is not running')
    assert server.runtime.container(b).reason == "StartError"
    client.rs.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid))
    assert server.runtime.containers == {} and server.runtime.sandboxes == {}


def test_state_errors(server, client):
    sid, scfg = run_pod(client)
    cid = create(client, sid, scfg)
    err = rpc_error(client.rs.ExecSync, pb.ExecSyncRequest(container_id=cid, cmd=["true"]))
    assert (err.code(), err.details()) == (UNKNOWN, "failed to exec in container: container is in CONTAINER_CREATED state")
    err = rpc_error(client.rs.ContainerStats, pb.ContainerStatsRequest(container_id=cid))
    assert (err.code(), err.details()) == (UNKNOWN, "unexpected metrics response: []")
    client.rs.StopContainer(pb.StopContainerRequest(container_id=cid))  # not running: a no-op
    client.rs.StartContainer(pb.StartContainerRequest(container_id=cid))
    err = rpc_error(client.rs.StartContainer, pb.StartContainerRequest(container_id=cid))
    assert (err.code(), err.details()) == (
        UNKNOWN, f'failed to set starting state for container "{cid}": container is in CONTAINER_RUNNING state')
    assert client.rs.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"])).exit_code == 0
    server.runtime.exit_container(cid, 3)
    st = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)).status
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 3, "Error")


def test_duplicate_names_are_reserved(server, client):
    sid, scfg = run_pod(client)
    err = rpc_error(client.rs.RunPodSandbox, pb.RunPodSandboxRequest(config=scfg))
    name = f"web_default_{scfg.metadata.uid}_0"
    assert (err.code(), err.details()) == (
        UNKNOWN, f'failed to reserve sandbox name "{name}": name "{name}" is reserved for "{sid}"')
    cid = create(client, sid, scfg)
    err = rpc_error(create, client, sid, scfg)
    cname = f"main_web_default_{scfg.metadata.uid}_0"
    assert (err.code(), err.details()) == (
        UNKNOWN, f'failed to reserve container name "{cname}": name "{cname}" is reserved for "{cid}"')
    create(client, sid, scfg, container_config(attempt=1))  # a new attempt is a new name
    client.rs.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    create(client, sid, scfg)  # released by RemoveContainer
    err = rpc_error(client.rs.RunPodSandbox, pb.RunPodSandboxRequest(config=scfg, runtime_handler="kata"))
    assert (err.code(), err.details()) == (UNKNOWN, 'failed to get sandbox runtime: no runtime for "kata" is configured')


def test_unimplemented_and_unknown_methods(server, client):
    err = rpc_error(client.rs.CheckpointContainer, pb.CheckpointContainerRequest(container_id="x"))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNIMPLEMENTED, "method CheckpointContainer not implemented")
    err = rpc_error(lambda: list(client.rs.StreamContainers(pb.StreamContainersRequest())))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    err = rpc_error(client.channel.unary_unary("/runtime.v1.RuntimeService/NoSuch"), b"\n\x02v1")
    assert (err.code(), err.details()) == (  # recorder-smoke.jsonl seq 12, verbatim
        grpc.StatusCode.UNIMPLEMENTED, "unknown method NoSuch for service runtime.v1.RuntimeService")
    err = rpc_error(client.channel.unary_unary("/runtime.v1alpha2.RuntimeService/Version"), b"")
    assert (err.code(), err.details()) == (grpc.StatusCode.UNIMPLEMENTED, "unknown service runtime.v1alpha2.RuntimeService")
    assert [(c.name, c.code) for c in server.runtime.calls] == [
        ("CheckpointContainer", "UNIMPLEMENTED"), ("StreamContainers", "UNIMPLEMENTED"),
        ("NoSuch", "UNIMPLEMENTED"), ("Version", "UNIMPLEMENTED")]


# --------------------------------------------------------------------------- filters


def test_list_filters(server, client):
    s1, c1cfg = run_pod(client, sandbox_config("one", uid="1" * 32, tier="a"))
    s2, c2cfg = run_pod(client, sandbox_config("two", uid="2" * 32, tier="b"))
    client.rs.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s2))
    ids = lambda items: sorted(i.id for i in items)  # noqa: E731

    def pods(**f):
        return ids(client.rs.ListPodSandbox(pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(**f))).items)

    assert ids(client.rs.ListPodSandbox(pb.ListPodSandboxRequest()).items) == sorted([s1, s2])
    assert pods(id=s1) == [s1] and pods(id=s2[:8]) == [s2] and pods(id="zzz") == []
    assert pods(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)) == [s1]
    assert pods(state=pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)) == [s2]
    assert pods(label_selector={"tier": "b"}) == [s2]
    assert pods(label_selector={"tier": "b", "io.kubernetes.pod.name": "one"}) == []

    a = create(client, s1, c1cfg, container_config("a", role="x"))
    b = create(client, s1, c1cfg, container_config("b", role="y"))
    client.rs.StartContainer(pb.StartContainerRequest(container_id=b))

    def ctrs(**f):
        return ids(client.rs.ListContainers(pb.ListContainersRequest(filter=pb.ContainerFilter(**f))).containers)

    assert ctrs() == sorted([a, b]) and ctrs(id=a) == [a] and ctrs(id=b[:10]) == [b]
    assert ctrs(pod_sandbox_id=s1) == sorted([a, b]) and ctrs(pod_sandbox_id=s1[:6]) == sorted([a, b])
    assert ctrs(pod_sandbox_id=s2) == []
    assert ctrs(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)) == [b]
    assert ctrs(state=pb.ContainerStateValue(state=pb.CONTAINER_CREATED)) == [a]
    assert ctrs(label_selector={"role": "x"}) == [a]
    assert ctrs(label_selector={"role": "x", "io.kubernetes.container.name": "b"}) == []

    stats = client.rs.ListContainerStats(pb.ListContainerStatsRequest()).stats
    assert [s.attributes.id for s in stats] == [b]  # only running containers have metrics
    assert stats[0].memory.available_bytes.value == 134217728 - stats[0].memory.working_set_bytes.value
    assert client.rs.ListContainerStats(
        pb.ListContainerStatsRequest(filter=pb.ContainerStatsFilter(label_selector={"role": "x"}))).stats == []
    assert client.rs.ContainerStats(pb.ContainerStatsRequest(container_id=b)).stats.attributes.labels["role"] == "y"
    [pstats] = client.rs.ListPodSandboxStats(pb.ListPodSandboxStatsRequest()).stats
    assert pstats.attributes.id == s1 and [c.attributes.id for c in pstats.linux.containers] == [b]


# --------------------------------------------------------------------------- images and knobs


def test_image_service(server, client):
    images = client.im.ListImages(pb.ListImagesRequest()).images
    assert {i.repo_tags[0] for i in images} == {"localhost/busybox:latest", "localhost/pause:e2e"}
    assert client.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="busybox"))) == pb.ImageStatusResponse()
    ref = client.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox"))).image_ref
    st = client.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image="docker.io/library/busybox:latest"),
                                                     verbose=True))
    assert st.image.id == ref and st.image.repo_tags == ["docker.io/library/busybox:latest"]
    assert st.image.repo_digests[0].startswith("docker.io/library/busybox@sha256:") and "chainID" in st.info["info"]
    assert client.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=ref))).image.id == ref
    fs = client.im.ImageFsInfo(pb.ImageFsInfoRequest()).image_filesystems[0]
    assert fs.used_bytes.value == sum(i.size for i in server.runtime.images.values()) and fs.fs_id.mountpoint
    client.im.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image="busybox")))
    client.im.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image="busybox")))  # idempotent
    assert len(client.im.ListImages(pb.ListImagesRequest()).images) == 2

    server.runtime.strict_images = True
    sid, scfg = run_pod(client)
    cfg = container_config()
    cfg.image.image = "quay.io/nothing:here"
    err = rpc_error(create, client, sid, scfg, cfg)
    assert (err.code(), err.details()) == (NOT_FOUND, 'failed to resolve image "quay.io/nothing:here": not found')


def test_delay_and_fail_knobs(server, client):
    rt = server.runtime
    rt.delays["PullImage"] = 0.6
    t0 = time.monotonic()
    # a slow pull does not block other calls
    result: list = []
    t = threading.Thread(target=lambda: result.append(
        client.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="nginx:1.25")))))
    t.start()
    time.sleep(0.05)
    t1 = time.monotonic()
    client.rs.Version(pb.VersionRequest())
    assert time.monotonic() - t1 < 0.4 and t.is_alive()
    t.join()
    assert time.monotonic() - t0 >= 0.6 and result[0].image_ref.startswith("sha256:")
    assert rt.images[result[0].image_ref].repo_tags == ["docker.io/library/nginx:1.25"]

    rt.fail["/runtime.v1.RuntimeService/RunPodSandbox"] = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
    err = rpc_error(run_pod, client)
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
    assert rt.sandboxes == {} and rt.calls_of("RunPodSandbox")[0].code == "RESOURCE_EXHAUSTED"
    del rt.fail["/runtime.v1.RuntimeService/RunPodSandbox"]

    sid, scfg = run_pod(client)
    cid = create(client, sid, scfg)
    client.rs.StartContainer(pb.StartContainerRequest(container_id=cid))
    rt.delays["ExecSync"] = 5
    t0 = time.monotonic()
    err = rpc_error(client.rs.ExecSync, pb.ExecSyncRequest(container_id=cid, cmd=["sleep"], timeout=1))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED, "failed to exec in container: timeout 1s exceeded: context deadline exceeded")
    assert 1.0 <= time.monotonic() - t0 < 3
    rt.delays["ExecSync"] = 0.1
    rt.exec_sync_result = (b"ok\n", b"", 0)
    assert client.rs.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=1)).stdout == b"ok\n"
    rt.exec_sync_output = lambda cmd: (cmd[1].encode(), b"", 3) if cmd[0] == "echo" else None
    r = client.rs.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hi"], timeout=1))
    assert (r.stdout, r.exit_code) == (b"hi", 3)
    assert client.rs.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=1)).stdout == b"ok\n"


def test_concurrent_clients(server, client):
    def worker(i: int) -> None:
        c = Client(server.address)
        try:
            sid, scfg = run_pod(c, sandbox_config(f"p{i}", uid=f"{i:032x}"))
            for n in range(3):
                create(c, sid, scfg, container_config(f"c{n}"))
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(client.rs.ListPodSandbox(pb.ListPodSandboxRequest()).items) == 8
    assert len(client.rs.ListContainers(pb.ListContainersRequest()).containers) == 24
    assert len(server.runtime.received_create_requests) == 24


def test_serve_fake_runtime_with_asyncio(tmp_path):
    path = _sock(tmp_path)

    async def main() -> None:
        server, rt = await serve_fake_runtime(f"unix://{path}", cgroup_driver="systemd", delays={"Version": 0.01})
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
                rs = api_pb2_grpc.RuntimeServiceStub(ch)
                assert (await rs.RuntimeConfig(pb.RuntimeConfigRequest())).linux.cgroup_driver == pb.SYSTEMD
                assert (await rs.Version(pb.VersionRequest())).runtime_api_version == "v1"
            assert [c.name for c in rt.calls] == ["RuntimeConfig", "Version"]
        finally:
            await server.stop(None)

    # not asyncio.run(): it leaves the main thread's policy with "no current event loop",
    # which breaks later tests that still call asyncio.get_event_loop()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_handle_without_grpc():
    rt = FakeRuntime()
    resp = pb.VersionResponse.FromString(rt.handle("/runtime.v1.RuntimeService/Version", b""))
    assert resp.runtime_name == "fake-runtime"


# --------------------------------------------------------------------------- trace replay


def _trace_calls(path: Path) -> list[dict]:
    with open_text(str(path)) as f:
        lines = f.read().splitlines()
    assert json.loads(lines[0])["format"] == "cri-trace"
    return sorted((json.loads(line) for line in lines[1:]), key=lambda r: r["start"])


@pytest.mark.parametrize("trace", [TRACE_OFF, TRACE_ON], ids=["memqos-off", "memqos-on"])
def test_replay_trace_requests(server, client, trace):
    """Replay the trace's RunPodSandbox/CreateContainer/StartContainer bytes (sandbox and
    container ids mapped to the new ones); the fake's answers then equal containerd 1.6.20's
    recorded ContainerStatus/PodSandboxStatus/ListContainers answers apart from ids and times."""
    calls = _trace_calls(trace)
    unary = lambda path: client.channel.unary_unary(path)  # noqa: E731 - raw bytes in, bytes out
    sandbox_ids: dict[str, str] = {}
    container_ids: dict[str, str] = {}
    sent_creates: list[bytes] = []
    recorded_status: dict[str, pb.ContainerStatus] = {}
    recorded_sandbox: dict[str, pb.PodSandboxStatus] = {}
    recorded_list: dict[str, pb.Container] = {}
    for call in calls:
        method = call["method"].rsplit("/", 1)[1]
        request = base64.b64decode(call["request"])
        response = base64.b64decode(call["responses"][0]) if call["responses"] else b""
        if call["code"] != "OK":
            continue
        if method == "RunPodSandbox":
            new = pb.RunPodSandboxResponse.FromString(unary(call["method"])(request)).pod_sandbox_id
            sandbox_ids[pb.RunPodSandboxResponse.FromString(response).pod_sandbox_id] = new
        elif method == "CreateContainer":
            req = pb.CreateContainerRequest.FromString(request)
            req.pod_sandbox_id = sandbox_ids[req.pod_sandbox_id]
            body = req.SerializeToString()
            sent_creates.append(body)
            new = pb.CreateContainerResponse.FromString(unary(call["method"])(body)).container_id
            container_ids[pb.CreateContainerResponse.FromString(response).container_id] = new
        elif method == "StartContainer":
            old = pb.StartContainerRequest.FromString(request).container_id
            client.rs.StartContainer(pb.StartContainerRequest(container_id=container_ids[old]))
        elif method == "ContainerStatus":
            st = pb.ContainerStatusResponse.FromString(response).status
            if st.state == pb.CONTAINER_RUNNING and st.id in container_ids:
                recorded_status.setdefault(st.id, st)
        elif method == "PodSandboxStatus":
            st = pb.PodSandboxStatusResponse.FromString(response).status
            if st.state == pb.SANDBOX_READY and st.id in sandbox_ids:
                recorded_sandbox.setdefault(st.id, st)
        elif method == "ListContainers" and container_ids and len(recorded_list) < len(container_ids):
            for c in pb.ListContainersResponse.FromString(response).containers:
                if c.id in container_ids and c.state == pb.CONTAINER_RUNNING:
                    recorded_list.setdefault(c.id, c)

    assert len(sandbox_ids) == 6 and len(container_ids) == 8
    rt = server.runtime
    assert rt.received_create_requests == sent_creates
    for old, new in container_ids.items():
        c = rt.container(new)
        original = next(pb.CreateContainerRequest.FromString(base64.b64decode(x["request"])) for x in calls
                        if x["method"].endswith("/CreateContainer") and
                        pb.CreateContainerResponse.FromString(base64.b64decode(x["responses"][0])).container_id == old)
        assert c.labels == dict(original.config.labels) and c.annotations == dict(original.config.annotations)
        assert c.pod_sandbox_id == sandbox_ids[original.pod_sandbox_id]
        assert c.labels["io.kubernetes.pod.name"] == rt.sandbox(c.pod_sandbox_id).labels["io.kubernetes.pod.name"]

    assert len(recorded_status) >= 7 and len(recorded_sandbox) == 6 and recorded_list
    for old, want in recorded_status.items():
        got = client.rs.ContainerStatus(pb.ContainerStatusRequest(container_id=container_ids[old])).status
        assert got.id == container_ids[old]
        for st in (got, want):
            st.id, st.created_at, st.started_at = "", 0, 0
        assert got == want
    for old, want in recorded_sandbox.items():
        got = client.rs.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_ids[old])).status
        for st in (got, want):
            st.id, st.created_at = "", 0
        assert got == want
    listed = {c.id: c for c in client.rs.ListContainers(pb.ListContainersRequest()).containers}
    for old, want in recorded_list.items():
        got = listed[container_ids[old]]
        assert got.pod_sandbox_id == sandbox_ids[want.pod_sandbox_id]
        for c in (got, want):
            c.id, c.pod_sandbox_id, c.created_at = "", "", 0
        assert got == want


# --------------------------------------------------------------------------- command line


def test_command_line(tmp_path):
    path = _sock(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", str(path), "--cgroup-driver", "systemd",
         "--delay", "Version=0.01", "--fail", "PullImage=UNAVAILABLE:registry down"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"fake-runtime listening on unix://{path}"
        c = Client(f"unix://{path}")
        try:
            assert c.rs.RuntimeConfig(pb.RuntimeConfigRequest()).linux.cgroup_driver == pb.SYSTEMD
            err = rpc_error(c.im.PullImage, pb.PullImageRequest(image=pb.ImageSpec(image="x")))
            assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "registry down")
        finally:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
