#!/usr/bin/env python3
"""Guest side of the real-kernel suite: runs as root inside the virtme-ng VM (cgroup v2).

Started by scripts/e2e-vm with the checkout's .venv python. It
  1. enables the cgroup controllers, starts containerd (root/state on tmpfs) in
     /system.slice/containerd.service and imports the local images;
  2. per scenario (one recorded kubelet trace each): starts the shim from the checkout in
     /system.slice/memqos-shim.service in front of containerd, replays the kubelet's own
     requests (ImageStatus, RunPodSandbox, CreateContainer, StartContainer, later StopContainer,
     StopPodSandbox, RemoveContainer, RemovePodSandbox) through the shim's socket with the
     recorded ids mapped to the new ones, and reads back /sys/fs/cgroup after each step:
     created, updated (UpdateContainerResources), pods removed, shim killed with SIGKILL,
     shim restarted, `memqos-shim reset`;
  3. writes OUT/report-guest.json (every asserted file with expected and actual value) and
     the logs (containerd, shim, audit, cgroup snapshots) under OUT/logs.

Expected values come from e2e/expect.py (own arithmetic, not the shim's). Exit code:
0 all checks passed, 1 a check failed, 3 infrastructure error (containerd, images, shim
would not start...): the host tells these apart from a boot failure by the report's presence.
"""
from __future__ import annotations

import argparse
import base64
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

CGROOT = "/sys/fs/cgroup"
RUN = "/run/e2e"
CONTAINERD_SOCK = f"{RUN}/containerd/containerd.sock"
SHIM_SOCK = f"{RUN}/shim/memqos-shim.sock"
RUNTIME = "/runtime.v1.RuntimeService/"
CREATE_PHASE = ("RunPodSandbox", "CreateContainer", "StartContainer")
NODE_CALLS = ("Version", "Status", "ImageStatus")
REMOVE_PHASE = ("StopContainer", "StopPodSandbox", "RemoveContainer", "RemovePodSandbox")
CALL_TIMEOUT = 300.0
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
              why: str = "", source: str = "cgroupfs") -> bool:
        ok = str(expected) == str(actual)
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
    for d in ("system.slice", "system.slice/containerd.service", "system.slice/memqos-shim.service"):
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

        self.path = path
        with open(path) as f:
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
        self._prepare_host(name, req)
        t = time.time()
        try:
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
class Shim:
    def __init__(self, python: str, out_logs: str, scenario: str, kubelet_config: str, meminfo: str):
        self.python = python
        self.args = [
            "--listen", f"unix://{SHIM_SOCK}",
            "--upstream", f"unix://{CONTAINERD_SOCK}",
            "--kubelet-config", kubelet_config,
            "--cgroup-root", CGROOT,
            "--meminfo", meminfo,
            "--audit-log", os.path.join(out_logs, f"{scenario}-audit.jsonl"),
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
        self.proc = spawn([self.python, "-m", "shim", "serve", *self.args], "system.slice/memqos-shim.service",
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

    def check_sandboxes(self, step: str) -> None:
        for pod in self.model.live_pods().values():
            cg = f"{pod['parent']}/{pod['sandbox']}"
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

    def check_all(self, step: str, settle: float | None = None) -> None:
        for pod in self.model.live_pods().values():
            for c in pod["containers"].values():
                self.check_container(step, pod, c, c.get("current_exp"))
        self.check_sandboxes(step)
        self.check_pod_level(step, settle)
        snapshot(self.snap, f"{self.name}: {step}")

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
        self.check_all("created")

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
        if self.reconciler:
            drifted = [pod["parent"] for pod in self.model.live_pods().values() if pod["qos"] == X.BURSTABLE][:1]
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
        self.reset()
        rep.timing(f"{name}:total", time.time() - t_all)

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
        targets = [(pod["parent"], f"pod {pod['name']}") for pod in self.model.live_pods().values()]
        targets += [("/kubepods/burstable", "burstable QoS cgroup"), ("/kubepods/besteffort", "besteffort QoS cgroup"),
                    ("/kubepods", "kubepods (node allocatable)")]
        for path, subject in targets:
            self.report.check(self.name, "reset", subject, f"{CGROOT}{path}/memory.min", "0",
                              cg_read(path, "memory.min"), "reset writes 0 where the shim wrote memory.min")
        snapshot(self.snap, f"{self.name}: reset")

    def teardown(self) -> None:
        """Stop the shim, remove every pod straight through containerd, remove the kubepods tree:
        the next scenario starts on a clean node."""
        from shim.cri import api_pb2 as pb

        if self.shim.proc and self.shim.proc.poll() is None:
            self.shim.kill(signal.SIGTERM)
        if self.shim_cri:
            self.shim_cri.close()
        try:
            for sb in self.direct.call("ListPodSandbox", pb.ListPodSandboxRequest()).items:
                self.direct.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sb.id))
                self.direct.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id))
        except Exception as e:  # noqa: BLE001
            log(f"teardown: {e}")
        remove_cgroup_tree("kubepods")
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
def start_containerd(out_logs: str, images: list[str], systemd: bool, report: Report):
    from shim.cri import api_pb2 as pb

    t = time.time()
    for d in ("containerd", "cni/bin", "cni/net.d"):
        os.makedirs(os.path.join(RUN, d), exist_ok=True)
    with open(os.path.join(HERE, "containerd.toml.in")) as f:
        conf = f.read().replace("@ROOT@", RUN).replace("@SYSTEMD_CGROUP@", "true" if systemd else "false")
    conf_path = os.path.join(RUN, "containerd", "config.toml")
    with open(conf_path, "w") as f:
        f.write(conf)
    shutil.copy(conf_path, os.path.join(out_logs, "containerd.toml"))
    proc = spawn(["containerd", "--config", conf_path], "system.slice/containerd.service",
                 os.path.join(out_logs, "containerd.log"))
    wait_for_socket(CONTAINERD_SOCK, proc, 240, "containerd")
    report.timing("containerd-start", time.time() - t)
    t = time.time()
    for tar in images:
        p = subprocess.run(["ctr", "-a", CONTAINERD_SOCK, "-n", "k8s.io", "images", "import", tar],
                           capture_output=True, text=True, timeout=600)
        with open(os.path.join(out_logs, "ctr-import.log"), "a") as f:
            f.write(f"$ ctr images import {tar}\n{p.stdout}{p.stderr}exit {p.returncode}\n")
        if p.returncode != 0:
            raise InfraError(f"ctr images import {tar} failed: {p.stderr.strip()[-500:]}")
    cri = Cri(CONTAINERD_SOCK)
    deadline = time.time() + 120
    try:
        for ref in ("localhost/pause:e2e", "localhost/busybox:latest"):
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


