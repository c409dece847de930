"""`memqos-shim doctor`: each check's verdict on fake nodes (cgroup tree, /proc, kubelet files),
the real upstream check against the fake runtime, and that no check can crash the command."""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tempfile
from pathlib import Path

import pytest

from shim.app.config import OPTIONS, resolve
from shim.tools.doctor import FAIL, PASS, WARN, Doctor, Env, cmd_doctor, kernel_version

UID = "11111111-2222-3333-4444-555555555555"


def cfg(**over):
    ns = argparse.Namespace(config=None, **{o.name.replace("-", "_"): None for o in OPTIONS})
    for k, v in over.items():
        setattr(ns, k, v)
    return resolve(ns)


def v2_tree(root: Path, *, driver="cgroupfs", missing: tuple[str, ...] = ()) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    if driver == "cgroupfs":
        dirs = ["", "kubepods", "kubepods/burstable", "kubepods/besteffort"]
    else:
        dirs = ["", "kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
                "kubepods.slice/kubepods-besteffort.slice"]
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
        ctl = "cpu pids" if d in missing else "cpu memory pids"
        (root / d / "cgroup.subtree_control").write_text(ctl + "\n")


def fake_proc(base: Path, *, psi=True, kubelet_args: list[str] | None = None, mounts: str = "") -> Path:
    proc = Path(tempfile.mkdtemp(prefix="proc-", dir=base))
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(mounts)
    if psi:
        (proc / "pressure").mkdir()
        (proc / "pressure" / "memory").write_text(
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    if kubelet_args is not None:
        (proc / "4242").mkdir()
        (proc / "4242" / "comm").write_text("kubelet\n")
        (proc / "4242" / "cmdline").write_text("\x00".join(["/usr/bin/kubelet", *kubelet_args]) + "\x00")
    (proc / "1").mkdir()
    (proc / "1" / "comm").write_text("systemd\n")
    (proc / "1" / "cmdline").write_text("/sbin/init\x00")
    return proc


def env(proc: Path, release="6.1.0-18-amd64", **kw) -> Env:
    kw.setdefault("nri_socket", str(proc / "no-nri.sock"))  # the host's NRI and /etc stay out of it
    kw.setdefault("etc_root", str(proc))
    return Env(proc=str(proc), kernel_release=lambda: release, kubelet_env_files=(), kubelet_unit_dirs=(),
               rpc_timeout=2.0, **kw)


def by_name(results) -> dict:
    return {r.name: r for r in results}


@pytest.fixture
def node(tmp_path):
    """A healthy-looking cgroup v2 node (no runtime, no shim running)."""
    root = tmp_path / "cg"
    v2_tree(root)
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\nkubeReserved: {memory: 100Mi}\n")
    return tmp_path


def doctor_for(node: Path, proc: Path, **over) -> dict:
    settings = dict(cgroup_root=str(node / "cg"), meminfo=str(node / "meminfo"),
                    kubelet_config=str(node / "kubelet.yaml"), listen=f"unix://{node}/shim/shim.sock",
                    upstream=f"unix://{node}/none.sock") | over
    return by_name(Doctor(cfg(**settings), env(proc)).run())


def test_kernel_version_parse():
    assert kernel_version("6.18.44-fc-v669") == (6, 18)
    assert kernel_version("5.4.0-150-generic") == (5, 4)
    assert kernel_version("weird") is None


@pytest.mark.parametrize("release,verdict", [("6.1.0-18-amd64", PASS), ("5.9.0", PASS), ("5.8.18", WARN),
                                             ("4.19.0", WARN), ("4.4.0", FAIL), ("garbage", WARN)])
def test_kernel(node, release, verdict):
    c = cfg(cgroup_root=str(node / "cg"))
    r = Doctor(c, env(fake_proc(node), release)).check_kernel()
    assert r.verdict == verdict


def test_healthy_v2_node(node):
    r = doctor_for(node, fake_proc(node))
    assert r["cgroup v2"].verdict == PASS
    assert r["memory controller"].verdict == PASS
    assert "kubepods/burstable" in r["memory controller"].summary
    assert r["PSI"].verdict == PASS
    assert r["kubelet config"].verdict == PASS and "cgroupDriver cgroupfs" in r["kubelet config"].summary
    assert r["cgroup driver"].verdict == PASS
    assert r["MemoryQoS gate"].verdict == PASS
    assert r["reservations"].verdict == PASS and "allocatable 16284Mi of 16Gi" in r["reservations"].summary
    assert r["kubelet endpoint"].verdict == WARN  # no kubelet to ask
    assert r["upstream"].verdict == FAIL and "no socket" in r["upstream"].summary
    assert r["shim socket"].verdict == WARN and "not running" in r["shim socket"].summary
    assert r["audit log"].verdict == PASS
    assert r["memory.high guard"].verdict == PASS


def test_cgroup_v1_host(node):
    mounts = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
              "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
              "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
              f"41 31 0:38 / {node}/unified rw,relatime - cgroup2 cgroup2 rw\n")
    (node / "unified").mkdir()
    (node / "unified" / "cgroup.controllers").write_text("hugetlb\n")
    v1 = node / "v1"
    v1.mkdir()
    c = cfg(cgroup_root=str(v1))
    d = Doctor(c, env(fake_proc(node, mounts=mounts)))
    r = d.check_cgroup_v2()
    assert r.verdict == FAIL
    m = d.check_memory_controller()
    assert m.verdict == FAIL
    assert any("hugetlb" in x and "no memory controller" in x for x in r.details)


