"""The kubelet trace and its replay through the shim's socket (e2e/guest.py's trace scenarios)."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from guest_common import (
    Cri, InfraError, NODE_CALLS, REMOVE_PHASE, Report, log
)


def substitute_ids(msg, idmap: dict[str, str]) -> int:
    """Replace every string field (also repeated and map values) equal to a recorded id."""
    from google.protobuf.descriptor import FieldDescriptor as F

    n = 0
    for fd, value in msg.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == F.LABEL_REPEATED
        if fd.type == F.TYPE_STRING:
            if repeated:
                for i, v in enumerate(value):
                    if v in idmap:
                        value[i] = idmap[v]
                        n += 1
            elif value in idmap:
                setattr(msg, fd.name, idmap[value])
                n += 1
        elif fd.type == F.TYPE_MESSAGE:
            if fd.message_type.GetOptions().map_entry:
                vfield = fd.message_type.fields_by_name["value"]
                for k in list(value.keys()):
                    if vfield.type == F.TYPE_STRING and value[k] in idmap:
                        value[k] = idmap[value[k]]
                        n += 1
                    elif vfield.type == F.TYPE_MESSAGE:
                        n += substitute_ids(value[k], idmap)
            elif repeated:
                for m in value:
                    n += substitute_ids(m, idmap)
            else:
                n += substitute_ids(value, idmap)
    return n


# -- the trace ---------------------------------------------------------------------------------
def short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class Trace:
    def __init__(self, path: str):
        from shim.cri import api_pb2 as pb
        from shim.evidence.trace import open_text

        self.path = path
        with open_text(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        self.header = lines[0]
        if self.header.get("format") != "cri-trace":
            raise InfraError(f"{path}: not a cri-trace file")
        self.calls = sorted(lines[1:], key=lambda c: c["start"])
        self.pod_of_sandbox: dict[str, str] = {}
        self.pod_of_container: dict[str, str] = {}
        self.creates: list[tuple[dict, object, str]] = []  # (call, request, recorded container id)
        for c in self.calls:
            m = short(c["method"])
            if c["code"] != "OK" or not c["method"].startswith("/runtime.v1."):
                continue
            if m == "RunPodSandbox":
                req = pb.RunPodSandboxRequest.FromString(base64.b64decode(c["request"]))
                resp = pb.RunPodSandboxResponse.FromString(base64.b64decode(c["responses"][0]))
                self.pod_of_sandbox[resp.pod_sandbox_id] = req.config.metadata.uid
            elif m == "CreateContainer":
                req = pb.CreateContainerRequest.FromString(base64.b64decode(c["request"]))
                resp = pb.CreateContainerResponse.FromString(base64.b64decode(c["responses"][0]))
                self.pod_of_container[resp.container_id] = req.sandbox_config.metadata.uid
                self.creates.append((c, req, resp.container_id))

    def pod_of_call(self, c: dict, req) -> str | None:
        m = short(c["method"])
        if m == "RunPodSandbox":
            return req.config.metadata.uid
        if m == "CreateContainer":
            return req.sandbox_config.metadata.uid
        if hasattr(req, "container_id") and req.container_id:
            return self.pod_of_container.get(req.container_id)
        if hasattr(req, "pod_sandbox_id") and req.pod_sandbox_id:
            return self.pod_of_sandbox.get(req.pod_sandbox_id)
        return None

    def removal_start(self) -> float:
        starts = [c["start"] for c in self.calls if short(c["method"]) in REMOVE_PHASE]
        return min(starts) if starts else float("inf")


class Replayer:
    """Sends recorded requests through the shim with the recorded ids mapped to the new ones."""

    def __init__(self, cri: Cri, trace: Trace, report: Report, scenario: str):
        self.cri = cri
        self.trace = trace
        self.report = report
        self.scenario = scenario
        self.idmap: dict[str, str] = {}
        self.lock = threading.Lock()
        self.sent: list[dict] = []
        self.after_call = None  # (method, request, response) -> None, in the pod's worker thread
        self.before_call = None  # (method, request) -> None, in the pod's worker thread, before sending
        self.gate = contextlib.nullcontext()  # held around each call (protection.CallGate pauses them)
        # added to every pod's and container's metadata.attempt: a pod of an earlier phase that the
        # runtime could not remove (report["runtime_hangs"]) keeps its sandbox name reserved, and
        # the kubelet's next attempt of the same pod is what gets a new name
        self.attempt = 0

    def _prepare_host(self, name: str, req) -> None:
        """Create what the kubelet had created on its node before the call: the pod log
        directory and the sources of the container's bind mounts (termination-log files)."""
        if name == "RunPodSandbox" and req.config.log_directory:
            os.makedirs(req.config.log_directory, exist_ok=True)
        if name == "CreateContainer":
            if req.sandbox_config.log_directory:
                os.makedirs(os.path.join(req.sandbox_config.log_directory, req.config.metadata.name), exist_ok=True)
            for m in req.config.mounts:
                if not m.host_path or os.path.exists(m.host_path):
                    continue
                if m.container_path in ("/dev/termination-log", "/etc/hosts", "/etc/resolv.conf", "/etc/hostname"):
                    os.makedirs(os.path.dirname(m.host_path), exist_ok=True)
                    open(m.host_path, "a").close()
                else:
                    os.makedirs(m.host_path, exist_ok=True)

    def replay(self, c: dict):
        from shim.cri import api_pb2 as pb

        name = short(c["method"])
        req = getattr(pb, name + "Request").FromString(base64.b64decode(c["request"]))
        with self.lock:
            idmap = dict(self.idmap)
        mapped = substitute_ids(req, idmap)
        if self.attempt:
            if name == "RunPodSandbox":
                req.config.metadata.attempt += self.attempt
            elif name == "CreateContainer":
                req.sandbox_config.metadata.attempt += self.attempt
                req.config.metadata.attempt += self.attempt
        self._prepare_host(name, req)
        if self.before_call is not None:
            self.before_call(name, req)
        t = time.time()
        try:
            with self.gate:
                data = self.cri.raw(c["method"], req.SerializeToString())
        except self.cri.grpc.RpcError as e:
            raise InfraError(f"replayed {name} (trace seq {c['seq']}) failed: {e.code().name}: {e.details()}") from None
        resp = getattr(pb, name + "Response").FromString(data)
        dt = time.time() - t
        learned = {}
        if c["responses"]:
            rec = getattr(pb, name + "Response").FromString(base64.b64decode(c["responses"][0]))
            if name == "RunPodSandbox":
                learned[rec.pod_sandbox_id] = resp.pod_sandbox_id
            elif name == "CreateContainer":
                learned[rec.container_id] = resp.container_id
            elif name == "ImageStatus" and rec.image.id and resp.image.id:
                learned[rec.image.id] = resp.image.id
        with self.lock:
            self.idmap.update(learned)
            self.sent.append({"seq": c["seq"], "method": name, "ids_mapped": mapped, "seconds": round(dt, 2),
                              "learned": learned})
        if self.after_call is not None:
            self.after_call(name, req, resp)
        return req, resp

    def run_phase(self, calls: list[dict], title: str) -> list[tuple[dict, object, object]]:
        """Node-level calls first (in order, once per distinct request), then every pod's calls in
        their recorded order, pods concurrently (as the kubelet's pod workers do)."""
        from shim.cri import api_pb2 as pb

        t = time.time()
        done: list[tuple[dict, object, object]] = []
        per_pod: dict[str, list[dict]] = {}
        seen = set()
        for c in calls:
            name = short(c["method"])
            if name in NODE_CALLS:
                if c["request"] in seen:
                    continue
                seen.add(c["request"])
                req, resp = self.replay(c)
                done.append((c, req, resp))
                continue
            req = getattr(pb, name + "Request").FromString(base64.b64decode(c["request"]))
            pod = self.trace.pod_of_call(c, req) or "?"
            per_pod.setdefault(pod, []).append(c)

        def worker(pod_calls: list[dict]):
            return [(c, *self.replay(c)) for c in pod_calls]

        with ThreadPoolExecutor(max_workers=max(1, len(per_pod))) as pool:
            for result in pool.map(worker, per_pod.values()):
                done.extend(result)
        log(f"{self.scenario}: replayed {len(done)} calls ({title}) in {time.time() - t:.1f}s")
        self.report.timing(f"{self.scenario}:replay-{title}", time.time() - t)
        return done
