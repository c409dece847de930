"""scripts/demo's engine end to end: real processes (fake runtime, memqos-shim serve) on
real unix sockets, driven by a kubelet-shaped client."""
import json

from shim.tools import demo


def test_demo_rewrites_every_pod(tmp_path, capsys):
    assert demo.run(tmp_path / "demo") == 0
    records = [json.loads(line) for line in (tmp_path / "demo" / "audit.jsonl").read_text().splitlines()]
    decisions = {(r["pod"].split("/")[1], r["container"], r["method"]): r for r in records
                 if r.get("method") in ("CreateContainer", "UpdateContainerResources")}
    assert len(decisions) == 9
    web = decisions[("web", "app", "CreateContainer")]
    assert web["qos"] == "Guaranteed" and web["unified_after"] == {"memory.min": str(256 * 2**20)}
    newer = decisions[("newer-kubelet", "app", "CreateContainer")]
    assert newer["unified_after"]["memory.oom.group"] == "1" and newer["unified_after"]["memory.high"] != "max"
    resize = decisions[("api", "app", "UpdateContainerResources")]
    assert resize["limit"] == 2**30 and resize["request_source"] == "oom-score-adj"
    assert all(r.get("code") == "OK" for r in decisions.values())
    assert "CreateContainer" in capsys.readouterr().out
