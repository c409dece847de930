"""The protection benchmark (e2e/guest.py --pressure quick|full): does the protection protect?

Cgroups laid out as the kubelet lays them out with the cgroupfs driver -- kubepods (memory.max =
the node's allocatable, the reclaim root) / [burstable|besteffort] / pod<uid> (memory.max = the sum
of the limits) / a pause sibling holding PAUSE_MIB and the containers (memory.max = the limit) --
and workloads run straight in them (no runtime: e2e/pressure.c and e2e/hog.c, static), with the
kubelet's oom_score_adj. Each scenario runs once per value set (pressure_model.SETS, written into
the files directly; the shim's from its own decision code), one after the other in the same
boot, on a fresh tree, caches dropped. Every ~0.2 s a sampler reads every pod's memory.current,
min/low/high/max, memory.events and memory.stat (logs/pressure-<scenario>-<set>.jsonl).

Scenarios (pressure_model sizes, MiB):
* pagecache-guaranteed: 256/256, 150 anon, writes and reads 10 files of 30 per pass;
* pagecache-burstable: the same at request 240, limit 256;
* pagecache-multi: a Guaranteed pod of two containers, cache (192/192, 100 anon + 10 x 20 files)
  and anon (128/128 holding 126);
* node-pressure: holders of each QoS class (64 anon + 2 x 24 files each, touched and read in a
  loop), then a BestEffort aggressor grows until kubepods has room for the Guaranteed and
  Burstable holders' files and half the BestEffort one's; the holders loop on for a hold (20 s
  quick, 30 s full) once the aggressor is done growing (or 60 s went by);
* gap-wide, gap-narrow (full only): a Guaranteed holder beside a Burstable aggressor that wants
  32 MiB more than its limit, request 32 limit 384 (memory.high 35 MiB under memory.max with the
  factor 0.9) and request 240 limit 256 (1.6 MiB under): held at memory.high, or through to
  memory.max. The shim's PSI guard, which would lift memory.high off the held one, is not run
  here (it acts on containers the shim created through the runtime; see the guard scenario);
* the class scenarios (class_scenarios), each under none, the shim's default class and the class
  under test (pressure_model.CLASSES_CONFIG, read by the shim's own parser): class-nothrottle (no
  swap: a grower past its memory.high under a class without memory.high), then, after a zram swap
  device is switched on (setup_swap), class-swap (a grower past memory.high and memory.max under
  a swap class, beside anon-heavy protected holders) and node-pressure-swap (node pressure from
  an aggressor that keeps its anonymous memory hot).

Checks (report checks, scenario "pressure"): no OOM kill that the no-protection baseline does not
have (every value set of the shim's; the kubelet's outcome is in the table only); under the shim's
default values the Guaranteed and Burstable holders' file refaults at most a tenth of the
baseline's, and the BestEffort holder reclaimed no later than the Burstable one; with swap the
same for anon refaults; the no-throttling class never at memory.high (memory.events high 0, the
default class's > 0) and OOM-killed exactly when no QoS is; the swap class's grower not OOM-killed,
running at the end with pages in swap, its protected neighbours' anon at least RESIDENT of what it
was. No timing is asserted."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

from guest_common import CGROOT, MI, RUN, InfraError, Report, cg_read, cg_write, log, parse_events, parse_pressure_full
import pressure_model as M
import pressure_outcome as O

PODS_SET = {"quick": ("none", "shim"), "full": M.SETS}
SAMPLE = 0.2  # s between samples
GROW = 30.0  # s an aggressor may take to reach its target before the hold begins anyway
FS_MIB = 400  # the ramdisk the files live on (its pages are guest memory outside every cgroup)
SWAP_MIB = 512  # the zram swap device of the swap scenarios (its pages are guest memory outside every cgroup)
RESIDENT = 0.9  # a holder's anon "stays resident" when it ends at or above this share of what it was
ONLY_FILE = "pressure-only"  # OUT/pressure-only: the scenario names to run, one a line (scripts/protection-bench --only)
LATENCY, SWAPPER = M.CLASS_PREFIX + "latency-critical", M.CLASS_PREFIX + "swap"


def scenarios(mode: str) -> list[dict]:
    quick = mode == "quick"
    passes = 2 if quick else 3
    G = M.Box
    allocatable = 640 * M.MI
    holder = ("loop", 64, 2, 24, 0)
    # the aggressor leaves room for the protected holders' files and half the BestEffort one's
    aggressor = 640 - 3 * 64 - 4 * M.PAUSE_MIB - 2 * 48 - 24 - 8
    return [
        {"name": "pagecache-guaranteed", "allocatable": allocatable, "timeout": 300, "pods": [
            M.Pod("guaranteed", "a0000001", (G("app", 256 * MI, 256 * MI, ("write", 150, 10, 30, passes)),), "writer")]},
        {"name": "pagecache-burstable", "allocatable": allocatable, "timeout": 300, "pods": [
            M.Pod("burstable", "a0000002", (G("app", 240 * MI, 256 * MI, ("write", 150, 10, 30, passes)),), "writer")]},
        {"name": "pagecache-multi", "allocatable": allocatable, "timeout": 300, "pods": [
            M.Pod("multi", "a0000003", (G("cache", 192 * MI, 192 * MI, ("write", 100, 10, 20, passes)),
                                    G("anon", 128 * MI, 128 * MI, ("hog", 126, 0))), "writer")]},
        {"name": "node-pressure", "allocatable": allocatable, "hold": 20 if quick else 30, "grow": 60, "timeout": 240,
         "pods": [
            M.Pod("guaranteed", "b0000001", (G("app", 128 * MI, 128 * MI, holder),)),
            M.Pod("burstable", "b0000002", (G("app", 128 * MI, 256 * MI, holder),)),
            M.Pod("besteffort", "b0000003", (G("app", 0, 0, holder),)),
            M.Pod("aggressor", "b0000004", (G("app", 0, 0, ("hog", aggressor, 10)),), "aggressor")]},
    ] + ([] if quick else [
        # an aggressor that wants 32 MiB more than its limit, beside a Guaranteed holder: with memory.high
        # (factor 0.9) a wide gap to memory.max (request 32, limit 384: 35 MiB) holds it at memory.high,
        # a narrow one (request 240, limit 256: 1.6 MiB) lets it through to memory.max
        {"name": f"gap-{name}", "allocatable": allocatable, "hold": 15, "timeout": 240, "pods": [
            M.Pod("guaranteed", f"c000000{i}", (G("app", 128 * MI, 128 * MI, holder),)),
            M.Pod("aggressor", f"c100000{i}", (G("app", req * MI, lim * MI, ("hog", lim + 32, 10)),), "aggressor")]}
        for i, (name, req, lim) in enumerate((("wide", 32, 384), ("narrow", 240, 256)))]) + class_scenarios(mode)


def class_scenarios(mode: str) -> list[dict]:
    """The class scenarios (docs/protection.md, "Classes and swap"), each under none, the shim's
    default class (the node's settings) and the class under test for the pods ``classed`` names.
    The first without swap, the others (``swap``) after the zram device is on."""
    quick = mode == "quick"
    G = M.Box
    holder = ("loop", 64, 2, 24, 0)
    # idle 3 s after every pass: with swap, a working set that is not busy all the time is what
    # reclaim takes first (anon to swap, files dropped) unless protection keeps it
    anon_holder = ("loop", 96, 1, 16, 0, 3000)  # mostly anonymous: what swap can take from it
    return [
        # (a) an anonymous-memory grower past its memory.high (request 32, limit 256: 233.6 MiB with
        # the factor 0.9) that wants 288, as fast as it can: the default class holds it at memory.high,
        # the class without memory.high lets it through to memory.max like no QoS
        {"name": "class-nothrottle", "allocatable": 640 * MI, "hold": 5 if quick else 15, "grow": 25 if quick else 40,
         "timeout": 180, "sets": ("none", "shim", LATENCY), "classed": ("aggressor",), "pods": [
             M.Pod("guaranteed", "d0000001", (G("app", 128 * MI, 128 * MI, holder),)),
             M.Pod("aggressor", "d1000001", (G("app", 32 * MI, 256 * MI, ("hog", 288, 0)),), "aggressor")]},
        # (b) with swap: a grower that wants 32 MiB more than its limit (request 64, limit 320; memory.high
        # 294.4 MiB), as fast as it can, beside
        # anon-heavy Guaranteed and Burstable holders, kubepods (480) short by about 70 MiB
        {"name": "class-swap", "swap": True, "allocatable": 480 * MI, "hold": 10 if quick else 20,
         "grow": 30, "timeout": 200, "sets": ("none", "shim", SWAPPER), "classed": ("aggressor",), "pods": [
             M.Pod("guaranteed", "e0000001", (G("app", 128 * MI, 128 * MI, anon_holder),)),
             M.Pod("burstable", "e0000002", (G("app", 128 * MI, 256 * MI, anon_holder),)),
             M.Pod("aggressor", "e1000001", (G("app", 64 * MI, 320 * MI, ("hog", 352, 0)),), "aggressor")]},
        # (c) node pressure with swap: anon-heavy idle holders of each QoS class (96 anon + 16 file)
        # beside a BestEffort aggressor that keeps touching 400 MiB of anonymous memory (its pages as
        # hot as it can keep them): kubepods (640) about 100 MiB short, more than all the holders' files
        {"name": "node-pressure-swap", "swap": True, "allocatable": 640 * MI, "hold": 20 if quick else 30,
         "timeout": 240, "sets": ("none", "shim") if quick else ("none", "shim", SWAPPER), "classed": ("*",), "pods": [
             M.Pod("guaranteed", "f0000001", (G("app", 128 * MI, 128 * MI, anon_holder),)),
             M.Pod("burstable", "f0000002", (G("app", 128 * MI, 256 * MI, anon_holder),)),
             M.Pod("besteffort", "f0000003", (G("app", 0, 0, anon_holder),)),
             M.Pod("aggressor", "f0000004", (G("app", 0, 0, ("loop", 400, 0, 0, 0)),), "aggressor")]},
    ]


class PressureScenario:
    def __init__(self, args, report: Report):
        self.mode = args.pressure
        self.bin = args.images
        self.report = report
        self.name = "pressure"
        self.out = args.out
        self.logs = os.path.join(args.out, "logs")
        self.mnt = os.path.join(RUN, "pressure")
        self.device = ""
        self.swap = ""
        self.procs: list[subprocess.Popen] = []
        self.data = report.data.setdefault("pressure", {"mode": self.mode, "runs": []})

    # -- the file system the page cache lives on -------------------------------------------------
    def setup_fs(self) -> None:
        def run(*cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)

        os.makedirs(self.mnt, exist_ok=True)
        p = run("modprobe", "brd", "rd_nr=1", f"rd_size={FS_MIB * 1024}")
        if p.returncode != 0 or not os.path.exists("/dev/ram0"):
            raise InfraError(f"no brd ramdisk: {p.stderr.strip()}")
        self.device = "/dev/ram0"
        run("modprobe", "ext4")
        for cmd in (("mkfs.ext4", "-q", "-F", "-b", "4096", self.device), ("mount", "-t", "ext4", self.device, self.mnt)):
            r = run(*cmd)
            if r.returncode != 0:
                raise InfraError(f"{' '.join(cmd)}: {r.stderr.strip()[-300:]}")

    def setup_swap(self) -> None:
        """A zram swap device of SWAP_MIB (lzo-rle): the guest has no disk (its root is the host's
        file system shared read-only), and zram needs no file system beside the page-cache one."""
        def run(*cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)

        p = run("modprobe", "zram", "num_devices=1")
        if p.returncode != 0 or not os.path.exists("/sys/block/zram0"):
            raise InfraError(f"no zram device: {p.stderr.strip()}")
        with open("/sys/block/zram0/disksize", "w") as f:
            f.write(f"{SWAP_MIB}M")
        for cmd in (("mkswap", "/dev/zram0"), ("swapon", "/dev/zram0")):
            r = run(*cmd)
            if r.returncode != 0:
                raise InfraError(f"{' '.join(cmd)}: {r.stderr.strip()[-300:]}")
        self.swap = "/dev/zram0"
        swappiness = open("/proc/sys/vm/swappiness").read().strip()
        self.data["swap"] = {"device": "zram0", "mib": SWAP_MIB, "algorithm": open(
            "/sys/block/zram0/comp_algorithm").read().strip(), "swappiness": swappiness}
        log(f"pressure: swap on: zram0 {SWAP_MIB} MiB, vm.swappiness {swappiness}")

    # -- one run -------------------------------------------------------------------------------
    def build(self, pods: list[M.Pod], lay: M.Layout, limits: M.Layout) -> None:
        for path in ("kubepods", M.BURSTABLE, M.BESTEFFORT) + tuple(
                d for p in pods for d in (p.path, f"{p.path}/pause") + tuple(f"{p.path}/{b.name}" for b in p.boxes)):
            os.makedirs(os.path.join(CGROOT, path), exist_ok=True)
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            if "memory" not in cg_read(parent, "cgroup.subtree_control").split():
                cg_write(parent, "cgroup.subtree_control", "+memory")
        for src in (limits, lay):  # top-down: a parent before its children
            for path in sorted(src.files, key=lambda p: p.count("/")):
                for file, value in src.files[path].items():
                    cg_write(path, file, value)

    def start(self, cmd: list[str], cgroup: str, adj: int, log_path: str) -> subprocess.Popen:
        procs = os.path.join(CGROOT, cgroup, "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(adj))
            os.setsid()

        logf = open(log_path, "ab", buffering=0)
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=enter)
        logf.close()
        self.procs.append(p)
        return p

    def command(self, work: tuple, data_dir: str) -> list[str]:
        if work[0] == "hog":
            return [os.path.join(self.bin, "hog"), str(work[1]), str(work[2])]
        kind, anon, files, file_mib, passes = work[:5]
        pause = [str(work[5])] if len(work) > 5 else []  # ms idle after every pass
        return [os.path.join(self.bin, "pressure"), str(anon), str(files), str(file_mib), str(passes), data_dir,
                kind] + pause

    def sample(self, pods: list[M.Pod], t0: float) -> dict:
        out = {"t": round(time.time() - t0, 3), "pods": {}}
        for p in pods:
            d: dict = {}
            for key in ("current", "min", "low", "high", "max"):
                v = cg_read(p.path, f"memory.{key}")
                d[key] = int(v) if v.isdigit() else v
            d["events"] = parse_events(cg_read(p.path, "memory.events"))
            swap = cg_read(p.path, "memory.swap.current")
            d["swap"] = int(swap) if swap.isdigit() else 0
            d["psi"] = {k: int(v.get("total", 0)) for k, v in parse_pressure_full(cg_read(p.path, "memory.pressure")).items()}
            for b in p.boxes:  # the container with the lowest memory.high (the kubelet sets it there)
                high = cg_read(f"{p.path}/{b.name}", "memory.high")
                if high.isdigit() and int(high) < d.get("box_high", 1 << 62):
                    d["box_high"] = int(high)
                    cur = cg_read(f"{p.path}/{b.name}", "memory.current")
                    d["box_current"] = int(cur) if cur.isdigit() else 0
            d["stat"] = O.parse_stat(cg_read(p.path, "memory.stat"))
            out["pods"][p.name] = d
        v = cg_read("kubepods", "memory.current")
        out["kubepods"] = int(v) if v.isdigit() else v
        return out

    def run_one(self, spec: dict, set_name: str, capacity: int) -> tuple[dict, list[dict]]:
        pods = spec["pods"]
        node = M.node_facts(capacity, spec["allocatable"])
        lay = M.values(set_name, pods, node, spec.get("classed", ()))
        tag = f"{spec['name']}-{set_name}"
        log(f"pressure: {tag}: {M.describe(lay, pods)}")
        self.clean()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        self.build(pods, lay, M.limits(pods, spec["allocatable"]))
        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.time()

        def sampler() -> None:
            while not stop.is_set():
                samples.append(self.sample(pods, t0))
                stop.wait(SAMPLE)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        work: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            for p in pods:
                self.start([os.path.join(self.bin, "hog"), str(M.PAUSE_MIB), "0"], f"{p.path}/pause", -998,
                           os.path.join(self.logs, f"pressure-{tag}-{p.name}-pause.log"))
            aggressors = [p for p in pods if p.role == "aggressor"]
            for p in (q for q in pods if q.role != "aggressor"):
                self.launch(p, tag, capacity, work)
            pressure_t = None
            deadline = t0 + spec["timeout"]
            if aggressors:  # holders warm (a pass done), then the aggressor, then hold
                while time.time() < deadline and not all(
                        "pass 1 " in open(lg).read() for proc, lg in work.values() if proc.poll() is None):
                    time.sleep(0.5)
                pressure_t = round(time.time() - t0, 3)
                for p in aggressors:
                    self.launch(p, tag, capacity, work)
                # the hold begins once every aggressor is done growing, gone, or GROW seconds went by
                grown = min(deadline, time.time() + spec.get("grow", GROW))
                while time.time() < grown and any(
                        proc.poll() is None and not O.grown(open(lg).read())
                        for key, (proc, lg) in work.items() if key.split("/")[0] in {p.name for p in aggressors}):
                    time.sleep(0.5)
                end = min(deadline, time.time() + spec["hold"])
                while time.time() < end:
                    time.sleep(0.5)
            else:
                while time.time() < deadline and any(proc.poll() is None for proc, _ in work.values()
                                                     if os.path.basename(proc.args[0]) == "pressure"):
                    time.sleep(0.5)
            duration = time.time() - t0
            time.sleep(SAMPLE * 2)  # a last sample with the end state
        finally:
            stop.set()
            thread.join(timeout=10)
        result = self.summarize(spec, set_name, lay, pods, work, samples, t0, duration, pressure_t)
        with open(os.path.join(self.logs, f"pressure-{tag}.jsonl"), "w") as f:
            for s in samples:
                f.write(json.dumps(s) + "\n")
        self.kill_all()
        return result, samples

    def launch(self, p: M.Pod, tag: str, capacity: int, work: dict) -> None:
        for b in p.boxes:
            data_dir = os.path.join(self.mnt, f"{p.name}-{b.name}")
            os.makedirs(data_dir, exist_ok=True)
            lg = os.path.join(self.logs, f"pressure-{tag}-{p.name}-{b.name}.log")
            proc = self.start(self.command(b.work, data_dir), f"{p.path}/{b.name}", M.oom_score_adj(p, b, capacity), lg)
            work[f"{p.name}/{b.name}"] = (proc, lg)

    def summarize(self, spec, set_name, lay, pods, work, samples, t0, duration, pressure_t) -> dict:
        since = pressure_t or 0.0
        run = {"scenario": spec["name"], "set": set_name, "values": M.describe(lay, pods),
               "duration_s": round(duration, 1), "pressure_t": pressure_t, "samples": len(samples), "pods": {}}
        last = samples[-1]["pods"] if samples else {}
        for p in pods:
            ev = last.get(p.name, {}).get("events", {})
            passes, completed, exits = [], True, {}
            for b in p.boxes:
                proc, lg = work.get(f"{p.name}/{b.name}", (None, ""))
                text = open(lg).read() if lg and os.path.exists(lg) else ""
                passes += [ms for end, ms in O.parse_passes(text) if pressure_t is None or end >= t0 + since]
                exits[b.name] = None if proc is None else proc.poll()
                if b.work[0] == "write":
                    completed = completed and "pressure: done" in text and exits[b.name] == 0
            prot = {k: int(v) for k, v in lay.files.get(p.path, {}).items() if v.isdigit()}
            run["pods"][p.name] = {
                "qos": p.qos.value, "role": p.role, "exits": exits, "completed": completed,
                "oom_kill": ev.get("oom_kill", 0), "max_events": ev.get("max", 0), "high_events": ev.get("high", 0),
                "low_events": ev.get("low", 0), "peak": O.peak(samples, p.name),
                "min": prot.get("memory.min"), "low": prot.get("memory.low"),
                "high": max((int(v) for b in p.boxes for k, v in lay.files.get(f"{p.path}/{b.name}", {}).items()
                             if k == "memory.high" and v.isdigit()), default=None),
                "refault_file": O.delta(samples, p.name, "workingset_refault_file", since),
                "refault_anon": O.delta(samples, p.name, "workingset_refault_anon", since),
                "pgmajfault": O.delta(samples, p.name, "pgmajfault", since),
                "at_high_s": O.at_high(samples, p.name, SAMPLE),
                "stall_s": O.stall_s(samples, p.name, since), "swap_peak": O.peak(samples, p.name, "swap"),
                "anon_before": O.stat_at(samples, p.name, "anon", since), "anon_end": O.stat_at(samples, p.name, "anon"),
                "p50_ms": O.percentile(passes, 50), "p99_ms": O.percentile(passes, 99), "passes": len(passes),
            }
        return run

    # -- the whole benchmark -------------------------------------------------------------------
    def run(self) -> None:
        self.setup_fs()
        capacity = int(open("/proc/meminfo").readline().split()[1]) * 1024
        self.data["capacity"] = capacity
        results: dict[str, dict[str, tuple[dict, list[dict]]]] = {}
        specs = scenarios(self.mode)
        only = os.path.join(self.out, ONLY_FILE)  # scripts/protection-bench --only
        if os.path.exists(only):
            names = set(open(only).read().split())
            specs = [s for s in specs if s["name"] in names]
            self.data["only"] = sorted(names)
        for spec in specs:
            if spec.get("swap") and not self.swap:
                self.setup_swap()
            for set_name in spec.get("sets", PODS_SET[self.mode]):
                run, samples = self.run_one(spec, set_name, capacity)
                results.setdefault(spec["name"], {})[set_name] = (run, samples)
                self.data["runs"].append(run)
                self.report.save()
                log(f"pressure: {run['scenario']} {run['set']}: {O.outcome(run)} in {run['duration_s']} s")
        self.checks(results)
        plain = [r for r in self.data["runs"] if not O.is_class(r)]
        classed = [r for r in self.data["runs"] if O.is_class(r)]
        self.data["table"] = "\n\n".join(([O.table(plain)] if plain else []) + ([O.class_table(classed)] if classed else []))
        self.data["summary"] = self.data["table"].splitlines()

    def checks(self, results: dict) -> None:
        for scenario, by_set in results.items():
            base = by_set.get("none")
            if base is None:
                continue
            for set_name, (run, samples) in by_set.items():
                if set_name in ("none", "kubelet"):  # the baseline itself, and the kubelet's values: the table says
                    continue
                ok, exp, act = O.no_new_oom(base[0], run)
                self.report.check(self.name, scenario, f"value set {set_name}: {run['values']}",
                                  "memory.events oom_kill of every pod", exp, act,
                                  "protection must not OOM-kill what runs without it", "cgroupfs", ok)
            if scenario.startswith("node-pressure") and "shim" in by_set:
                run, samples = by_set["shim"]
                for pod in ("guaranteed", "burstable"):
                    for kind in ("file", "anon") if scenario.endswith("-swap") else ("file",):
                        ok, exp, act = O.refaults_cut(base[0], run, pod, kind=kind)
                        self.report.check(self.name, scenario, f"{pod} holder under the shim's default values",
                                          f"memory.stat workingset_refault_{kind} (from the aggressor's start)",
                                          exp, act, "a protected holder keeps its pages", "cgroupfs", ok)
                if scenario == "node-pressure":
                    ok, exp, act = O.reclaimed_first(samples, "besteffort", "burstable", run["pressure_t"])
                    self.report.check(self.name, scenario, "holders under the shim's default values",
                                      f"memory.stat file below {O.RECLAIMED:g} of its value when the aggressor started",
                                      exp, act, "BestEffort is reclaimed before Burstable", "cgroupfs", ok)
            if scenario == "class-nothrottle" and LATENCY in by_set and "shim" in by_set:
                ok, exp, act = O.throttled(by_set["shim"][0], "aggressor")
                self.report.check(self.name, scenario, "the grower under the default class (the node's settings)",
                                  "memory.events high", exp, act,
                                  "the default class throttles it at memory.high (what the class is for)", "cgroupfs", ok)
                run = by_set[LATENCY][0]
                ok, exp, act = O.not_throttled(run, "aggressor")
                self.report.check(self.name, scenario, f"the grower under {LATENCY}", "memory.events high",
                                  exp, act, "a class without memory.high never throttles", "cgroupfs", ok)
                ok, exp, act = O.same_oom(base[0], run, "aggressor")
                self.report.check(self.name, scenario, f"the grower under {LATENCY}", "memory.events oom_kill",
                                  exp, act, "OOM-killed at memory.max exactly as without QoS", "cgroupfs", ok)
            if scenario == "class-swap" and SWAPPER in by_set:
                run = by_set[SWAPPER][0]
                ok, exp, act = O.kept_running(run, "aggressor")
                self.report.check(self.name, scenario, f"the grower under {SWAPPER}",
                                  "memory.events oom_kill, memory.swap.current", exp, act,
                                  "past memory.high and memory.max it swaps and runs on", "cgroupfs", ok)
                for pod in ("guaranteed", "burstable"):
                    ok, exp, act = O.anon_resident(run, pod, RESIDENT)
                    self.report.check(self.name, scenario, f"{pod} holder beside the grower under {SWAPPER}",
                                      "memory.stat anon (the aggressor's start -> the end)", exp, act,
                                      "memory.min / memory.low keep a neighbour's anon out of swap", "cgroupfs", ok)

    # -- cleanup -------------------------------------------------------------------------------
    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log(f"pressure: pid {p.pid} did not exit")
        self.procs = []

    def clean(self) -> None:
        self.kill_all()
        remove_tree("kubepods")
        if os.path.ismount(self.mnt):
            for entry in os.listdir(self.mnt):
                if entry != "lost+found":
                    shutil.rmtree(os.path.join(self.mnt, entry), ignore_errors=True)

    def teardown(self) -> None:
        self.clean()
        if self.swap:
            subprocess.run(["swapoff", self.swap], capture_output=True, timeout=300)
        if self.device:
            subprocess.run(["umount", self.mnt], capture_output=True)


def remove_tree(rel: str) -> None:
    """Remove a cgroup tree bottom-up (its processes already gone), waiting briefly for a cgroup
    whose last process is still exiting."""
    base = os.path.join(CGROOT, rel)
    if not os.path.isdir(base):
        return
    for root, dirs, _files in os.walk(base, topdown=False):
        for d in dirs:
            _rmdir(os.path.join(root, d))
    _rmdir(base)


def _rmdir(path: str) -> None:
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    log(f"pressure: cannot remove cgroup {path}")
