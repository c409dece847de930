"""The soak's clients: pod workers (grpcio channels, each a kubelet's connection) taking pods
through their life the way a kubelet does, and a poller (the shim's own ``UnaryClient``, reads
only) relisting like the kubelet's PLEG. Every call goes through ``Context.rpc``, which
classifies its answer (``checks.Tally``)."""
from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from shim.cri import pb
from shim.cri.methods import CRI_METHODS
from shim.decision import Decision
from shim.tools.kubelet_requests import create_container, oom_score_adj, sandbox_config, update_resources
from memqos_dev.tools.soak.checks import LOST, MANGLED, OK, STALE, UNAVAILABLE, Expect, Tally, status_problems
from memqos_dev.tools.soak.stack import CAPACITY, MI, Faults, make_cgroup_dir
from shim.transport.unary_client import CallError, UnaryClient

PATHS = {m.name: m.path for m in CRI_METHODS}
_SERVICES = {s.name: s for s in pb.DESCRIPTOR.services_by_name.values()}
RESPONSES = {m.name: getattr(pb, m.output_type.name) for s in _SERVICES.values() for m in s.methods}

# (qos, pod annotations' requests, [(container, request, limit, kubelet's unified)], resized container)
PODS = [
    ("guaranteed", None, [("app", 256 * MI, 256 * MI, {})], None),
    ("burstable", {"app": "128Mi", "sidecar": "32Mi"},
     [("app", 128 * MI, 512 * MI, {"memory.oom.group": "1"}), ("sidecar", 32 * MI, 0, {})], "app"),
    ("burstable", {"worker": "64Mi"}, [("worker", 64 * MI, 0, {})], None),
    ("besteffort", None, [("job", 0, 0, {})], None),
    ("burstable", None, [("web", 0, 256 * MI, {"memory.high": "max"})], "web"),
]


class Stop(Exception):
    """The run is over (calls or time): the worker leaves its pod where it is."""


