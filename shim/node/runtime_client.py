"""The reconciler's own, direct connection to the runtime (not through the proxy): listings
and statuses to rebuild the node state after a restart and to resync periodically.

Synchronous unary gRPC calls (shim.transport.unary_client), used only from the reconciler's thread.
"""
from __future__ import annotations

import json
import logging
import posixpath
import time
from types import MappingProxyType
from typing import Any

from shim.cri import pb
from shim.cri.methods import RUNTIME_SERVICE
from shim.decision import PodFacts
from shim.cri.facts import derived_request
from shim.decision.pod import container_request, note_class
from shim.node.state import ContainerRecord, NodeState, PodRecord, SandboxRecord, SandboxView, Snapshot
from shim.transport.unary_client import CallError, UnaryClient

log = logging.getLogger(__name__)


class RuntimeUnavailable(Exception):
    def __init__(self, method: str, code: str, details: str):
        super().__init__(f"{method}: {code} {details}".strip())
        self.code = code


class RuntimeClient:
    """The CRI calls the reconciler needs, on a small blocking HTTP/2 client
    (``shim.transport.unary_client``: no grpcio in `serve`)."""

    def __init__(self, endpoint: str, *, timeout: float = 10.0):
        self.endpoint = endpoint
        self.timeout = timeout
        self._client = UnaryClient(endpoint, max_message_bytes=128 * 1024 * 1024)

    def close(self) -> None:
        self._client.close()

    def _call(self, name: str, request: Any, response_cls: Any) -> Any:
        try:
            raw = self._client.call(RUNTIME_SERVICE + name, request.SerializeToString(), self.timeout)
        except CallError as e:
            raise RuntimeUnavailable(name, e.code, e.details) from None
        try:
            return response_cls.FromString(raw)
        except Exception as e:  # noqa: BLE001 - a runtime answering garbage
            raise RuntimeUnavailable(name, "INTERNAL", f"undecodable answer: {e}") from None

    def list_sandboxes(self) -> list:
        return list(self._call("ListPodSandbox", pb.ListPodSandboxRequest(), pb.ListPodSandboxResponse).items)

    def list_containers(self) -> list:
        return list(self._call("ListContainers", pb.ListContainersRequest(), pb.ListContainersResponse).containers)

    def sandbox_status(self, sid: str, verbose: bool = True):
        """PodSandboxStatusResponse, or None when the sandbox is gone."""
        try:
            return self._call("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=verbose),
                              pb.PodSandboxStatusResponse)
        except RuntimeUnavailable as e:
            if e.code == "NOT_FOUND":
                return None
            raise

    def container_status(self, cid: str):
        """ContainerStatus, or None when the container is gone."""
        try:
            return self._call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid),
                              pb.ContainerStatusResponse).status
        except RuntimeUnavailable as e:
            if e.code == "NOT_FOUND":
                return None
            raise


def _int(v: Any) -> int:
    if isinstance(v, bool):
        return 0
    if isinstance(v, int):
        return max(0, v)
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return 0


def sandbox_info(resp: Any) -> tuple[str, int]:
    """(cgroup_parent, overhead bytes) from a verbose PodSandboxStatus: containerd's info JSON
    carries the whole PodSandboxConfig under "config" (proto field names; camelCase accepted);
    failing that, the pause container's runtimeSpec cgroupsPath gives the parent."""
    raw = resp.info.get("info") if resp is not None else None
    if not raw:
        return "", 0
    try:
        doc = json.loads(raw)
    except ValueError:
        return "", 0
    if not isinstance(doc, dict):
        return "", 0
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    linux = cfg.get("linux") if isinstance(cfg.get("linux"), dict) else {}
    parent = linux.get("cgroup_parent") or linux.get("cgroupParent") or ""
    oh = linux.get("overhead") if isinstance(linux.get("overhead"), dict) else {}
    overhead = _int(oh.get("memory_limit_in_bytes", oh.get("memoryLimitInBytes", 0)))
    if not parent:
        spec = doc.get("runtimeSpec") if isinstance(doc.get("runtimeSpec"), dict) else {}
        path = (spec.get("linux") or {}).get("cgroupsPath") if isinstance(spec.get("linux"), dict) else ""
        if isinstance(path, str) and path:
            # systemd: "<parent slice>:<prefix>:<id>"; cgroupfs: "<parent>/<id>"
            parent = path.split(":", 1)[0] if ":" in path else posixpath.dirname(path)
    return (parent if isinstance(parent, str) else ""), overhead


