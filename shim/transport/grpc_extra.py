"""grpcio is the optional ``[grpc]`` extra: ``--transport grpc`` (and ``replay --transport grpc``)
run on it; the default relay, the reconciler's client and the operator's commands do not."""
from __future__ import annotations

import importlib.util

INSTALL = "pip install 'memqos-shim[grpc]'"


def grpc_missing(what: str) -> str | None:
    """None when grpcio can be imported; else the error to show for ``what``."""
    try:
        found = importlib.util.find_spec("grpc") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return f"{what} needs grpcio, the [grpc] extra, which is not installed: {INSTALL}"