def test_cgroup_v1_mount_details_for_the_real_root(node):
    mounts = ("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
              "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n")
    c = cfg(cgroup_root=str(node / "nonexistent-root"))
    d = Doctor(c, env(fake_proc(node, mounts=mounts)))
    d.cfg = dataclasses.replace(d.cfg, cgroup_root="/sys/fs/cgroup")
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("this host is cgroup v2")
    r = d.check_cgroup_v2()
    assert r.verdict == FAIL and any("cpu, memory" in x for x in r.details)
    assert "/sys/fs/cgroup/memory" in d.check_memory_controller().summary


def test_memory_missing_from_subtree_control(node):
    v2_tree(node / "cg", missing=("kubepods/burstable",))
    r = doctor_for(node, fake_proc(node))["memory controller"]
    assert r.verdict == FAIL and "kubepods/burstable" in r.summary


def test_no_kubepods_yet(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "cgroup.subtree_control").write_text("memory\n")
    r = Doctor(cfg(cgroup_root=str(root), kubelet_config="none"), env(fake_proc(tmp_path))).check_memory_controller()
    assert r.verdict == WARN and "does not exist yet" in r.summary


def test_no_psi(node):
    assert doctor_for(node, fake_proc(node, psi=False))["PSI"].verdict == WARN


def test_kubelet_gate_on_and_driver_mismatch(node):
    (node / "kubelet.yaml").write_text("cgroupDriver: systemd\nfeatureGates: {MemoryQoS: true}\n"
                                       "memoryThrottlingFactor: 0.8\n")
    r = doctor_for(node, fake_proc(node), factor="0.9", node_allocatable="1Gi")
    assert r["MemoryQoS gate"].verdict == WARN
    assert r["cgroup driver"].verdict == FAIL and "laid out by cgroupfs" in r["cgroup driver"].summary
    assert r["reservations"].verdict == WARN
    assert any("--factor 0.9 differs" in x for x in r["reservations"].details)
    assert any("--node-allocatable 1Gi differs" in x for x in r["reservations"].details)


def test_kubelet_config_missing(node):
    r = doctor_for(node, fake_proc(node), kubelet_config=str(node / "nope.yaml"))
    assert r["kubelet config"].verdict == WARN and "not found" in r["kubelet config"].summary


