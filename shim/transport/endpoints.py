"""CRI endpoint strings: ``unix:///path/x.sock`` or a plain absolute ``/path/x.sock``.

These are the forms the kubelet's ``--container-runtime-endpoint`` and containerd's
``grpc.address`` use. Only unix sockets are supported: the shim is a node-local proxy.
"""
from __future__ import annotations

# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_UNIX_PATH_BYTES = 107


def socket_path(endpoint: str) -> str:
    """The filesystem path of a unix-socket endpoint.

    Accepts ``unix:///abs/path`` (the kubelet's form), ``unix:/abs/path`` (gRPC's short
    form) and a plain ``/abs/path``. Raises ValueError for any other scheme (tcp://,
    npipe://, ...), a ``unix://host/...`` authority, a relative or empty path.
    """
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise ValueError(f"empty CRI endpoint: {endpoint!r}")
    ep = endpoint.strip()
    if ep.startswith("unix://"):
        path = ep[len("unix://"):]
        if not path.startswith("/"):
            raise ValueError(
                f"unsupported CRI endpoint {endpoint!r}: expected unix:///absolute/path "
                "(three slashes; a host part is not allowed)"
            )
    elif ep.startswith("unix:"):
        path = ep[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError(f"unsupported CRI endpoint {endpoint!r}: the socket path must be absolute")
    elif ep.startswith("/"):
        path = ep
    elif "://" in ep or ":" in ep.split("/", 1)[0]:
        scheme = ep.split(":", 1)[0]
        raise ValueError(
            f"unsupported CRI endpoint {endpoint!r}: scheme {scheme!r} is not supported, "
            "only unix sockets (unix:///path/x.sock or /path/x.sock)"
        )
    else:
        raise ValueError(f"unsupported CRI endpoint {endpoint!r}: the socket path must be absolute")
    if "\x00" in path:
        raise ValueError(f"unsupported CRI endpoint {endpoint!r}: NUL byte in path")
    if path.rstrip("/") == "" or path.endswith("/"):
        raise ValueError(f"unsupported CRI endpoint {endpoint!r}: no socket file name")
    if len(path.encode()) > MAX_UNIX_PATH_BYTES:
        raise ValueError(
            f"CRI endpoint {endpoint!r}: socket path is {len(path.encode())} bytes, "
            f"unix sockets allow at most {MAX_UNIX_PATH_BYTES}"
        )
    return path
