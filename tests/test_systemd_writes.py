"""Pod/QoS/node values through systemd (shim/effects/systemd.py, --systemd-writes).

systemd is played by tests/fake_systemctl.py: systemctl's arguments and failures, and what
systemd does to a cgroup tree (applies the properties it is told; on daemon-reload re-applies
them all, resetting what was written behind its back). The real thing is proven in the
systemd guest (scripts/e2e-vm --guest systemd)."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from shim.effects import PathRefused
from shim.effects.systemd import CgroupWriter, Systemctl, SystemdError, slice_path, unit_for_path
from shim.node.facts import KubeletFacts
from shim.tools.reset import reset_cgroups
from tests.reconciler_support import FakeCgroupTree, read_audit, wait_for
from tests.test_reconciler import B_UID, G_UID, Stack

MI = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


class FakeSystemd:
    """A `systemctl` on PATH backed by tests/fake_systemctl.py and a JSON state file."""

    def __init__(self, tmp, tree: FakeCgroupTree, units=()):
        self.state_path = tmp / "systemd-state.json"
        self.bin = tmp / "bin"
        self.bin.mkdir(exist_ok=True)
        exe = self.bin / "systemctl"
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE}/fake_systemctl.py \"$@\"\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        self.tree = tree
        self.save({"root": str(tree.root), "units": {}, "props": {}, "calls": []})
        for path in units:
            self.load(path)

    def state(self) -> dict:
        return json.loads(self.state_path.read_text())

    def save(self, state: dict) -> None:
        self.state_path.write_text(json.dumps(state))

    def load(self, path: str) -> None:
        """systemd knows the unit (the kubelet started the slice)."""
        s = self.state()
        s["units"][path.rsplit("/", 1)[-1]] = path
        self.save(s)

    def set(self, key: str, value) -> None:
        s = self.state()
        s[key] = value
        self.save(s)

    def env(self, monkeypatch) -> None:
        monkeypatch.setenv("FAKE_SYSTEMD_STATE", str(self.state_path))
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")

    def systemctl(self, *args: str) -> None:
        import subprocess

        p = subprocess.run([str(self.bin / "systemctl"), *args], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr

    def set_property_calls(self) -> list[list[str]]:
        return [c for c in self.state()["calls"] if c and c[0] == "set-property"]


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


def test_a_value_set_through_systemd_survives_daemon_reload(tmp_path, monkeypatch):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods, tree.burstable])
    sd.env(monkeypatch)
    records = []
    w = writer(tree, records=records)
    wr = w.write(tree.burstable, "memory.min", 32 * MI, "sum of Burstable pods", level=1)
    assert (wr.old, wr.new) == ("0", str(32 * MI)) and tree.get(tree.burstable) == 32 * MI
    assert sd.set_property_calls() == [["set-property", "--runtime", "--", "kubepods-burstable.slice",
                                        f"MemoryMin={32 * MI}"]]
    assert records[-1] | {"path": None} == {
        "event": "cgroup-write", "path": None, "file": "memory.min", "old": "0", "new": str(32 * MI),
        "why": "sum of Burstable pods", "level": "qos", "via": "systemd", "unit": "kubepods-burstable.slice",
        "property": "MemoryMin"}
    assert w.write(tree.burstable, "memory.min", 32 * MI, "again") is None  # nothing to do: no call
    assert len(sd.set_property_calls()) == 1
    sd.systemctl("daemon-reload")
    assert tree.get(tree.burstable) == 32 * MI
    assert w.read(tree.burstable, "memory.min") == str(32 * MI)


def test_a_value_written_to_cgroupfs_is_reset_by_daemon_reload(tmp_path, monkeypatch):
    """The failure the systemd writer exists for (kubernetes#138431): also shows the fake can fail."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods, tree.burstable])
    sd.env(monkeypatch)
    w = writer(tree, mode="cgroupfs")
    w.write(tree.burstable, "memory.min", 32 * MI, "sum of Burstable pods")
    assert tree.get(tree.burstable) == 32 * MI and sd.set_property_calls() == []
    sd.systemctl("daemon-reload")
    assert tree.get(tree.burstable) == 0


def test_a_value_already_in_the_file_is_told_to_systemd_once(tmp_path, monkeypatch):
    """After an upgrade from cgroupfs writes (or a restart): the file is right, systemd may not know it."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods])
    sd.env(monkeypatch)
    tree.set(tree.kubepods, "memory.min", 96 * MI)
    records = []
    w = writer(tree, records=records)
    assert w.read(tree.kubepods, "memory.min") == f"{96 * MI} (not set through systemd)"
    wr = w.write(tree.kubepods, "memory.min", 96 * MI, "sum")
    assert (wr.old, wr.new) == (str(96 * MI), str(96 * MI)) and records[-1]["adopted"] is True
    assert w.read(tree.kubepods, "memory.min") == str(96 * MI)
    assert w.write(tree.kubepods, "memory.min", 96 * MI, "sum") is None
    assert len(sd.set_property_calls()) == 1
    sd.systemctl("daemon-reload")
    assert tree.get(tree.kubepods) == 96 * MI


def test_systemctl_failures_are_oserrors_and_nothing_is_recorded(tmp_path, monkeypatch):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    tree.mkdir("system.slice/kubelet.service")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods])  # kubelet.service: not known to systemd
    sd.env(monkeypatch)
    w = CgroupWriter(str(tree.root), [tree.kubepods, "system.slice/kubelet.service"], mode="dbus", settle=0.2)
    w.set_driver("systemd", ["system.slice/kubelet.service"])
    with pytest.raises(SystemdError, match="Unit kubelet.service not found"):
        w.write("system.slice/kubelet.service", "memory.min", 8 * MI, "kube-reserved")
    assert isinstance(SystemdError("x"), OSError)
    sd.set("bus", False)
    with pytest.raises(SystemdError, match="Failed to connect to bus"):
        w.write(tree.kubepods, "memory.min", 8 * MI, "sum")
    assert list(w.writes) == [] and tree.get("system.slice/kubelet.service") == 0 and tree.get(tree.kubepods) == 0
    missing = Systemctl(command=[str(tmp_path / "no-such-systemctl")])
    with pytest.raises(SystemdError, match="cannot run"):
        missing.set_property("kubepods.slice", "MemoryMin", 1)
    with pytest.raises(ValueError):
        missing.set_property("kubepods.slice", "CPUWeight", 1)  # only MemoryMin / MemoryLow


def test_systemd_is_never_asked_about_a_slice_whose_cgroup_is_gone(tmp_path, monkeypatch):
    """systemd accepts a property for a slice it does not know: it loads the slice and makes its
    cgroup (seen in the systemd guest). So the writer asks only for cgroups that exist."""
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods])
    sd.env(monkeypatch)
    w = writer(tree)
    with pytest.raises(FileNotFoundError):
        w.write(tree.pod("burstable", "0a"), "memory.min", 8 * MI, "pod request")
    assert sd.set_property_calls() == [] and not (tree.root / tree.pod("burstable", "0a")).exists()
    sd.systemctl("set-property", "--runtime", "--", "kubepods-burstable-pod0b.slice", "MemoryMin=4096")
    assert tree.get(tree.pod("burstable", "0b")) == 4096  # what the writer avoids


def test_paths_are_validated_before_systemd_is_asked(tmp_path, monkeypatch):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods])
    sd.env(monkeypatch)
    container = tree.mkdir(f"{tree.burstable}/cri-containerd-{'c' * 64}.scope")
    other = tree.mkdir("system.slice")
    w = writer(tree)
    for rel in (os.path.relpath(container, tree.root), os.path.relpath(other, tree.root),
                f"{tree.kubepods}/../system.slice"):
        with pytest.raises(PathRefused):
            w.write(rel, "memory.min", MI, "x")
    with pytest.raises(PathRefused):
        w.write(tree.kubepods, "memory.max", MI, "x")
    assert sd.set_property_calls() == []


def test_reset_goes_through_systemd_so_a_reload_keeps_the_zeros(tmp_path, monkeypatch):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    pod = tree.make_pod("burstable", "0a")
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods, tree.burstable, tree.besteffort, pod])
    sd.env(monkeypatch)
    sd.systemctl("set-property", "--runtime", "kubepods.slice", f"MemoryMin={64 * MI}")
    sd.systemctl("set-property", "--runtime", "kubepods-burstable-pod0a.slice", f"MemoryMin={64 * MI}")
    kubelet = KubeletFacts(source="test", cgroup_driver="systemd")
    writes, notes, errors = reset_cgroups(str(tree.root), kubelet, None, systemd_writes="dbus")
    assert (notes, errors) == ([], [])
    assert tree.nonzero() == {}
    sd.systemctl("daemon-reload")
    assert tree.nonzero() == {}
    # the same reset through cgroupfs: undone by the next reload
    sd.systemctl("set-property", "--runtime", "kubepods.slice", f"MemoryMin={64 * MI}")
    reset_cgroups(str(tree.root), kubelet, None, systemd_writes="cgroupfs")
    assert tree.nonzero() == {}
    sd.systemctl("daemon-reload")
    assert tree.get(tree.kubepods) == 64 * MI


# -- the reconciler with the writer --------------------------------------------------------
@pytest.mark.parametrize("mode", ["dbus", "cgroupfs"])
def test_reconciler_values_and_daemon_reload(tmp_path, monkeypatch, mode):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    gp, bp = tree.pod("guaranteed", G_UID), tree.pod("burstable", B_UID)
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods, tree.burstable, tree.besteffort, gp, bp])
    sd.env(monkeypatch)
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
            assert all(c[:3] == ["set-property", "--runtime", "--"] for c in sd.set_property_calls())
        else:
            assert sd.set_property_calls() == [] and all("via" not in r for r in recs)
        s.svc.reconciler.stop()  # frozen: what systemd alone keeps
        sd.systemctl("daemon-reload")
        if mode == "dbus":
            assert tree.nonzero() == want
        else:
            assert tree.nonzero() == {}  # reset by systemd
    finally:
        s.close()


def test_reconciler_retries_when_systemd_cannot_be_reached(tmp_path, monkeypatch):
    tree = FakeCgroupTree(tmp_path / "cg", "systemd")
    bp = tree.pod("burstable", B_UID)
    sd = FakeSystemd(tmp_path, tree, [tree.kubepods, tree.burstable, tree.besteffort, bp])
    sd.env(monkeypatch)
    sd.set("bus", False)  # dbus restarting
    s = Stack(tmp_path, driver="systemd", tree=tree, resync=0.3, extra=("--systemd-writes", "dbus"))
    try:
        b = s.kubelet.run_pod("qos-burstable", B_UID, "burstable")
        s.kubelet.create(b, "main", "burstable", request=32 * MI)
        s.sync()
        assert tree.nonzero() == {}
        errors = [r for r in s.records() if r["event"] == "reconciler-error"]
        assert errors and "Failed to connect to bus" in errors[0]["error"]
        sd.set("bus", True)
        wait_for(lambda: tree.get(bp) == 32 * MI and tree.get(tree.kubepods) == 32 * MI, timeout=10)
    finally:
        s.close()


def test_the_setting_is_validated(tmp_path):
    from shim.app.cli import main

    assert main(["reset", "--systemd-writes", "systemd", "--cgroup-root", str(tmp_path)]) == 2
    recs = read_audit(tmp_path / "none.jsonl")
    assert recs == []
