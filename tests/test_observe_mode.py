"""mode: observe. The shim decides, audits and counts as enforce would, forwards every call as
the kubelet sent it and writes no cgroup file; SIGHUP applies the config file's mode without a
restart. Through `memqos-shim serve` in a subprocess (the relay) in front of the fake runtime,
with a cgroup tree of real files; a recorded trace replayed in both modes; the NRI handler; the
writers of shim/effects one by one."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from shim.container.nri_handler import NriMemoryQoS
from shim.cri import pb
from shim.decision import NodeFacts, Policy
from shim.effects import CgroupFS, ContainerCgroups
from shim.effects.rollout import Rollout
from shim.effects.systemd import CgroupWriter
from shim.nri import api_pb2 as nri
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.tools.kubelet_requests import create_container, oom_score_adj, update_resources
from tests.reconciler_support import FakeCgroupTree
from tests.test_nri_front import TABLE, nri_container, nri_pod
from tests.test_serve import CAPACITY, MI, Shim, complete_lines, run_pod, short_dir

UID = "0b5e7a11-0000-4000-8000-0000000000a1"
UID2 = "0b5e7a11-0000-4000-8000-0000000000a2"
UID3 = "0b5e7a11-0000-4000-8000-0000000000a3"
REQUESTS = json.dumps({"app": "64Mi"})
VOLATILE = {"rollout", "time", "handler_us"}  # handler_us: the NRI handler's own time, per call


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root: its bytes and its mtime (ns)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def audit(shim: Shim) -> list[dict]:
    return [json.loads(line) for line in complete_lines(shim.audit)]


def wait_for(shim: Shim, pred, what: str, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in audit(shim) if pred(r)]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no audit record {what}: {(shim.base / 'shim.log').read_text()[-3000:]}")


def pod_write(tree: FakeCgroupTree, uid: str):
    pod_dir = str(tree.root / tree.pod("burstable", uid))
    return lambda r: r.get("event") == "cgroup-write" and r.get("path") == pod_dir and r.get("file") == "memory.min"


def serving(shim: Shim) -> None:
    """Wait until the shim answers (its socket file exists a moment before it listens)."""
    shim.rt.Version(pb.VersionRequest(), timeout=30, wait_for_ready=True)


def create(shim: Shim, runtime, uid: str, name: str):
    """A Burstable pod (64Mi request, 256Mi limit) and its container, through the shim: (what
    the kubelet sent, what the runtime received, the container id)."""
    sid, sb = run_pod(shim, name, uid, "burstable", annotations={"memqos.io/requests": REQUESTS})
    req = create_container(sid, sb, "app", "burstable", request=64 * MI, limit=256 * MI, capacity=CAPACITY)
    sent = req.SerializeToString()
    cid = shim.rt.CreateContainer(req, timeout=10).container_id
    return sent, runtime.container(cid).create_request_bytes, cid


# -- (a) serve in observe: no byte changed on the wire, no cgroup file written -----------------------

@pytest.mark.parametrize("mode", ["observe", "enforce"])
def test_observe_changes_no_byte_on_the_wire_and_writes_no_cgroup_file(mode):
    base = short_dir()
    tree = FakeCgroupTree(base / "cgroup")
    tree.make_pod("burstable", UID)
    with FakeRuntimeServer(base / "runtime.sock") as server:
        shim = Shim(base, server.address, extra=("--mode", mode, "--resync-interval", "3600"))
        try:
            serving(shim)
            before = files_of(tree.root)
            sent, received, cid = create(shim, server.runtime, UID, "obs")
            update = update_resources(cid, limit=512 * MI, oom_score_adj=oom_score_adj("burstable", 64 * MI, CAPACITY))
            shim.rt.UpdateContainerResources(update, timeout=10)
            updated = server.runtime.container(cid).update_requests[-1]
            # the reconciler decided the pod's memory.min (written in enforce, only audited in observe)
            [write] = wait_for(shim, pod_write(tree, UID), "for the pod's memory.min")
            record = shim.record_for(cid)
            after = files_of(tree.root)
        finally:
            shim.stop()
    assert record["event"] == "rewrite" and record["unified_after"]["memory.min"] == str(64 * MI)
    assert write["new"] == str(64 * MI)
    if mode == "observe":
        assert received == sent  # byte for byte what the kubelet sent
        assert updated == update.SerializeToString()
        assert record["rollout"] == "observe" and write["rollout"] == "observe"
        assert after == before  # not one file of the tree changed
    else:
        assert received != sent and updated != update.SerializeToString()
        assert "rollout" not in record and "rollout" not in write
        assert after != before and tree.get(tree.pod("burstable", UID)) == 64 * MI


# -- (c) SIGHUP: observe -> enforce without a restart --------------------------------------------------

def test_sighup_switches_observe_to_enforce_and_a_bad_file_keeps_the_mode():
    base = short_dir()
    tree = FakeCgroupTree(base / "cgroup")
    for uid in (UID, UID2, UID3):
        tree.make_pod("burstable", uid)
    config = base / "shim.yaml"
    config.write_text("mode: observe\n")
    with FakeRuntimeServer(base / "runtime.sock") as server:
        shim = Shim(base, server.address, extra=("--config", str(config), "--resync-interval", "3600",
                                                 "--metrics-address", "127.0.0.1:0"))
        try:
            serving(shim)
            sent, received, _ = create(shim, server.runtime, UID, "first")
            assert received == sent
            wait_for(shim, pod_write(tree, UID), "for the first pod (observe)")
            assert tree.get(tree.pod("burstable", UID)) == 0

            config.write_text("mode: enforce\npolicy: Soft\n")
            shim.proc.send_signal(signal.SIGHUP)
            [switch] = wait_for(shim, lambda r: r.get("event") == "mode", "of the switch")
            sent, received, cid = create(shim, server.runtime, UID2, "second")
            assert received != sent  # rewritten: enforce from the next call on
            assert shim.record_for(cid).get("rollout") is None
            # the reconciler enforces what observe only audited
            deadline = time.monotonic() + 20
            while tree.get(tree.pod("burstable", UID)) != 64 * MI and time.monotonic() < deadline:
                time.sleep(0.05)
            assert tree.get(tree.pod("burstable", UID)) == 64 * MI

            config.write_text("mode: observ\n")
            shim.proc.send_signal(signal.SIGHUP)
            [error] = wait_for(shim, lambda r: r.get("event") == "config-reload-error", "of the bad reload")
            sent, received, _ = create(shim, server.runtime, UID3, "third")
            assert received != sent  # still enforcing
            assert shim.proc.poll() is None
            records = audit(shim)
        finally:
            shim.stop()
    log = (base / "shim.log").read_text()
    assert (switch["from"], switch["to"]) == ("observe", "enforce") and "SIGHUP" in switch["why"]
    [reload] = [r for r in records if r.get("event") == "config-reload"]
    assert reload["needs_restart"] == ["policy"] and "policy changed" in log and "needs a restart" in log
    assert error["mode_kept"] == "enforce" and "observ" in error["error"]
    assert "cannot reload the configuration, mode stays enforce" in log
    assert [r["rollout"] for r in records if r.get("event") == "start"] == ["observe"]


# -- (b) a recorded trace through both modes ---------------------------------------------------------

@pytest.fixture(scope="module")
def both_modes():
    from shim.evidence.recorder import MethodFilter
    from shim.evidence.trace import read_trace
    from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, trace_file
    from shim.tools.replay import replay, replay_settings

    out = {}
    keep = MethodFilter(None)  # the lifecycle calls (the records depend only on them)
    for stem in (MEMQOS_ON, MEMQOS_OFF):
        trace = read_trace(str(trace_file(stem)))
        trace.calls[:] = [c for c in trace.calls if keep(c.method)]
        settings = replay_settings(trace.header)
        out[stem] = (trace, {mode: replay(trace, settings, mode=mode) for mode in ("enforce", "observe")})
    return out


def decisions(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


@pytest.mark.parametrize("stem", ["on", "off"])
def test_a_replayed_trace_is_decided_alike_and_forwarded_unchanged_in_observe(both_modes, stem):
    from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON

    trace, results = both_modes[MEMQOS_ON if stem == "on" else MEMQOS_OFF]
    enforce, observe = results["enforce"], results["observe"]
    assert enforce.problems == [] and observe.problems == []
    assert enforce.records and decisions(observe.records) == decisions(enforce.records)
    assert all(r["rollout"] == "observe" for r in observe.records)
    assert not any("rollout" in r for r in enforce.records)
    rewritten = {r["seq"] for r in enforce.records if r["event"] == "rewrite"}
    assert rewritten  # enforce changed the unified map of these calls ...
    requests = {c.seq: c.request for c in trace.calls}
    assert all(enforce.forwarded[seq] != requests[seq] for seq in rewritten)
    assert observe.forwarded == {}  # ... and observe sent every request as recorded


def test_replay_cli_takes_the_mode(tmp_path, capsys):
    from shim.cli.main import main
    from shim.evidence.recorder import MethodFilter
    from shim.evidence.trace import read_trace, write_trace
    from memqos_dev.testing.traces import MEMQOS_ON, trace_file

    trace = read_trace(str(trace_file(MEMQOS_ON)))
    keep = MethodFilter(None)
    path = tmp_path / f"{MEMQOS_ON}.jsonl"
    write_trace(str(path), trace.header.raw, [c for c in trace.calls if keep(c.method)])
    assert main(["replay", str(path), "--json", "--mode", "observe"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records and all(r["rollout"] == "observe" for r in records)


# -- (d) the NRI handler in observe --------------------------------------------------------------------

NODE = NodeFacts(capacity=CAPACITY, allocatable=CAPACITY - 200 * MI, page_size=4096, factor=0.9)


@pytest.mark.parametrize("qos, req, limit, annotations, unified, policy, owns", TABLE)
def test_nri_observe_answers_empty_and_audits_the_decision(qos, req, limit, annotations, unified, policy, owns):
    answers, records = {}, {}
    for mode in ("enforce", "observe"):
        events: list = []
        records[mode] = []
        handler = NriMemoryQoS(NODE, policy, records[mode].append, ownership=owns, rollout=Rollout(mode),
                               enqueue=events.append)
        pod = nri_pod("p", "u1", qos, annotations)
        created = handler.create_container(pod, nri_container("c1", pod, "app", qos, request=req, limit=limit,
                                                              unified=unified))
        resources = nri.LinuxResources()
        resources.memory.limit.value = 2 * limit or 1024 * MI
        resources.unified.update(unified)
        updated = handler.update_container(pod, nri_container("c1", pod, "app", qos, request=req, limit=limit),
                                           resources)
        synced = handler.synchronize([pod], [nri_container("c2", pod, "side", qos, request=req, limit=limit,
                                                           unified=unified)])
        answers[mode] = (created, list(updated), list(synced), [type(e).__name__ for e in events])
    created, updated, synced, events = answers["observe"]
    assert created is None and updated == [] and synced == []
    assert events == answers["enforce"][3]  # the node state hears what enforce would tell it
    assert answers["enforce"][0] is not None  # (enforce at least annotates every container)
    assert decisions(records["observe"]) == decisions(records["enforce"])
    assert all(r["rollout"] == "observe" for r in records["observe"]) and records["observe"]
    assert [r["event"] for r in records["observe"]][:2] in (["rewrite", "rewrite"], ["rewrite", "unchanged"],
                                                            ["unchanged", "rewrite"], ["unchanged", "unchanged"])


# -- the writers of shim/effects -----------------------------------------------------------------------

def test_cgroupfs_in_observe_audits_the_write_once_and_writes_nothing(tmp_path):
    tree = FakeCgroupTree(tmp_path)
    rollout, records = Rollout("observe"), []
    fs = CgroupFS(str(tmp_path), [tree.kubepods], emit=records.append, rollout=rollout)
    before = files_of(tmp_path)
    w = fs.write(tree.burstable, "memory.min", 64 * MI, "sum of the Burstable pods", level=1)
    assert (w.old, w.new) == ("0", str(64 * MI)) and files_of(tmp_path) == before
    [r] = records
    assert (r["event"], r["rollout"], r["new"]) == ("cgroup-write", "observe", str(64 * MI))
    # the same would-write (every resync) is audited once
    assert fs.write(tree.burstable, "memory.min", 64 * MI, "sum of the Burstable pods", level=1) is None
    assert len(records) == 1
    rollout.set("enforce")
    fs.write(tree.burstable, "memory.min", 64 * MI, "sum of the Burstable pods", level=1)
    assert tree.get(tree.burstable) == 64 * MI and "rollout" not in records[-1]


def test_container_files_and_reclaim_in_observe(tmp_path):
    tree = FakeCgroupTree(tmp_path)
    rel = tree.make_pod("burstable", UID) + "/c1"
    d = tree.mkdir(rel)
    (d / "memory.high").write_text("1000\n")
    (d / "memory.current").write_text("5000\n")
    (d / "memory.reclaim").write_text("")
    rollout = Rollout("observe")
    fs = ContainerCgroups(str(tmp_path), [tree.kubepods], rollout=rollout)
    before = files_of(tmp_path)
    assert fs.write(rel, "memory.high", "max", expect="1000") == "1000"
    assert fs.write(rel, "memory.high", "1000", expect="max") == "1000"  # (a restore: no expect in observe)
    out = fs.reclaim(rel, 4096)
    assert (out.asked, out.freed, out.eagain) == (4096, 0, False)
    assert files_of(tmp_path) == before
    rollout.set("enforce")
    assert fs.write(rel, "memory.high", "max", expect="1000") == "1000"
    assert (d / "memory.high").read_text().strip() == "max"


def test_systemd_writes_in_observe_ask_systemd_nothing(tmp_path):
    class Systemd:  # the D-Bus client's interface (shim.effects.systemd_bus.SystemdBus)
        calls: list = []
        down = False

        def set_unit_properties(self, *args):
            self.calls.append(args)

    tree = FakeCgroupTree(tmp_path, "systemd")
    systemctl, records, rollout = Systemd(), [], Rollout("observe")
    fs = CgroupWriter(str(tmp_path), [tree.kubepods], emit=records.append, mode="dbus", bus=systemctl,
                      rollout=rollout, settle=0)
    fs.set_driver("systemd")
    fs.write(tree.burstable, "memory.min", 64 * MI, "sum", level=1)
    assert systemctl.calls == [] and tree.get(tree.burstable) == 0
    [r] = records
    assert (r["via"], r["property"], r["rollout"]) == ("systemd", "MemoryMin", "observe")
    rollout.set("enforce")
    fs.write(tree.burstable, "memory.min", 64 * MI, "sum", level=1)
    assert systemctl.calls == [("kubepods-burstable.slice", [("MemoryMin", 64 * MI)])]


def test_memqos_mode_metric_says_the_mode():
    from shim.evidence.metrics import Metrics

    rollout = Rollout("observe")
    m = Metrics().attach(rollout=rollout)
    text = m.render().decode()
    assert 'memqos_mode{mode="observe"} 1.0' in text and 'memqos_mode{mode="enforce"} 0.0' in text
    rollout.set("enforce")
    assert 'memqos_mode{mode="enforce"} 1.0' in m.render().decode()


def test_mode_flag_and_file_key():
    import argparse

    from shim.app.config import ConfigError, add_arguments, reread, resolve

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert resolve(p.parse_args([])).mode == "enforce"
    assert resolve(p.parse_args(["--mode", "Observe"])).mode == "observe"
    with pytest.raises(ConfigError, match="mode must be one of"):
        resolve(p.parse_args(["--mode", "audit"]))
    cfg = resolve(p.parse_args(["--mode", "observe"]))
    path = Path(short_dir()) / "c.yaml"
    path.write_text("mode: enforce\n")
    assert reread(cfg, str(path)).mode == "observe"  # a flag stays, as at start


def test_the_guard_and_reclaim_in_observe_decide_audit_and_write_nothing(tmp_path):
    from shim.decision.guard import GuardConfig
    from shim.decision.reclaim import ReclaimConfig
    from shim.guard.monitor import Monitor
    from shim.node.facts import KubeletFacts
    from tests.test_metrics import CID, CID2, UID as POD_UID, Clock, fake_root, pressure_text, ref
    from tests.test_reclaim_monitor import FakeKernel, container

    root = fake_root(tmp_path)
    # one container crawls at memory.high (the guard's), one is near it with cache to give (reclaim's)
    cdir = container(root, CID, current=100 * MI)
    (cdir / "memory.pressure").write_text(pressure_text(95.0, 90.0))
    container(root, CID2)
    pod = root / "kubepods" / "burstable" / f"pod{POD_UID}"
    records, clock, kernel, rollout = [], Clock(), FakeKernel(), Rollout("observe")
    monitor = Monitor(cgroup_root=str(root), kubelet=KubeletFacts(source="test", cgroup_driver="cgroupfs"),
                      guard=GuardConfig(window=30.0, cooldown=60.0), interval=5.0, emit=records.append,
                      sources=[lambda: [ref(), ref(cid=CID2, name="cache")]], clock=clock, reclaim=ReclaimConfig(),
                      page_size=4096, episodes=None, rollout=rollout)
    monitor.fs._write_value = kernel
    before = files_of(pod)
    verdicts = []
    for _ in range(8):  # 0..35 s of crawling at memory.high
        verdicts += [d.verdict.value for _, d in monitor.tick()]
        clock.t += 5
    assert verdicts == ["relax"]
    assert files_of(pod) == before and kernel.writes == []
    [relax] = [r for r in records if r["event"] == "guard-relax"]
    assert (relax["old"], relax["new"], relax["rollout"]) == (str(100 * MI), "max", "observe")
    [rec] = [r for r in records if r["event"] == "reclaim"]
    assert rec["writes"] >= 1 and rec["rollout"] == "observe" and rec["freed_bytes"] == 0
    # enforcing: the guard starts over from the container as it runs, and acts for real
    rollout.set("enforce")
    for _ in range(8):
        verdicts += [d.verdict.value for _, d in monitor.tick()]
        clock.t += 5
    assert verdicts == ["relax", "relax"] and (cdir / "memory.high").read_text() == "max\n"
    assert kernel.writes and "rollout" not in [r for r in records if r["event"] == "guard-relax"][-1]


def test_reload_mode_without_a_file_and_with_the_flag_given(tmp_path, caplog):
    import argparse
    import logging

    from shim.app.config import add_arguments, resolve
    from shim.app.reload import reload_mode
    from shim.app.service import Service

    def service(argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        s = object.__new__(Service)  # what reload_mode and set_mode use of a running Service
        s.cfg, s.reconciler = resolve(p.parse_args(argv)), None
        s.rollout = Rollout(s.cfg.mode)
        s.audit = type("Audit", (), {"records": [], "emit": lambda self, r: self.records.append(r)})()
        return s

    caplog.set_level(logging.INFO)
    s = service(["--mode", "observe"])
    assert reload_mode(s, None) == "observe" and s.audit.records == []
    assert "started without --config" in caplog.text
    path = tmp_path / "c.yaml"
    path.write_text("mode: enforce\n")
    s = service(["--mode", "observe", "--config", str(path)])
    assert reload_mode(s, str(path)) == "observe" and s.rollout.observe  # the flag wins, as at start
    assert "given by the --mode flag" in caplog.text
    s = service(["--config", str(path)])
    path.write_text("mode: observe\n")
    assert reload_mode(s, str(path)) == "observe" and s.rollout.observe and s.cfg.mode == "observe"
    assert [r["event"] for r in s.audit.records] == ["mode", "config-reload"]
    assert reload_mode(s, str(path)) == "observe"  # unchanged: no switch audited
    assert [r["event"] for r in s.audit.records] == ["mode", "config-reload", "config-reload"]
    path.write_text("mode: [observe\n")
    assert reload_mode(s, str(path)) == "observe"
    assert s.audit.records[-1]["event"] == "config-reload-error" and "not YAML" in s.audit.records[-1]["error"]
