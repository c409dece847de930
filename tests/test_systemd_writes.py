"""Pod/QoS/node values through systemd (shim/effects/systemd.py, shim/effects/systemd_bus.py,
--systemd-writes).

systemd is played by tests/fake_systemd_bus.py on a private dbus-daemon
(tests/systemd_bus_support.py): systemd's D-Bus method, its argument types and error answers,
and what systemd does to a cgroup tree (applies the properties it is told; on daemon-reload
re-applies them all, resetting what was written behind its back). The real thing is proven in
the systemd guest (scripts/e2e-vm --guest systemd)."""
from __future__ import annotations

import os

import pytest

from shim.effects import PathRefused
from shim.effects.systemd import CgroupWriter, SystemdError, slice_path, unit_for_path
from shim.evidence.metrics import Metrics
from shim.node.facts import KubeletFacts
from shim.tools.reset import reset_cgroups
from tests.reconciler_support import FakeCgroupTree, read_audit, wait_for
from tests.systemd_bus_support import FakeSystemdBus
from tests.test_reconciler import B_UID, G_UID, Stack

MI = 2**20


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    """make(tree, units) -> FakeSystemdBus: org.freedesktop.systemd1 on a private bus, which
    the shim's writers reach through DBUS_SYSTEM_BUS_ADDRESS."""
    made = []

    def make(tree, units=()):
        sd = FakeSystemdBus(tmp_path, tree, units)
        made.append(sd)
        sd.env(monkeypatch)
        return sd

    yield make
    for sd in made:
        sd.close()


# -- unit names ---------------------------------------------------------------------------
def test_slice_paths_follow_systemd_naming():
    assert slice_path("kubepods.slice") == ["kubepods.slice"]
    assert slice_path("kubepods-burstable-pod1_2.slice") == [
        "kubepods.slice", "kubepods-burstable.slice", "kubepods-burstable-pod1_2.slice"]
    assert slice_path("-.slice") == []
    for bad in ("kubepods--x.slice", "-kubepods.slice", "kubepods-.slice", "kubepods", "a\\x2db.slice",
                "kubepods.service"):
        with pytest.raises(PathRefused):
            slice_path(bad)


@pytest.mark.parametrize("path,unit", [
    ("kubepods.slice", "kubepods.slice"),
    ("kubepods.slice/kubepods-burstable.slice", "kubepods-burstable.slice"),
    ("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a_b.slice", "kubepods-besteffort-pod0a_b.slice"),
    ("kubepods.slice/kubepods-pod5d9d.slice", "kubepods-pod5d9d.slice"),
])
def test_kubepods_units_are_accepted(path, unit):
    assert unit_for_path(path) == unit


@pytest.mark.parametrize("path", [
    "kubepods.slice/kubepods-besteffort-pod0a.slice",  # not where systemd puts it
    "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a.slice/cri-containerd-abc.scope",  # a container
    "system.slice",  # not configured as reserved
    "system.slice/kubepods.slice",
    "kubepods.slice/../system.slice",
    "kubepods.slice/kubepods-x\\x2dy.slice",
    "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a.slice/memory.min",
    "",
])
def test_other_units_are_refused(path):
    with pytest.raises(PathRefused):
        unit_for_path(path)


def test_reserved_units_only_when_configured_and_only_themselves():
    assert unit_for_path("system.slice", ["system.slice"]) == "system.slice"
    assert unit_for_path("kube.slice/kube-reserved.slice", ["/kube.slice/kube-reserved.slice"]) == "kube-reserved.slice"
    assert unit_for_path("system.slice/kubelet.service", ["system.slice/kubelet.service"]) == "kubelet.service"
    with pytest.raises(PathRefused):  # below a reserved cgroup: not the shim's
        unit_for_path("system.slice/ssh.service", ["system.slice"])


# -- the writer ---------------------------------------------------------------------------
def writer(tree, mode="dbus", driver="systemd", booted=True, systemd_root=None, records=None):
    w = CgroupWriter(str(tree.root), [tree.kubepods], mode=mode, booted=lambda: booted, settle=0.5,
                     systemd_root=systemd_root or str(tree.root), emit=records.append if records is not None else None)
    w.set_driver(driver)
    return w