def take_snapshot(client: RuntimeClient, known: NodeState | None, capacity: int, gen: int = 1) -> Snapshot:
    """List sandboxes and containers (listing number ``gen``); ask for the statuses the known
    state lacks (all of them when ``known`` is None: a full rebuild)."""
    snap = Snapshot(gen=gen, taken_at=time.time_ns())
    sandboxes = client.list_sandboxes()
    t0 = time.time_ns()
    containers = client.list_containers()
    t1 = time.time_ns()
    views: dict[str, SandboxView] = {}
    for s in sandboxes:
        md = s.metadata
        if not md.uid:
            continue
        record = SandboxRecord(s.id, md.uid, s.state == pb.SANDBOX_READY, s.created_at)
        view = SandboxView(record, PodRecord(md.uid, md.namespace, md.name, dict(s.annotations)))
        pod = known.pod_of_sandbox(s.id) if known is not None else None
        sb = pod.sandboxes.get(s.id) if pod is not None else None
        if sb is not None and sb.cgroup_parent:
            record.cgroup_parent, record.overhead = sb.cgroup_parent, sb.overhead
        else:
            status = client.sandbox_status(s.id, verbose=True)
            if status is None:
                continue
            record.cgroup_parent, record.overhead = sandbox_info(status)
            if not record.cgroup_parent and sb is not None:
                record.cgroup_parent = sb.cgroup_parent
        views[s.id] = view
        snap.sandboxes.append(view)
    for c in containers:
        view = views.get(c.pod_sandbox_id)
        if view is None:
            continue
        exited = c.state == pb.CONTAINER_EXITED
        kc = known.container(c.id) if known is not None else None
        if kc is not None and (not exited or kc.finished_at):
            rec = ContainerRecord(**{**kc.__dict__})
            rec.created_at = c.created_at or kc.created_at
            rec.exists_at = kc.exists_at or t1
            rec.first_gen = kc.first_gen or gen
            if not exited:
                rec.finished_at = 0
                rec.alive_at = max(kc.alive_at, t0)
                rec.alive_gen = gen
            snap.containers.append(rec)
            continue
        ts = time.time_ns()
        st = client.container_status(c.id)
        te = time.time_ns()
        if st is None:
            continue
        res = st.resources.linux if st.HasField("resources") else pb.LinuxContainerResources()
        pod = view.pod
        facts = PodFacts(uid=pod.uid, namespace=pod.namespace, name=pod.name, cgroup_parent=view.record.cgroup_parent,
                         annotations=MappingProxyType(dict(pod.annotations)))
        name = st.metadata.name or c.metadata.name
        if kc is not None:
            b, src, note = kc.request, kc.source, None
        else:
            b, src, note = container_request(res.unified, st.annotations or c.annotations,
                                             lambda: derived_request(facts, name, res, capacity))
        st_exited = st.state == pb.CONTAINER_EXITED
        snap.containers.append(ContainerRecord(
            id=c.id, sandbox_id=c.pod_sandbox_id, name=name,
            attempt=st.metadata.attempt or c.metadata.attempt, request=b, source=src,
            qos=str(note.get("qos", "")) if note else (kc.qos if kc else ""),
            cgroup_parent=str(note.get("cgroup_parent", "")) if note else (kc.cgroup_parent if kc else ""),
            cls=note_class(note) if note else (kc.cls if kc else ""),
            created_at=st.created_at or c.created_at,
            finished_at=st.finished_at if st_exited else 0,
            create_start=kc.create_start if kc else 0,
            exists_at=(kc.exists_at if kc and kc.exists_at else t1),
            exited_by=te if st_exited else 0,
            alive_at=0 if st_exited else ts,
            first_gen=(kc.first_gen if kc and kc.first_gen else gen),
            alive_gen=0 if exited else gen,
        ))
    return snap