@pytest.mark.parametrize("args,verdict,needle", [
    (["--container-runtime-endpoint=unix://{listen}"], PASS, "the shim's socket"),
    (["--container-runtime-endpoint", "{listen}"], PASS, "the shim's socket"),
    (["--container-runtime-endpoint=unix://{upstream}"], FAIL, "runtime's own socket"),
    (["--container-runtime-endpoint=unix:///run/other.sock"], FAIL, "neither"),
    (["--config", "{kcfg}"], PASS, "containerRuntimeEndpoint"),
    (["--v=2"], FAIL, "no --container-runtime-endpoint"),
])
def test_kubelet_endpoint_from_the_running_kubelet(node, args, verdict, needle):
    listen, upstream = f"{node}/shim/shim.sock", f"{node}/none.sock"
    (node / "kcfg.yaml").write_text(f"containerRuntimeEndpoint: unix://{listen}\n")
    args = [a.format(listen=listen, upstream=upstream, kcfg=node / "kcfg.yaml") for a in args]
    r = doctor_for(node, fake_proc(node, kubelet_args=args))["kubelet endpoint"]
    assert r.verdict == verdict and needle in r.summary + " ".join(r.details)


def test_kubelet_endpoint_from_env_file(node):
    listen = f"{node}/shim/shim.sock"
    f = node / "kubeadm-flags.env"
    f.write_text(f'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix://{listen} --pod-infra-container-image=x"\n')
    c = cfg(cgroup_root=str(node / "cg"), listen=f"unix://{listen}", kubelet_config="none")
    e = env(fake_proc(node))
    e.kubelet_env_files = (str(f),)
    r = Doctor(c, e).check_kubelet_endpoint()
    assert r.verdict == PASS and str(f) in r.summary


def test_upstream_and_shim_socket_against_the_fake_runtime():
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer

    base = Path(tempfile.mkdtemp(prefix="mqd-"))
    with FakeRuntimeServer(base / "rt.sock") as rt:
        # a "shim" socket that is really the runtime's, world-accessible: permission failure
        bad = base / "shim.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(bad))
        os.chmod(bad, 0o666)
        try:
            c = cfg(upstream=rt.address, listen=f"unix://{bad}", kubelet_config="none")
            d = Doctor(c, env(fake_proc(base)))
            up = d.check_upstream()
            assert up.verdict == PASS and "fake-runtime 0.1.0 (CRI v1)" in up.summary
            sock = d.check_socket()
            assert sock.verdict == FAIL and any("every user" in x for x in sock.details)
            # the runtime's own socket as the "listen" socket: mode ok, answers Version
            os.chmod(base / "rt.sock", 0o600)
            c2 = cfg(upstream=rt.address, listen=rt.address, kubelet_config="none")
            ok = Doctor(c2, env(fake_proc(base))).check_socket()
            if os.geteuid() == 0:
                assert ok.verdict == PASS, ok
            assert "answers Version through the shim: fake-runtime" in ok.summary
        finally:
            s.close()


@pytest.mark.parametrize("target,verdict", [("-", PASS), ("none", WARN), ("{dir}", FAIL),
                                            ("{dir}/audit.jsonl", PASS), ("{dir}/missing/audit.jsonl", WARN)])
def test_audit_log(tmp_path, target, verdict):
    c = cfg(audit_log=target.format(dir=tmp_path))
    assert Doctor(c, env(fake_proc(tmp_path))).check_audit_log().verdict == verdict


def test_guard_and_metrics_lines(tmp_path):
    e = env(fake_proc(tmp_path))
    assert Doctor(cfg(monitor_interval="0"), e).check_guard().verdict == WARN
    assert Doctor(cfg(guard_action="none"), e).check_guard().verdict == WARN
    assert Doctor(cfg(metrics_address="0.0.0.0:9808"), e).check_metrics().verdict == WARN
    assert Doctor(cfg(metrics_address="9808"), e).check_metrics().verdict == PASS


