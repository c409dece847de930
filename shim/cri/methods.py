"""The CRI runtime.v1 method table, read once from the generated descriptor, and the paths of
the methods the shim names: the one place a CRI method path is spelled."""
from __future__ import annotations

from dataclasses import dataclass

from shim.cri import pb

CRI_SERVICES = ("runtime.v1.RuntimeService", "runtime.v1.ImageService")


@dataclass(frozen=True)
class CriMethod:
    path: str  # "/runtime.v1.RuntimeService/Version", exactly as on the wire
    service: str  # "runtime.v1.RuntimeService"
    name: str  # "Version"
    client_streaming: bool
    server_streaming: bool


def _load() -> tuple[CriMethod, ...]:
    out = []
    for full_name in CRI_SERVICES:
        service = pb.DESCRIPTOR.services_by_name[full_name.rsplit(".", 1)[1]]
        assert service.full_name == full_name, service.full_name
        for m in service.methods:
            out.append(
                CriMethod(
                    path=f"/{full_name}/{m.name}",
                    service=full_name,
                    name=m.name,
                    client_streaming=m.client_streaming,
                    server_streaming=m.server_streaming,
                )
            )
    return tuple(out)


CRI_METHODS: tuple[CriMethod, ...] = _load()
CRI_METHODS_BY_PATH: dict[str, CriMethod] = {m.path: m for m in CRI_METHODS}

# -- the paths the shim itself names (everything else is only forwarded) ----------------------
RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"
IMAGE_SERVICE = "/runtime.v1.ImageService/"


def _path(service: str, name: str) -> str:
    path = service + name
    assert path in CRI_METHODS_BY_PATH, path
    return path


VERSION = _path(RUNTIME_SERVICE, "Version")
EXEC_SYNC = _path(RUNTIME_SERVICE, "ExecSync")
RUN_POD_SANDBOX = _path(RUNTIME_SERVICE, "RunPodSandbox")
STOP_POD_SANDBOX = _path(RUNTIME_SERVICE, "StopPodSandbox")
REMOVE_POD_SANDBOX = _path(RUNTIME_SERVICE, "RemovePodSandbox")
UPDATE_POD_SANDBOX_RESOURCES = _path(RUNTIME_SERVICE, "UpdatePodSandboxResources")
CREATE_CONTAINER = _path(RUNTIME_SERVICE, "CreateContainer")
UPDATE_CONTAINER_RESOURCES = _path(RUNTIME_SERVICE, "UpdateContainerResources")
REMOVE_CONTAINER = _path(RUNTIME_SERVICE, "RemoveContainer")
CONTAINER_STATUS = _path(RUNTIME_SERVICE, "ContainerStatus")
PULL_IMAGE = _path(IMAGE_SERVICE, "PullImage")
