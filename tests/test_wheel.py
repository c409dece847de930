"""The runtime wheel on its own: built from this tree, installed into a new virtual environment
(no system site packages, dependencies from the package index or pip's cache, without extras),
and run from a directory outside the checkout with nothing of the checkout on its path: the
commands an operator runs answer, ``nri`` starts, ``serve`` forwards a real call to a fake
runtime started from the checkout's environment, and neither grpcio nor the development
package is there or needed.

One wheel and one environment per test session (the ``installed`` fixture)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

from shim.cri import pb
from shim.cri.methods import RUNTIME_SERVICE
from shim.tools.kubelet_requests import create_container, sandbox_config
from shim.transport.unary_client import UnaryClient

REPO = Path(__file__).resolve().parents[1]
MI = 2**20


class Installed:
    def __init__(self, wheel: Path, env_dir: Path, home: Path) -> None:
        self.wheel = wheel
        self.env_dir = env_dir
        self.home = home  # cwd of every command: outside the checkout
        self.python = env_dir / "bin" / "python"
        self.cli = env_dir / "bin" / "memqos-shim"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env["PYTHONNOUSERSITE"] = "1"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.cli), *args], cwd=self.home, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def python_c(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), "-c", code], cwd=self.home, env=self.env, capture_output=True,
                              text=True, timeout=60)


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of what the wheel is built from (pyproject.toml, README.md, shim/):
    nothing else of the checkout can end up in it, and the checkout gets no build/ directory."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "shim", src / "shim", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # the checkout's setuptools when it has one (no index needed for the build), else pip's own
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--quiet",
                        "-w", str(out / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = (out / "dist").glob("memqos_shim-*.whl")
    return wheel


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    home = base / "home"
    home.mkdir()
    inst = Installed(wheel, env_dir, home)
    p = subprocess.run([str(inst.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        str(wheel)], cwd=home, env=inst.env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return inst


def test_the_wheel_holds_the_runtime_package_only(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"shim"}
    modules = {n for n in names if n.endswith(".py")}
    assert {"shim/app/cli.py", "shim/tools/demo.py", "shim/tools/demo_runtime.py", "shim/tools/grpc_server.py",
            "shim/tools/trace_runtime.py", "shim/cri/api_pb2.py"} <= modules
    left = [n for n in modules if n.startswith("shim/testing/")
            or any(word in n for word in ("bench", "soak", "h2_limits", "reset_storm", "start_latency",
                                          "nri_latency", "fake_runtime", "fake_nri_runtime", "traces.py"))]
    assert left == []
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in zipfile.ZipFile(installed.wheel).read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    grpc = [r for r in requires if "grpcio" in r]
    assert grpc and all('extra == "test"' in r for r in grpc)  # the tests' only


def test_neither_grpcio_nor_the_checkout_is_importable(installed):
    for module in ("grpc", "memqos_dev"):
        p = installed.python_c(f"import {module}")
        assert p.returncode != 0 and "ModuleNotFoundError" in p.stderr, (module, p.stderr)
    p = installed.python_c("import shim, sys; print(shim.__file__); print(sys.path)")
    assert p.returncode == 0 and str(installed.env_dir) in p.stdout.splitlines()[0]
    assert str(REPO) not in p.stdout


def test_help_lists_the_commands(installed):
    p = installed.run("--help")
    assert p.returncode == 0, p.stderr
    for command in ("serve", "nri", "explain", "doctor", "reset", "replay", "trace", "health", "demo"):
        assert command in p.stdout


def test_doctor_prints_its_checks(installed):
    p = installed.run("doctor", "--upstream", str(installed.home / "no-runtime.sock"),
                      "--listen", str(installed.home / "no-shim.sock"))
    out = p.stdout + p.stderr
    assert "Traceback" not in out
    assert "PASS" in out or "FAIL" in out or "WARN" in out
    assert "does not answer" in out or "no-runtime.sock" in out  # the runtime check ran (no grpcio needed)


def test_explain(installed):
    p = installed.run("explain", "--request", "256Mi", "--limit", "1Gi", "--allocatable", "8Gi", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["unified"]["memory.min"] == str(256 * MI)


def test_demo(installed):
    p = installed.run("demo", "--out", str(installed.home / "demo"), timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "{} -> {memory.low=256Mi (268435456), memory.min=230.4Mi (241590272)}" in p.stdout
    assert "Traceback" not in p.stderr


def test_replay_runs_a_recorded_trace(installed):
    trace = REPO / "tests" / "data" / "traces" / "recorder-smoke.jsonl"
    p = installed.run("replay", str(trace), "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr


def test_a_config_file_asking_for_the_grpc_transport_is_refused_clearly(installed):
    config = installed.home / "grpc.yaml"
    config.write_text("transport: grpc\n")
    p = installed.run("serve", "--config", str(config), "--listen", str(installed.home / "g.sock"),
                      "--upstream", str(installed.home / "rt.sock"))
    assert p.returncode == 2
    assert "the HTTP/2 relay is the only transport" in p.stderr and "Traceback" not in p.stderr


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{what} did not create {path}"
        time.sleep(0.05)


def test_serve_forwards_to_a_fake_runtime(installed, tmp_path):
    """The installed `serve` (the relay, no grpcio) between a client and the checkout's fake
    runtime: Version answered by the runtime, a CreateContainer rewritten and audited."""
    rt_sock, shim_sock, audit = tmp_path / "rt.sock", tmp_path / "shim.sock", tmp_path / "audit.jsonl"
    cgroot = tmp_path / "cgroup"
    (cgroot / "kubepods" / "burstable").mkdir(parents=True)
    (cgroot / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: {8 * 1024 * 1024} kB\n")
    (tmp_path / "kubelet.yaml").write_text("kind: KubeletConfiguration\ncgroupDriver: cgroupfs\n")
    runtime = subprocess.Popen([sys.executable, "-m", "memqos_dev.testing.fake_runtime", "--listen", str(rt_sock)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shim = subprocess.Popen([str(installed.cli), "serve", "--listen", str(shim_sock), "--upstream", str(rt_sock),
                             "--cgroup-root", str(cgroot), "--meminfo", str(tmp_path / "meminfo"),
                             "--kubelet-config", str(tmp_path / "kubelet.yaml"), "--page-size", "4096",
                             "--audit-log", str(audit), "--kubelet-version", "1.30.0"],
                            cwd=installed.home, env=installed.env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "shim.log", "w"))
    client = UnaryClient(f"unix://{shim_sock}")
    try:
        _wait_for(rt_sock, runtime, "the fake runtime")
        _wait_for(shim_sock, shim, "the installed memqos-shim serve")
        version = pb.VersionResponse.FromString(client.call(
            RUNTIME_SERVICE + "Version", pb.VersionRequest(version="v1").SerializeToString(), 10))
        assert version.runtime_name == "fake-runtime"  # the fake runtime answered, through the shim
        uid = "1f0c2a9e-0000-4000-8000-0000000000aa"
        sb = sandbox_config("web", uid, "burstable")
        sid = pb.RunPodSandboxResponse.FromString(client.call(
            RUNTIME_SERVICE + "RunPodSandbox", pb.RunPodSandboxRequest(config=sb).SerializeToString(), 10)
        ).pod_sandbox_id
        req = create_container(sid, sb, "app", "burstable", request=128 * MI, limit=512 * MI, capacity=8 << 30)
        cid = pb.CreateContainerResponse.FromString(client.call(
            RUNTIME_SERVICE + "CreateContainer", req.SerializeToString(), 10)).container_id
        assert cid
        deadline = time.monotonic() + 30
        records = []
        while not records and time.monotonic() < deadline:  # the audit writer is asynchronous
            if audit.exists():
                records = [json.loads(line) for line in audit.read_text().splitlines()
                           if line.strip() and '"CreateContainer"' in line]
            time.sleep(0.05)
        assert records and records[0]["container_id"] == cid
        assert records[0]["unified_before"] == {}  # the kubelet sent no memory.min: the shim's rewrite
        assert records[0]["unified_after"]["memory.min"] == str(records[0]["request"]) and records[0]["request"] > 0
    finally:
        client.close()
        for p in (shim, runtime):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert "Traceback" not in (tmp_path / "shim.log").read_text()


def test_nri_starts_and_waits_for_its_runtime(installed, tmp_path):
    """`memqos-shim nri` with no runtime socket yet: it imports what it needs, says it is
    waiting for the socket, and stops on SIGTERM."""
    (tmp_path / "cgroup").mkdir()
    log = tmp_path / "nri.log"
    with open(log, "w") as out:
        p = subprocess.Popen([str(installed.cli), "nri", "--nri-socket", str(tmp_path / "nri.sock"),
                              "--cgroup-root", str(tmp_path / "cgroup"), "--audit-log", str(tmp_path / "audit.jsonl")],
                             cwd=installed.home, env=installed.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "nri.sock" not in log.read_text():
                assert p.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        finally:
            p.terminate()
            p.wait(15)
    assert "Traceback" not in log.read_text()


# each bad socket setting: the arguments after `serve` (or the config file's text), and what the
# one line on stderr names. {home}: the installed package's working directory.
BAD_SOCKET_SETTINGS = [
    (["--upstream", "tcp://1.2.3.4:5"], None, "--upstream"),
    (["--upstream", "http://x"], None, "--upstream"),
    (["--upstream", ""], None, "--upstream"),
    (["--upstream", "unix://"], None, "--upstream"),
    (["--listen", "relative.sock"], None, "--listen"),
    (["--listen", "tcp://127.0.0.1:5"], None, "--listen"),
    (["--listen", "{home}/rt.sock", "--upstream", "unix://{home}/rt.sock"], None, "--listen"),
    (["--listen", "{home}/regular-file"], None, "--listen"),
    (["--listen", "/proc/memqos-shim-test.sock"], None, "--listen"),
    (["--listen", "/proc/self/nope/x.sock"], None, "--listen"),
    (["--socket-group", "nosuchgroup-memqos"], None, "--socket-group"),
    ([], 'socket-mode: "0660"\n', "c.yaml:1: socket-mode: "),
    ([], "mode: enforce\nupstream: tcp://1.2.3.4:5\n", "c.yaml:2: upstream: "),
]


@pytest.mark.parametrize("args,config,names", BAD_SOCKET_SETTINGS,
                         ids=[" ".join(a) or c.strip() for a, c, _ in BAD_SOCKET_SETTINGS])
def test_a_bad_socket_setting_exits_2_with_one_line_naming_it(installed, tmp_path, args, config, names):
    """The installed `serve` with a bad listen / upstream / socket-group / socket-mode: exit 2,
    one line on stderr naming the setting as given, no traceback, and nothing created."""
    home = installed.home
    (home / "regular-file").write_text("not a socket\n")
    argv = [a.format(home=home) for a in args]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "c.yaml")]
    if "--listen" not in argv:
        argv += ["--listen", str(tmp_path / "shim.sock")]
    before = sorted(p.name for p in home.iterdir())
    p = installed.run("serve", *argv, "--audit-log", str(tmp_path / "audit.jsonl"), "--kubelet-config", "none",
                      timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("memqos-shim: ") and names in lines[0], lines[0]
    assert (home / "regular-file").read_text() == "not a socket\n"
    assert sorted(p.name for p in home.iterdir()) == before
    assert not (tmp_path / "audit.jsonl").exists() and not (tmp_path / "shim.sock").exists()


def test_demo_out_where_nothing_can_be_made_exits_2_with_one_line(installed):
    p = installed.run("demo", "--out", "/proc/nope")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out /proc/nope" in lines[0] and "Traceback" not in p.stderr


def test_the_wheel_has_no_grpc_stubs(installed):
    """Nothing in the wheel imports grpcio, which it does not require: the CRI's grpc service
    stubs stay beside it (memqos_dev/testing/cri_grpc.py, for the tests' grpcio clients)."""
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert [n for n in names if n.endswith("_grpc.py")] == []
    p = installed.python_c("import pkgutil, shim.cri; print(sorted(m.name for m in pkgutil.iter_modules(shim.cri.__path__)))")
    assert p.returncode == 0 and "api_pb2_grpc" not in p.stdout, p.stdout + p.stderr
