"""`memqos-shim reset`: every managed memory.min / memory.low back to 0, bottom-up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shim.cli.main import main
from tests.reconciler_support import FakeCgroupTree, read_audit, write_kubelet_config

MI = 2**20
UIDS = ("0a", "0b", "0c")


def populated(tmp_path, driver):
    t = FakeCgroupTree(tmp_path / "cgroup", driver)
    g = t.make_pod("guaranteed", UIDS[0])
    b = t.make_pod("burstable", UIDS[1])
    be = t.make_pod("besteffort", UIDS[2])
    t.set(t.kubepods, "memory.min", 96 * MI)
    t.set(t.kubepods, "memory.low", 7 * MI)
    t.set(t.burstable, "memory.min", 32 * MI)
    t.set(g, "memory.min", 64 * MI)
    t.set(b, "memory.min", 32 * MI)
    t.set(b, "memory.low", 32 * MI)
    container = t.mkdir(f"{b}/{'c' * 64}")  # a container cgroup: the runtime's, left alone
    (container / "memory.min").write_text(f"{32 * MI}\n")
    t.mkdir("system.slice")
    t.set("system.slice", "memory.min", 100 * MI)
    return t, g, b, be


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_reset_zeroes_every_managed_value_bottom_up(tmp_path, driver):
    t, g, b, _ = populated(tmp_path, driver)
    kc = write_kubelet_config(tmp_path / "kubelet.json", driver,
                              enforceNodeAllocatable=["pods", "system-reserved"], systemReservedCgroup="/system.slice")
    audit = tmp_path / "audit.jsonl"
    rc = main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", str(kc), "--audit-log", str(audit)])
    assert rc == 0
    left = t.nonzero()
    assert left == {f"{b}/{'c' * 64}": (32 * MI, 0)}  # only the container cgroup keeps its value
    recs = [r for r in read_audit(audit) if r["event"] == "cgroup-write"]
    order = [(os.path.relpath(r["path"], t.root), r["file"]) for r in recs]
    assert order == [(b, "memory.min"), (b, "memory.low"), (g, "memory.min"), (t.burstable, "memory.min"),
                     (t.kubepods, "memory.min"), (t.kubepods, "memory.low"), ("system.slice", "memory.min")]
    assert all(r["new"] == "0" and r["why"] == "memqos-shim reset" for r in recs)
    # a second reset has nothing to do
    assert main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", str(kc), "--audit-log", str(audit)]) == 0
    assert len([r for r in read_audit(audit) if r["event"] == "cgroup-write"]) == len(recs)


def test_reset_dry_run_changes_nothing(tmp_path):
    t, *_ = populated(tmp_path, "cgroupfs")
    before = t.values()
    kc = write_kubelet_config(tmp_path / "kubelet.json")
    out = subprocess.run([sys.executable, "-m", "shim", "reset", "--dry-run", "--cgroup-root", str(t.root),
                          "--kubelet-config", str(kc), "--audit-log", "-"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert t.values() == before
    recs = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["event"] for r in recs} == {"cgroup-write-dry-run"} and len(recs) == 6
    assert "would set 6 value(s) to 0" in out.stderr


def test_reset_skips_symlinks_and_reserved_cgroups_not_enforced(tmp_path):
    t, *_ = populated(tmp_path, "cgroupfs")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "memory.min").write_text("5\n")
    os.symlink(outside, t.root / "kubepods" / "burstable" / "pod0d")
    kc = write_kubelet_config(tmp_path / "kubelet.json", systemReservedCgroup="/system.slice")  # not enforced
    assert main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", str(kc), "--audit-log", "none"]) == 0
    assert (outside / "memory.min").read_text() == "5\n"
    assert t.get("system.slice") == 100 * MI


def test_reset_on_cgroup_v1_or_without_kubepods_does_nothing(tmp_path, capsys):
    t = FakeCgroupTree(tmp_path / "v1", v2=False)
    t.set("kubepods", "memory.min", 5 * MI)
    assert main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", "none", "--audit-log", "none"]) == 0
    assert t.get("kubepods") == 5 * MI
    assert "not a cgroup v2 hierarchy" in capsys.readouterr().err
    t2 = FakeCgroupTree(tmp_path / "empty", kubepods=False)
    assert main(["reset", "--cgroup-root", str(t2.root), "--kubelet-config", "none", "--audit-log", "none"]) == 0
    assert "no kubepods cgroup" in capsys.readouterr().err


def test_reset_after_the_running_shim_wrote_values(tmp_path):
    """The acceptance path: pods through the running proxy, the shim stopped, reset -> all 0."""
    from tests.test_reconciler import B_UID, G_UID, Stack

    s = Stack(tmp_path)
    k = s.kubelet
    g = k.run_pod("g", G_UID, "guaranteed")
    k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
    b = k.run_pod("b", B_UID, "burstable", overhead=4 * MI)
    k.create(b, "main", "burstable", request=32 * MI)
    s.sync()
    assert len(s.tree.nonzero()) == 4
    s.close()
    kc = tmp_path / "kubelet.json"  # written by the stack
    assert main(["reset", "--cgroup-root", str(s.tree.root), "--kubelet-config", str(kc), "--audit-log", "none"]) == 0
    assert s.tree.nonzero() == {}


def test_reset_leaves_values_the_kubelet_writes_itself(tmp_path, capsys):
    """A v1.37 kubelet with memoryReservationPolicy TieredReservation owns the pod / QoS / node
    values: reset does not zero them (the kubelet would only write them back)."""
    t, *_ = populated(tmp_path, "cgroupfs")
    before = t.values()
    kc = write_kubelet_config(tmp_path / "kubelet.json", memoryReservationPolicy="TieredReservation")
    assert main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", str(kc), "--kubelet-version", "1.37",
                 "--audit-log", "none"]) == 0
    assert t.values() == before
    assert "the kubelet writes the pod / QoS / node values itself" in capsys.readouterr().err
    # the same kubelet on 1.36 with the gate at its default (off): the values are the shim's
    assert main(["reset", "--cgroup-root", str(t.root), "--kubelet-config", str(kc), "--kubelet-version", "1.36",
                 "--audit-log", "none"]) == 0
    assert t.values() != before and t.get("kubepods") == 0 and t.get("kubepods/burstable", "memory.low") == 0
