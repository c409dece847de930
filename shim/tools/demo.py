"""The demo behind scripts/demo: the shim in front of the in-repo fake runtime, driven
like a kubelet would drive it, on a fixed 8 GiB node described by files under out/demo/.

Nothing here needs root, containerd or cgroup v2 on the host: the cgroup tree is a
directory of plain files (the kubelet would have created the pod cgroups; the demo
does it before each RunPodSandbox).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc

from shim.cri import api_pb2_grpc, pb
from shim.tools.kubelet_requests import create_container, oom_score_adj, sandbox_config, update_resources

MI = 2**20
GI = 2**30
CAPACITY = 8 * GI

# (pod, uid, qos, annotations, [(container, request, limit, kubelet unified, init?)])
PODS = [
    ("web", "1f0c2a9e-0000-4000-8000-000000000001", "guaranteed", {},
     [("app", 256 * MI, 256 * MI, {}, False)]),
    ("api", "1f0c2a9e-0000-4000-8000-000000000002", "burstable", {},
     [("app", 128 * MI, 512 * MI, {}, False)]),
    ("worker", "1f0c2a9e-0000-4000-8000-000000000003", "burstable",
     {"memqos.io/requests": json.dumps({"worker": "64Mi"})},
     [("worker", 64 * MI, 0, {}, False)]),
    ("batch", "1f0c2a9e-0000-4000-8000-000000000004", "besteffort", {},
     [("job", 0, 0, {}, False)]),
    ("multi", "1f0c2a9e-0000-4000-8000-000000000005", "burstable",
     {"memqos.io/requests": json.dumps({"init": "16Mi", "a": "24Mi", "b": "8Mi"})},
     [("init", 16 * MI, 0, {}, True), ("a", 24 * MI, 64 * MI, {}, False), ("b", 8 * MI, 0, {}, False)]),
    # a v1.37 kubelet with the MemoryQoS gate off on cgroup v2: memory.high="max" and
    # memory.oom.group; the shim replaces the first and keeps the second
    ("newer-kubelet", "1f0c2a9e-0000-4000-8000-000000000006", "burstable", {},
     [("app", 32 * MI, 256 * MI, {"memory.high": "max", "memory.oom.group": "1"}, False)]),
]


def _pod_dir(root: Path, qos: str, uid: str) -> Path:
    if qos == "guaranteed":
        return root / "kubepods" / f"pod{uid}"
    return root / "kubepods" / qos / f"pod{uid}"


def _make_cgroup_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("memory.min", "memory.low"):
        f = path / name
        if not f.exists():
            f.write_text("0\n")
    if not (path / "memory.high").exists():
        (path / "memory.high").write_text("max\n")


def _wait_for_socket(path: Path, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            raise SystemExit(f"demo: {what} exited with {proc.returncode}; see its log under out/demo/")
        time.sleep(0.05)
    raise SystemExit(f"demo: {what} did not create {path} within {timeout}s")


def _fmt_unified(u: dict) -> str:
    if not u:
        return "{}"
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(u.items())) + "}"


def print_audit_table(records: list[dict], out=None) -> None:
    out = out or sys.stdout
    rows = [r for r in records if r.get("method") in ("CreateContainer", "UpdateContainerResources")]
    header = ("method", "pod/container", "QoS", "request (source)", "limit", "unified before -> after")
    print(f"{header[0]:<24} {header[1]:<22} {header[2]:<10} {header[3]:<28} {header[4]:>10}  {header[5]}", file=out)
    for r in rows:
        who = f"{r.get('pod', '').split('/')[-1]}/{r.get('container', '')}"
        if r.get("event") == "fail-open":
            print(f"{r['method']:<24} {who:<22} fail-open: {r.get('error')}", file=out)
            continue
        req = f"{r.get('request', 0)} ({r.get('request_source', '')})"
        print(f"{r['method']:<24} {who:<22} {r.get('qos', ''):<10} {req:<28} {r.get('limit', 0):>10}  "
              f"{_fmt_unified(r.get('unified_before', {}))} -> {_fmt_unified(r.get('unified_after', {}))}", file=out)


def run(out_dir: Path, keep_running: bool = False) -> int:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cgroot = out_dir / "cgroup"
    cgroot.mkdir()
    (cgroot / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    for d in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
        _make_cgroup_dir(cgroot / d)
    (out_dir / "meminfo").write_text(f"MemTotal:       {CAPACITY // 1024} kB\n")
    (out_dir / "kubelet-config.yaml").write_text(
        "kind: KubeletConfiguration\napiVersion: kubelet.config.k8s.io/v1beta1\n"
        "cgroupDriver: cgroupfs\nkubeReserved: {memory: 100Mi}\nsystemReserved: {memory: 100Mi}\n"
    )
    runtime_sock, shim_sock = out_dir / "runtime.sock", out_dir / "shim.sock"
    audit = out_dir / "audit.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    try:
        runtime = subprocess.Popen(
            [sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", str(runtime_sock)],
            stdout=open(out_dir / "fake-runtime.log", "w"), stderr=subprocess.STDOUT, env=env)
        procs.append(runtime)
        _wait_for_socket(runtime_sock, runtime, "the fake runtime")
        shim = subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--listen", str(shim_sock), "--upstream", str(runtime_sock),
             "--kubelet-config", str(out_dir / "kubelet-config.yaml"), "--cgroup-root", str(cgroot),
             "--meminfo", str(out_dir / "meminfo"), "--page-size", "4096", "--audit-log", str(audit)],
            stdout=open(out_dir / "shim.log", "w"), stderr=subprocess.STDOUT, env=env)
        procs.append(shim)
        _wait_for_socket(shim_sock, shim, "memqos-shim")
        print(f"memqos-shim on {shim_sock} -> fake runtime on {runtime_sock}; node: 8Gi, "
              f"kubeReserved 100Mi, systemReserved 100Mi, factor 0.9, page 4096\n")
        drive(f"unix://{shim_sock}", cgroot)
        records = _read_audit(audit, expect=sum(len(p[4]) for p in PODS) + 1)
        print_audit_table(records)
        levels = _settled_levels(cgroot)
        if levels:
            print("\npod / QoS / node cgroups with memory.min set (the fake cgroup tree):")
            for p in levels:
                print(f"  /{p.parent.relative_to(cgroot)}  memory.min={p.read_text().strip()}")
        print(f"\naudit log: {audit}  (one JSON object per line; shim log: {out_dir / 'shim.log'})")
        if keep_running:
            print("running; Ctrl-C to stop")
            shim.wait()
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def _settled_levels(cgroot: Path, timeout: float = 5) -> list[Path]:
    """The reconciler writes pod/QoS/node values from a side thread: wait (bounded) until
    the tree stops changing, then list the cgroups with a non-zero memory.min."""
    def snapshot():
        return {p: p.read_text().strip() for p in cgroot.rglob("memory.min")}

    deadline = time.monotonic() + timeout
    last = snapshot()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = snapshot()
        if now == last:
            break
        last = now
    return sorted(p for p, v in last.items() if v not in ("", "0"))


def _read_audit(path: Path, expect: int, timeout: float = 10) -> list[dict]:
    """The audit writer is asynchronous: wait (bounded) until the decisions are written."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        done = sum(1 for r in records if r.get("method") in ("CreateContainer", "UpdateContainerResources"))
        if done >= expect or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def drive(target: str, cgroot: Path) -> None:
    """RunPodSandbox, CreateContainer, StartContainer for every pod, one resize, one removal."""
    channel = grpc.insecure_channel(target)
    rt = api_pb2_grpc.RuntimeServiceStub(channel)
    rt.Version(pb.VersionRequest(version="v1"), timeout=10)
    containers: dict[tuple[str, str], str] = {}
    sandboxes: dict[str, str] = {}
    for pod, uid, qos, annotations, ctrs in PODS:
        _make_cgroup_dir(_pod_dir(cgroot, qos, uid))  # the kubelet creates the pod cgroup
        sb = sandbox_config(pod, uid, qos, annotations=annotations)
        sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id
        sandboxes[pod] = sid
        for name, request, limit, unified, is_init in ctrs:
            req = create_container(sid, sb, name, qos, request=request, limit=limit, unified=unified,
                                   capacity=CAPACITY)
            cid = rt.CreateContainer(req, timeout=10).container_id
            containers[(pod, name)] = cid
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=10)
            if is_init:  # an init container runs to completion before the next one starts
                rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0), timeout=10)
    # in-place resize of api/app: limit 512Mi -> 1Gi
    rt.UpdateContainerResources(update_resources(
        containers[("api", "app")], limit=GI, oom_score_adj=oom_score_adj("burstable", 128 * MI, CAPACITY)),
        timeout=10)
    # the batch pod finishes and is removed
    rt.StopContainer(pb.StopContainerRequest(container_id=containers[("batch", "job")], timeout=0), timeout=10)
    rt.RemoveContainer(pb.RemoveContainerRequest(container_id=containers[("batch", "job")]), timeout=10)
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandboxes["batch"]), timeout=10)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandboxes["batch"]), timeout=10)
    channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shim.tools.demo", description=__doc__)
    p.add_argument("--out", default="out/demo", help="directory for the demo's files (recreated)")
    p.add_argument("--keep-running", action="store_true", help="leave the shim running after the demo")
    args = p.parse_args(argv)
    return run(Path(args.out).resolve(), args.keep_running)


if __name__ == "__main__":
    raise SystemExit(main())
