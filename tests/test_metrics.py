"""Metrics and the monitor over a fake cgroupfs: what /metrics shows, the guard's writes, path
validation; and `memqos-shim serve --metrics-address` scraped over HTTP in front of the fake
runtime."""
from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shim.container.chain import HookChain
from shim.decision.guard import GuardAction, GuardConfig
from shim.evidence.audit import AuditLog
from shim.evidence.metrics import Metrics, method_label
from shim.guard.monitor import ContainerRef, Monitor
from shim.guard.sampling import parse_pressure
from shim.node.facts import KubeletFacts
from shim.transport.hooks import RpcCall

MI = 2**20
UID = "11111111-2222-3333-4444-555555555555"
CID = "ab" * 32
CID2 = "cd" * 32


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} from an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text_or_samples, name: str, **labels) -> float | None:
    ss = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return ss.get((name, tuple(sorted(labels.items()))))


def pressure_text(some10=0.0, full10=0.0, some_total=0, full_total=0) -> str:
    return (f"some avg10={some10:.2f} avg60=0.00 avg300=0.00 total={some_total}\n"
            f"full avg10={full10:.2f} avg60=0.00 avg300=0.00 total={full_total}\n")


def write_cgroup(d: Path, *, current: int, min: int = 0, low: int = 0, high="max", max="max",
                 events: dict | None = None, pressure: str | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    ev = {"low": 0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0, "oom_group_kill": 0} | (events or {})
    files = {
        "memory.current": f"{current}\n",
        "memory.min": f"{min}\n",
        "memory.low": f"{low}\n",
        "memory.high": f"{high}\n",
        "memory.max": f"{max}\n",
        "memory.events": "".join(f"{k} {v}\n" for k, v in ev.items()),
        "memory.pressure": pressure if pressure is not None else pressure_text(),
    }
    for name, text in files.items():
        (d / name).write_text(text)


def fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    return root


def ref(cid=CID, uid=UID, parent=None, name="app") -> ContainerRef:
    return ContainerRef(cid, "default", "web-1", name, uid, parent or f"/kubepods/burstable/pod{uid}", "Burstable")


def make_monitor(root: Path, refs, *, driver="cgroupfs", emit=None, guard=None, clock=None) -> Monitor:
    return Monitor(cgroup_root=str(root), kubelet=KubeletFacts(source="test", cgroup_driver=driver),
                   guard=guard or GuardConfig(), interval=5.0, emit=emit or (lambda r: None),
                   sources=[lambda: list(refs)], clock=clock or time.monotonic)


# -- parsing ---------------------------------------------------------------------------------
def test_parse_pressure():
    p = parse_pressure(pressure_text(1.5, 90.25, 123, 4567))
    assert p["some"]["avg10"] == 1.5 and p["full"]["avg10"] == 90.25 and p["full"]["total"] == 4567


def test_method_label_bounded():
    assert method_label("/runtime.v1.RuntimeService/CreateContainer") == "CreateContainer"
    assert method_label("/runtime.v1.ImageService/PullImage") == "PullImage"
    assert method_label("/evil/" + "x" * 1000) == "other"


# -- /metrics from a fake cgroupfs -----------------------------------------------------------
def test_metrics_show_every_series_with_the_fake_cgroupfs_values(tmp_path):
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=60 * MI, min=32 * MI, high=64 * MI, max=128 * MI,
                 events={"low": 1, "high": 42, "max": 3, "oom": 2, "oom_kill": 1},
                 pressure=pressure_text(12.5, 7.25, 3_000_000, 1_500_000))
    # a BestEffort container on the systemd-free layout: no memory.high -> +Inf
    uid2 = "99999999-2222-3333-4444-555555555555"
    write_cgroup(root / "kubepods" / "besteffort" / f"pod{uid2}" / CID2, current=5 * MI)
    refs = [ref(), ref(CID2, uid2, f"/kubepods/besteffort/pod{uid2}", "side")]
    audit = AuditLog(None).start()
    monitor = make_monitor(root, refs, emit=audit.emit)
    m = Metrics().attach(audit=audit, monitor=monitor)

    # CRI calls through the observer; the rewrite timed
    obs = m.observer
    for code, ms in (("OK", 2.0), ("OK", 4.0), ("UNAVAILABLE", 1.0)):
        obs.finished(RpcCall("/runtime.v1.RuntimeService/CreateContainer", time.time(), ms, b"", None, [], code))
    obs.finished(RpcCall("/runtime.v1.RuntimeService/Version", time.time(), 0.3, b"", None, [], "OK"))

    class Inner:
        held_methods = frozenset({"/runtime.v1.RuntimeService/CreateContainer"})

        def rewrite(self, call):
            return call.request + b"!"

        def finished(self, call):
            self.seen = call

    timed = HookChain(Inner())
    timed.time_rewrites(m.rewrite_timer)
    assert timed.rewrite(RpcCall("/runtime.v1.RuntimeService/CreateContainer", 0.0, request=b"x")) == b"x!"
    # what the audit log says: rewrites by QoS and source, fail-opens, cgroup writes, refusals, guard
    for rec in (
        {"event": "rewrite", "method": "CreateContainer", "qos": "Burstable", "request_source": "annotation"},
        {"event": "rewrite", "method": "CreateContainer", "qos": "Burstable", "request_source": "annotation"},
        {"event": "rewrite", "method": "UpdateContainerResources", "qos": "BestEffort", "request_source": "none"},
        {"event": "unchanged", "method": "CreateContainer"},
        {"event": "fail-open", "method": "CreateContainer", "error": "x"},
        {"event": "cgroup-write", "level": "pod", "file": "memory.min"},
        {"event": "cgroup-write", "level": "node", "file": "memory.min"},
        {"event": "cgroup-refused", "reason": "symlink"},
        {"event": "reconciler-error", "what": "resync"},
    ):
        audit.emit(rec)
    monitor.tick()
    audit.flush()
    text = m.render().decode()
    ss = samples(text)
    audit.close()

    assert value(ss, "memqos_cri_calls_total", method="CreateContainer", code="OK") == 2
    assert value(ss, "memqos_cri_calls_total", method="CreateContainer", code="UNAVAILABLE") == 1
    assert value(ss, "memqos_cri_calls_total", method="Version", code="OK") == 1
    assert value(ss, "memqos_cri_call_duration_seconds_count", method="CreateContainer") == 3
    assert value(ss, "memqos_cri_call_duration_seconds_sum", method="CreateContainer") == pytest.approx(0.007)
    assert value(ss, "memqos_cri_call_duration_seconds_bucket", method="CreateContainer", le="0.0025") == 2
    assert value(ss, "memqos_cri_rewrite_duration_seconds_count", method="CreateContainer") == 1
    assert value(ss, "memqos_rewrites_total", method="CreateContainer", qos="Burstable", request_source="annotation",
                 **{"class": ""}) == 2
    assert value(ss, "memqos_rewrites_total", method="UpdateContainerResources", qos="BestEffort",
                 request_source="none", **{"class": ""}) == 1
    assert value(ss, "memqos_unchanged_total", method="CreateContainer", **{"class": ""}) == 1
    assert value(ss, "memqos_fail_open_total", method="CreateContainer") == 1
    assert value(ss, "memqos_cgroup_writes_total", level="pod", file="memory.min") == 1
    assert value(ss, "memqos_cgroup_writes_total", level="node", file="memory.min") == 1
    assert value(ss, "memqos_cgroup_refusals_total", by="reconciler") == 1
    assert value(ss, "memqos_reconciler_errors_total") == 1
    assert value(ss, "memqos_audit_records_dropped_total") == 0
    assert value(ss, "memqos_guard_actions_total", action="relax") == 0
    assert value(ss, "memqos_guard_config", action="relax", threshold_percent="40", window_seconds="30",
                 cooldown_seconds="300") == 1
    assert value(ss, "memqos_monitor_containers") == 2
    assert value(ss, "memqos_monitor_sampled_containers") == 2

    c = dict(namespace="default", pod="web-1", container="app", container_id=CID)
    assert value(ss, "memqos_container_memory_current_bytes", **c) == 60 * MI
    assert value(ss, "memqos_container_memory_min_bytes", **c) == 32 * MI
    assert value(ss, "memqos_container_memory_low_bytes", **c) == 0
    assert value(ss, "memqos_container_memory_high_bytes", **c) == 64 * MI
    assert value(ss, "memqos_container_memory_max_bytes", **c) == 128 * MI
    for event, n in (("low", 1), ("high", 42), ("max", 3), ("oom", 2), ("oom_kill", 1)):
        assert value(ss, "memqos_container_memory_events_total", event=event, **c) == n
    assert value(ss, "memqos_container_memory_events_total", event="oom_group_kill", **c) is None
    assert value(ss, "memqos_container_memory_pressure_avg10_ratio", kind="some", **c) == pytest.approx(0.125)
    assert value(ss, "memqos_container_memory_pressure_avg10_ratio", kind="full", **c) == pytest.approx(0.0725)
    assert value(ss, "memqos_container_memory_pressure_stalled_seconds_total", kind="some", **c) == 3.0
    assert value(ss, "memqos_container_memory_pressure_stalled_seconds_total", kind="full", **c) == 1.5
    assert value(ss, "memqos_container_guard_relaxed", **c) == 0
    be = dict(namespace="default", pod="web-1", container="side", container_id=CID2)
    assert value(ss, "memqos_container_memory_high_bytes", **be) == math.inf
    assert value(ss, "memqos_container_memory_max_bytes", **be) == math.inf
    assert value(ss, "memqos_container_memory_current_bytes", **be) == 5 * MI


