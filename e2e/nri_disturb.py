"""The NRI scenario's disturbances beyond kill -9 / SIGSTOP / a runtime restart (e2e/nri_scenario.py):

* CPU burners: two busy shells in the guest from the plugin's first registration to the bench;
  containerd must never time the plugin out except where a step stops it on purpose (its log's
  "closing plugin ... deadline exceeded" lines are counted around those steps);
* late registration: the plugin is stopped (SIGTERM), a pod and its container are created and
  left not started, the plugin starts again (a new registration, a Synchronize that lists a
  container that is not running yet), then the container is started: its values must be in
  its cgroup (containerd keeps such a Synchronize update in the stored spec only);
* an ejection during a burst: three pods created back to back, the plugin stopped (SIGSTOP, past
  containerd's request timeout) after the first; continued once all are created; the first
  pod's container runs before the Synchronize, the others are started after it;
* a gate-on kubelet: the plugin restarted with the kubelet's MemoryQoS gate on in the
  configuration it reads; two pods whose CreateContainer carries the kubelet's own unified
  memory.min / memory.high (one created with the plugin stopped, so the next Synchronize lists
  it): the kernel holds exactly the kubelet's values, before and after the Synchronize.

After each step every container's, pod's, QoS class's and kubepods' value is checked
(``check_all``), the new containers' memory.min waited for up to ``--settle`` seconds first.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import expect as X  # noqa: E402
from guest_common import CGROOT, RUN, cg_read  # noqa: E402

EJECTED = ("closing plugin", "deadline exceeded")
BURNER = "while :; do :; done"


def ejections(logs: str) -> list[str]:
    """containerd.log's lines saying it timed the plugin out."""
    try:
        with open(os.path.join(logs, "containerd.log"), errors="replace") as f:
            return [line.strip() for line in f if all(n in line for n in EJECTED)]
    except OSError:
        return []


