"""What the doctor's checks share: verdicts, results, where to look, and small readers of /proc
and the CRI."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable

PASS, WARN, FAIL = "pass", "warn", "fail"
SKIP = "skip"  # not checked: a check it depends on failed
KUBELET_ENV_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet", "/etc/sysconfig/kubelet")
KUBELET_UNIT_DIRS = ("/etc/systemd/system/kubelet.service.d", "/usr/lib/systemd/system/kubelet.service.d",
                     "/lib/systemd/system/kubelet.service.d")
ENDPOINT_FLAG = re.compile(r"--container-runtime-endpoint(?:=|\s+)[\"']?([^\s\"']+)")
MIN_KERNEL_WARN = (5, 9)
MIN_KERNEL_FAIL = (4, 5)  # memory.high, memory.min's sibling memory.low: cgroup v2 memory controller
MIN_KERNEL_RECLAIM = (5, 19)  # memory.reclaim


@dataclass
class Result:
    name: str
    verdict: str
    summary: str
    details: list[str] = field(default_factory=list)


@dataclass
class Env:
    """Where doctor looks (tests point these at fake trees)."""

    proc: str = "/proc"
    kernel_release: Callable[[], str] = lambda: os.uname().release
    kubelet_env_files: tuple[str, ...] = KUBELET_ENV_FILES
    kubelet_unit_dirs: tuple[str, ...] = KUBELET_UNIT_DIRS
    rpc_timeout: float = 2.0
    nri_socket: str | None = None  # None: the nri-socket setting, else /var/run/nri/nri.sock
    etc_root: str = "/"  # where etc/containerd/config.toml and etc/crio are looked for


def read_text(path: str, limit: int = 1 << 16) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def words(path: str) -> list[str]:
    return (read_text(path) or "").split()


def kernel_version(release: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cgroup_mounts(proc: str) -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of cgroup/cgroup2 mounts, from mountinfo."""
    out = []
    for line in (read_text(os.path.join(proc, "self", "mountinfo")) or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) >= 5 and len(rf) >= 3 and rf[0] in ("cgroup", "cgroup2"):
            out.append((lf[4], rf[0], rf[2]))
    return out


def runtime_version(endpoint: str, timeout: float) -> tuple[str, str, str]:
    """(runtime_name, runtime_version, runtime_api_version) by a CRI Version call."""
    from shim.cri import pb
    from shim.cri.methods import RUNTIME_SERVICE
    from shim.transport.unary_client import UnaryClient

    client = UnaryClient(endpoint, max_message_bytes=1 << 20, connect_timeout=timeout)
    try:
        raw = client.call(RUNTIME_SERVICE + "Version", pb.VersionRequest(version="v1").SerializeToString(), timeout)
        r = pb.VersionResponse.FromString(raw)
        return r.runtime_name, r.runtime_version, r.runtime_api_version
    finally:
        client.close()


def rpc_error(e: Exception) -> str:
    code = getattr(e, "code", None)
    if isinstance(code, str):  # shim.transport.unary_client.CallError
        return f"{code}: {getattr(e, 'details', '')}"
    if callable(code):
        c = code()
        details = e.details() if callable(getattr(e, "details", None)) else ""
        return f"{c.name if c is not None else 'error'}: {details}"
    return f"{e.__class__.__name__}: {e}"


class CheckBase:
    """What every group of checks reads: the settings `serve` would run with, where to look
    (Env), and the kubelet's configuration and cgroup driver as `serve` would see them."""

    def __init__(self, cfg, env: Env | None = None, config_note: str = ""):
        self.cfg = cfg
        self.env = env or Env()
        self.config_note = config_note
        self._kubelet = None

    @property
    def kubelet(self):
        if self._kubelet is None:
            from shim.node.facts import load_kubelet_config

            self._kubelet = load_kubelet_config(self.cfg.kubelet_config)
        return self._kubelet

    def _driver(self) -> tuple[str | None, str]:
        from shim.effects.layout import detect_driver

        k = self.kubelet
        on_disk = detect_driver(self.cfg.cgroup_root, k.cgroup_root)
        return on_disk, (k.cgroup_driver if k.source else (on_disk or "cgroupfs"))

    def _ownership(self):
        """(KubeletWrites, Ownership, how the version was found), as `serve` would see them."""
        from shim.node.kubelet import detect_kubelet_version, kubelet_writes, ownership

        version, how = detect_kubelet_version(self.cfg.kubelet_version,
                                              proc_root=self.env.proc)
        writes = kubelet_writes(self.kubelet, version)
        return writes, ownership(writes, self.cfg.policy), how