def test_scrape_reads_no_cgroup_file(tmp_path):
    """Values come from the last round: a change on disk shows only after the next tick."""
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=10 * MI)
    monitor = make_monitor(root, [ref()])
    m = Metrics().attach(monitor=monitor)
    monitor.tick()
    (cdir / "memory.current").write_text(f"{20 * MI}\n")
    c = dict(namespace="default", pod="web-1", container="app", container_id=CID)
    assert value(m.render().decode(), "memqos_container_memory_current_bytes", **c) == 10 * MI
    monitor.tick()
    assert value(m.render().decode(), "memqos_container_memory_current_bytes", **c) == 20 * MI


def test_systemd_and_crio_naming(tmp_path):
    root = fake_root(tmp_path)
    u = UID.replace("-", "_")
    pod = root / "kubepods.slice" / "kubepods-burstable.slice" / f"kubepods-burstable-pod{u}.slice"
    write_cgroup(pod / f"cri-containerd-{CID}.scope", current=7 * MI)
    write_cgroup(pod / f"crio-{CID2}.scope", current=9 * MI)
    leaf = f"kubepods-burstable-pod{u}.slice"
    monitor = make_monitor(root, [ref(parent=leaf), ref(CID2, parent=leaf, name="b")], driver="systemd")
    monitor.tick()
    got = {r.ref.id: r.current for r in monitor.snapshot().readings}
    assert got == {CID: 7 * MI, CID2: 9 * MI}


