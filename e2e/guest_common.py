"""The guest's shared parts (e2e/guest.py and its scenarios): paths, logging, the report, cgroupfs,
the CRI client, the shim process, readings of cgroup files, logs and metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, CHECKOUT)

CGROOT = "/sys/fs/cgroup"
RUN = "/run/e2e"
CONTAINERD_SOCK = f"{RUN}/containerd/containerd.sock"
SHIM_SOCK = f"{RUN}/shim/memqos-shim.sock"
RUNTIME = "/runtime.v1.RuntimeService/"
CREATE_PHASE = ("RunPodSandbox", "CreateContainer", "StartContainer")
NODE_CALLS = ("Version", "Status", "ImageStatus")
REMOVE_PHASE = ("StopContainer", "StopPodSandbox", "RemoveContainer", "RemovePodSandbox")
CALL_TIMEOUT = 300.0
HOG_IMAGE = "localhost/hog:e2e"
MI = 1 << 20
T0 = time.time()


def log(msg: str) -> None:
    print(f"[guest {time.time() - T0:7.1f}s] {msg}", flush=True)


class InfraError(Exception):
    """The environment, not the shim's values: containerd, images, a replayed call failing."""


# -- report ----------------------------------------------------------------------------------
class Report:
    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, "report-guest.json")
        self.data: dict = {
            "status": "running",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "guest": {},
            "scenarios": [],
            "checks": [],
            "skipped": [],
            "errors": [],
            "timings": {},
        }
        self.lock = threading.Lock()

    def check(self, scenario: str, step: str, subject: str, file: str, expected: str, actual: str,
              why: str = "", source: str = "cgroupfs", ok: bool | None = None) -> bool:
        """One assertion. Without ``ok`` it passes when expected and actual read the same; with
        it (a bound such as "<= 13 s" against "11.2 s") the caller's verdict is recorded."""
        ok = str(expected) == str(actual) if ok is None else bool(ok)
        entry = {"scenario": scenario, "step": step, "subject": subject, "file": file,
                 "expected": str(expected), "actual": str(actual), "pass": ok, "source": source}
        if why:
            entry["why"] = why
        with self.lock:
            self.data["checks"].append(entry)
        if not ok:
            log(f"FAIL [{scenario}/{step}] {file}: expected {expected}, actual {actual} ({subject}; {why})")
        return ok

    def skip(self, scenario: str, what: str, reason: str) -> None:
        with self.lock:
            self.data["skipped"].append({"scenario": scenario, "what": what, "reason": reason})
        log(f"SKIP [{scenario}] {what}: {reason}")

    def timing(self, name: str, seconds: float) -> None:
        self.data["timings"][name] = round(seconds, 2)

    def save(self) -> None:
        checks = self.data["checks"]
        self.data["summary"] = {
            "checks": len(checks),
            "passed": sum(1 for c in checks if c["pass"]),
            "failed": sum(1 for c in checks if not c["pass"]),
            "skipped": len(self.data["skipped"]),
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


# -- cgroups and processes -------------------------------------------------------------------
def cg_read(path: str, name: str) -> str:
    try:
        with open(os.path.join(CGROOT, path.strip("/"), name)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "(no such cgroup)" if not os.path.isdir(os.path.join(CGROOT, path.strip("/"))) else "(no such file)"
    except OSError as e:
        return f"(error {e.errno}: {e.strerror})"


def cg_write(path: str, name: str, value: str) -> None:
    with open(os.path.join(CGROOT, path.strip("/"), name), "w") as f:
        f.write(value)


def setup_cgroups() -> None:
    controllers = open(os.path.join(CGROOT, "cgroup.controllers")).read().split()
    want = [c for c in ("cpu", "cpuset", "io", "memory", "pids", "hugetlb") if c in controllers]
    if "memory" not in want:
        raise InfraError(f"no memory controller in {CGROOT}/cgroup.controllers: {controllers}")
    cg_write("", "cgroup.subtree_control", " ".join("+" + c for c in want))
    for d in ("system.slice", "system.slice/containerd.service", "system.slice/memqos-shim.app.service"):
        os.makedirs(os.path.join(CGROOT, d), exist_ok=True)


def spawn(cmd: list[str], cgroup: str, log_path: str, env: dict | None = None, cwd: str | None = None):
    procs = os.path.join(CGROOT, cgroup, "cgroup.procs")

    def enter_cgroup() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        os.setsid()

    logf = open(log_path, "ab", buffering=0)
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=enter_cgroup, env=env, cwd=cwd)


def wait_for_socket(path: str, proc, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise InfraError(f"{what} exited with code {proc.returncode} before creating {path}")
        time.sleep(0.2)
    raise InfraError(f"{what}: no socket {path} after {timeout:.0f} s")


def snapshot(out: str, title: str) -> None:
    """Append memory.min/low/high/max of every cgroup under kubepods (like the traces' *.cgroups.txt)."""
    lines = [f"### {title} (t+{time.time() - T0:.1f}s)"]
    base = os.path.join(CGROOT, "kubepods")
    for root, dirs, _files in os.walk(base):
        dirs.sort()
        rel = root[len(CGROOT):]
        vals = " ".join(f"{k}={cg_read(rel, 'memory.' + k)}" for k in ("min", "low", "high", "max"))
        lines.append(f"{rel} {vals}")
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n")


def remove_cgroup_tree(rel: str) -> None:
    base = os.path.join(CGROOT, rel)
    if not os.path.isdir(base):
        return
    for root, dirs, _files in os.walk(base, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(root, d))
            except OSError as e:
                log(f"cannot remove cgroup {os.path.join(root, d)}: {e}")
    try:
        os.rmdir(base)
    except OSError as e:
        log(f"cannot remove cgroup {base}: {e}")


# -- CRI ---------------------------------------------------------------------------------------
class Cri:
    def __init__(self, sock: str):
        import grpc

        self.grpc = grpc
        self.sock = sock
        self.channel = grpc.insecure_channel(f"unix://{sock}")

    def raw(self, method: str, request: bytes, timeout: float = CALL_TIMEOUT) -> bytes:
        call = self.channel.unary_unary(method)  # identity serializers: bytes in, bytes out
        return call(request, timeout=timeout)

    def call(self, name: str, msg, service: str = "RuntimeService", timeout: float = CALL_TIMEOUT):
        from shim.cri import api_pb2 as pb

        data = self.raw(f"/runtime.v1.{service}/{name}", msg.SerializeToString(), timeout)
        return getattr(pb, name + "Response").FromString(data)

    def close(self) -> None:
        self.channel.close()


# -- the shim --------------------------------------------------------------------------------------
# the kubelet the guard and reclaim scenarios imitate (their requests carry memory.min, as the
# recorded v1.23 kubelet's do with the MemoryQoS gate on)
KUBELET_VERSION = "1.23"


class Shim:
    def __init__(self, python: str, out_logs: str, scenario: str, kubelet_config: str, meminfo: str,
                 extra: tuple[str, ...] = (), settings: dict | None = None):
        """``extra``: more flags; ``settings``: config-file keys (the tuning settings are no flags),
        written to <scenario>-config.yaml beside the logs."""
        self.python = python
        self.audit_log = os.path.join(out_logs, f"{scenario}-audit.jsonl")
        config = []
        if settings:
            path = os.path.join(out_logs, f"{scenario}-config.yaml")
            with open(path, "w") as f:
                f.write("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
            config = ["--config", path]
        self.args = [
            "--listen", f"unix://{SHIM_SOCK}",
            "--upstream", f"unix://{CONTAINERD_SOCK}",
            "--kubelet-config", kubelet_config,
            "--cgroup-root", CGROOT,
            "--meminfo", meminfo,
            "--audit-log", self.audit_log,
            *config,
            *extra,
        ]
        self.log = os.path.join(out_logs, f"{scenario}-shim.log")
        self.proc = None

    def env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = CHECKOUT
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def start(self) -> float:
        t = time.time()
        os.makedirs(os.path.dirname(SHIM_SOCK), exist_ok=True)
        with open(self.log, "a") as f:
            f.write(f"==== start t+{time.time() - T0:.1f}s: {self.python} -m shim serve {' '.join(self.args)}\n")
        self.proc = spawn([self.python, "-m", "shim", "serve", *self.args], "system.slice/memqos-shim.app.service",
                          self.log, env=self.env(), cwd=CHECKOUT)
        wait_for_socket(SHIM_SOCK, self.proc, 180, "memqos-shim")
        # The socket may be a leftover of a killed shim: wait until the new one answers.
        from shim.cri import api_pb2 as pb

        cri = Cri(SHIM_SOCK)
        deadline = time.time() + 180
        try:
            while True:
                try:
                    cri.call("Version", pb.VersionRequest(), timeout=10)
                    break
                except cri.grpc.RpcError as e:
                    if self.proc.poll() is not None:
                        raise InfraError(f"memqos-shim exited with code {self.proc.returncode}") from None
                    if time.time() > deadline:
                        raise InfraError(f"memqos-shim does not answer Version: {e.code().name}") from None
                    time.sleep(0.5)
        finally:
            cri.close()
        return time.time() - t

    def kill(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with open(self.log, "a") as f:
            f.write(f"==== stopped with signal {sig} t+{time.time() - T0:.1f}s, exit {self.proc.returncode if self.proc else None}\n")

    def run_cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, "-m", "shim", *args], capture_output=True, text=True,
                              env=self.env(), cwd=CHECKOUT, timeout=timeout)


def reconciler_available(python: str) -> tuple[bool, str]:
    """The pod/QoS/node side of the shim (another part of the project) shows by `reset`."""
    env = dict(os.environ, PYTHONPATH=CHECKOUT, PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([python, "-m", "shim", "reset", "--help"], capture_output=True, text=True,
                       env=env, cwd=CHECKOUT, timeout=300)
    return p.returncode == 0, (p.stdout if p.returncode == 0 else (p.stderr or p.stdout))[-2000:]


# -- readings: PSI, cgroup events, the hog's progress, the audit log, metrics ------------------------
def parse_pressure_full(text: str) -> dict[str, dict[str, float]]:
    """memory.pressure -> {'some': {'avg10': .., 'total': ..}, 'full': {...}} (total in µs). Own parsing, not the shim's."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in ("some", "full"):
            vals = {}
            for kv in parts[1:]:
                k, _, v = kv.partition("=")
                try:
                    vals[k] = float(v)
                except ValueError:
                    pass
            out[parts[0]] = vals
    return out


def parse_pressure(text: str) -> dict[str, float]:
    """memory.pressure -> {'some': avg10, 'full': avg10} (percent)."""
    return {kind: v["avg10"] for kind, v in parse_pressure_full(text).items() if "avg10" in v}


def sample_container(pod: dict) -> tuple[dict, dict | None]:
    """One sample of a scenario pod's container cgroup: time since the pod started,
    memory.current / high / events, and the parsed memory.pressure (None, with "gone", when the
    cgroup no longer exists)."""
    cg = pod["cg"]
    t = time.time()
    s: dict = {"t": round(t - pod["t_start"], 2), "wall": round(t, 3)}
    if not os.path.isdir(CGROOT + cg):
        s["gone"] = True
        return s, None
    cur = cg_read(cg, "memory.current")
    s["current"] = int(cur) if cur.isdigit() else None
    s["high"] = cg_read(cg, "memory.high")
    s["events"] = parse_events(cg_read(cg, "memory.events"))
    return s, parse_pressure_full(cg_read(cg, "memory.pressure"))


def parse_events(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def hog_progress(log_path: str) -> dict:
    """The last line e2e/hog.c wrote, from the container's CRI log file
    (`<time> stdout F hog: 45 MiB 3.214 s 1700000000.123`): MiB touched, seconds since it
    started, wall clock; done when it reached its target."""
    last: dict = {"mib": 0, "done": False, "lines": 0}
    try:
        with open(log_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return last
    for line in lines:
        text = line.split(" ", 3)[-1] if line.count(" ") >= 3 else line
        parts = text.split()
        if len(parts) < 6 or parts[0] != "hog:":
            continue
        last["lines"] += 1
        if parts[1] == "start":
            last["started_wall"] = float(parts[-1])
            continue
        if parts[1] == "freed":
            last["freed_wall"] = float(parts[-1])
            continue
        done = parts[1] == "done"
        try:
            mib = int(parts[2] if done else parts[1])
            last.update(mib=mib, elapsed=float(parts[-3]), wall=float(parts[-1]))
        except ValueError:
            continue
        if done:
            last["done"] = True
            last["done_wall"] = float(parts[-1])
    return last


def read_audit(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def scrape_metrics(address: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; {} when /metrics does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=20) as r:
            text = r.read().decode()
    except OSError as e:
        return {"(error)": str(e)}  # type: ignore[dict-item]
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(metrics: dict, name: str, **labels: str) -> float | None:
    """The value of one series, matched on the given labels (others ignored)."""
    for key, value in metrics.items():
        if key.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return None


def load_manifests(directory: str) -> dict:
    import yaml

    out = {}
    if directory and os.path.isdir(directory):
        for fn in sorted(os.listdir(directory)):
            if fn.endswith((".yaml", ".yml")):
                with open(os.path.join(directory, fn)) as f:
                    doc = yaml.safe_load(f)
                out[doc["metadata"]["name"]] = doc
    return out


def pids_named(comm: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if open(f"/proc/{pid}/comm").read().strip() == comm:
                    out.append(int(pid))
            except OSError:
                pass
    return out


def remove_every_pod(cri: "Cri", report: "Report", what: str, timeout: float) -> None:
    """Stop and remove every pod the runtime has, each on its own (one stuck pod does not keep
    the others); a pod the runtime cannot remove within `timeout` is recorded as a runtime hang."""
    from shim.cri import api_pb2 as pb

    try:
        sandboxes = cri.call("ListPodSandbox", pb.ListPodSandboxRequest()).items
    except Exception as e:  # noqa: BLE001
        log(f"{what}: {e}")
        return
    for sb in sandboxes:
        try:
            stop_gently(cri, sb.id)
        except Exception:  # noqa: BLE001
            pass
        for attempt in (1, 2):  # under TCG containerd may need minutes to get over a shim's slow exit
            try:
                cri.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=timeout)
                cri.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=timeout)
                break
            except Exception as e:  # noqa: BLE001
                line = f"{what}: sandbox {sb.id[:12]} ({sb.metadata.name}) not removed in {timeout:g} s: {e}"
                if attempt == 1:
                    log(f"{line[:300]}; asking once more")
                    continue
                report.data.setdefault("runtime_hangs", []).append(line[:300])
                log(line[:300])


def stop_gently(cri: "Cri", sandbox_id: str, grace: int = 10) -> None:
    """StopContainer (SIGTERM, then SIGKILL after `grace` s) for each container of a pod that is
    not exited, before the pod's StopPodSandbox: what the kubelet does. StopPodSandbox alone
    SIGKILLs running containers at once; with the runc of Debian trixie and sid unpacked here
    (stacks 1.7 and 2.x) the task delete that follows such a kill sometimes never completes
    (docs/testing.md, "Stack matrix"); every container of the suite exits on SIGTERM (busybox with a TERM
    trap, e2e/hog.c)."""
    from shim.cri import api_pb2 as pb

    flt = pb.ContainerFilter(pod_sandbox_id=sandbox_id)
    for c in cri.call("ListContainers", pb.ListContainersRequest(filter=flt), timeout=60).containers:
        if c.state != pb.CONTAINER_EXITED:
            cri.call("StopContainer", pb.StopContainerRequest(container_id=c.id, timeout=grace), timeout=grace + 90)


def dump_processes(path: str, title: str) -> None:
    """For a call that hangs: every process with its state, kernel wait channel, cgroup and
    command line, the kernel stack of those in D state or of the runtime (runc, shims); then
    SIGUSR1 to containerd and its shims, which makes them log their goroutine stacks
    (containerd.log)."""
    lines = [f"### {title} (t+{time.time() - T0:.1f}s)"]
    signalled = []
    for pid in sorted((int(p) for p in os.listdir("/proc") if p.isdigit())):
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            state = stat[0]
            hz = os.sysconf("SC_CLK_TCK")
            uptime = float(open("/proc/uptime").read().split()[0])
            age = f"age={uptime - int(stat[19]) / hz:.1f}s cpu={(int(stat[11]) + int(stat[12])) / hz:.1f}s"
            wchan = open(f"/proc/{pid}/wchan").read().strip()
            cgroup = open(f"/proc/{pid}/cgroup").read().strip().split("::", 1)[-1]
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            continue
        lines.append(f"{pid} {state} {comm} {age} wchan={wchan} cgroup={cgroup} {cmd}")
        if state == "D" or comm.startswith(("runc", "containerd")):
            try:
                lines.append("    " + open(f"/proc/{pid}/stack").read().strip().replace("\n", "\n    "))
            except OSError as e:
                lines.append(f"    (no kernel stack: {e})")
        if comm.startswith("containerd"):
            try:
                os.kill(pid, signal.SIGUSR1)
                signalled.append(pid)
            except OSError:
                pass
    lines.append(f"SIGUSR1 (goroutine dump into containerd.log) sent to {signalled}")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    log(f"{title}: processes dumped to {path}")
