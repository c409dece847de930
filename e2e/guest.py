#!/usr/bin/env python3
"""Guest side of the real-kernel suite: runs as root inside the virtme-ng VM (cgroup v2).

Started by scripts/e2e-vm with the checkout's .venv python. It
  1. enables the cgroup controllers, starts containerd (root/state on tmpfs) in
     /system.slice/containerd.service and imports the local images;
  2. per scenario (one recorded kubelet trace each): starts the shim from the checkout in
     /system.slice/memqos-shim.app.service in front of containerd, replays the kubelet's own
     requests (ImageStatus, RunPodSandbox, CreateContainer, StartContainer, later StopContainer,
     StopPodSandbox, RemoveContainer, RemovePodSandbox) through the shim's socket with the
     recorded ids mapped to the new ones, and reads back /sys/fs/cgroup after each step:
     created, updated (UpdateContainerResources), pods removed, shim killed with SIGKILL,
     shim restarted, `memqos-shim reset`;
  3. with --guard, the PSI guard scenario (GuardScenario): a container running e2e/hog.c
     crawls at memory.high; with --guard-action none it is still near memory.high after the
     guard's window, with relax its memory.high becomes max within window + one interval and it
     completes or is OOM-killed at memory.max;
  3b. with --reclaim, the proactive reclaim scenario (ReclaimScenario): a page-cache reader
     without and with --reclaim, one after the other and side by side, plus the anon hog;
  4. writes OUT/report-guest.json (every asserted file with expected and actual value; the
     guard's timings under "guard", the reclaim tables under "reclaim") and the logs (containerd, shim, audit, cgroup snapshots,
     guard-timeline.jsonl) under OUT/logs.

Expected values come from e2e/expect.py (own arithmetic, not the shim's). Exit code:
0 all checks passed, 1 a check failed, 3 infrastructure error (containerd, images, shim
would not start...): the host tells these apart from a boot failure by the report's presence.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, CHECKOUT)

import expect as X  # noqa: E402  (e2e/expect.py: independent arithmetic)
import protection as P  # noqa: E402  (e2e/protection.py: the sampling check)

sys.modules.setdefault("guest", sys.modules[__name__])  # e2e/nri_scenario.py imports this module

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


def substitute_ids(msg, idmap: dict[str, str]) -> int:
    """Replace every string field (also repeated and map values) equal to a recorded id."""
    from google.protobuf.descriptor import FieldDescriptor as F

    n = 0
    for fd, value in msg.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == F.LABEL_REPEATED
        if fd.type == F.TYPE_STRING:
            if repeated:
                for i, v in enumerate(value):
                    if v in idmap:
                        value[i] = idmap[v]
                        n += 1
            elif value in idmap:
                setattr(msg, fd.name, idmap[value])
                n += 1
        elif fd.type == F.TYPE_MESSAGE:
            if fd.message_type.GetOptions().map_entry:
                vfield = fd.message_type.fields_by_name["value"]
                for k in list(value.keys()):
                    if vfield.type == F.TYPE_STRING and value[k] in idmap:
                        value[k] = idmap[value[k]]
                        n += 1
                    elif vfield.type == F.TYPE_MESSAGE:
                        n += substitute_ids(value[k], idmap)
            elif repeated:
                for m in value:
                    n += substitute_ids(m, idmap)
            else:
                n += substitute_ids(value, idmap)
    return n


# -- the trace ---------------------------------------------------------------------------------
def short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class Trace:
    def __init__(self, path: str):
        from shim.cri import api_pb2 as pb
        from shim.evidence.trace import open_text

        self.path = path
        with open_text(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        self.header = lines[0]
        if self.header.get("format") != "cri-trace":
            raise InfraError(f"{path}: not a cri-trace file")
        self.calls = sorted(lines[1:], key=lambda c: c["start"])
        self.pod_of_sandbox: dict[str, str] = {}
        self.pod_of_container: dict[str, str] = {}
        self.creates: list[tuple[dict, object, str]] = []  # (call, request, recorded container id)
        for c in self.calls:
            m = short(c["method"])
            if c["code"] != "OK" or not c["method"].startswith("/runtime.v1."):
                continue
            if m == "RunPodSandbox":
                req = pb.RunPodSandboxRequest.FromString(base64.b64decode(c["request"]))
                resp = pb.RunPodSandboxResponse.FromString(base64.b64decode(c["responses"][0]))
                self.pod_of_sandbox[resp.pod_sandbox_id] = req.config.metadata.uid
            elif m == "CreateContainer":
                req = pb.CreateContainerRequest.FromString(base64.b64decode(c["request"]))
                resp = pb.CreateContainerResponse.FromString(base64.b64decode(c["responses"][0]))
                self.pod_of_container[resp.container_id] = req.sandbox_config.metadata.uid
                self.creates.append((c, req, resp.container_id))

    def pod_of_call(self, c: dict, req) -> str | None:
        m = short(c["method"])
        if m == "RunPodSandbox":
            return req.config.metadata.uid
        if m == "CreateContainer":
            return req.sandbox_config.metadata.uid
        if hasattr(req, "container_id") and req.container_id:
            return self.pod_of_container.get(req.container_id)
        if hasattr(req, "pod_sandbox_id") and req.pod_sandbox_id:
            return self.pod_of_sandbox.get(req.pod_sandbox_id)
        return None

    def removal_start(self) -> float:
        starts = [c["start"] for c in self.calls if short(c["method"]) in REMOVE_PHASE]
        return min(starts) if starts else float("inf")


class Replayer:
    """Sends recorded requests through the shim with the recorded ids mapped to the new ones."""

    def __init__(self, cri: Cri, trace: Trace, report: Report, scenario: str):
        self.cri = cri
        self.trace = trace
        self.report = report
        self.scenario = scenario
        self.idmap: dict[str, str] = {}
        self.lock = threading.Lock()
        self.sent: list[dict] = []
        self.after_call = None  # (method, request, response) -> None, in the pod's worker thread
        self.before_call = None  # (method, request) -> None, in the pod's worker thread, before sending
        self.gate = contextlib.nullcontext()  # held around each call (protection.CallGate pauses them)
        # added to every pod's and container's metadata.attempt: a pod of an earlier phase that the
        # runtime could not remove (report["runtime_hangs"]) keeps its sandbox name reserved, and
        # the kubelet's next attempt of the same pod is what gets a new name
        self.attempt = 0

    def _prepare_host(self, name: str, req) -> None:
        """Create what the kubelet had created on its node before the call: the pod log
        directory and the sources of the container's bind mounts (termination-log files)."""
        if name == "RunPodSandbox" and req.config.log_directory:
            os.makedirs(req.config.log_directory, exist_ok=True)
        if name == "CreateContainer":
            if req.sandbox_config.log_directory:
                os.makedirs(os.path.join(req.sandbox_config.log_directory, req.config.metadata.name), exist_ok=True)
            for m in req.config.mounts:
                if not m.host_path or os.path.exists(m.host_path):
                    continue
                if m.container_path in ("/dev/termination-log", "/etc/hosts", "/etc/resolv.conf", "/etc/hostname"):
                    os.makedirs(os.path.dirname(m.host_path), exist_ok=True)
                    open(m.host_path, "a").close()
                else:
                    os.makedirs(m.host_path, exist_ok=True)

    def replay(self, c: dict):
        from shim.cri import api_pb2 as pb

        name = short(c["method"])
        req = getattr(pb, name + "Request").FromString(base64.b64decode(c["request"]))
        with self.lock:
            idmap = dict(self.idmap)
        mapped = substitute_ids(req, idmap)
        if self.attempt:
            if name == "RunPodSandbox":
                req.config.metadata.attempt += self.attempt
            elif name == "CreateContainer":
                req.sandbox_config.metadata.attempt += self.attempt
                req.config.metadata.attempt += self.attempt
        self._prepare_host(name, req)
        if self.before_call is not None:
            self.before_call(name, req)
        t = time.time()
        try:
            with self.gate:
                data = self.cri.raw(c["method"], req.SerializeToString())
        except self.cri.grpc.RpcError as e:
            raise InfraError(f"replayed {name} (trace seq {c['seq']}) failed: {e.code().name}: {e.details()}") from None
        resp = getattr(pb, name + "Response").FromString(data)
        dt = time.time() - t
        learned = {}
        if c["responses"]:
            rec = getattr(pb, name + "Response").FromString(base64.b64decode(c["responses"][0]))
            if name == "RunPodSandbox":
                learned[rec.pod_sandbox_id] = resp.pod_sandbox_id
            elif name == "CreateContainer":
                learned[rec.container_id] = resp.container_id
            elif name == "ImageStatus" and rec.image.id and resp.image.id:
                learned[rec.image.id] = resp.image.id
        with self.lock:
            self.idmap.update(learned)
            self.sent.append({"seq": c["seq"], "method": name, "ids_mapped": mapped, "seconds": round(dt, 2),
                              "learned": learned})
        if self.after_call is not None:
            self.after_call(name, req, resp)
        return req, resp

    def run_phase(self, calls: list[dict], title: str) -> list[tuple[dict, object, object]]:
        """Node-level calls first (in order, once per distinct request), then every pod's calls in
        their recorded order, pods concurrently (as the kubelet's pod workers do)."""
        from shim.cri import api_pb2 as pb

        t = time.time()
        done: list[tuple[dict, object, object]] = []
        per_pod: dict[str, list[dict]] = {}
        seen = set()
        for c in calls:
            name = short(c["method"])
            if name in NODE_CALLS:
                if c["request"] in seen:
                    continue
                seen.add(c["request"])
                req, resp = self.replay(c)
                done.append((c, req, resp))
                continue
            req = getattr(pb, name + "Request").FromString(base64.b64decode(c["request"]))
            pod = self.trace.pod_of_call(c, req) or "?"
            per_pod.setdefault(pod, []).append(c)

        def worker(pod_calls: list[dict]):
            return [(c, *self.replay(c)) for c in pod_calls]

        with ThreadPoolExecutor(max_workers=max(1, len(per_pod))) as pool:
            for result in pool.map(worker, per_pod.values()):
                done.extend(result)
        log(f"{self.scenario}: replayed {len(done)} calls ({title}) in {time.time() - t:.1f}s")
        self.report.timing(f"{self.scenario}:replay-{title}", time.time() - t)
        return done


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