def test_refused_paths_are_audited_and_never_read(tmp_path):
    root = fake_root(tmp_path)
    outside = tmp_path / "outside"
    write_cgroup(outside / CID, current=1)
    (root / "kubepods" / "burstable").mkdir(parents=True)
    evil_uid = "77777777-2222-3333-4444-555555555555"
    os.symlink(outside, root / "kubepods" / "burstable" / f"pod{evil_uid}")
    records = []
    refs = [
        ref(uid=evil_uid),  # pod directory is a symlink
        ref("../../etc", name="dots"),  # not an id
        ref(CID2, parent="/kubepods/burstable/pod00000000-0000-0000-0000-000000000000", name="mismatch"),
        ref("ef" * 32, parent="/etc", name="notkubepods"),
    ]
    monitor = make_monitor(root, refs, emit=records.append)
    monitor.tick()
    monitor.tick()  # each refusal is audited once
    assert monitor.snapshot().readings == []
    refused = [r for r in records if r["event"] == "cgroup-refused"]
    assert {r["container"] for r in refused} == {"app", "dots", "mismatch", "notkubepods"}
    assert len(refused) == 4
    assert "symlink" in next(r["reason"] for r in refused if r["container"] == "app")
    assert all(r["by"] == "monitor" for r in refused)


def test_cgroup_v1_monitor_is_idle(tmp_path):
    root = tmp_path / "v1"
    root.mkdir()
    monitor = make_monitor(root, [ref()])
    assert monitor.tick() == []
    assert "not cgroup v2" in monitor.snapshot().idle_reason


