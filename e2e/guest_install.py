"""Phase "install" of the systemd guest (e2e/guest_systemd.py): the host install an operator
makes, proven on a systemd node without network.

Steps, with the guest set up by guest_systemd.Guest (kubepods slices, containerd):
  1. /etc/memqos-shim/config.yaml written first (this guest's containerd socket and
     KubeletConfiguration), so the install must keep it; `bash deploy/install.sh --wheel W
     --find-links H --no-index` with the guest's own /usr/bin/python3, where W is the wheel
     and H the wheelhouse the host made with `pip download` of W (scripts/e2e-vm-systemd):
     nothing else is installed. Checks: exit 0, the config kept, the unit active;
  2. kubelet-style traffic through the installed unit's socket: one Burstable pod made the way
     the kubelet makes it (Guest.create_pod); its container's memory.min/high/max;
  3. a crash loop: SIGKILL of the unit's main process 10 times, each as soon as systemd has
     started the next one. Checks: more than 5 of the kills within 10 s (what systemd's default
     start limit, 5 starts in 10 s, refuses; the span of all 10 is reported), the unit is
     active again and answers (Version, ListContainers with the pod's container), NRestarts
     grew by 10;
  4. `bash deploy/uninstall.sh --purge`: the unit, /opt/memqos-shim and /etc/memqos-shim gone.
The numbers (install time, kill times, NRestarts, the unit's state) go to report["install"].
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import signal
import time

import expect as X
from guest_common import CGROOT, CONTAINERD_SOCK, Cri, InfraError, cg_read, log

SCENARIO = "systemd"
UNIT = "memqos-shim.service"
PREFIX = "/opt/memqos-shim"
CONFIG = "/etc/memqos-shim/config.yaml"
SOCK = "/run/memqos-shim/memqos-shim.sock"
AUDIT = "/var/log/memqos-shim/audit.jsonl"
DROPIN_DIR = f"/etc/systemd/system/{UNIT}.d"
KILLS = 10
KILL_WINDOW_S = 10.0
DEFAULT_BURST = 5  # systemd's DefaultStartLimitBurst, over DefaultStartLimitIntervalSec=10s
MI = 1 << 20


def phase_install(g, wheelhouse: str | None) -> None:
    """``g``: the guest_systemd.Guest after its other phases (containerd up, no shim running)."""
    g.phase = "install"
    if not wheelhouse:
        g.report.skip(SCENARIO, "install", "no --wheelhouse (scripts/e2e-vm-systemd makes one)")
        return
    data: dict = {}
    g.report.data["install"] = data
    wheels = sorted(glob.glob(os.path.join(wheelhouse, "memqos_shim-*.whl")))
    if len(wheels) != 1:
        raise InfraError(f"expected one memqos_shim wheel in {wheelhouse}, found {wheels}")
    data["wheel"] = os.path.basename(wheels[0])
    data["wheel_bytes"] = os.path.getsize(wheels[0])
    data["wheelhouse"] = sorted(os.listdir(wheelhouse))
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        _install(g, checkout, wheels[0], wheelhouse, data)
        pod = _traffic(g, data)
        _crash_loop(g, pod, data)
    finally:
        _collect_logs(g)
        if g.cri:
            g.cri.close()
            g.cri = None  # teardown removes the pods through containerd
    _uninstall(g, checkout, data)


def _check(g, step: str, subject: str, file: str, expected, actual, why: str = "", source: str = "systemd",
           ok: bool | None = None) -> bool:
    return g.check(step, subject, file, expected, actual, why, source=source, ok=ok)


def _install(g, checkout: str, wheel: str, wheelhouse: str, data: dict) -> None:
    config = "\n".join([
        "# written by the e2e guest before deploy/install.sh, which must keep it",
        f"listen: unix://{SOCK}",
        f"upstream: unix://{CONTAINERD_SOCK}",
        f"kubelet-config: {g.kubelet_config}",
        f"cgroup-root: {CGROOT}",
        f"audit-log: {AUDIT}",
        "monitor-interval: 0",
        f"resync-interval: {g.args.resync:g}",
        "",
    ])
    os.makedirs(os.path.dirname(CONFIG), exist_ok=True)
    with open(CONFIG, "w") as f:
        f.write(config)
    # an operator's drop-in, as docs/install.md says: under TCG the shim takes a minute to start,
    # near systemd's default start timeout (90 s); uninstall.sh --purge removes it
    os.makedirs(DROPIN_DIR, exist_ok=True)
    with open(os.path.join(DROPIN_DIR, "e2e.conf"), "w") as f:
        f.write("[Service]\nTimeoutStartSec=600\n")
    t = time.time()
    p = g.run(["bash", os.path.join(checkout, "deploy", "install.sh"), "--wheel", wheel, "--find-links", wheelhouse,
               "--no-index", "--python", "/usr/bin/python3"], check=False, timeout=900)
    data["install_s"] = round(time.time() - t, 1)
    log(f"install: deploy/install.sh exit {p.returncode} after {data['install_s']} s")
    g.report.timing("install:install.sh", time.time() - t)
    with open(os.path.join(g.logs, "install.log"), "w") as f:
        f.write(p.stdout + p.stderr + f"exit {p.returncode}\n")
    _check(g, "installed", "bash deploy/install.sh --wheel W --find-links H --no-index (no network)", "exit code",
           "0", p.returncode, (p.stderr or p.stdout).strip()[-300:], source="process")
    if p.returncode != 0:
        raise InfraError(f"deploy/install.sh failed: {(p.stderr or p.stdout).strip()[-400:]}")
    with open(CONFIG) as f:
        kept = f.read() == config
    _check(g, "installed", "an existing config", CONFIG, "kept", "kept" if kept else "overwritten",
           "install.sh never overwrites a config", source="file")
    state = {k: g.show(UNIT, k) for k in ("ActiveState", "SubState", "UnitFileState", "FragmentPath", "MainPID")}
    data["after_install"] = state
    _check(g, "installed", "the unit after install.sh", f"systemctl show {UNIT}", "active/running/enabled",
           f"{state['ActiveState']}/{state['SubState']}/{state['UnitFileState']}", "enable --now, Type=notify")
    python = os.path.realpath(os.path.join(PREFIX, "bin", "python"))
    data["python"] = python
    _check(g, "installed", "the virtual environment's Python", f"{PREFIX}/bin/python", "/usr/bin/python3.*",
           python, "the guest's own Python, not the checkout's", source="file",
           ok=python.startswith("/usr/bin/python3"))


def _traffic(g, data: dict) -> dict:
    g.shim_unit = None  # stop_shim() must not stop the installed unit
    g.cri = Cri(SOCK)
    t = time.time()
    pod = g.create_pod("installed", X.BURSTABLE, 40 * MI, 120 * MI, True)
    data["create_pod_s"] = round(time.time() - t, 2)
    pg = g.node.page
    e = pod["exp"]
    want = {"memory.min": X.kernel_reads(e.min, pg), "memory.low": X.kernel_reads(e.low, pg),
             "memory.high": X.kernel_reads(e.high, pg), "memory.max": X.kernel_reads(e.max, pg)}
    for f, v in want.items():
        _check(g, "traffic", "container installed/main (Burstable) made through the installed unit",
               f"{CGROOT}/{pod['scope']}/{f}", v, cg_read(pod["scope"], f), json.dumps(e.why, sort_keys=True),
               source="cgroupfs")
    return pod


def _main_pid(g) -> int:
    try:
        return int(g.show(UNIT, "MainPID") or 0)
    except ValueError:
        return 0


def _crash_loop(g, pod: dict, data: dict) -> None:
    from shim.cri import api_pb2 as pb

    g.cri.close()
    g.cri = None
    before = int(g.show(UNIT, "NRestarts") or 0)
    # the unit's only process is its main process: read from the unit's cgroup, which costs no
    # systemctl call (each takes a while under TCG) between a start and its kill
    procs = os.path.join(CGROOT, g.show(UNIT, "ControlGroup").lstrip("/"), "cgroup.procs")
    first = _main_pid(g)
    kills: list[dict] = []
    killed: set[int] = set()
    t0 = time.time()
    deadline = t0 + 120
    while len(kills) < KILLS and time.time() < deadline:
        try:
            with open(procs) as f:
                pids = [int(x) for x in f.read().split() if int(x) not in killed]
        except OSError as e:  # between two starts: the cgroup is gone (ENOENT) or being removed (ENODEV)
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                raise
            pids = []
        if not pids:
            time.sleep(0.01)
            continue
        pid = pids[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.add(pid)
        kills.append({"pid": pid, "t_s": round(time.time() - t0, 2)})
    if kills:
        kills[0]["main_pid_before"] = first
    span = round(kills[-1]["t_s"] - kills[0]["t_s"], 2) if kills else None
    times = [k["t_s"] for k in kills]
    densest = max((sum(1 for u in times[i:] if u - t <= KILL_WINDOW_S) for i, t in enumerate(times)), default=0)
    data["kills"] = kills
    data["kill_span_s"] = span
    data["kills_in_densest_10s"] = densest
    log(f"install: {len(kills)} SIGKILLs of the main process within {span} s ({densest} within 10 s)")
    # Each kill waits for systemd's next start (RestartSec=500ms, then a fork): under TCG on a busy
    # host ten of them may take a little over 10 s. What a start limit would refuse is more than
    # DEFAULT_BURST starts within 10 s: the check asks for that, the span is reported.
    _check(g, "crash-loop", "SIGKILL of the main process, each as soon as systemd started the next", "kills",
           f"{KILLS}, more than {DEFAULT_BURST} of them within {KILL_WINDOW_S:g} s",
           f"{len(kills)} in {span} s, {densest} within {KILL_WINDOW_S:g} s",
           f"systemd's default start limit ({DEFAULT_BURST} starts in 10 s) would leave the unit failed",
           source="process", ok=len(kills) == KILLS and densest > DEFAULT_BURST)
    # active and serving again
    t = time.time()
    answered = None
    while time.time() - t < 180:
        if g.show(UNIT, "ActiveState") == "active":
            cri = Cri(SOCK)
            try:
                version = cri.call("Version", pb.VersionRequest(), timeout=10)
                listed = cri.call("ListContainers", pb.ListContainersRequest(), timeout=10)
                answered = {"runtime": f"{version.runtime_name} {version.runtime_version}",
                            "containers": [c.id for c in listed.containers]}
                break
            except cri.grpc.RpcError:
                pass
            finally:
                cri.close()
        if g.show(UNIT, "ActiveState") == "failed":
            break
        time.sleep(0.3)
    data["serving_again_s"] = round(time.time() - t, 2) if answered else None
    state = {k: g.show(UNIT, k) for k in ("ActiveState", "SubState", "Result", "NRestarts", "MainPID",
                                          "StartLimitIntervalUSec", "StartLimitBurst", "RestartUSec")}
    data["after_crash_loop"] = state
    data["restarts_counted"] = int(state["NRestarts"] or 0) - before
    log(f"install: after the kills {state}, serving again after {data['serving_again_s']} s")
    _check(g, "crash-loop", "the unit after the kills", f"systemctl show -p ActiveState,SubState {UNIT}",
           "active/running", f"{state['ActiveState']}/{state['SubState']}",
           f"StartLimitIntervalUSec={state['StartLimitIntervalUSec']}, Result={state['Result']}")
    _check(g, "crash-loop", "restarts systemd counted", f"systemctl show -p NRestarts {UNIT}", f">= {KILLS}",
           data["restarts_counted"], f"NRestarts {before} before the kills, {state['NRestarts']} after",
           ok=data["restarts_counted"] >= KILLS)
    _check(g, "crash-loop", "a call through the socket after the kills", f"{SOCK} ListContainers",
           f"answered, with container {pod['id'][:12]}",
           "no answer" if answered is None else
           f"answered by {answered['runtime']}" + (f", with container {pod['id'][:12]}"
                                                   if pod["id"] in answered["containers"] else ", without the pod"),
           "the kubelet's calls are served again", source="process",
           ok=answered is not None and pod["id"] in answered["containers"])


def _collect_logs(g) -> None:
    p = g.run(["journalctl", "--no-pager", "-o", "short-monotonic", "-u", UNIT], check=False)
    with open(os.path.join(g.logs, "install-journal.log"), "w") as f:
        f.write(p.stdout)
    if os.path.exists(AUDIT):
        shutil.copy(AUDIT, os.path.join(g.logs, "install-audit.jsonl"))


def _uninstall(g, checkout: str, data: dict) -> None:
    t = time.time()
    p = g.run(["bash", os.path.join(checkout, "deploy", "uninstall.sh"), "--purge"], check=False, timeout=300)
    data["uninstall_s"] = round(time.time() - t, 1)
    log(f"install: deploy/uninstall.sh --purge exit {p.returncode} after {data['uninstall_s']} s")
    with open(os.path.join(g.logs, "uninstall.log"), "w") as f:
        f.write(p.stdout + p.stderr + f"exit {p.returncode}\n")
    _check(g, "uninstalled", "bash deploy/uninstall.sh --purge", "exit code", "0", p.returncode,
           (p.stderr or p.stdout).strip()[-300:], source="process")
    left = [x for x in (PREFIX, os.path.dirname(CONFIG), f"/etc/systemd/system/{UNIT}") if os.path.exists(x)]
    _check(g, "uninstalled", "what install.sh put on the node", "files", "[]", str(left),
           "the virtual environment, the unit, the config (--purge)", source="file")
    _check(g, "uninstalled", "the unit after uninstall.sh", f"systemctl show -p LoadState {UNIT}", "not-found",
           g.show(UNIT, "LoadState"))
