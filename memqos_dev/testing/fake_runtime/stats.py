"""The fake runtime's stats calls (containerd's container_stats*.go, sandbox_stats*.go): plausible
constants shaped like the traced ones, for running containers and ready sandboxes."""
from __future__ import annotations

import grpc

from shim.cri import pb
from memqos_dev.testing.fake_runtime import records
from memqos_dev.testing.fake_runtime.errors import UNKNOWN, CriError, quote
from memqos_dev.testing.fake_runtime.records import SNAPSHOTTER_MOUNT, Container, Sandbox
from memqos_dev.testing.fake_runtime.state import RuntimeState


def _fill_attributes(attributes: pb.ContainerAttributes | pb.PodSandboxAttributes, id: str, config) -> None:
    """The attributes of a stats entry: id, metadata, labels and annotations of its config."""
    attributes.id = id
    attributes.metadata.CopyFrom(config.metadata)
    attributes.labels.update(config.labels)
    attributes.annotations.update(config.annotations)


class StatsCalls(RuntimeState):
    """ContainerStats, ListContainerStats, PodSandboxStats and ListPodSandboxStats."""

    def _cri_container_stats(self, c: Container, now: int) -> pb.ContainerStats:
        cs = pb.ContainerStats()
        _fill_attributes(cs.attributes, c.id, c.config)
        cs.cpu.timestamp = now
        cs.cpu.usage_core_nano_seconds.value = max(0, now - c.started_at) // 100  # 1% of a core
        cs.cpu.usage_nano_cores.value = 10_000_000
        ws = c.memory_working_set_bytes
        cs.memory.timestamp = now
        cs.memory.working_set_bytes.value = ws
        if c.resources.memory_limit_in_bytes:
            cs.memory.available_bytes.value = max(0, c.resources.memory_limit_in_bytes - ws)
        cs.memory.usage_bytes.value = ws
        cs.memory.rss_bytes.value = 110592
        cs.memory.page_faults.value = 3300
        cs.memory.major_page_faults.SetInParent()
        cs.writable_layer.timestamp = now
        cs.writable_layer.fs_id.mountpoint = SNAPSHOTTER_MOUNT
        cs.writable_layer.used_bytes.SetInParent()
        cs.writable_layer.inodes_used.value = 5
        return cs

    def _container_stats(self, req: pb.ContainerStatsRequest) -> pb.ContainerStatsResponse:
        """ContainerStats: unknown id -> NOT_FOUND "failed to find container: not found"; a
        container without a running task -> UNKNOWN "unexpected metrics response: []"
        (container_stats.go)."""
        c = self._find_container(req.container_id, "failed to find container")
        if c.state != pb.CONTAINER_RUNNING:
            raise CriError(UNKNOWN, "unexpected metrics response: []")
        return pb.ContainerStatsResponse(stats=self._cri_container_stats(c, records.now_ns()))

    def _list_container_stats(self, req: pb.ListContainerStatsRequest) -> pb.ListContainerStatsResponse:
        """ListContainerStats: running containers only (containerd asks the task service for
        metrics, and only started containers have tasks), filtered by id / pod_sandbox_id
        (unique prefixes allowed) / label_selector. Values are plausible constants shaped
        like the traced ones."""
        now = records.now_ns()
        resp = pb.ListContainerStatsResponse()
        for c in self._containers_matching(req.filter, pb.CONTAINER_RUNNING):
            resp.stats.append(self._cri_container_stats(c, now))
        return resp

    def _cri_pod_sandbox_stats(self, sb: Sandbox, now: int) -> pb.PodSandboxStats:
        stats = pb.PodSandboxStats()
        _fill_attributes(stats.attributes, sb.id, sb.config)
        running = [c for c in self.containers.values() if c.pod_sandbox_id == sb.id and c.state == pb.CONTAINER_RUNNING]
        stats.linux.cpu.timestamp = now
        stats.linux.cpu.usage_core_nano_seconds.value = sum(max(0, now - c.started_at) // 100 for c in running)
        stats.linux.cpu.usage_nano_cores.value = 10_000_000 * len(running)
        ws = sum(c.memory_working_set_bytes for c in running)
        stats.linux.memory.timestamp = now
        stats.linux.memory.working_set_bytes.value = ws
        stats.linux.memory.usage_bytes.value = ws
        for c in running:
            stats.linux.containers.append(self._cri_container_stats(c, now))
        return stats

    def _pod_sandbox_stats(self, req: pb.PodSandboxStatsRequest) -> pb.PodSandboxStatsResponse:
        """PodSandboxStats: unknown id -> NOT_FOUND "an error occurred when trying to find
        sandbox <id>: not found"; a sandbox that is not ready -> UNAVAILABLE (sandbox_stats.go)."""
        sb = self._find_sandbox(req.pod_sandbox_id, f"an error occurred when trying to find sandbox {req.pod_sandbox_id}")
        if sb.state != pb.SANDBOX_READY:
            raise CriError(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to decode pod sandbox metrics {req.pod_sandbox_id}: failed to get pod sandbox stats "
                f"since sandbox container {quote(sb.id)} is not in ready state: unavailable",
            )
        return pb.PodSandboxStatsResponse(stats=self._cri_pod_sandbox_stats(sb, records.now_ns()))

    def _list_pod_sandbox_stats(self, req: pb.ListPodSandboxStatsRequest) -> pb.ListPodSandboxStatsResponse:
        """ListPodSandboxStats: ready sandboxes matching the id (prefix) / label filter."""
        now = records.now_ns()
        resp = pb.ListPodSandboxStatsResponse()
        for sb in self._sandboxes_matching(req.filter, pb.SANDBOX_READY):
            resp.stats.append(self._cri_pod_sandbox_stats(sb, now))
        return resp
