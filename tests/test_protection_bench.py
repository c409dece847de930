"""The protection benchmark's pure parts (e2e/pressure_model.py, e2e/pressure_outcome.py): the value
sets written into kubelet-laid cgroups (the shim's from its own decision code), and the outcome
checks, table and plot over recorded samples. The benchmark itself runs in the VM
(scripts/e2e-vm --scenario pressure, scripts/protection-bench)."""
from __future__ import annotations

import os
import struct
import sys

import pytest

from shim.decision.facts import ContainerFacts, Policy, PodFacts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import pressure_model as M  # noqa: E402
import pressure_outcome as O  # noqa: E402
from shim.decision.memory import decide  # noqa: E402

MI = M.MI
NODE = M.node_facts(1400 * MI, 640 * MI)
G = M.Pod("guaranteed", "a0000001", (M.Box("app", 256 * MI, 256 * MI, ("write", 150, 10, 30, 3)),), "writer")
B = M.Pod("burstable", "a0000002", (M.Box("app", 240 * MI, 256 * MI, ("write", 150, 10, 30, 3)),), "writer")
E = M.Pod("besteffort", "a0000003", (M.Box("app", 0, 0, ("loop", 64, 2, 24, 0)),))


def test_layout_is_the_kubelets():
    assert (G.qos.value, B.qos.value, E.qos.value) == ("Guaranteed", "Burstable", "BestEffort")
    assert (G.path, B.path, E.path) == ("kubepods/poda0000001", "kubepods/burstable/poda0000002",
                                        "kubepods/besteffort/poda0000003")
    lim = M.limits([G, B, E], 640 * MI)
    assert lim.get("kubepods", "memory.max") == str(640 * MI)
    assert lim.get(G.path, "memory.max") == lim.get(G.path + "/app", "memory.max") == str(256 * MI)
    assert lim.get(E.path, "memory.max") == "max" and lim.get(G.path + "/pause", "memory.max") == "max"
    assert M.oom_score_adj(G, G.boxes[0], NODE.capacity) == -997
    assert M.oom_score_adj(E, E.boxes[0], NODE.capacity) == 1000
    assert M.oom_score_adj(B, B.boxes[0], NODE.capacity) == 1000 - (1000 * 240 * MI) // (1400 * MI)