# -- the guard through the monitor -----------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_guard_relaxes_then_restores_through_the_monitor(tmp_path):
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=64 * MI, high=64 * MI, max=128 * MI, pressure=pressure_text(95.0, 90.0))
    audit = AuditLog(None).start()
    records = []
    audit.add_listener(records.append)
    clock = Clock()
    monitor = make_monitor(root, [ref()], emit=audit.emit, clock=clock,
                           guard=GuardConfig(window=30.0, cooldown=60.0))
    m = Metrics().attach(audit=audit, monitor=monitor)
    for _ in range(6):  # 0..25 s: not yet
        assert monitor.tick() == []
        clock.t += 5
    acted = monitor.tick()  # 30 s
    assert [d.verdict.value for _, d in acted] == ["relax"]
    assert (cdir / "memory.high").read_text() == "max\n"
    # the kernel now reads max; the container calms down and shrinks
    write_cgroup(cdir, current=30 * MI, high="max", max=128 * MI, pressure=pressure_text(3.0, 1.0))
    verdicts = []
    for _ in range(14):
        clock.t += 5
        verdicts += [d.verdict.value for _, d in monitor.tick()]
    assert verdicts == ["restore"]
    assert (cdir / "memory.high").read_text() == f"{64 * MI}\n"
    audit.flush()
    relax, restore = [r for r in records if r["event"].startswith("guard-")]
    assert relax["event"] == "guard-relax" and relax["old"] == str(64 * MI) and relax["new"] == "max"
    assert relax["path"] == str(cdir) and relax["container_id"] == CID and relax["full_avg10"] == 90.0
    assert restore["event"] == "guard-restore" and restore["old"] == "max" and restore["new"] == str(64 * MI)
    ss = samples(m.render().decode())
    assert value(ss, "memqos_guard_actions_total", action="relax") == 1
    assert value(ss, "memqos_guard_actions_total", action="restore") == 1
    assert value(ss, "memqos_cgroup_writes_total", level="container", file="memory.high") == 2
    audit.close()


def test_guard_action_none_reports_and_writes_nothing(tmp_path):
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=64 * MI, high=64 * MI, pressure=pressure_text(95.0, 90.0))
    records = []
    clock = Clock()
    monitor = make_monitor(root, [ref()], emit=records.append, clock=clock,
                           guard=GuardConfig(action=GuardAction.NONE, window=10.0))
    for _ in range(5):
        monitor.tick()
        clock.t += 5
    assert [r["event"] for r in records] == ["guard-report"]
    assert (cdir / "memory.high").read_text() == f"{64 * MI}\n"


def test_guard_does_not_overwrite_a_value_changed_meanwhile(tmp_path):
    """Compare-and-write: the runtime applied an update between the read and the write."""
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=64 * MI, high=64 * MI, pressure=pressure_text(95.0, 90.0))
    records = []
    clock = Clock()
    monitor = make_monitor(root, [ref()], emit=records.append, clock=clock, guard=GuardConfig(window=10.0))
    monitor.tick()
    clock.t += 10
    real = monitor.fs.read_files

    def racing_read(rel, files=None):
        out = real(rel)
        (cdir / "memory.high").write_text(f"{96 * MI}\n")  # lands after our read
        return out

    monitor.fs.read_files = racing_read
    monitor.tick()
    assert (cdir / "memory.high").read_text() == f"{96 * MI}\n"
    assert [r["event"] for r in records] == ["guard-error"]
    assert "changed meanwhile" in records[0]["error"]
    assert monitor.guard_states().get(CID) is None or monitor.guard_states()[CID].mode == "watch"


