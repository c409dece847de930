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


UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
SANDBOX = "aa" * 32


def _container(cg: Path, pod_dir: str, cid: str, mn: int | str, mx: int | str) -> None:
    d = cg / pod_dir / cid
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.min").write_text(f"{mn}\n")
    (d / "memory.max").write_text(f"{mx}\n")


def test_containers_under_the_cap_pass(tmp_path):
    cg = tmp_path / "cg"
    v2_tree(cg)
    _container(cg, f"kubepods/pod{UID}", SANDBOX, 0, "max")  # the sandbox
    _container(cg, f"kubepods/pod{UID}", "11" * 32, 241590272, 256 * MI)  # the rule's value (docs/memory-qos.md)
    _container(cg, f"kubepods/burstable/pod{UID}", "22" * 32, 100 * MI, 256 * MI)  # request well under it
    _container(cg, f"kubepods/burstable/pod{UID}", "33" * 32, 1024 * MI, "max")  # no limit: no cap
    # memory.max as the kernel keeps a limit of 1000001995 (a page lower): the shim's value from the limit
    _container(cg, f"kubepods/burstable/pod{UID}", "44" * 32, 900001792, 1000001536)
    [r] = named(run(tmp_path), "containers' memory.min")
    assert r.verdict == PASS and r.summary.startswith("3 container cgroups"), r.summary


def test_a_container_holding_memory_min_at_its_limit_is_a_warning_naming_it(tmp_path):
    cg = tmp_path / "cg"
    v2_tree(cg)
    _container(cg, f"kubepods/pod{UID}", "11" * 32, 256 * MI, 256 * MI)
    _container(cg, f"kubepods/pod{UID}", "22" * 32, 241590272, 256 * MI)
    [r] = named(run(tmp_path), "containers' memory.min")
    assert r.verdict == WARN and r.summary.startswith("1 of 2 container cgroups") and "OOM-killed" in r.summary
    assert r.details[0] == (f"pod {UID} container 1111111111111: memory.min 268435456 (256Mi) of memory.max "
                            "268435456 (256Mi); the rule caps it at 241590272 (headroom 26843546)")
    assert any("recreate these containers" in d for d in r.details)
    assert not any("correct-kubelet-min" in d for d in r.details)


def test_the_cap_follows_the_headroom_settings(tmp_path):
    cg = tmp_path / "cg"
    v2_tree(cg)
    _container(cg, f"kubepods/burstable/pod{UID}", "11" * 32, 1008 * MI, 1024 * MI)  # 16Mi under its limit
    [warn] = named(run(tmp_path), "containers' memory.min")
    [ok] = named(run(tmp_path, protection_headroom_ratio="0.01"), "containers' memory.min")
    assert (warn.verdict, ok.verdict) == (WARN, PASS)
    assert "the rule caps it at 966365184 (headroom 107374183)" in warn.details[0]


def test_systemd_pods_are_named_by_uid_and_container_id(tmp_path):
    cg = tmp_path / "cg"
    v2_tree(cg, driver="systemd")
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    _container(cg, pod, f"cri-containerd-{'ab' * 32}.scope", 512 * MI, 512 * MI)
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: systemd\n")
    c = cfg(cgroup_root=str(cg), meminfo=str(tmp_path / "meminfo"), kubelet_config=str(tmp_path / "kubelet.yaml"),
            kubelet_version="1.37")
    [r] = named(Doctor(c, env(fake_proc(tmp_path))).check_protection(), "containers' memory.min")
    assert r.verdict == WARN and r.details[0].startswith(f"pod {UID} container ababababababa: memory.min 536870912")


def test_the_list_is_bounded(tmp_path):
    from shim.tools.doctor.protection import MAX_LISTED

    cg = tmp_path / "cg"
    v2_tree(cg)
    for i in range(MAX_LISTED + 3):
        _container(cg, f"kubepods/pod{UID[:-4]}{i:04d}", f"{i:064x}", 64 * MI, 64 * MI)
    [r] = named(run(tmp_path), "containers' memory.min")
    assert r.verdict == WARN and r.summary.startswith(f"{MAX_LISTED + 3} of {MAX_LISTED + 3} ")
    assert sum(d.startswith("pod ") for d in r.details) == MAX_LISTED and "and 3 more" in r.details


@pytest.mark.parametrize("correct, says", [(False, "set correct-kubelet-min: true"),
                                           (True, "correct-kubelet-min is on")])
def test_where_the_kubelet_owns_memory_min_the_setting_is_named_for_what_it_does(tmp_path, correct, says):
    cg = tmp_path / "cg"
    v2_tree(cg)
    _container(cg, f"kubepods/pod{UID}", "11" * 32, 256 * MI, 256 * MI)
    [r] = named(run(tmp_path, "memoryReservationPolicy: TieredReservation\n", correct_kubelet_min=correct),
                "containers' memory.min")
    assert r.verdict == WARN
    [todo] = [d for d in r.details if "correct-kubelet-min" in d]
    assert todo.startswith(says) and "a running container keeps its value" in todo


def test_a_node_without_containers_says_so(tmp_path):
    [r] = named(run(tmp_path), "containers' memory.min")
    assert r.verdict == PASS and r.summary == "no container cgroup with a memory.min and a memory.max under kubepods"
