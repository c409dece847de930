"""State and CRI semantics of the fake runtime. No gRPC server here (see server.py).

``FakeRuntime.handle(method, request_bytes) -> response_bytes`` is the whole runtime: it parses
the request, applies containerd's semantics to in-memory state and serializes the answer, or
raises ``CriError(code, details)``. The gRPC layer adds only the ``delays`` / ``fail`` knobs.

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

import hashlib
import json
import posixpath
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc

from shim.cri import pb
from shim.testing.fake_runtime import _gojson

RUNTIME_SERVICE = "runtime.v1.RuntimeService"
IMAGE_SERVICE = "runtime.v1.ImageService"
SERVICES = (RUNTIME_SERVICE, IMAGE_SERVICE)

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"

#: The images of the recorded traces (containerd 1.6.20, images imported locally, hence no
#: repo digests). Preloaded by default so trace requests (which name images by id) resolve.
BUSYBOX_IMAGE_ID = "sha256:9bd6f25845ac1294077fa416805124f081f523e3c925a8583f1d8e9283bf8e0f"
PAUSE_IMAGE_ID = "sha256:036e274c0404a799da4222811a8a5444a6e0b2e18557a0eb0ed5078b572843e0"
DEFAULT_SANDBOX_IMAGE = "localhost/pause:e2e"

SNAPSHOTTER_MOUNT = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs"
RUNC_RUNTIME_TYPE = "io.containerd.runc.v2"

# containerd constants (pkg/cri/server/helpers.go, container_start.go, sandbox_run.go)
COMPLETE_EXIT_REASON = "Completed"
ERROR_EXIT_REASON = "Error"
ERROR_START_EXIT_CODE = 128
ERROR_START_REASON = "StartError"
SIGKILL_EXIT_CODE = 137
DEFAULT_SANDBOX_OOM_ADJ = -998
DEFAULT_SANDBOX_CPU_SHARES = 2

_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_UNKNOWN = grpc.StatusCode.UNKNOWN


class CriError(Exception):
    """A CRI call failing with a gRPC status, as containerd's errdefs.ToGRPC would return it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _q(s: str) -> str:
    """Go's %q for the strings we meet (ids, names): a double-quoted, escaped string."""
    return json.dumps(s, ensure_ascii=False)


def _go_duration(seconds: float) -> str:
    """Go's time.Duration.String() for whole/fractional seconds as they appear in messages."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:g}s"


def _now_ns() -> int:
    return time.time_ns()


def generate_id() -> str:
    """64 random hex characters, like containerd's util.GenerateID (32 random bytes)."""
    return secrets.token_hex(32)