# -- the model of what should be on the node ---------------------------------------------------------
class Model:
    """Pods and containers as created from the trace, with their expectations."""

    def __init__(self, trace: Trace, node: X.Node, manifests: dict):
        self.trace = trace
        self.node = node
        self.manifests = manifests
        self.pods: dict[str, dict] = {}  # uid -> {name, qos, parent, sandbox, containers: {new id: {...}}}

    def add_sandbox(self, req, resp) -> None:
        meta = req.config.metadata
        parent = req.config.linux.cgroup_parent
        case = req.config.labels.get("case") or meta.name
        self.pods[meta.uid] = {"name": meta.name, "case": case, "qos": X.qos_from_cgroup_parent(parent),
                               "parent": parent, "sandbox": resp.pod_sandbox_id, "containers": {},
                               "removed": False}

    def add_container(self, req, resp) -> dict:
        pod = self.pods[req.sandbox_config.metadata.uid]
        r = req.config.linux.resources
        name = req.config.metadata.name
        manifest = self.manifests.get(pod["case"], {})
        spec = manifest.get("spec", {})
        init_names = {c["name"] for c in spec.get("initContainers", []) or []}
        truth = {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            if c["name"] == name:
                truth = (c.get("resources") or {})
        true_req = X.quantity((truth.get("requests") or {}).get("memory")) or \
            X.quantity((truth.get("limits") or {}).get("memory"))
        facts = {"limit": r.memory_limit_in_bytes, "oom_score_adj": r.oom_score_adj, "unified": dict(r.unified)}
        exp = X.container_expectation(pod["qos"], facts["limit"], facts["oom_score_adj"], facts["unified"], self.node)
        entry = {"name": name, "id": resp.container_id, "init": name in init_names, "facts": facts,
                 "resources": r, "exp": exp, "true_request": true_req}
        pod["containers"][resp.container_id] = entry
        return entry

    def live_pods(self) -> dict:
        return {uid: p for uid, p in self.pods.items() if not p["removed"]}

    def pod_request(self, pod: dict) -> int:
        regular = [c["exp"].request.bytes for c in pod["containers"].values() if not c["init"]]
        init = [c["exp"].request.bytes for c in pod["containers"].values() if c["init"]]
        return X.pod_request(regular, init) if pod["qos"] != X.BESTEFFORT else 0


# -- a scenario -------------------------------------------------------------------------------------------
class Scenario:
    def __init__(self, args, report: Report, trace_path: str, name: str, reconciler: tuple[bool, str]):
        self.args = args
        self.report = report
        self.name = name
        self.trace = Trace(trace_path)
        self.node = X.Node.from_trace_header(self.trace.header)
        self.logs = os.path.join(args.out, "logs")
        self.snap = os.path.join(self.logs, f"{name}-cgroups.txt")
        self.reconciler, self.reconciler_help = reconciler
        self.manifests = load_manifests(args.manifests)
        self.model = Model(self.trace, self.node, self.manifests)
        work = os.path.join(RUN, name)
        os.makedirs(work, exist_ok=True)
        kc = os.path.join(work, "kubelet-config.yaml")
        with open(kc, "w") as f:  # JSON is YAML
            json.dump(self.trace.header["node"]["kubelet_config"], f)
        meminfo = os.path.join(work, "meminfo")
        with open(meminfo, "w") as f:
            # The recorded oom_score_adj values were computed by the kubelet from this node's
            # capacity; the shim must decode them with the same capacity (the guest has less).
            f.write(f"MemTotal: {self.node.capacity // 1024} kB\n")
        self.kubelet_config = kc
        self.shim = Shim(args.python, self.logs, name, kc, meminfo)
        self.shim_cri: Cri | None = None
        self.replayer: Replayer | None = None
        self.started_init: dict[str, bool] = {}
        self.direct = Cri(CONTAINERD_SOCK)
        self.on_running = None  # () -> None, once the created containers run (main's stack check)
        self.on_created = None  # (scenario) -> None, after the "created" step's checks (the NRI scenario's table)
        self.protection: P.Protection | None = None

    # -- checks ---------------------------------------------------------------------------------
    def check_container(self, step: str, pod: dict, c: dict, exp: X.ContainerExpectation | None = None) -> None:
        exp = exp or c["exp"]
        page = self.node.page
        subject = f"{pod['name']}/{c['name']} ({pod['qos']})"
        why = "; ".join(f"{k}: {v}" for k, v in exp.why.items())
        if c["true_request"]:
            why += f"; true request {c['true_request']} (manifest)"
        cg = f"{pod['parent']}/{c['id']}"
        if c["init"]:
            self.check_init(step, pod, c, exp, subject, why)
            return
        for key, value in (("memory.min", exp.min), ("memory.high", exp.high), ("memory.max", exp.max)):
            # memory.min 0 reads "0"; an unset memory.high / memory.max reads "max"
            want = "0" if key == "memory.min" and not value else X.kernel_reads(value, page)
            self.report.check(self.name, step, subject, f"{CGROOT}{cg}/{key}", want, cg_read(cg, key), why)

    def check_init(self, step, pod, c, exp, subject, why) -> None:
        """An init container runs `true` and its cgroup is gone when it exits: read what
        containerd gave runc (the OCI spec's unified map) and that the container exited 0."""
        from shim.cri import api_pb2 as pb

        st = self.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=c["id"], verbose=True))
        info = json.loads(st.info.get("info", "{}"))
        res = ((info.get("runtimeSpec") or {}).get("linux") or {}).get("resources") or {}
        unified = res.get("unified") or {}
        mem_limit = (res.get("memory") or {}).get("limit")
        src = "containerd runtime spec (cgroup removed after exit)"
        base = f"runtimeSpec {pod['parent']}/{c['id']} linux.resources"
        self.report.check(self.name, step, subject, f"{base}.unified[memory.min]",
                          str(exp.min) if exp.min else "(absent)", unified.get("memory.min", "(absent)"), why, src)
        self.report.check(self.name, step, subject, f"{base}.unified[memory.high]",
                          str(exp.high) if exp.high else "(absent)", unified.get("memory.high", "(absent)"), why, src)
        self.report.check(self.name, step, subject, f"{base}.memory.limit",
                          str(exp.max) if exp.max else "(absent)", str(mem_limit) if mem_limit else "(absent)", why, src)
        self.report.check(self.name, step, subject, f"ContainerStatus {c['id']} state/exit_code",
                          "CONTAINER_EXITED/0", f"{pb.ContainerState.Name(st.status.state)}/{st.status.exit_code}",
                          "init container ran with these values", "CRI ContainerStatus")

    def check_sandboxes(self, step: str, gone_ok: bool = False) -> None:
        """Each sandbox cgroup untouched. ``gone_ok``: after a runtime restart, a sandbox cgroup the
        runtime no longer has is noted (report["sandboxes_gone"]), not checked: it holds no value
        of the shim's, and its pod's containers are still checked."""
        for pod in self.model.live_pods().values():
            cg = f"{pod['parent']}/{pod['sandbox']}"
            if gone_ok and not os.path.isdir(os.path.join(CGROOT, cg.strip("/"))):
                self.report.data.setdefault("sandboxes_gone", []).append({"step": step, "cgroup": cg})
                log(f"{self.name}: {step}: {pod['name']} sandbox cgroup {cg} is gone (the runtime's restart)")
                continue
            for key, want in (("memory.min", "0"), ("memory.high", "max")):
                self.report.check(self.name, step, f"{pod['name']} sandbox", f"{CGROOT}{cg}/{key}", want,
                                  cg_read(cg, key), "the shim does not touch RunPodSandbox")

    def pod_level_expectations(self) -> list[tuple[str, str, str, str]]:
        """(cgroup path, expected read-back, subject, why) for pod, QoS and node cgroups."""
        page = self.node.page
        out = []
        sums = {X.BURSTABLE: 0, X.GUARANTEED: 0}
        for pod in self.model.live_pods().values():
            req = self.model.pod_request(pod)
            parts = ", ".join(f"{c['name']}{'(init)' if c['init'] else ''}={c['exp'].request.bytes}"
                              for c in pod["containers"].values())
            out.append((pod["parent"], X.kernel_reads(req, page), f"pod {pod['name']} ({pod['qos']})",
                        f"pod request max(sum regular, each init): {parts}"))
            if pod["qos"] in sums:
                sums[pod["qos"]] += req
        out.append(("/kubepods/burstable", X.kernel_reads(sums[X.BURSTABLE], page), "burstable QoS cgroup",
                    f"sum of Burstable pod requests = {sums[X.BURSTABLE]}"))
        out.append(("/kubepods/besteffort", "0", "besteffort QoS cgroup", "BestEffort pods have no requests"))
        total = sums[X.BURSTABLE] + sums[X.GUARANTEED]
        out.append(("/kubepods", X.kernel_reads(total, page), "kubepods (node allocatable)",
                    f"Guaranteed {sums[X.GUARANTEED]} + Burstable {sums[X.BURSTABLE]} = {total}"))
        return out

    def check_pod_level(self, step: str, settle: float | None = None) -> None:
        wanted = self.pod_level_expectations()
        if not self.reconciler:
            seen = "; ".join(f"{path}: expected {want}, reads {cg_read(path, 'memory.min')}" for path, want, *_ in wanted)
            self.report.skip(self.name, f"{step}: pod/burstable/kubepods memory.min",
                             "the checkout has no `memqos-shim reset` (`python -m shim reset --help` fails), so "
                             f"the pod/QoS/node side is not taken as present; not asserted: {seen}")
            return
        deadline = time.time() + (self.args.settle if settle is None else settle)
        while True:  # the reconciler works asynchronously: give it time to converge
            actual = [cg_read(path, "memory.min") for path, *_ in wanted]
            if all(a == w[1] for a, w in zip(actual, wanted)) or time.time() > deadline:
                break
            time.sleep(0.5)
        for (path, want, subject, why), got in zip(wanted, actual):
            self.report.check(self.name, step, subject, f"{CGROOT}{path}/memory.min", want, got, why)

    def check_all(self, step: str, settle: float | None = None, sandboxes_may_go: bool = False) -> None:
        for pod in self.model.live_pods().values():
            for c in pod["containers"].values():
                self.check_container(step, pod, c, c.get("current_exp"))
        self.check_sandboxes(step, gone_ok=sandboxes_may_go)
        self.check_pod_level(step, settle)
        snapshot(self.snap, f"{self.name}: {step}")
        if self.protection:
            self.protection.sampler.phase = f"after '{step}'"

    # -- steps -------------------------------------------------------------------------------------
    def wait_containers(self) -> None:
        from shim.cri import api_pb2 as pb

        deadline = time.time() + 240
        pending = {c["id"]: c for p in self.model.pods.values() for c in p["containers"].values()}
        while pending and time.time() < deadline:
            for cid, c in list(pending.items()):
                st = self.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid)).status
                want = pb.CONTAINER_EXITED if c["init"] else pb.CONTAINER_RUNNING
                if st.state == want:
                    del pending[cid]
                elif st.state == pb.CONTAINER_EXITED and not c["init"]:
                    raise InfraError(f"container {c['name']} {cid[:12]} exited ({st.exit_code}): {st.reason} {st.message}")
            time.sleep(0.5)
        if pending:
            raise InfraError(f"containers not in their expected state after 240 s: {[c['name'] for c in pending.values()]}")


    def update_limit(self, pod: dict, c: dict, new_limit: int):
        """A kubelet-shaped UpdateContainerResources (what an in-place resize sends: the
        container's whole LinuxContainerResources as at creation, with the new limit).
        Kubelet 1.23 of the traces never sends one, so this request is built here."""
        from shim.cri import api_pb2 as pb

        res = pb.LinuxContainerResources()
        res.CopyFrom(c["resources"])
        res.memory_limit_in_bytes = new_limit
        self.shim_cri.call("UpdateContainerResources",
                           pb.UpdateContainerResourcesRequest(container_id=c["id"], linux=res))
        return X.container_expectation(pod["qos"], new_limit, res.oom_score_adj, dict(res.unified), self.node)

    def kubelet_waits(self, method: str, req, resp) -> None:
        """What the kubelet's pod worker does between the recorded calls: it creates a pod's next
        container only after the init container it started has exited (successfully). The replay
        keeps that order, or the runtime would see the next container created while the init
        container still runs, which the kubelet never does."""
        from shim.cri import api_pb2 as pb

        if method == "CreateContainer":
            case = req.sandbox_config.labels.get("case") or req.sandbox_config.metadata.name
            spec = self.manifests.get(case, {}).get("spec", {})
            inits = {c["name"] for c in spec.get("initContainers") or []}
            with self.replayer.lock:
                self.started_init[resp.container_id] = req.config.metadata.name in inits
        elif method == "StartContainer" and self.started_init.get(req.container_id):
            deadline = time.time() + 240
            while time.time() < deadline:
                st = self.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=req.container_id)).status
                if st.state == pb.CONTAINER_EXITED:
                    if st.exit_code != 0:
                        raise InfraError(f"init container {req.container_id[:12]} exited {st.exit_code}")
                    return
                time.sleep(0.2)
            raise InfraError(f"init container {req.container_id[:12]} still running after 240 s")

    def find(self, case: str, container: str) -> tuple[dict, dict]:
        for pod in self.model.pods.values():
            if pod["case"] == case:
                for c in pod["containers"].values():
                    if c["name"] == container:
                        return pod, c
        raise InfraError(f"no container {case}/{container} in the replayed trace")

    def reconnect(self) -> None:
        if self.shim_cri:
            self.shim_cri.close()
        self.shim_cri = Cri(SHIM_SOCK)
        self.replayer.cri = self.shim_cri

    def run(self) -> None:
        rep, name = self.report, self.name
        t_all = time.time()
        rep.data["scenarios"].append({"name": name, "trace": self.trace.path,
                                      "node": {"capacity": self.node.capacity, "allocatable": self.node.allocatable,
                                               "page": self.node.page, "factor": self.node.factor},
                                      "reconciler": self.reconciler})
        if os.sysconf("SC_PAGE_SIZE") != self.node.page:
            raise InfraError(f"guest page size {os.sysconf('SC_PAGE_SIZE')} != trace's {self.node.page}")
        dt = self.shim.start()
        rep.timing(f"{name}:shim-start", dt)
        log(f"{name}: shim serving after {dt:.1f}s")
        self.shim_cri = Cri(SHIM_SOCK)
        self.replayer = Replayer(self.shim_cri, self.trace, rep, name)
        self.replayer.after_call = self.kubelet_waits
        if rep.data.get("runtime_hangs"):
            self.replayer.attempt = 1
            log(f"{name}: pods of an earlier phase were not removed (runtime hang): replayed as the kubelet's "
                "next attempt (metadata.attempt + 1) so their sandbox names stay free")
        self.protection = P.Protection(self)  # samples pod/QoS/node values from here until reset

        # 1. created: the kubelet's own calls up to its first Stop/Remove
        boundary = self.trace.removal_start()
        calls = [c for c in self.trace.calls if c["code"] == "OK" and c["method"].startswith("/runtime.v1.")
                 and short(c["method"]) in NODE_CALLS + CREATE_PHASE and c["start"] < boundary]
        done = sorted(self.replayer.run_phase(calls, "create"), key=lambda t: t[0]["start"])
        for c, req, resp in done:
            if short(c["method"]) == "RunPodSandbox":
                self.model.add_sandbox(req, resp)
        for c, req, resp in done:
            if short(c["method"]) == "CreateContainer":
                self.model.add_container(req, resp)
        self.wait_containers()
        if self.on_running:
            self.on_running()
        self.check_all("created")
        if self.on_created:
            self.on_created(self)
        self.doctor()

        # 2. updated: raise one Burstable container's limit, then check every value again
        pod, c = self.find("qos-burstable-limit", "main")
        old_limit = c["facts"]["limit"]
        c["current_exp"] = self.update_limit(pod, c, old_limit * 2)
        self.check_all("updated")

        # 3. removed: the kubelet's own Stop/Remove calls for qos-besteffort and multi
        calls = [c2 for c2 in self.trace.calls if c2["code"] == "OK" and c2["method"].startswith("/runtime.v1.")
                 and short(c2["method"]) in REMOVE_PHASE]
        removed = []
        for c2, req, _resp in self.replayer.run_phase(calls, "remove"):
            if short(c2["method"]) == "RemovePodSandbox":
                uid = self.trace.pod_of_sandbox.get(self._recorded_id(req.pod_sandbox_id))
                if uid in self.model.pods:
                    self.model.pods[uid]["removed"] = True
                    removed.append(self.model.pods[uid])
        for p in removed:
            for c2 in p["containers"].values():
                cg = f"{p['parent']}/{c2['id']}"
                self.report.check(name, "removed", f"{p['name']}/{c2['name']}", f"{CGROOT}{cg}",
                                  "absent", "present" if os.path.isdir(CGROOT + cg) else "absent",
                                  "container removed by the replayed RemoveContainer", "cgroupfs")
            left = cg_read(p["parent"], "memory.min")
            rep.data.setdefault("observations", []).append(
                f"{name}: removed pod {p['name']}: pod cgroup {p['parent']} "
                f"{'still exists, memory.min=' + left if os.path.isdir(CGROOT + p['parent']) else 'is gone'}"
                " (runc leaves the pod cgroup; the kubelet removes it in production)")
        self.check_all("removed")

        # 4. kill -9 of the shim: nothing it wrote may revert while it is down ...
        self.shim.kill(signal.SIGKILL)
        self.check_all("shim killed (SIGKILL)", settle=0)
        # ... and a restarted shim has the same values. The kernel keeps them anyway, so zero some
        # while the shim is down: the restarted shim must rebuild them from the runtime alone.
        # (Not with the MemoryQoS-on trace: there the kubelet owns these values, not the shim.)
        if self.reconciler and not self.protection.kubelet_writes:
            drifted = [pod["parent"] for pod in self.model.live_pods().values() if pod["qos"] == X.BURSTABLE][:1]
            with self.protection.external(drifted + ["/kubepods/burstable"]):
                for path in drifted + ["/kubepods/burstable"]:
                    cg_write(path, "memory.min", "0")
            rep.data.setdefault("observations", []).append(
                f"{name}: wrote memory.min=0 to {drifted + ['/kubepods/burstable']} while the shim was down")
        dt = self.shim.start()
        rep.timing(f"{name}:shim-restart", dt)
        self.reconnect()
        self.check_all("shim restarted")
        # an update after the restart: the shim has to work without its memory of the creation
        c["current_exp"] = self.update_limit(pod, c, old_limit)
        self.check_all("updated after restart")

        # 5. reset: the shim stopped, `memqos-shim reset` puts pod/QoS/node memory.min back to 0
        self.protection.finish()
        self.reset()
        rep.timing(f"{name}:total", time.time() - t_all)

    def doctor(self) -> None:
        """`memqos-shim doctor` on a real cgroup v2 node with the shim and containerd running:
        its verdicts for this node go in the report, its output in logs/<scenario>-doctor.txt."""
        r = self.shim.run_cli("doctor", *self.shim.args, timeout=300)
        path = os.path.join(self.logs, f"{self.name}-doctor.txt")
        with open(path, "w") as f:
            f.write(r.stdout + r.stderr + f"\nexit code {r.returncode}\n")
        verdicts = {}
        for line in r.stdout.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[0] in ("PASS", "WARN", "FAIL"):
                check = parts[1][:18].strip()
                verdicts[check] = parts[0]
        self.report.data.setdefault("doctor", {})[self.name] = {"exit_code": r.returncode, "verdicts": verdicts}
        for check in ("cgroup v2", "memory controller", "kernel", "upstream", "shim socket", "audit log"):
            self.report.check(self.name, "doctor", f"memqos-shim doctor: {check}", path, "PASS",
                              verdicts.get(check, "missing"), why="a cgroup v2 node with containerd and the shim running")
        gate = bool((self.trace.header["node"]["kubelet_config"].get("featureGates") or {}).get("MemoryQoS"))
        self.report.check(self.name, "doctor", "memqos-shim doctor: MemoryQoS gate", path, "WARN" if gate else "PASS",
                          verdicts.get("MemoryQoS gate", "missing"),
                          why=f"the trace's kubelet ran with the MemoryQoS gate {'on: it would fight the shim' if gate else 'off'}")
        self.report.check(self.name, "doctor", "memqos-shim doctor exit code", path, "0", str(r.returncode),
                          why="no FAIL verdict on this node")
        log(f"{self.name}: doctor exit {r.returncode}: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()))

    def _recorded_id(self, new_id: str) -> str:
        for old, new in self.replayer.idmap.items():
            if new == new_id:
                return old
        return new_id

    def reset(self) -> None:
        if not self.reconciler:
            self.report.skip(self.name, "reset: pod/burstable/kubepods memory.min back to 0",
                             "the checkout has no `memqos-shim reset` yet")
            return
        self.shim.kill(signal.SIGTERM)
        targets = [(pod["parent"], f"pod {pod['name']}") for pod in self.model.live_pods().values()]
        targets += [("/kubepods/burstable", "burstable QoS cgroup"), ("/kubepods/besteffort", "besteffort QoS cgroup"),
                    ("/kubepods", "kubepods (node allocatable)")]
        # a kubelet with the MemoryQoS gate on (before v1.36) writes memory.min = request at pod, QoS
        # and kubepods level itself: reset leaves those values (zeroing them would fight the kubelet)
        kubelet_writes = bool((self.trace.header["node"]["kubelet_config"].get("featureGates") or {}).get("MemoryQoS"))
        before = {path: cg_read(path, "memory.min") for path, _ in targets}
        helptext = self.reconciler_help
        args = ["reset"]
        for flag, value in (("--cgroup-root", CGROOT), ("--kubelet-config", self.kubelet_config)):
            if flag in helptext:
                args += [flag, value]
        p = self.shim.run_cli(*args)
        with open(os.path.join(self.logs, f"{self.name}-reset.log"), "w") as f:
            f.write(f"$ memqos-shim {' '.join(args)}\nexit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
        self.report.check(self.name, "reset", "memqos-shim reset", "exit code", "0", str(p.returncode),
                          (p.stderr or "")[-300:], "process")
        if kubelet_writes:
            said = "the kubelet writes the pod / QoS / node values itself" in (p.stderr or "")
            self.report.check(self.name, "reset", "memqos-shim reset", "stderr", "says the kubelet's values stay",
                              "says the kubelet's values stay" if said else (p.stderr or "")[-200:],
                              "reset names who keeps the values it leaves", "process")
        for path, subject in targets:
            if kubelet_writes:
                self.report.check(self.name, "reset", subject, f"{CGROOT}{path}/memory.min", before[path],
                                  cg_read(path, "memory.min"), "the trace's kubelet (MemoryQoS gate on, before v1.36) "
                                  "writes memory.min = request here itself: reset leaves it")
            else:
                self.report.check(self.name, "reset", subject, f"{CGROOT}{path}/memory.min", "0",
                                  cg_read(path, "memory.min"), "reset writes 0 where the shim wrote memory.min")
        snapshot(self.snap, f"{self.name}: reset")

    def teardown(self) -> None:
        """Stop the shim, remove every pod straight through containerd, remove the kubepods tree:
        the next scenario starts on a clean node."""
        if self.protection:
            self.protection.finish()
        if self.shim.proc and self.shim.proc.poll() is None:
            self.shim.kill(signal.SIGTERM)
        if self.shim_cri:
            self.shim_cri.close()
        remove_every_pod(self.direct, self.report, f"{self.name} teardown", timeout=120)
        remove_cgroup_tree("kubepods")
        self.direct.close()


# -- the PSI guard on a real kernel ---------------------------------------------------------------
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


class GuardScenario:
    """The memory.high crawl on a real kernel, without and with the PSI guard.

    A Burstable container with request 16Mi and limit 96Mi on a node whose kubelet sets
    memoryThrottlingFactor 0.25 gets memory.high = 16Mi + (96Mi - 16Mi) * 0.25 = 36Mi (computed
    by e2e/expect.py), memory.max 96Mi. It runs e2e/hog.c, which touches 1 MiB every 50 ms;
    there is no swap in the guest, so past memory.high the kernel can only make it sleep.

    * control: shim with --guard-action none. The hog (target 160 MiB, above the limit) crawls:
      after the guard's window it is still near memory.high, far below memory.max; memory.events
      `high` climbs, PSI full avg10 is high, the shim audits `guard-report` and memory.high
      stays as computed.
    * guard: a new shim with --guard-action relax, two pods at once: the same hog (target above
      the limit) and one with a target below the limit (80 MiB). Within window + one interval
      (+ margin) of the crawl the shim audits `guard-relax` and memory.high reads `max`; then
      the first is OOM-killed at memory.max (memory.events oom_kill, ContainerStatus
      OOMKilled/137) and the second completes.
    * restart: that shim is killed -9 with the second still relaxed; a new shim resumes the
      episode from the episode file, the hog frees its memory (SIGUSR1) and the new shim
      restores the computed memory.high after the cool-down.

    Timings (crawl detection, relaxation, hog progress, crawl rate) go to the report
    (report["guard"]) and logs/guard-timeline.jsonl (every 0.25 s sample).
    """

    REQUEST, LIMIT, FACTOR = 16 * MI, 96 * MI, 0.25
    # MiB, MiB, ms between MiB steps: at 50 ms the relaxed hog needs >= 3 s from memory.high to
    # memory.max, so the guest's 0.25 s samples see memory.high `max` before the OOM kill
    TARGET_OOM, TARGET_COMPLETE, STEP_MS = 160, 80, 50
    POLL = 0.25  # s between the guest's own samples

    def __init__(self, args, report: Report):
        self.args = args
        self.on_running = None  # () -> None, once the first pod runs (main's stack check)
        self.report = report
        self.name = "guard"
        self.interval = args.guard_interval
        self.window = args.guard_window
        self.cooldown = args.guard_cooldown
        self.threshold = args.guard_threshold
        self.slack = args.guard_slack
        self.logs = os.path.join(args.out, "logs")
        self.timeline = os.path.join(self.logs, "guard-timeline.jsonl")
        self.work = os.path.join(RUN, "guard")
        os.makedirs(self.work, exist_ok=True)
        capacity = int(open("/proc/meminfo").readline().split()[1]) * 1024
        self.node = X.Node(capacity=capacity, page=os.sysconf("SC_PAGE_SIZE"), factor=self.FACTOR)
        self.kubelet_config = os.path.join(self.work, "kubelet-config.json")
        with open(self.kubelet_config, "w") as f:  # JSON is YAML
            json.dump({"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
                       "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/",
                       "featureGates": {"MemoryQoS": True}, "memoryThrottlingFactor": self.FACTOR}, f)
        self.exp = X.container_expectation(X.BURSTABLE, self.LIMIT, self.oom_score_adj(),
                                           {"memory.min": str(self.REQUEST)}, self.node)
        self.high = int(X.kernel_reads(self.exp.high, self.node.page))
        self.at_high = self.high - max(self.high * 2 // 100, MI)  # "at memory.high": within 2 %, >= 1 MiB
        self.shim: Shim | None = None
        self.cri: Cri | None = None
        self.direct = Cri(CONTAINERD_SOCK)
        self.summary: list[str] = []
        self.data: dict = {
            "settings": {"monitor_interval": self.interval, "window": self.window, "cooldown": self.cooldown,
                         "threshold": self.threshold, "slack": self.slack, "poll": self.POLL},
            "container": {"request": self.REQUEST, "limit": self.LIMIT, "factor": self.FACTOR,
                          "memory.high": self.high, "why": self.exp.why, "step_ms": self.STEP_MS},
            "phases": {},
        }
        report.data["guard"] = self.data

    def oom_score_adj(self) -> int:
        adj = 1000 - (1000 * self.REQUEST) // self.node.capacity  # the kubelet's Burstable formula
        return min(max(adj, 3), 999)

    @property
    def deadline(self) -> float:
        """Seconds from t_hot the guard may take: window + one interval + slack (see run())."""
        return self.window + self.interval + self.slack

    def note(self, line: str) -> None:
        self.summary.append(line)
        self.data["summary"] = self.summary
        log(f"guard: {line}")

    def check(self, step: str, subject: str, file: str, expected, actual, why: str = "", source: str = "cgroupfs",
              ok: bool | None = None) -> bool:
        return self.report.check(self.name, step, subject, file, str(expected), str(actual), why, source, ok)

    # -- the shim and the pods
    def start_shim(self, phase: str, action: str, port: int) -> None:
        # the pods' requests are a v1.23 kubelet's with the MemoryQoS gate on (memory.min in unified,
        # as in the recorded memqos-on trace): the shim owns every container value (docs/memory-qos.md)
        extra = ("--kubelet-version", KUBELET_VERSION, "--monitor-interval", f"{self.interval:g}", "--guard-action", action,
                 "--metrics-address", f"127.0.0.1:{port}")
        settings = {"guard-threshold": self.threshold, "guard-window": self.window, "guard-cooldown": self.cooldown}
        self.shim = Shim(self.args.python, self.logs, f"guard-{phase}", self.kubelet_config, "/proc/meminfo", extra,
                         settings)
        self.metrics_address = f"127.0.0.1:{port}"
        dt = self.shim.start()
        self.report.timing(f"guard-{phase}:shim-start", dt)
        log(f"guard-{phase}: shim (guard action {action}) serving after {dt:.1f}s")
        self.cri = Cri(SHIM_SOCK)

    def stop_shim(self, sig: int = signal.SIGTERM) -> None:
        if self.cri:
            self.cri.close()
            self.cri = None
        if self.shim and self.shim.proc and self.shim.proc.poll() is None:
            self.shim.kill(sig)

    def create_pod(self, name: str, target_mib: int) -> dict:
        """RunPodSandbox, CreateContainer, StartContainer through the shim, shaped like the
        kubelet's (host network, Burstable cgroup parent, MemoryQoS-style memory.min)."""
        import uuid

        from shim.cri import api_pb2 as pb

        uid = uuid.uuid4().hex
        parent = f"/kubepods/burstable/pod{uid}"
        logdir = os.path.join(self.work, "pods", f"default_{name}_{uid}")
        os.makedirs(os.path.join(logdir, "hog"), exist_ok=True)
        sb = pb.PodSandboxConfig()
        sb.metadata.name, sb.metadata.uid, sb.metadata.namespace = name, uid, "default"
        sb.log_directory = logdir
        sb.labels.update({"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": "default",
                          "io.kubernetes.pod.uid": uid, "app": "memqos-guard-e2e"})
        sb.linux.cgroup_parent = parent
        sb.linux.security_context.namespace_options.network = pb.NODE
        sb.linux.security_context.namespace_options.pid = pb.CONTAINER
        sandbox_id = self.cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sb)).pod_sandbox_id
        req = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id)
        req.sandbox_config.CopyFrom(sb)
        c = req.config
        c.metadata.name = "hog"
        c.image.image = HOG_IMAGE
        c.args.extend([str(target_mib), str(self.STEP_MS), "sleep"])
        c.log_path = "hog/0.log"
        c.labels.update({"io.kubernetes.container.name": "hog", "io.kubernetes.pod.name": name,
                         "io.kubernetes.pod.namespace": "default", "io.kubernetes.pod.uid": uid})
        r = c.linux.resources
        r.cpu_period, r.cpu_shares = 100000, 2
        r.memory_limit_in_bytes = self.LIMIT
        r.oom_score_adj = self.oom_score_adj()
        r.unified["memory.min"] = str(self.REQUEST)  # a kubelet with MemoryQoS on sends the request
        c.linux.security_context.namespace_options.network = pb.NODE
        c.linux.security_context.namespace_options.pid = pb.CONTAINER
        cid = self.cri.call("CreateContainer", req).container_id
        self.cri.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        t = time.time()
        log(f"guard: pod {name} started ({cid[:12]}, hog target {target_mib} MiB)")
        return {"name": name, "uid": uid, "sandbox": sandbox_id, "id": cid, "parent": parent,
                "cg": f"{parent}/{cid}", "log": os.path.join(logdir, "hog", "0.log"), "target": target_mib,
                "t_start": t, "samples": [], "finished": False, "status": None}

    def remove_pod(self, pod: dict) -> None:
        from shim.cri import api_pb2 as pb

        cri = self.cri or self.direct
        # a removal that takes over a minute (seconds on a sound runtime) leaves a process dump
        # and the runtime's goroutine stacks in the logs, taken while it still hangs
        timers = [threading.Timer(t, dump_processes, (os.path.join(self.logs, "processes.txt"),
                                                      f"guard: removal of {pod['name']} takes over {t} s"))
                  for t in (60, 90)]
        for timer in timers:
            timer.start()
        try:
            stop_gently(cri, pod["sandbox"])
            cri.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod["sandbox"]), timeout=150)
            cri.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod["sandbox"]), timeout=150)
        except cri.grpc.RpcError as e:
            # Not an assertion of the suite: the pod is only removed to leave a clean node for
            # the next phase, whose pods are new ones. A runtime that cannot remove it (seen with
            # containerd 2.1 + runc 1.3: its `runc kill --all` on the task's delete outlives
            # containerd's 10 s event timeout again and again) is recorded and shown, not hidden.
            what = (f"guard: StopPodSandbox/RemovePodSandbox of {pod['name']} ({pod['sandbox'][:12]}) did not "
                    f"finish in 150 s: {e.code().name}; the phase goes on beside the stuck pod (see processes.txt, "
                    "containerd.log)")
            self.report.data.setdefault("runtime_hangs", []).append(what)
            log(what)
        finally:
            for timer in timers:
                timer.cancel()

    def status(self, pod: dict):
        from shim.cri import api_pb2 as pb

        return self.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=pod["id"])).status

    # -- watching
    def sample(self, pod: dict, phase: str) -> dict:
        s, p = sample_container(pod)
        if p is not None:
            s["full"], s["some"] = p.get("full", {}).get("avg10"), p.get("some", {}).get("avg10")
        s["pod_events"] = parse_events(cg_read(pod["parent"], "memory.events"))
        hog = hog_progress(pod["log"])
        s["hog_mib"], s["hog_done"] = hog["mib"], hog["done"]
        pod["hog"] = hog
        pod["samples"].append(s)
        with open(self.timeline, "a") as f:
            f.write(json.dumps({"phase": phase, "pod": pod["name"], **s}) + "\n")
        return s

    def first(self, pod: dict, pred) -> dict | None:
        return next((s for s in pod["samples"] if pred(s)), None)

    def is_at_high(self, s: dict) -> bool:
        return s.get("current") is not None and s["current"] >= self.at_high and s.get("high") != "max"

    def is_hot(self, s: dict) -> bool:
        return self.is_at_high(s) and s.get("full") is not None and s["full"] >= self.threshold

    def audit(self, pod: dict, event: str) -> dict | None:
        return next((r for r in read_audit(self.shim.audit_log)
                     if r.get("event") == event and r.get("container_id") == pod["id"]), None)

    def watch(self, phase: str, pods: list[dict], finished, limit: float) -> None:
        """Sample every pod each POLL seconds until finished(pod, sample) holds for all of them
        or `limit` seconds passed."""
        deadline = time.time() + limit
        last_status = 0.0
        while time.time() < deadline and not all(p["finished"] for p in pods):
            poll_status = time.time() - last_status >= 1.0
            if poll_status:
                last_status = time.time()
            for p in pods:
                if p["finished"]:
                    continue
                s = self.sample(p, phase)
                if poll_status or s.get("gone"):
                    st = self.status(p)
                    p["status"] = st
                    s["state"] = st.state
                if finished(p, s):
                    p["finished"] = True
            time.sleep(self.POLL)
        for p in pods:
            if not p["finished"]:
                p["timed_out"] = True
                log(f"guard: {phase}/{p['name']} not finished after {limit:.0f}s")

    # -- timings
    def timings(self, pod: dict, action: dict | None) -> dict:
        """Times in seconds since StartContainer returned (t 0): at memory.high, hot (PSI full
        avg10 >= threshold at memory.high: the crawl as the guard defines it), the shim's action."""
        t0 = pod["t_start"]
        at_high, hot = self.first(pod, self.is_at_high), self.first(pod, self.is_hot)
        out: dict = {"at_high": at_high and at_high["t"], "hot": hot and hot["t"],
                     "full_avg10_max": max((s["full"] for s in pod["samples"] if s.get("full") is not None),
                                           default=None)}
        if action:
            out["action"] = round(action["time"] - t0, 2)
            if hot:
                out["action_after_hot"] = round(action["time"] - hot["wall"], 2)
            if at_high:
                out["action_after_at_high"] = round(action["time"] - at_high["wall"], 2)
        pod["timings"] = out
        return out

    def sample_at(self, pod: dict, wall: float) -> dict | None:
        """The last sample taken at or before `wall`."""
        before = [s for s in pod["samples"] if s["wall"] <= wall]
        return before[-1] if before else None

    # -- the two phases
    def control(self) -> None:
        step = "control (guard action none)"
        self.start_shim("control", "none", 19464)
        pod = self.create_pod("guard-control", self.TARGET_OOM)
        if self.on_running:
            self.on_running()
        report_rec: dict = {}

        def finished(p: dict, s: dict) -> bool:
            if not report_rec:
                rec = self.audit(p, "guard-report")
                if rec:
                    report_rec.update(rec)
                    log(f"guard: control: guard-report after {rec['time'] - p['t_start']:.1f}s")
            # keep watching for five more intervals past the report: the crawl goes on
            return bool(report_rec) and time.time() >= report_rec["time"] + 5 * self.interval

        self.watch("control", [pod], finished, 150)
        metrics = scrape_metrics(self.metrics_address)
        end = pod["samples"][-1]
        tm = self.timings(pod, report_rec or None)
        hot = self.first(pod, self.is_hot)
        subject = f"{pod['name']}/hog (request 16Mi, limit 96Mi, hog target {pod['target']} MiB)"
        cg = f"{CGROOT}{pod['cg']}"
        self.check(step, subject, f"{cg}/memory.high (at creation: first sample)", self.high,
                   pod["samples"][0].get("high"), "; ".join(f"{k}: {v}" for k, v in self.exp.why.items()))
        self.check(step, subject, f"{cg}/memory.max", X.kernel_reads(self.LIMIT, self.node.page),
                   cg_read(pod["cg"], "memory.max"), "the limit")
        self.check(step, subject, f"{cg}/memory.pressure full avg10 >= threshold while at memory.high",
                   f">= {self.threshold:g}% at some sample", f"max {tm['full_avg10_max']}% "
                   f"({'first at t+' + str(hot['t']) + 's' if hot else 'never with memory.current at memory.high'})",
                   "the crawl as the guard defines it: PSI full avg10 >= threshold, memory.current at memory.high",
                   ok=hot is not None)
        self.check(step, subject, f"{self.shim.audit_log}: guard-report for {pod['id'][:12]}",
                   f"<= {self.deadline:g} s after the crawl began", f"{tm.get('action_after_hot')} s"
                   if report_rec else "no guard-report record",
                   f"window {self.window:g} + interval {self.interval:g} + slack {self.slack:g}", "audit log",
                   ok=bool(report_rec) and hot is not None and tm["action_after_hot"] <= self.deadline)
        relax = self.audit(pod, "guard-relax")
        self.check(step, subject, f"{self.shim.audit_log}: guard-relax for {pod['id'][:12]}", "none",
                   "none" if relax is None else "present", "guard action none writes nothing", "audit log")
        self.check(step, subject, f"{cg}/memory.high (end)", self.high, end.get("high"),
                   "guard action none: memory.high unchanged")
        # far below memory.max: closer to memory.high than to memory.max, and the hog short of its target
        mid = (self.high + self.LIMIT) // 2
        cur = end.get("current")
        self.check(step, subject, f"{cg}/memory.current (end)",
                   f">= {self.at_high} (at memory.high) and < {mid} (halfway memory.high..memory.max)",
                   cur, f"{(cur or 0) / MI:.1f} MiB = {100 * (cur or 0) / self.LIMIT:.0f}% of memory.max, "
                   f"{(end['wall'] - hot['wall']) if hot else 0:.1f} s after the crawl began",
                   ok=cur is not None and self.at_high <= cur < mid)
        self.check(step, subject, f"{pod['log']}: hog progress (end)", f"< {pod['target']} MiB (not done)",
                   f"{end['hog_mib']} MiB", "the hog crawls", "container log", ok=not end["hog_done"])
        if hot:
            ev0, ev1 = hot["events"].get("high", 0), end.get("events", {}).get("high", 0)
            self.check(step, subject, f"{cg}/memory.events high (crawl start -> end)", f"> {ev0}", ev1,
                       "the kernel keeps throttling at memory.high", ok=ev1 > ev0)
            dt = end["wall"] - hot["wall"]
            rate = ((cur or 0) - hot["current"]) / MI / dt if dt > 0 else None
            hog_rate = (end["hog_mib"] - hot["hog_mib"]) / dt if dt > 0 else None
            at_high = self.first(pod, self.is_at_high)
            dt_high = end["wall"] - at_high["wall"]
            tm.update(over_high_seconds=round(dt_high, 2),
                      over_high_rate_mib_s=round(((cur or 0) - at_high["current"]) / MI / dt_high, 3))
            tm.update(crawl_seconds=round(dt, 2), crawl_rate_mib_s=rate and round(rate, 3),
                      hog_rate_mib_s=hog_rate and round(hog_rate, 3),
                      current_at_hot=hot["current"], current_end=cur, hog_mib_at_hot=hot["hog_mib"],
                      hog_mib_end=end["hog_mib"], events_high_at_hot=ev0, events_high_end=ev1)
            if rate and rate > 0:
                tm["projected_seconds_to_memory_max"] = round((self.LIMIT - (cur or 0)) / MI / rate)
        m_full = metric(metrics, "memqos_container_memory_pressure_avg10_ratio", container_id=pod["id"], kind="full")
        m_report = metric(metrics, "memqos_guard_actions_total", action="report")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_guard_actions_total{{action=report}}",
                   "1.0", m_report, "counted from the audit stream", "metrics")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics "
                   f"memqos_container_memory_pressure_avg10_ratio{{kind=full,container_id={pod['id'][:12]}}}",
                   f">= {self.threshold / 100:g}", m_full, "the monitor's last sample", "metrics",
                   ok=m_full is not None and m_full >= self.threshold / 100)
        self.data["phases"]["control"] = {
            "pod": pod["id"], "timings": tm, "report_record": report_rec or None,
            "metrics": {"full_avg10_ratio": m_full, "guard_actions_report": m_report,
                        "monitor_sample_duration_seconds": metric(metrics, "memqos_monitor_sample_duration_seconds")}}
        self.note(f"control (action none): memory.high {self.high / MI:.0f} MiB reached at t+{tm['at_high']}s, "
                  f"crawl (full avg10 >= {self.threshold:g}%) from t+{tm['hot']}s, guard-report "
                  f"{tm.get('action_after_hot')}s later; over {tm.get('crawl_seconds')}s of crawl memory.current "
                  f"{(tm.get('current_at_hot') or 0) / MI:.1f} -> {(cur or 0) / MI:.1f} MiB "
                  f"({tm.get('crawl_rate_mib_s')} MiB/s; hog {tm.get('hog_mib_at_hot')} -> {tm.get('hog_mib_end')} MiB), "
                  f"full avg10 max {tm['full_avg10_max']}%; at that rate memory.max is "
                  f"{tm.get('projected_seconds_to_memory_max')}s away")
        self.remove_pod(pod)
        self.stop_shim()

    def guard(self) -> None:
        step = "guard (action relax)"
        self.start_shim("relax", "relax", 19465)
        oom = self.create_pod("guard-oom", self.TARGET_OOM)
        done = self.create_pod("guard-complete", self.TARGET_COMPLETE)
        relaxed: dict[str, dict] = {}

        def finished(p: dict, s: dict) -> bool:
            if p["id"] not in relaxed:
                rec = self.audit(p, "guard-relax")
                if rec:
                    relaxed[p["id"]] = rec
                    log(f"guard: relax of {p['name']} after {rec['time'] - p['t_start']:.1f}s")
            if p is oom:
                st = p["status"]
                from shim.cri import api_pb2 as pb

                return st is not None and st.state == pb.CONTAINER_EXITED
            return p["id"] in relaxed and s["hog_done"] and s.get("high") == "max"

        self.watch("guard", [oom, done], finished, 180)
        metrics = scrape_metrics(self.metrics_address)
        phase: dict = {"metrics": {}}
        for pod in (oom, done):
            rec = relaxed.get(pod["id"])
            tm = self.timings(pod, rec)
            hot = self.first(pod, self.is_hot)
            subject = f"{pod['name']}/hog (request 16Mi, limit 96Mi, hog target {pod['target']} MiB)"
            cg = f"{CGROOT}{pod['cg']}"
            self.check(step, subject, f"{cg}/memory.high (at creation: first sample)", self.high,
                       pod["samples"][0].get("high"), "; ".join(f"{k}: {v}" for k, v in self.exp.why.items()))
            self.check(step, subject, f"{cg}/memory.pressure full avg10 >= threshold while at memory.high",
                       f">= {self.threshold:g}% at some sample", f"max {tm['full_avg10_max']}% "
                       f"({'first at t+' + str(hot['t']) + 's' if hot else 'never with memory.current at memory.high'})",
                       "the crawl as the guard defines it", ok=hot is not None)
            self.check(step, subject, f"{self.shim.audit_log}: guard-relax for {pod['id'][:12]}",
                       f"<= {self.deadline:g} s after the crawl began",
                       f"{tm.get('action_after_hot')} s" if rec else "no guard-relax record",
                       f"window {self.window:g} + interval {self.interval:g} + slack {self.slack:g}", "audit log",
                       ok=bool(rec) and hot is not None and tm["action_after_hot"] <= self.deadline)
            self.check(step, subject, f"{self.shim.audit_log}: guard-relax old -> new", f"{self.high} -> max",
                       f"{rec.get('old')} -> {rec.get('new')}" if rec else "no record", "compare-and-write of memory.high",
                       "audit log")
            after = [s for s in pod["samples"] if rec and s["wall"] >= rec["time"] and not s.get("gone")]
            self.check(step, subject, f"{cg}/memory.high (first sample after guard-relax)", "max",
                       after[0].get("high") if after else "(no sample before the cgroup went away)",
                       f"read {after[0]['wall'] - rec['time']:.2f} s after the record" if after else "")
            at_relax = self.sample_at(pod, rec["time"]) if rec else None
            if at_relax:
                tm.update(current_at_relax=at_relax.get("current"), hog_mib_at_relax=at_relax["hog_mib"])
            if hot and rec:
                dt = rec["time"] - hot["wall"]
                tm["crawl_rate_mib_s"] = round(((at_relax or hot).get("current", 0) - hot["current"]) / MI / dt, 3) \
                    if dt > 0 and (at_relax or hot).get("current") is not None else None
            if pod is oom:
                self.check_oom(step, subject, pod, rec, tm)
            else:
                self.check_complete(step, subject, pod, rec, tm)
            phase[pod["name"]] = {"pod": pod["id"], "timings": tm, "relax_record": rec}
            phase["metrics"][pod["name"]] = {
                "memory_high_bytes": metric(metrics, "memqos_container_memory_high_bytes", container_id=pod["id"]),
                "guard_relaxed": metric(metrics, "memqos_container_guard_relaxed", container_id=pod["id"])}
        m_relax = metric(metrics, "memqos_guard_actions_total", action="relax")
        phase["metrics"]["guard_actions_relax"] = m_relax
        phase["metrics"]["monitor_sample_duration_seconds"] = metric(metrics, "memqos_monitor_sample_duration_seconds")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_guard_actions_total{{action=relax}}",
                   "2.0", m_relax, "one relaxation per crawling container", "metrics")
        m_high = phase["metrics"]["guard-complete"]["memory_high_bytes"]
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_container_memory_high_bytes"
                   f"{{container_id={done['id'][:12]}}}", "inf", m_high, "memory.high max shows as +Inf", "metrics")
        self.data["phases"]["guard"] = phase
        self.relaxed_pods = (oom, done)
        self.stop_shim(signal.SIGKILL)  # the restart phase takes over from a shim that had no say

    def restart(self) -> None:
        """The guard phase's shim was killed (-9) with guard-complete relaxed (memory.high max, its
        hog holding 80 MiB). A new shim resumes the episode from the episode file; the hog gives
        its memory back (SIGUSR1); after the cool-down of calm the new shim restores the computed
        memory.high -- a restore on a real kernel, by a shim that did not relax it."""
        step = "restart (guard episode resumed by a new shim)"
        oom, done = self.relaxed_pods
        subject = f"{done['name']}/hog (relaxed by the previous shim, hog holding {done['target']} MiB)"
        cg = f"{CGROOT}{done['cg']}"
        episodes = os.path.join(os.path.dirname(SHIM_SOCK), "guard-episodes.json")
        try:
            saved = json.load(open(episodes))["episodes"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            saved = []
            log(f"guard: restart: {episodes}: {e}")
        entry = next((e for e in saved if e.get("ref", {}).get("id") == done["id"]), None)
        self.check(step, subject, f"{episodes} (after kill -9)", f"relaxed, restore_high {self.high}",
                   f"{entry['mode']}, restore_high {entry['restore_high']}" if entry else "no entry",
                   "written by the guard phase's shim when it relaxed the container", "episode file")
        self.check(step, subject, f"{cg}/memory.high (before the new shim)", "max", cg_read(done["cg"], "memory.high"),
                   "nobody restored it while no shim ran")
        self.start_shim("restart", "relax", 19466)
        t_shim = time.time()
        pids = [int(x) for x in cg_read(done["cg"], "cgroup.procs").split()]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        t_free = time.time()
        log(f"guard: restart: new shim up, SIGUSR1 to the hog ({pids}): it gives its memory back")
        restored: dict = {}

        def finished(p: dict, s: dict) -> bool:
            if not restored:
                rec = self.audit(p, "guard-restore")
                if rec:
                    restored.update(rec)
            return bool(restored) and s.get("high") not in (None, "max")

        limit = self.cooldown + 4 * self.interval + self.slack + 30
        done["finished"] = False  # watched again, from the guard phase's end
        done.pop("timed_out", None)
        self.watch("restart", [done], finished, limit)
        resume = self.audit(done, "guard-resume")
        self.check(step, subject, f"{self.shim.audit_log}: guard-resume for {done['id'][:12]}",
                   f"mode relaxed, restore_high {self.high}",
                   f"mode {resume.get('mode')}, restore_high {resume.get('restore_high')}" if resume else "no record",
                   "the new shim took the episode over", "audit log")
        gone = self.audit(oom, "guard-resume")
        self.check(step, f"{oom['name']}/hog (OOM-killed: its cgroup is gone)",
                   f"{self.shim.audit_log}: guard-resume for {oom['id'][:12]}", "none",
                   "none" if gone is None else "present", "an episode of a container that is gone is dropped",
                   "audit log")
        freed = (done.get("hog") or {}).get("freed_wall")
        # calm began: the first sample after the resume and the free that meets the guard's own
        # calm condition (PSI full avg10 below half the threshold -- avg10 still decays from the
        # crawl for several seconds -- and memory.current below memory.high minus the margin)
        start = max(resume["time"] if resume else t_shim, freed or t_free)
        calm = next((x for x in done["samples"] if x["wall"] >= start and x.get("full") is not None
                     and x["full"] < self.threshold / 2 and x.get("current") is not None
                     and x["current"] < self.at_high), None)
        calm_from = calm["wall"] if calm else start
        after = round(restored["time"] - calm_from, 2) if restored else None
        bound = self.cooldown + 2 * self.interval + self.slack
        self.check(step, subject, f"{self.shim.audit_log}: guard-restore for {done['id'][:12]}",
                   f"{self.cooldown - self.interval:g} s .. {bound:g} s after calm began "
                   f"({round(calm_from - start, 2) if calm else 'never'} s after resume and free)",
                   f"{after} s, old {restored.get('old')} -> new {restored.get('new')}" if restored else "no record",
                   f"cool-down {self.cooldown:g} restarted by the new shim + 2 intervals + slack {self.slack:g}",
                   "audit log", ok=bool(restored) and self.cooldown - self.interval <= after <= bound
                   and restored.get("old") == "max" and restored.get("new") == str(self.high))
        end = done["samples"][-1] if done["samples"] else {}
        self.check(step, subject, f"{cg}/memory.high (after guard-restore)", self.high, end.get("high"),
                   "the computed value, written back by the new shim")
        self.check(step, subject, f"{cg}/memory.current (after SIGUSR1)", f"< {self.at_high}", end.get("current"),
                   "the hog gave its memory back: calm", ok=end.get("current") is not None
                   and end["current"] < self.at_high)
        left = json.load(open(episodes))["episodes"] if os.path.exists(episodes) else []
        self.check(step, subject, f"{episodes} (after the restore)", "no episode", f"{len(left)} episode(s)",
                   "the episode is over", "episode file", ok=not left)
        self.data["phases"]["restart"] = {"pod": done["id"], "resume_record": resume, "restore_record": restored or None,
                                          "restore_after_calm": after, "freed_wall": freed,
                                          "calm_after_resume_and_free": calm and round(calm_from - start, 2)}
        self.note(f"restart: the relaxing shim killed -9; a new shim resumed the episode of {done['name']} "
                  f"(guard-resume, restore_high {self.high / MI:.0f} MiB), the hog freed its memory, and the new "
                  f"shim restored memory.high {after}s after calm began (cool-down {self.cooldown:g}s)")
        self.stop_shim()

    def check_oom(self, step: str, subject: str, pod: dict, rec: dict | None, tm: dict) -> None:
        """Relaxed, the hog runs into memory.max: the kernel OOM-kills it. Its cgroup goes away
        with the task (containerd deletes it on exit), so oom_kill is read from the pod cgroup
        (memory.events is hierarchical) and, when a sample caught it, from the container's."""
        st = self.status(pod)
        pod["status"] = st
        from shim.cri import api_pb2 as pb

        pod_events = parse_events(cg_read(pod["parent"], "memory.events"))
        self.check(step, subject, f"{CGROOT}{pod['parent']}/memory.events oom_kill (pod: hierarchical)", ">= 1",
                   pod_events.get("oom_kill"), "killed at memory.max", ok=(pod_events.get("oom_kill") or 0) >= 1)
        seen = [s["events"].get("oom_kill", 0) for s in pod["samples"] if s.get("events")]
        self.check(step, subject, f"ContainerStatus {pod['id'][:12]} state/exit_code/reason",
                   "CONTAINER_EXITED/137/OOMKilled",
                   f"{pb.ContainerState.Name(st.state)}/{st.exit_code}/{st.reason}", "the runtime saw the OOM kill",
                   "CRI ContainerStatus")
        hog = pod.get("hog") or {}
        last = hog.get("mib", 0)
        limit_mib = self.LIMIT // MI
        self.check(step, subject, f"{pod['log']}: last MiB touched", f"> {self.high // MI} and <= {limit_mib}",
                   f"{last} MiB", "past memory.high once relaxed, never past memory.max", "container log",
                   ok=self.high // MI < last <= limit_mib)
        exited = self.first(pod, lambda s: s.get("state") == pb.CONTAINER_EXITED or s.get("gone"))
        tm.update(container_oom_kill_seen=max(seen, default=None), pod_oom_kill=pod_events.get("oom_kill"),
                  hog_mib_last=last, exit_code=st.exit_code, reason=st.reason,
                  gone_or_exited=exited and exited["t"])
        if rec and hog.get("wall"):
            tm["last_step_after_relax"] = round(hog["wall"] - rec["time"], 2)
        self.note(f"{pod['name']} (target {pod['target']} MiB > limit): memory.high reached at t+{tm['at_high']}s, "
                  f"crawl from t+{tm['hot']}s, guard-relax {tm.get('action_after_hot')}s later "
                  f"(memory.current {(tm.get('current_at_relax') or 0) / MI:.1f} MiB, hog at "
                  f"{tm.get('hog_mib_at_relax')} MiB, crawl {tm.get('crawl_rate_mib_s')} MiB/s); then the hog reached "
                  f"{last} MiB {tm.get('last_step_after_relax')}s after the relax and was OOM-killed "
                  f"(exit {st.exit_code} {st.reason}, pod memory.events oom_kill {pod_events.get('oom_kill')})")

    def check_complete(self, step: str, subject: str, pod: dict, rec: dict | None, tm: dict) -> None:
        hog = pod.get("hog") or {}
        end = pod["samples"][-1]
        cg = f"{CGROOT}{pod['cg']}"
        self.check(step, subject, f"{pod['log']}: hog done", f"done {pod['target']} MiB",
                   f"{'done' if hog.get('done') else 'not done'} {hog.get('mib')} MiB", "the target fits below memory.max",
                   "container log", ok=hog.get("done") and hog.get("mib") == pod["target"])
        cur = end.get("current")
        self.check(step, subject, f"{cg}/memory.current (after done)",
                   f">= {pod['target'] * MI} and <= {self.LIMIT}", cur, "the hog's memory is charged in full",
                   ok=cur is not None and pod["target"] * MI <= cur <= self.LIMIT)
        self.check(step, subject, f"{cg}/memory.events oom_kill", "0", end.get("events", {}).get("oom_kill"),
                   "completed below memory.max")
        st = self.status(pod)
        from shim.cri import api_pb2 as pb

        self.check(step, subject, f"ContainerStatus {pod['id'][:12]} state", "CONTAINER_RUNNING",
                   pb.ContainerState.Name(st.state), "the hog sleeps after its target", "CRI ContainerStatus")
        if rec and hog.get("done_wall"):
            tm["done_after_relax"] = round(hog["done_wall"] - rec["time"], 2)
        tm.update(current_end=cur, hog_mib_end=hog.get("mib"))
        self.note(f"{pod['name']} (target {pod['target']} MiB < limit): memory.high reached at t+{tm['at_high']}s, "
                  f"crawl from t+{tm['hot']}s, guard-relax {tm.get('action_after_hot')}s later "
                  f"(memory.current {(tm.get('current_at_relax') or 0) / MI:.1f} MiB, hog at "
                  f"{tm.get('hog_mib_at_relax')} MiB, crawl {tm.get('crawl_rate_mib_s')} MiB/s); done "
                  f"{tm.get('done_after_relax')}s after the relax, memory.current {(cur or 0) / MI:.1f} MiB, "
                  f"memory.high {end.get('high')}")

    def run(self) -> None:
        t = time.time()
        swaps = open("/proc/swaps").read().splitlines()[1:]
        self.data["guest"] = {"swap": swaps, "mem_available_kb": int(next(
            line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable")))}
        if swaps:
            raise InfraError(f"the guest has swap ({swaps}): anonymous memory could be swapped, no crawl to prove")
        self.control()
        self.guard()
        self.restart()
        self.report.timing("guard:total", time.time() - t)

    def teardown(self) -> None:
        self.stop_shim()
        remove_every_pod(self.direct, self.report, "guard teardown", timeout=90)
        remove_cgroup_tree("kubepods")
        self.direct.close()


# -- proactive reclaim on a real kernel -------------------------------------------------------------
class ReclaimScenario:
    """Proactive reclaim (memory.reclaim) on a real kernel, without and with, in one boot.

    The workload is page cache: a busybox reader dd's 2 MiB of a sparse 4 GiB file on an ext4
    filesystem (on a brd ramdisk, or a loop device, mounted read-only into the container)
    every 0.25 s, always at a new offset: the holes are read as zero-filled page cache pages
    (memory.stat `file`), clean and never re-read (no refaults) -- a container streaming
    through data, whose cache grows until memory.high. Burstable, request 16Mi, limit 336Mi,
    memoryThrottlingFactor 0.25 -> memory.high 96Mi (e2e/expect.py). Beside it, in both
    phases, the guard scenario's anon-only hog (request 16Mi, limit 96Mi -> memory.high 36Mi,
    target 80 MiB, no swap): reclaim must leave it alone; the guard relaxes its crawl.

    * without: shim --reclaim false (monitor every second, guard relax, window 10 s);
    * with: a new shim with --reclaim true (its defaults), the same pods on a fresh file
      (caches dropped between the phases);
    * side by side: both readers at once, one through a shim with --reclaim true
      --reconcile false, its twin straight through containerd with the same memory.high;
    * thrash: on that shim, a reader cycling through 120 MiB (> memory.high): refaults grow, the
      shim backs off and writes nothing more while backing off.

    Each phase is measured over the same MEASURE seconds from StartContainer: memory.events
    high of the reader, PSI some/full (avg10 max and mean, stall time from the totals), its
    memory.current (max, share of samples at memory.high), memory.stat file and refaults, the
    reader's loops per second, and with reclaim the bytes reclaimed (/metrics) and the
    `reclaim` audit records. report["reclaim"], logs/reclaim-timeline.jsonl, RECLAIM lines.
    """

    REQUEST, LIMIT, FACTOR = 16 * MI, 336 * MI, 0.25
    HOG_LIMIT, HOG_TARGET, HOG_STEP_MS = 96 * MI, 80, 50
    CHUNK_MIB, SLEEP_US = 2, 250000
    MEASURE = 75.0
    POLL = 0.5
    INTERVAL = 1.0

    def __init__(self, args, report: Report):
        self.args = args
        self.report = report
        self.name = "reclaim"
        self.logs = os.path.join(args.out, "logs")
        self.timeline = os.path.join(self.logs, "reclaim-timeline.jsonl")
        self.work = os.path.join(RUN, "reclaim")
        self.data_dir = os.path.join(self.work, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        capacity = int(open("/proc/meminfo").readline().split()[1]) * 1024
        self.node = X.Node(capacity=capacity, page=os.sysconf("SC_PAGE_SIZE"), factor=self.FACTOR)
        self.kubelet_config = os.path.join(self.work, "kubelet-config.json")
        with open(self.kubelet_config, "w") as f:
            json.dump({"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
                       "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/",
                       "featureGates": {"MemoryQoS": True}, "memoryThrottlingFactor": self.FACTOR}, f)
        self.exp = X.container_expectation(X.BURSTABLE, self.LIMIT, self.oom_score_adj(self.REQUEST),
                                           {"memory.min": str(self.REQUEST)}, self.node)
        self.high = int(X.kernel_reads(self.exp.high, self.node.page))
        hog_exp = X.container_expectation(X.BURSTABLE, self.HOG_LIMIT, self.oom_score_adj(self.REQUEST),
                                          {"memory.min": str(self.REQUEST)}, self.node)
        self.hog_high = int(X.kernel_reads(hog_exp.high, self.node.page))
        self.shim: Shim | None = None
        self.cri: Cri | None = None
        self.direct = Cri(CONTAINERD_SOCK)
        self.device = None
        self.summary: list[str] = []
        self.data: dict = {
            "settings": {"monitor_interval": self.INTERVAL, "measure_s": self.MEASURE, "poll": self.POLL,
                         "reader_chunk_mib": self.CHUNK_MIB, "reader_sleep_us": self.SLEEP_US,
                         "shim_reclaim_flags": "defaults (--reclaim true, reclaim-audit-interval: 15)"},
            "reader": {"request": self.REQUEST, "limit": self.LIMIT, "factor": self.FACTOR,
                       "memory.high": self.high, "why": self.exp.why},
            "hog": {"request": self.REQUEST, "limit": self.HOG_LIMIT, "memory.high": self.hog_high,
                    "target_mib": self.HOG_TARGET},
            "phases": {},
        }
        report.data["reclaim"] = self.data

    def oom_score_adj(self, request: int) -> int:
        return min(max(1000 - (1000 * request) // self.node.capacity, 3), 999)

    def note(self, line: str) -> None:
        self.summary.append(line)
        self.data["summary"] = self.summary
        log(f"reclaim: {line}")

    def check(self, step: str, subject: str, file: str, expected, actual, why: str = "", source: str = "cgroupfs",
              ok: bool | None = None) -> bool:
        return self.report.check(self.name, step, subject, file, str(expected), str(actual), why, source, ok)

    # -- the page-cache data: sparse files on ext4 (holes read as page cache, no memory behind them)
    def setup_data(self) -> None:
        def run(*cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)

        p = run("modprobe", "brd", "rd_nr=1", "rd_size=65536")
        if p.returncode == 0 and os.path.exists("/dev/ram0"):
            self.device = "/dev/ram0"
        else:
            img = os.path.join(self.work, "disk.img")
            with open(img, "wb") as f:
                f.truncate(64 * MI)
            run("modprobe", "loop")
            q = run("losetup", "-f", "--show", img)
            if q.returncode != 0:
                raise InfraError(f"no ramdisk ({p.stderr.strip()}) and no loop device ({q.stderr.strip()})")
            self.device = q.stdout.strip()
        for cmd in (("modprobe", "ext4"), ("mkfs.ext4", "-q", "-F", "-b", "4096", self.device),
                    ("mount", "-t", "ext4", self.device, self.data_dir)):
            r = run(*cmd)
            if r.returncode != 0 and cmd[0] != "modprobe":
                raise InfraError(f"{' '.join(cmd)}: {r.stderr.strip()[-300:]}")
        for phase in ("without", "with", "side-managed", "side-direct", "thrash"):
            with open(os.path.join(self.data_dir, f"{phase}.img"), "wb") as f:
                f.truncate(4 << 30)
        self.data["device"] = self.device
        log(f"reclaim: sparse 4 GiB files on ext4 on {self.device} at {self.data_dir}")

    @staticmethod
    def drop_caches() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    # -- shim and pods
    def start_shim(self, phase: str, reclaim: bool, port: int, more: tuple[str, ...] = ()) -> None:
        extra = more + ("--kubelet-version", KUBELET_VERSION, "--monitor-interval", f"{self.INTERVAL:g}",
                        "--guard-action", "relax", "--metrics-address", f"127.0.0.1:{port}",
                        "--reclaim", "true" if reclaim else "false")
        settings = {"guard-window": 10, "guard-cooldown": 600}
        if reclaim:
            settings["reclaim-audit-interval"] = 15
        self.shim = Shim(self.args.python, self.logs, f"reclaim-{phase}", self.kubelet_config, "/proc/meminfo", extra,
                         settings)
        self.metrics_address = f"127.0.0.1:{port}"
        dt = self.shim.start()
        self.report.timing(f"reclaim-{phase}:shim-start", dt)
        log(f"reclaim-{phase}: shim (--reclaim {str(reclaim).lower()}) serving after {dt:.1f}s")
        self.cri = Cri(SHIM_SOCK)

    def stop_shim(self) -> None:
        if self.cri:
            self.cri.close()
            self.cri = None
        if self.shim and self.shim.proc and self.shim.proc.poll() is None:
            self.shim.kill(signal.SIGTERM)

    def create_pod(self, name: str, kind: str, phase: str, direct_high: int | None = None,
                   data: str | None = None, wrap: int | None = None) -> dict:
        """Through the shim; with ``direct_high`` straight to containerd (the shim never sees the
        container) with the memory.high the shim gave its twin."""
        import uuid

        from shim.cri import api_pb2 as pb

        cri = self.direct if direct_high is not None else self.cri

        uid = uuid.uuid4().hex
        parent = f"/kubepods/burstable/pod{uid}"
        cname = kind
        logdir = os.path.join(self.work, "pods", f"default_{name}_{uid}")
        os.makedirs(os.path.join(logdir, cname), exist_ok=True)
        sb = pb.PodSandboxConfig()
        sb.metadata.name, sb.metadata.uid, sb.metadata.namespace = name, uid, "default"
        sb.log_directory = logdir
        sb.labels.update({"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": "default",
                          "io.kubernetes.pod.uid": uid, "app": "memqos-reclaim-e2e"})
        sb.linux.cgroup_parent = parent
        sb.linux.security_context.namespace_options.network = pb.NODE
        sb.linux.security_context.namespace_options.pid = pb.CONTAINER
        sandbox_id = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sb)).pod_sandbox_id
        req = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id)
        req.sandbox_config.CopyFrom(sb)
        c = req.config
        c.metadata.name = cname
        r = c.linux.resources
        if kind == "reader":
            c.image.image = "localhost/busybox:latest"
            at = f"(i%{wrap})" if wrap else "i"
            script = (f"i=0; while :; do dd if=/data/{data or phase}.img of=/dev/null bs=1048576 count={self.CHUNK_MIB} "
                      f"skip=$(({at}*{self.CHUNK_MIB})) 2>/dev/null; i=$((i+1)); echo \"reader: $i\"; "
                      f"usleep {self.SLEEP_US}; done")
            c.command.extend(["sh", "-c", script])
            c.mounts.append(pb.Mount(container_path="/data", host_path=self.data_dir, readonly=True))
            r.memory_limit_in_bytes = self.LIMIT
        else:
            c.image.image = HOG_IMAGE
            c.args.extend([str(self.HOG_TARGET), str(self.HOG_STEP_MS), "sleep"])
            r.memory_limit_in_bytes = self.HOG_LIMIT
        c.log_path = f"{cname}/0.log"
        c.labels.update({"io.kubernetes.container.name": cname, "io.kubernetes.pod.name": name,
                         "io.kubernetes.pod.namespace": "default", "io.kubernetes.pod.uid": uid})
        r.cpu_period, r.cpu_shares = 100000, 2
        r.oom_score_adj = self.oom_score_adj(self.REQUEST)
        r.unified["memory.min"] = str(self.REQUEST)
        if direct_high is not None:
            r.unified["memory.high"] = str(direct_high)
        c.linux.security_context.namespace_options.network = pb.NODE
        c.linux.security_context.namespace_options.pid = pb.CONTAINER
        cid = cri.call("CreateContainer", req).container_id
        cri.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        t = time.time()
        log(f"reclaim-{phase}: pod {name} started ({cid[:12]}{', straight to containerd' if direct_high else ''})")
        return {"name": name, "kind": kind, "uid": uid, "sandbox": sandbox_id, "id": cid, "parent": parent,
                "cg": f"{parent}/{cid}", "log": os.path.join(logdir, cname, "0.log"), "t_start": t, "samples": [],
                "direct": direct_high is not None}

    def remove_pod(self, pod: dict) -> None:
        from shim.cri import api_pb2 as pb

        cri = self.direct if pod.get("direct") else (self.cri or self.direct)
        cri.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod["sandbox"]))
        cri.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod["sandbox"]))

    @staticmethod
    def loops(log_path: str) -> int:
        try:
            with open(log_path) as f:
                return sum(1 for line in f if " reader: " in line)
        except OSError:
            return 0

    def sample(self, pod: dict, phase: str) -> dict:
        cg = pod["cg"]
        s, p = sample_container(pod)
        if p is not None:
            for kind in ("some", "full"):
                s[kind] = p.get(kind, {}).get("avg10")
                s[f"{kind}_total_us"] = p.get(kind, {}).get("total")
            st = parse_events(cg_read(cg, "memory.stat"))
            s["file"], s["anon"] = st.get("file"), st.get("anon")
            s["refault_file"] = st.get("workingset_refault_file")
        if pod["kind"] == "reader":
            s["loops"] = self.loops(pod["log"])
        else:
            hog = hog_progress(pod["log"])
            s["hog_mib"], s["hog_done"] = hog["mib"], hog["done"]
        pod["samples"].append(s)
        with open(self.timeline, "a") as f:
            f.write(json.dumps({"phase": phase, "pod": pod["name"], **s}) + "\n")
        return s

    def measure(self, pod: dict) -> dict:
        ss = [s for s in pod["samples"] if not s.get("gone")]
        first, last = ss[0], ss[-1]
        at_high = [s for s in ss if s.get("current") is not None and s["current"] >= self.high - MI]
        # where reclaim starts (the shim's default headroom: 10 % of memory.high, at least 8 MiB)
        start = self.high - max(self.high // 10, 8 * MI)
        reach = next((s for s in ss if s.get("current") is not None and s["current"] > start), None)
        dt = last["wall"] - first["wall"]

        def rate(a: dict, b: dict):
            return round((b["loops"] - a["loops"]) / (b["wall"] - a["wall"]), 3) if b["wall"] > a["wall"] else None

        before = rate(first, reach) if reach else None
        steady = rate(reach, last) if reach else None

        def delta(key: str):
            a, b = first.get(key), last.get(key)
            return None if a is None or b is None else b - a

        somes = [s["some"] for s in ss if s.get("some") is not None]
        fulls = [s["full"] for s in ss if s.get("full") is not None]
        return {
            "samples": len(ss), "seconds": round(dt, 2),
            "high_events": last.get("events", {}).get("high", 0),
            "max_events": last.get("events", {}).get("max", 0),
            "oom_kill": last.get("events", {}).get("oom_kill", 0),
            "current_max": max((s["current"] for s in ss if s.get("current") is not None), default=None),
            "current_end": last.get("current"),
            "share_at_high": round(len(at_high) / len(ss), 3),
            "near_high_at_t": reach and reach["t"],
            "file_end": last.get("file"), "anon_end": last.get("anon"),
            "refault_file_delta": delta("refault_file"),
            "some_avg10_max": max(somes, default=None),
            "some_avg10_mean": round(sum(somes) / len(somes), 2) if somes else None,
            "full_avg10_max": max(fulls, default=None),
            "full_avg10_mean": round(sum(fulls) / len(fulls), 2) if fulls else None,
            "some_stall_ms": None if delta("some_total_us") is None else round(delta("some_total_us") / 1000, 1),
            "full_stall_ms": None if delta("full_total_us") is None else round(delta("full_total_us") / 1000, 1),
            "loops": delta("loops"),
            "loops_per_s": round(delta("loops") / dt, 3) if dt > 0 and delta("loops") is not None else None,
            "loops_per_s_before_headroom": before, "loops_per_s_steady": steady,
            "steady_over_before": round(steady / before, 3) if before and steady is not None else None,
        }

    def phase(self, phase: str, reclaim: bool, port: int) -> dict:
        self.drop_caches()
        self.start_shim(phase, reclaim, port)
        reader = self.create_pod(f"reclaim-{phase}-reader", "reader", phase)
        hog = self.create_pod(f"reclaim-{phase}-hog", "hog", phase)
        end = time.time() + self.MEASURE
        while time.time() < end:
            for p in (reader, hog):
                self.sample(p, phase)
            time.sleep(self.POLL)
        metrics = scrape_metrics(self.metrics_address)
        audit = read_audit(self.shim.audit_log)
        doctor = self.doctor(phase, reclaim)
        out = {"reader": {"id": reader["id"], **self.measure(reader)},
               "hog": {"id": hog["id"], "high_events": (hog["samples"][-1].get("events") or {}).get("high"),
                       "mib_end": hog["samples"][-1].get("hog_mib"), "done": hog["samples"][-1].get("hog_done"),
                       "memory_high_end": hog["samples"][-1].get("high")}}
        for key, pod in (("reader", reader), ("hog", hog)):
            recs = [r for r in audit if r.get("container_id") == pod["id"]]
            out[key]["reclaim_records"] = [r for r in recs if r.get("event") == "reclaim"]
            out[key]["reclaim_errors"] = [r for r in recs if r.get("event") == "reclaim-error"]
            out[key]["guard"] = [r.get("event") for r in recs if str(r.get("event", "")).startswith("guard-")]
            out[key]["reclaimed_bytes_metric"] = metric(metrics, "memqos_container_reclaimed_bytes_total",
                                                        container_id=pod["id"])
            out[key]["reclaim_writes_audited"] = sum(r.get("writes", 0) for r in out[key]["reclaim_records"])
        out["doctor"] = doctor
        out["metrics"] = {k: metric(metrics, n, **lb) for k, n, lb in (
            ("writes_ok", "memqos_reclaim_writes_total", {"result": "ok"}),
            ("writes_eagain", "memqos_reclaim_writes_total", {"result": "eagain"}),
            ("writes_error", "memqos_reclaim_writes_total", {"result": "error"}),
            ("asked_bytes", "memqos_reclaim_asked_bytes_total", {}),
            ("freed_bytes", "memqos_reclaim_freed_bytes_total", {}),
            ("backoffs", "memqos_reclaim_backoffs_total", {}),
            ("stalls_avoided", "memqos_reclaim_stalls_avoided_total", {}),
            ("high_events_while_active", "memqos_reclaim_high_events_while_active_total", {}),
            ("monitor_sample_duration_seconds", "memqos_monitor_sample_duration_seconds", {}))}
        for p in (reader, hog):
            try:
                self.remove_pod(p)
            except Exception as e:  # noqa: BLE001
                log(f"reclaim: removing {p['name']}: {e}")
        self.stop_shim()
        self.data["phases"][phase] = out
        return out

    def run(self) -> None:
        t = time.time()
        swaps = open("/proc/swaps").read().splitlines()[1:]
        if swaps:
            raise InfraError(f"the guest has swap ({swaps}): the anon-only hog could be reclaimed")
        self.data["guest"] = {"kernel": os.uname().release}
        self.setup_data()
        probe = os.path.join(CGROOT, "system.slice", "memory.reclaim")
        self.check("setup", "kernel", probe, "exists (kernel >= 5.19)", "exists" if os.path.exists(probe) else "missing",
                   "proactive reclaim needs memory.reclaim", ok=os.path.exists(probe))
        wo = self.phase("without", False, 19470)
        wi = self.phase("with", True, 19471)
        side = self.side_by_side(19472)
        self.compare(wo, wi, side)
        self.thrash()
        self.report.timing("reclaim:total", time.time() - t)

    def doctor(self, phase: str, reclaim: bool) -> str:
        """`memqos-shim doctor` with the running shim's settings: its proactive reclaim line on a
        5.19+ kernel (memory.reclaim available; on or off as the shim runs)."""
        r = self.shim.run_cli("doctor", *self.shim.args, timeout=300)
        path = os.path.join(self.logs, f"reclaim-{phase}-doctor.txt")
        with open(path, "w") as f:
            f.write(r.stdout + r.stderr + f"\nexit code {r.returncode}\n")
        line = next((x for x in r.stdout.splitlines() if "proactive reclaim" in x), "")
        want = "PASS", ("on:" if reclaim else "off (--reclaim false"), "memory.reclaim available"
        self.check(phase, "memqos-shim doctor", f"{path}: proactive reclaim", " ... ".join(want), line.strip() or "missing",
                   "memory.reclaim exists in non-root cgroups on this 6.1 kernel", "doctor",
                   ok=bool(line) and line.startswith("PASS") and all(w in line for w in want[1:]))
        return line.strip()

    def side_by_side(self, port: int) -> dict:
        """Both readers at once under the same host load: one created through a shim with
        --reclaim true (managed: reclaimed), its twin straight through containerd with the same
        memory.min and memory.high (the shim never sees it: --reconcile false, so the monitor
        knows only containers created through it)."""
        phase = "side"
        self.drop_caches()
        self.start_shim(phase, True, port, ("--reconcile", "false"))
        managed = self.create_pod("reclaim-side-managed", "reader", phase, data="side-managed")
        high = cg_read(managed["cg"], "memory.high")
        if not high.isdigit():
            raise InfraError(f"the managed reader's memory.high reads {high!r}")
        direct = self.create_pod("reclaim-side-direct", "reader", phase, direct_high=int(high), data="side-direct")
        end = time.time() + self.MEASURE
        while time.time() < end:
            for p in (managed, direct):
                self.sample(p, phase)
            time.sleep(self.POLL)
        metrics = scrape_metrics(self.metrics_address)
        audit = read_audit(self.shim.audit_log)
        out: dict = {}
        for key, pod in (("managed", managed), ("direct", direct)):
            recs = [r for r in audit if r.get("container_id") == pod["id"]]
            out[key] = {"id": pod["id"], "memory.high": cg_read(pod["cg"], "memory.high"), **self.measure(pod),
                        "reclaim_records": [r for r in recs if r.get("event") == "reclaim"],
                        "guard": [r.get("event") for r in recs if str(r.get("event", "")).startswith("guard-")],
                        "reclaimed_bytes_metric": metric(metrics, "memqos_container_reclaimed_bytes_total",
                                                         container_id=pod["id"])}
        out["metrics"] = {"writes_ok": metric(metrics, "memqos_reclaim_writes_total", result="ok"),
                          "writes_eagain": metric(metrics, "memqos_reclaim_writes_total", result="eagain"),
                          "freed_bytes": metric(metrics, "memqos_reclaim_freed_bytes_total"),
                          "asked_bytes": metric(metrics, "memqos_reclaim_asked_bytes_total"),
                          "stalls_avoided": metric(metrics, "memqos_reclaim_stalls_avoided_total")}
        for p in (managed, direct):
            try:
                self.remove_pod(p)
            except Exception as e:  # noqa: BLE001
                log(f"reclaim: removing {p['name']}: {e}")
        self.data["phases"]["side"] = out  # its shim stays for the thrash phase
        return out

    THRASH_CHUNKS = 60  # the thrashing reader cycles through 60 x 2 MiB = 120 MiB > memory.high

    def thrash(self) -> None:
        """The refault back-off on the real kernel: a reader cycling through 120 MiB (more than its
        memory.high) re-reads what was evicted -- its cache is its working set. On the side phase's
        shim (--reclaim true): reclaim runs until refaults grow, then backs off and writes nothing
        while backing off. /metrics is scraped every 2 s for the timing."""
        phase = "thrash"
        self.drop_caches()
        base = scrape_metrics(self.metrics_address)
        b0 = metric(base, "memqos_reclaim_backoffs_total") or 0.0
        pod = self.create_pod("reclaim-thrash-reader", "reader", phase, wrap=self.THRASH_CHUNKS)
        series: list[dict] = []
        end, last = time.time() + self.MEASURE, 0.0
        while time.time() < end:
            self.sample(pod, phase)
            if time.time() - last >= 2.0:
                last = time.time()
                m = scrape_metrics(self.metrics_address)
                series.append({"t": round(last - pod["t_start"], 2),
                               "reclaimed": metric(m, "memqos_container_reclaimed_bytes_total", container_id=pod["id"]),
                               "backoffs": (metric(m, "memqos_reclaim_backoffs_total") or 0.0) - b0})
            time.sleep(self.POLL)
        audit = [r for r in read_audit(self.shim.audit_log) if r.get("container_id") == pod["id"]]
        recs = [r for r in audit if r.get("event") == "reclaim"]
        meas = self.measure(pod)
        first = next((s for s in series if s["backoffs"] >= 1), None)
        end_bytes = series[-1]["reclaimed"] if series else None
        subj = f"thrashing reader (cycles through {self.THRASH_CHUNKS * self.CHUNK_MIB} MiB, memory.high 96 MiB)"
        self.check(phase, subj, "memory.stat workingset_refault_file over the phase", "> 0",
                   meas["refault_file_delta"], "it re-reads what was evicted: its cache is its working set",
                   ok=(meas["refault_file_delta"] or 0) > 0)
        self.check(phase, subj, f"http://{self.metrics_address}/metrics memqos_reclaim_backoffs_total (phase)", ">= 1",
                   series[-1]["backoffs"] if series else None, "refaults grew: back off", "metrics",
                   ok=bool(series) and series[-1]["backoffs"] >= 1)
        reason = next((r.get("backoff_reason") for r in recs if r.get("backoffs")), None)
        self.check(phase, subj, f"{self.shim.audit_log}: reclaim record backoff_reason",
                   "refaults: '... working set ...' (or PSI after the shim's reclaim)", reason,
                   "audited with the reason", "audit log",
                   ok=bool(reason) and ("working set" in reason or "after the shim's reclaim" in reason))
        self.check(phase, subj, "memqos_container_reclaimed_bytes_total: end of phase", f"== at the first back-off "
                   f"({first and first['reclaimed']})", end_bytes, "no write while backing off", "metrics",
                   ok=first is not None and end_bytes == first["reclaimed"])
        out = {"id": pod["id"], **meas, "metrics_series": series, "reclaim_records": recs,
               "first_backoff_t": first and first["t"], "reclaimed_at_first_backoff": first and first["reclaimed"],
               "reclaimed_end": end_bytes, "backoff_reason": reason}
        self.data["phases"]["thrash"] = out
        try:
            self.remove_pod(pod)
        except Exception as e:  # noqa: BLE001
            log(f"reclaim: removing {pod['name']}: {e}")
        self.stop_shim()
        self.note(f"thrash (cycling through {self.THRASH_CHUNKS * self.CHUNK_MIB} MiB): refaults "
                  f"{meas['refault_file_delta']} file pages; first back-off at t+{out['first_backoff_t']}s after "
                  f"{(out['reclaimed_at_first_backoff'] or 0) / MI:.1f} MiB reclaimed, "
                  f"{(end_bytes or 0) / MI:.1f} MiB at the end; memory.events high {meas['high_events']}, PSI some "
                  f"avg10 max {meas['some_avg10_max']}%; reason: {reason}")

    def compare(self, wo: dict, wi: dict, side: dict) -> None:
        step = "without vs with reclaim"
        a, b = wo["reader"], wi["reader"]
        subj = f"reader (page cache, memory.high {self.high / MI:.0f} MiB)"
        self.check("without", subj, "memory.stat file (end of the phase)", f">= {self.high // 2} (the workload is "
                   "page cache)", a["file_end"], "the reader's cache grows", ok=(a["file_end"] or 0) >= self.high // 2)
        self.check("without", subj, "memory.events high", "> 0 (the workload reaches memory.high)", a["high_events"],
                   "without reclaim the kernel reclaims at memory.high in the reader's own tasks",
                   ok=a["high_events"] > 0)
        self.check("without", subj, "guard records for the reader", "none", a["guard"] or "none",
                   "the comparison needs memory.high in force all along", "audit log", ok=not a["guard"])
        self.check("with", subj, "guard records for the reader", "none", b["guard"] or "none",
                   "the comparison needs memory.high in force all along", "audit log", ok=not b["guard"])
        self.check(step, subj, "memory.events high", f"< {a['high_events']} (without)", b["high_events"],
                   "proactive reclaim keeps the reader out of memory.high's reclaim", ok=b["high_events"] < a["high_events"])
        self.check(step, subj, "share of samples at memory.high (>= high - 1 MiB)", f"< {a['share_at_high']} (without)",
                   b["share_at_high"], "", ok=b["share_at_high"] < a["share_at_high"])
        self.check(step, subj, "memory.pressure some stall time over the phase (ms)", f"<= {a['some_stall_ms']} (without)",
                   b["some_stall_ms"], "the reclaim work runs in the shim's task, not the reader's",
                   ok=b["some_stall_ms"] is not None and a["some_stall_ms"] is not None
                   and b["some_stall_ms"] <= a["some_stall_ms"])
        freed = b.get("reclaimed_bytes_metric") or 0
        self.check("with", subj, f"http://{self.metrics_address}/metrics memqos_container_reclaimed_bytes_total", "> 0",
                   freed, "memory.current before - after each write", "metrics", ok=freed > 0)
        self.check("with", subj, "audit: reclaim records for the reader", ">= 1", len(b["reclaim_records"]),
                   "the first write of a quiet container is audited at once", "audit log", ok=bool(b["reclaim_records"]))
        self.check("without", subj, "audit: reclaim records (--reclaim false)", "0",
                   len(a["reclaim_records"]) + len(a["reclaim_errors"]), "off by default changes nothing", "audit log")
        lw, lo = b["steady_over_before"], a["steady_over_before"]
        self.check(step, subj, "reader loops/s near memory.high relative to its own rate before (steady / before)",
                   f">= 0.9 x {lo} (without)", lw, "no throughput lost to reclaim; each phase normalized by its own "
                   "rate before the headroom, as host load differs between phases", "container log",
                   ok=lw is not None and lo is not None and lw >= 0.9 * lo)
        m, d = side["managed"], side["direct"]
        sstep = "side by side (same time, same load)"
        self.check(sstep, "two readers", "memory.high managed / direct", "equal", f"{m['memory.high']} / {d['memory.high']}",
                   "the twin got the shim's value straight through containerd", ok=m["memory.high"] == d["memory.high"])
        self.check(sstep, "reader with reclaim (managed)", "memory.events high", f"< {d['high_events']} (direct, no reclaim)",
                   m["high_events"], "", ok=m["high_events"] < d["high_events"])
        self.check(sstep, "reader with reclaim (managed)", "memory.pressure some stall time (ms)",
                   f"<= {d['some_stall_ms']} (direct)", m["some_stall_ms"], "",
                   ok=m["some_stall_ms"] is not None and d["some_stall_ms"] is not None
                   and m["some_stall_ms"] <= d["some_stall_ms"])
        self.check(sstep, "reader with reclaim (managed)", "loops/s near memory.high",
                   f">= 0.9 x {d['loops_per_s_steady']} (direct)", m["loops_per_s_steady"], "no throughput lost",
                   "container log", ok=m["loops_per_s_steady"] is not None and d["loops_per_s_steady"] is not None
                   and m["loops_per_s_steady"] >= 0.9 * d["loops_per_s_steady"])
        self.check(sstep, "reader without reclaim (direct)", "audit: reclaim records", "0", len(d["reclaim_records"]),
                   "the shim does not know the direct container", "audit log")
        hog = wi["hog"]
        hsubj = f"hog (anon only, memory.high {self.hog_high / MI:.0f} MiB, target {self.HOG_TARGET} MiB)"
        self.check("with", hsubj, "audit: reclaim records / writes for the hog", "0 / 0",
                   f"{len(hog['reclaim_records'])} / {hog['reclaim_writes_audited']}",
                   "anon without swap cannot be reclaimed: left alone", "audit log",
                   ok=not hog["reclaim_records"])
        self.check("with", hsubj, f"http://{self.metrics_address}/metrics memqos_container_reclaimed_bytes_total", "0.0",
                   hog.get("reclaimed_bytes_metric"), "no reclaim for the hog", "metrics")
        self.check("with", hsubj, "audit: guard-relax for the hog", "present", "present" if "guard-relax" in hog["guard"]
                   else f"absent ({hog['guard']})", "the guard still handles the crawl", "audit log",
                   ok="guard-relax" in hog["guard"])
        rows = [("memory.events high (reader)", a["high_events"], b["high_events"]),
                ("samples at memory.high", a["share_at_high"], b["share_at_high"]),
                ("memory.current max MiB", round((a["current_max"] or 0) / MI, 1), round((b["current_max"] or 0) / MI, 1)),
                ("PSI some avg10 max / mean %", f"{a['some_avg10_max']} / {a['some_avg10_mean']}",
                 f"{b['some_avg10_max']} / {b['some_avg10_mean']}"),
                ("PSI full avg10 max / mean %", f"{a['full_avg10_max']} / {a['full_avg10_mean']}",
                 f"{b['full_avg10_max']} / {b['full_avg10_mean']}"),
                ("PSI some / full stall ms", f"{a['some_stall_ms']} / {a['full_stall_ms']}",
                 f"{b['some_stall_ms']} / {b['full_stall_ms']}"),
                ("reclaimed MiB (writes, eagain)", "0 (off)",
                 f"{freed / MI:.1f} ({int(wi['metrics'].get('writes_ok') or 0)}, "
                 f"{int(wi['metrics'].get('writes_eagain') or 0)})"),
                ("reader loops/s (2 MiB each), all", a["loops_per_s"], b["loops_per_s"]),
                ("  before the headroom / near high", f"{a['loops_per_s_before_headroom']} / {a['loops_per_s_steady']}",
                 f"{b['loops_per_s_before_headroom']} / {b['loops_per_s_steady']}"),
                ("refaults (file pages)", a["refault_file_delta"], b["refault_file_delta"]),
                ("hog: reclaim writes / guard", f"{wo['hog']['reclaim_writes_audited']} / {wo['hog']['guard']}",
                 f"{hog['reclaim_writes_audited']} / {hog['guard']}")]
        self.data["table"] = [{"what": w, "without": x, "with": y} for w, x, y in rows]
        self.note(f"{'':34} {'without':>22} {'with':>22}  (one after the other, {self.MEASURE:g} s each, same boot)")
        for w, x, y in rows:
            self.note(f"{w:34} {str(x):>22} {str(y):>22}")
        fm = side["metrics"].get("freed_bytes") or 0
        srows = [("memory.events high", d["high_events"], m["high_events"]),
                 ("samples at memory.high", d["share_at_high"], m["share_at_high"]),
                 ("PSI some avg10 max / mean %", f"{d['some_avg10_max']} / {d['some_avg10_mean']}",
                  f"{m['some_avg10_max']} / {m['some_avg10_mean']}"),
                 ("PSI full avg10 max / mean %", f"{d['full_avg10_max']} / {d['full_avg10_mean']}",
                  f"{m['full_avg10_max']} / {m['full_avg10_mean']}"),
                 ("PSI some / full stall ms", f"{d['some_stall_ms']} / {d['full_stall_ms']}",
                  f"{m['some_stall_ms']} / {m['full_stall_ms']}"),
                 ("reclaimed MiB (writes)", "0 (not managed)",
                  f"{fm / MI:.1f} ({int(side['metrics'].get('writes_ok') or 0)})"),
                 ("loops/s all / before / near high",
                  f"{d['loops_per_s']} / {d['loops_per_s_before_headroom']} / {d['loops_per_s_steady']}",
                  f"{m['loops_per_s']} / {m['loops_per_s_before_headroom']} / {m['loops_per_s_steady']}")]
        self.data["table_side_by_side"] = [{"what": w, "no_reclaim": x, "reclaim": y} for w, x, y in srows]
        self.note(f"{'side by side':34} {'no reclaim':>22} {'reclaim':>22}  (both at once, {self.MEASURE:g} s)")
        for w, x, y in srows:
            self.note(f"{w:34} {str(x):>22} {str(y):>22}")

    def teardown(self) -> None:
        from shim.cri import api_pb2 as pb

        self.stop_shim()
        try:
            for sb in self.direct.call("ListPodSandbox", pb.ListPodSandboxRequest()).items:
                self.direct.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sb.id))
                self.direct.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id))
        except Exception as e:  # noqa: BLE001
            log(f"reclaim teardown: {e}")
        remove_cgroup_tree("kubepods")
        subprocess.run(["umount", self.data_dir], capture_output=True)
        self.direct.close()


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