class GrpcConn:
    """One grpcio channel (one HTTP/2 connection, as a kubelet keeps), raw bytes both ways."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stubs: dict[str, Callable] = {}

    def call(self, name: str, request: bytes, timeout: float) -> tuple[str, str, bytes | None]:
        stub = self.stubs.get(name)
        if stub is None:
            stub = self.stubs[name] = self.channel.unary_unary(PATHS[name])
        try:
            return "OK", "", stub(request, timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", None

    def close(self) -> None:
        self.channel.close()


class UnaryConn:
    """The shim's own small HTTP/2 client (the reconciler's), for reads."""

    def __init__(self, target: str) -> None:
        self.client = UnaryClient(target)

    def call(self, name: str, request: bytes, timeout: float) -> tuple[str, str, bytes | None]:
        try:
            return "OK", "", self.client.call(PATHS[name], request, timeout)
        except CallError as e:
            return e.code, e.details, None
        except Exception as e:  # noqa: BLE001 - a client bug shows as a mangled call
            return "CLIENT_ERROR", f"{e.__class__.__name__}: {e}", None

    def close(self) -> None:
        self.client.close()


@dataclass
class Context:
    target: str
    cgroot: Path
    expect: Expect
    faults: Faults
    tally: Tally
    calls: int
    deadline: float  # per call, seconds
    grace: float  # after an outage, seconds
    backoff: float  # pause after an UNAVAILABLE, seconds
    end_at: float  # time.monotonic() when the run stops
    stop: threading.Event = field(default_factory=threading.Event)
    removing: set = field(default_factory=set)  # container ids whose removal was asked for

    def over(self) -> bool:
        return self.stop.is_set() or self.tally.total >= self.calls or time.monotonic() >= self.end_at

    def rpc(self, conn, name: str, msg, *, epoch: int | None = None, check: Callable | None = None,
            removing: str = "") -> tuple[object | None, int]:
        """One call, classified; (the response if OK, the epoch when it started). ``epoch``: when
        the object the call is about was made (NOT_FOUND is stale once the runtime restarted
        since); ``check(response) -> [problems]`` runs when no restart happened meanwhile;
        ``removing``: an id whose NOT_FOUND is expected once its removal was asked for."""
        if self.over():
            raise Stop
        faults = self.faults
        e0, t0 = faults.epoch, time.monotonic()
        code, details, raw = conn.call(name, msg.SerializeToString(), self.deadline)
        t1, e1 = time.monotonic(), faults.epoch
        tally = self.tally
        if code == "OK":
            try:
                resp = RESPONSES[name].FromString(raw)
            except DecodeError as e:
                tally.add(MANGLED, name, f"answer does not parse as {RESPONSES[name].__name__}: {e}")
                return None, e0
            if check is not None and e0 == e1 and (epoch is None or epoch == e1):
                problems = check(resp)
                if problems:
                    tally.add(MANGLED, name, "; ".join(problems)[:300])
                    return None, e0
            tally.add(OK, name)
            return resp, e0
        if code == "UNAVAILABLE" and faults.in_outage(t0, t1, self.grace):
            tally.add(UNAVAILABLE, name, details[:120])
            self.stop.wait(self.backoff)  # a kubelet backs off too; no busy loop against the outage
        elif code == "NOT_FOUND" and ((epoch is not None and epoch < e1) or (removing and removing in self.removing)):
            tally.add(STALE, name, details[:120])
        elif code == "DEADLINE_EXCEEDED":
            tally.add(LOST, name, f"no answer within {self.deadline:g} s")
        else:
            tally.add(MANGLED, name, f"{code}: {details[:200]} (epoch {e0}->{e1})")
        return None, e0


def _is_id(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


@dataclass
class Pod:
    sid: str
    epoch: int
    containers: list = field(default_factory=list)  # [cid, epoch, request sent, decision, unified now, limit]


class PodWorker(threading.Thread):
    """A kubelet's connection: pods one after another, each through its whole life; a pod
    whose call failed is left and cleaned up (RemoveContainer, StopPodSandbox, RemovePodSandbox)
    before the next one, as the kubelet's garbage collection would."""

    def __init__(self, ctx: Context, index: int, polls: int = 2) -> None:
        super().__init__(name=f"soak-pods-{index}", daemon=True)
        self.ctx, self.index, self.polls = ctx, index, polls
        self.conn = GrpcConn(ctx.target)
        self.garbage: list[Pod] = []
        self.pods = 0
        self.error = ""

    def run(self) -> None:
        try:
            while not self.ctx.over():
                self.collect()
                self.one_pod(self.pods)
                self.pods += 1
        except Stop:
            pass
        except Exception as e:  # noqa: BLE001
            self.error = f"{e.__class__.__name__}: {e}"
        finally:
            self.conn.close()

    def rpc(self, name: str, msg, **kw):
        return self.ctx.rpc(self.conn, name, msg, **kw)

    def collect(self) -> None:
        keep = []
        for pod in self.garbage:
            done = True
            for c in pod.containers:
                self.ctx.removing.add(c[0])
                done &= self.rpc("RemoveContainer", pb.RemoveContainerRequest(container_id=c[0]))[0] is not None
            for name, req in (("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod.sid)),
                              ("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sid))):
                resp, e0 = self.rpc(name, req, epoch=pod.epoch)
                done &= resp is not None or e0 > pod.epoch
            if not done:
                keep.append(pod)
        self.garbage = keep[-50:]

    def one_pod(self, k: int) -> None:
        qos, requests, containers, resized = PODS[k % len(PODS)]
        name = f"soak-{self.index}-{k}"
        uid = f"{self.index:08x}-{k >> 16 & 0xFFFF:04x}-4000-8000-{k & 0xFFFFFFFFFFFF:012x}"
        pod_dir = self.ctx.cgroot / "kubepods" / (f"pod{uid}" if qos == "guaranteed" else f"{qos}/pod{uid}")
        make_cgroup_dir(pod_dir)  # the kubelet makes the pod cgroup before RunPodSandbox
        try:
            ann = {"memqos.io/requests": json.dumps(requests)} if requests else None
            sb = sandbox_config(name, uid, qos, annotations=ann)
            r, e = self.rpc("RunPodSandbox", pb.RunPodSandboxRequest(config=sb),
                            check=lambda r: [] if _is_id(r.pod_sandbox_id) else [f"sandbox id {r.pod_sandbox_id!r}"])
            if r is None:
                return
            pod = Pod(r.pod_sandbox_id, e)
            if not self.life(pod, sb, qos, containers, resized):
                self.garbage.append(pod)
        finally:
            shutil.rmtree(pod_dir, ignore_errors=True)  # the kubelet removes it after RemovePodSandbox

    def life(self, pod: Pod, sb, qos: str, containers, resized) -> bool:
        sid = pod.sid
        ok = self.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=sid), epoch=pod.epoch,
                      check=lambda r: [] if r.status.id == sid and r.status.metadata == sb.metadata
                      and r.status.state == pb.SANDBOX_READY else ["sandbox status differs"])[0]
        if ok is None:
            return False
        for cname, request, limit, unified in containers:
            req = create_container(sid, sb, cname, qos, request=request, limit=limit, unified=unified, capacity=CAPACITY)
            d = self.ctx.expect.create(req)
            r, e = self.rpc("CreateContainer", req, epoch=pod.epoch,
                            check=lambda r: [] if _is_id(r.container_id) else [f"container id {r.container_id!r}"])
            if r is None:
                return False
            c = [r.container_id, e, req, d, dict(d.unified_after), limit]
            pod.containers.append(c)
            if not self.status(c, pb.CONTAINER_CREATED, rewrite=True):
                return False
            if self.rpc("StartContainer", pb.StartContainerRequest(container_id=c[0]), epoch=e)[0] is None:
                return False
        cids = {c[0] for c in pod.containers}
        if self.rpc("ListContainers", pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=sid)),
                    epoch=pod.epoch, check=lambda r: [] if {x.id for x in r.containers} == cids
                    else ["the pod's containers listed differ"])[0] is None:
            return False
        for _ in range(self.polls):
            for c in pod.containers:
                if not self.status(c, pb.CONTAINER_RUNNING):
                    return False
            if self.rpc("ListPodSandbox", pb.ListPodSandboxRequest(), epoch=pod.epoch,
                        check=lambda r: [] if any(s.id == sid for s in r.items) else ["the pod is not listed"])[0] is None:
                return False
        for c in pod.containers:
            if c[2].config.metadata.name == resized and not self.resize(c, qos):
                return False
        for c in pod.containers:
            if self.rpc("StopContainer", pb.StopContainerRequest(container_id=c[0], timeout=30), epoch=c[1])[0] is None:
                return False
            self.ctx.removing.add(c[0])
            if self.rpc("RemoveContainer", pb.RemoveContainerRequest(container_id=c[0]), epoch=c[1])[0] is None:
                return False
        for name, req in (("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sid)),
                          ("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sid))):
            if self.rpc(name, req, epoch=pod.epoch)[0] is None:
                return False
        return True

    def status(self, c: list, state: int, rewrite: bool = False) -> bool:
        cid, epoch, sent, _, unified, limit = c

        def check(r) -> list[str]:
            problems = status_problems(r.status, cid, sent, unified, limit)
            if r.status.state != state:
                problems.append(f"state {r.status.state} != {state}")
            return problems

        resp = self.rpc("ContainerStatus", pb.ContainerStatusRequest(container_id=cid), epoch=epoch, check=check)[0]
        if resp is not None and rewrite and epoch == self.ctx.faults.epoch:
            self.ctx.tally.checked_rewrite()
        return resp is not None

    def resize(self, c: list, qos: str) -> bool:
        """An in-place resize: the limit doubled; the runtime merges the shim's unified into the
        container's (keys are never removed), as containerd does."""
        cid, epoch, sent, at_create, unified, limit = c
        request = at_create.request.bytes
        new_limit = 2 * limit if limit else 1024 * MI
        upd = update_resources(cid, limit=new_limit, oom_score_adj=oom_score_adj(qos, request, CAPACITY))
        d: Decision = self.ctx.expect.update(sent, at_create, upd)
        if self.rpc("UpdateContainerResources", upd, epoch=epoch)[0] is None:
            return False
        c[4] = {**unified, **d.unified_after}
        c[5] = new_limit
        return self.status(c, pb.CONTAINER_RUNNING, rewrite=True)


class Poller(threading.Thread):
    """The kubelet's relist, through the shim's UnaryClient: Version, ListPodSandbox,
    ListContainers, and the status of a few listed containers (NOT_FOUND is expected for one
    whose removal was asked for meanwhile, or after a restart)."""

    def __init__(self, ctx: Context, pause: float = 0.02) -> None:
        super().__init__(name="soak-poller", daemon=True)
        self.ctx, self.pause = ctx, pause
        self.conn = UnaryConn(ctx.target)
        self.error = ""

    def run(self) -> None:
        ctx = self.ctx
        try:
            while not ctx.over():
                ctx.rpc(self.conn, "Version", pb.VersionRequest(version="0.1.0"),
                        check=lambda r: [] if r.runtime_name == "fake-runtime" and r.runtime_api_version == "v1"
                        else [f"version answer {r.runtime_name!r} {r.runtime_api_version!r}"])
                ctx.rpc(self.conn, "ListPodSandbox", pb.ListPodSandboxRequest(),
                        check=lambda r: [] if all(_is_id(s.id) for s in r.items) else ["a sandbox id is not an id"])
                r, e = ctx.rpc(self.conn, "ListContainers", pb.ListContainersRequest(),
                               check=lambda r: [] if all(_is_id(x.id) for x in r.containers) else ["bad container id"])
                for x in (r.containers[:2] if r is not None else ()):
                    cid = x.id
                    ctx.rpc(self.conn, "ContainerStatus", pb.ContainerStatusRequest(container_id=cid), epoch=e,
                            removing=cid, check=lambda s, cid=cid: [] if s.status.id == cid else ["status of another id"])
                time.sleep(self.pause)
        except Stop:
            pass
        except Exception as e:  # noqa: BLE001
            self.error = f"{e.__class__.__name__}: {e}"
        finally:
            self.conn.close()
