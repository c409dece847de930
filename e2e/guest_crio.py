#!/usr/bin/env python3
"""The CRI-O resize check, inside the VM (scripts/e2e-vm-crio boots it): a real CRI-O (a build
of a release before 1.36, which leaves `unified` out of UpdateContainerResources) with runc on
cgroup v2 (cgroupfs driver), and the shim from this checkout in front of it.

  1. a Burstable container (request 32Mi as the kubelet's unified memory.min, limit 128Mi)
     created through the shim: its crio-<id> cgroup holds the shim's memory.high for 128Mi;
  2. the same runtime asked directly (not through the shim) for a 192Mi limit with the
     memory.high for 192Mi in `unified`: the kernel gets the limit and keeps the old memory.high
     (the runtime's own behaviour, shown without the shim);
  3. `crictl update --memory 268435456` through the shim (the same request: the limit alone):
     the kernel holds memory.max 268435456 and the shim's memory.high for 256Mi, and the audit
     log has the shim's update-write.

No kubelet and no CNI: host-network pods, and the CRI calls a kubelet or crictl makes, from
Python. Writes OUT/report.json (every check with expected and actual) and OUT/logs/.

  guest_crio.py --out OUT --python PYTHON --crio-bin DIR --images DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guest_common import (  # noqa: E402
    CGROOT, CHECKOUT, MI, Cri, InfraError, Report, Shim, cg_read, log, read_audit, setup_cgroups, spawn,
)

RUN = "/run/e2e-crio"
CRIO_SOCK = f"{RUN}/crio.sock"
SHIM_SOCK = "/run/e2e/shim/memqos-shim.sock"
UID = "6d1e0f2a-3b4c-4d5e-8f60-718293a4b5c6"
POD_PARENT = f"/kubepods/burstable/pod{UID}"
REQUEST, LIMIT, DIRECT, RESIZED = 32 * MI, 128 * MI, 192 * MI, 256 * MI
SCENARIO = "crio-resize"


def high(limit: int, request: int = REQUEST, factor: float = 0.9, page: int = 4096) -> int:
    """KEP-2570's memory.high for a Burstable container, as shim.decision computes it."""
    from shim.decision import memory_high

    return memory_high(request, limit, factor, page)


