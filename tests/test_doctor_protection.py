"""`memqos-shim doctor`'s protection checks on fake nodes: the kubelet's own container
memory.min, the headroom kubepods and the QoS cgroups leave under their memory.max, and
memory_recursiveprot (docs/memory-qos.md, "Protection that never OOM-kills")."""
from __future__ import annotations

from pathlib import Path

import pytest

from shim.tools.doctor import PASS, WARN, Doctor
from tests.test_doctor import cfg, env, fake_proc, v2_tree

MI = 2**20


def run(tmp_path: Path, kubelet: str = "", mounts: str = "", **over) -> list:
    if not (tmp_path / "cg").exists():
        v2_tree(tmp_path / "cg")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\n" + kubelet)
    c = cfg(cgroup_root=str(tmp_path / "cg"), meminfo=str(tmp_path / "meminfo"),
            kubelet_config=str(tmp_path / "kubelet.yaml"), kubelet_version="1.37", **over)
    return Doctor(c, env(fake_proc(tmp_path, mounts=mounts))).check_protection()


def named(results, name: str) -> list:
    return [r for r in results if r.name == name]


def test_the_shims_container_memory_min_passes(tmp_path):
    [r] = named(run(tmp_path), "container memory.min")
    assert r.verdict == PASS and "the shim's" in r.summary and "ceil(limit x 0.1)" in r.summary


def test_a_kubelet_that_writes_container_memory_min_is_a_warning_naming_the_setting(tmp_path):
    [r] = named(run(tmp_path, "memoryReservationPolicy: TieredReservation\n"), "container memory.min")
    assert r.verdict == WARN and "OOM-killed" in r.summary and "memory.min = its request" in r.summary
    assert any("correct-kubelet-min: true" in d for d in r.details)
    [ok] = named(run(tmp_path, "memoryReservationPolicy: TieredReservation\n", correct_kubelet_min=True),
                 "container memory.min")
    assert ok.verdict == PASS and "correct-kubelet-min" in ok.summary


def _pods(cg: Path, parent: str, mins: list[int], limit: int | str) -> None:
    (cg / parent / "memory.max").write_text(f"{limit}\n")
    for i, m in enumerate(mins):
        d = cg / parent / f"pod{i:04d}"
        d.mkdir()
        (d / "memory.min").write_text(f"{m}\n")


@pytest.mark.parametrize("mins,verdict", [([512 * MI, 256 * MI], PASS), ([768 * MI, 252 * MI], WARN),
                                          ([1024 * MI], WARN)])
def test_kubepods_headroom_under_its_memory_max(tmp_path, mins, verdict):
    v2_tree(tmp_path / "cg")
    _pods(tmp_path / "cg", "kubepods", mins, 1024 * MI)
    [r] = named(run(tmp_path), "protection headroom")
    assert r.verdict == verdict and r.summary.startswith("kubepods:")
    assert f"memory.max {1024}Mi" in r.summary or "memory.max 1Gi" in r.summary


def test_a_qos_cgroup_with_a_memory_max_is_checked_one_without_is_not(tmp_path):
    v2_tree(tmp_path / "cg")
    cg = tmp_path / "cg"
    (cg / "kubepods" / "memory.max").write_text("max\n")
    _pods(cg, "kubepods/burstable", [300 * MI], 304 * MI)
    [r] = named(run(tmp_path), "protection headroom")
    assert r.verdict == WARN and r.summary.startswith("kubepods/burstable:")


@pytest.mark.parametrize("options,word", [("rw,nsdelegate,memory_recursiveprot", "with"), ("rw,nsdelegate", "without")])
def test_memory_recursiveprot_is_reported(tmp_path, options, word):
    v2_tree(tmp_path / "cg")
    mounts = f"30 23 0:27 / {tmp_path / 'cg'} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 {options}\n"
    [r] = named(run(tmp_path, mounts=mounts), "memory_recursiveprot")
    assert r.verdict == PASS and f"mounted {word} memory_recursiveprot" in r.summary
