"""The classes scenario of the real-kernel suite (e2e/guest.py --classes): memory QoS classes
chosen by pod annotation, pods created THROUGH THE PRODUCT.

The shim (`memqos-shim serve`, proxy mode, in front of containerd) runs with a config file that
defines three classes and which namespaces may use them (CONFIG below); kubelet-shaped pods are
created through its socket (shim/tools/kubelet_requests.py builds the requests as a gate-off
kubelet fills them in: the shim owns every value, container and pod / QoS / kubepods alike):

  * created: every container's memory.min / memory.low / memory.high / memory.max read back and
    compared with the class's expectation (e2e/expect.py's arithmetic with the class's factor and
    policy); a refused annotation (a class the pod's namespace may not use, a malformed value, an
    unknown class) reads exactly what its unannotated twin reads, and the create's audit record
    carries ``class`` (null when refused) and ``class_refused``; the pod / QoS / kubepods memory.min
    the reconciler writes leave out the container of the class without protection;
  * reclaim: a page-cache reader of class "batch" (factor 0.5, reclaim on; the node's reclaim is
    off) and its unannotated twin read a sparse file: `reclaim` audit records for the batch reader
    only;
  * updated: a kubelet-shaped UpdateContainerResources (which carries no annotation) for class containers: the class's
    values stay (the batch one with a new limit: memory.high from the class's factor 0.5 and the
    new limit);
  * shim restarted (SIGKILL, new process): the same values, an update after the restart keeps the
    class (remembered from the container's annotation memqos.io/request), and the pod / QoS sums
    still leave the unprotected class out;
  * NRI (--classes nri, containerd's NRI on): the proxy stopped, `memqos-shim nri` started with the
    same config: after its Synchronize the proxy's pods keep their class values; a subset of the
    pods created again (new names) straight at containerd: the same values as the proxy gave the
    same pods, the same audit class fields, the sums over both sets.

Expectations are computed (``expected``, ``pod_protection``), never written as numbers;
tests/test_e2e_classes.py checks on the host that they equal the product's own decision
(shim.decision with the config parsed by shim.app.config) for every pod of this scenario.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field, replace

import expect as X  # e2e/expect.py: independent arithmetic
from guest_common import (
    CGROOT, CONTAINERD_SOCK, MI, RUN, Cri, InfraError, Report, SHIM_SOCK, Shim, cg_read, log, metric,
    read_audit, remove_cgroup_tree, remove_every_pod, scrape_metrics, snapshot, spawn
)

SCN = "classes"
KUBELET_VERSION = "1.35"  # gate off: the shim owns container, pod, QoS and kubepods values
NODE_FACTOR = 0.9  # the shim's default factor (the kubelet config sets none)
CLASS_ANNOTATION = "memqos.io/class"
CONTAINER_PREFIX = "memqos.io/class."

# the config file's keys (written as YAML by guest_common.Shim); the node's reclaim is off
CLASSES = {
    "latency-critical": {"factor": "none"},
    "batch": {"factor": 0.5, "reclaim": True},
    "unprotected": {"policy": "None"},
}
NAMESPACE_CLASSES = {"default": ["latency-critical", "batch", "unprotected"], "tenant": ["batch"]}
CONFIG = {"classes": CLASSES, "namespace-classes": NAMESPACE_CLASSES,
          "guard-window": 10, "guard-cooldown": 600}
NODE_SETTINGS = ("--kubelet-version", KUBELET_VERSION, "--reclaim", "false")


@dataclass(frozen=True)
class Ctr:
    name: str
    kind: str  # "sleep" or "reader" (page cache)
    request: int
    limit: int
    want_class: str | None  # the class it must get
    refused: str = ""  # the refusal reason its audit record must carry


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    annotations: dict
    containers: tuple[Ctr, ...]
    nri: bool = False  # created again through `memqos-shim nri`
    twin: str = ""  # the pod whose values it must read (same shape, node settings)


R, L = 32 * MI, 160 * MI
RR, RL = 16 * MI, 128 * MI  # the readers: batch memory.high 72 MiB, the node's 116 MiB


def _one(want: str | None, refused: str = "", kind: str = "sleep", r: int = R, lim: int = L) -> tuple[Ctr, ...]:
    return (Ctr("main", kind, r, lim, want, refused),)


PODS = (
    Pod("cls-twin", "default", {}, _one(None), nri=True),
    Pod("cls-lc", "default", {CLASS_ANNOTATION: "latency-critical"}, _one("latency-critical"), nri=True),
    Pod("cls-unprot", "default", {CLASS_ANNOTATION: "unprotected"}, _one("unprotected"), nri=True),
    Pod("cls-denied", "tenant", {CLASS_ANNOTATION: "latency-critical"}, _one(None, "namespace-not-allowed"),
        nri=True, twin="cls-twin"),
    Pod("cls-malformed", "default", {CLASS_ANNOTATION: "Latency_Critical!"}, _one(None, "malformed"),
        twin="cls-twin"),
    Pod("cls-unknown", "default", {CLASS_ANNOTATION: "gold"}, _one(None, "unknown-class"), twin="cls-twin"),
    Pod("cls-mixed", "default", {CLASS_ANNOTATION: "batch", CONTAINER_PREFIX + "side": "latency-critical"},
        (Ctr("main", "sleep", R, L, "batch"), Ctr("side", "sleep", R, L, "latency-critical")), nri=True),
    Pod("cls-batch", "default", {CLASS_ANNOTATION: "batch"}, _one("batch", kind="reader", r=RR, lim=RL)),
    Pod("cls-reader", "default", {}, _one(None, kind="reader", r=RR, lim=RL)),
)
RESIZED = ("cls-mixed", "main", 192 * MI)  # the update with a new limit


def oom_score_adj(request: int, capacity: int) -> int:
    """The kubelet's oom_score_adj of a Burstable container (kubelet_requests.oom_score_adj)."""
    adj = 1000 - (1000 * request) // capacity
    return 3 if adj < 3 else 999 if adj == 1000 else adj