class _LookupError(Exception):
    def __init__(self, code: grpc.StatusCode, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


def _truncindex_get(ids: Iterable[str], key: str) -> str:
    """containerd's truncindex.Get: exact id or unique prefix.

    Empty key -> "prefix can't be empty" (UNKNOWN), no match -> ErrNotFound ("not found",
    NOT_FOUND), several matches -> "Multiple IDs found with provided prefix: <key>" (UNKNOWN).
    """
    if key == "":
        raise _LookupError(_UNKNOWN, "prefix can't be empty")
    ids = list(ids)
    if key in ids:
        return key
    matches = [i for i in ids if i.startswith(key)]
    if not matches:
        raise _LookupError(_NOT_FOUND, "not found")
    if len(matches) > 1:
        raise _LookupError(_UNKNOWN, f"Multiple IDs found with provided prefix: {key}")
    return matches[0]


# --------------------------------------------------------------------------- images


def _filter_id(ids: Iterable[str], key: str) -> str:
    """A list filter's id: the full id it is a unique prefix of, else the key itself (which
    then matches nothing) -- containerd filters lists this way, it never fails them."""
    try:
        return _truncindex_get(ids, key)
    except _LookupError:
        return key


def normalize_image_ref(ref: str) -> str:
    """docker.ParseDockerRef: add docker.io/library/ and :latest; a digest drops the tag."""
    name, _, digest = ref.partition("@")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        domain, path = parts[0], "/".join(parts[1:])
    else:
        domain, path = "docker.io", name
    if domain == "docker.io" and "/" not in path:
        path = "library/" + path
    full = f"{domain}/{path}"
    if digest:
        return f"{full}@{digest}"
    return f"{full}:{tag or 'latest'}"


@dataclass
class Image:
    """An image in the fake image store (what containerd's CRI image store holds)."""

    id: str
    repo_tags: list[str] = field(default_factory=list)
    repo_digests: list[str] = field(default_factory=list)
    size: int = 0
    uid: int | None = None
    username: str = ""
    pinned: bool = False

    def to_cri(self) -> pb.Image:
        img = pb.Image(
            id=self.id,
            repo_tags=self.repo_tags,
            repo_digests=self.repo_digests,
            size=self.size,
            username=self.username,
            pinned=self.pinned,
        )
        if self.uid is not None:
            img.uid.value = self.uid
        return img


def default_images() -> list[Image]:
    """The two images of the recorded traces, with the ids and sizes containerd reported."""
    return [
        Image(id=BUSYBOX_IMAGE_ID, repo_tags=["localhost/busybox:latest"], size=3666618),
        Image(id=PAUSE_IMAGE_ID, repo_tags=["localhost/pause:e2e"], size=3666624),
    ]


# --------------------------------------------------------------------------- resources


def apply_linux_resources(
    spec: pb.LinuxContainerResources,
    new: pb.LinuxContainerResources,
    *,
    swap_controller: bool = True,
    hugetlb_controller: bool = False,
) -> None:
    """Merge ``new`` into ``spec`` the way containerd's ``opts.WithResources`` edits the OCI spec.

    Used for CreateContainer and, on a copy of the current spec, for UpdateContainerResources
    (``updateOCIResource``). Semantics (pkg/cri/opts/spec_linux.go):

    * cpu_period / cpu_quota / cpu_shares / cpuset_cpus / cpuset_mems / memory_limit_in_bytes
      overwrite only when non-zero -- a zero field in an update keeps the old value;
    * with a memory limit and no explicit swap limit, swap = limit (when the swap controller is
      available, as on the traced node: every limited container reports
      memory_swap_limit_in_bytes == memory_limit_in_bytes); a non-zero swap limit wins;
    * ``unified`` keys are merged in: added or overwritten, never removed;
    * hugepage limits are appended only if the hugetlb controller exists; otherwise skipped
      (tolerate_missing_hugetlb_controller, the default): the traced node had none, so its
      statuses carry no hugepage_limits although the kubelet sent 2MB/1GB entries;
    * oom_score_adj is not a resource here (it is process-level, set at create only).
    """
    if new.cpu_period:
        spec.cpu_period = new.cpu_period
    if new.cpu_quota:
        spec.cpu_quota = new.cpu_quota
    if new.cpu_shares:
        spec.cpu_shares = new.cpu_shares
    if new.cpuset_cpus:
        spec.cpuset_cpus = new.cpuset_cpus
    if new.cpuset_mems:
        spec.cpuset_mems = new.cpuset_mems
    if new.memory_limit_in_bytes:
        spec.memory_limit_in_bytes = new.memory_limit_in_bytes
        if not new.memory_swap_limit_in_bytes and swap_controller:
            spec.memory_swap_limit_in_bytes = new.memory_limit_in_bytes
    if new.memory_swap_limit_in_bytes and swap_controller:
        spec.memory_swap_limit_in_bytes = new.memory_swap_limit_in_bytes
    if hugetlb_controller:
        for limit in new.hugepage_limits:
            spec.hugepage_limits.add(page_size=limit.page_size, limit=limit.limit)
    for key, value in new.unified.items():
        spec.unified[key] = value


def oci_linux_resources(r: pb.LinuxContainerResources) -> dict[str, Any]:
    """The ``linux.resources`` object of an OCI runtime spec holding ``r`` (for verbose info)."""
    out: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    memory: dict[str, Any] = {}
    if r.memory_limit_in_bytes:
        memory["limit"] = r.memory_limit_in_bytes
    if r.memory_swap_limit_in_bytes:
        memory["swap"] = r.memory_swap_limit_in_bytes
    out["memory"] = memory
    cpu: dict[str, Any] = {}
    if r.cpu_shares:
        cpu["shares"] = r.cpu_shares
    if r.cpu_quota:
        cpu["quota"] = r.cpu_quota
    if r.cpu_period:
        cpu["period"] = r.cpu_period
    if r.cpuset_cpus:
        cpu["cpus"] = r.cpuset_cpus
    if r.cpuset_mems:
        cpu["mems"] = r.cpuset_mems
    out["cpu"] = cpu
    if r.hugepage_limits:
        out["hugepageLimits"] = [{"pageSize": h.page_size, "limit": h.limit} for h in r.hugepage_limits]
    if r.unified:
        out["unified"] = dict(sorted(r.unified.items()))
    return out


def cgroups_path(cgroup_parent: str, id: str) -> str:
    """containerd's getCgroupsPath: ``slice:cri-containerd:id`` under a systemd slice, else a path."""
    base = posixpath.basename(cgroup_parent)
    if base.endswith(".slice"):
        return f"{base}:cri-containerd:{id}"
    return posixpath.join(cgroup_parent, id) if cgroup_parent else id


def expand_slice(name: str) -> str:
    """systemd's slice naming: 'kubepods-burstable-pod1_2.slice' lives at
    'kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice' (every dash
    names a parent slice); '-.slice' is the root."""
    if not name.endswith(".slice") or name == "-.slice":
        raise ValueError(f"not a slice name: {name!r}")
    stem = name[: -len(".slice")]
    if not stem or stem.startswith("-") or stem.endswith("-") or "--" in stem or "/" in stem:
        raise ValueError(f"invalid slice name: {name!r}")
    parts = stem.split("-")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def container_cgroup(cgroup_parent: str, id: str, driver: str) -> str:
    """Where runc puts a container's cgroup (relative to the cgroup v2 root), from containerd's
    cgroupsPath: with the systemd driver ``slice:cri-containerd:id`` becomes the scope
    ``cri-containerd-<id>.scope`` in the expanded slice (the kubelet may send the full slice
    path or the leaf slice alone: only the leaf counts); with cgroupfs ``<parent>/<id>``.
    ValueError for the combinations runc refuses (systemd driver and a plain path)."""
    path = cgroups_path(cgroup_parent, id)
    if driver == SYSTEMD:
        parts = path.split(":")
        if len(parts) != 3:
            raise ValueError(f'expected cgroupsPath to be of format "slice:prefix:name" for systemd cgroups, '
                             f'got "{path}" instead')
        slice_name, prefix, name = parts
        return posixpath.join(expand_slice(slice_name), f"{prefix}-{name}.scope")
    if ":" in path:
        raise ValueError(f"cgroupfs driver: invalid cgroup path {path!r} (a systemd slice parent)")
    return path.lstrip("/")


def _copy(msg):
    new = type(msg)()
    new.CopyFrom(msg)
    return new


# --------------------------------------------------------------------------- records


@dataclass
class RecordedCall:
    """One RPC as the fake runtime received it (bytes exactly as they came off the wire)."""

    method: str  # full path, e.g. "/runtime.v1.RuntimeService/CreateContainer"
    request: bytes
    start: float
    code: str = ""  # grpc.StatusCode name once finished ("" while in flight)
    details: str = ""

    @property
    def name(self) -> str:
        return self.method.rsplit("/", 1)[-1]


@dataclass
class Sandbox:
    """A pod sandbox. ``config`` is the full PodSandboxConfig of the RunPodSandboxRequest."""

    id: str
    name: str  # containerd's reserved name: <pod>_<namespace>_<uid>_<attempt>
    config: pb.PodSandboxConfig
    runtime_handler: str
    created_at: int
    pid: int
    state: int = pb.SANDBOX_READY
    ip: str = ""
    run_request_bytes: bytes = b""
    #: raw bytes of every UpdatePodSandboxResourcesRequest applied to this sandbox
    update_resources_requests: list[bytes] = field(default_factory=list)
    overhead: pb.LinuxContainerResources | None = None
    resources: pb.LinuxContainerResources | None = None

    @property
    def metadata(self) -> pb.PodSandboxMetadata:
        return self.config.metadata

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.config.labels)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.config.annotations)

    @property
    def host_network(self) -> bool:
        return self.config.linux.security_context.namespace_options.network == pb.NODE

    @property
    def cgroup_parent(self) -> str:
        return self.config.linux.cgroup_parent