def write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def crio_config(bin_dir: str) -> str:
    d = RUN
    policy = write(f"{d}/policy.json", json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    return write(f"{d}/crio.conf", f"""
[crio]
root = "{d}/storage"
runroot = "{d}/runroot"
storage_driver = "overlay"
log_dir = "{d}/pod-logs"
version_file = "{d}/version"
version_file_persist = "{d}/version-persist"
clean_shutdown_file = "{d}/clean.shutdown"
internal_wipe = true

[crio.api]
listen = "{CRIO_SOCK}"

[crio.runtime]
cgroup_manager = "cgroupfs"
default_runtime = "runc"
pinns_path = "{bin_dir}/pinns"
namespaces_dir = "{d}/ns"
container_exits_dir = "{d}/exits"
container_attach_socket_dir = "{d}/attach"
drop_infra_ctr = true

[crio.runtime.runtimes.runc]
runtime_path = "/usr/sbin/runc"
runtime_type = "oci"
runtime_root = "{d}/runc"
monitor_path = "/usr/bin/conmon"

[crio.image]
pause_image = "localhost/pause:e2e"
signature_policy = "{policy}"
big_files_temporary_dir = "{d}/tmp"

[crio.network]
network_dir = "{d}/cni-conf"
plugin_dirs = ["/usr/lib/cni"]

[crio.nri]
enable_nri = false

[crio.metrics]
enable_metrics = false
""")


def import_images(bin_dir: str, images: str, logs: str) -> None:
    for name, ref in (("pause", "localhost/pause:e2e"), ("busybox", "localhost/busybox:latest")):
        cmd = [f"{bin_dir}/copyimg", "--root", f"{RUN}/storage", "--runroot", f"{RUN}/runroot",
               "--storage-driver", "overlay", "--image-name", ref, "--import-from",
               f"oci-archive:{images}/{name}.tar"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        with open(f"{logs}/copyimg.log", "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}exit {r.returncode}\n")
        if r.returncode != 0:
            raise InfraError(f"copyimg {name}: exit {r.returncode}: {r.stderr[-500:]}")


def wait_answering(sock: str, proc, timeout: float, what: str):
    from shim.cri import api_pb2 as pb

    deadline = time.time() + timeout
    while True:
        if os.path.exists(sock):
            cri = Cri(sock)
            try:
                return cri.call("Version", pb.VersionRequest(version="v1"), timeout=10)
            except cri.grpc.RpcError:
                pass
            finally:
                cri.close()
        if proc.poll() is not None:
            raise InfraError(f"{what} exited with code {proc.returncode}")
        if time.time() > deadline:
            raise InfraError(f"{what} does not answer Version on {sock} after {timeout:.0f} s")
        time.sleep(1)


def kubepods() -> None:
    """What the kubelet makes before any pod: kubepods, the burstable QoS cgroup, the pod's."""
    for rel in ("kubepods", "kubepods/burstable", POD_PARENT.strip("/")):
        os.makedirs(os.path.join(CGROOT, rel), exist_ok=True)
        if rel != POD_PARENT.strip("/"):
            with open(os.path.join(CGROOT, rel, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids +cpu")


def sandbox(logs: str):
    from shim.cri import api_pb2 as pb

    cfg = pb.PodSandboxConfig()
    cfg.metadata.name, cfg.metadata.uid, cfg.metadata.namespace = "resize", UID, "default"
    cfg.log_directory = f"{logs}/pods/resize"
    os.makedirs(cfg.log_directory, exist_ok=True)
    cfg.linux.cgroup_parent = POD_PARENT
    cfg.linux.security_context.namespace_options.network = pb.NODE
    cfg.labels["io.kubernetes.pod.name"] = "resize"
    cfg.labels["io.kubernetes.pod.namespace"] = "default"
    cfg.labels["io.kubernetes.pod.uid"] = UID
    return cfg


def container_request(sid: str, cfg, name: str):
    from shim.cri import api_pb2 as pb

    req = pb.CreateContainerRequest(pod_sandbox_id=sid)
    req.sandbox_config.CopyFrom(cfg)
    c = req.config
    c.metadata.name = name
    c.image.image = "localhost/busybox:latest"
    c.image.user_specified_image = "localhost/busybox:latest"
    c.command.extend(["/bin/sleep", "3600"])
    c.log_path = f"{name}.log"
    r = c.linux.resources
    r.memory_limit_in_bytes = LIMIT
    r.oom_score_adj = 1000 - (1000 * REQUEST) // (8 * 1024 * MI)
    r.unified["memory.min"] = str(REQUEST)  # a kubelet with the MemoryQoS gate on sends the request
    r.cpu_shares = 2
    r.cpu_period = 100000
    c.labels["io.kubernetes.container.name"] = name
    return req


def run(args, report: Report) -> None:
    from shim.cri import api_pb2 as pb

    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    setup_cgroups()
    os.makedirs(os.path.join(CGROOT, "system.slice/crio.service"), exist_ok=True)
    kubepods()
    for d in ("storage", "runroot", "pod-logs", "ns", "exits", "attach", "runc", "tmp", "cni-conf", "config.d"):
        os.makedirs(f"{RUN}/{d}", exist_ok=True)
    conf = crio_config(args.crio_bin)
    registries = write(f"{RUN}/registries.conf", 'unqualified-search-registries = []\n')
    import_images(args.crio_bin, args.images, logs)
    t = time.time()
    crio = spawn([f"{args.crio_bin}/crio", "--config", conf, "--config-dir", f"{RUN}/config.d",
                  "--registries-conf", registries, "--log-level", "info"],
                 "system.slice/crio.service", f"{logs}/crio.log")
    version = wait_answering(CRIO_SOCK, crio, 600, "crio")
    report.timing("crio_start", time.time() - t)
    report.data["guest"]["runtime"] = f"{version.runtime_name} {version.runtime_version}"
    log(f"runtime {version.runtime_name} {version.runtime_version} answers")

    kc = write(f"{RUN}/kubelet.json", json.dumps({
        "kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/"}))
    shim = Shim(args.python, logs, SCENARIO, kc, "/proc/meminfo",
                extra=("--upstream", f"unix://{CRIO_SOCK}", "--kubelet-version", "1.28",
                       "--monitor-interval", "1", "--page-size", "4096"))
    shim.start()
    try:
        scenario(report, logs, shim)
    finally:
        shim.kill(15)
        crio.terminate()
        try:
            crio.wait(60)
        except subprocess.TimeoutExpired:
            crio.kill()


def scenario(report: Report, logs: str, shim: Shim) -> None:
    from shim.cri import api_pb2 as pb

    via_shim, direct = Cri(SHIM_SOCK), Cri(CRIO_SOCK)
    v = via_shim.call("Version", pb.VersionRequest(version="v1"))  # the kubelet's first call
    report.check(SCENARIO, "version", "runtime through the shim", "RuntimeName RuntimeVersion", "cri-o 1.34.11",
                 f"{v.runtime_name} {v.runtime_version}", source="CRI Version")
    cfg = sandbox(logs)
    sid = via_shim.call("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    cid = via_shim.call("CreateContainer", container_request(sid, cfg, "app")).container_id
    via_shim.call("StartContainer", pb.StartContainerRequest(container_id=cid))
    cg = f"{POD_PARENT}/crio-{cid}"
    report.data["guest"]["container_cgroup"] = cg
    subject = "default/resize/app"
    steps = [("created", LIMIT, high(LIMIT), "created through the shim: its unified in force")]
    for step, limit, want_high, why in steps:
        report.check(SCENARIO, step, subject, f"{cg}/memory.max", str(limit), cg_read(cg, "memory.max"), why)
        report.check(SCENARIO, step, subject, f"{cg}/memory.high", str(want_high), cg_read(cg, "memory.high"), why)
        report.check(SCENARIO, step, subject, f"{cg}/memory.min", str(REQUEST), cg_read(cg, "memory.min"), why)

    # the runtime alone: unified dropped on update
    u = pb.UpdateContainerResourcesRequest(container_id=cid)
    u.linux.memory_limit_in_bytes = DIRECT
    u.linux.unified["memory.high"] = str(high(DIRECT))
    direct.call("UpdateContainerResources", u)
    why = "asked of CRI-O directly with memory.high in unified: it applies the limit, drops unified"
    report.check(SCENARIO, "direct-update", subject, f"{cg}/memory.max", str(DIRECT), cg_read(cg, "memory.max"), why)
    report.check(SCENARIO, "direct-update", subject, f"{cg}/memory.high", str(high(LIMIT)),
                 cg_read(cg, "memory.high"), why + " (the value for the old limit stays)")

    # crictl update --memory 268435456 <id>, through the shim
    u = pb.UpdateContainerResourcesRequest(container_id=cid)
    u.linux.memory_limit_in_bytes = RESIZED
    t = time.time()
    via_shim.call("UpdateContainerResources", u)
    want = str(high(RESIZED))
    deadline = time.time() + 30  # the write runs on the call-finisher's thread after the answer
    while cg_read(cg, "memory.high") != want and time.time() < deadline:
        time.sleep(0.05)
    report.timing("update_to_memory_high", time.time() - t)
    why = "crictl update --memory through the shim: the runtime sets the limit, the shim writes memory.high"
    report.check(SCENARIO, "shim-update", subject, f"{cg}/memory.max", str(RESIZED), cg_read(cg, "memory.max"), why)
    report.check(SCENARIO, "shim-update", subject, f"{cg}/memory.high", want, cg_read(cg, "memory.high"), why)
    report.check(SCENARIO, "shim-update", subject, f"{cg}/memory.min", str(REQUEST), cg_read(cg, "memory.min"), why)
    time.sleep(3)  # three monitor rounds
    records = read_audit(shim.audit_log)
    writes = [r for r in records if r.get("event") == "update-write" and r.get("container_id") == cid]
    written = writes[-1].get("written", {}) if writes else {}
    report.check(SCENARIO, "shim-update", subject, "audit update-write memory.high",
                 json.dumps({"old": str(high(LIMIT)), "new": want}),
                 json.dumps(written.get("memory.high")), "the shim's write, audited", source="audit")
    runtime = [r for r in records if r.get("event") == "runtime"]
    report.check(SCENARIO, "shim-update", "runtime", "audit runtime unified_on_update", "written by the shim",
                 runtime[-1].get("unified_on_update", "") if runtime else "(none)", source="audit")
    mismatches = [r for r in records if r.get("event") == "kernel-mismatch" and r.get("container_id") == cid]
    report.check(SCENARIO, "shim-update", subject, "audit kernel-mismatch records", "0", str(len(mismatches)),
                 "the monitor finds the decided values in the kernel", source="audit")
    with open(os.path.join(logs, "cgroup-after.txt"), "w") as f:
        for name in ("memory.min", "memory.low", "memory.high", "memory.max"):
            f.write(f"{cg}/{name} {cg_read(cg, name)}\n")
    via_shim.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sid))
    via_shim.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sid))
    via_shim.close()
    direct.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--crio-bin", required=True)
    p.add_argument("--images", required=True)
    args = p.parse_args(argv)
    report = Report(args.out)
    open(os.path.join(args.out, "guest-started"), "w").close()
    report.data["guest"]["kernel"] = os.uname().release
    report.data["guest"]["checkout"] = subprocess.run(["git", "-C", CHECKOUT, "rev-parse", "HEAD"],
                                                      capture_output=True, text=True).stdout.strip()
    code = 0
    try:
        run(args, report)
        report.data["status"] = "done"
    except Exception as e:  # noqa: BLE001 - the report says what broke
        report.data["status"] = "error"
        report.data["errors"].append(f"{e.__class__.__name__}: {e}\n{traceback.format_exc()}")
        log(f"ERROR {e}")
        code = 3
    report.save()
    os.replace(report.path, os.path.join(args.out, "report.json"))
    s = report.data["summary"]
    log(f"{s['passed']}/{s['checks']} checks passed")
    return code or (1 if s["failed"] else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