def test_a_crashing_check_is_a_fail_line_not_a_traceback(node, capsys, monkeypatch):
    def boom(self):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(Doctor, "check_psi", boom)
    monkeypatch.setattr("shim.tools.doctor.DEFAULT_CONFIG", str(node / "no-such-config.yaml"))
    args = argparse.Namespace(config=None, **{o.name.replace("-", "_"): None for o in OPTIONS})
    args.cgroup_root = str(node / "cg")
    rc = cmd_doctor(args, env(fake_proc(node)))
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  psi" in out and "kaboom" in out
    assert "PASS  cgroup v2" in out and out.strip().splitlines()[-1].endswith("fail")


def test_bad_config_file_is_a_fail_line(node, capsys):
    bad = node / "bad.yaml"
    bad.write_text("no-such-key: 1\n")
    args = argparse.Namespace(config=str(bad), **{o.name.replace("-", "_"): None for o in OPTIONS})
    rc = cmd_doctor(args, env(fake_proc(node)))
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  config" in out and "no-such-key" in out and "kernel" in out


def test_exit_code_zero_without_fail(node, capsys, monkeypatch):
    monkeypatch.setattr(Doctor, "check_upstream", lambda self: __import__("shim.tools.doctor").tools.doctor.Result("upstream", PASS, "ok"))
    monkeypatch.setattr("shim.tools.doctor.DEFAULT_CONFIG", str(node / "no-such-config.yaml"))
    args = argparse.Namespace(config=None, **{o.name.replace("-", "_"): None for o in OPTIONS})
    args.cgroup_root = str(node / "cg")
    args.kubelet_config = str(node / "kubelet.yaml")
    args.meminfo = str(node / "meminfo")
    args.listen = f"unix://{node}/shim/shim.sock"
    rc = cmd_doctor(args, env(fake_proc(node)))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 fail" in out


def test_cli_registers_doctor():
    from shim.cli.main import build_parser

    args = build_parser().parse_args(["doctor", "--cgroup-root", "/x"])
    assert args.func is cmd_doctor


def test_guard_episodes_are_listed_and_a_forged_file_warns(node):
    """doctor shows where the guard keeps its open episodes and which are open; a file the shim
    would not trust (writable by others) is a WARN saying why."""
    import json as _json

    shim_dir = node / "shim"
    shim_dir.mkdir()
    path = shim_dir / "guard-episodes.json"
    r = doctor_for(node, fake_proc(node))["memory.high guard"]
    assert r.verdict == PASS and r.details == [f"episodes kept in {path}: 0 open"]
    ref = {"id": "ab" * 32, "namespace": "default", "pod": "web-1", "container": "app", "uid": UID,
           "cgroup_parent": f"/kubepods/burstable/pod{UID}", "qos": "Burstable"}
    path.write_text(_json.dumps({"version": 1, "episodes": [{"ref": ref, "mode": "relaxed", "restore_high": 37748736}]}))
    os.chmod(path, 0o600)
    r = doctor_for(node, fake_proc(node))["memory.high guard"]
    assert r.verdict == PASS
    assert r.details == [f"episodes kept in {path}: 1 open",
                         f"  relaxed: default/web-1/app ({'ab' * 6}), restore 37748736"]
    os.chmod(path, 0o666)
    r = doctor_for(node, fake_proc(node))["memory.high guard"]
    assert r.verdict == WARN and "writable by others" in r.details[0]
    r = doctor_for(node, fake_proc(node), guard_state="none")["memory.high guard"]
    assert r.verdict == PASS and "memory only" in r.details[0]


