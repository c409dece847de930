"""The fake runtime's method table: every runtime.v1 method with its message classes, by short name."""
from __future__ import annotations

from typing import Any

from shim.cri import pb

RUNTIME_SERVICE = "runtime.v1.RuntimeService"
IMAGE_SERVICE = "runtime.v1.ImageService"
SERVICES = (RUNTIME_SERVICE, IMAGE_SERVICE)


def _method_table() -> dict[str, tuple[str, Any, Any, bool]]:
    """short name -> (full path, request class, response class, server_streaming)."""
    table = {}
    for service_name in ("RuntimeService", "ImageService"):
        service = pb.DESCRIPTOR.services_by_name[service_name]
        for m in service.methods:
            table[m.name] = (
                f"/{service.full_name}/{m.name}",
                getattr(pb, m.input_type.name),
                getattr(pb, m.output_type.name),
                m.server_streaming,
            )
    return table


METHODS = _method_table()


def method_name(method: str) -> str:
    """'/runtime.v1.RuntimeService/Version' or 'Version' -> 'Version'."""
    return method.rsplit("/", 1)[-1]


def method_path(method: str) -> str:
    """'Version' -> '/runtime.v1.RuntimeService/Version' (full paths pass through)."""
    if method.startswith("/"):
        return method
    entry = METHODS.get(method)
    return entry[0] if entry else method