def test_vanished_container_forgotten(tmp_path):
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=1 * MI, high=2 * MI)
    monitor = make_monitor(root, [ref()])
    monitor.tick()
    assert len(monitor.snapshot().readings) == 1
    for f in cdir.iterdir():
        f.unlink()
    cdir.rmdir()
    monitor.tick()
    assert monitor.snapshot().readings == [] and monitor.guard_states() == {}


# -- serve --metrics-address, scraped over HTTP ----------------------------------------------
def test_serve_metrics_endpoint_end_to_end(tmp_path):
    from shim.cri import pb
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer
    from tests.test_serve import Shim, create, expected_high, run_pod, short_dir

    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        (base / "config.yaml").write_text("guard-window: 0.5\nguard-cooldown: 0.5\n")  # config-file settings
        shim = Shim(base, runtime.address, extra=(
            "--metrics-address", "127.0.0.1:0", "--monitor-interval", "0.1", "--resync-interval", "0.5",
            "--config", str(base / "config.yaml")))
        try:
            uid = "0123abcd-0000-1111-2222-333344445555"
            sid, sb = run_pod(shim, "crawler", uid, "burstable",
                              annotations={"memqos.io/requests": json.dumps({"main": str(64 * MI)})})
            cid, unified, _, _ = create(shim, runtime.runtime, sid, sb, "main", "burstable",
                                        request=64 * MI, limit=256 * MI)
            high = expected_high(64 * MI, 256 * MI)
            assert unified["memory.high"] == str(high)
            # the kubelet's and the runtime's part on a real node: the cgroups
            cg = base / "cgroup"
            for d in (cg / "kubepods", cg / "kubepods" / "burstable", cg / "kubepods" / "burstable" / f"pod{uid}"):
                d.mkdir(exist_ok=True)
                (d / "memory.min").write_text("0\n")
                (d / "memory.low").write_text("0\n")
            cdir = cg / "kubepods" / "burstable" / f"pod{uid}" / cid
            write_cgroup(cdir, current=high, min=64 * MI, high=high, max=256 * MI,
                         events={"high": 5000}, pressure=pressure_text(95.0, 90.0, 10**6, 9 * 10**5))
            deadline = time.monotonic() + 20
            addr = None
            while addr is None and time.monotonic() < deadline:
                for line in shim.audit.read_text().split("\n")[:-1]:  # complete lines only
                    r = json.loads(line)
                    if r.get("event") == "metrics":
                        addr = r["address"]
                time.sleep(0.05)
            assert addr, (base / "shim.log").read_text()
            # the guard relaxes the crawling container (window 0.5 s)
            while (cdir / "memory.high").read_text() != "max\n" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (cdir / "memory.high").read_text() == "max\n"
            url = f"http://{addr}/metrics"
            text = ""
            c = dict(namespace="default", pod="crawler", container="main", container_id=cid)
            while time.monotonic() < deadline:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
                if (value(text, "memqos_container_guard_relaxed", **c) == 1
                        and value(text, "memqos_cgroup_writes_total", level="pod", file="memory.min")):
                    break
                time.sleep(0.1)
            ss = samples(text)
            assert value(ss, "memqos_cri_calls_total", method="CreateContainer", code="OK") == 1
            assert value(ss, "memqos_cri_calls_total", method="RunPodSandbox", code="OK") == 1
            assert value(ss, "memqos_cri_call_duration_seconds_count", method="CreateContainer") == 1
            assert value(ss, "memqos_cri_rewrite_duration_seconds_count", method="CreateContainer") == 1
            assert value(ss, "memqos_rewrites_total", method="CreateContainer", qos="Burstable",
                         request_source="annotation", **{"class": ""}) == 1
            assert value(ss, "memqos_guard_actions_total", action="relax") == 1
            assert value(ss, "memqos_cgroup_writes_total", level="container", file="memory.high") == 1
            # the reconciler wrote the pod's memory.min (64Mi) through the same audit stream
            assert value(ss, "memqos_cgroup_writes_total", level="pod", file="memory.min") == 1
            assert (cg / "kubepods" / "burstable" / f"pod{uid}" / "memory.min").read_text().strip() == str(64 * MI)
            assert value(ss, "memqos_reconciler_lag_seconds") is not None
            # the relay's limits, read from its public counters (the test's client holds a connection)
            assert value(ss, "memqos_transport_max_connections") == 128
            assert value(ss, "memqos_transport_connections") >= 1
            assert value(ss, "memqos_transport_connections_shed_total", reason="limit") == 0
            assert value(ss, "memqos_container_memory_high_bytes", **c) == math.inf  # the guard's max
            assert value(ss, "memqos_container_memory_min_bytes", **c) == 64 * MI
            assert value(ss, "memqos_container_memory_max_bytes", **c) == 256 * MI
            assert value(ss, "memqos_container_memory_events_total", event="high", **c) == 5000
            assert value(ss, "memqos_container_memory_pressure_avg10_ratio", kind="full", **c) == pytest.approx(0.9)
            # calm and small again: restored after the cool-down
            write_cgroup(cdir, current=10 * MI, min=64 * MI, high="max", max=256 * MI,
                         pressure=pressure_text(0.0, 0.0))
            # (wait for the value itself: the guard's write truncates the file first, so a read can see "")
            while (cdir / "memory.high").read_text() != f"{high}\n" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (cdir / "memory.high").read_text() == f"{high}\n"
            events = [json.loads(x).get("event") for x in shim.audit.read_text().split("\n")[:-1]]
            assert "guard-relax" in events and "guard-restore" in events
            shim.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=10)
        finally:
            shim.stop()


