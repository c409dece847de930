"""The trace scenario (e2e/guest.py, step 2): the model of what should be on the node and the
scenario that replays one recorded kubelet trace and reads back /sys/fs/cgroup after each step."""
from __future__ import annotations

import json
import os
import signal
import time

from guest_common import (
    CGROOT, CONTAINERD_SOCK, CREATE_PHASE, Cri, InfraError, NODE_CALLS, REMOVE_PHASE, RUN, Report,
    SHIM_SOCK, Shim, cg_read, cg_write, load_manifests, log, remove_cgroup_tree, remove_every_pod,
    snapshot
)
import expect as X  # e2e/expect.py: independent arithmetic
import protection as P  # e2e/protection.py: the sampling check
from guest_replay import (
    Replayer, Trace, short
)


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
        regular = [c["exp"].request.bytes for c in pod["containers"].values() if not c["init"] and not c.get("gone")]
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
        for key, value in (("memory.min", exp.min), ("memory.low", exp.low), ("memory.high", exp.high),
                           ("memory.max", exp.max)):
            # memory.min / memory.low 0 read "0"; an unset memory.high / memory.max reads "max"
            want = "0" if key in ("memory.min", "memory.low") and not value else X.kernel_reads(value, page)
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
        self.report.check(self.name, step, subject, f"{base}.unified[memory.low]",
                          str(exp.low) if exp.low else "(absent)", unified.get("memory.low", "(absent)"), why, src)
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

    def note_containers_gone(self, step: str) -> None:
        """After a runtime restart: a regular container the runtime no longer runs (containerd's
        cleanup of a leaked shim at its restart stops it and removes its cgroup) leaves the
        expectations, as it leaves the pod's sum in the shim; noted in report["containers_gone"]."""
        from shim.cri import api_pb2 as pb

        for pod in self.model.live_pods().values():
            for cid, c in pod["containers"].items():
                if c["init"] or c.get("gone"):
                    continue
                try:
                    state = self.direct.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid)).status.state
                    state_name = pb.ContainerState.Name(state)
                except Exception as e:  # noqa: BLE001 - NOT_FOUND: the runtime removed it
                    state, state_name = None, f"status failed: {str(e)[:120]}"
                if state != pb.CONTAINER_RUNNING:
                    c["gone"] = True
                    self.report.data.setdefault("containers_gone", []).append(
                        {"step": step, "pod": pod["name"], "container": c["name"], "state": state_name})
                    log(f"{self.name}: {step}: {pod['name']}/{c['name']} is {state_name} (the runtime's restart)")

    def check_all(self, step: str, settle: float | None = None, sandboxes_may_go: bool = False) -> None:
        """Every container, sandbox, pod, QoS and node value. ``sandboxes_may_go``: after a runtime
        restart, sandboxes and containers the runtime cleaned up are noted instead of checked
        (``check_sandboxes``, ``note_containers_gone``)."""
        if sandboxes_may_go:
            self.note_containers_gone(step)
        for pod in self.model.live_pods().values():
            for c in pod["containers"].values():
                if c.get("gone"):
                    continue
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
