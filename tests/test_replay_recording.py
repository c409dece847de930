"""`serve --record` end to end: kubelet traffic from a recorded trace goes through a real
Service (proxy, hooks, audit log, recorder) in front of the trace-driven runtime; replaying
the recording through `replay` reproduces the audit records the Service wrote."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from shim.evidence.recorder import HIGH_VOLUME_METHODS
from shim.evidence.trace import read_trace
from memqos_dev.testing.traces import kubelet_traces

ROOT = Path(__file__).resolve().parents[1]
KUBELET_TRACES = kubelet_traces()


def lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _serve_args(tmp_path, trace, sockets, extra=()):
    from shim.cli.main import build_parser

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "meminfo").write_text(f"MemTotal:       {trace.header.mem_total_bytes // 1024} kB\n")
    (tmp_path / "kubelet.yaml").write_text(json.dumps(trace.header.kubelet_config))
    return build_parser().parse_args([
        "serve",
        "--listen", f"unix://{sockets}/shim.sock",
        "--upstream", f"unix://{sockets}/rt.sock",
        "--kubelet-config", str(tmp_path / "kubelet.yaml"),
        "--meminfo", str(tmp_path / "meminfo"),
        "--cgroup-root", str(tmp_path / "cg"),
        "--page-size", "4096",
        "--audit-log", str(tmp_path / "audit.jsonl"),
        "--record", str(tmp_path / "rec" / "calls.jsonl"),
        *extra,
    ])


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("time", "seq")}


@pytest.mark.parametrize("path", KUBELET_TRACES, ids=lambda p: p.name)
def test_recording_through_the_shim_then_replaying_it_gives_the_same_audit_records(tmp_path, path):
    from shim.app.config import OPTIONS, resolve
    from shim.tools.replay import drive, replay, replay_settings
    from shim.app.service import Service
    from shim.tools.trace_runtime import TraceRuntime

    kubelet = read_trace(str(path))
    sockets = tempfile.mkdtemp(prefix="mq-")  # short: unix socket paths are limited to 107 bytes
    # The reconciler (pod/QoS cgroups) asks the runtime for its state directly, not through the
    # proxy; against a trace-driven runtime its calls would use up recorded answers.
    extra = ["--reconcile", "false"] if any(o.name == "reconcile" for o in OPTIONS) else []
    cfg = resolve(_serve_args(tmp_path, kubelet, sockets, extra))

    async def run():
        runtime = TraceRuntime(kubelet.calls)
        await runtime.start(f"{sockets}/rt.sock")
        service = Service.from_config(cfg)
        try:
            await service.start()
            # like the kubelet: no replay metadata, so the runtime matches by bytes / normalized
            outcomes = await drive(f"unix://{sockets}/shim.sock", kubelet.in_start_order(), tag_seq=False)
        finally:
            await service.stop()
            await runtime.stop(None)
            shutil.rmtree(sockets, ignore_errors=True)
        return runtime, outcomes

    runtime, outcomes = asyncio.run(run())
    assert [o.problem() for o in outcomes if o.problem()] == []
    assert runtime.misses == [] and runtime.mismatches == []

    served = [r for r in lines(tmp_path / "audit.jsonl") if r.get("method")]
    assert len(served) == sum(c.name == "CreateContainer" for c in kubelet.calls) == 8

    recording = read_trace(str(tmp_path / "rec" / "calls.jsonl"))
    assert recording.header.shim["policy"] == "Hard"
    assert recording.header.mem_total_bytes == kubelet.header.mem_total_bytes
    names = {c.name for c in recording.calls}
    assert not names & HIGH_VOLUME_METHODS and {"CreateContainer", "RunPodSandbox", "StartContainer"} <= names
    creates = [c for c in recording.calls if c.name == "CreateContainer"]
    assert all(c.forwarded is not None and c.forwarded != c.request for c in creates)
    # the recording keeps the request as the kubelet sent it, byte for byte
    assert sorted(c.request for c in creates) == sorted(c.request for c in kubelet.calls
                                                        if c.name == "CreateContainer")

    again = replay(recording, replay_settings(recording.header))
    assert again.problems == [] and again.notes == []  # forwarded bytes identical to the recording's
    assert [_comparable(r) for r in again.records] == [_comparable(r) for r in served]