def guest_facts() -> dict:
    facts = {"kernel": os.uname().release}
    try:
        facts["mem_total_kb"] = int(open("/proc/meminfo").readline().split()[1])
        facts["pid1"] = open("/proc/1/comm").read().strip()
        facts["cgroup_controllers"] = open(os.path.join(CGROOT, "cgroup.controllers")).read().split()
        facts["nproc"] = os.cpu_count()
        for tool in (["containerd", "--version"], ["runc", "--version"]):
            facts[tool[0]] = subprocess.run(tool, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001
        facts["error"] = str(e)
    return facts


def systemd_usable() -> tuple[bool, str]:
    pid1 = open("/proc/1/comm").read().strip()
    if pid1 == "systemd" and os.path.isdir("/run/systemd/system"):
        return True, ""
    return False, (f"the guest's PID 1 is {pid1!r}, not systemd: runc's systemd cgroup driver creates "
                   "scopes and slices through systemd over D-Bus, which a virtme-ng guest does not run")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--images", required=True, help="directory with busybox.tar and pause.tar")
    ap.add_argument("--trace", action="append", required=True, help="NAME=PATH of a recorded kubelet trace")
    ap.add_argument("--manifests", default="")
    ap.add_argument("--driver", default="all", help="cgroupfs, systemd or all")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the reconciler gets to converge")
    args = ap.parse_args(argv)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(args.out, "guest-started"), "w") as f:
        f.write(f"{time.time()}\n")
    report = Report(args.out)
    report.data["guest"] = guest_facts()
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
        images = [os.path.join(args.images, n) for n in ("pause.tar", "busybox.tar")]
        containerd = start_containerd(logs, images, False, report)
        log("containerd ready, images imported")
        for spec in args.trace:
            name, path = spec.split("=", 1)
            scenario = Scenario(args, report, path, name, reconciler)
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
