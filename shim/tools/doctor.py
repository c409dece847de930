"""`memqos-shim doctor`: is this node ready for the shim, and is the shim set up right?

Every check prints one line, PASS / WARN / FAIL, then what it saw and what to do. A check
never crashes the command: an unexpected error is that check's FAIL with the reason. Exit
code 0 when nothing failed, 1 otherwise.

The settings are the ones `serve` would run with: the same flags, ``--config FILE``, and
without it /etc/memqos-shim/config.yaml when that file exists (the systemd unit's config).
"""
from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Callable

from shim.decision import Policy

PASS, WARN, FAIL = "pass", "warn", "fail"
DEFAULT_CONFIG = "/etc/memqos-shim/config.yaml"
KUBELET_ENV_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet", "/etc/sysconfig/kubelet")
KUBELET_UNIT_DIRS = ("/etc/systemd/system/kubelet.service.d", "/usr/lib/systemd/system/kubelet.service.d",
                     "/lib/systemd/system/kubelet.service.d")
_ENDPOINT_FLAG = re.compile(r"--container-runtime-endpoint(?:=|\s+)[\"']?([^\s\"']+)")
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


# -- helpers ---------------------------------------------------------------------------------
def _read(path: str, limit: int = 1 << 16) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def _words(path: str) -> list[str]:
    return (_read(path) or "").split()