# -- containerd -----------------------------------------------------------------------------------------
NRI_ON_1X = '[plugins."io.containerd.nri.v1.nri"]\n  disable = false\n'  # 2.x: on by default


def start_containerd(out_logs: str, images: list[str], systemd: bool, report: Report, stack: dict,
                     nri: bool = False):
    from shim.cri import api_pb2 as pb

    t = time.time()
    for d in ("containerd", "cni/bin", "cni/net.d"):
        os.makedirs(os.path.join(RUN, d), exist_ok=True)
    with open(stack["config"]) as f:
        conf = f.read().replace("@ROOT@", RUN).replace("@SYSTEMD_CGROUP@", "true" if systemd else "false")
    conf = conf.replace("@RUNC@", stack["runc"]).replace("#@NRI@", NRI_ON_1X if nri else "")
    conf_path = os.path.join(RUN, "containerd", "config.toml")
    with open(conf_path, "w") as f:
        f.write(conf)
    shutil.copy(conf_path, os.path.join(out_logs, "containerd.toml"))
    # PATH (set in main from the stack) puts the stack's containerd-shim-runc-v2 first: containerd
    # looks the shim up in PATH; runc is named in the config (BinaryName)
    proc = spawn([stack["containerd"], "--config", conf_path], "system.slice/containerd.service",
                 os.path.join(out_logs, "containerd.log"))
    wait_for_socket(CONTAINERD_SOCK, proc, 240, "containerd")
    report.timing("containerd-start", time.time() - t)
    t = time.time()
    for tar in images:
        p = subprocess.run([stack["ctr"], "-a", CONTAINERD_SOCK, "-n", "k8s.io", "images", "import", tar],
                           capture_output=True, text=True, timeout=600)
        with open(os.path.join(out_logs, "ctr-import.log"), "a") as f:
            f.write(f"$ ctr images import {tar}\n{p.stdout}{p.stderr}exit {p.returncode}\n")
        if p.returncode != 0:
            raise InfraError(f"ctr images import {tar} failed: {p.stderr.strip()[-500:]}")
    cri = Cri(CONTAINERD_SOCK)
    deadline = time.time() + 120
    try:
        for ref in ("localhost/pause:e2e", "localhost/busybox:latest", HOG_IMAGE):
            while True:
                try:
                    st = cri.call("ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=ref)),
                                  service="ImageService", timeout=30)
                    if st.image.id:
                        break
                except cri.grpc.RpcError as e:
                    if time.time() > deadline:
                        raise InfraError(f"containerd CRI not answering: {e.code().name} {e.details()}") from None
                if time.time() > deadline:
                    raise InfraError(f"image {ref} not visible to the CRI after import")
                time.sleep(0.5)
    finally:
        cri.close()
    report.timing("images-import", time.time() - t)
    return proc