def test_kubelet_values_follow_kep_2570():
    lay = M.kubelet_values([G, B, E], 640 * MI)
    assert lay.get(G.path + "/app", "memory.min") == lay.get(G.path, "memory.min") == str(256 * MI)
    assert lay.get(G.path + "/app", "memory.high") == ""  # none for Guaranteed
    # 240Mi + 0.9 * 16Mi, rounded down to a page
    assert lay.get(B.path + "/app", "memory.high") == str((240 * MI + int(0.9 * 16 * MI)) // 4096 * 4096)
    assert lay.get(E.path + "/app", "memory.high") == str(int(0.9 * 640 * MI) // 4096 * 4096)
    assert lay.get("kubepods/burstable", "memory.min") == str(240 * MI)
    assert lay.get("kubepods", "memory.min") == str(496 * MI)
    assert M.values("none", [G], NODE).files == {}


@pytest.mark.parametrize("policy", list(Policy))
def test_shim_values_are_the_decision_codes(policy):
    """The container values are decide()'s for the container as a gate-on kubelet sends it: the
    benchmark follows whatever the rule is."""
    name = "shim" if policy is M.SHIM_DEFAULT else f"shim-{policy.value}"
    lay = M.values(name, [G, B, E], NODE)
    sent = M.kubelet_values([G, B, E], NODE.allocatable)
    for pod in (G, B, E):
        box = pod.boxes[0]
        path = f"{pod.path}/{box.name}"
        d = decide(PodFacts(uid=pod.uid, name=pod.name, namespace="default",
                            cgroup_parent="/" + pod.path.rsplit("/", 1)[0]),
                   ContainerFacts(name=box.name, limit=box.limit, oom_score_adj=M.oom_score_adj(pod, box, NODE.capacity),
                                  unified=dict(sent.files.get(path, {}))), NODE, policy)
        for key in ("memory.min", "memory.low", "memory.high"):
            assert lay.get(path, key, None) == d.unified_after.get(key), (policy, path, key)
    if policy is Policy.HARD:
        assert lay.get(G.path, "memory.min") == str(256 * MI)
        assert lay.get("kubepods", "memory.min") == str(496 * MI)
    if policy is Policy.NONE:
        assert lay.get(G.path, "memory.min") == lay.get("kubepods", "memory.min") == "0"


def sample(t, **pods):
    return {"t": t, "pods": {name: {"current": v[0], "min": 0, "low": 0, "high": "max",
                                    "events": {"oom_kill": v[3] if len(v) > 3 else 0},
                                    "stat": {"file": v[1], "workingset_refault_file": v[2]}}
                             for name, v in pods.items()}}


SAMPLES = [
    sample(0.0, be=(100 * MI, 48 * MI, 0), bu=(100 * MI, 48 * MI, 0)),
    sample(1.0, be=(100 * MI, 48 * MI, 0), bu=(100 * MI, 48 * MI, 0)),
    sample(2.0, be=(80 * MI, 20 * MI, 500), bu=(100 * MI, 47 * MI, 10)),
    sample(3.0, be=(70 * MI, 10 * MI, 900), bu=(90 * MI, 30 * MI, 40)),
]


def test_parsers_and_counters():
    assert O.parse_stat("anon 10\nfile 20\nworkingset_refault_file 3\nshmem 9\n") == {
        "anon": 10, "file": 20, "workingset_refault_file": 3}
    assert O.parse_passes("pressure: anon 8 MiB 1.0\npressure: pass 1 118.146 ms 1700.5\npressure: done 1\n") == [
        (1700.5, 118.146)]
    assert O.percentile([], 50) is None
    assert O.percentile([3.0, 1.0, 2.0, 10.0], 50) == 2.0 and O.percentile([3.0, 1.0, 2.0, 10.0], 99) == 10.0
    assert O.delta(SAMPLES, "be", "workingset_refault_file", since=1.0) == 900
    assert O.peak(SAMPLES, "bu") == 100 * MI


def test_reclaim_order():
    assert O.reclaimed_at(SAMPLES, "be", 1.0) == 2.0
    assert O.reclaimed_at(SAMPLES, "bu", 1.0) == 3.0
    assert O.reclaimed_first(SAMPLES, "be", "bu", 1.0)[0]
    ok, _, actual = O.reclaimed_first(SAMPLES, "bu", "be", 1.0)
    assert not ok and "bu 2.0 s, be 1.0 s" == actual
    untouched = [sample(t, be=(1, 48 * MI, 0), bu=(1, 48 * MI, 0)) for t in (0.0, 1.0, 2.0)]
    assert not O.reclaimed_first(untouched, "be", "bu", 1.0)[0]  # no reclaim at all: not shown


def run(set_name, **pods):
    return {"scenario": "s", "set": set_name, "duration_s": 5.0, "pods": {
        name: {"qos": "Guaranteed", "role": "writer", "completed": not kills, "oom_kill": kills,
               "refault_file": refaults, "peak": 200 * MI, "min": 256 * MI, "p50_ms": 12.0, "p99_ms": 80.5}
        for name, (kills, refaults) in pods.items()}}


def test_outcome_checks():
    base = run("none", g=(0, 1000), b=(0, 800))
    assert O.no_new_oom(base, run("shim", g=(0, 5), b=(0, 80)))[0]
    ok, _, actual = O.no_new_oom(base, run("shim", g=(1, 5), b=(0, 80)))
    assert not ok and "new: ['g']" in actual
    assert O.no_new_oom(run("none", g=(1, 0)), run("shim", g=(1, 0)))[0]  # the baseline lost it too
    assert O.refaults_cut(base, run("shim", g=(0, 100), b=(0, 80)), "g")[0]
    assert not O.refaults_cut(base, run("shim", g=(0, 101), b=(0, 81)), "b")[0]


def test_table_has_a_row_per_pod_and_the_outcome():
    shim = dict(run("shim", g=(1, 5), b=(0, 80)), values="kubepods min 256 low -; g 256/- [app 230.398/256/-]")
    text = O.table([run("none", g=(0, 1000), b=(0, 800)), shim])
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| s | none | completed | 5.0 | g |") and "| 256/-/- |" in lines[2]
    assert "g OOM-killed (1)" in lines[4] and "| 256/- [app 230.398/256/-] |" in lines[4] and "| 12/80 |" in lines[4]
    assert len({line.count("|") for line in lines}) == 1


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    r1 = run("none", be=(0, 900), bu=(0, 40))
    r2 = dict(run("shim", be=(1, 900), bu=(0, 40)), pressure_t=1.0)
    kill = SAMPLES[:3] + [sample(3.0, be=(0, 0, 900, 1), bu=(90 * MI, 30 * MI, 40))]
    out = tmp_path / "s.png"
    O.plot("s", [(r1, SAMPLES), (r2, kill)], str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert w >= 600 and h >= 500 and len(data) > 20_000


def test_time_held_at_memory_high():
    held = [{"t": t, "pods": {"a": {"box_high": 100 * MI, "box_current": c}}}
            for t, c in ((0.0, 50 * MI), (0.2, 99.5 * MI), (0.4, 100 * MI), (0.6, 101 * MI))]
    assert O.at_high(held, "a", 0.2) == 0.6
    assert O.at_high([{"t": 0.0, "pods": {"a": {"current": 5}}}], "a", 0.2) == 0.0  # no memory.high
    r = run("kubelet", a=(0, 0))
    r["pods"]["a"]["at_high_s"] = 12.4
    r["pods"]["a"]["role"] = "aggressor"
    assert O.outcome(r) == "no OOM kill; a held at memory.high 12.4 s"
    r["pods"]["a"]["role"] = "writer"
    assert O.outcome(r) == "completed; a held at memory.high 12.4 s"


def test_render_reads_the_report_and_the_samples(tmp_path):
    """scripts/protection-bench's host side: the table of the report's runs, a PNG per scenario;
    a run cut short (no report.json yet) is rendered from the guest's report."""
    pytest.importorskip("matplotlib")
    import json

    (tmp_path / "logs").mkdir()
    runs = [run("none", be=(0, 900)), run("shim", be=(0, 10))]
    (tmp_path / "report-guest.json").write_text(json.dumps({"pressure": {"runs": runs}}))
    for r in runs:
        with open(tmp_path / "logs" / f"pressure-s-{r['set']}.jsonl", "w") as f:
            for s in SAMPLES:
                f.write(json.dumps(s) + "\n")
    text = O.render(str(tmp_path), str(tmp_path / "png"))
    assert text == O.table(runs)
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["protection-s.png"]