def test_reclaim_check_reports_availability_and_the_setting(node):
    """memory.reclaim exists in non-root cgroups on 5.19+: doctor says whether it does and
    whether --reclaim is on; never a FAIL (reclaim is optional)."""
    root = node / "cg"
    e = env(fake_proc(node), "6.1.0-56-amd64")
    base = dict(cgroup_root=str(root), kubelet_config="none")
    r = Doctor(cfg(**base), e).check_reclaim()
    assert r.verdict == PASS and "off" in r.summary and "not available" in r.summary
    (root / "kubepods").mkdir(exist_ok=True)
    (root / "kubepods" / "memory.reclaim").write_text("")
    r = Doctor(cfg(**base), e).check_reclaim()
    assert r.verdict == PASS and "off" in r.summary and "memory.reclaim available" in r.summary
    r = Doctor(cfg(reclaim="true", **base), e).check_reclaim()
    assert r.verdict == PASS and r.summary.startswith("on:")
    assert Doctor(cfg(reclaim="true", monitor_interval="0", **base), e).check_reclaim().verdict == WARN
    (root / "kubepods" / "memory.reclaim").unlink()
    r = Doctor(cfg(reclaim="true", **base), env(fake_proc(node), "5.10.0-1-amd64")).check_reclaim()
    assert r.verdict == WARN and "older than 5.19" in r.summary


# -- nri -------------------------------------------------------------------------------------
def nri_result(tmp_path, sock: Path, files: dict[str, str] | None = None):
    for rel_path, text in (files or {}).items():
        p = tmp_path / "etc-root" / rel_path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "etc-root").mkdir(exist_ok=True)
    e = Env(nri_socket=str(sock), etc_root=str(tmp_path / "etc-root"), rpc_timeout=2.0)
    return Doctor(cfg(), e).check_nri()


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="nri-", dir="/tmp"))  # AF_UNIX paths are short


def test_nri_listening_socket_is_reachable_and_the_doctor_only_connects(tmp_path):
    d = short_dir()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(d / "nri.sock"))
    srv.listen(1)
    srv.settimeout(5)
    try:
        r = nri_result(tmp_path, d / "nri.sock")
        conn, _ = srv.accept()  # the doctor's connection reached the listener ...
        conn.settimeout(5)
        assert conn.recv(64) == b""  # ... sent nothing (no RegisterPlugin) and closed
        conn.close()
    finally:
        srv.close()
    assert r.verdict == PASS and "accepts connections" in r.summary


def test_nri_socket_missing_is_not_enabled_with_the_runtime_config(tmp_path):
    d = short_dir()
    r = nri_result(tmp_path, d / "nri.sock", {
        "etc/containerd/config.toml": 'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n'})
    assert r.verdict == WARN and "not enabled" in r.summary
    assert any("disable = true" in x for x in r.details) and any("restart the runtime" in x for x in r.details)
    r = nri_result(tmp_path, d / "nri.sock", {"etc/containerd/config.toml": "version = 3\n"})
    assert r.verdict == WARN and "restart the runtime" in r.summary
    r = nri_result(tmp_path / "c", d / "nri.sock", {"etc/crio/crio.conf.d/10.conf": "[crio.nri]\nenable_nri = false\n"})
    assert r.verdict == WARN and any("enable_nri = false" in x for x in r.details)


def test_nri_regular_file_fails_and_a_dead_socket_fails(tmp_path):
    d = short_dir()
    (d / "nri.sock").write_text("")
    r = nri_result(tmp_path, d / "nri.sock")
    assert r.verdict == FAIL and "not a socket" in r.summary
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(d / "dead.sock"))
    dead.close()  # bound, never listening: the file a stopped runtime leaves behind
    r = nri_result(tmp_path, d / "dead.sock")
    assert r.verdict == FAIL and "nobody accepts" in r.summary


def test_doctor_prints_an_nri_line(node):
    proc = fake_proc(node)
    results = by_name(Doctor(cfg(cgroup_root=str(node / "cg"), kubelet_config=str(node / "kubelet.yaml")),
                             dataclasses.replace(env(proc), nri_socket=str(short_dir() / "none.sock"),
                                                 etc_root=str(node))).run())
    assert results["nri"].verdict == WARN