def expected(c: Ctr, node: X.Node, limit: int | None = None) -> X.ContainerExpectation:
    """What the container's cgroup must hold: e2e/expect.py's arithmetic over the node's settings,
    with what the container's class changes (factor; policy None: no memory.min / memory.low)."""
    limit = c.limit if limit is None else limit
    settings = CLASSES.get(c.want_class or "", {})
    if "factor" in settings:
        f = settings["factor"]
        node = replace(node, factor=None if f == "none" else float(f))
    exp = X.container_expectation(X.BURSTABLE, limit, oom_score_adj(c.request, node.capacity), {}, node)
    if str(settings.get("policy", "")).lower() == "none":
        exp.min, exp.low = 0, 0
        exp.why["memory.min"] = f"class {c.want_class}: policy None"
    if c.want_class:
        exp.why["class"] = c.want_class
    return exp


def protects(c: Ctr) -> bool:
    return str(CLASSES.get(c.want_class or "", {}).get("policy", "")).lower() != "none"


def pod_protection(pod: Pod, node: X.Node) -> int:
    """The pod's memory.min the reconciler writes: its protected containers' requests."""
    return X.pod_request([expected(c, node).request.bytes for c in pod.containers if protects(c)], [])


@dataclass
class Live:
    spec: Pod
    uid: str
    sandbox: str
    parent: str
    ids: dict = field(default_factory=dict)  # container name -> id
    limits: dict = field(default_factory=dict)  # container name -> the limit in force


