#!/usr/bin/env python3
"""Guest side of the systemd scenario (scripts/e2e-vm --guest systemd): systemd is PID 1,
containerd runs with runc's systemd cgroup driver (SystemdCgroup = true), and this checkout's
shim sits in front of it with a KubeletConfiguration that says cgroupDriver: systemd.

Runs as e2e-driver.service in the guest built by scripts/e2e-systemd-image. Steps:
  1. as the kubelet's systemd cgroup manager does, start kubepods.slice,
     kubepods-burstable.slice and kubepods-besteffort.slice as transient slice units
     (StartTransientUnit over D-Bus, memory accounting on, kubepods with MemoryMax =
     allocatable); start containerd as a transient service; import the local images;
  2. phase "cgroupfs": a shim with --systemd-writes cgroupfs; four pods built the way the
     kubelet builds them (pod slice started first, then RunPodSandbox with cgroup_parent
     kubepods[-qos]-pod<uid_>.slice, CreateContainer, StartContainer): Guaranteed, Burstable
     with and without limit, BestEffort. Checks: each container's cri-containerd-<id>.scope
     memory.min/high/max (e2e/expect.py), each sandbox scope, pod/QoS/kubepods memory.min and
     memory.low. Then, with the shim frozen (SIGSTOP), what the kubelet and systemd do to a
     node: `systemctl daemon-reload`, SetUnitProperties(kubepods.slice, MemoryMax, CPUWeight)
     and SetUnitProperties(kubepods-burstable.slice, CPUWeight). Checks that systemd reset
     the values the shim wrote to cgroupfs (the known problem: the check fails if it does
     not happen, i.e. if this test could not tell the two ways apart), then that the shim,
     thawed, restores them within one resync (measured);
  3. phase "dbus": a new shim with --systemd-writes MODE (auto by default: through systemd,
     since the driver is systemd and systemd is PID 1); the values, and systemd's own
     MemoryMin/MemoryLow of every unit; then the same reload and SetUnitProperties with the
     shim frozen: the values must still be there; a pod removed (the slice stopped as the
     kubelet does): lowered sums, again surviving a reload; the shim stopped and `memqos-shim
     reset` run: every value 0, still 0 after a reload (a reset that wrote only cgroupfs
     would be undone by systemd);
  4. OUT/report-guest.json (checks like e2e/guest.py's) and logs under OUT/logs.
Then, with --wheelhouse, phase "install" (e2e/guest_install.py): deploy/install.sh from a wheel
and its wheelhouse, traffic through the installed unit, a kill -9 crash loop, deploy/uninstall.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, CHECKOUT)

import expect as X  # noqa: E402
import guest_install  # noqa: E402  (phase "install": deploy/install.sh, the crash loop, uninstall.sh)
from guest_common import (  # noqa: E402
    CGROOT, CONTAINERD_SOCK, Cri, InfraError, RUN, Report, SHIM_SOCK, T0, cg_read, log, read_audit
)
from guest_stack import guest_facts, load_stack, systemd_usable  # noqa: E402
from guest_systemd_phases import NO_PATH, SCENARIO, SystemdPhases  # noqa: E402  (phases cgroupfs, dbus)

MI = 1 << 20
FACTOR = 0.9
LEVEL_FILES = ("memory.min", "memory.low")


class Guest(SystemdPhases):
    def __init__(self, args, report: Report):
        self.args = args
        self.report = report
        self.logs = os.path.join(args.out, "logs")
        self.cmdlog = os.path.join(self.logs, "systemd-commands.log")
        self.work = os.path.join(RUN, "systemd")
        os.makedirs(self.work, exist_ok=True)
        capacity = int(open("/proc/meminfo").readline().split()[1]) * 1024
        self.node = X.Node(capacity=capacity, page=os.sysconf("SC_PAGE_SIZE"), factor=FACTOR)
        self.kubelet_config = os.path.join(self.work, "kubelet-config.json")
        with open(self.kubelet_config, "w") as f:  # JSON is YAML
            json.dump({"kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
                       "cgroupDriver": "systemd", "cgroupsPerQOS": True, "cgroupRoot": "/",
                       # the kubelet writes no memory values itself (gate off), so every value is the
                       # shim's; the factor is the shim's memory.high factor (--factor auto reads it)
                       "featureGates": {"MemoryQoS": False}, "memoryThrottlingFactor": FACTOR}, f)
        self.pods: dict[str, dict] = {}
        self.shim_unit: str | None = None
        self.phase = ""
        self.data: dict = {"phases": {}, "restore": {}}
        report.data["systemd"] = self.data

    # -- commands
    def run(self, argv: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        t = time.time()
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        with open(self.cmdlog, "a") as f:
            f.write(f"[t+{t - T0:.1f}s {time.time() - t:.2f}s] $ {' '.join(argv)}\n{p.stdout}{p.stderr}"
                    f"exit {p.returncode}\n")
        if check and p.returncode != 0:
            raise InfraError(f"{' '.join(argv[:6])} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-400:]}")
        return p

    def busctl(self, method: str, signature: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(["busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                         "org.freedesktop.systemd1.Manager", method, signature, *args], check=check)

    @staticmethod
    def props(props: list[tuple[str, str, str]]) -> list[str]:
        out = [str(len(props))]
        for name, sig, value in props:
            out += [name, sig, value]
        return out

    def start_slice(self, name: str, props: list[tuple[str, str, str]]) -> str:
        """A transient slice like the kubelet's (libcontainer's systemd manager): accounting on,
        no default dependencies, wanted by its parent slice."""
        words = name[: -len(".slice")].split("-")
        parent = "-".join(words[:-1]) + ".slice" if len(words) > 1 else "-.slice"
        base = [("Description", "s", f"memqos e2e (kubelet-like) {name}"), ("DefaultDependencies", "b", "false"),
                ("MemoryAccounting", "b", "true"), ("CPUAccounting", "b", "true"), ("TasksAccounting", "b", "true"),
                ("IOAccounting", "b", "true")]
        if parent != "-.slice":
            base.append(("Wants", "as", f"1 {parent}"))
        flat = []
        for n, s, v in base + props:
            flat += [n, s, *v.split(" ")] if s == "as" else [n, s, v]
        self.busctl("StartTransientUnit", "ssa(sv)a(sa(sv))", name, "replace", str(len(base + props)), *flat, "0")
        path = "/".join(["-".join(words[: i + 1]) + ".slice" for i in range(len(words))])
        deadline = time.time() + 30
        while not os.path.isfile(os.path.join(CGROOT, path, "memory.min")):
            if time.time() > deadline:
                raise InfraError(f"slice {name}: no {CGROOT}/{path}/memory.min after 30 s")
            time.sleep(0.1)
        return path

    def set_unit_properties(self, unit: str, props: list[tuple[str, str, str]]) -> None:
        flat = []
        for n, s, v in props:
            flat += [n, s, v]
        self.busctl("SetUnitProperties", "sba(sv)", unit, "true", str(len(props)), *flat)

    def show(self, unit: str, prop: str) -> str:
        return self.run(["systemctl", "show", "-p", prop, "--value", unit], check=False).stdout.strip()

    # -- containerd and the shim
    def start_containerd(self) -> None:
        t = time.time()
        for d in ("containerd", "cni/bin", "cni/net.d"):
            os.makedirs(os.path.join(RUN, d), exist_ok=True)
        with open(os.path.join(HERE, "containerd.toml.in")) as f:
            conf = f.read().replace("@ROOT@", RUN).replace("@SYSTEMD_CGROUP@", "true")
        conf = conf.replace("@RUNC@", shutil.which("runc") or "runc")  # the image's runc
        conf_path = os.path.join(RUN, "containerd", "config.toml")
        with open(conf_path, "w") as f:
            f.write(conf)
        with open(os.path.join(self.logs, "containerd.toml"), "w") as f:
            f.write(conf)
        clog = os.path.join(self.logs, "containerd.log")
        # as Debian's containerd.service: delegated, only the main process killed on stop
        self.run(["systemd-run", "--unit=e2e-containerd", "--collect", "-p", "Delegate=yes", "-p", "KillMode=process",
                  "-p", f"StandardOutput=append:{clog}", "-p", f"StandardError=append:{clog}",
                  "containerd", "--config", conf_path])
        deadline = time.time() + 240
        while not os.path.exists(CONTAINERD_SOCK):
            if time.time() > deadline:
                raise InfraError(f"containerd: no socket after 240 s ({self.show('e2e-containerd', 'ActiveState')})")
            time.sleep(0.2)
        self.report.timing("containerd-start", time.time() - t)
        t = time.time()
        for name in ("pause.tar", "busybox.tar"):
            tar = os.path.join(self.args.images, name)
            p = self.run(["ctr", "-a", CONTAINERD_SOCK, "-n", "k8s.io", "images", "import", tar], check=False,
                         timeout=600)
            if p.returncode != 0:
                raise InfraError(f"ctr images import {tar} failed: {p.stderr.strip()[-500:]}")
        self.report.timing("images-import", time.time() - t)

    def start_shim(self, phase: str, writes: str) -> None:
        t = time.time()
        unit = f"memqos-shim-{phase}"
        self.audit_log = os.path.join(self.logs, f"{phase}-audit.jsonl")
        shim_log = os.path.join(self.logs, f"{phase}-shim.log")
        os.makedirs(os.path.dirname(SHIM_SOCK), exist_ok=True)
        if os.path.exists(SHIM_SOCK):
            os.unlink(SHIM_SOCK)
        self.run(["systemd-run", f"--unit={unit}", "--collect", f"--working-directory={CHECKOUT}",
                  f"--setenv=PYTHONPATH={CHECKOUT}", "--setenv=PYTHONDONTWRITEBYTECODE=1",
                  f"--setenv=PATH={NO_PATH}",  # nothing to run (no systemctl, as in the image): D-Bus only
                  "-p", f"StandardOutput=append:{shim_log}", "-p", f"StandardError=append:{shim_log}",
                  self.args.python, "-m", "shim", "serve", "--listen", f"unix://{SHIM_SOCK}",
                  "--upstream", f"unix://{CONTAINERD_SOCK}", "--kubelet-config", self.kubelet_config,
                  "--cgroup-root", CGROOT, "--audit-log", self.audit_log, "--monitor-interval", "0",
                  "--resync-interval", f"{self.args.resync:g}", "--systemd-writes", writes])
        self.shim_unit = unit
        from shim.cri import api_pb2 as pb

        deadline = time.time() + 240
        while not os.path.exists(SHIM_SOCK):
            if self.show(unit, "ActiveState") not in ("active", "activating"):
                raise InfraError(f"shim unit {unit} is {self.show(unit, 'ActiveState')}: see {shim_log}")
            if time.time() > deadline:
                raise InfraError("memqos-shim: no socket after 240 s")
            time.sleep(0.3)
        cri = Cri(SHIM_SOCK)
        try:
            while True:
                try:
                    cri.call("Version", pb.VersionRequest(), timeout=10)
                    break
                except cri.grpc.RpcError as e:
                    if time.time() > deadline:
                        raise InfraError(f"memqos-shim does not answer Version: {e.code().name}") from None
                    time.sleep(0.5)
        finally:
            cri.close()
        self.report.timing(f"{phase}:shim-start", time.time() - t)
        log(f"{phase}: shim serving after {time.time() - t:.1f}s (--systemd-writes {writes})")
        self.cri = Cri(SHIM_SOCK)

    def shim_pid(self) -> int:
        return int(self.show(self.shim_unit, "MainPID") or 0)

    def freeze_shim(self, frozen: bool) -> None:
        pid = self.shim_pid()
        if pid <= 0:
            raise InfraError(f"shim unit {self.shim_unit} has no main process")
        os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop_shim(self) -> None:
        if getattr(self, "cri", None):
            self.cri.close()
            self.cri = None
        if self.shim_unit:
            self.run(["systemctl", "stop", self.shim_unit], check=False)
            self.shim_unit = None

    def audit(self) -> list[dict]:
        return read_audit(self.audit_log)

    def writer_of_shim(self) -> str:
        """The `writes` of the shim's reconciler-active audit record (waits for the record)."""
        deadline = time.time() + self.args.settle
        while True:
            active = [r for r in self.audit() if r.get("event") == "reconciler-active"]
            if active or time.time() > deadline:
                return active[-1].get("writes", "(no writes field)") if active else "(no reconciler-active record)"
            time.sleep(0.5)

    # -- pods, the way the kubelet makes them on a systemd node
    def create_pod(self, name: str, qos: str, request: int, limit: int, unified: bool) -> dict:
        from shim.cri import api_pb2 as pb

        uid = str(uuid.uuid4())
        u = uid.replace("-", "_")
        qname = {X.BURSTABLE: "burstable", X.BESTEFFORT: "besteffort"}.get(qos)
        leaf = f"kubepods-{qname}-pod{u}.slice" if qname else f"kubepods-pod{u}.slice"
        props = [("MemoryMax", "t", str(limit))] if qos == X.GUARANTEED or (limit and qos == X.BURSTABLE) else []
        slice_path = self.start_slice(leaf, props)
        logdir = os.path.join(self.work, "pods", f"default_{name}_{uid}")
        os.makedirs(os.path.join(logdir, "main"), exist_ok=True)
        sb = pb.PodSandboxConfig()
        sb.metadata.name, sb.metadata.uid, sb.metadata.namespace = name, uid, "default"
        sb.log_directory = logdir
        sb.labels.update({"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": "default",
                          "io.kubernetes.pod.uid": uid})
        sb.linux.cgroup_parent = leaf  # the kubelet's systemd driver passes the leaf slice name
        sb.linux.security_context.namespace_options.network = pb.NODE
        sb.linux.security_context.namespace_options.pid = pb.CONTAINER
        sandbox_id = self.cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sb)).pod_sandbox_id
        if qos == X.BESTEFFORT:
            adj = 1000
        elif qos == X.GUARANTEED:
            adj = -997
        else:  # the kubelet's Burstable formula
            adj = min(max(1000 - (1000 * request) // self.node.capacity, 3), 999)
        u_map = {"memory.min": str(request)} if unified and request else {}
        req = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id)
        req.sandbox_config.CopyFrom(sb)
        c = req.config
        c.metadata.name = "main"
        c.image.image = "localhost/busybox:latest"
        c.command.extend(["/bin/sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"])
        c.log_path = "main/0.log"
        c.labels.update({"io.kubernetes.container.name": "main", "io.kubernetes.pod.name": name,
                         "io.kubernetes.pod.namespace": "default", "io.kubernetes.pod.uid": uid})
        r = c.linux.resources
        r.cpu_period, r.cpu_shares = 100000, 2
        r.memory_limit_in_bytes = limit
        r.oom_score_adj = adj
        for k, v in u_map.items():
            r.unified[k] = v
        c.linux.security_context.namespace_options.network = pb.NODE
        c.linux.security_context.namespace_options.pid = pb.CONTAINER
        cid = self.cri.call("CreateContainer", req).container_id
        self.cri.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        exp = X.container_expectation(qos, limit, adj, u_map, self.node)
        pod = {"name": name, "uid": uid, "qos": qos, "request": request, "limit": limit, "slice": leaf,
               "path": slice_path, "sandbox": sandbox_id, "id": cid, "exp": exp,
               "scope": f"{slice_path}/cri-containerd-{cid}.scope",
               "sandbox_scope": f"{slice_path}/cri-containerd-{sandbox_id}.scope"}
        self.pods[name] = pod
        log(f"pod {name} ({qos}) created: {slice_path}, container {cid[:12]}")
        return pod

    def remove_pod(self, name: str) -> None:
        from shim.cri import api_pb2 as pb

        pod = self.pods.pop(name)
        cri = self.cri or Cri(CONTAINERD_SOCK)
        cri.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod["sandbox"]))
        cri.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod["sandbox"]))
        self.busctl("StopUnit", "ss", pod["slice"], "replace")  # the kubelet destroys the pod cgroup
        deadline = time.time() + 30
        while os.path.isdir(os.path.join(CGROOT, pod["path"])) and time.time() < deadline:
            time.sleep(0.2)
        log(f"pod {name} removed")

    # -- expectations and checks
    def level_expectations(self) -> list[tuple[str, str, str, int, str]]:
        """(unit, cgroup path, file, value, why) for kubepods, the QoS slices and every pod slice
        (policy `Hard`)."""
        out = []
        burst = sum(p["request"] for p in self.pods.values() if p["qos"] == X.BURSTABLE)
        guar = sum(p["request"] for p in self.pods.values() if p["qos"] == X.GUARANTEED)
        pg = self.node.page
        for p in self.pods.values():
            v = p["request"] // pg * pg if p["qos"] != X.BESTEFFORT else 0
            out.append((p["slice"], p["path"], "memory.min", v, f"pod request of {p['name']} ({p['qos']})"))
            out.append((p["slice"], p["path"], "memory.low", 0, "policy request: memory.low stays 0"))
        out.append(("kubepods-burstable.slice", "kubepods.slice/kubepods-burstable.slice", "memory.min",
                    burst // pg * pg, "sum of Burstable pod requests"))
        out.append(("kubepods-burstable.slice", "kubepods.slice/kubepods-burstable.slice", "memory.low", 0, "0"))
        for f in LEVEL_FILES:
            out.append(("kubepods-besteffort.slice", "kubepods.slice/kubepods-besteffort.slice", f, 0, "BestEffort: 0"))
        out.append(("kubepods.slice", "kubepods.slice", "memory.min", (guar + burst) // pg * pg,
                    "sum of Guaranteed and Burstable pod requests"))
        out.append(("kubepods.slice", "kubepods.slice", "memory.low", 0, "0"))
        return out

    def levels_match(self) -> bool:
        return all(cg_read(path, f) == str(v) for _u, path, f, v, _w in self.level_expectations())

    def wait_levels(self, limit: float) -> float | None:
        """Seconds until every pod/QoS/kubepods value reads as expected, None if not within limit."""
        t = time.time()
        while True:
            if self.levels_match():
                return time.time() - t
            if time.time() - t > limit:
                return None
            time.sleep(0.2)

    def check(self, step: str, subject: str, file: str, expected, actual, why: str = "", source: str = "cgroupfs",
              ok: bool | None = None) -> bool:
        return self.report.check(SCENARIO, f"{self.phase}/{step}", subject, file, str(expected), str(actual), why,
                                 source, ok)

    def check_containers(self, step: str) -> None:
        pg = self.node.page
        for p in self.pods.values():
            e = p["exp"]
            want = {"memory.min": X.kernel_reads(e.min, pg), "memory.low": X.kernel_reads(e.low, pg),
                     "memory.high": X.kernel_reads(e.high, pg), "memory.max": X.kernel_reads(e.max, pg)}
            for f, v in want.items():
                self.check(step, f"container {p['name']}/main ({p['qos']})", f"{CGROOT}/{p['scope']}/{f}", v,
                           cg_read(p["scope"], f), json.dumps(e.why, sort_keys=True))
            self.check(step, f"sandbox of {p['name']}", f"{CGROOT}/{p['sandbox_scope']}/memory.min", "0",
                       cg_read(p["sandbox_scope"], "memory.min"), "the shim does not touch RunPodSandbox")

    def check_levels(self, step: str, note: str = "") -> None:
        for unit, path, f, v, why in self.level_expectations():
            self.check(step, f"{unit} ({note or 'pod/QoS/node level'})", f"{CGROOT}/{path}/{f}", v,
                       cg_read(path, f), why)

    def check_systemd_knows(self, step: str) -> None:
        for unit, _path, f, v, why in self.level_expectations():
            prop = {"memory.min": "MemoryMin", "memory.low": "MemoryLow"}[f]
            self.check(step, f"{unit}: systemd's own {prop}", f"systemctl show -p {prop} {unit}", v,
                       self.show(unit, prop), why, source="systemd")

    def disturb(self, settle: bool = True) -> dict:
        """What the kubelet and systemd do to a systemd node: a daemon-reload, the kubelet's
        SetUnitProperties on kubepods.slice (node allocatable: MemoryMax, CPUWeight) and on a
        QoS slice (CPUWeight)."""
        t = time.time()
        self.run(["systemctl", "daemon-reload"])
        self.set_unit_properties("kubepods.slice", [("MemoryMax", "t", str(self.node.allocatable)),
                                                    ("CPUWeight", "t", "100")])
        self.set_unit_properties("kubepods-burstable.slice", [("CPUWeight", "t", "20")])
        took = time.time() - t
        if settle:
            time.sleep(self.args.after_disturb)  # systemd applies from its event loop
        return {"commands_s": round(took, 2)}

    def watch_levels(self, duration: float) -> dict:
        """Sample every pod/QoS/kubepods value every 0.1 s for ``duration`` seconds (the shim
        running): when values were first seen wrong, when all were right again, how many
        samples were wrong."""
        t0 = time.time()
        first_bad = last_bad = None
        bad = samples = 0
        while time.time() - t0 < duration:
            samples += 1
            if not self.levels_match():
                bad += 1
                now = time.time() - t0
                first_bad = now if first_bad is None else first_bad
                last_bad = now
            time.sleep(0.1)
        return {"samples": samples, "wrong_samples": bad,
                "first_wrong_s": None if first_bad is None else round(first_bad, 2),
                "right_again_s": None if last_bad is None else round(last_bad + 0.1, 2),
                "right_at_end": self.levels_match()}

    def snapshot(self, title: str) -> None:
        lines = [f"### {self.phase}: {title} (t+{time.time() - T0:.1f}s)"]
        base = os.path.join(CGROOT, "kubepods.slice")
        for root, dirs, _files in os.walk(base):
            dirs.sort()
            rel = root[len(CGROOT) + 1:]
            vals = " ".join(f"{k}={cg_read(rel, 'memory.' + k)}" for k in ("min", "low", "high", "max"))
            lines.append(f"{rel} {vals}")
        with open(os.path.join(self.logs, "systemd-cgroups.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")

    # -- the phases
    def setup(self) -> None:
        ok, why = systemd_usable()
        if not ok:
            raise InfraError(why)
        self.report.data["guest"]["systemd"] = self.run(["systemctl", "--version"]).stdout.splitlines()[0]
        t = time.time()
        self.start_slice("kubepods.slice", [("MemoryMax", "t", str(self.node.allocatable))])
        self.start_slice("kubepods-burstable.slice", [])
        self.start_slice("kubepods-besteffort.slice", [])
        self.report.timing("kubepods-slices", time.time() - t)
        self.start_containerd()
        log("containerd (SystemdCgroup = true) ready, images imported")
        self.probe_failures()

    def teardown(self) -> None:
        self.stop_shim()
        for name in list(self.pods):
            try:
                self.remove_pod(name)
            except Exception as e:  # noqa: BLE001
                log(f"teardown: {name}: {e}")
        self.run(["systemctl", "stop", "e2e-containerd"], check=False)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--images", required=True, help="directory with busybox.tar and pause.tar")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the reconciler gets to converge")
    ap.add_argument("--resync", type=float, default=5.0, help="the shims' --resync-interval")
    ap.add_argument("--restore-slack", type=float, default=5.0,
                    help="seconds beyond one resync the cgroupfs shim may take to repair the reset values")
    ap.add_argument("--after-disturb", type=float, default=2.0,
                    help="seconds between the disturbance and reading the values")
    ap.add_argument("--writes", default="auto", help="--systemd-writes of the dbus phase (cgroupfs shows the failure)")
    ap.add_argument("--wheelhouse", help="the wheel and its dependencies for the install phase (e2e/guest_install.py)")
    args = ap.parse_args(argv)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(args.out, "guest-started"), "w") as f:
        f.write(f"{time.time()}\n")
    report = Report(args.out)
    report.data["guest"] = guest_facts(load_stack(""))  # the image's containerd and runc, from PATH
    report.data["guest"]["uptime_at_start_s"] = float(open("/proc/uptime").read().split()[0])
    report.data["shim_checkout"] = CHECKOUT
    report.save()
    log(f"guest up: {report.data['guest']}")
    g = Guest(args, report)
    try:
        g.setup()
        for phase in (g.phase_cgroupfs, g.phase_dbus, lambda: guest_install.phase_install(g, args.wheelhouse)):
            try:
                phase()
            finally:
                report.save()
    except InfraError as e:
        report.data["errors"].append(f"{g.phase or 'setup'}: {e}")
        log(f"INFRA ERROR: {e}")
    except Exception:  # noqa: BLE001
        report.data["errors"].append(traceback.format_exc())
        log(f"ERROR: {traceback.format_exc()}")
    finally:
        try:
            g.teardown()
        except Exception as e:  # noqa: BLE001
            log(f"teardown: {e}")
        failed = sum(1 for c in report.data["checks"] if not c["pass"])
        report.data["status"] = "error" if report.data["errors"] else ("fail" if failed else "pass")
        report.timing("guest-total", time.time() - T0)
        report.save()
    s = report.data["summary"]
    log(f"status {report.data['status']}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
    return {"pass": 0, "fail": 1}.get(report.data["status"], 3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
