"""The fake runtime's container calls (containerd's container_*.go): create, start, stop, remove,
list, status, update resources, reopen log, exec."""
from __future__ import annotations

import hashlib
import posixpath

from shim.cri import pb
from memqos_dev.testing.fake_runtime import gojson, records
from memqos_dev.testing.fake_runtime.errors import NOT_FOUND, UNKNOWN, CriError, quote
from memqos_dev.testing.fake_runtime.records import (
    COMPLETE_EXIT_REASON,
    ERROR_EXIT_REASON,
    ERROR_START_EXIT_CODE,
    ERROR_START_REASON,
    RUNC_RUNTIME_TYPE,
    Container,
    copy_message,
)
from memqos_dev.testing.fake_runtime.resources import apply_linux_resources, cgroups_path, oci_linux_resources, write_cgroup
from memqos_dev.testing.fake_runtime.state import RuntimeState


class ContainerCalls(RuntimeState):
    """CreateContainer, StartContainer, StopContainer, RemoveContainer, ListContainers,
    ContainerStatus, UpdateContainerResources, ReopenContainerLog and ExecSync on the fake
    runtime's container records."""

    def _status_image(self, c: Container) -> tuple[pb.ImageSpec, str]:
        """ContainerStatus's image/image_ref: the image's first repo tag and first repo digest
        when the image is known (else the config's ImageSpec and the image id) -- containerd's
        ContainerStatus; in the traces: image "localhost/busybox:latest", image_ref the id."""
        spec = copy_message(c.config.image)
        image_ref = c.image_ref
        image = self.images.get(c.image_ref)
        if image is not None:
            if image.repo_tags:
                spec = pb.ImageSpec(image=image.repo_tags[0])
            if image.repo_digests:
                image_ref = image.repo_digests[0]
        return spec, image_ref

    def _to_cri_container_status(self, c: Container) -> pb.ContainerStatus:
        state = c.state
        reason = c.reason
        if state == pb.CONTAINER_EXITED and not reason:
            reason = COMPLETE_EXIT_REASON if c.exit_code == 0 else ERROR_EXIT_REASON
        started = c.started_at if state in (pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED) else 0
        finished = c.finished_at if state == pb.CONTAINER_EXITED else 0
        image, image_ref = self._status_image(c)
        status = pb.ContainerStatus(
            id=c.id,
            metadata=c.config.metadata,
            state=state,
            created_at=c.created_at,
            started_at=started,
            finished_at=finished,
            exit_code=c.exit_code,
            image=image,
            image_ref=image_ref,
            reason=reason,
            message=c.message,
            labels=c.config.labels,
            annotations=c.config.annotations,
            mounts=c.config.mounts,
            log_path=c.log_path,
        )
        status.resources.linux.CopyFrom(c.resources)
        return status

    def _to_cri_container(self, c: Container) -> pb.Container:
        """containerd's toCRIContainer: image is the config's ImageSpec, image_ref the image id."""
        return pb.Container(
            id=c.id,
            pod_sandbox_id=c.pod_sandbox_id,
            metadata=c.config.metadata,
            image=c.config.image,
            image_ref=c.image_ref,
            state=c.state,
            created_at=c.created_at,
            labels=c.config.labels,
            annotations=c.config.annotations,
        )

    def _container_info(self, c: Container) -> dict[str, str]:
        """ContainerStatus verbose info: containerd's ContainerInfo JSON under key "info"."""
        cfg = c.config
        spec = {
            "ociVersion": "1.0.2-dev",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": list(cfg.command) + list(cfg.args),
                "env": [f"{kv.key}={kv.value}" for kv in cfg.envs],
                "cwd": cfg.working_dir or "/",
                "oomScoreAdj": c.resources.oom_score_adj,
            },
            "root": {"path": "rootfs"},
            "annotations": {
                "io.kubernetes.cri.container-name": cfg.metadata.name,
                "io.kubernetes.cri.container-type": "container",
                "io.kubernetes.cri.image-name": cfg.image.image,
                "io.kubernetes.cri.sandbox-id": c.pod_sandbox_id,
                "io.kubernetes.cri.sandbox-name": c.sandbox_config.metadata.name,
                "io.kubernetes.cri.sandbox-namespace": c.sandbox_config.metadata.namespace,
                "io.kubernetes.cri.sandbox-uid": c.sandbox_config.metadata.uid,
            },
            "linux": {
                "resources": oci_linux_resources(c.resources),
                "cgroupsPath": cgroups_path(c.sandbox_config.linux.cgroup_parent, c.id, self.cgroup_prefix),
            },
        }
        info = {
            "sandboxID": c.pod_sandbox_id,
            "pid": c.pid,
            "removing": False,
            "snapshotKey": c.id,
            "snapshotter": "overlayfs",
            "runtimeType": RUNC_RUNTIME_TYPE,
            "runtimeOptions": self._runtime_options(),
            "config": c.config,
            "runtimeSpec": spec,
        }
        return {"info": gojson.dumps(info)}

    def _create_container(self, req: pb.CreateContainerRequest, raw: bytes) -> pb.CreateContainerResponse:
        """CreateContainer, as containerd's container_create.go (1.6):

        * unknown sandbox -> NOT_FOUND 'failed to find sandbox id "<id>": not found';
        * sandbox not running (stopped) -> NOT_FOUND 'failed to get sandbox container task: no
          running task found: task <id> not found: not found';
        * no metadata -> UNKNOWN "container config must include metadata";
        * the name <ctr>_<pod>_<namespace>_<uid>_<attempt> (pod part from the request's
          sandbox_config) is reserved until RemoveContainer; a duplicate -> UNKNOWN
          'failed to reserve container name "n": name "n" is reserved for "<id>"';
        * with ``strict_images`` an unknown image -> NOT_FOUND 'failed to resolve image "x": not found';
        * log path = sandbox_config.log_directory joined with config.log_path (both non-empty);
        * resources in force = apply_linux_resources(config.linux.resources) + oom_score_adj.
        """
        sb = self._find_sandbox(req.pod_sandbox_id, f"failed to find sandbox id {quote(req.pod_sandbox_id)}")
        if sb.state != pb.SANDBOX_READY:
            raise CriError(
                NOT_FOUND,
                f"failed to get sandbox container task: no running task found: task {sb.id} not found: not found",
            )
        config = req.config
        if not config.HasField("metadata"):
            raise CriError(UNKNOWN, "container config must include metadata")
        smd = req.sandbox_config.metadata
        name = "_".join([config.metadata.name, smd.name, smd.namespace, smd.uid, str(config.metadata.attempt)])
        holder = self._container_names.get(name)
        if holder is not None:
            raise CriError(
                UNKNOWN, f"failed to reserve container name {quote(name)}: name {quote(name)} is reserved for {quote(holder)}"
            )
        image = self._resolve_image(config.image.image)
        if image is None:
            if self.strict_images:
                raise CriError(NOT_FOUND, f"failed to resolve image {quote(config.image.image)}: not found")
            image_id = "sha256:" + hashlib.sha256(("image:" + config.image.image).encode()).hexdigest()
        else:
            image_id = image.id
        log_dir = req.sandbox_config.log_directory
        log_path = posixpath.join(log_dir, config.log_path) if (log_dir and config.log_path) else ""
        resources = pb.LinuxContainerResources()
        apply_linux_resources(
            resources,
            config.linux.resources,
            swap_controller=self.swap_controller,
            hugetlb_controller=self.hugetlb_controller,
        )
        resources.oom_score_adj = config.linux.resources.oom_score_adj
        cid = records.generate_id()
        while cid in self.containers:  # pragma: no cover
            cid = records.generate_id()
        c = Container(
            id=cid,
            name=name,
            pod_sandbox_id=sb.id,
            config=copy_message(config),
            sandbox_config=copy_message(req.sandbox_config),
            image_ref=image_id,
            log_path=log_path,
            created_at=records.now_ns(),
            resources=resources,
            create_request_bytes=raw,
        )
        self.containers[cid] = c
        self._container_names[name] = cid
        return pb.CreateContainerResponse(container_id=cid)

    def _start_container(self, req: pb.StartContainerRequest) -> pb.StartContainerResponse:
        """StartContainer (container_start.go):

        * unknown id -> NOT_FOUND 'an error occurred when try to find container "<id>": not found';
        * not CREATED -> UNKNOWN 'failed to set starting state for container "<id>": container
          is in CONTAINER_RUNNING state' (or CONTAINER_EXITED);
        * sandbox not ready -> UNKNOWN 'sandbox container "<sid>" is not running', and the
          container becomes EXITED with exit code 128, reason StartError (the start-failure
          defer in containerd).
        """
        c = self._find_container(req.container_id, f"an error occurred when try to find container {quote(req.container_id)}")
        if c.state != pb.CONTAINER_CREATED:
            raise CriError(
                UNKNOWN,
                f"failed to set starting state for container {quote(c.id)}: container is in "
                f"{pb.ContainerState.Name(c.state)} state",
            )
        sb = self.sandboxes.get(c.pod_sandbox_id)
        if sb is None:
            msg = f"sandbox {quote(c.pod_sandbox_id)} not found: not found"
            self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
            raise CriError(NOT_FOUND, msg)
        if sb.state != pb.SANDBOX_READY:
            msg = f"sandbox container {quote(sb.id)} is not running"
            self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
            raise CriError(UNKNOWN, msg)
        if self.cgroup_root is not None:
            try:
                self._write_cgroup(c, create=True)
            except (ValueError, OSError) as e:
                msg = f"failed to create containerd task: failed to create shim task: OCI runtime create failed: {e}"
                self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
                raise CriError(UNKNOWN, msg)
        c.started_at = records.now_ns()
        c.pid = self._pid()
        return pb.StartContainerResponse()

    def _stop_container(self, req: pb.StopContainerRequest) -> pb.StopContainerResponse:
        """StopContainer: RUNNING -> EXITED (exit 0 for timeout > 0, 137 for timeout 0);
        CREATED or EXITED containers are left alone and the call is OK (containerd's
        stopContainer returns nil unless the container is running).

        Unknown id -> NOT_FOUND 'an error occurred when try to find container "<id>": not found'
        in containerd 1.6.20 (container_stop.go); OK with ``idempotent_stop`` (the July 2024
        backports of containerd#10521).
        """
        c = self._find_or_none(
            self.containers, req.container_id, f"an error occurred when try to find container {quote(req.container_id)}",
            missing_ok=self.idempotent_stop,
        )
        if c is not None:
            self._stop_container_record(c, req.timeout)
        return pb.StopContainerResponse()

    def _remove_container(self, req: pb.RemoveContainerRequest) -> pb.RemoveContainerResponse:
        """RemoveContainer: force-stops a running container (exit 137), deletes it, releases
        its name. Unknown id -> OK ("RemoveContainer called for container ... that does not
        exist", container_remove.go); an empty/ambiguous id is still UNKNOWN."""
        c = self._find_or_none(
            self.containers, req.container_id, f"an error occurred when try to find container {quote(req.container_id)}", missing_ok=True
        )
        if c is None:
            return pb.RemoveContainerResponse()
        self._stop_container_record(c, 0)
        self._delete_container_record(c)
        return pb.RemoveContainerResponse()

    def _list_containers(self, req: pb.ListContainersRequest) -> pb.ListContainersResponse:
        """ListContainers: filter by id and pod_sandbox_id (full or unique prefix), state,
        label_selector -- filterCRIContainers. Sandbox (pause) containers are never listed."""
        resp = pb.ListContainersResponse()
        f = req.filter if req.HasField("filter") else None
        state = f.state.state if f is not None and f.HasField("state") else None
        for c in self._containers_matching(f, state):
            resp.containers.append(self._to_cri_container(c))
        return resp

    def _container_status(self, req: pb.ContainerStatusRequest) -> pb.ContainerStatusResponse:
        """ContainerStatus: unknown id -> NOT_FOUND 'an error occurred when try to find
        container "<id>": not found' (recorder-smoke.jsonl seq 6). Fields as containerd fills
        them (compared field by field against the traces in the tests): labels, annotations,
        mounts from the config, log_path, image = first repo tag, image_ref = image id, reason
        Completed/Error for exited containers, resources = the resources in force."""
        c = self._find_container(req.container_id, f"an error occurred when try to find container {quote(req.container_id)}")
        resp = pb.ContainerStatusResponse(status=self._to_cri_container_status(c))
        if req.verbose:
            for k, v in self._container_info(c).items():
                resp.info[k] = v
        return resp

    def _update_container_resources(
        self, req: pb.UpdateContainerResourcesRequest, raw: bytes
    ) -> pb.UpdateContainerResourcesResponse:
        """UpdateContainerResources: merges req.linux into the resources in force with
        containerd's WithResources semantics (see apply_linux_resources: zero fields keep the old
        value, unified keys are merged, never removed; oom_score_adj is not updated), in any
        state (a not-running container only gets its spec updated).

        Unknown id -> NOT_FOUND "failed to find container: not found"
        (container_update_resources.go)."""
        c = self._find_container(req.container_id, "failed to find container")
        if req.HasField("linux"):
            new = copy_message(c.resources)
            linux = req.linux
            if not self.update_unified:  # CRI-O before 1.36: toOCIResources leaves unified out
                linux = copy_message(linux)
                linux.ClearField("unified")
            apply_linux_resources(
                new, linux, swap_controller=self.swap_controller, hugetlb_controller=self.hugetlb_controller
            )
            c.resources = new
            if self.cgroup_root is not None and c.state == pb.CONTAINER_RUNNING:
                try:
                    if self.update_unified:  # containerd: the task update carries the whole spec's resources
                        self._write_cgroup(c, create=False)
                    else:  # CRI-O < 1.36: runc update gets no unified and writes none of its keys
                        applied = copy_message(new)
                        applied.ClearField("unified")
                        write_cgroup(self.cgroup_dir(c), applied, create=False)
                except (ValueError, OSError) as e:
                    raise CriError(UNKNOWN, f"failed to update resources: {e}")
        c.update_requests.append(raw)
        return pb.UpdateContainerResourcesResponse()

    def _reopen_container_log(self, req: pb.ReopenContainerLogRequest) -> pb.ReopenContainerLogResponse:
        """ReopenContainerLog: NOT_FOUND for an unknown id, UNKNOWN "container is not running"."""
        c = self._find_container(req.container_id, f"an error occurred when try to find container {quote(req.container_id)}")
        if c.state != pb.CONTAINER_RUNNING:
            raise CriError(UNKNOWN, "container is not running")
        return pb.ReopenContainerLogResponse()

    def _exec_sync(self, req: pb.ExecSyncRequest) -> pb.ExecSyncResponse:
        """ExecSync: returns ``exec_sync_output(cmd)`` if set and not None, else ``exec_sync_result``
        (default exit code 0, no output).

        Unknown id -> NOT_FOUND 'failed to exec in container: failed to find container "<id>"
        in store: not found'; not running -> UNKNOWN 'failed to exec in container: container is
        in CONTAINER_EXITED state' (container_execsync.go). The gRPC layer turns a ``delays``
        entry longer than req.timeout into DEADLINE_EXCEEDED 'failed to exec in container:
        timeout 1s exceeded: context deadline exceeded'.
        """
        c = self._find_container(
            req.container_id, f"failed to exec in container: failed to find container {quote(req.container_id)} in store"
        )
        if c.state != pb.CONTAINER_RUNNING:
            raise CriError(
                UNKNOWN, f"failed to exec in container: container is in {pb.ContainerState.Name(c.state)} state"
            )
        answer = self.exec_sync_output(list(req.cmd)) if self.exec_sync_output is not None else None
        stdout, stderr, code = self.exec_sync_result if answer is None else answer
        return pb.ExecSyncResponse(stdout=stdout, stderr=stderr, exit_code=code)
