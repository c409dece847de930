#!/usr/bin/env python3
"""critest (the CRI validation suite of cri-tools) inside the VM, once straight at containerd and
once through the shim from this checkout (scripts/critest-vm boots it).

  1. a registry on 127.0.0.1 (e2e/registry.py) serves the images critest pulls, built by
     e2e/critest_images.py; containerd's registry host configuration (config_path, one
     hosts.toml per registry host) sends every pull of those hosts there;
  2. containerd (the stack's binaries, e2e/stacks.py) with a bridge + portmap CNI network
     (Debian's containernetworking-plugins), its streaming server on 127.0.0.1;
  3. critest against containerd's socket: the baseline of this boot;
  4. the shim (`memqos-shim serve`, default settings, a cgroupfs kubelet configuration) in front
     of containerd, and critest against the shim's socket. critest opens two connections per
     spec and never closes them, so this run holds more connections than the shim's
     max-connections (128) by its end: every spec must still pass;
  5. the shim's transport metrics and audit counts.

Writes OUT/report.json (checks, the two runs' counts and failed specs) and OUT/logs/ (critest
output of each run, containerd, registry, shim, audit).

  guest_critest.py --out OUT --python PYTHON --critest BIN --store DIR --images DIR
                   --stack STACK_JSON [--skip REGEX] [--focus REGEX]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guest_common import (  # noqa: E402
    CGROOT, CHECKOUT, CONTAINERD_SOCK, RUN, InfraError, Report, Shim, SHIM_SOCK, log, read_audit,
    scrape_metrics, setup_cgroups, spawn, wait_for_socket,
)

SCENARIO = "critest"
REGISTRY = "127.0.0.1:5000"
# the registry hosts critest v1.26's image references name (pkg/validate/consts.go,
# pkg/framework/util.go), and docker.io for short names
REGISTRY_HOSTS = ("gcr.io", "registry.k8s.io", "docker.io", "k8s.gcr.io")
CNI_BIN = "/usr/lib/cni"
METRICS = "127.0.0.1:9187"
MAX_CONNECTIONS = 128  # the shim's default max-connections
POD_SUBNET = "10.88.0.0/16"
KERNEL_MODULES = ("bridge", "br_netfilter", "veth", "nf_tables", "nft_chain_nat", "nft_compat",
                  "xt_nat", "xt_MASQUERADE", "xt_mark", "xt_comment", "xt_multiport", "xt_addrtype",
                  "iptable_nat", "iptable_filter")


def write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


# -- the node: network, registry, containerd ------------------------------------------------------------
def network(logs: str) -> None:
    """Modules and sysctls the bridge and portmap plugins need; lo up."""
    lines = []
    for m in KERNEL_MODULES:
        p = subprocess.run(["modprobe", m], capture_output=True, text=True)
        lines.append(f"modprobe {m}: exit {p.returncode} {p.stderr.strip()}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/ipv4/conf/all/route_localnet", "1"),
                       ("net/bridge/bridge-nf-call-iptables", "1")):
        try:
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(value)
            lines.append(f"{key} = {value}")
        except OSError as e:
            lines.append(f"{key}: {e}")
    write(os.path.join(logs, "network.txt"), "\n".join(lines) + "\n")


def start_registry(python: str, store: str, logs: str):
    port_file = os.path.join(RUN, "registry.port")
    proc = spawn([python, os.path.join(CHECKOUT, "e2e", "registry.py"), "--store", store, "--listen", REGISTRY,
                  "--port-file", port_file, "--log", os.path.join(logs, "registry-requests.log")],
                 "system.slice", os.path.join(logs, "registry.log"))
    wait_for_socket(port_file, proc, 120, "e2e/registry.py")
    return proc


def containerd_config(stack: dict) -> str:
    """The suite's containerd configuration for the stack, with CNI from Debian's plugins, the
    registry host directory (the streaming server stays on its default address, 127.0.0.1)."""
    hosts_dir = os.path.join(RUN, "certs.d")
    for host in REGISTRY_HOSTS:
        write(os.path.join(hosts_dir, host, "hosts.toml"),
              f'server = "https://{host}"\n\n[host."http://{REGISTRY}"]\n  capabilities = ["pull", "resolve"]\n')
    with open(stack["config"]) as f:
        conf = f.read().replace("@ROOT@", RUN).replace("@SYSTEMD_CGROUP@", "false")
    conf = conf.replace("@RUNC@", stack["runc"]).replace("#@NRI@", "")
    conf = conf.replace(f'"{RUN}/cni/bin"', f'"{CNI_BIN}"')
    if 'version = 3' in conf:
        conf += f'\n[plugins."io.containerd.cri.v1.images".registry]\n  config_path = "{hosts_dir}"\n'
    else:
        conf += f'\n[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "{hosts_dir}"\n'
    write(os.path.join(RUN, "cni", "net.d", "10-critest.conflist"), json.dumps({
        "cniVersion": "1.0.0", "name": "critest", "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": os.path.join(RUN, "cni", "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
    return write(os.path.join(RUN, "containerd", "config.toml"), conf)


def start_containerd(stack: dict, images: str, logs: str, report: Report):
    from guest_common import Cri
    from shim.cri import api_pb2 as pb

    os.makedirs(os.path.join(CGROOT, "system.slice/containerd.service"), exist_ok=True)
    conf = containerd_config(stack)
    with open(conf) as f:
        write(os.path.join(logs, "containerd.toml"), f.read())
    t = time.time()
    proc = spawn([stack["containerd"], "--config", conf], "system.slice/containerd.service",
                 os.path.join(logs, "containerd.log"))
    wait_for_socket(CONTAINERD_SOCK, proc, 300, "containerd")
    # the sandbox (pause) image is the suite's own, imported: critest never pulls it
    tar = os.path.join(images, "pause.tar")
    p = subprocess.run([stack["ctr"], "-a", CONTAINERD_SOCK, "-n", "k8s.io", "images", "import", tar],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise InfraError(f"ctr images import {tar}: {p.stderr.strip()[-400:]}")
    cri = Cri(CONTAINERD_SOCK)
    try:
        deadline = time.time() + 300
        while True:
            try:
                v = cri.call("Version", pb.VersionRequest(), timeout=30)
                break
            except cri.grpc.RpcError as e:
                if time.time() > deadline:
                    raise InfraError(f"containerd CRI does not answer: {e.code().name}") from None
                time.sleep(1)
    finally:
        cri.close()
    report.timing("containerd_start", time.time() - t)
    report.data["guest"]["runtime"] = f"{v.runtime_name} {v.runtime_version}"
    log(f"containerd {v.runtime_version} answers")
    return proc


# -- critest --------------------------------------------------------------------------------------------
SUMMARY = re.compile(r"^(SUCCESS|FAIL)! -- (\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped")
RAN = re.compile(r"^Ran (\d+) of (\d+) Specs in ([\d.]+) seconds")
FAILED = re.compile(r"^\s*\[(?:FAIL|PANICKED|TIMEDOUT|INTERRUPTED)\] (.*?)(?: \[It\].*)?$")


def parse_critest(text: str) -> dict:
    """Counts and failed spec names from critest's (ginkgo v2) closing lines."""
    result: dict = {"ran": None, "total": None, "passed": None, "failed": None, "skipped": None,
                    "seconds": None, "failed_specs": []}
    summarizing = False
    for line in text.splitlines():
        if m := RAN.match(line):
            result.update(ran=int(m[1]), total=int(m[2]), seconds=float(m[3]))
        elif m := SUMMARY.match(line):
            result.update(passed=int(m[2]), failed=int(m[3]), skipped=int(m[5]))
        elif line.startswith("Summarizing"):
            summarizing = True
        elif summarizing and (m := FAILED.match(line)):
            result["failed_specs"].append(m[1].strip())
    return result


