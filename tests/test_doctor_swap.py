"""`memqos-shim doctor`'s swap checks on fake nodes: swap areas (/proc/swaps, SwapTotal), the
kubepods cgroup's memory.swap.max, the kubelet's failSwapOn / memorySwap.swapBehavior / NodeSwap
gate, and what the kubelet of each version sends in memory.swap.max (docs/operations.md, "Swap")."""
from __future__ import annotations

from pathlib import Path

import pytest

from shim.tools.doctor import FAIL, PASS, WARN, Doctor
from shim.tools.doctor.swap import KubeletSwap, kubelet_swap_config, kubelet_swap_writes, swap_devices
from tests.test_doctor import cfg, env, fake_proc, v2_tree

SWAPS = ("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
         "/swapfile                               file\t\t2097148\t\t0\t\t-2\n")


def run(tmp_path: Path, *, kubelet: str = "", swap_kib: int = 0, swap_max: str | None = "max",
        version: str = "1.33", kubelet_args: list[str] | None = None, **over) -> dict:
    root = tmp_path / "cg"
    v2_tree(root)
    if swap_max is not None:
        (root / "kubepods" / "memory.swap.max").write_text(swap_max + "\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: 16777216 kB\nSwapTotal: {swap_kib} kB\nSwapFree: {swap_kib} kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\n" + kubelet)
    proc = fake_proc(tmp_path, kubelet_args=kubelet_args)
    if swap_kib:
        (proc / "swaps").write_text(SWAPS)
    c = cfg(cgroup_root=str(root), meminfo=str(tmp_path / "meminfo"), kubelet_config=str(tmp_path / "kubelet.yaml"),
            kubelet_version=version, **over)
    d = Doctor(c, env(proc))
    return {"swap": d.check_swap(), "kubelet swap": d.check_kubelet_swap()}


def test_no_swap_passes_and_the_kubelet_sends_memory_swap_max_0(tmp_path):
    r = run(tmp_path)
    assert r["swap"].verdict == PASS and "no swap" in r["swap"].summary
    assert r["kubelet swap"].verdict == PASS
    assert "NoSwap (default)" in r["kubelet swap"].summary and "memory.swap.max 0 for every" in r["kubelet swap"].summary


def test_swap_on_with_fail_swap_on_default_fails(tmp_path):
    r = run(tmp_path, swap_kib=2097148)
    assert r["swap"].verdict == FAIL
    assert "2097148Ki" in r["swap"].summary and "/swapfile" in r["swap"].summary
    assert any("refuses to start" in d for d in r["swap"].details)


def test_swap_on_with_the_flag_on_the_kubelets_command_line_passes(tmp_path):
    r = run(tmp_path, swap_kib=2097148, kubelet_args=["--fail-swap-on=false"])
    assert r["swap"].verdict == PASS


def test_limited_swap_on_a_swap_node(tmp_path):
    r = run(tmp_path, swap_kib=2097148, kubelet="failSwapOn: false\nmemorySwap: {swapBehavior: LimitedSwap}\n")
    assert r["swap"].verdict == PASS and "kubepods/memory.swap.max max" in r["swap"].summary
    k = r["kubelet swap"]
    assert k.verdict == PASS and "LimitedSwap" in k.summary
    assert any("Burstable" in d and "floor(request / MemTotal x swap size)" in d for d in k.details)
    assert any("Guaranteed, BestEffort" in d and "memory.swap.max 0" in d for d in k.details)


def test_no_swap_accounting_warns(tmp_path):
    r = run(tmp_path, swap_kib=2097148, swap_max=None, kubelet="failSwapOn: false\n")
    assert r["swap"].verdict == WARN and "absent" in r["swap"].summary
    assert r["kubelet swap"].verdict == WARN and "nothing about swap" in r["kubelet swap"].summary


def test_limited_swap_with_the_gate_off_warns(tmp_path):
    r = run(tmp_path, kubelet="memorySwap: {swapBehavior: LimitedSwap}\nfeatureGates: {NodeSwap: false}\n")
    k = r["kubelet swap"]
    assert k.verdict == WARN and "NoSwap" in k.summary
    assert any("gate off: the kubelet uses NoSwap" in d for d in k.details)


def test_unlimited_swap_is_refused_from_v1_30(tmp_path):
    r = run(tmp_path, kubelet="memorySwap: {swapBehavior: UnlimitedSwap}\n")
    assert r["kubelet swap"].verdict == WARN
    assert any("removed in v1.30" in d for d in r["kubelet swap"].details)


def test_a_bad_swap_behaviour_is_a_problem(tmp_path):
    r = run(tmp_path, kubelet="memorySwap: {swapBehavior: Sometimes}\n")
    assert r["kubelet swap"].verdict == WARN
    assert any("'Sometimes' is not NoSwap or LimitedSwap" in d for d in r["kubelet swap"].details)


