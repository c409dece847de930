"""Proactive reclaim through the monitor, over a fake cgroupfs whose memory.reclaim behaves like
the kernel's: a write of N bytes takes up to N bytes of the container's clean page cache
(memory.current and memory.stat `file` drop), and raises EAGAIN (OSError errno 11) after a
partial reclaim when it could not take N. Plus: with reclaim off the monitor reads, writes and
audits exactly what it did before."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from shim.decision.reclaim import ReclaimConfig
from shim.effects.cgroupfs import PathRefused
from shim.effects.container import READ_FILES, ContainerCgroups
from shim.evidence.audit import AuditLog
from shim.evidence.metrics import Metrics
from shim.guard.monitor import Monitor
from shim.node.facts import KubeletFacts
from tests.test_metrics import CID, CID2, UID, Clock, fake_root, pressure_text, ref, samples, value, write_cgroup

MI = 2**20
HIGH = 100 * MI


def write_stat(d: Path, *, file: int, anon: int, refault_pages: int = 0) -> None:
    (d / "memory.stat").write_text(
        f"anon {anon}\nfile {file}\nkernel 1048576\nshmem 0\nfile_mapped 0\nfile_dirty 0\nfile_writeback 0\n"
        f"inactive_file {file}\nactive_file 0\nworkingset_refault_anon 0\nworkingset_refault_file {refault_pages}\n")


def container(root: Path, cid=CID, *, current=95 * MI, file=60 * MI, anon=30 * MI, high=HIGH, events_high=0,
              reclaim_file=True) -> Path:
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / cid
    write_cgroup(cdir, current=current, min=16 * MI, high=high, max=200 * MI, events={"high": events_high},
                 pressure=pressure_text(0.5, 0.0))
    write_stat(cdir, file=file, anon=anon)
    if reclaim_file:
        (cdir / "memory.reclaim").write_text("")
    return cdir


class FakeKernel:
    """Stands in for the kernel's memory.reclaim write: takes min(asked, what is reclaimable)
    from memory.current and memory.stat `file`; EAGAIN when that was less than asked."""

    def __init__(self, limit: dict[str, int] | None = None):
        self.writes: list[tuple[str, int, int]] = []  # (cgroup dir, asked, freed)
        self.limit = limit or {}  # cgroup dir -> bytes the kernel can still find

    def __call__(self, fd: int, text: str) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        assert os.path.basename(path) == "memory.reclaim"
        d = Path(os.path.dirname(path))
        asked = int(text)
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        file = int(stat["file"])
        can = min(file, self.limit.get(str(d), file))
        freed = min(asked, can)
        current = int((d / "memory.current").read_text())
        (d / "memory.current").write_text(f"{current - freed}\n")
        write_stat(d, file=file - freed, anon=int(stat["anon"]))
        if str(d) in self.limit:
            self.limit[str(d)] -= freed
        self.writes.append((str(d), asked, freed))
        if freed < asked:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))


def make(root: Path, refs, *, reclaim=ReclaimConfig(), emit=None, clock=None, kernel=None, audit_interval=60.0):
    m = Monitor(cgroup_root=str(root), kubelet=KubeletFacts(source="test", cgroup_driver="cgroupfs"),
                guard=__import__("shim.decision.guard", fromlist=["GuardConfig"]).GuardConfig(), interval=5.0,
                emit=emit or (lambda r: None), sources=[lambda: list(refs)], clock=clock or Clock(),
                reclaim=reclaim, reclaim_audit_interval=audit_interval, page_size=4096)
    if kernel is not None:
        m.fs._write_value = kernel
    return m


def reclaim_records(records):
    return [r for r in records if r["event"].startswith("reclaim")]


def test_reclaim_writes_are_made_audited_in_sums_and_counted(tmp_path):
    root = fake_root(tmp_path)
    cdir = container(root)
    audit = AuditLog(None).start()
    records = []
    audit.add_listener(records.append)
    clock, kernel = Clock(), FakeKernel()
    monitor = make(root, [ref()], emit=audit.emit, clock=clock, kernel=kernel)
    m = Metrics().attach(audit=audit, monitor=monitor)
    monitor.tick()  # first sample: refaults have nothing to compare with
    assert kernel.writes == []
    clock.t += 5
    monitor.tick()  # 95 MiB within 10 MiB of 100: back to 85 MiB
    assert kernel.writes == [(str(cdir), 10 * MI, 10 * MI)]
    assert (cdir / "memory.current").read_text() == f"{85 * MI}\n"
    for _ in range(3):  # it grows back each interval: reclaimed each time, audited later in one record
        (cdir / "memory.current").write_text(f"{95 * MI}\n")
        clock.t += 5
        monitor.tick()
    assert len(kernel.writes) == 4
    audit.flush()
    recs = reclaim_records(records)
    assert len(recs) == 1  # the first write of a quiet container at once, the rest in sums
    first = recs[0]
    assert first["event"] == "reclaim" and first["writes"] == 1 and first["asked_bytes"] == 10 * MI
    assert first["freed_bytes"] == 10 * MI and first["eagain"] == 0 and first["container_id"] == CID
    assert first["path"] == str(cdir) and first["file"] == "memory.reclaim" and "asking 10.0MiB" in first["reason"]
    clock.t += 60
    (cdir / "memory.current").write_text(f"{95 * MI}\n")
    monitor.tick()
    audit.flush()
    recs = reclaim_records(records)
    assert len(recs) == 2
    assert recs[1]["writes"] == 4 and recs[1]["freed_bytes"] == 40 * MI
    assert recs[1]["stalls_avoided"] == 4  # memory.events high never grew after a write (writes 1-4)
    ss = samples(m.render().decode())
    assert value(ss, "memqos_reclaim_writes_total", result="ok") == 5
    assert value(ss, "memqos_reclaim_freed_bytes_total") == 50 * MI
    assert value(ss, "memqos_reclaim_stalls_avoided_total") == 4
    assert value(ss, "memqos_container_reclaimed_bytes_total", namespace="default", pod="web-1", container="app",
                 container_id=CID) == 50 * MI
    assert value(ss, "memqos_cgroup_writes_total", level="container", file="memory.reclaim") == 5
    assert value(ss, "memqos_reclaim_config", headroom_percent="10", headroom_min_bytes=str(8 * MI),
                 step_bytes=str(32 * MI), rate_bytes=str(16 * MI), psi_some_percent="10", backoff_seconds="60") == 1
    audit.close()


def test_eagain_after_partial_reclaim_is_an_outcome_and_a_fruitless_one_backs_off(tmp_path):
    root = fake_root(tmp_path)
    cdir = container(root)
    records = []
    clock = Clock()
    kernel = FakeKernel({str(cdir): 4 * MI})
    monitor = make(root, [ref()], emit=records.append, clock=clock, kernel=kernel, audit_interval=1.0)
    monitor.tick()
    clock.t += 5
    monitor.tick()
    assert kernel.writes == [(str(cdir), 10 * MI, 4 * MI)]  # partial, then EAGAIN
    (rec,) = reclaim_records(records)
    assert rec["eagain"] == 1 and rec["freed_bytes"] == 4 * MI and rec["asked_bytes"] == 10 * MI
    clock.t += 5
    monitor.tick()  # 91 MiB: asks 6, the kernel finds nothing: EAGAIN, back off
    assert kernel.writes[-1] == (str(cdir), 6 * MI, 0)
    for _ in range(5):
        clock.t += 5
        monitor.tick()
    assert len(kernel.writes) == 2  # backing off (60 s)
    assert monitor.reclaim_totals["eagain"] == 2 and monitor.reclaim_totals["writes"] == 2


def test_anon_only_guaranteed_and_relaxed_containers_are_left_alone(tmp_path):
    root = fake_root(tmp_path)
    anon = container(root, CID, current=99 * MI, file=MI // 2, anon=98 * MI)
    relaxed = container(root, CID2, high="max")
    g_uid = "99999999-2222-3333-4444-555555555555"
    g = root / "kubepods" / f"pod{g_uid}" / ("ef" * 32)
    write_cgroup(g, current=99 * MI, high=HIGH, pressure=pressure_text())  # odd, but must still be left alone
    write_stat(g, file=60 * MI, anon=30 * MI)
    (g / "memory.reclaim").write_text("")
    from shim.guard.monitor import ContainerRef

    guaranteed = ContainerRef("ef" * 32, "default", "g", "app", g_uid, f"/kubepods/pod{g_uid}", "Guaranteed")
    records, clock, kernel = [], Clock(), FakeKernel()
    monitor = make(root, [ref(), ref(CID2, name="b"), guaranteed], emit=records.append, clock=clock, kernel=kernel)
    for _ in range(10):
        monitor.tick()
        clock.t += 5
    assert kernel.writes == [] and reclaim_records(records) == []
    assert len(monitor.snapshot().readings) == 3
    assert (anon / "memory.current").read_text() == f"{99 * MI}\n"
    assert (relaxed / "memory.high").read_text() == "max\n"


def test_reclaim_off_reads_writes_and_audits_nothing_new(tmp_path):
    root = fake_root(tmp_path)
    cdir = container(root)
    before = {p.name: p.read_text() for p in cdir.iterdir()}
    records, clock, kernel = [], Clock(), FakeKernel()
    monitor = make(root, [ref()], reclaim=None, emit=records.append, clock=clock, kernel=kernel)
    opened = []
    real_open = monitor.fs._open_file

    def spy(dfd, name, flags):
        opened.append((name, flags & (os.O_WRONLY | os.O_RDWR)))
        return real_open(dfd, name, flags)

    monitor.fs._open_file = spy
    for _ in range(10):
        monitor.tick()
        clock.t += 5
    assert {name for name, _ in opened} == set(READ_FILES)  # the monitor's files, not memory.stat
    assert all(mode == 0 for _, mode in opened)  # nothing opened for writing
    assert kernel.writes == [] and records == []
    assert {p.name: p.read_text() for p in cdir.iterdir()} == before
    assert monitor.snapshot().readings[0].reclaimed is None
    m = Metrics().attach(monitor=monitor)
    text = m.render().decode()
    assert "memqos_reclaim" not in text and "memqos_container_reclaimed" not in text
    assert not hasattr(monitor, "_rc_hist") or monitor._rc_hist == {}


def test_no_memory_reclaim_file_turns_reclaim_off_once(tmp_path):
    root = fake_root(tmp_path)
    container(root, reclaim_file=False)
    container(root, CID2, reclaim_file=False)
    records, clock = [], Clock()
    monitor = make(root, [ref(), ref(CID2, name="b")], emit=records.append, clock=clock)
    for _ in range(5):
        monitor.tick()
        clock.t += 5
    errs = reclaim_records(records)
    assert [r["event"] for r in errs] == ["reclaim-error"] and errs[0]["reclaim_disabled"] is True
    assert "kernel < 5.19" in errs[0]["error"]


def test_reclaim_path_is_validated_like_every_write(tmp_path):
    root = fake_root(tmp_path)
    cdir = container(root)
    fs = ContainerCgroups(str(root), ["kubepods"])
    fs._write_value = FakeKernel()
    rel = f"kubepods/burstable/pod{UID}/{CID}"
    assert fs.reclaim(rel, 2 * MI).freed == 2 * MI
    with pytest.raises(PathRefused):
        fs.reclaim("kubepods", MI)  # not strictly below kubepods
    with pytest.raises(PathRefused):
        fs.reclaim(f"kubepods/burstable/pod{UID}/../../x", MI)
    with pytest.raises(ValueError):
        fs.reclaim(rel, 0)
    (cdir / "memory.reclaim").unlink()
    os.symlink(tmp_path / "elsewhere", cdir / "memory.reclaim")
    with pytest.raises(PathRefused):
        fs.reclaim(rel, MI)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "kubepods" / "burstable" / "podlink")
    with pytest.raises(PathRefused):
        fs.reclaim("kubepods/burstable/podlink", MI)


def test_refaults_back_off_through_the_monitor(tmp_path):
    root = fake_root(tmp_path)
    cdir = container(root)
    records, clock, kernel = [], Clock(), FakeKernel()
    monitor = make(root, [ref()], emit=records.append, clock=clock, kernel=kernel, audit_interval=1.0)
    monitor.tick()
    clock.t += 5
    monitor.tick()
    assert len(kernel.writes) == 1
    (cdir / "memory.current").write_text(f"{95 * MI}\n")
    write_stat(cdir, file=50 * MI, anon=30 * MI, refault_pages=1024)  # 4 MiB refaulted
    clock.t += 5
    monitor.tick()
    assert len(kernel.writes) == 1
    recs = reclaim_records(records)
    assert recs[-1]["backoffs"] == 1 and "working set" in recs[-1]["backoff_reason"]


def test_off_by_default_and_on_with_the_documented_defaults(tmp_path):
    import argparse

    from shim.app.config import OPTIONS, resolve
    from shim.guard.monitor import build_monitor, reclaim_config

    ns = argparse.Namespace(config=None, **{o.name.replace("-", "_"): None for o in OPTIONS})
    ns.cgroup_root, ns.guard_state = str(tmp_path), "none"
    cfg = resolve(ns)
    assert cfg.reclaim is False and reclaim_config(cfg) is None
    kubelet = KubeletFacts(source="test", cgroup_driver="cgroupfs")
    assert build_monitor(cfg, kubelet, lambda r: None).reclaim is None
    ns.reclaim = "true"
    on = reclaim_config(resolve(ns))
    assert on == ReclaimConfig(max_gap=15.0)  # the decision's defaults, gap = 3 intervals of 5 s
    assert build_monitor(resolve(ns), kubelet, lambda r: None).reclaim == on