def guest_facts(stack: dict) -> dict:
    facts = {"kernel": os.uname().release}
    try:
        facts["mem_total_kb"] = int(open("/proc/meminfo").readline().split()[1])
        facts["pid1"] = open("/proc/1/comm").read().strip()
        facts["cgroup_controllers"] = open(os.path.join(CGROOT, "cgroup.controllers")).read().split()
        facts["nproc"] = os.cpu_count()
        for tool in ("containerd", "runc"):
            p = subprocess.run([stack[tool], "--version"], capture_output=True, text=True)
            facts[tool] = (p.stdout.strip() or p.stderr.strip() or f"exit {p.returncode}").splitlines()[0]
    except Exception as e:  # noqa: BLE001
        facts["error"] = str(e)
    return facts


def load_stack(path: str) -> dict:
    """The containerd + runc stack to run (e2e/stacks.py's stack.json); without one, the
    binaries in PATH (the host's packages) and the 1.x config."""
    if path:
        with open(path) as f:
            stack = json.load(f)
    else:
        stack = {"name": "(PATH)", "config": os.path.join(HERE, "containerd.toml.in"), "bin_dirs": []}
        for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr"):
            stack[tool] = shutil.which(tool) or tool
    if stack.get("bin_dirs"):
        os.environ["PATH"] = os.pathsep.join(stack["bin_dirs"] + [os.environ.get("PATH", "")])
    return stack


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


