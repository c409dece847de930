"""The NRI scenario of the real-kernel suite (scripts/e2e-vm --scenario nri): `memqos-shim nri`
as a plugin of the real containerd, pods created straight at containerd's CRI socket.

  1. proxy mode: the gate-off trace's pods created through `memqos-shim serve`, every value
     read back. When the same VM boot replayed that trace (scenario all+nri or traces+nri), its
     "created" step's values are taken (guest.py hands them over); else the pods are created
     here, checked against e2e/expect.py, then removed and the kubepods tree deleted;
  2. NRI mode: `memqos-shim nri` started as a process (it connects to /var/run/nri/nri.sock),
     the same recorded RunPodSandbox / CreateContainer / StartContainer requests replayed at
     containerd itself (no proxy in the path), the same checks, and one table: each cgroup's
     value in proxy mode beside NRI mode, asserted equal;
  3. the plugin killed with SIGKILL and restarted while the pods run, sampling every 0.1 s
     memory.min of every container / pod / QoS / kubepods cgroup: no value may drop; then killed
     again with two values zeroed behind its back: the restarted plugin's Synchronize restores them;
  4. the plugin stopped with SIGSTOP: a new pod's RunPodSandbox / CreateContainer still succeed
     (containerd times the plugin out and closes it, its log says so), and after SIGCONT the
     plugin reconnects and the new pod gets its values (Synchronize + reconciler);
  5. containerd restarted: the plugin reconnects and registers exactly once;
     with 2 CPU burners in the guest from 3. to here, plus late registration, an ejection during
     a burst of creations and a gate-on kubelet (e2e/nri_disturb.py): no ejection but the
     intended ones, every value right after each;
  6. the CreateContainer latency bench at containerd's CRI socket: no plugin, the plugin, proxy
     mode, in alternating blocks (e2e/nri_bench.py).

Registrations are counted from the plugin's audit ("nri-configure", one per registration, then
"nri-synchronize"), the runtime's side from containerd.log.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import expect as X  # noqa: E402
from guest_common import (  # noqa: E402
    CGROOT, CREATE_PHASE, Cri, InfraError, NODE_CALLS, RUN, SHIM_SOCK, cg_read, cg_write, log
)
from guest_replay import Replayer, short, substitute_ids  # noqa: E402
from guest_traces import Scenario  # noqa: E402
from nri_plugin import Plugin  # noqa: E402

SCN = "nri"
SAMPLE_INTERVAL = 0.1


class Sampler(threading.Thread):
    """memory.min of the given cgroups every 0.1 s; the lowest value each one read."""

    def __init__(self, paths: list[str]):
        super().__init__(daemon=True)
        self.paths = paths
        self.lowest: dict[str, int | None] = {p: None for p in paths}
        self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for p in self.paths:
                v = cg_read(p, "memory.min")
                n = int(v) if v.isdigit() else -1  # a cgroup gone or unreadable counts as a drop
                if self.lowest[p] is None or n < self.lowest[p]:
                    self.lowest[p] = n
            self.samples += 1
            self.halt.wait(SAMPLE_INTERVAL)

    def stop(self) -> None:
        self.halt.set()
        self.join()


def containerd_lines(logs: str, needle: str) -> list[str]:
    try:
        with open(os.path.join(logs, "containerd.log"), errors="replace") as f:
            return [line.strip() for line in f if needle in line]
    except OSError:
        return []


def values(scn: Scenario) -> dict[str, str]:
    """cgroup (named by pod case and container name, the same in both modes) -> value read."""
    import json

    from shim.cri import api_pb2 as pb

    out = {}
    for pod in scn.model.live_pods().values():
        for c in pod["containers"].values():
            key = f"{pod['parent']}/<{c['name']}>"
            if c["init"]:
                st = scn.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=c["id"], verbose=True))
                spec = json.loads(st.info.get("info", "{}")).get("runtimeSpec") or {}
                unified = ((spec.get("linux") or {}).get("resources") or {}).get("unified") or {}
                for k in ("memory.min", "memory.high"):
                    out[f"{key} (init, runtime spec) {k}"] = unified.get(k, "(absent)")
                continue
            for k in ("memory.min", "memory.high", "memory.max"):
                out[f"{key} {k}"] = cg_read(f"{pod['parent']}/{c['id']}", k)
        out[f"{pod['parent']} memory.min"] = cg_read(pod["parent"], "memory.min")
    for path in ("/kubepods/burstable", "/kubepods/besteffort", "/kubepods"):
        out[f"{path} memory.min"] = cg_read(path, "memory.min")
    return out


class NriScenario:
    def __init__(self, args, report, trace_path: str, reconciler, containerd, restart_containerd,
                 proxy_values: dict[str, str] | None = None):
        self.args, self.report = args, report
        self.proxy_values = proxy_values  # proxy mode's values() for this trace, from the same boot's replay
        self.trace_path, self.reconciler = trace_path, reconciler
        self.containerd, self.restart_containerd = containerd, restart_containerd
        self.logs = os.path.join(args.out, "logs")
        self.proxy: Scenario | None = None
        self.nri: Scenario | None = None
        self.plugin: Plugin | None = None
        self.summary: list[str] = []
        report.data["nri"] = {"summary": self.summary, "table": []}

    def note(self, line: str) -> None:
        self.summary.append(line)
        log(f"nri: {line}")

    def check(self, step, subject, file, expected, actual, why="", source="nri", ok=None) -> bool:
        return self.report.check(SCN, step, subject, file, expected, actual, why, source, ok)

    # -- the trace's pods, created and read back -----------------------------------------------
    @staticmethod
    def next_attempt(c: dict) -> dict:
        """The recorded call as the kubelet's next attempt (metadata.attempt 1): the runtime keeps
        a pod or container name reserved until it is removed, and proxy mode's pods, the same
        pods, may outlive their removal on a slow runtime (docs/testing.md, "Stack matrix")."""
        import base64

        from shim.cri import api_pb2 as pb

        name = short(c["method"])
        if name not in ("RunPodSandbox", "CreateContainer"):
            return c
        req = getattr(pb, name + "Request").FromString(base64.b64decode(c["request"]))
        if name == "RunPodSandbox":
            req.config.metadata.attempt += 1
        else:
            req.sandbox_config.metadata.attempt += 1
            req.config.metadata.attempt += 1
        return dict(c, request=base64.b64encode(req.SerializeToString()).decode())

    @classmethod
    def create(cls, scn: Scenario, cri: Cri, next_attempt: bool = False) -> None:
        scn.replayer = Replayer(cri, scn.trace, scn.report, scn.name)
        scn.replayer.after_call = scn.kubelet_waits
        boundary = scn.trace.removal_start()
        calls = [c for c in scn.trace.calls if c["code"] == "OK" and c["method"].startswith("/runtime.v1.")
                 and short(c["method"]) in NODE_CALLS + CREATE_PHASE and c["start"] < boundary]
        if next_attempt:
            calls = [cls.next_attempt(c) for c in calls]
        done = sorted(scn.replayer.run_phase(calls, "create"), key=lambda t: t[0]["start"])
        for c, req, resp in done:
            if short(c["method"]) == "RunPodSandbox":
                scn.model.add_sandbox(req, resp)
        for c, req, resp in done:
            if short(c["method"]) == "CreateContainer":
                scn.model.add_container(req, resp)
        scn.wait_containers()

    def min_paths(self) -> list[str]:
        scn = self.nri
        paths = []
        for pod in scn.model.live_pods().values():
            paths += [f"{pod['parent']}/{c['id']}" for c in pod["containers"].values() if not c["init"]]
            paths.append(pod["parent"])
        return paths + ["/kubepods/burstable", "/kubepods"]

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> None:
        t_all = time.time()
        # 1. proxy mode: the same boot's replay of this trace ("created" step), else replayed here
        proxy_values = self.proxy_values
        if proxy_values is None:
            self.proxy = Scenario(self.args, self.report, self.trace_path, "nri-proxy", self.reconciler)
            self.proxy.report.data["scenarios"].append({"name": "nri-proxy", "trace": self.trace_path})
            self.proxy.shim.start()
            self.proxy.shim_cri = Cri(SHIM_SOCK)
            self.create(self.proxy, self.proxy.shim_cri)
            self.proxy.check_all("created (proxy mode)")
            proxy_values = values(self.proxy)
            self.proxy.teardown()
            self.proxy = None
            self.note("proxy mode's values: the trace's pods created through memqos-shim serve here")
        else:
            self.note("proxy mode's values: this boot's replay of the same trace, its 'created' step")

        # 2. NRI mode: the plugin, then the same requests straight at containerd
        self.nri = Scenario(self.args, self.report, self.trace_path, SCN, self.reconciler)
        self.report.data["scenarios"].append({"name": SCN, "trace": self.trace_path})
        import nri_image  # the image's plugin with --nri-image (scripts/e2e-vm --plugin-image)

        meminfo = os.path.join(RUN, SCN, "meminfo")
        self.plugin = nri_image.plugin_for(self.args, self.logs, self.nri.kubelet_config, meminfo) or \
            Plugin(self.args.python, self.logs, self.nri.kubelet_config, meminfo)
        self.plugin.start()
        dt = self.plugin.wait_synced(1)
        if hasattr(self.plugin, "check_pod"):
            self.plugin.check_pod(self)
        self.report.timing("nri:plugin-registered", dt)
        conf = self.plugin.events("nri-configure")
        self.note(f"plugin registered after {dt:.1f}s: {conf[-1] if conf else '?'}")
        self.create(self.nri, self.nri.direct, next_attempt=True)
        self.nri.check_all("created (NRI mode)")
        nri_values = values(self.nri)
        table = self.report.data["nri"]["table"]
        width = max(len(k) for k in proxy_values) if proxy_values else 10
        lines = [f"{'cgroup':<{width}}  {'proxy mode':>12}  {'NRI mode':>12}"]
        for key in sorted(set(proxy_values) | set(nri_values)):
            p, n = proxy_values.get(key, "(none)"), nri_values.get(key, "(none)")
            table.append({"cgroup": key, "proxy": p, "nri": n})
            lines.append(f"{key:<{width}}  {p:>12}  {n:>12}{'' if p == n else '   <-- differs'}")
            self.check("same as proxy mode", key, key, p, n, "the value proxy mode gave the same pod")
        with open(os.path.join(self.logs, "nri-table.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        log("nri: values by mode\n" + "\n".join(lines))
        self.summary.append(f"values by mode: {sum(r['proxy'] == r['nri'] for r in table)}/{len(table)} equal "
                            "(logs/nri-table.txt)")

        import nri_disturb

        more = nri_disturb.Disturbances(self)
        more.start_burners()
        try:
            self.kill_restart()
            before = len(nri_disturb.ejections(self.logs))
            self.stopped_plugin()
            more.intended += len(nri_disturb.ejections(self.logs)) - before
            more.late_registration()
            more.burst_with_ejection()
            self.containerd_restart()
            more.gate_on_kubelet()
        finally:
            more.stop_burners()
        self.bench()
        self.report.timing("nri:total", time.time() - t_all)

    def kill_restart(self) -> None:
        # 3a. SIGKILL and restart while sampling: no memory.min may drop
        paths = self.min_paths()
        before = {p: int(cg_read(p, "memory.min")) for p in paths}
        sampler = Sampler(paths)
        sampler.start()
        syncs = len(self.plugin.events("nri-synchronize"))
        self.plugin.signal(signal.SIGKILL)
        time.sleep(2)
        self.plugin.start()
        dt = self.plugin.wait_synced(syncs + 1)
        time.sleep(3)  # the reconciler's first pass after the Synchronize
        sampler.stop()
        dropped = [p for p in paths if sampler.lowest[p] < before[p]]
        for p in paths:
            self.check("plugin SIGKILL + restart", f"{p} memory.min, lowest of {sampler.samples} samples",
                       f"{CGROOT}{p}/memory.min", f">= {before[p]}", str(sampler.lowest[p]),
                       "sampled every 0.1 s from the kill to 3 s after the new Synchronize; no pod left",
                       "cgroupfs sampler", ok=sampler.lowest[p] >= before[p])
        self.note(f"SIGKILL + restart: Synchronize after {dt:.1f}s, {sampler.samples} samples of {len(paths)} "
                  f"cgroups, {len(dropped)} dropped {dropped}")
        self.nri.check_all("plugin restarted after SIGKILL")
        # 3b. killed again, two values zeroed behind its back: Synchronize + reconciler restore them
        syncs = len(self.plugin.events("nri-synchronize"))
        self.plugin.signal(signal.SIGKILL)
        drifted = [pod["parent"] for pod in self.nri.model.live_pods().values() if pod["qos"] == X.BURSTABLE][:1]
        for path in drifted + ["/kubepods/burstable"]:
            cg_write(path, "memory.min", "0")
        self.note(f"wrote memory.min=0 to {drifted + ['/kubepods/burstable']} with the plugin down")
        self.plugin.start()
        self.plugin.wait_synced(syncs + 1)
        self.nri.check_all("plugin restarted after values were zeroed")

    def clone_pod(self, tail: str, name_suffix: str):
        """A copy of qos-burstable-limit's RunPodSandbox + CreateContainer requests as a new pod:
        the uid's last four characters replaced by ``tail`` (the same length, so the serialized
        request is edited in place), ``name_suffix`` added to the pod's name."""
        import base64

        from shim.cri import api_pb2 as pb

        tr = self.nri.trace
        run_req = create_req = None
        for c in tr.calls:
            if c["code"] != "OK":
                continue
            m = short(c["method"])
            if m == "RunPodSandbox":
                r = pb.RunPodSandboxRequest.FromString(base64.b64decode(c["request"]))
                if (r.config.labels.get("case") or r.config.metadata.name) == "qos-burstable-limit":
                    run_req = r
            elif m == "CreateContainer" and run_req is not None and create_req is None:
                r = pb.CreateContainerRequest.FromString(base64.b64decode(c["request"]))
                if r.sandbox_config.metadata.uid == run_req.config.metadata.uid and r.config.metadata.name == "main":
                    create_req = r
        if run_req is None or create_req is None:
            raise InfraError("no qos-burstable-limit/main in the trace")
        old = run_req.config.metadata.uid
        new = old[:-4] + tail

        def renamed(msg):
            data = msg.SerializeToString().replace(old.encode(), new.encode())
            out = type(msg).FromString(data)
            return out

        run_req, create_req = renamed(run_req), renamed(create_req)
        run_req.config.metadata.name += name_suffix
        create_req.sandbox_config.metadata.name += name_suffix
        with self.nri.replayer.lock:
            substitute_ids(create_req, dict(self.nri.replayer.idmap))
        return run_req, create_req

    def stopped_plugin(self) -> None:
        # 4. SIGSTOP: the runtime times the plugin out, the pod is still created
        from shim.cri import api_pb2 as pb

        run_req, create_req = self.clone_pod("beef", "-late")
        closing_before = len(containerd_lines(self.logs, "closing plugin"))
        syncs = len(self.plugin.events("nri-synchronize"))
        self.plugin.signal(signal.SIGSTOP)
        cri = self.nri.direct
        t = time.time()
        self.nri.replayer._prepare_host("RunPodSandbox", run_req)
        try:
            run = cri.call("RunPodSandbox", run_req)
            t_run = time.time() - t
            create_req.pod_sandbox_id = run.pod_sandbox_id
            self.nri.replayer._prepare_host("CreateContainer", create_req)
            t = time.time()
            created = cri.call("CreateContainer", create_req)
            t_create = time.time() - t
            cri.call("StartContainer", pb.StartContainerRequest(container_id=created.container_id))
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001
            ok, err, t_run, t_create = False, str(e)[:300], time.time() - t, 0.0
        self.check("plugin SIGSTOP", "new pod qos-burstable-limit-late", "CRI RunPodSandbox+CreateContainer+StartContainer",
                   "succeeded", "succeeded" if ok else f"failed: {err}",
                   "fail-open: a stopped plugin is timed out by the runtime, the pod is created", "CRI")
        time.sleep(1)
        closing = containerd_lines(self.logs, "closing plugin")[closing_before:]
        self.check("plugin SIGSTOP", "containerd closes the stopped plugin", "containerd.log 'closing plugin'",
                   ">= 1 line", f"{len(closing)} line(s): {closing[0][-300:] if closing else ''}",
                   "containerd's NRI request timeout", "containerd.log", ok=bool(closing))
        self.note(f"SIGSTOP: RunPodSandbox took {t_run:.2f}s, CreateContainer {t_create:.2f}s, "
                  f"containerd log: {closing[0][-200:] if closing else '(no closing plugin line)'}")
        self.report.timing("nri:stopped-plugin-runpodsandbox", t_run)
        self.report.timing("nri:stopped-plugin-createcontainer", t_create)
        if not ok:
            self.plugin.signal(signal.SIGCONT)
            return
        self.nri.model.add_sandbox(run_req, run)
        self.nri.model.add_container(create_req, created)
        self.nri.wait_containers()
        self.plugin.signal(signal.SIGCONT)
        dt = self.plugin.wait_synced(syncs + 1)
        # the audit's Synchronize record is written before the reply: containerd applies the
        # reply's container updates after it, through the runc shim
        late = f"{run_req.config.linux.cgroup_parent}/{created.container_id}"
        want = X.kernel_reads(self.nri.model.pods[run_req.config.metadata.uid]["containers"][created.container_id]
                              ["exp"].min, self.nri.node.page)
        t = time.time()
        while cg_read(late, "memory.min") != want and time.time() - t < self.args.settle:
            time.sleep(0.2)
        self.note(f"SIGCONT: plugin reconnected and synchronized after {dt:.1f}s; the late container's "
                  f"memory.min read {cg_read(late, 'memory.min')} {time.time() - t:.1f}s later")
        self.nri.check_all("plugin continued (SIGCONT): the late pod caught up")

    def containerd_restart(self) -> None:
        # 5. containerd restarted: the plugin reconnects and registers once
        confs = len(self.plugin.events("nri-configure"))
        syncs = len(self.plugin.events("nri-synchronize"))
        self.containerd = self.restart_containerd()
        dt = self.plugin.wait_synced(syncs + 1)
        time.sleep(10)  # a second registration would come within the backoff
        n = len(self.plugin.events("nri-configure")) - confs
        self.check("containerd restarted", "plugin registrations after the restart", "nri-audit.jsonl nri-configure",
                   "1", str(n), "one live registration per runtime", "audit")
        mentions = [line[-200:] for line in containerd_lines(self.logs, "memqos")][-6:]
        self.report.data["nri"]["containerd_restart_log"] = mentions
        self.note(f"containerd restarted: plugin synchronized after {dt:.1f}s, {n} registration(s); "
                  f"containerd.log lines naming memqos (last): {mentions}")
        self.nri.check_all("containerd restarted", sandboxes_may_go=True)

    def bench(self) -> None:
        # 6. CreateContainer latency: no plugin / plugin / proxy mode, alternating blocks
        import nri_bench

        result = nri_bench.Bench(self).run()
        self.report.data["nri"]["latency"] = result
        self.report.timing("nri:latency-bench", result["seconds"])
        for line in nri_bench.summary_lines(result):
            self.note(line)

    def teardown(self) -> None:
        if self.plugin and self.plugin.proc and self.plugin.proc.poll() is None:
            os.kill(self.plugin.proc.pid, signal.SIGCONT)
            self.plugin.signal(signal.SIGTERM)
        if self.proxy is not None:
            self.proxy.teardown()
        if self.nri is not None:  # the last scenario of its VM: its pods go with the VM (removing
            self.nri.direct.close()  # them takes minutes on the slow stacks, docs/testing.md "Stack matrix")