@pytest.mark.parametrize("version,cfg_,expect", [
    ((1, 21), KubeletSwap(), "no swap support before v1.22"),
    ((1, 25), KubeletSwap(), "nothing about swap"),
    ((1, 25), KubeletSwap(gate=True), "memory_swap_limit_in_bytes = the memory limit"),
    ((1, 25), KubeletSwap(gate=True, behavior="UnlimitedSwap"), "memory_swap_limit_in_bytes -1"),
    ((1, 28), KubeletSwap(), "NodeSwap gate off (default): unified memory.swap.max 0 for every container"),
    ((1, 29), KubeletSwap(gate=True, behavior="LimitedSwap"), "request / MemTotal x swap size for Burstable"),
    ((1, 29), KubeletSwap(gate=True, behavior="UnlimitedSwap"), "memory.swap.max max for every container"),
    ((1, 28), KubeletSwap(gate=True), "UnlimitedSwap (the default then): unified memory.swap.max max"),
    ((1, 30), KubeletSwap(), "NodeSwap gate on (default), NoSwap (default): unified memory.swap.max 0"),
    ((1, 34), KubeletSwap(behavior="LimitedSwap"), "LimitedSwap: unified memory.swap.max for every container"),
])
def test_what_each_kubelet_version_sends(version, cfg_, expect):
    summary, _, _ = kubelet_swap_writes(version, cfg_, accounting=True)
    assert expect in summary


def test_an_unknown_version_says_what_it_assumes():
    summary, details, _ = kubelet_swap_writes(None, KubeletSwap(), accounting=True)
    assert "NoSwap" in summary and any("assumed v1.31" in d for d in details)


def test_cgroup_v1_has_no_unified_swap():
    summary, _, _ = kubelet_swap_writes((1, 33), KubeletSwap(), accounting=True, cgroup_v2=False)
    assert "cgroup v1" in summary


def test_kubelet_swap_config_tolerates_any_shape():
    assert kubelet_swap_config(None) == KubeletSwap()
    k = kubelet_swap_config({"failSwapOn": "yes", "memorySwap": [1], "featureGates": {"NodeSwap": "on"}})
    assert k.fail_swap_on is None and k.gate is None and len(k.problems) == 2


def test_swap_devices_skips_garbage(tmp_path):
    (tmp_path / "swaps").write_text(SWAPS + "garbage line\n/dev/zram0 partition notanumber 0 100\n")
    assert swap_devices(str(tmp_path)) == [("/swapfile", 2097148 * 1024)]


def test_doctor_prints_the_swap_lines(tmp_path):
    v2_tree(tmp_path / "cg")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\n")
    c = cfg(cgroup_root=str(tmp_path / "cg"), meminfo=str(tmp_path / "meminfo"),
            kubelet_config=str(tmp_path / "kubelet.yaml"), kubelet_version="1.33")
    names = [r.name for r in Doctor(c, env(fake_proc(tmp_path))).run()]
    assert names.index("kubelet config") < names.index("swap") < names.index("kubelet swap")


def test_swap_classes_are_said_to_change_nothing_where_the_kubelet_sends_memory_swap_max(tmp_path):
    conf = tmp_path / "classes.yaml"
    conf.write_text("classes: {swappy: {swap: true}}\nnamespace-classes: {'*': [swappy]}\n")
    r = run(tmp_path, config=str(conf))  # v1.33, accounting: NoSwap sends 0 to every container
    k = r["kubelet swap"]
    assert k.verdict == WARN and any("classes allowing swap (swappy) change nothing here" in d for d in k.details)
    old = tmp_path / "old"
    old.mkdir()
    r = run(old, config=str(conf), version="1.27")  # gate off: the kubelet sends nothing about swap
    k = r["kubelet swap"]
    assert k.verdict == PASS and any("swappy): their containers get memory.swap.max max" in d for d in k.details)


def test_before_the_kubelet_made_kubepods_another_cgroup_says_whether_swap_is_accounted(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "system.slice").mkdir()
    (root / "system.slice" / "memory.swap.max").write_text("max\n")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nSwapTotal: 0 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\n")
    c = cfg(cgroup_root=str(root), meminfo=str(tmp_path / "meminfo"), kubelet_config=str(tmp_path / "kubelet.yaml"),
            kubelet_version="1.33")
    d = Doctor(c, env(fake_proc(tmp_path)))
    assert "system.slice/memory.swap.max max" in d.check_swap().details[0]
    assert d.check_kubelet_swap().verdict == PASS  # accounted: NoSwap sends 0