def test_relaxed_container_stays_watched_when_a_source_forgets_it(tmp_path):
    root = fake_root(tmp_path)
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=64 * MI, high=64 * MI, pressure=pressure_text(95.0, 90.0))
    listed = [ref()]
    clock = Clock()
    monitor = make_monitor(root, listed, clock=clock, guard=GuardConfig(window=10.0, cooldown=20.0))
    monitor.tick()
    clock.t += 10
    assert [d.verdict.value for _, d in monitor.tick()] == ["relax"]
    listed.clear()  # e.g. the runtime listing missed it
    write_cgroup(cdir, current=10 * MI, high="max", pressure=pressure_text(0.0, 0.0))
    verdicts = []
    for _ in range(6):
        clock.t += 5
        verdicts += [d.verdict.value for _, d in monitor.tick()]
    assert verdicts == ["restore"]
    assert (cdir / "memory.high").read_text() == f"{64 * MI}\n"
    clock.t += 5
    monitor.tick()  # episode over and no source lists it: no longer watched
    assert monitor.snapshot().readings == []


def test_decisions_are_counted_by_class_with_only_the_configured_names():
    """The class label takes the configured class names and "": an audit record naming another
    class (an annotation's value never reaches the record unchecked, but a bug could) counts
    under "", so no pod can add a series."""
    m = Metrics().set_classes(["batch", "latency-critical"])
    for cls in ("batch", "batch", None, "latency-critical", "made-up", 7):
        m.on_audit({"event": "rewrite", "method": "CreateContainer", "qos": "Burstable",
                    "request_source": "kubelet-unified", "class": cls})
    m.on_audit({"event": "unchanged", "method": "UpdateContainerResources", "class": "batch"})
    ss = samples(m.render().decode())
    rw = {k[1]: v for k, v in ss.items() if k[0] == "memqos_rewrites_total"}
    by_class = {dict(labels)["class"]: v for labels, v in rw.items()}
    assert by_class == {"batch": 2, "latency-critical": 1, "": 3}
    assert value(ss, "memqos_unchanged_total", method="UpdateContainerResources", **{"class": "batch"}) == 1


def test_build_metrics_takes_the_class_names_from_the_config(tmp_path):
    import argparse

    from shim.app.config import OPTIONS, resolve
    from shim.evidence.metrics import build_metrics

    f = tmp_path / "config.yaml"
    f.write_text("metrics-address: 127.0.0.1:0\nclasses: {batch: {factor: 0.5}}\n"
                 "namespace-classes: {'*': [batch]}\n")
    ns = argparse.Namespace(config=str(f), **{o.name.replace("-", "_"): None for o in OPTIONS})
    assert build_metrics(resolve(ns)).class_names == {"batch"}