def run_critest(binary: str, endpoint: str, name: str, logs: str, skip: str, focus: str,
                timeout: float) -> dict:
    # critest-run-NAME.log: the shim's own log is critest-shim.log (guest_common.Shim)
    report_dir = os.path.join(logs, f"critest-run-{name}")
    cmd = [binary, "--runtime-endpoint", endpoint, "--image-endpoint", endpoint, "--ginkgo.no-color",
           "--ginkgo.v", "--ginkgo.timeout", f"{int(timeout)}s", "--report-dir", report_dir]
    if skip:
        cmd += ["--ginkgo.skip", skip]
    if focus:
        cmd += ["--ginkgo.focus", focus]
    os.makedirs(report_dir, exist_ok=True)
    out_path = os.path.join(logs, f"critest-run-{name}.log")
    log(f"critest ({name}): {' '.join(cmd)}")
    t = time.time()
    with open(out_path, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=timeout + 120).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    with open(out_path, errors="replace") as f:
        result = parse_critest(f.read())
    result.update(exit=rc, wall_s=round(time.time() - t, 1), endpoint=endpoint)
    log(f"critest ({name}): exit {rc}, ran {result['ran']} of {result['total']}, passed {result['passed']}, "
        f"failed {result['failed']} in {result['wall_s']} s")
    return result


