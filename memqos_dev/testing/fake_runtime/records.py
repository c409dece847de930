"""What the fake runtime holds: its image, sandbox and container records and the calls it received.

The clock (``now_ns``) and the id generator (``generate_id``) are read through this module at
every use, so a test can make them deterministic by patching them here.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from google.protobuf.message import Message

from shim.cri import pb

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


def now_ns() -> int:
    """The clock of the records (created, started, finished, stats timestamps): ns since the epoch."""
    return time.time_ns()


def generate_id() -> str:
    """64 random hex characters, like containerd's util.GenerateID (32 random bytes)."""
    return secrets.token_hex(32)


def copy_message(msg: Message) -> Message:
    """A deep copy of a protobuf message (records never share messages with a request)."""
    new = type(msg)()
    new.CopyFrom(msg)
    return new


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


class ConfiguredRecord:
    """A sandbox or container record: metadata, labels and annotations are its config's."""

    config: pb.PodSandboxConfig | pb.ContainerConfig

    @property
    def metadata(self) -> pb.PodSandboxMetadata | pb.ContainerMetadata:
        return self.config.metadata

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.config.labels)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.config.annotations)


@dataclass
class Sandbox(ConfiguredRecord):
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
    def host_network(self) -> bool:
        return self.config.linux.security_context.namespace_options.network == pb.NODE

    @property
    def cgroup_parent(self) -> str:
        return self.config.linux.cgroup_parent


@dataclass
class Container(ConfiguredRecord):
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
    def image(self) -> str:
        return self.config.image.image

    @property
    def create_request(self) -> pb.CreateContainerRequest:
        return pb.CreateContainerRequest.FromString(self.create_request_bytes)

    @property
    def update_request_messages(self) -> list[pb.UpdateContainerResourcesRequest]:
        return [pb.UpdateContainerResourcesRequest.FromString(b) for b in self.update_requests]


