"""The fake runtime: state and CRI semantics, no gRPC server here (see server.py).

``FakeRuntime.handle(method, request_bytes) -> response_bytes`` is the whole runtime: it parses
the request, applies containerd's semantics to in-memory state and serializes the answer, or
raises ``CriError(code, details)``. The gRPC layer adds only the ``delays`` / ``fail`` knobs.

The calls live in mixins of ``state.RuntimeState`` (the stores, knobs and shared record
operations): ``sandboxes.SandboxCalls``, ``containers.ContainerCalls``, ``stats.StatsCalls``,
``images.ImageCalls``; the records themselves in ``records``, the statuses and id lookups in
``errors``, the OCI resource merge and cgroup files in ``resources``, the method table in
``methods``. Version, Status and the runtime config calls are here.

Which containerd behaviour is mimicked, and where it was checked, is stated in each handler's
docstring. Sources: containerd's ``pkg/cri/server`` (1.6/1.7 ``server`` package: container_*.go,
sandbox_*.go, image_*.go, helpers.go), ``pkg/cri/opts/spec_linux.go`` (``WithResources``),
``pkg/cri/store/*`` (truncindex lookups) and ``pkg/registrar``; and the responses containerd
1.6.20 actually sent in tests/data/traces (kubelet-1.23-*.jsonl.xz, recorder-smoke.jsonl).

How containerd turns Go errors into gRPC statuses (``errdefs.ToGRPC``): an error wrapping
``errdefs.ErrNotFound`` becomes NOT_FOUND, ``context.DeadlineExceeded`` DEADLINE_EXCEEDED,
anything unrecognised (e.g. ``fmt.Errorf`` text, registrar conflicts) UNKNOWN; the status
message is the whole wrapped error text, e.g. ``an error occurred when try to find container
"deadbeef": not found``.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import grpc

from shim.cri import pb
from memqos_dev.testing.fake_runtime import gojson
from memqos_dev.testing.fake_runtime.containers import ContainerCalls
from memqos_dev.testing.fake_runtime.errors import CriError, IdLookupError, truncindex_get
from memqos_dev.testing.fake_runtime.images import ImageCalls
from memqos_dev.testing.fake_runtime.methods import METHODS, method_name, method_path
from memqos_dev.testing.fake_runtime.records import (
    CGROUPFS,
    DEFAULT_SANDBOX_IMAGE,
    RUNC_RUNTIME_TYPE,
    SYSTEMD,
    Container,
    Image,
    RecordedCall,
    Sandbox,
    default_images,
)
from memqos_dev.testing.fake_runtime.resources import CONTAINERD_PREFIX, CRIO_PREFIX
from memqos_dev.testing.fake_runtime.sandboxes import SandboxCalls
from memqos_dev.testing.fake_runtime.stats import StatsCalls


class FakeRuntime(SandboxCalls, ContainerCalls, StatsCalls, ImageCalls):
    """An in-memory CRI runtime with containerd 1.6/1.7 semantics for the calls a kubelet makes.

    Thread-safe: every operation holds ``self.lock`` (an RLock); hold it yourself to read
    several records consistently while a server is running.

    Knobs (plain attributes, change them at any time):

    * ``delays``: {method: seconds} -- the gRPC layer sleeps (without blocking other calls)
      before handling. Keys are short names ("PullImage") or full paths. For ExecSync a delay
      longer than the request's timeout ends in DEADLINE_EXCEEDED like containerd.
    * ``fail``: {method: (grpc.StatusCode, details)} -- the call fails with that status
      (after its delay) and changes nothing.
    * ``idempotent_stop``: StopContainer / StopPodSandbox of an unknown id. containerd 1.6.20
      (the traced version) and 1.7 before mid-2024 answer NOT_FOUND; the backports of
      containerd#10520/#10521 (release/1.6 #10531, release/1.7 #10528, July 2024) made them
      return OK. Default False = the traced 1.6.20 behaviour.
    * ``strict_images``: CreateContainer of an image the store does not hold fails with
      NOT_FOUND (``failed to resolve image "x": not found``) like containerd. Default False:
      the image is accepted and given a synthetic id, so tests need not pull first.
    * ``network_ready``: the NetworkReady condition of Status.
    * ``exec_sync_result``: (stdout, stderr, exit_code) that ExecSync returns.
    * ``exec_sync_output``: None, or a function of the ExecSync command returning its
      (stdout, stderr, exit_code), or None for ``exec_sync_result``.
    * ``swap_controller`` / ``hugetlb_controller``: see ``apply_linux_resources``.
    * ``kernel_files``: a started container's cgroup also gets memory.min / memory.low /
      memory.high at the kernel's defaults, as a real one has them (off: a file exists only when
      something wrote it, which some tests look at).
    * ``update_unified``: whether UpdateContainerResources applies ``unified`` (containerd and
      CRI-O >= 1.36 do; CRI-O before 1.36 applies the limit and leaves the keys as they were).

    ``FakeRuntime.crio(version)`` is the same runtime as CRI-O names and updates containers:
    RuntimeName "cri-o", container cgroups ``crio-<id>`` (``crio-<id>.scope`` with systemd), and
    ``update_unified`` as that version does (docs/nri-mode.md, "What the runtimes do").
    """

    def __init__(
        self,
        *,
        cgroup_driver: str = CGROUPFS,
        delays: dict[str, float] | None = None,
        fail: dict[str, tuple[grpc.StatusCode, str]] | None = None,
        images: Iterable[Image] | None = None,
        strict_images: bool = False,
        idempotent_stop: bool = False,
        network_ready: bool = True,
        runtime_handlers: Iterable[str] = ("", "runc"),
        swap_controller: bool = True,
        hugetlb_controller: bool = False,
        sandbox_image: str = DEFAULT_SANDBOX_IMAGE,
        runtime_name: str = "fake-runtime",
        runtime_version: str = "0.1.0",
        cgroup_root: str | None = None,
        update_unified: bool = True,
        cgroup_prefix: str = CONTAINERD_PREFIX,
        kernel_files: bool = False,
    ):
        if cgroup_driver not in (CGROUPFS, SYSTEMD):
            raise ValueError(f"cgroup_driver must be {CGROUPFS!r} or {SYSTEMD!r}, not {cgroup_driver!r}")
        self.lock = threading.RLock()
        self.cgroup_driver = cgroup_driver
        self.delays: dict[str, float] = dict(delays or {})
        self.fail: dict[str, tuple[grpc.StatusCode, str]] = dict(fail or {})
        self.strict_images = strict_images
        self.idempotent_stop = idempotent_stop
        self.network_ready = network_ready
        self.runtime_handlers = set(runtime_handlers)
        self.swap_controller = swap_controller
        self.hugetlb_controller = hugetlb_controller
        self.sandbox_image = sandbox_image
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        # a cgroup v2 tree (real files) where started containers get their cgroup, as runc
        # creates it: memory.max and every unified key written, updates applied, removed at exit
        self.cgroup_root = cgroup_root
        self.update_unified = update_unified
        self.kernel_files = kernel_files  # new container cgroups get memory.min/low/high at the kernel's defaults
        self.cgroup_prefix = cgroup_prefix  # the container cgroup's leaf: <prefix>-<id> (cgroupfs: <id> for containerd)
        self.exec_sync_result: tuple[bytes, bytes, int] = (b"", b"", 0)
        self.exec_sync_output: Callable[[list[str]], tuple[bytes, bytes, int] | None] | None = None

        self.sandboxes: dict[str, Sandbox] = {}
        self.containers: dict[str, Container] = {}
        self.images: dict[str, Image] = {}
        for image in default_images() if images is None else images:
            self.images[image.id] = image
        self._sandbox_names: dict[str, str] = {}  # name -> id (containerd's registrar)
        self._container_names: dict[str, str] = {}
        self._next_pid = 1000
        self._next_ip = 2

        #: every call received (also failed and unimplemented ones), in arrival order
        self.calls: list[RecordedCall] = []
        #: raw bytes of every CreateContainerRequest received, in arrival order
        self.received_create_requests: list[bytes] = []
        #: raw bytes of every UpdateContainerResourcesRequest received, in arrival order
        self.received_update_requests: list[bytes] = []

        self._handlers: dict[str, Callable[[Any], Any]] = {
            "Version": self._version,
            "Status": self._status,
            "RuntimeConfig": self._runtime_config,
            "UpdateRuntimeConfig": self._update_runtime_config,
            "RunPodSandbox": self._run_pod_sandbox,
            "StopPodSandbox": self._stop_pod_sandbox,
            "RemovePodSandbox": self._remove_pod_sandbox,
            "PodSandboxStatus": self._pod_sandbox_status,
            "ListPodSandbox": self._list_pod_sandbox,
            "UpdatePodSandboxResources": self._update_pod_sandbox_resources,
            "CreateContainer": self._create_container,
            "StartContainer": self._start_container,
            "StopContainer": self._stop_container,
            "RemoveContainer": self._remove_container,
            "ListContainers": self._list_containers,
            "ContainerStatus": self._container_status,
            "UpdateContainerResources": self._update_container_resources,
            "ReopenContainerLog": self._reopen_container_log,
            "ExecSync": self._exec_sync,
            "ContainerStats": self._container_stats,
            "ListContainerStats": self._list_container_stats,
            "PodSandboxStats": self._pod_sandbox_stats,
            "ListPodSandboxStats": self._list_pod_sandbox_stats,
            "ListImages": self._list_images,
            "ImageStatus": self._image_status,
            "PullImage": self._pull_image,
            "RemoveImage": self._remove_image,
            "ImageFsInfo": self._image_fs_info,
        }

    # ------------------------------------------------------------------ public helpers

    @classmethod
    def crio(cls, version: str = "1.34.11", **kwargs) -> "FakeRuntime":
        """The runtime as CRI-O ``version`` answers Version, names container cgroups and treats
        ``unified`` in UpdateContainerResources (applied from 1.36.0 on)."""
        major, minor = (int(x) for x in version.split(".")[:2])
        kwargs.setdefault("update_unified", (major, minor) >= (1, 36))
        return cls(runtime_name="cri-o", runtime_version=version, cgroup_prefix=CRIO_PREFIX, **kwargs)

    @property
    def implemented_methods(self) -> frozenset[str]:
        return frozenset(self._handlers)

    def handle(self, method: str, request: bytes) -> bytes:
        """Run one unary CRI call on the state: request bytes in, response bytes out.

        ``method`` is a short name or a full path. Raises CriError (UNIMPLEMENTED for methods
        the fake does not implement, with grpc-go's "method X not implemented" text, which is
        what containerd's embedded Unimplemented*Server answers). Does not record the call
        and ignores ``delays``/``fail`` (the gRPC layer applies those).
        """
        name = method_name(method)
        entry = METHODS.get(name)
        handler = self._handlers.get(name)
        if entry is None or handler is None:
            raise CriError(grpc.StatusCode.UNIMPLEMENTED, f"method {name} not implemented")
        _, req_cls, _, _ = entry
        try:
            req = req_cls.FromString(request)
        except Exception as exc:  # malformed protobuf
            raise CriError(grpc.StatusCode.INTERNAL, f"grpc: error unmarshalling request: {exc}") from exc
        if name == "CreateContainer":
            with self.lock:
                self.received_create_requests.append(bytes(request))
        elif name == "UpdateContainerResources":
            with self.lock:
                self.received_update_requests.append(bytes(request))
        with self.lock:
            resp = handler(req, bytes(request)) if name in _WANTS_RAW else handler(req)
        return resp.SerializeToString()

    def record_call(self, method: str, request: bytes) -> RecordedCall:
        call = RecordedCall(method=method_path(method), request=bytes(request), start=time.time())
        with self.lock:
            self.calls.append(call)
        return call

    def calls_of(self, method: str) -> list[RecordedCall]:
        name = method_name(method)
        with self.lock:
            return [c for c in self.calls if c.name == name]

    def delay_for(self, method: str) -> float:
        d = self.delays
        return float(d.get(method_path(method), d.get(method_name(method), 0.0)) or 0.0)

    def failure_for(self, method: str) -> tuple[grpc.StatusCode, str] | None:
        f = self.fail
        return f.get(method_path(method), f.get(method_name(method)))

    def _record(self, store: dict, id_or_prefix: str):
        with self.lock:
            try:
                return store[truncindex_get(store, id_or_prefix)]
            except IdLookupError as exc:
                raise KeyError(id_or_prefix) from exc

    def sandbox(self, id_or_prefix: str) -> Sandbox:
        """The sandbox with this id (or unique id prefix); KeyError if none."""
        return self._record(self.sandboxes, id_or_prefix)

    def container(self, id_or_prefix: str) -> Container:
        """The container with this id (or unique id prefix); KeyError if none."""
        return self._record(self.containers, id_or_prefix)

    def containers_in(self, sandbox_id: str) -> list[Container]:
        with self.lock:
            return [c for c in self.containers.values() if c.pod_sandbox_id == sandbox_id]

    def add_image(self, ref: str, *, id: str | None = None, size: int = 3_000_000) -> Image:
        """Put an image in the store as if pulled; returns it (existing one if present)."""
        with self.lock:
            return self._add_image(ref, id=id, size=size)

    def exit_container(self, id: str, exit_code: int = 0, *, reason: str = "", message: str = "") -> None:
        """Make a RUNNING container exit on its own (like its process ending)."""
        with self.lock:
            c = self.container(id)
            if c.state == pb.CONTAINER_RUNNING:
                self._finish(c, exit_code, reason=reason, message=message)
    # ------------------------------------------------------------------ RuntimeService

    def _version(self, req: pb.VersionRequest) -> pb.VersionResponse:
        """Version: kubelet API version "0.1.0", runtime_api_version "v1" (as containerd sends)."""
        return pb.VersionResponse(
            version="0.1.0",
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
            runtime_api_version="v1",
        )

    def _status(self, req: pb.StatusRequest) -> pb.StatusResponse:
        """Status: RuntimeReady and NetworkReady conditions; verbose adds an info map.

        containerd reports NetworkReady=false with reason NetworkPluginNotReady while no CNI
        config is loaded (seen in the traces); ``network_ready=False`` reproduces that.
        """
        resp = pb.StatusResponse()
        resp.status.conditions.add(type="RuntimeReady", status=True)
        if self.network_ready:
            resp.status.conditions.add(type="NetworkReady", status=True)
        else:
            resp.status.conditions.add(
                type="NetworkReady",
                status=False,
                reason="NetworkPluginNotReady",
                message="Network plugin returns error: cni plugin not initialized",
            )
        if req.verbose:
            config = {
                "containerd": {
                    "snapshotter": "overlayfs",
                    "defaultRuntimeName": "runc",
                    "runtimes": {
                        "runc": {
                            "runtimeType": RUNC_RUNTIME_TYPE,
                            "options": {"SystemdCgroup": self.cgroup_driver == SYSTEMD},
                        }
                    },
                },
                "sandboxImage": self.sandbox_image,
            }
            resp.info["config"] = gojson.dumps(config)
            resp.info["golang"] = '"go1.19.9"'
            resp.info["lastCNILoadStatus"] = "OK" if self.network_ready else "cni config load failed"
        return resp

    def _runtime_config(self, req: pb.RuntimeConfigRequest) -> pb.RuntimeConfigResponse:
        """RuntimeConfig (containerd >= 2.0): the cgroup driver; ``cgroup_driver`` knob."""
        resp = pb.RuntimeConfigResponse()
        resp.linux.cgroup_driver = pb.SYSTEMD if self.cgroup_driver == SYSTEMD else pb.CGROUPFS
        return resp

    def _update_runtime_config(self, req: pb.UpdateRuntimeConfigRequest) -> pb.UpdateRuntimeConfigResponse:
        """UpdateRuntimeConfig: accepted (containerd stores the pod CIDR for its CNI template)."""
        return pb.UpdateRuntimeConfigResponse()


#: handlers that also receive the raw request bytes (they keep them)
_WANTS_RAW = frozenset({"RunPodSandbox", "CreateContainer", "UpdateContainerResources", "UpdatePodSandboxResources"})