@dataclass
class Container:
    """A container. ``config`` is the full ContainerConfig of the CreateContainerRequest."""

    id: str
    name: str  # containerd's reserved name: <ctr>_<pod>_<namespace>_<uid>_<attempt>
    pod_sandbox_id: str
    config: pb.ContainerConfig
    sandbox_config: pb.PodSandboxConfig  # the one sent along with CreateContainer
    image_ref: str  # the image id containerd resolved config.image to
    log_path: str
    created_at: int
    #: LinuxContainerResources in force: containerd's OCI spec view, i.e. the config's
    #: resources after apply_linux_resources, then every UpdateContainerResources merged in,
    #: plus oom_score_adj. ContainerStatus.resources.linux is exactly this.
    resources: pb.LinuxContainerResources
    #: the exact bytes of the CreateContainerRequest this container was made from
    create_request_bytes: bytes = b""
    #: the exact bytes of every UpdateContainerResourcesRequest applied, in order
    update_requests: list[bytes] = field(default_factory=list)
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    reason: str = ""
    message: str = ""
    pid: int = 0
    #: reported by the stats calls; tests may change it
    memory_working_set_bytes: int = 344064

    @property
    def state(self) -> int:
        """containerstore.Status.State(): finished -> EXITED, started -> RUNNING, else CREATED."""
        if self.finished_at:
            return pb.CONTAINER_EXITED
        if self.started_at:
            return pb.CONTAINER_RUNNING
        return pb.CONTAINER_CREATED

    @property
    def metadata(self) -> pb.ContainerMetadata:
        return self.config.metadata

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.config.labels)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.config.annotations)

    @property
    def image(self) -> str:
        return self.config.image.image

    @property
    def create_request(self) -> pb.CreateContainerRequest:
        return pb.CreateContainerRequest.FromString(self.create_request_bytes)

    @property
    def update_request_messages(self) -> list[pb.UpdateContainerResourcesRequest]:
        return [pb.UpdateContainerResourcesRequest.FromString(b) for b in self.update_requests]


# --------------------------------------------------------------------------- the runtime


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