def test_auto_goes_through_systemd_only_on_a_systemd_node(tmp_path):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    assert writer(tree, "auto").via == "systemd"
    assert writer(tree, "auto", driver="cgroupfs").via == "cgroupfs"
    assert writer(tree, "auto", booted=False).via == "cgroupfs"
    # a cgroup root that is not systemd's hierarchy (a test tree, another mount): the files
    assert writer(tree, "auto", systemd_root="/sys/fs/cgroup").via == "cgroupfs"
    assert writer(tree, "dbus", driver="cgroupfs", booted=False).via == "systemd"
    assert writer(tree, "cgroupfs").via == "cgroupfs"
    with pytest.raises(ValueError):
        CgroupWriter(str(tree.root), mode="systemd")


def test_a_value_set_through_systemd_survives_daemon_reload(tmp_path, systemd):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods, tree.burstable])
    records = []
    w = writer(tree, records=records)
    wr = w.write(tree.burstable, "memory.min", 32 * MI, "sum of Burstable pods", level=1)
    assert (wr.old, wr.new) == ("0", str(32 * MI)) and tree.get(tree.burstable) == 32 * MI
    # systemd's method with its exact signature, runtime=true, the value as a uint64 variant
    assert sd.calls() == [{"member": "SetUnitProperties", "signature": "sba(sv)", "unit": "kubepods-burstable.slice",
                           "runtime": True, "props": [["MemoryMin", "t", 32 * MI]]}]
    assert records[-1] | {"path": None} == {
        "event": "cgroup-write", "path": None, "file": "memory.min", "old": "0", "new": str(32 * MI),
        "why": "sum of Burstable pods", "level": "qos", "via": "systemd", "unit": "kubepods-burstable.slice",
        "property": "MemoryMin"}
    assert w.write(tree.burstable, "memory.min", 32 * MI, "again") is None  # nothing to do: no call
    assert len(sd.calls()) == 1
    sd.reload()
    assert tree.get(tree.burstable) == 32 * MI
    assert w.read(tree.burstable, "memory.min") == str(32 * MI)


def test_a_value_written_to_cgroupfs_is_reset_by_daemon_reload(tmp_path, systemd):
    """The failure the systemd writer exists for (kubernetes#138431): also shows the fake can fail."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods, tree.burstable])
    w = writer(tree, mode="cgroupfs")
    w.write(tree.burstable, "memory.min", 32 * MI, "sum of Burstable pods")
    assert tree.get(tree.burstable) == 32 * MI and sd.calls() == []
    sd.reload()
    assert tree.get(tree.burstable) == 0


def test_a_value_already_in_the_file_is_told_to_systemd_once(tmp_path, systemd):
    """After an upgrade from cgroupfs writes (or a restart): the file is right, systemd may not know it."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods])
    tree.set(tree.kubepods, "memory.min", 96 * MI)
    records = []
    w = writer(tree, records=records)
    assert w.read(tree.kubepods, "memory.min") == f"{96 * MI} (not set through systemd)"
    wr = w.write(tree.kubepods, "memory.min", 96 * MI, "sum")
    assert (wr.old, wr.new) == (str(96 * MI), str(96 * MI)) and records[-1]["adopted"] is True
    assert w.read(tree.kubepods, "memory.min") == str(96 * MI)
    assert w.write(tree.kubepods, "memory.min", 96 * MI, "sum") is None
    assert len(sd.calls()) == 1
    sd.reload()
    assert tree.get(tree.kubepods) == 96 * MI