class ConnectionSampler(threading.Thread):
    """Reads the shim's memqos_transport_connections every few seconds: the peak a run reached."""

    def __init__(self, address: str, every: float = 3.0):
        super().__init__(daemon=True)
        self.address, self.every = address, every
        self.peak, self.samples = 0.0, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            value = scrape_metrics(self.address).get("memqos_transport_connections")
            if isinstance(value, float):
                self.peak, self.samples = max(self.peak, value), self.samples + 1

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


def check_run(report: Report, name: str, r: dict, expect_ran: int | None) -> None:
    why = f"critest {name}: {r['endpoint']}"
    report.check(SCENARIO, name, "critest", "specs passed / ran", f"{r['ran']}/{r['ran']}",
                 f"{r['passed']}/{r['ran']}", why + "; failed: " + "; ".join(r["failed_specs"][:10]),
                 source="critest", ok=r["ran"] is not None and r["ran"] > 0 and r["passed"] == r["ran"])
    report.check(SCENARIO, name, "critest", "exit code", "0", str(r["exit"]), why, source="critest")
    if expect_ran is not None:
        report.check(SCENARIO, name, "critest", "specs ran", str(expect_ran), str(r["ran"]),
                     "as many specs as the run straight at containerd", source="critest")


def run_through_shim(args, report: Report, logs: str, runs: dict) -> Shim:
    """The shim with its defaults in front of containerd, critest through it, then the shim's
    connection metrics, audit counts and log; the shim is stopped before the function returns."""
    kc = write(f"{RUN}/kubelet.json", json.dumps({
        "kind": "KubeletConfiguration", "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True, "cgroupRoot": "/"}))
    shim = Shim(args.python, logs, SCENARIO, kc, "/proc/meminfo",
                extra=("--kubelet-version", "1.28", "--page-size", "4096", "--metrics-address", METRICS))
    report.timing("shim_start", shim.start())
    sampler = ConnectionSampler(METRICS)
    sampler.start()
    try:
        runs["shim"] = r = run_critest(args.critest, f"unix://{SHIM_SOCK}", "shim", logs, args.skip, args.focus,
                                       args.timeout)
    finally:
        sampler.stop()
    report.data["shim_connections_peak"] = {"peak": sampler.peak, "samples": sampler.samples}
    check_run(report, "shim", r, None)
    transport = {k: v for k, v in scrape_metrics(METRICS).items() if k.startswith("memqos_transport_connections")}
    report.data["shim_metrics"] = transport
    shed = sum(v for k, v in transport.items() if k.startswith("memqos_transport_connections_shed_total"))
    if (r["ran"] or 0) * 2 > MAX_CONNECTIONS:  # two connections a spec, never closed
        report.check(SCENARIO, "shim", "connections", "memqos_transport_connections_shed_total (sum)", "> 0",
                     str(shed), f"critest held more connections than max-connections ({MAX_CONNECTIONS}; peak "
                     f"seen {sampler.peak:g}): the quiet ones were shed", source="metrics", ok=shed > 0)
    shim.kill(15)
    counts: dict[str, int] = {}
    for rec in read_audit(shim.audit_log):
        counts[rec.get("event", "?")] = counts.get(rec.get("event", "?"), 0) + 1
    report.data["shim_audit_events"] = counts
    with open(shim.log, errors="replace") as f:
        tracebacks = f.read().count("Traceback")
    report.check(SCENARIO, "shim", "shim log", "tracebacks", "0", str(tracebacks), "the shim ran clean", source="log")
    return shim


def run(args, report: Report) -> None:
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(args.stack) as f:
        stack = json.load(f)
    if stack.get("bin_dirs"):
        os.environ["PATH"] = os.pathsep.join(stack["bin_dirs"] + [os.environ.get("PATH", "")])
    report.data["stack"] = {k: stack.get(k) for k in ("name", "containerd_version", "runc_version", "source")}
    setup_cgroups()
    for d in ("containerd", "cni/net.d", "cni/ipam", "shim"):
        os.makedirs(os.path.join(RUN, d), exist_ok=True)
    network(logs)
    registry = start_registry(args.python, args.store, logs)
    containerd = start_containerd(stack, args.images, logs, report)
    shim = None
    try:
        p = subprocess.run([args.critest, "--version"], capture_output=True, text=True)
        report.data["guest"]["critest"] = ((p.stdout or p.stderr).strip().splitlines() or ["?"])[0]  # then "PASS"
        runs = report.data.setdefault("critest", {})
        for name in args.runs:
            if name == "shim":
                shim = run_through_shim(args, report, logs, runs)
            else:
                runs["direct"] = run_critest(args.critest, f"unix://{CONTAINERD_SOCK}", "direct", logs, args.skip,
                                             args.focus, args.timeout)
                check_run(report, "direct", runs["direct"], None)
            report.save()
        if "shim" in runs and "direct" in runs:
            report.check(SCENARIO, "shim", "critest", "specs ran", str(runs["direct"]["ran"]), str(runs["shim"]["ran"]),
                         "as many specs through the shim as straight at containerd", source="critest")
            report.check(SCENARIO, "shim", "critest", "failed specs",
                         json.dumps(sorted(runs["direct"]["failed_specs"])),
                         json.dumps(sorted(runs["shim"]["failed_specs"])),
                         "through the shim the same specs fail as straight at containerd", source="critest")
    finally:
        if shim and shim.proc and shim.proc.poll() is None:
            shim.kill(15)
        for proc in (containerd, registry):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--critest", required=True)
    p.add_argument("--store", required=True, help="e2e/critest_images.py's output (the registry's store)")
    p.add_argument("--images", required=True, help="e2e/build_images.py's output (pause.tar)")
    p.add_argument("--stack", required=True)
    p.add_argument("--args", default="", help="a JSON file with skip and focus (regexes with spaces)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--runs", default="shim,direct",
                   help="which critest runs, in order: shim (through the shim), direct (at containerd)")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.runs or set(args.runs) - {"shim", "direct"}:
        p.error("--runs: a comma list of shim and direct")
    args.skip = args.focus = ""
    if args.args:
        with open(args.args) as f:
            extra = json.load(f)
        args.skip, args.focus = extra.get("skip", ""), extra.get("focus", "")
    report = Report(args.out)
    open(os.path.join(args.out, "guest-started"), "w").close()
    report.data["guest"]["kernel"] = os.uname().release
    report.data["guest"]["checkout"] = subprocess.run(["git", "-C", CHECKOUT, "rev-parse", "HEAD"],
                                                      capture_output=True, text=True).stdout.strip()
    report.data["guest"]["skip"], report.data["guest"]["focus"] = args.skip, args.focus
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