class FakeRuntime:
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
    * ``swap_controller`` / ``hugetlb_controller``: see ``apply_linux_resources``.
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
        self.exec_sync_result: tuple[bytes, bytes, int] = (b"", b"", 0)

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

    def sandbox(self, id_or_prefix: str) -> Sandbox:
        """The sandbox with this id (or unique id prefix); KeyError if none."""
        with self.lock:
            try:
                return self.sandboxes[_truncindex_get(self.sandboxes, id_or_prefix)]
            except _LookupError as exc:
                raise KeyError(id_or_prefix) from exc

    def container(self, id_or_prefix: str) -> Container:
        """The container with this id (or unique id prefix); KeyError if none."""
        with self.lock:
            try:
                return self.containers[_truncindex_get(self.containers, id_or_prefix)]
            except _LookupError as exc:
                raise KeyError(id_or_prefix) from exc

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

    # ------------------------------------------------------------------ internals

    def _pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def _find_sandbox(self, key: str, prefix: str) -> Sandbox:
        try:
            return self.sandboxes[_truncindex_get(self.sandboxes, key)]
        except _LookupError as exc:
            raise CriError(exc.code, f"{prefix}: {exc.text}") from None

    def _find_container(self, key: str, prefix: str) -> Container:
        try:
            return self.containers[_truncindex_get(self.containers, key)]
        except _LookupError as exc:
            raise CriError(exc.code, f"{prefix}: {exc.text}") from None

    def _lookup_or_none(self, store: dict, key: str):
        try:
            return store[_truncindex_get(store, key)]
        except _LookupError as exc:
            if exc.code == _NOT_FOUND:
                return None
            raise

    def _resolve_image(self, ref: str) -> Image | None:
        """containerd's localResolve: an image id, a (normalised) reference, or an id prefix."""
        if not ref:
            return None
        if ref in self.images:
            return self.images[ref]
        try:
            normalized = normalize_image_ref(ref)
        except Exception:  # pragma: no cover - defensive
            normalized = ""
        for image in self.images.values():
            if normalized in image.repo_tags or normalized in image.repo_digests:
                return image
        hex_part = ref[len("sha256:"):] if ref.startswith("sha256:") else ref
        if hex_part and all(ch in "0123456789abcdef" for ch in hex_part):
            matches = [i for i in self.images.values() if i.id[len("sha256:"):].startswith(hex_part)]
            if len(matches) == 1:
                return matches[0]
        return None

    def _add_image(self, ref: str, *, id: str | None = None, size: int = 3_000_000) -> Image:
        existing = self._resolve_image(ref)
        if existing is not None:
            return existing
        normalized = normalize_image_ref(ref)
        image_id = id or "sha256:" + hashlib.sha256(("image:" + normalized).encode()).hexdigest()
        repo = normalized.split("@", 1)[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        digest = "sha256:" + hashlib.sha256(("manifest:" + normalized).encode()).hexdigest()
        image = self.images.get(image_id)
        if image is None:
            image = Image(id=image_id, size=size)
            self.images[image_id] = image
        if "@" not in normalized and normalized not in image.repo_tags:
            image.repo_tags.append(normalized)
        if f"{repo}@{digest}" not in image.repo_digests:
            image.repo_digests.append(f"{repo}@{digest}")
        return image

    def cgroup_dir(self, c: Container) -> str | None:
        """The container's cgroup directory under ``cgroup_root`` (None without one)."""
        if self.cgroup_root is None:
            return None
        rel = container_cgroup(c.sandbox_config.linux.cgroup_parent, c.id, self.cgroup_driver)
        return posixpath.join(self.cgroup_root, rel)

    def _write_cgroup(self, c: Container, *, create: bool) -> None:
        import os

        d = self.cgroup_dir(c)
        if create:
            os.makedirs(d, exist_ok=True)
        elif not os.path.isdir(d):
            return
        r = c.resources
        values = {"memory.max": str(r.memory_limit_in_bytes) if r.memory_limit_in_bytes else "max"}
        values.update(r.unified)
        for key, value in values.items():
            if "/" in key or key.startswith("."):
                raise ValueError(f"invalid unified key {key!r}")
            with open(posixpath.join(d, key), "w", encoding="ascii") as f:
                f.write(value + "\n")

    def _remove_cgroup(self, c: Container) -> None:
        import shutil

        try:
            d = self.cgroup_dir(c)
        except ValueError:
            return
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def _finish(self, c: Container, exit_code: int, *, reason: str = "", message: str = "") -> None:
        if self.cgroup_root is not None and c.pid:
            self._remove_cgroup(c)  # the task is deleted when it exits: runc removes the cgroup
        c.finished_at = _now_ns()
        c.exit_code = exit_code
        c.reason = reason
        c.message = message
        c.pid = 0

    def _stop_container_record(self, c: Container, timeout: int) -> None:
        """containerd's stopContainer: only RUNNING containers are acted on.

        A graceful stop (timeout > 0) is modelled as the process exiting 0 on SIGTERM (what
        the traced busybox containers did: reason Completed); timeout 0 is SIGKILL: 137.
        """
        if c.state != pb.CONTAINER_RUNNING:
            return
        self._finish(c, 0 if timeout > 0 else SIGKILL_EXIT_CODE)

    def _stop_sandbox_record(self, sb: Sandbox) -> None:
        """containerd's stopPodSandbox: force-stop (timeout 0) its containers, then the sandbox."""
        for c in self.containers.values():
            if c.pod_sandbox_id == sb.id:
                self._stop_container_record(c, 0)
        sb.state = pb.SANDBOX_NOTREADY
        sb.pid = 0

    def _delete_container_record(self, c: Container) -> None:
        self.containers.pop(c.id, None)
        if self._container_names.get(c.name) == c.id:
            del self._container_names[c.name]

    def _status_image(self, c: Container) -> tuple[pb.ImageSpec, str]:
        """ContainerStatus's image/image_ref: the image's first repo tag and first repo digest
        when the image is known (else the config's ImageSpec and the image id) -- containerd's
        ContainerStatus; in the traces: image "localhost/busybox:latest", image_ref the id."""
        spec = _copy(c.config.image)
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

    def _to_cri_sandbox_status(self, sb: Sandbox) -> pb.PodSandboxStatus:
        ip = "" if (sb.host_network or sb.state != pb.SANDBOX_READY) else sb.ip
        status = pb.PodSandboxStatus(
            id=sb.id,
            metadata=sb.config.metadata,
            state=sb.state,
            created_at=sb.created_at,
            labels=sb.config.labels,
            annotations=sb.config.annotations,
            runtime_handler=sb.runtime_handler,
        )
        status.network.ip = ip
        ns = sb.config.linux.security_context.namespace_options
        status.linux.namespaces.SetInParent()
        if sb.config.linux.security_context.HasField("namespace_options"):
            status.linux.namespaces.options.CopyFrom(ns)
        return status

    def _runtime_options(self) -> dict[str, Any]:
        return {"systemd_cgroup": True} if self.cgroup_driver == SYSTEMD else {}

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
        return {"info": _gojson.dumps(info)}

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
                "cgroupsPath": cgroups_path(c.sandbox_config.linux.cgroup_parent, c.id),
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
        return {"info": _gojson.dumps(info)}

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
            resp.info["config"] = _gojson.dumps(config)
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
            raise CriError(_UNKNOWN, "sandbox config must include metadata")
        md = config.metadata
        name = "_".join([md.name, md.namespace, md.uid, str(md.attempt)])
        if req.runtime_handler not in self.runtime_handlers:
            raise CriError(
                _UNKNOWN, f"failed to get sandbox runtime: no runtime for {_q(req.runtime_handler)} is configured"
            )
        holder = self._sandbox_names.get(name)
        if holder is not None:
            raise CriError(
                _UNKNOWN, f"failed to reserve sandbox name {_q(name)}: name {_q(name)} is reserved for {_q(holder)}"
            )
        sid = generate_id()
        while sid in self.sandboxes:  # pragma: no cover - 256 random bits
            sid = generate_id()
        sb = Sandbox(
            id=sid,
            name=name,
            config=_copy(config),
            runtime_handler=req.runtime_handler,
            created_at=_now_ns(),
            pid=self._pid(),
            run_request_bytes=raw,
        )
        if not sb.host_network:
            n = self._next_ip
            self._next_ip += 1
            sb.ip = f"10.88.{n // 254}.{n % 254 + 1}"
        if config.linux.HasField("overhead"):
            sb.overhead = _copy(config.linux.overhead)
        if config.linux.HasField("resources"):
            sb.resources = _copy(config.linux.resources)
        self.sandboxes[sid] = sb
        self._sandbox_names[name] = sid
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    def _stop_pod_sandbox(self, req: pb.StopPodSandboxRequest) -> pb.StopPodSandboxResponse:
        """StopPodSandbox: force-stops its containers (exit 137) and marks it NOTREADY.

        Unknown id -> NOT_FOUND 'an error occurred when try to find sandbox "<id>": not found'
        in containerd 1.6.20 (sandbox_stop.go); OK with ``idempotent_stop`` (containerd with
        the July 2024 backports of #10520). Stopping a stopped sandbox is OK (seen in the trace).
        """
        try:
            sb = self._find_sandbox(req.pod_sandbox_id, f"an error occurred when try to find sandbox {_q(req.pod_sandbox_id)}")
        except CriError as err:
            if err.code == _NOT_FOUND and self.idempotent_stop:
                return pb.StopPodSandboxResponse()
            raise
        self._stop_sandbox_record(sb)
        return pb.StopPodSandboxResponse()

    def _remove_pod_sandbox(self, req: pb.RemovePodSandboxRequest) -> pb.RemovePodSandboxResponse:
        """RemovePodSandbox: stops it if needed, removes all its containers, releases its name.

        Unknown id -> OK (idempotent: "RemovePodSandbox called for sandbox ... that does not
        exist", sandbox_remove.go). An empty or ambiguous id is still an error (UNKNOWN).
        """
        try:
            sb = self._lookup_or_none(self.sandboxes, req.pod_sandbox_id)
        except _LookupError as exc:
            raise CriError(exc.code, f"an error occurred when try to find sandbox {_q(req.pod_sandbox_id)}: {exc.text}")
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
        want_id = ""
        if f is not None and f.id:
            want_id = _filter_id(self.sandboxes, f.id)
        for sb in self.sandboxes.values():
            if f is not None:
                if want_id and sb.id != want_id:
                    continue
                if f.HasField("state") and f.state.state != sb.state:
                    continue
                if any(sb.config.labels.get(k) != v for k, v in f.label_selector.items()):
                    continue
            resp.items.add(
                id=sb.id,
                metadata=sb.config.metadata,
                state=sb.state,
                created_at=sb.created_at,
                labels=sb.config.labels,
                annotations=sb.config.annotations,
                runtime_handler=sb.runtime_handler,
            )
        return resp

    def _update_pod_sandbox_resources(
        self, req: pb.UpdatePodSandboxResourcesRequest, raw: bytes
    ) -> pb.UpdatePodSandboxResourcesResponse:
        """UpdatePodSandboxResources (containerd >= 2.1, NRI notification only): recorded on
        the sandbox. Unknown id -> NOT_FOUND (message modelled on the other sandbox calls)."""
        sb = self._find_sandbox(req.pod_sandbox_id, f"an error occurred when try to find sandbox {_q(req.pod_sandbox_id)}")
        if req.HasField("overhead"):
            sb.overhead = _copy(req.overhead)
        if req.HasField("resources"):
            sb.resources = _copy(req.resources)
        sb.update_resources_requests.append(raw)
        return pb.UpdatePodSandboxResourcesResponse()

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
        sb = self._find_sandbox(req.pod_sandbox_id, f"failed to find sandbox id {_q(req.pod_sandbox_id)}")
        if sb.state != pb.SANDBOX_READY:
            raise CriError(
                _NOT_FOUND,
                f"failed to get sandbox container task: no running task found: task {sb.id} not found: not found",
            )
        config = req.config
        if not config.HasField("metadata"):
            raise CriError(_UNKNOWN, "container config must include metadata")
        smd = req.sandbox_config.metadata
        name = "_".join([config.metadata.name, smd.name, smd.namespace, smd.uid, str(config.metadata.attempt)])
        holder = self._container_names.get(name)
        if holder is not None:
            raise CriError(
                _UNKNOWN, f"failed to reserve container name {_q(name)}: name {_q(name)} is reserved for {_q(holder)}"
            )
        image = self._resolve_image(config.image.image)
        if image is None:
            if self.strict_images:
                raise CriError(_NOT_FOUND, f"failed to resolve image {_q(config.image.image)}: not found")
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
        cid = generate_id()
        while cid in self.containers:  # pragma: no cover
            cid = generate_id()
        c = Container(
            id=cid,
            name=name,
            pod_sandbox_id=sb.id,
            config=_copy(config),
            sandbox_config=_copy(req.sandbox_config),
            image_ref=image_id,
            log_path=log_path,
            created_at=_now_ns(),
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
        c = self._find_container(req.container_id, f"an error occurred when try to find container {_q(req.container_id)}")
        if c.state != pb.CONTAINER_CREATED:
            raise CriError(
                _UNKNOWN,
                f"failed to set starting state for container {_q(c.id)}: container is in "
                f"{pb.ContainerState.Name(c.state)} state",
            )
        sb = self.sandboxes.get(c.pod_sandbox_id)
        if sb is None:
            msg = f"sandbox {_q(c.pod_sandbox_id)} not found: not found"
            self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
            raise CriError(_NOT_FOUND, msg)
        if sb.state != pb.SANDBOX_READY:
            msg = f"sandbox container {_q(sb.id)} is not running"
            self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
            raise CriError(_UNKNOWN, msg)
        if self.cgroup_root is not None:
            try:
                self._write_cgroup(c, create=True)
            except (ValueError, OSError) as e:
                msg = f"failed to create containerd task: failed to create shim task: OCI runtime create failed: {e}"
                self._finish(c, ERROR_START_EXIT_CODE, reason=ERROR_START_REASON, message=msg)
                raise CriError(_UNKNOWN, msg)
        c.started_at = _now_ns()
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
        try:
            c = self._find_container(req.container_id, f"an error occurred when try to find container {_q(req.container_id)}")
        except CriError as err:
            if err.code == _NOT_FOUND and self.idempotent_stop:
                return pb.StopContainerResponse()
            raise
        self._stop_container_record(c, req.timeout)
        return pb.StopContainerResponse()

    def _remove_container(self, req: pb.RemoveContainerRequest) -> pb.RemoveContainerResponse:
        """RemoveContainer: force-stops a running container (exit 137), deletes it, releases
        its name. Unknown id -> OK ("RemoveContainer called for container ... that does not
        exist", container_remove.go); an empty/ambiguous id is still UNKNOWN."""
        try:
            c = self._lookup_or_none(self.containers, req.container_id)
        except _LookupError as exc:
            raise CriError(exc.code, f"an error occurred when try to find container {_q(req.container_id)}: {exc.text}")
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
        want_id = want_sb = ""
        if f is not None:
            if f.id:
                want_id = _filter_id(self.containers, f.id)
            if f.pod_sandbox_id:
                want_sb = _filter_id(self.sandboxes, f.pod_sandbox_id)
        for c in self.containers.values():
            if f is not None:
                if want_id and c.id != want_id:
                    continue
                if want_sb and c.pod_sandbox_id != want_sb:
                    continue
                if f.HasField("state") and f.state.state != c.state:
                    continue
                if any(c.config.labels.get(k) != v for k, v in f.label_selector.items()):
                    continue
            resp.containers.append(self._to_cri_container(c))
        return resp

    def _container_status(self, req: pb.ContainerStatusRequest) -> pb.ContainerStatusResponse:
        """ContainerStatus: unknown id -> NOT_FOUND 'an error occurred when try to find
        container "<id>": not found' (recorder-smoke.jsonl seq 6). Fields as containerd fills
        them (compared field by field against the traces in the tests): labels, annotations,
        mounts from the config, log_path, image = first repo tag, image_ref = image id, reason
        Completed/Error for exited containers, resources = the resources in force."""
        c = self._find_container(req.container_id, f"an error occurred when try to find container {_q(req.container_id)}")
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
            new = _copy(c.resources)
            apply_linux_resources(
                new, req.linux, swap_controller=self.swap_controller, hugetlb_controller=self.hugetlb_controller
            )
            c.resources = new
            if self.cgroup_root is not None and c.state == pb.CONTAINER_RUNNING:
                try:
                    self._write_cgroup(c, create=False)
                except (ValueError, OSError) as e:
                    raise CriError(_UNKNOWN, f"failed to update resources: {e}")
        c.update_requests.append(raw)
        return pb.UpdateContainerResourcesResponse()

    def _reopen_container_log(self, req: pb.ReopenContainerLogRequest) -> pb.ReopenContainerLogResponse:
        """ReopenContainerLog: NOT_FOUND for an unknown id, UNKNOWN "container is not running"."""
        c = self._find_container(req.container_id, f"an error occurred when try to find container {_q(req.container_id)}")
        if c.state != pb.CONTAINER_RUNNING:
            raise CriError(_UNKNOWN, "container is not running")
        return pb.ReopenContainerLogResponse()

    def _exec_sync(self, req: pb.ExecSyncRequest) -> pb.ExecSyncResponse:
        """ExecSync: returns ``exec_sync_result`` (default exit code 0, no output).

        Unknown id -> NOT_FOUND 'failed to exec in container: failed to find container "<id>"
        in store: not found'; not running -> UNKNOWN 'failed to exec in container: container is
        in CONTAINER_EXITED state' (container_execsync.go). The gRPC layer turns a ``delays``
        entry longer than req.timeout into DEADLINE_EXCEEDED 'failed to exec in container:
        timeout 1s exceeded: context deadline exceeded'.
        """
        c = self._find_container(
            req.container_id, f"failed to exec in container: failed to find container {_q(req.container_id)} in store"
        )
        if c.state != pb.CONTAINER_RUNNING:
            raise CriError(
                _UNKNOWN, f"failed to exec in container: container is in {pb.ContainerState.Name(c.state)} state"
            )
        stdout, stderr, code = self.exec_sync_result
        return pb.ExecSyncResponse(stdout=stdout, stderr=stderr, exit_code=code)

    def _cri_container_stats(self, c: Container, now: int) -> pb.ContainerStats:
        cs = pb.ContainerStats()
        cs.attributes.id = c.id
        cs.attributes.metadata.CopyFrom(c.config.metadata)
        cs.attributes.labels.update(c.config.labels)
        cs.attributes.annotations.update(c.config.annotations)
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
            raise CriError(_UNKNOWN, "unexpected metrics response: []")
        return pb.ContainerStatsResponse(stats=self._cri_container_stats(c, _now_ns()))

    def _list_container_stats(self, req: pb.ListContainerStatsRequest) -> pb.ListContainerStatsResponse:
        """ListContainerStats: running containers only (containerd asks the task service for
        metrics, and only started containers have tasks), filtered by id / pod_sandbox_id
        (unique prefixes allowed) / label_selector. Values are plausible constants shaped
        like the traced ones."""
        f = req.filter
        want_id = want_sb = ""
        if f.id:
            want_id = _filter_id(self.containers, f.id)
        if f.pod_sandbox_id:
            want_sb = _filter_id(self.sandboxes, f.pod_sandbox_id)
        now = _now_ns()
        resp = pb.ListContainerStatsResponse()
        for c in self.containers.values():
            if c.state != pb.CONTAINER_RUNNING:
                continue
            if want_id and c.id != want_id:
                continue
            if want_sb and c.pod_sandbox_id != want_sb:
                continue
            if any(c.config.labels.get(k) != v for k, v in f.label_selector.items()):
                continue
            resp.stats.append(self._cri_container_stats(c, now))
        return resp

    def _cri_pod_sandbox_stats(self, sb: Sandbox, now: int) -> pb.PodSandboxStats:
        stats = pb.PodSandboxStats()
        stats.attributes.id = sb.id
        stats.attributes.metadata.CopyFrom(sb.config.metadata)
        stats.attributes.labels.update(sb.config.labels)
        stats.attributes.annotations.update(sb.config.annotations)
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
                f"since sandbox container {_q(sb.id)} is not in ready state: unavailable",
            )
        return pb.PodSandboxStatsResponse(stats=self._cri_pod_sandbox_stats(sb, _now_ns()))

    def _list_pod_sandbox_stats(self, req: pb.ListPodSandboxStatsRequest) -> pb.ListPodSandboxStatsResponse:
        """ListPodSandboxStats: ready sandboxes matching the id (prefix) / label filter."""
        f = req.filter
        want_id = ""
        if f.id:
            want_id = _filter_id(self.sandboxes, f.id)
        now = _now_ns()
        resp = pb.ListPodSandboxStatsResponse()
        for sb in self.sandboxes.values():
            if sb.state != pb.SANDBOX_READY:
                continue
            if want_id and sb.id != want_id:
                continue
            if any(sb.config.labels.get(k) != v for k, v in f.label_selector.items()):
                continue
            resp.stats.append(self._cri_pod_sandbox_stats(sb, now))
        return resp

    # ------------------------------------------------------------------ ImageService

    def _list_images(self, req: pb.ListImagesRequest) -> pb.ListImagesResponse:
        """ListImages: every image; containerd (1.6/1.7) ignores the filter ("TODO: Add image
        list filters after CRI defines this more clear")."""
        return pb.ListImagesResponse(images=[i.to_cri() for i in self.images.values()])

    def _image_status(self, req: pb.ImageStatusRequest) -> pb.ImageStatusResponse:
        """ImageStatus: an image unknown locally -> OK with an empty response (image unset),
        not NOT_FOUND (image_status.go). ``verbose`` adds info["info"] {chainID, imageSpec}."""
        image = self._resolve_image(req.image.image)
        if image is None:
            return pb.ImageStatusResponse()
        resp = pb.ImageStatusResponse(image=image.to_cri())
        if req.verbose:
            chain = "sha256:" + hashlib.sha256(("chain:" + image.id).encode()).hexdigest()
            resp.info["info"] = _gojson.dumps(
                {
                    "chainID": chain,
                    "imageSpec": {
                        "architecture": "amd64",
                        "os": "linux",
                        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
                        "rootfs": {"type": "layers", "diff_ids": [chain]},
                    },
                }
            )
        return resp

    def _pull_image(self, req: pb.PullImageRequest) -> pb.PullImageResponse:
        """PullImage: adds the image (normalised reference as repo tag, a synthetic repo
        digest) and answers image_ref = the image id, as containerd does. Use ``delays`` to
        simulate a slow pull and ``fail`` for a failing one."""
        if not req.image.image:
            raise CriError(_UNKNOWN, 'failed to pull and unpack image "": invalid reference format')
        image = self._add_image(req.image.image)
        return pb.PullImageResponse(image_ref=image.id)

    def _remove_image(self, req: pb.RemoveImageRequest) -> pb.RemoveImageResponse:
        """RemoveImage: removes the image (all its references); unknown -> OK (image_remove.go)."""
        image = self._resolve_image(req.image.image)
        if image is not None:
            self.images.pop(image.id, None)
        return pb.RemoveImageResponse()

    def _image_fs_info(self, req: pb.ImageFsInfoRequest) -> pb.ImageFsInfoResponse:
        """ImageFsInfo: one image filesystem (the overlayfs snapshotter root), as in the traces."""
        resp = pb.ImageFsInfoResponse()
        fs = resp.image_filesystems.add()
        fs.timestamp = _now_ns()
        fs.fs_id.mountpoint = SNAPSHOTTER_MOUNT
        fs.used_bytes.value = sum(i.size for i in self.images.values())
        fs.inodes_used.value = 100 * len(self.images)
        return resp


#: handlers that also receive the raw request bytes (they keep them)
_WANTS_RAW = frozenset({"RunPodSandbox", "CreateContainer", "UpdateContainerResources", "UpdatePodSandboxResources"})
