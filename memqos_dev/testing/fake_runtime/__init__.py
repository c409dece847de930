"""A fake CRI runtime (runtime.v1) that behaves like containerd 1.6/1.7 for the calls a kubelet makes.

Used by the tests, the demo, the replayer and the benchmarks as the "upstream" of the shim.

From a test without an event loop::

    from memqos_dev.testing.fake_runtime import FakeRuntimeServer
    with FakeRuntimeServer(tmp_path / "containerd.sock", cgroup_driver="systemd") as srv:
        channel = srv.channel()                 # or grpc.insecure_channel(srv.address)
        ...
        srv.runtime.received_create_requests    # exact CreateContainerRequest bytes received
        srv.runtime.container(cid).update_requests
        # FakeRuntimeServer(..., cgroup_root=tree): started containers get real cgroup dirs, as
        # runc makes them (cri-containerd-<id>.scope in the expanded slice with systemd)

From asyncio::

    server, runtime = await serve_fake_runtime("unix:///run/x.sock", delays={"PullImage": 2})
    ...
    await server.stop(None)

From the command line (foreground until SIGTERM/SIGINT)::

    python -m memqos_dev.testing.fake_runtime --listen /run/fake.sock [--cgroup-driver systemd]

Without gRPC: ``FakeRuntime().handle("/runtime.v1.RuntimeService/Version", b"")``.
"""
from memqos_dev.testing.fake_runtime.errors import CriError
from memqos_dev.testing.fake_runtime.records import (
    BUSYBOX_IMAGE_ID, CGROUPFS, DEFAULT_SANDBOX_IMAGE, PAUSE_IMAGE_ID, SYSTEMD,
    Container, Image, RecordedCall, Sandbox, default_images, normalize_image_ref,
)
from memqos_dev.testing.fake_runtime.resources import apply_linux_resources, container_cgroup, expand_slice
from memqos_dev.testing.fake_runtime.runtime import FakeRuntime
from memqos_dev.testing.fake_runtime.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FakeRuntimeServer,
    generic_handlers,
    serve_fake_runtime,
    socket_address,
    socket_path,
)

__all__ = [
    "BUSYBOX_IMAGE_ID",
    "CGROUPFS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_SANDBOX_IMAGE",
    "PAUSE_IMAGE_ID",
    "SYSTEMD",
    "Container",
    "CriError",
    "FakeRuntime",
    "FakeRuntimeServer",
    "Image",
    "RecordedCall",
    "Sandbox",
    "apply_linux_resources",
    "container_cgroup",
    "default_images",
    "expand_slice",
    "generic_handlers",
    "normalize_image_ref",
    "serve_fake_runtime",
    "socket_address",
    "socket_path",
]