def check_stack_binaries(report: Report, stack: dict, containerd_pid: int) -> None:
    """The processes running are the stack's own binaries (not whatever PATH found first), and
    containerd answers CRI Version with the stack's version: what the report says was tested is
    what ran. Called with the pods of the first scenario running (their shims are up)."""
    from shim.cri import api_pb2 as pb

    why = f"stack {stack['name']}: {stack.get('about', '')}"
    # /proc/PID/exe names the binary with every symlink resolved: so is the expected path
    report.check("*", "stack", "containerd process", f"/proc/{containerd_pid}/exe",
                 os.path.realpath(stack["containerd"]), os.readlink(f"/proc/{containerd_pid}/exe"), why, "procfs")
    shims = sorted({os.readlink(f"/proc/{p}/exe") for p in pids_named("containerd-shim")})
    report.check("*", "stack", "containerd-shim-runc-v2 processes", "/proc/<containerd-shim>/exe",
                 os.path.realpath(stack["containerd-shim-runc-v2"]), ", ".join(shims) or "(no shim running)", why,
                 "procfs")
    cri = Cri(CONTAINERD_SOCK)
    try:
        v = cri.call("Version", pb.VersionRequest(), timeout=30)
    finally:
        cri.close()
    if stack.get("containerd_version"):
        report.check("*", "stack", "containerd CRI Version", "runtime.v1 Version.runtime_version",
                     stack["containerd_version"], v.runtime_version, why, "CRI Version")
    report.data["stack"]["cri_runtime_version"] = v.runtime_version
    report.data["stack"]["cri_runtime_api_version"] = v.runtime_api_version


