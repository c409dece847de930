"""`memqos-shim demo` end to end: real processes (the demo's stand-in runtime, memqos-shim serve)
on real unix sockets, driven by a kubelet-shaped client."""
import json

from shim.tools import demo


def test_demo_rewrites_every_pod(tmp_path, capsys):
    assert demo.run(tmp_path / "demo") == 0
    records = [json.loads(line) for line in (tmp_path / "demo" / "audit.jsonl").read_text().splitlines()]
    decisions = {(r["pod"].split("/")[1], r["container"], r["method"]): r for r in records
                 if r.get("method") in ("CreateContainer", "UpdateContainerResources")}
    assert len(decisions) == 9
    web = decisions[("web", "app", "CreateContainer")]
    assert web["qos"] == "Guaranteed" and web["unified_after"] == {"memory.min": "241590272", "memory.low": str(256 * 2**20)}
    newer = decisions[("newer-kubelet", "app", "CreateContainer")]
    assert newer["unified_after"]["memory.oom.group"] == "1" and newer["unified_after"]["memory.high"] != "max"
    resize = decisions[("api", "app", "UpdateContainerResources")]
    assert resize["limit"] == 2**30 and resize["request_source"] == "oom-score-adj"
    assert all(r.get("code") == "OK" for r in decisions.values())
    out = capsys.readouterr().out
    assert "CreateContainer" in out
    # sizes in Mi/Gi beside the bytes, in the table and in the pod / QoS / node values the
    # reconciler wrote (it learns the cgroup parents from the stand-in runtime's listings)
    assert "{} -> {memory.low=256Mi (268435456), memory.min=230.4Mi (241590272)}" in out
    assert "memory.oom.group=1}" in out
    assert f"/kubepods/pod{demo.PODS[0][1]}  memory.min=256Mi (268435456)" in out


def test_sizes_name_mi_or_gi_beside_the_bytes():
    assert demo.size(0) == "0"
    assert demo.size(256 * 2**20) == "256Mi (268435456)"
    assert demo.size(3 * 2**29) == "1.5Gi (1610612736)"
    assert demo.size(128849019) == "122.9Mi (128849019)"
    assert demo._fmt_unified({"memory.high": "max", "memory.oom.group": "1", "memory.min": "8388608"}) == \
        "{memory.high=max, memory.min=8Mi (8388608), memory.oom.group=1}"
