"""The demo's stand-in CRI runtime (``python -m shim.tools.demo_runtime --listen SOCKET``): just
enough of containerd for ``memqos-shim demo`` -- sandboxes and containers kept in memory, created,
started, stopped, resized, listed, described and removed -- on ``shim.tools.grpc_server``, so the
demo needs nothing beyond the runtime install. It starts no process and writes no file.

PodSandboxStatus(verbose) carries the sandbox's config in its ``info`` JSON as containerd does
(the reconciler reads the cgroup parent there); ContainerStatus carries the resources of the
last CreateContainer / UpdateContainerResources, as the runtime received them (after the
shim). Every other method answers UNIMPLEMENTED.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from dataclasses import dataclass

from shim.cri import pb
from shim.cri.methods import RUNTIME_SERVICE
from shim.tools.grpc_server import GrpcServer

NAME, VERSION = "memqos-demo-runtime", "0.1"


class Missing(Exception):
    pass


@dataclass
class _Sandbox:
    id: str
    config: object  # PodSandboxConfig
    created_at: int
    ready: bool = True


@dataclass
class _Container:
    id: str
    sandbox_id: str
    config: object  # ContainerConfig
    created_at: int
    resources: object  # LinuxContainerResources
    state: int = pb.CONTAINER_CREATED
    started_at: int = 0
    finished_at: int = 0


class DemoRuntime:
    def __init__(self) -> None:
        self.sandboxes: dict[str, _Sandbox] = {}
        self.containers: dict[str, _Container] = {}
        self._n = 0
        self.handlers = {
            "Version": (pb.VersionRequest, self.version),
            "RunPodSandbox": (pb.RunPodSandboxRequest, self.run_sandbox),
            "StopPodSandbox": (pb.StopPodSandboxRequest, self.stop_sandbox),
            "RemovePodSandbox": (pb.RemovePodSandboxRequest, self.remove_sandbox),
            "PodSandboxStatus": (pb.PodSandboxStatusRequest, self.sandbox_status),
            "ListPodSandbox": (pb.ListPodSandboxRequest, self.list_sandboxes),
            "CreateContainer": (pb.CreateContainerRequest, self.create_container),
            "StartContainer": (pb.StartContainerRequest, self.start_container),
            "StopContainer": (pb.StopContainerRequest, self.stop_container),
            "RemoveContainer": (pb.RemoveContainerRequest, self.remove_container),
            "ContainerStatus": (pb.ContainerStatusRequest, self.container_status),
            "ListContainers": (pb.ListContainersRequest, self.list_containers),
            "UpdateContainerResources": (pb.UpdateContainerResourcesRequest, self.update_resources),
        }

    def _id(self) -> str:
        self._n += 1
        return f"{self._n:064x}"

    async def handle(self, path: str, headers: dict, messages: list) -> tuple[list, str, str]:
        name = path[len(RUNTIME_SERVICE):] if path.startswith(RUNTIME_SERVICE) else None
        if name not in self.handlers:
            return [], "UNIMPLEMENTED", f"method {path} not implemented by the demo runtime"
        request_cls, fn = self.handlers[name]
        try:
            request = request_cls.FromString(messages[0] if messages else b"")
            return [fn(request).SerializeToString()], "OK", ""
        except Missing as e:
            return [], "NOT_FOUND", str(e)
        except Exception as e:  # noqa: BLE001 - an undecodable request
            return [], "INVALID_ARGUMENT", f"{e.__class__.__name__}: {e}"

    def _sandbox(self, sid: str) -> _Sandbox:
        if sid not in self.sandboxes:
            raise Missing(f"an error occurred when try to find sandbox {sid!r}: not found")
        return self.sandboxes[sid]

    def _container(self, cid: str) -> _Container:
        if cid not in self.containers:
            raise Missing(f"an error occurred when try to find container {cid!r}: not found")
        return self.containers[cid]

    # -- methods
    def version(self, req):
        return pb.VersionResponse(version="0.1.0", runtime_name=NAME, runtime_version=VERSION,
                                  runtime_api_version="v1")

    def run_sandbox(self, req):
        sid = self._id()
        self.sandboxes[sid] = _Sandbox(sid, req.config, time.time_ns())
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    def stop_sandbox(self, req):
        self._sandbox(req.pod_sandbox_id).ready = False
        for c in self.containers.values():
            if c.sandbox_id == req.pod_sandbox_id and c.state == pb.CONTAINER_RUNNING:
                c.state, c.finished_at = pb.CONTAINER_EXITED, time.time_ns()
        return pb.StopPodSandboxResponse()

    def remove_sandbox(self, req):
        self.sandboxes.pop(req.pod_sandbox_id, None)
        for cid in [c.id for c in self.containers.values() if c.sandbox_id == req.pod_sandbox_id]:
            del self.containers[cid]
        return pb.RemovePodSandboxResponse()

    def _sandbox_message(self, s: _Sandbox):
        return pb.PodSandbox(id=s.id, metadata=s.config.metadata, created_at=s.created_at,
                             state=pb.SANDBOX_READY if s.ready else pb.SANDBOX_NOTREADY,
                             labels=s.config.labels, annotations=s.config.annotations)

    def sandbox_status(self, req):
        s = self._sandbox(req.pod_sandbox_id)
        status = pb.PodSandboxStatus(id=s.id, metadata=s.config.metadata, created_at=s.created_at,
                                     state=pb.SANDBOX_READY if s.ready else pb.SANDBOX_NOTREADY,
                                     labels=s.config.labels, annotations=s.config.annotations)
        info = {}
        if req.verbose:
            linux = s.config.linux
            info["info"] = json.dumps({"config": {"linux": {
                "cgroup_parent": linux.cgroup_parent,
                "overhead": {"memory_limit_in_bytes": linux.overhead.memory_limit_in_bytes}}}})
        return pb.PodSandboxStatusResponse(status=status, info=info)

    def list_sandboxes(self, req):
        return pb.ListPodSandboxResponse(items=[self._sandbox_message(s) for s in self.sandboxes.values()])

    def create_container(self, req):
        self._sandbox(req.pod_sandbox_id)
        cid = self._id()
        self.containers[cid] = _Container(cid, req.pod_sandbox_id, req.config, time.time_ns(),
                                          req.config.linux.resources)
        return pb.CreateContainerResponse(container_id=cid)

    def start_container(self, req):
        c = self._container(req.container_id)
        c.state, c.started_at = pb.CONTAINER_RUNNING, time.time_ns()
        return pb.StartContainerResponse()

    def stop_container(self, req):
        c = self._container(req.container_id)
        if c.state != pb.CONTAINER_EXITED:
            c.state, c.finished_at = pb.CONTAINER_EXITED, time.time_ns()
        return pb.StopContainerResponse()

    def remove_container(self, req):
        self.containers.pop(req.container_id, None)
        return pb.RemoveContainerResponse()

    def _container_message(self, c: _Container):
        return pb.Container(id=c.id, pod_sandbox_id=c.sandbox_id, metadata=c.config.metadata, image=c.config.image,
                            state=c.state, created_at=c.created_at, labels=c.config.labels,
                            annotations=c.config.annotations)

    def container_status(self, req):
        c = self._container(req.container_id)
        return pb.ContainerStatusResponse(status=pb.ContainerStatus(
            id=c.id, metadata=c.config.metadata, state=c.state, created_at=c.created_at,
            started_at=c.started_at, finished_at=c.finished_at, image=c.config.image,
            labels=c.config.labels, annotations=c.config.annotations,
            resources=pb.ContainerResources(linux=c.resources)))

    def list_containers(self, req):
        return pb.ListContainersResponse(containers=[self._container_message(c) for c in self.containers.values()])

    def update_resources(self, req):
        c = self._container(req.container_id)
        if req.HasField("linux"):
            c.resources = req.linux
        return pb.UpdateContainerResourcesResponse()


async def serve(listen: str) -> None:
    server = GrpcServer(DemoRuntime().handle)
    await server.start(listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{NAME} on {server.path}", flush=True)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shim.tools.demo_runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="unix socket path to serve on")
    args = p.parse_args(argv)
    asyncio.run(serve(args.listen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
