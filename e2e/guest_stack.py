"""The guest's runtime stack (e2e/guest.py, e2e/guest_systemd.py and their scenarios): which
containerd + runc binaries run (e2e/stacks.py's stack.json, or PATH), containerd started with the
local images imported, the guest's facts, and the check that the processes running are the stack's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

from guest_common import (
    CGROOT, CONTAINERD_SOCK, HERE, HOG_IMAGE, RUN, Cri, InfraError, Report, pids_named, spawn, wait_for_socket
)


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
