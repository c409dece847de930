"""The fake runtime's pod sandbox calls (containerd's sandbox_*.go): run, stop, remove, status, list."""
from __future__ import annotations

from shim.cri import pb
from memqos_dev.testing.fake_runtime import gojson, records
from memqos_dev.testing.fake_runtime.errors import UNKNOWN, CriError, quote
from memqos_dev.testing.fake_runtime.records import (
    DEFAULT_SANDBOX_CPU_SHARES,
    DEFAULT_SANDBOX_OOM_ADJ,
    RUNC_RUNTIME_TYPE,
    Sandbox,
    copy_message,
)
from memqos_dev.testing.fake_runtime.resources import cgroups_path, oci_linux_resources
from memqos_dev.testing.fake_runtime.state import RuntimeState


def _sandbox_fields(sb: Sandbox) -> dict:
    """The fields a PodSandbox list item and a PodSandboxStatus share."""
    return {
        "id": sb.id,
        "metadata": sb.config.metadata,
        "state": sb.state,
        "created_at": sb.created_at,
        "labels": sb.config.labels,
        "annotations": sb.config.annotations,
        "runtime_handler": sb.runtime_handler,
    }


class SandboxCalls(RuntimeState):
    """RunPodSandbox, StopPodSandbox, RemovePodSandbox, PodSandboxStatus, ListPodSandbox and
    UpdatePodSandboxResources on the fake runtime's sandbox records."""

    def _to_cri_sandbox_status(self, sb: Sandbox) -> pb.PodSandboxStatus:
        ip = "" if (sb.host_network or sb.state != pb.SANDBOX_READY) else sb.ip
        status = pb.PodSandboxStatus(**_sandbox_fields(sb))
        status.network.ip = ip
        ns = sb.config.linux.security_context.namespace_options
        status.linux.namespaces.SetInParent()
        if sb.config.linux.security_context.HasField("namespace_options"):
            status.linux.namespaces.options.CopyFrom(ns)
        return status

    def _sandbox_info(self, sb: Sandbox) -> dict[str, str]:
        """PodSandboxStatus verbose info: containerd's SandboxInfo JSON under key "info"."""
        spec = {
            "ociVersion": "1.0.2-dev",
            "process": {
                "user": {"uid": 65535, "gid": 65535},
                "args": ["/pause"],
                "cwd": "/",
                "oomScoreAdj": DEFAULT_SANDBOX_OOM_ADJ,
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": sb.config.hostname,
            "annotations": {
                "io.kubernetes.cri.container-type": "sandbox",
                "io.kubernetes.cri.sandbox-id": sb.id,
                "io.kubernetes.cri.sandbox-log-directory": sb.config.log_directory,
                "io.kubernetes.cri.sandbox-name": sb.config.metadata.name,
                "io.kubernetes.cri.sandbox-namespace": sb.config.metadata.namespace,
                "io.kubernetes.cri.sandbox-uid": sb.config.metadata.uid,
            },
            "linux": {
                "resources": oci_linux_resources(pb.LinuxContainerResources(cpu_shares=DEFAULT_SANDBOX_CPU_SHARES)),
                "cgroupsPath": cgroups_path(sb.cgroup_parent, sb.id),
            },
        }
        cni_result = None
        if not sb.host_network and sb.ip:
            cni_result = {
                "Interfaces": {"eth0": {"IPConfigs": [{"IP": sb.ip, "Gateway": "10.88.0.1"}], "Mac": ""}},
                "DNS": [{}, {}],
                "Routes": None,
            }
        info = {
            "pid": sb.pid,
            "processStatus": "running" if sb.state == pb.SANDBOX_READY else "deleted",
            "netNamespaceClosed": (not sb.host_network) and sb.state != pb.SANDBOX_READY,
            "image": self.sandbox_image,
            "snapshotKey": sb.id,
            "snapshotter": "overlayfs",
            "runtimeHandler": sb.runtime_handler,
            "runtimeType": RUNC_RUNTIME_TYPE,
            "runtimeOptions": self._runtime_options(),
            "config": sb.config,
            "runtimeSpec": spec,
            "cniResult": cni_result,
        }
        return {"info": gojson.dumps(info)}

    def _run_pod_sandbox(self, req: pb.RunPodSandboxRequest, raw: bytes) -> pb.RunPodSandboxResponse:
        """RunPodSandbox, as containerd's sandbox_run.go.

        * no metadata -> UNKNOWN "sandbox config must include metadata";
        * the name <pod>_<namespace>_<uid>_<attempt> is reserved until RemovePodSandbox; a
          second RunPodSandbox with the same metadata -> UNKNOWN
          'failed to reserve sandbox name "n": name "n" is reserved for "<id>"'
          (pkg/registrar errors are plain fmt errors, hence UNKNOWN, not ALREADY_EXISTS);
        * an unknown runtime_handler -> UNKNOWN
          'failed to get sandbox runtime: no runtime for "x" is configured';
        * a pod network (not NODE) gets an IP from 10.88.0.0/16 (containerd's default CNI range).
        """
        config = req.config
        if not config.HasField("metadata"):
            raise CriError(UNKNOWN, "sandbox config must include metadata")
        md = config.metadata
        name = "_".join([md.name, md.namespace, md.uid, str(md.attempt)])
        if req.runtime_handler not in self.runtime_handlers:
            raise CriError(
                UNKNOWN, f"failed to get sandbox runtime: no runtime for {quote(req.runtime_handler)} is configured"
            )
        holder = self._sandbox_names.get(name)
        if holder is not None:
            raise CriError(
                UNKNOWN, f"failed to reserve sandbox name {quote(name)}: name {quote(name)} is reserved for {quote(holder)}"
            )
        sid = records.generate_id()
        while sid in self.sandboxes:  # pragma: no cover - 256 random bits
            sid = records.generate_id()
        sb = Sandbox(
            id=sid,
            name=name,
            config=copy_message(config),
            runtime_handler=req.runtime_handler,
            created_at=records.now_ns(),
            pid=self._pid(),
            run_request_bytes=raw,
        )
        if not sb.host_network:
            n = self._next_ip
            self._next_ip += 1
            sb.ip = f"10.88.{n // 254}.{n % 254 + 1}"
        if config.linux.HasField("overhead"):
            sb.overhead = copy_message(config.linux.overhead)
        if config.linux.HasField("resources"):
            sb.resources = copy_message(config.linux.resources)
        self.sandboxes[sid] = sb
        self._sandbox_names[name] = sid
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    def _stop_pod_sandbox(self, req: pb.StopPodSandboxRequest) -> pb.StopPodSandboxResponse:
        """StopPodSandbox: force-stops its containers (exit 137) and marks it NOTREADY.

        Unknown id -> NOT_FOUND 'an error occurred when try to find sandbox "<id>": not found'
        in containerd 1.6.20 (sandbox_stop.go); OK with ``idempotent_stop`` (containerd with
        the July 2024 backports of #10520). Stopping a stopped sandbox is OK (seen in the trace).
        """
        sb = self._find_or_none(
            self.sandboxes, req.pod_sandbox_id, f"an error occurred when try to find sandbox {quote(req.pod_sandbox_id)}",
            missing_ok=self.idempotent_stop,
        )
        if sb is not None:
            self._stop_sandbox_record(sb)
        return pb.StopPodSandboxResponse()

    def _remove_pod_sandbox(self, req: pb.RemovePodSandboxRequest) -> pb.RemovePodSandboxResponse:
        """RemovePodSandbox: stops it if needed, removes all its containers, releases its name.

        Unknown id -> OK (idempotent: "RemovePodSandbox called for sandbox ... that does not
        exist", sandbox_remove.go). An empty or ambiguous id is still an error (UNKNOWN).
        """
        sb = self._find_or_none(
            self.sandboxes, req.pod_sandbox_id, f"an error occurred when try to find sandbox {quote(req.pod_sandbox_id)}", missing_ok=True
        )
        if sb is None:
            return pb.RemovePodSandboxResponse()
        self._stop_sandbox_record(sb)
        for c in list(self.containers.values()):
            if c.pod_sandbox_id == sb.id:
                self._delete_container_record(c)
        del self.sandboxes[sb.id]
        if self._sandbox_names.get(sb.name) == sb.id:
            del self._sandbox_names[sb.name]
        return pb.RemovePodSandboxResponse()

    def _pod_sandbox_status(self, req: pb.PodSandboxStatusRequest) -> pb.PodSandboxStatusResponse:
        """PodSandboxStatus: unknown id -> NOT_FOUND "an error occurred when try to find
        sandbox: not found" (no id in the text; recorder-smoke.jsonl seq 8). Host-network pods
        report an empty IP; ``verbose`` adds info["info"] (containerd's SandboxInfo JSON with
        the full config, the pause runtime spec and cgroupsPath)."""
        sb = self._find_sandbox(req.pod_sandbox_id, "an error occurred when try to find sandbox")
        resp = pb.PodSandboxStatusResponse(status=self._to_cri_sandbox_status(sb))
        if req.verbose:
            for k, v in self._sandbox_info(sb).items():
                resp.info[k] = v
        return resp

    def _list_pod_sandbox(self, req: pb.ListPodSandboxRequest) -> pb.ListPodSandboxResponse:
        """ListPodSandbox: filter by id (full or unique prefix), state, label_selector (all
        key=value pairs must match) -- filterCRISandboxes. NOTREADY sandboxes are listed."""
        resp = pb.ListPodSandboxResponse()
        f = req.filter if req.HasField("filter") else None
        state = f.state.state if f is not None and f.HasField("state") else None
        for sb in self._sandboxes_matching(f, state):
            resp.items.add(**_sandbox_fields(sb))
        return resp

    def _update_pod_sandbox_resources(
        self, req: pb.UpdatePodSandboxResourcesRequest, raw: bytes
    ) -> pb.UpdatePodSandboxResourcesResponse:
        """UpdatePodSandboxResources (containerd >= 2.1, NRI notification only): recorded on
        the sandbox. Unknown id -> NOT_FOUND (message modelled on the other sandbox calls)."""
        sb = self._find_sandbox(req.pod_sandbox_id, f"an error occurred when try to find sandbox {quote(req.pod_sandbox_id)}")
        if req.HasField("overhead"):
            sb.overhead = copy_message(req.overhead)
        if req.HasField("resources"):
            sb.resources = copy_message(req.resources)
        sb.update_resources_requests.append(raw)
        return pb.UpdatePodSandboxResourcesResponse()