def test_systemd_refusals_are_oserrors_and_nothing_is_recorded(tmp_path, systemd):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    tree.mkdir("system.slice/kubelet.service")
    sd = systemd(tree, [tree.kubepods])  # kubelet.service: not known to systemd
    records = []
    w = CgroupWriter(str(tree.root), [tree.kubepods, "system.slice/kubelet.service"], mode="dbus", settle=0.2,
                     emit=records.append)
    w.set_driver("systemd", ["system.slice/kubelet.service"])
    with pytest.raises(SystemdError, match="org.freedesktop.systemd1.NoSuchUnit: Unit kubelet.service not found"):
        w.write("system.slice/kubelet.service", "memory.min", 8 * MI, "kube-reserved")
    assert isinstance(SystemdError("x"), OSError)
    assert records == [] and list(w.writes) == [] and tree.get("system.slice/kubelet.service") == 0
    # a refusal is systemd's answer, not a bus failure: the next write goes through at once
    assert w.write(tree.kubepods, "memory.min", 8 * MI, "sum") is not None and tree.get(tree.kubepods) == 8 * MI
    assert [r["event"] for r in records] == ["cgroup-write"] and w.bus.connects == 1
    with pytest.raises(ValueError):
        w.bus.set_unit_properties("kubepods.slice", [("CPUWeight", 1)])  # only MemoryMin / MemoryLow
    with pytest.raises(ValueError):
        w.bus.set_unit_properties("kubepods.slice", [("MemoryMin", 2**64)])
    w.close()


def test_properties_go_out_as_systemd_types_them(tmp_path, systemd):
    """The fake answers a wrong signature or variant type as systemd does: the shim's calls are
    the ones it accepts (and a call it refuses is a SystemdError, not a crash)."""
    from jeepney import MessageType

    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods])
    wrong_type = sd.call("SetUnitProperties", "sba(sv)", ("kubepods.slice", True, [("MemoryMin", ("u", 4096))]))
    wrong_signature = sd.call("SetUnitProperties", "sbas", ("kubepods.slice", True, ["MemoryMin=4096"]))
    unknown = sd.call("SetUnitProperties", "sba(sv)", ("kubepods.slice", True, [("NoSuchProperty", ("t", 1))]))
    assert all(r.header.message_type == MessageType.error for r in (wrong_type, wrong_signature, unknown))
    assert tree.get(tree.kubepods) == 0
    w = writer(tree)
    w.write(tree.kubepods, "memory.low", 2**40, "sum")  # beyond 32 bits: a uint64 on the wire
    assert sd.calls()[-1] == {"member": "SetUnitProperties", "signature": "sba(sv)", "unit": "kubepods.slice",
                              "runtime": True, "props": [["MemoryLow", "t", 2**40]]}
    assert "error" not in sd.calls()[-1] and tree.get(tree.kubepods, "memory.low") == 2**40
    w.close()