def kernel_version(release: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cgroup_mounts(proc: str) -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of cgroup/cgroup2 mounts, from mountinfo."""
    out = []
    for line in (_read(os.path.join(proc, "self", "mountinfo")) or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) >= 5 and len(rf) >= 3 and rf[0] in ("cgroup", "cgroup2"):
            out.append((lf[4], rf[0], rf[2]))
    return out


def runtime_version(endpoint: str, timeout: float) -> tuple[str, str, str]:
    """(runtime_name, runtime_version, runtime_api_version) by a CRI Version call."""
    import grpc

    from shim.cri import pb
    from shim.transport.endpoints import grpc_target

    channel = grpc.insecure_channel(grpc_target(endpoint))
    try:
        fn = channel.unary_unary("/runtime.v1.RuntimeService/Version",
                                 request_serializer=pb.VersionRequest.SerializeToString,
                                 response_deserializer=pb.VersionResponse.FromString)
        r = fn(pb.VersionRequest(version="v1"), timeout=timeout)
        return r.runtime_name, r.runtime_version, r.runtime_api_version
    finally:
        channel.close()


def _rpc_error(e: Exception) -> str:
    code = getattr(e, "code", None)
    if callable(code):
        c = code()
        details = e.details() if callable(getattr(e, "details", None)) else ""
        return f"{c.name if c is not None else 'error'}: {details}"
    return f"{e.__class__.__name__}: {e}"


# -- the checks -----------------------------------------------------------------------------
class Doctor:
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

    CHECKS = ("check_kernel", "check_psi", "check_cgroup_v2", "check_memory_controller", "check_kubelet_config",
              "check_kubelet_endpoint", "check_upstream", "check_socket", "check_audit_log", "check_guard",
              "check_metrics", "check_reclaim")

    def run(self) -> list[Result]:
        out: list[Result] = []
        for attr in self.CHECKS:
            name = attr.removeprefix("check_").replace("_", " ")
            try:
                r = getattr(self, attr)()
            except Exception as e:  # a check must never take the command down
                r = Result(name, FAIL, f"the check itself failed: {e.__class__.__name__}: {e}")
            out.extend(r if isinstance(r, list) else [r])
        return out

    # kernel
    def check_kernel(self) -> Result:
        release = self.env.kernel_release()
        v = kernel_version(release)
        if v is None:
            return Result("kernel", WARN, f"cannot parse the kernel release {release!r}")
        if v < MIN_KERNEL_FAIL:
            return Result("kernel", FAIL, f"{release}: older than 4.5, no cgroup v2 memory controller")
        if v < MIN_KERNEL_WARN:
            return Result("kernel", WARN, f"{release}: older than 5.9", [
                "memory.high throttling on kernels before 5.9 is harsher than what the shim's defaults assume",
                "(reference section 4): containers past memory.high crawl worse; consider --factor none or a newer kernel"])
        return Result("kernel", PASS, f"{release} (5.9 or newer)")

    def check_psi(self) -> Result:
        path = os.path.join(self.env.proc, "pressure", "memory")
        text = _read(path)
        if text is None or "full" not in text:
            return Result("PSI", WARN, f"{path} is not readable: the kernel has no PSI (or was booted with psi=0)", [
                "the memory.high guard cannot see a crawling container and never acts; /metrics has no",
                "memory.pressure series. Boot with psi=1 (CONFIG_PSI)."])
        return Result("PSI", PASS, f"{path} readable: the guard can see memory pressure")

    # cgroups
    def _driver(self) -> tuple[str | None, str]:
        from shim.effects.layout import detect_driver

        k = self.kubelet
        on_disk = detect_driver(self.cfg.cgroup_root, k.cgroup_root)
        return on_disk, (k.cgroup_driver if k.source else (on_disk or "cgroupfs"))

    def check_cgroup_v2(self) -> Result:
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        if is_cgroup_v2(root):
            controllers = " ".join(_words(os.path.join(root, "cgroup.controllers")))
            return Result("cgroup v2", PASS, f"{root} is a cgroup v2 hierarchy (controllers: {controllers or 'none'})")
        details = []
        mounts = cgroup_mounts(self.env.proc)
        v1 = sorted({o for mp, t, opts in mounts if t == "cgroup" and mp.startswith(root.rstrip("/") + "/")
                     for o in opts.split(",") if o not in ("rw", "ro", "relatime") and not o.startswith("name=")})
        if v1:
            details.append(f"cgroup v1 hierarchies are mounted under {root}: {', '.join(v1)}")
        for mp, t, _ in mounts:
            if t == "cgroup2":
                ctl = " ".join(_words(os.path.join(mp, "cgroup.controllers")))
                mem = "" if "memory" in ctl.split() else " -- no memory controller: it stays with v1"
                details.append(f"a cgroup2 hierarchy is mounted at {mp} (hybrid mode), controllers: {ctl or 'none'}{mem}")
        details += [
            "On cgroup v1 runc rejects `unified`, so the shim forwards every call unchanged: no memory QoS",
            "on this node. Boot with systemd.unified_cgroup_hierarchy=1 (and cgroup_no_v1=all) to switch.",
        ]
        return Result("cgroup v2", FAIL, f"{root} is not a cgroup v2 hierarchy (no cgroup.controllers)", details)

    def check_memory_controller(self) -> Result:
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        name = "memory controller"
        if not is_cgroup_v2(root):
            v1 = [mp for mp, t, opts in cgroup_mounts(self.env.proc) if t == "cgroup" and "memory" in opts.split(",")]
            where = f"; the memory controller is on the cgroup v1 hierarchy at {', '.join(v1)}" if v1 else ""
            return Result(name, FAIL, f"no cgroup v2 hierarchy at {root}: no memory.min / memory.high{where}")
        if "memory" not in _words(os.path.join(root, "cgroup.controllers")):
            return Result(name, FAIL, f"{root}/cgroup.controllers has no memory controller",
                          ["the memory controller is bound to a cgroup v1 hierarchy; unmount it (cgroup_no_v1=memory)"])
        on_disk, driver = self._driver()
        from shim.effects.layout import CgroupLayout
        from shim.decision import QoSClass

        try:
            layout = CgroupLayout(driver, self.kubelet.cgroup_root)
        except ValueError as e:
            return Result(name, FAIL, str(e))
        chain = [("", "the root")]
        kp = layout.kubepods
        parts = kp.split("/")
        for i in range(1, len(parts) + 1):
            chain.append(("/".join(parts[:i]), "/".join(parts[:i])))
        for q in (QoSClass.BURSTABLE, QoSClass.BESTEFFORT):
            chain.append((layout.qos(q), layout.qos(q)))
        missing, checked, absent = [], [], []
        for rel, label in chain:
            d = os.path.join(root, rel) if rel else root
            if not os.path.isdir(d):
                absent.append(label)
                continue
            checked.append(label)
            if "memory" not in _words(os.path.join(d, "cgroup.subtree_control")):
                missing.append(label)
        if missing:
            return Result(name, FAIL, f"memory is not in cgroup.subtree_control of {', '.join(missing)}", [
                "cgroups below those get no memory.min / memory.high files: the shim's values cannot apply.",
                "The kubelet enables it when it creates kubepods; something turned it off (or the kubelet runs",
                "with cgroupsPerQOS=false)."])
        if absent and kp in absent:
            return Result(name, WARN, f"memory enabled at the root; {root}/{kp} does not exist yet "
                                      f"(kubelet not started? driver {driver})")
        return Result(name, PASS, f"memory in cgroup.subtree_control along {', '.join(checked)}")

    def _ownership(self):
        """(KubeletWrites, Ownership, how the version was found), as `serve` would see them."""
        from shim.node.kubelet import detect_kubelet_version, kubelet_writes, ownership

        version, how = detect_kubelet_version(self.cfg.kubelet_version,
                                              proc_root=self.env.proc)
        writes = kubelet_writes(self.kubelet, version)
        return writes, ownership(writes, self.cfg.policy), how

    # kubelet
    def check_kubelet_config(self) -> list[Result]:
        from shim.node.facts import node_facts, read_mem_total
        from shim.decision.quantity import format_bytes

        path = self.cfg.kubelet_config
        k = self.kubelet
        if not path:
            return [Result("kubelet config", WARN, "not read (--kubelet-config none): defaults are used",
                           ["cgroupfs driver, no reservations, factor 0.9 -- right only if the kubelet has the same"])]
        if not k.source:
            return [Result("kubelet config", WARN, '; '.join(k.problems) or f"{path}: not read", [
                "the shim then assumes the cgroupfs driver, no kubeReserved/systemReserved and factor 0.9;",
                "point --kubelet-config at the kubelet's --config file"])]
        out = []
        gate = {True: "on", False: "off", None: "not set (off)"}[k.memory_qos_gate]
        summary = (f"{path}: cgroupDriver {k.cgroup_driver}, kubeReserved {format_bytes(k.kube_reserved)}, "
                   f"systemReserved {format_bytes(k.system_reserved)}, memoryThrottlingFactor "
                   f"{k.memory_throttling_factor if k.memory_throttling_factor is not None else 'unset'}, "
                   f"MemoryQoS gate {gate}")
        out.append(Result("kubelet config", WARN if k.problems else PASS, summary, list(k.problems)))
        # cgroup driver: what the kubelet says against what is on disk
        on_disk, driver = self._driver()
        if on_disk is None:
            out.append(Result("cgroup driver", WARN, f"kubelet: {k.cgroup_driver}; no kubepods cgroup under "
                                                     f"{self.cfg.cgroup_root} to compare with (kubelet not started?)"))
        elif on_disk != k.cgroup_driver:
            out.append(Result("cgroup driver", FAIL, f"the kubelet config says {k.cgroup_driver}, the cgroup tree "
                                                     f"is laid out by {on_disk}", [
                "the shim and the reconciler would look for pods in the wrong place; is --kubelet-config the file",
                "the kubelet really reads?"]))
        else:
            out.append(Result("cgroup driver", PASS, f"{k.cgroup_driver}, as laid out under {self.cfg.cgroup_root}"))
        if not k.cgroups_per_qos:
            out.append(Result("cgroupsPerQOS", WARN, "false: no QoS cgroups, the reconciler has nothing to protect"))
        writes, owners, how = self._ownership()
        if writes.gate and (writes.writes_protection or writes.writes_high):
            out.append(Result("MemoryQoS gate", WARN, f"on in the kubelet ({writes.gate_reason}): it writes its own "
                                                      "memory values", [
                writes.summary(),
                "'ownership' says which values stay the kubelet's and which the shim writes; to let the shim do all,",
                "turn the gate off (featureGates: {MemoryQoS: false}) or unset memoryReservationPolicy and",
                "memoryThrottlingFactor (v1.36+)."]))
        else:
            out.append(Result("MemoryQoS gate", PASS, f"{gate} ({writes.gate_reason}): the kubelet writes no "
                                                      "memory.min / memory.low / memory.high itself"))
        details = [f"kubelet version: {how}", writes.summary()]
        details += [f"assumed: {a}" for a in writes.assumptions]
        details += owners.lines()
        kubelet_side = [w for w, who in owners.owners.items() if who == "kubelet"]
        uses_low = self.cfg.policy in (Policy.SOFT, Policy.TIERED_RESERVATION)
        low_capped = writes.gate and not writes.policy_aware and uses_low
        if low_capped:
            details.append(f"policy {self.cfg.policy.value} under a kubelet that writes memory.min itself (before "
                           "v1.36, gate on): containers get memory.low, but their pods keep memory.low 0, which "
                           "caps it: use policy Hard with this kubelet")
        out.append(Result("ownership", WARN if low_capped or (writes.version is None and writes.assumptions) else PASS,
                          ("kubelet owns " + ", ".join(kubelet_side) if kubelet_side else "the shim owns every value")
                          + f"; shim policy {self.cfg.policy.value}", details))
        # reservations and factor as the shim would use them
        try:
            capacity = read_mem_total(self.cfg.meminfo)
            node = node_facts(capacity, k, page_size=4096, allocatable=self.cfg.node_allocatable, factor=self.cfg.factor)
            from_kubelet = max(0, capacity - k.kube_reserved - k.system_reserved)
            notes = []
            verdict = PASS
            if self.cfg.node_allocatable is not None and self.cfg.node_allocatable != from_kubelet:
                verdict = WARN
                notes.append(f"--node-allocatable {format_bytes(self.cfg.node_allocatable)} differs from MemTotal - "
                             f"kubeReserved - systemReserved = {format_bytes(from_kubelet)} (the kubelet's value)")
            f = self.cfg.factor
            if isinstance(f, float) and k.memory_throttling_factor is not None and f != k.memory_throttling_factor:
                verdict = WARN
                notes.append(f"--factor {f} differs from the kubelet's memoryThrottlingFactor {k.memory_throttling_factor}")
            out.append(Result("reservations", verdict,
                              f"allocatable {format_bytes(node.allocatable)} of {format_bytes(capacity)}, "
                              f"factor {node.factor if node.factor is not None else 'none'}", notes))
        except (OSError, ValueError) as e:
            out.append(Result("reservations", FAIL, f"cannot read MemTotal from {self.cfg.meminfo}: {e}"))
        return out

    def _kubelet_processes(self) -> list[list[str]]:
        procs = []
        try:
            names = os.listdir(self.env.proc)
        except OSError:
            return procs
        for pid in names:
            if not pid.isdigit():
                continue
            comm = (_read(os.path.join(self.env.proc, pid, "comm"), 256) or "").strip()
            if comm != "kubelet":
                continue
            raw = _read(os.path.join(self.env.proc, pid, "cmdline")) or ""
            procs.append([a for a in raw.split("\x00") if a])
        return procs

    @staticmethod
    def _flag(args: list[str], flag: str) -> str | None:
        for i, a in enumerate(args):
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
            if a == flag and i + 1 < len(args):
                return args[i + 1]
        return None

    def discover_endpoint(self) -> tuple[str | None, str]:
        """(endpoint, where it was found)."""
        for args in self._kubelet_processes():
            ep = self._flag(args, "--container-runtime-endpoint")
            if ep:
                return ep, "the running kubelet's command line"
            cfg_path = self._flag(args, "--config")
            if cfg_path:
                ep = self._endpoint_in_config(cfg_path)
                if ep:
                    return ep, f"containerRuntimeEndpoint in {cfg_path} (the running kubelet's --config)"
            return None, "the running kubelet's command line (no --container-runtime-endpoint: containerd's default)"
        for f in self.env.kubelet_env_files:
            m = _ENDPOINT_FLAG.search(_read(f) or "")
            if m:
                return m.group(1), f
        for d in self.env.kubelet_unit_dirs:
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for n in names:
                m = _ENDPOINT_FLAG.search(_read(os.path.join(d, n)) or "")
                if m:
                    return m.group(1), os.path.join(d, n)
        if self.cfg.kubelet_config:
            ep = self._endpoint_in_config(self.cfg.kubelet_config)
            if ep:
                return ep, f"containerRuntimeEndpoint in {self.cfg.kubelet_config}"
        return None, ""

    @staticmethod
    def _endpoint_in_config(path: str) -> str | None:
        import yaml

        try:
            doc = yaml.safe_load(_read(path) or "")
        except yaml.YAMLError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("containerRuntimeEndpoint"), str):
            return doc["containerRuntimeEndpoint"]
        return None

    def check_kubelet_endpoint(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "kubelet endpoint"
        ep, where = self.discover_endpoint()
        listen = socket_path(self.cfg.listen)
        if ep is None:
            if where:
                return Result(name, FAIL, f"{where}", [
                    f"the kubelet talks to containerd directly; set --container-runtime-endpoint=unix://{listen}"])
            return Result(name, WARN, "not discoverable: no kubelet process, no --container-runtime-endpoint in "
                                      f"{', '.join(self.env.kubelet_env_files)} or the kubelet's unit drop-ins, no "
                                      "containerRuntimeEndpoint in the kubelet config", [
                f"make sure the kubelet runs with --container-runtime-endpoint=unix://{listen}"])
        try:
            path = socket_path(ep)
        except ValueError as e:
            return Result(name, FAIL, f"{ep!r} (from {where}) is not a unix socket endpoint: {e}")
        if os.path.realpath(path) == os.path.realpath(listen):
            return Result(name, PASS, f"{ep} (from {where}) is the shim's socket")
        try:
            upstream = socket_path(self.cfg.upstream)
        except ValueError:
            upstream = None
        if upstream and os.path.realpath(path) == os.path.realpath(upstream):
            return Result(name, FAIL, f"{ep} (from {where}) is the runtime's own socket: the shim sees nothing", [
                f"set --container-runtime-endpoint=unix://{listen} and restart the kubelet"])
        return Result(name, FAIL, f"{ep} (from {where}) is neither the shim's socket ({listen}) nor the upstream")

    # sockets
    def check_upstream(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "upstream"
        up = self.cfg.upstream
        try:
            path = socket_path(up)
        except ValueError as e:
            return Result(name, FAIL, str(e))
        if not os.path.exists(path):
            return Result(name, FAIL, f"no socket at {path}: is the runtime (containerd / CRI-O) running?")
        try:
            rname, rver, api = runtime_version(up, self.env.rpc_timeout)
        except Exception as e:
            return Result(name, FAIL, f"{up} does not answer CRI Version: {_rpc_error(e)}")
        return Result(name, PASS, f"{up} answers: {rname} {rver} (CRI {api})")

    def check_socket(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "shim socket"
        path = socket_path(self.cfg.listen)
        parent = os.path.dirname(path)
        notes = []
        verdict = PASS
        try:
            pst = os.stat(parent)
            if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
                verdict = FAIL
                notes.append(f"{parent} is world-writable without the sticky bit: anyone can replace the socket")
        except FileNotFoundError:
            return Result(name, WARN, f"{parent} does not exist: the shim is not running (it creates it at start)")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return Result(name, WARN if verdict == PASS else verdict,
                          f"no socket at {path}: the shim is not running (or listens elsewhere)", notes)
        if not stat.S_ISSOCK(st.st_mode):
            return Result(name, FAIL, f"{path} exists and is not a socket", notes)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o007:
            verdict = FAIL
            notes.append(f"mode {mode:04o} lets every user drive the runtime through the shim (root-equivalent)")
        if mode & 0o070 and not self.cfg.socket_group:
            verdict = FAIL if verdict == FAIL else WARN
            notes.append(f"mode {mode:04o} grants a group access although no --socket-group is configured")
        if st.st_uid != 0:
            verdict = FAIL if verdict == FAIL else WARN
            notes.append(f"owned by uid {st.st_uid}, not root")
        try:
            rname, rver, _ = runtime_version(self.cfg.listen, self.env.rpc_timeout)
            answer = f"answers Version through the shim: {rname} {rver}"
        except Exception as e:
            answer = f"does not answer Version: {_rpc_error(e)}"
            verdict = FAIL if verdict == FAIL else WARN
        return Result(name, verdict, f"{path} mode {mode:04o} uid {st.st_uid} gid {st.st_gid}; {answer}", notes)

    # audit, guard, metrics
    def check_audit_log(self) -> Result:
        name = "audit log"
        target = self.cfg.audit_log
        if target is None:
            return Result(name, WARN, "none: rewrites, cgroup writes and guard actions leave no record")
        if target == "-":
            return Result(name, PASS, "stdout (the journal under systemd)")
        if os.path.isdir(target):
            return Result(name, FAIL, f"{target} is a directory")
        if os.path.exists(target):
            if os.access(target, os.W_OK):
                return Result(name, PASS, f"{target} is writable")
            return Result(name, FAIL, f"{target} is not writable by uid {os.geteuid()}")
        parent = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(parent):
            return Result(name, WARN, f"{parent} does not exist (the systemd unit's LogsDirectory= creates "
                                      "/var/log/memqos-shim when it starts; otherwise the shim cannot start)")
        if os.access(parent, os.W_OK | os.X_OK):
            return Result(name, PASS, f"{target} does not exist yet; {parent} is writable")
        return Result(name, FAIL, f"{parent} is not writable by uid {os.geteuid()}: the shim cannot create {target}")

    def check_guard(self) -> Result:
        name = "memory.high guard"
        interval = self.cfg.monitor_interval
        if not interval:
            return Result(name, WARN, "off (--monitor-interval 0): crawling containers are neither relaxed nor reported")
        desc = (f"action {self.cfg.guard_action}: full avg10 >= {self.cfg.guard_threshold:g}% for "
                f"{self.cfg.guard_window:g} s at memory.high; restore after {self.cfg.guard_cooldown:g} s calm; "
                f"sampled every {interval:g} s")
        details, problems = self._guard_episodes()
        try:
            _, owners, _ = self._ownership()
        except Exception:  # the ownership check reports its own failure
            owners = None
        if owners is not None and owners.owner("container memory.high") == "kubelet" and self.cfg.guard_action == "relax":
            return Result(name, WARN, desc, [
                f"the kubelet owns container memory.high ({owners.reasons['container memory.high']}): serve's guard",
                "reports crawling containers instead of relaxing them (relaxing would fight the kubelet)"] + details)
        if self.cfg.guard_action == "none":
            return Result(name, WARN, desc, ["report only: a container past memory.high keeps crawling"] + details)
        if self.cfg.guard_window < 2 * interval:
            return Result(name, WARN, desc, ["the window is shorter than two samples: one sample decides"] + details)
        if problems:
            return Result(name, WARN, desc, problems + details)
        return Result(name, PASS, desc, details)

    def _guard_episodes(self) -> tuple[list[str], list[str]]:
        """(details, problems): where open guard episodes are kept and which are open now."""
        from shim.guard.monitor import episode_file

        try:
            episodes = episode_file(self.cfg)
        except ValueError as e:
            return [], [f"guard state: {e}"]
        if episodes is None:
            return ["episodes in memory only (--guard-state none): a restart leaves relaxed containers at max"], []
        found = episodes.load()
        details = [f"episodes kept in {episodes.path}: {len(found)} open"]
        for e in found[:10]:
            r = e.ref
            what = f"restore {e.restore_high}" if e.restore_high else "reported"
            details.append(f"  {e.mode}: {r['namespace']}/{r['pod']}/{r['container']} ({r['id'][:12]}), {what}")
        if len(found) > 10:
            details.append(f"  ... and {len(found) - 10} more")
        problems = [f"{episodes.path}: {episodes.problem}"] if episodes.problem else []
        return details, problems

    def check_metrics(self) -> Result:
        from shim.evidence.metrics import is_loopback, split_address

        addr = self.cfg.metrics_address
        if not addr:
            return Result("metrics", PASS, "off (--metrics-address not set)")
        host, _ = split_address(addr)
        if not is_loopback(host):
            return Result("metrics", WARN, f"{addr}: reachable from the network; the series name pods and containers")
        return Result("metrics", PASS, f"http://{addr}/metrics (loopback only)")


    def reclaim_file(self) -> tuple[str | None, str]:
        """(a memory.reclaim found in a non-root cgroup, or None; where it looked)."""
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        if not is_cgroup_v2(root):
            return None, f"{root} is not cgroup v2"
        places = []
        try:
            on_disk, driver = self._driver()
            from shim.effects.layout import CgroupLayout

            places.append(CgroupLayout(driver, self.kubelet.cgroup_root).kubepods)
        except Exception:  # noqa: BLE001 -- any non-root cgroup will do
            pass
        try:
            places += sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
        except OSError:
            pass
        for rel in places:
            path = os.path.join(root, rel, "memory.reclaim")
            if os.path.isfile(path):
                return path, rel
        return None, f"no non-root cgroup under {root} has memory.reclaim" if places else f"no cgroup below {root}"

    def check_reclaim(self) -> Result:
        name = "proactive reclaim"
        path, where = self.reclaim_file()
        v = kernel_version(self.env.kernel_release())
        old = v is not None and v < MIN_KERNEL_RECLAIM
        avail = f"memory.reclaim available ({path})" if path else (
            f"memory.reclaim not available: {where}" + (" (kernel older than 5.19)" if old else ""))
        if not self.cfg.reclaim:
            return Result(name, PASS, f"off (--reclaim false, the default); {avail}")
        from shim.decision.quantity import format_bytes

        c = self.cfg
        desc = (f"on: within {c.reclaim_headroom:g}% (at least {format_bytes(c.reclaim_headroom_min)}) of memory.high, "
                f"at most {format_bytes(c.reclaim_step)} per write and {format_bytes(c.reclaim_rate)}/s per container, "
                f"while PSI some avg10 < {c.reclaim_psi_some:g}%; {avail}")
        if not c.monitor_interval:
            return Result(name, WARN, desc, ["--monitor-interval 0: the monitor does not run, so neither does reclaim"])
        if path is None:
            return Result(name, WARN, desc, ["the shim will find no memory.reclaim, audit one reclaim-error and "
                                             "stop reclaiming; memory.reclaim needs cgroup v2 and a 5.19 or newer kernel"])
        return Result(name, PASS, desc)


# -- command -------------------------------------------------------------------------------
def format_results(results: list[Result], header: str = "") -> str:
    lines = [header] if header else []
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        lines.append(f"{r.verdict.upper():4}  {r.name:<{width}}  {r.summary}")
        for d in r.details:
            lines.append(f"{'':4}  {'':<{width}}    {d}")
    n = {v: sum(r.verdict == v for r in results) for v in (PASS, WARN, FAIL)}
    lines.append(f"{n[PASS]} pass, {n[WARN]} warn, {n[FAIL]} fail")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace, env: Env | None = None) -> int:
    from shim.app.config import Config, ConfigError, resolve

    note = ""
    if not getattr(args, "config", None) and os.path.isfile(DEFAULT_CONFIG):
        args.config = DEFAULT_CONFIG
    results: list[Result] = []
    try:
        cfg = resolve(args)
        note = f"config: {args.config}" if getattr(args, "config", None) else "config: built-in defaults and flags"
    except ConfigError as e:
        results.append(Result("config", FAIL, str(e), ["the checks below use the built-in defaults"]))
        cfg = Config()
        note = "config: unusable, defaults"
    try:
        results += Doctor(cfg, env).run()
    except Exception as e:  # never a traceback
        results.append(Result("doctor", FAIL, f"{e.__class__.__name__}: {e}"))
    print(format_results(results, f"memqos-shim doctor ({note})"))
    sys.stdout.flush()
    return 1 if any(r.verdict == FAIL for r in results) else 0


def register(subparsers) -> None:
    from shim.app.config import OPTIONS, add_arguments

    p = subparsers.add_parser(
        "doctor", help="check this node and the shim's setup (pass/warn/fail per check)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, OPTIONS)
    p.set_defaults(func=cmd_doctor)


