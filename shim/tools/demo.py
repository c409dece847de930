"""`memqos-shim demo` (and scripts/demo): the shim in front of a stand-in runtime
(``shim.tools.demo_runtime``), driven like a kubelet would drive it, on a fixed 8 GiB node
described by files in the demo's directory.

Nothing here needs root, containerd, cgroup v2 on the host or anything beyond the runtime
install: the cgroup tree is a directory of plain files (the kubelet would have created the pod
cgroups; the demo does it before each RunPodSandbox).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shim.cri import pb
from shim.cri.methods import RUNTIME_SERVICE
from shim.tools.kubelet_requests import create_container, oom_score_adj, sandbox_config, update_resources
from shim.transport.unary_client import UnaryClient

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


def _accepts(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:  # not there yet, or bound and not yet listening
        return False
    finally:
        s.close()


def _wait_for_socket(path: Path, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _accepts(path):
            return
        if proc.poll() is not None:
            raise SystemExit(f"demo: {what} exited with {proc.returncode}; see its log in {path.parent}")
        time.sleep(0.05)
    raise SystemExit(f"demo: {what} does not accept connections on {path} after {timeout}s")


def size(n: int) -> str:
    """Mi or Gi beside the bytes: '256Mi (268435456)', '1.5Gi (1610612736)', '0'."""
    if not n:
        return "0"
    unit, name = (GI, "Gi") if n >= GI else (MI, "Mi")
    v = n / unit
    return f"{v:.0f}{name} ({n})" if n % unit == 0 else f"{v:.1f}{name} ({n})"


BYTE_KEYS = frozenset({"memory.min", "memory.low", "memory.high", "memory.max", "memory.swap.max"})


def _value(v: str, key: str = "memory.min") -> str:
    return size(int(v)) if key in BYTE_KEYS and str(v).isdigit() else str(v)


def _fmt_unified(u: dict) -> str:
    if not u:
        return "{}"
    return "{" + ", ".join(f"{k}={_value(v, k)}" for k, v in sorted(u.items())) + "}"


def print_audit_table(records: list[dict], out=None) -> None:
    out = out or sys.stdout
    rows = [r for r in records if r.get("method") in ("CreateContainer", "UpdateContainerResources")]
    header = ("method", "pod/container", "QoS", "request (source)", "limit", "unified before -> after")
    print(f"{header[0]:<24} {header[1]:<22} {header[2]:<10} {header[3]:<36} {header[4]:<20}  {header[5]}", file=out)
    for r in rows:
        who = f"{r.get('pod', '').split('/')[-1]}/{r.get('container', '')}"
        if r.get("event") == "fail-open":
            print(f"{r['method']:<24} {who:<22} fail-open: {r.get('error')}", file=out)
            continue
        req = f"{size(r.get('request', 0))} {r.get('request_source', '')}"
        print(f"{r['method']:<24} {who:<22} {r.get('qos', ''):<10} {req:<36} {size(r.get('limit', 0)):<20}  "
              f"{_fmt_unified(r.get('unified_before', {}))} -> {_fmt_unified(r.get('unified_after', {}))}", file=out)


#: the file that marks a directory as the demo's own: only such a directory (or an empty one) is
#: emptied and reused by a later run
MARKER = ".memqos-shim-demo"


class NotTheDemosDir(Exception):
    """--out names something the demo did not create: refused, nothing removed."""


def prepare_out_dir(out_dir: Path) -> None:
    """Make ``out_dir`` an empty directory carrying the demo's marker file. An existing
    directory is reused only when it is empty or carries the marker (then its contents are
    removed); a non-empty directory without it, a symlink or a file is refused
    (NotTheDemosDir) and left as it is."""
    try:
        st = os.lstat(out_dir)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise NotTheDemosDir(f"--out {out_dir}: {e.strerror}") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise NotTheDemosDir(f"--out {out_dir} is a symbolic link; refusing to use it")
        if not stat.S_ISDIR(st.st_mode):
            raise NotTheDemosDir(f"--out {out_dir} exists and is not a directory; refusing to replace it")
        entries = os.listdir(out_dir)
        if entries and not _is_regular_file(out_dir / MARKER):
            raise NotTheDemosDir(
                f"--out {out_dir} is not empty and was not made by the demo (no {MARKER} in it); "
                "refusing to remove anything in it: name a new or empty directory")
        try:
            for name in entries:  # the demo's own directory, from an earlier run
                path = out_dir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        except OSError as e:
            raise NotTheDemosDir(f"--out {out_dir}: cannot empty it: {e}") from None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MARKER).write_text("made by memqos-shim demo: a later demo run may empty this directory\n")
    except OSError as e:
        raise NotTheDemosDir(f"--out {out_dir}: cannot create it: {e.strerror}") from None


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def run(out_dir: Path, keep_running: bool = False) -> int:
    prepare_out_dir(out_dir)
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
            [sys.executable, "-m", "shim.tools.demo_runtime", "--listen", str(runtime_sock)],
            stdout=open(out_dir / "runtime.log", "w"), stderr=subprocess.STDOUT, env=env)
        procs.append(runtime)
        _wait_for_socket(runtime_sock, runtime, "the demo runtime")
        shim = subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--listen", str(shim_sock), "--upstream", str(runtime_sock),
             "--kubelet-config", str(out_dir / "kubelet-config.yaml"), "--cgroup-root", str(cgroot),
             "--meminfo", str(out_dir / "meminfo"), "--page-size", "4096", "--audit-log", str(audit)],
            stdout=open(out_dir / "shim.log", "w"), stderr=subprocess.STDOUT, env=env)
        procs.append(shim)
        _wait_for_socket(shim_sock, shim, "memqos-shim")
        print(f"memqos-shim on {shim_sock} -> demo runtime on {runtime_sock}; node: 8Gi, "
              f"kubeReserved 100Mi, systemReserved 100Mi, factor 0.9, page 4096\n")
        drive(f"unix://{shim_sock}", cgroot)
        records = _read_audit(audit, expect=sum(len(p[4]) for p in PODS) + 1)
        print_audit_table(records)
        levels = _settled_levels(cgroot)
        if levels:
            print("\npod / QoS / node cgroups with memory.min set (the fake cgroup tree):")
            for p in levels:
                print(f"  /{p.parent.relative_to(cgroot)}  memory.min={_value(p.read_text().strip())}")
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


class _Runtime:
    """The calls the demo makes, as the kubelet makes them (unary CRI calls on one connection)."""

    def __init__(self, target: str) -> None:
        self.client = UnaryClient(target, max_message_bytes=16 * MI)

    def __getattr__(self, name: str):
        response_cls = getattr(pb, f"{name}Response")

        def call(request, timeout: float = 10):
            raw = self.client.call(RUNTIME_SERVICE + name, request.SerializeToString(), timeout)
            return response_cls.FromString(raw)

        return call


def drive(target: str, cgroot: Path) -> None:
    """RunPodSandbox, CreateContainer, StartContainer for every pod, one resize, one removal."""
    rt = _Runtime(target)
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
    rt.client.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help="directory for the demo's files (default: a new directory under $TMPDIR); a new or empty "
                        f"one, or one an earlier demo made (it holds a {MARKER} file), whose contents are then "
                        "removed; anything else is refused (exit 2) and left untouched")
    p.add_argument("--keep-running", action="store_true", help="leave the shim running after the demo")


def run_args(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="memqos-demo-"))
    try:
        return run(Path(os.path.abspath(out)), args.keep_running)
    except NotTheDemosDir as e:
        print(f"memqos-shim demo: {e}", file=sys.stderr)
        return 2


def register(sub) -> None:
    p = sub.add_parser("demo", help="the shim in front of a stand-in runtime, pods of every QoS class "
                                    "driven through it (no root, no containerd)",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run_args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shim.tools.demo", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