def systemd_usable() -> tuple[bool, str]:
    pid1 = open("/proc/1/comm").read().strip()
    if pid1 == "systemd" and os.path.isdir("/run/systemd/system"):
        return True, ""
    return False, (f"the guest's PID 1 is {pid1!r}, not systemd: runc's systemd cgroup driver creates "
                   "scopes and slices through systemd over D-Bus, which a virtme-ng guest does not run "
                   "(the systemd driver is proven by scripts/e2e-vm --guest systemd)")


def run_scenario(name: str, scenario, report: Report) -> None:
    """Run one scenario; an error in it is recorded and the next scenario still runs. Its
    teardown always runs and the report is saved after it."""
    try:
        scenario.run()
    except InfraError as e:
        report.data["errors"].append(f"{name}: {e}")
        log(f"INFRA ERROR in {name}: {e}")
    except Exception:  # noqa: BLE001
        report.data["errors"].append(f"{name}: {traceback.format_exc()}")
        log(f"ERROR in {name}: {traceback.format_exc()}")
    finally:
        scenario.teardown()
        report.save()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--images", required=True, help="directory with busybox.tar and pause.tar")
    ap.add_argument("--trace", action="append", default=[], help="NAME=PATH of a recorded kubelet trace")
    ap.add_argument("--guard", action="store_true", help="run the PSI guard scenario (after the traces)")
    ap.add_argument("--guard-threshold", type=float, default=40.0, help="guard: PSI full avg10 percent")
    ap.add_argument("--guard-interval", type=float, default=1.0, help="guard: the shim's --monitor-interval")
    ap.add_argument("--guard-window", type=float, default=10.0, help="guard: the shim's guard-window setting")
    ap.add_argument("--guard-cooldown", type=float, default=20.0, help="guard: the shim's guard-cooldown setting")
    ap.add_argument("--guard-slack", type=float, default=3.0,
                    help="guard: seconds allowed beyond window + one interval for the guard to act")
    ap.add_argument("--reclaim", action="store_true",
                    help="run the proactive reclaim scenario (after the traces and the guard)")
    ap.add_argument("--nri", default="", metavar="TRACE",
                    help="run the NRI scenario (e2e/nri_scenario.py) on this trace, after the others; proxy mode's "
                         "values for it are those of the --trace replay of the same file when there is one")
    ap.add_argument("--manifests", default="")
    ap.add_argument("--driver", default="all", help="cgroupfs, systemd or all")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the reconciler gets to converge")
    ap.add_argument("--stack", default="", help="stack.json of e2e/stacks.py (default: the binaries in PATH)")
    args = ap.parse_args(argv)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(args.out, "guest-started"), "w") as f:
        f.write(f"{time.time()}\n")
    report = Report(args.out)
    stack = load_stack(args.stack)
    report.data["guest"] = guest_facts(stack)
    report.data["stack"] = {
        "name": stack["name"], "source": stack.get("source", "PATH"),
        "containerd": report.data["guest"].get("containerd", ""), "runc": report.data["guest"].get("runc", ""),
        "containerd_version": stack.get("containerd_version", ""), "runc_version": stack.get("runc_version", ""),
        "packages": stack.get("packages", []), "notes": stack.get("notes", []),
        "config": os.path.basename(stack["config"]), "cgroup_driver": "cgroupfs",
        "kernel": report.data["guest"]["kernel"],
    }
    report.data["shim_checkout"] = CHECKOUT
    report.save()
    log(f"guest up: {report.data['guest']}")
    containerd = None
    try:
        setup_cgroups()
        drivers = ["cgroupfs", "systemd"] if args.driver == "all" else [args.driver]
        if "systemd" in drivers:
            ok, why = systemd_usable()
            report.skip("*", "cgroup driver systemd", why if not ok else
                        "the guest runs systemd, but the replay of the (cgroupfs) traces with systemd slice "
                        "parents is not written yet")
            drivers.remove("systemd")
        else:
            report.skip("*", "cgroup driver systemd", "not requested (--driver cgroupfs)")
        if drivers != ["cgroupfs"]:
            raise InfraError(f"no cgroup driver to run (asked: {args.driver})")
        reconciler = reconciler_available(args.python)
        report.data["reconciler"] = {"available": reconciler[0], "reset_help": reconciler[1][-1500:]}
        if not reconciler[0]:
            log("no reconciler in the checkout: pod/QoS/node values will be reported as skipped")
        images = [os.path.join(args.images, n) for n in ("pause.tar", "busybox.tar", "hog.tar")]
        containerd = start_containerd(logs, images, False, report, stack, nri=bool(args.nri))
        log("containerd ready, images imported")
        stack_checked: list[bool] = []

        def stack_check() -> None:  # once, with the first pods running
            if not stack_checked:
                stack_checked.append(True)
                check_stack_binaries(report, stack, containerd.pid)

        created_values: dict[str, dict[str, str]] = {}  # trace path -> the values after its "created" step
        for spec in args.trace:
            name, path = spec.split("=", 1)
            scenario = Scenario(args, report, path, name, reconciler)
            scenario.on_running = stack_check
            if args.nri and os.path.realpath(path) == os.path.realpath(args.nri):
                import nri_scenario

                scenario.on_created = lambda scn, p=path: created_values.__setitem__(p, nri_scenario.values(scn))
            run_scenario(name, scenario, report)
        if args.guard:
            guard = GuardScenario(args, report)
            guard.on_running = stack_check
            run_scenario("guard", guard, report)
        if args.reclaim:
            run_scenario("reclaim", ReclaimScenario(args, report), report)
        if args.nri:  # last: its pods stay until the VM ends
            import nri_scenario

            def restart_containerd():
                nonlocal containerd
                containerd.terminate()
                containerd.wait(timeout=60)
                containerd = start_containerd(logs, [], False, report, stack, nri=True)
                return containerd

            proxy_values = next((v for p, v in created_values.items()
                                 if os.path.realpath(p) == os.path.realpath(args.nri)), None)
            nri = nri_scenario.NriScenario(args, report, args.nri, reconciler, containerd, restart_containerd,
                                           proxy_values=proxy_values)
            run_scenario("nri", nri, report)
        if not args.trace and not args.guard and not args.reclaim and not args.nri:
            raise InfraError("nothing to run: no --trace, no --guard, no --reclaim")
    except InfraError as e:
        report.data["errors"].append(str(e))
        log(f"INFRA ERROR: {e}")
    except Exception:  # noqa: BLE001
        report.data["errors"].append(traceback.format_exc())
        log(f"ERROR: {traceback.format_exc()}")
    finally:
        failed = sum(1 for c in report.data["checks"] if not c["pass"])
        report.data["status"] = "error" if report.data["errors"] else ("fail" if failed else "pass")
        report.timing("guest-total", time.time() - T0)
        report.save()
        if containerd and containerd.poll() is None:
            containerd.terminate()
            try:
                containerd.wait(timeout=30)
            except subprocess.TimeoutExpired:
                containerd.kill()
    s = report.data["summary"]
    log(f"status {report.data['status']}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
    return {"pass": 0, "fail": 1}.get(report.data["status"], 3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