class ClassesScenario:
    MEASURE_RECLAIM = 90.0
    CHUNK_MIB, SLEEP_US = 2, 250000

    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.logs = os.path.join(args.out, "logs")
        self.work = os.path.join(RUN, SCN)
        self.data_dir = os.path.join(self.work, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        capacity = int(open("/proc/meminfo").readline().split()[1]) * 1024
        self.node = X.Node(capacity=capacity, page=os.sysconf("SC_PAGE_SIZE"), factor=NODE_FACTOR)
        self.kubelet_config = os.path.join(self.work, "kubelet-config.json")
        with open(self.kubelet_config, "w") as f:
            json.dump({"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
                       "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/",
                       "featureGates": {"MemoryQoS": False}}, f)
        self.metrics_address = "127.0.0.1:9473"
        self.shim = Shim(args.python, self.logs, SCN, self.kubelet_config, "/proc/meminfo",
                         NODE_SETTINGS + ("--monitor-interval", "1", "--metrics-address", self.metrics_address),
                         CONFIG)
        self.cri: Cri | None = None
        self.direct = Cri(CONTAINERD_SOCK)
        self.plugin = None
        self.readers_done = False
        self.leftover: list[str] = []  # pods of an earlier scenario the runtime did not remove
        self.device = ""
        self.pods: dict[str, Live] = {}
        self.proxy_values: dict[str, str] = {}
        self.snap = os.path.join(self.logs, "classes-cgroups.txt")
        self.data: dict = {"config": CONFIG, "node": {"capacity": capacity, "factor": NODE_FACTOR}, "summary": []}
        report.data["classes"] = self.data

    def note(self, line: str) -> None:
        self.data["summary"].append(line)
        log(f"classes: {line}")

    def check(self, step, subject, file, expected_, actual, why="", source="cgroupfs", ok=None) -> bool:
        return self.report.check(SCN, step, subject, file, str(expected_), str(actual), why, source, ok)

    # -- the page-cache data (as the reclaim scenario): sparse files on ext4, holes read as cache
    def setup_data(self) -> None:
        def run(*cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)

        img = os.path.join(self.work, "disk.img")
        with open(img, "wb") as f:
            f.truncate(64 * MI)
        run("modprobe", "loop")
        q = run("losetup", "-f", "--show", img)
        if q.returncode != 0:
            raise InfraError(f"no loop device for the readers' data: {q.stderr.strip()}")
        self.device = q.stdout.strip()
        run("modprobe", "ext4")
        for cmd in (("mkfs.ext4", "-q", "-F", "-b", "4096", self.device), ("mount", "-t", "ext4", self.device,
                                                                            self.data_dir)):
            r = run(*cmd)
            if r.returncode != 0:
                raise InfraError(f"{' '.join(cmd)}: {r.stderr.strip()[-300:]}")
        for pod in PODS:
            with open(os.path.join(self.data_dir, f"{pod.name}.img"), "wb") as f:
                f.truncate(4 << 30)

    # -- pods -----------------------------------------------------------------------------------------
    def create(self, cri: Cri, spec: Pod, suffix: str = "") -> Live:
        from shim.cri import api_pb2 as pb
        from shim.tools import kubelet_requests as K

        uid = str(uuid.uuid4())
        sb = K.sandbox_config(spec.name + suffix, uid, "burstable", namespace=spec.namespace,
                              annotations=spec.annotations)
        sb.linux.security_context.namespace_options.pid = pb.CONTAINER
        sid = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sb)).pod_sandbox_id
        live = Live(spec, uid, sid, sb.linux.cgroup_parent)
        for c in spec.containers:
            req = K.create_container(sid, sb, c.name, "burstable", request=c.request, limit=c.limit,
                                     capacity=self.node.capacity)
            cfg = req.config
            del cfg.command[:]
            if c.kind == "reader":
                script = (f"trap 'exit 0' TERM; i=0; while :; do dd if=/data/{spec.name}.img of=/dev/null bs=1048576 "
                          f"count={self.CHUNK_MIB} skip=$((i*{self.CHUNK_MIB})) 2>/dev/null; i=$((i+1)); "
                          f"usleep {self.SLEEP_US}; done")
                cfg.mounts.append(pb.Mount(container_path="/data", host_path=self.data_dir, readonly=True))
            else:
                script = "trap 'exit 0' TERM; while :; do sleep 1; done"
            cfg.command.extend(["sh", "-c", script])
            cfg.linux.security_context.namespace_options.network = pb.NODE
            cfg.linux.security_context.namespace_options.pid = pb.CONTAINER
            cid = cri.call("CreateContainer", req).container_id
            cri.call("StartContainer", pb.StartContainerRequest(container_id=cid))
            live.ids[c.name], live.limits[c.name] = cid, c.limit
        self.pods[spec.name + suffix] = live
        return live

    def remove_pods(self) -> None:
        remove_every_pod(self.direct, self.report, "classes: removing the pods", timeout=120)
        self.pods.clear()
        remove_cgroup_tree("kubepods")

    # -- checks ---------------------------------------------------------------------------------------
    def read(self, live: Live, name: str) -> dict[str, str]:
        cg = f"{live.parent}/{live.ids[name]}"
        return {k: cg_read(cg, k) for k in ("memory.min", "memory.low", "memory.high", "memory.max")}

    def check_values(self, step: str, suffix: str = "") -> dict[str, str]:
        """Each container's values against its expectation; a refused one also against its twin's
        reading. Returns {pod/container key: value} for the NRI comparison."""
        page = self.node.page
        out = {}
        for spec in PODS:
            live = self.pods.get(spec.name + suffix)
            if live is None:
                continue
            for c in spec.containers:
                if c.kind == "reader" and self.readers_done:
                    continue
                exp = expected(c, self.node, live.limits[c.name])
                got = self.read(live, c.name)
                why = "; ".join(f"{k}: {v}" for k, v in exp.why.items())
                subject = f"{spec.namespace}/{live.spec.name}{suffix}/{c.name} (class {c.want_class}" + \
                          (f", refused: {c.refused})" if c.refused else ")")
                for key, value in (("memory.min", exp.min), ("memory.low", exp.low), ("memory.high", exp.high),
                                   ("memory.max", exp.max)):
                    want = "0" if key in ("memory.min", "memory.low") and not value else X.kernel_reads(value, page)
                    self.check(step, subject, f"{CGROOT}{live.parent}/{live.ids[c.name]}/{key}", want, got[key], why)
                    out[f"{spec.name}/{c.name} {key}"] = got[key]
                twin = self.pods.get(spec.twin + suffix) if spec.twin else None
                if twin is not None:
                    theirs = self.read(twin, c.name)
                    self.check(step, f"{subject} vs its unannotated twin {spec.twin}", "memory.min/low/high/max",
                               json.dumps(theirs), json.dumps(got), "a refused annotation gets the node's settings")
        return out

    def check_audit(self, step: str, audit_log: str, suffix: str = "") -> None:
        recs = read_audit(audit_log)
        for spec in PODS:
            live = self.pods.get(spec.name + suffix)
            if live is None:
                continue
            for c in spec.containers:
                cid = live.ids[c.name]
                mine = [r for r in recs if r.get("container_id") == cid and r.get("method") in
                        ("CreateContainer", "CreateContainer (NRI)") and r.get("event") in ("rewrite", "unchanged")]
                r = mine[0] if mine else {}
                subject = f"{spec.namespace}/{spec.name}{suffix}/{c.name}"
                self.check(step, subject, f"{audit_log}: create record 'class'", c.want_class, r.get("class", "(absent)")
                           if mine else "(no create record)", "the class in force", "audit log")
                self.check(step, subject, f"{audit_log}: create record 'class_refused'", c.refused or "(absent)",
                           r.get("class_refused", "(absent)"), "why an annotation was refused" if c.refused else
                           "nothing refused", "audit log")
                if c.refused:
                    note = r.get("class_note", "")
                    self.check(step, subject, f"{audit_log}: create record 'class_note'", "names the annotation",
                               note or "(absent)", "an audit note naming why", "audit log",
                               ok=CLASS_ANNOTATION in note)

    def check_pod_level(self, step: str, settle: float | None = None) -> None:
        page = self.node.page
        wanted = []
        total = 0
        for name, live in self.pods.items():
            v = pod_protection(live.spec, self.node)
            total += v
            left = [c.name for c in live.spec.containers if not protects(c)]
            wanted.append((live.parent, X.kernel_reads(v, page), f"pod {name}",
                           "sum of its protected containers' requests" + (f" ({left} of class unprotected left out)"
                                                                          if left else "")))
        if self.leftover:
            self.report.skip(SCN, f"{step}: burstable / kubepods memory.min (expected {total})",
                             f"pods of an earlier scenario still there: {self.leftover}")
        else:
            wanted.append(("/kubepods/burstable", X.kernel_reads(total, page), "burstable QoS cgroup",
                           f"sum of the pods' protected requests = {total}"))
            wanted.append(("/kubepods", X.kernel_reads(total, page), "kubepods", "Burstable sum (no Guaranteed pod)"))
        deadline = time.time() + (self.args.settle if settle is None else settle)
        while True:
            actual = [cg_read(p, "memory.min") for p, *_ in wanted]
            if all(a == w[1] for a, w in zip(actual, wanted)) or time.time() > deadline:
                break
            time.sleep(0.5)
        for (path, want, subject, why), got in zip(wanted, actual):
            self.check(step, subject, f"{CGROOT}{path}/memory.min", want, got, why)

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> None:
        from shim.cri import api_pb2 as pb

        self.t0 = time.time()
        left = self.direct.call("ListPodSandbox", pb.ListPodSandboxRequest()).items
        if left:  # an earlier scenario's pod the runtime did not remove (docs/testing.md, "Stack matrix")
            remove_every_pod(self.direct, self.report, "classes: an earlier scenario's pods", timeout=60)
            left = self.direct.call("ListPodSandbox", pb.ListPodSandboxRequest()).items
            self.leftover = [f"{sb.metadata.namespace}/{sb.metadata.name}" for sb in left]
            if left:
                self.note(f"pods of an earlier scenario the runtime did not remove: {self.leftover}; the burstable "
                          "and kubepods sums are not asserted (they may hold those pods' requests)")
        self.setup_data()
        self.report.data["scenarios"].append({"name": SCN, "config": CONFIG})
        dt = self.shim.start()
        self.note(f"shim (proxy) with classes {sorted(CLASSES)} serving after {dt:.1f}s")
        self.cri = Cri(SHIM_SOCK)
        t_created = time.time()
        for spec in PODS:
            self.create(self.cri, spec)
        self.report.timing("classes:create-proxy-pods", time.time() - t_created)
        self.note(f"{len(PODS)} pods created through the shim in {time.time() - t_created:.0f}s")
        self.proxy_values = self.check_values("created")
        self.check_audit("created", self.shim.audit_log)
        self.check_pod_level("created")
        snapshot(self.snap, "classes: created")
        self.reclaim(t_created)
        self.readers_done = True  # their values are checked up to here (the guard may relax the twin's later)
        self.update("updated")
        self.restart()
        if self.args.classes == "nri":
            self.nri()
        else:
            self.report.skip(SCN, "classes through memqos-shim nri", "containerd runs without NRI in this boot "
                             "(a scenario without +nri: --classes proxy)")
        self.report.timing("classes:run", time.time() - self.t0)

    def reclaim(self, t0: float) -> None:
        batch, twin = self.pods["cls-batch"].ids["main"], self.pods["cls-reader"].ids["main"]
        deadline = max(t0, time.time()) + self.MEASURE_RECLAIM
        while time.time() < deadline:
            if any(r.get("event") == "reclaim" and r.get("container_id") == batch
                   for r in read_audit(self.shim.audit_log)):
                break
            time.sleep(1)
        time.sleep(5)
        recs = [r for r in read_audit(self.shim.audit_log) if r.get("event") == "reclaim"]
        by = {}
        for r in recs:
            by[r.get("container_id")] = by.get(r.get("container_id"), 0) + 1
        names = {cid: f"{n}/{c}" for n, live in self.pods.items() for c, cid in live.ids.items()}
        self.check("reclaim", "default/cls-batch/main (class batch: reclaim true)", "audit: reclaim records", ">= 1",
                   by.get(batch, 0), "the class turns reclaim on for this container", "audit log",
                   ok=by.get(batch, 0) >= 1)
        self.check("reclaim", "default/cls-reader/main (node settings: reclaim false)", "audit: reclaim records", "0",
                   by.get(twin, 0), "the node's reclaim is off: its twin reader is left alone", "audit log")
        self.check("reclaim", "every other container", "audit: containers with reclaim records",
                   "only default/cls-batch/main", sorted(names.get(c, c) for c in by) or "(none)",
                   "reclaim for the batch reader only", "audit log", ok=set(by) <= {batch})
        m = scrape_metrics(self.metrics_address)
        freed = metric(m, "memqos_container_reclaimed_bytes_total", container_id=batch) or 0
        self.check("reclaim", "default/cls-batch/main", f"http://{self.metrics_address}/metrics "
                   "memqos_container_reclaimed_bytes_total", "> 0", freed, "", "metrics", ok=freed > 0)
        live = self.pods["cls-batch"]
        high = X.kernel_reads(expected(live.spec.containers[0], self.node).high, self.node.page)
        self.check("reclaim", "default/cls-batch/main", f"{CGROOT}{live.parent}/{batch}/memory.high", high,
                   self.read(live, "main")["memory.high"], "reclaim leaves the class's memory.high in force")
        guard = sorted({f"{names.get(r.get('container_id'), r.get('container_id'))}: {r['event']}"
                        for r in read_audit(self.shim.audit_log) if str(r.get("event", "")).startswith("guard-")})
        self.data["reclaim"] = {"records_by_container": {names.get(k, k): v for k, v in by.items()},
                                "reclaimed_bytes": freed, "guard_records": guard}
        self.note(f"reclaim records by container: {self.data['reclaim']['records_by_container']}, "
                  f"{freed / MI:.1f} MiB reclaimed from the batch reader; guard records: {guard or 'none'}")

    def update(self, step: str) -> None:
        """Kubelet-shaped updates (no annotation) of the class containers through the shim."""
        from shim.tools import kubelet_requests as K

        for name, cname in (("cls-lc", "main"), ("cls-unprot", "main"), ("cls-mixed", "side")):
            live = self.pods[name]
            c = next(x for x in live.spec.containers if x.name == cname)
            self.cri.call("UpdateContainerResources", K.update_resources(
                live.ids[cname], limit=live.limits[cname], oom_score_adj=oom_score_adj(c.request, self.node.capacity)))
        name, cname, new = RESIZED
        live = self.pods[name]
        c = next(x for x in live.spec.containers if x.name == cname)
        self.cri.call("UpdateContainerResources", K.update_resources(
            live.ids[cname], limit=new, oom_score_adj=oom_score_adj(c.request, self.node.capacity)))
        live.limits[cname] = new
        self.check_values(step)
        self.check_pod_level(step)
        snapshot(self.snap, f"classes: {step}")

    def restart(self) -> None:
        self.cri.close()
        self.shim.kill(signal.SIGKILL)
        dt = self.shim.start()
        self.cri = Cri(SHIM_SOCK)
        self.note(f"shim killed (SIGKILL) and restarted: serving after {dt:.1f}s")
        self.check_values("shim restarted")
        self.check_pod_level("shim restarted")
        self.update("updated after the restart")

    # -- NRI --------------------------------------------------------------------------------------------
    def nri(self) -> None:
        self.cri.close()
        self.cri = None
        self.shim.kill(signal.SIGTERM)
        audit = os.path.join(self.logs, "classes-nri-audit.jsonl")
        path = os.path.join(self.logs, f"{SCN}-config.yaml")  # the proxy's config file, as written
        args = ["nri", "--nri-socket", "/var/run/nri/nri.sock", "--kubelet-config", self.kubelet_config,
                "--cgroup-root", CGROOT, "--meminfo", "/proc/meminfo", "--audit-log", audit, "--config", path,
                *NODE_SETTINGS]
        plog = os.path.join(self.logs, "classes-nri-plugin.log")
        env = dict(self.shim.env())
        with open(plog, "a") as f:
            f.write(f"==== start: {self.args.python} -m shim {' '.join(args)}\n")
        self.plugin = spawn([self.args.python, "-m", "shim", *args], "system.slice/memqos-shim.app.service", plog,
                            env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        t = time.time()
        while not any(r.get("event") == "nri-synchronize" for r in read_audit(audit)):
            if self.plugin.poll() is not None:
                raise InfraError(f"memqos-shim nri exited with code {self.plugin.returncode} ({plog})")
            if time.time() - t > 240:
                raise InfraError(f"memqos-shim nri: no Synchronize after 240 s ({plog})")
            time.sleep(0.2)
        self.note(f"memqos-shim nri registered after {time.time() - t:.1f}s")
        # the proxy's pods stay (removing pods mid-run is slow on this runtime, docs/testing.md "Stack
        # matrix"): the plugin's Synchronize takes them over with the class each was created with
        time.sleep(3)  # containerd applies the Synchronize reply's updates after the plugin audited it
        self.check_values("NRI plugin synchronized (the proxy's pods)")
        for spec in PODS:
            if spec.nri:
                self.create(self.direct, spec, "-nri")
        got = self.check_values("NRI mode", "-nri")
        self.check_audit("NRI mode", audit, "-nri")
        self.check_pod_level("NRI mode")
        same = 0
        for key, value in sorted(got.items()):
            p = self.proxy_values.get(key, "(none)")
            same += p == value
            self.check("NRI mode: same as proxy mode", key, key, p, value, "the value proxy mode gave the same pod",
                       "nri")
        self.note(f"NRI mode: {same}/{len(got)} values equal to proxy mode's")
        snapshot(self.snap, "classes: NRI mode")

    def teardown(self) -> None:
        t = time.time()
        if self.cri:
            self.cri.close()
        if self.shim.proc and self.shim.proc.poll() is None:
            self.shim.kill(signal.SIGTERM)
        if self.plugin is not None and self.plugin.poll() is None:
            self.plugin.terminate()
            try:
                self.plugin.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.plugin.kill()
        try:
            self.remove_pods()
        except Exception as e:  # noqa: BLE001
            log(f"classes teardown: {e}")
        subprocess.run(["umount", self.data_dir], capture_output=True)
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
        self.direct.close()
        self.report.timing("classes:teardown", time.time() - t)