def test_the_connection_is_kept_and_made_again_when_the_bus_comes_back(tmp_path, systemd):
    """Fail open: without a bus a write is a SystemdError (audited once as systemd-bus down),
    then calls fail at once during the hold-off; with the bus back the writer reconnects."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods, tree.burstable])
    records = []
    w = writer(tree, records=records)
    for i in range(1, 4):
        w.write(tree.kubepods, "memory.min", i * MI, "sum")
    assert tree.get(tree.kubepods) == 3 * MI and w.bus.connects == 1  # one connection for every call
    sd.bus_gone()
    with pytest.raises(SystemdError, match="cannot reach systemd"):
        w.write(tree.kubepods, "memory.min", 4 * MI, "sum")
    with pytest.raises(SystemdError, match="not used for"):  # held off: no new attempt
        w.write(tree.burstable, "memory.min", 4 * MI, "sum")
    down = [r for r in records if r["event"] == "systemd-bus"]
    assert [(r["state"], r["bus"]) for r in down] == [("down", sd.address)] and "Connection" in down[0]["error"]
    metrics = Metrics()
    for r in records:
        metrics.on_audit(r)
    assert metrics.registry.get_sample_value("memqos_systemd_bus_unreachable_total") == 1
    assert tree.get(tree.kubepods) == 3 * MI and w.bus.failures == 2
    sd.bus_back()
    assert wait_for(lambda: _wrote(w, tree.kubepods, 4 * MI), timeout=30)
    assert tree.get(tree.kubepods) == 4 * MI and w.bus.connects == 2
    assert [r["state"] for r in records if r["event"] == "systemd-bus"] == ["down", "up"]
    w.close()


def _wrote(w, path, value) -> bool:
    try:
        w.write(path, "memory.min", value, "sum")
        return True
    except SystemdError:
        return False


def test_a_bus_that_does_not_answer_is_a_timeout(tmp_path):
    """A socket that accepts and never speaks D-Bus: the connect has a deadline (no call hangs the
    reconciler's thread)."""
    import socket
    import tempfile

    from shim.effects.systemd_bus import SystemdBus

    d = tempfile.mkdtemp(prefix="memqos-mute-")
    path = os.path.join(d, "bus")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(8)
    try:
        bus = SystemdBus(f"unix:path={path}", timeout=0.3, attempts=2, backoff=0.01)
        with pytest.raises(SystemdError, match=r"cannot reach systemd: .*2 attempt"):
            bus.set_unit_properties("kubepods.slice", [("MemoryMin", 1)])
        assert bus.down and bus.connects == 0
    finally:
        mute.close()
        os.unlink(path)
        os.rmdir(d)


def test_systemd_is_never_asked_about_a_slice_whose_cgroup_is_gone(tmp_path, systemd):
    """systemd accepts a property for a slice it does not know: it loads the slice and makes its
    cgroup (seen in the systemd guest). So the writer asks only for cgroups that exist."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods])
    w = writer(tree)
    with pytest.raises(FileNotFoundError):
        w.write(tree.pod("burstable", "0a"), "memory.min", 8 * MI, "pod request")
    assert sd.calls() == [] and not (tree.root / tree.pod("burstable", "0a")).exists()
    sd.set_property("kubepods-burstable-pod0b.slice", "MemoryMin", 4096)
    assert tree.get(tree.pod("burstable", "0b")) == 4096  # what the writer avoids


def test_paths_are_validated_before_systemd_is_asked(tmp_path, systemd):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = systemd(tree, [tree.kubepods])
    container = tree.mkdir(f"{tree.burstable}/cri-containerd-{'c' * 64}.scope")
    other = tree.mkdir("system.slice")
    w = writer(tree)
    for rel in (os.path.relpath(container, tree.root), os.path.relpath(other, tree.root),
                f"{tree.kubepods}/../system.slice"):
        with pytest.raises(PathRefused):
            w.write(rel, "memory.min", MI, "x")
    with pytest.raises(PathRefused):
        w.write(tree.kubepods, "memory.max", MI, "x")
    assert sd.calls() == []


def test_reset_goes_through_systemd_so_a_reload_keeps_the_zeros(tmp_path, systemd):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    pod = tree.make_pod("burstable", "0a")
    sd = systemd(tree, [tree.kubepods, tree.burstable, tree.besteffort, pod])
    sd.set_property("kubepods.slice", "MemoryMin", 64 * MI)
    sd.set_property("kubepods-burstable-pod0a.slice", "MemoryMin", 64 * MI)
    kubelet = KubeletFacts(source="test", cgroup_driver="systemd")
    writes, notes, errors = reset_cgroups(str(tree.root), kubelet, None, systemd_writes="dbus")
    assert (notes, errors) == ([], [])
    assert tree.nonzero() == {}
    sd.reload()
    assert tree.nonzero() == {}
    # the same reset through cgroupfs: undone by the next reload
    sd.set_property("kubepods.slice", "MemoryMin", 64 * MI)
    reset_cgroups(str(tree.root), kubelet, None, systemd_writes="cgroupfs")
    assert tree.nonzero() == {}
    sd.reload()
    assert tree.get(tree.kubepods) == 64 * MI


# -- the reconciler with the writer --------------------------------------------------------
@pytest.mark.parametrize("mode", ["dbus", "cgroupfs"])
def test_reconciler_values_and_daemon_reload(tmp_path, systemd, mode):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    gp, bp = tree.pod("guaranteed", G_UID), tree.pod("burstable", B_UID)
    sd = systemd(tree, [tree.kubepods, tree.burstable, tree.besteffort, gp, bp])
    s = Stack(tmp_path, driver="systemd", tree=tree, resync=0.3, extra=("--systemd-writes", mode))
    try:
        k = s.kubelet
        g = k.run_pod("qos-guaranteed", G_UID, "guaranteed")
        k.create(g, "main", "guaranteed", request=64 * MI, limit=64 * MI)
        b = k.run_pod("qos-burstable", B_UID, "burstable")
        k.create(b, "main", "burstable", request=32 * MI, limit=128 * MI)
        s.sync()
        want = {tree.kubepods: (96 * MI, 0), tree.burstable: (32 * MI, 0), gp: (64 * MI, 0), bp: (32 * MI, 0)}
        assert tree.nonzero() == want
        recs = [r for r in s.records() if r["event"] == "cgroup-write" and r["new"] != "0"]
        active = [r for r in s.records() if r["event"] == "reconciler-active"]
        assert active[-1]["writes"] == ("systemd" if mode == "dbus" else "cgroupfs")
        if mode == "dbus":
            assert {r["unit"] for r in recs} == {"kubepods.slice", "kubepods-burstable.slice",
                                                 f"kubepods-pod{G_UID}.slice",
                                                 f"kubepods-burstable-pod{B_UID.replace('-', '_')}.slice"}
            assert all(c["signature"] == "sba(sv)" and c["runtime"] is True for c in sd.calls())
        else:
            assert sd.calls() == [] and all("via" not in r for r in recs)
        s.svc.reconciler.stop()  # frozen: what systemd alone keeps
        sd.reload()
        if mode == "dbus":
            assert tree.nonzero() == want
        else:
            assert tree.nonzero() == {}  # reset by systemd
    finally:
        s.close()


def test_reconciler_retries_when_systemd_cannot_be_reached(tmp_path, systemd):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    bp = tree.pod("burstable", B_UID)
    sd = systemd(tree, [tree.kubepods, tree.burstable, tree.besteffort, bp])
    sd.bus_gone()  # dbus restarting
    s = Stack(tmp_path, driver="systemd", tree=tree, resync=0.3, extra=("--systemd-writes", "dbus"))
    try:
        b = s.kubelet.run_pod("qos-burstable", B_UID, "burstable")
        s.kubelet.create(b, "main", "burstable", request=32 * MI)
        s.sync()
        assert tree.nonzero() == {}
        # fail open: the failed writes are audited, the reconciler goes on (and the CRI calls went through)
        errors = [r for r in s.records() if r["event"] == "reconciler-error"]
        assert errors and "cannot reach systemd" in errors[0]["error"]
        assert [r["state"] for r in s.records() if r["event"] == "systemd-bus"] == ["down"]
        assert s.svc.reconciler.running
        sd.bus_back()
        # the next try after the hold-off (1 s doubling while the bus stayed away, 30 s at most)
        wait_for(lambda: tree.get(bp) == 32 * MI and tree.get(tree.kubepods) == 32 * MI, timeout=60)
        assert [r["state"] for r in s.records() if r["event"] == "systemd-bus"] == ["down", "up"]
    finally:
        s.close()


def test_the_setting_is_validated(tmp_path):
    from shim.cli.main import main

    assert main(["reset", "--systemd-writes", "systemd", "--cgroup-root", str(tmp_path)]) == 2
    recs = read_audit(tmp_path / "none.jsonl")
    assert recs == []


def test_the_documented_bounds_are_the_defaults():
    """docs/systemd-writes.md states the connection's deadlines and retries: they are the code's."""
    from pathlib import Path

    from shim.effects.systemd_bus import SystemdBus

    doc = (Path(__file__).resolve().parent.parent / "docs" / "systemd-writes.md").read_text()
    bus = SystemdBus()
    assert (bus.timeout, bus.attempts, bus.backoff, bus.first_hold, bus.max_hold) == (10.0, 3, 0.2, 1.0, 30.0)
    for phrase in ("the bus's Hello and each call have 10 s each", "3 attempts, 0.2 s then 0.4 s apart",
                   "not asked\n  again for 1 s (doubling while it keeps failing, at most 30 s)"):
        assert phrase in doc, phrase
