"""The protection benchmark's class and swap scenarios, host side (e2e/pressure_model.py,
e2e/pressure_outcome.py, e2e/guest_pressure.py's scenario list): the class value sets come from the
shim's class code (shim.app.config_classes, shim.decision.classes, decide), and the outcome checks
the VM suite makes of them. The runs themselves are in the VM (scripts/e2e-vm --scenario pressure)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from shim.decision.classes import ContainerClass, ContainerSettings, apply_class, with_swap
from shim.decision.facts import ContainerFacts, Policy, PodFacts
from shim.decision.memory import decide

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import guest_pressure as GP  # noqa: E402
import pressure_model as M  # noqa: E402
import pressure_outcome as O  # noqa: E402

MI = M.MI
NODE = M.node_facts(1400 * MI, 640 * MI)
HOLDER = M.Pod("guaranteed", "d0000001", (M.Box("app", 128 * MI, 128 * MI, ("loop", 64, 2, 24, 0)),))
GROWER = M.Pod("aggressor", "d1000001", (M.Box("app", 32 * MI, 256 * MI, ("hog", 288, 0)),), "aggressor")
PODS = [HOLDER, GROWER]


def decided(pod: M.Pod, cls: ContainerClass | None) -> dict:
    box = pod.boxes[0]
    path = f"{pod.path}/{box.name}"
    sent = M.kubelet_values(PODS, NODE.allocatable)
    s = apply_class(cls, ContainerSettings(cls=None, node=NODE, policy=M.SHIM_DEFAULT))
    d = with_swap(decide(PodFacts(uid=pod.uid, name=pod.name, namespace="default",
                                  cgroup_parent="/" + pod.path.rsplit("/", 1)[0]),
                         ContainerFacts(name=box.name, limit=box.limit,
                                        oom_score_adj=M.oom_score_adj(pod, box, NODE.capacity),
                                        unified=dict(sent.files.get(path, {}))), s.node, s.policy), s)
    return {k: v for k, v in d.unified_after.items() if k in M.SHIM_KEYS}


def written(lay: M.Layout, pod: M.Pod) -> dict:
    return {k: v for k, v in lay.files.get(f"{pod.path}/app", {}).items() if k in M.SHIM_KEYS}


def test_the_classes_are_read_by_the_shims_parser():
    table = M.classes()
    assert set(table) == set(M.CLASSES_CONFIG)
    assert table["latency-critical"].factor_set and table["latency-critical"].factor is None
    assert table["swap"].swap


@pytest.mark.parametrize("cls", sorted(M.CLASSES_CONFIG))
def test_class_values_are_the_class_codes(cls):
    """The classed pod's values are decide()'s under apply_class's settings; the other pod keeps
    the node's (the default class), and the sums are the default class's."""
    lay = M.values(M.CLASS_PREFIX + cls, PODS, NODE, ("aggressor",))
    shim = M.values("shim", PODS, NODE)
    assert written(lay, GROWER) == decided(GROWER, M.classes()[cls])
    assert written(lay, HOLDER) == written(shim, HOLDER) == decided(HOLDER, None)
    assert lay.get("kubepods", "memory.min") == shim.get("kubepods", "memory.min")
    everyone = M.values(M.CLASS_PREFIX + cls, PODS, NODE, ("*",))
    assert written(everyone, HOLDER) == decided(HOLDER, M.classes()[cls])


def test_no_throttling_class_drops_memory_high_only():
    lay = M.values(M.CLASS_PREFIX + "latency-critical", PODS, NODE, ("aggressor",))
    shim = M.values("shim", PODS, NODE)
    assert shim.get(f"{GROWER.path}/app", "memory.high")  # the default class throttles it
    assert lay.get(f"{GROWER.path}/app", "memory.high") == ""
    assert lay.get(f"{GROWER.path}/app", "memory.min") == shim.get(f"{GROWER.path}/app", "memory.min")


def test_swap_class_opens_swap_where_the_kubelet_sent_none():
    """The swap scenarios' kubelet leaves memory.swap.max to the runtime: the swap class writes max
    (what the runtime's default is), the default class nothing."""
    lay = M.values(M.CLASS_PREFIX + "swap", PODS, NODE, ("aggressor",))
    assert lay.get(f"{GROWER.path}/app", "memory.swap.max") == "max"
    assert lay.get(f"{HOLDER.path}/app", "memory.swap.max") == ""
    assert M.values("shim", PODS, NODE).get(f"{GROWER.path}/app", "memory.swap.max") == ""


def test_unknown_class_and_policy_changing_class_are_refused():
    with pytest.raises(ValueError):
        M.values(M.CLASS_PREFIX + "nope", PODS, NODE, ("aggressor",))
    with pytest.raises(ValueError):
        M.shim_values(PODS, NODE, Policy.HARD, {"aggressor": ContainerClass("soft", policy=Policy.SOFT)})


def test_scenarios_run_swap_after_the_swapless_ones():
    for mode in ("quick", "full"):
        specs = GP.scenarios(mode)
        swap = [i for i, s in enumerate(specs) if s.get("swap")]
        assert swap and swap == list(range(swap[0], len(specs)))  # the swap ones last: swapon once
        names = {s["name"]: s for s in specs}
        assert {"class-nothrottle", "class-swap", "node-pressure-swap"} <= set(names)
        assert not names["class-nothrottle"].get("swap")  # (a) is the swapless host of the report
        for s in specs:
            for set_name in s.get("sets", ()):
                M.values(set_name, s["pods"], M.node_facts(1400 * MI, s["allocatable"]), s.get("classed", ()))


def pod(**kw):
    base = {"qos": "Burstable", "role": "holder", "oom_kill": 0, "high_events": 0, "refault_file": 0,
            "refault_anon": 0, "peak": 100 * MI, "swap_peak": 0, "stall_s": 0.0, "exits": {"app": None},
            "anon_before": 96 * MI, "anon_end": 96 * MI}
    base.update(kw)
    return base


def run(scenario, set_name, **pods):
    return {"scenario": scenario, "set": set_name, "duration_s": 20.0, "pressure_t": 1.0,
            "values": "kubepods min 160 low -; aggressor 32/- [app 32/-/348.797]", "pods": pods}


def test_class_checks():
    none = run("class-nothrottle", "none", aggressor=pod(oom_kill=1, exits={"app": -9}))
    shim = run("class-nothrottle", "shim", aggressor=pod(high_events=5000, stall_s=14.2))
    cls = run("class-nothrottle", "class:latency-critical", aggressor=pod(oom_kill=1, exits={"app": -9}))
    assert O.throttled(shim, "aggressor")[0] and not O.throttled(cls, "aggressor")[0]
    assert O.not_throttled(cls, "aggressor")[0] and not O.not_throttled(shim, "aggressor")[0]
    assert O.same_oom(none, cls, "aggressor")[0]
    ok, exp, act = O.same_oom(none, shim, "aggressor")
    assert not ok and exp == "OOM-killed (as without QoS)" and act == "not OOM-killed"
    swapper = run("class-swap", "class:swap", aggressor=pod(swap_peak=40 * MI),
                  guaranteed=pod(anon_end=90 * MI), burstable=pod(anon_end=80 * MI))
    assert O.kept_running(swapper, "aggressor")[0]
    assert not O.kept_running(run("s", "x", aggressor=pod(swap_peak=0)), "aggressor")[0]  # no swap used
    assert not O.kept_running(run("s", "x", aggressor=pod(swap_peak=MI, exits={"app": 0})), "aggressor")[0]
    assert not O.kept_running(run("s", "x", aggressor=pod(swap_peak=MI, oom_kill=1)), "aggressor")[0]
    assert O.anon_resident(swapper, "guaranteed", 0.9)[0]
    ok, exp, act = O.anon_resident(swapper, "burstable", 0.9)
    assert not ok and act == "80 MiB"
    assert not O.anon_resident(run("s", "x", g=pod(anon_before=0)), "g", 0.9)[0]
    base = run("node-pressure-swap", "none", g=pod(refault_file=1000, refault_anon=300))
    assert O.refaults_cut(base, run("n", "shim", g=pod(refault_file=100, refault_anon=30)), "g", kind="anon")[0]
    assert not O.refaults_cut(base, run("n", "shim", g=pod(refault_file=100, refault_anon=31)), "g", kind="anon")[0]


def psi_sample(t, full, anon, refault_anon=0):
    return {"t": t, "pods": {"a": {"current": anon, "swap": 0, "psi": {"some": full, "full": full},
                                   "stat": {"anon": anon, "workingset_refault_anon": refault_anon}}}}


def test_stall_and_stat_series():
    samples = [psi_sample(0.0, 0, 10), psi_sample(1.0, 500_000, 20), psi_sample(2.0, 2_600_000, 30, 7)]
    assert O.stall_s(samples, "a", since=1.0) == 2.1
    assert O.stall_s(samples, "a") == 2.6 and O.stall_s([], "a") == 0.0
    assert O.stat_at(samples, "a", "anon", 1.0) == 20 and O.stat_at(samples, "a", "anon") == 30
    assert O.delta(samples, "a", "workingset_refault_anon", 1.0) == 7
    assert O.grown("hog: done 416 MiB 4.1 s 17.0") and O.grown("pressure: files 0 x 0 MiB 17.0")
    assert not O.grown("hog: 12 MiB 0.2 s 17.0\npressure: anon 360 MiB 17.0")


def test_class_table_and_render(tmp_path):
    runs = [run("node-pressure", "none", g=pod()),
            run("class-nothrottle", "shim", aggressor=pod(high_events=5000, stall_s=14.2, at_high_s=12.0)),
            run("class-swap", "class:swap", aggressor=pod(swap_peak=40 * MI, refault_anon=12))]
    assert [O.is_class(r) for r in runs] == [False, True, True]
    assert O.is_class(run("node-pressure-swap", "none"))
    text = O.class_table(runs[1:])
    lines = text.splitlines()
    assert len(lines) == 4 and len({line.count("|") for line in lines}) == 1
    assert "aggressor held at memory.high 12 s" in lines[2] and "| 5000 | 14.2 |" in lines[2]
    assert "| 32/- [app 32/-/348.797] |" in lines[2]
    assert "| 40 |" in lines[3] and "| 0 | 12 | 96/96 |" in lines[3]
    (tmp_path / "logs").mkdir()
    (tmp_path / "report.json").write_text(json.dumps({"pressure": {"runs": runs}}))
    pytest.importorskip("matplotlib")
    out = O.render(str(tmp_path), str(tmp_path / "png"))
    first, second = out.split("\n\n")
    assert first.splitlines()[2].startswith("| node-pressure | none |")
    assert second == text
    assert sorted(os.listdir(tmp_path / "png")) == ["protection-class-nothrottle.png", "protection-class-swap.png",
                                                    "protection-node-pressure.png"]