class Disturbances:
    def __init__(self, scenario):
        self.s = scenario
        self.burners: list[subprocess.Popen] = []
        self.ejections_at_start = 0
        self.intended = 0  # ejections the steps caused on purpose

    # -- helpers ----------------------------------------------------------------------------------
    def check(self, *a, **kw):
        return self.s.check(*a, **kw)

    def new_pod(self, tail: str, suffix: str, unified: dict | None = None, model: bool = True) -> tuple[str, dict]:
        """A copy of qos-burstable-limit's pod created at containerd (not started): its container id
        and its pod's cgroup parent. ``unified``: the kubelet's own keys in CreateContainer."""
        run_req, create_req = self.s.clone_pod(tail, suffix)
        if unified:
            create_req.config.linux.resources.unified.update(unified)
        nri, cri = self.s.nri, self.s.nri.direct
        nri.replayer._prepare_host("RunPodSandbox", run_req)
        run = cri.call("RunPodSandbox", run_req)
        create_req.pod_sandbox_id = run.pod_sandbox_id
        nri.replayer._prepare_host("CreateContainer", create_req)
        created = cri.call("CreateContainer", create_req)
        if model:
            nri.model.add_sandbox(run_req, run)
            nri.model.add_container(create_req, created)
        return created.container_id, {"parent": run_req.config.linux.cgroup_parent, "sandbox": run.pod_sandbox_id}

    def start(self, cid: str) -> None:
        from shim.cri import api_pb2 as pb

        self.s.nri.direct.call("StartContainer", pb.StartContainerRequest(container_id=cid))

    def wait_values(self, cids: list[str]) -> float:
        """Until each of these model containers' memory.min reads what is expected (at most
        --settle seconds); the seconds it took."""
        nri = self.s.nri
        want = {}
        for pod in nri.model.live_pods().values():
            for cid, c in pod["containers"].items():
                if cid in cids:
                    want[f"{pod['parent']}/{cid}"] = X.kernel_reads(c["exp"].min, nri.node.page)
        t = time.time()
        while time.time() - t < self.s.args.settle:
            if all(cg_read(p, "memory.min") == v for p, v in want.items()):
                break
            time.sleep(0.2)
        return time.time() - t

    def stop_plugin_past_the_timeout(self) -> None:
        self.s.plugin.signal(signal.SIGSTOP)

    # -- CPU burners --------------------------------------------------------------------------------
    def start_burners(self) -> None:
        self.ejections_at_start = len(ejections(self.s.logs))
        for _ in range(2):
            self.burners.append(subprocess.Popen(["/bin/sh", "-c", BURNER], stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.s.note("2 CPU burners started in the guest (until the bench)")

    def stop_burners(self) -> None:
        for p in self.burners:
            p.kill()
            p.wait()
        self.burners = []
        lines = ejections(self.s.logs)[self.ejections_at_start:]
        unintended = len(lines) - self.intended
        self.check("2 CPU burners", "containerd timed the plugin out outside the SIGSTOP steps",
                   "containerd.log 'closing plugin ... deadline exceeded'", "0",
                   f"{unintended} ({len(lines)} lines, {self.intended} from SIGSTOP steps)"
                   + (f": {lines[-1][-300:]}" if unintended > 0 and lines else ""),
                   "the reply path holds nothing that can wait", "containerd.log", ok=unintended <= 0)
        self.s.note(f"CPU burners stopped: {len(lines)} ejection(s) logged, {self.intended} intended")

    # -- steps ----------------------------------------------------------------------------------------
    def late_registration(self) -> None:
        plugin = self.s.plugin
        syncs = len(plugin.events("nri-synchronize"))
        plugin.signal(signal.SIGTERM)
        cid, _ = self.new_pod("1a7e", "-late-reg")
        plugin.start()
        dt = plugin.wait_synced(syncs + 1)
        self.start(cid)
        self.s.nri.wait_containers()
        waited = self.wait_values([cid])
        self.s.note(f"late registration: Synchronize {dt:.1f}s after the start with a container not started; "
                    f"its memory.min right {waited:.1f}s after it started")
        self.s.nri.check_all("plugin registered late (a container not started at its Synchronize)")

    def burst_with_ejection(self) -> None:
        plugin = self.s.plugin
        syncs = len(plugin.events("nri-synchronize"))
        before = len(ejections(self.s.logs))
        first, _ = self.new_pod("b0c1", "-burst1")
        self.start(first)
        self.stop_plugin_past_the_timeout()
        t = time.time()
        later = [self.new_pod(tail, f"-burst{i}")[0] for i, tail in ((2, "b0c2"), (3, "b0c3"))]
        t_burst = time.time() - t
        plugin.signal(signal.SIGCONT)
        dt = plugin.wait_synced(syncs + 1)
        for cid in later:
            self.start(cid)
        self.s.nri.wait_containers()
        waited = self.wait_values([first, *later])
        n = len(ejections(self.s.logs)) - before
        self.intended += n
        self.check("burst with an ejection", "containerd timed the stopped plugin out",
                   "containerd.log 'closing plugin ... deadline exceeded'", ">= 1", str(n),
                   "SIGSTOP past containerd's request timeout during the burst", "containerd.log", ok=n >= 1)
        self.s.note(f"burst with an ejection: 2 creates with the plugin stopped took {t_burst:.1f}s, {n} ejection(s); "
                    f"Synchronize {dt:.1f}s after SIGCONT; values right {waited:.1f}s after the starts")
        self.s.nri.check_all("ejection during a burst of creations")

    def gate_on_kubelet(self) -> None:
        """The plugin beside a kubelet whose MemoryQoS gate is on (the gate-on trace's kubelet:
        featureGates MemoryQoS, memoryThrottlingFactor 0.8): the kubelet's container values stay."""
        plugin = self.s.plugin
        with open(self.s.nri.kubelet_config) as f:
            kc = json.load(f)
        kc["featureGates"] = {**(kc.get("featureGates") or {}), "MemoryQoS": True}
        kc["memoryThrottlingFactor"] = 0.8
        path = os.path.join(RUN, "nri", "kubelet-config-gate-on.yaml")
        with open(path, "w") as f:
            json.dump(kc, f)
        syncs = len(plugin.events("nri-synchronize"))
        plugin.signal(signal.SIGTERM)
        normal = plugin.use_kubelet_config(path)
        plugin.start()
        plugin.wait_synced(syncs + 1)
        kubelets = {"memory.min": str(40 * 2**20), "memory.high": str(100 * 2**20)}  # the kubelet's own values
        first, p1 = self.new_pod("9a71", "-gate-on1", kubelets, model=False)
        self.start(first)
        syncs = len(plugin.events("nri-synchronize"))
        before = len(ejections(self.s.logs))
        self.stop_plugin_past_the_timeout()
        second, p2 = self.new_pod("9a72", "-gate-on2", kubelets, model=False)
        self.start(second)
        plugin.signal(signal.SIGCONT)
        plugin.wait_synced(syncs + 1)
        time.sleep(5)  # the Synchronize's updates and the confirmer, had there been any
        for cid, pod in ((first, p1), (second, p2)):
            for key, value in kubelets.items():
                self.check("gate-on kubelet", f"{pod['parent']}/{cid[:12]} {key}",
                           f"{CGROOT}{pod['parent']}/{cid}/{key}", value,
                           cg_read(f"{pod['parent']}/{cid}", key),
                           "the kubelet writes this key (gate on): NRI mode leaves it, nothing in force is lowered",
                           "cgroupfs")
        self.intended += len(ejections(self.s.logs)) - before
        self.s.note(f"gate-on kubelet: {len(kubelets) * 2} values of 2 containers kept as the kubelet set them")
        # the two pods stay (not in the model: no later check counts them; only the bench follows,
        # and removing pods takes minutes on a slow runtime, docs/testing.md "Stack matrix")
        syncs = len(plugin.events("nri-synchronize"))
        plugin.signal(signal.SIGTERM)
        plugin.use_kubelet_config(normal)
        plugin.start()
        plugin.wait_synced(syncs + 1)
