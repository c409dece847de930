"""The proactive reclaim scenario (e2e/guest.py --reclaim) on a real kernel."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from guest_common import (
    CGROOT, CONTAINERD_SOCK, Cri, HOG_IMAGE, InfraError, KUBELET_VERSION, MI, RUN, Report, SHIM_SOCK,
    Shim, cg_read, hog_progress, log, metric, parse_events, read_audit, remove_cgroup_tree,
    sample_container, scrape_metrics
)
import expect as X  # e2e/expect.py: independent arithmetic


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
