"""The deciding settings (shim.app.decides) from a real `serve --record` to `replay --expect`.

A real Service (relay, hooks, audit log, recorder) runs with each deciding setting off its
default -- one at a time, then all together -- in front of the trace-driven runtime answering
a recorded kubelet's calls; the kubelet's requests go through it. Its recording then replays
through `memqos-shim replay --expect <that run's audit log>`: the same records, `unified`
values byte for byte, every setting taken from the recording's header. Without the header's
settings the same replay differs, so the test fails when the header or replay lose one.

The config file of a replay (`--config`): a setting it uses wins over the header; a setting it
does not use is named in a note, never dropped silently."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile

import pytest
import yaml

from shim.cli.main import main
from shim.app.decides import DECIDING, json_form
from shim.evidence.recorder import MethodFilter
from shim.evidence.trace import read_trace, write_trace
from memqos_dev.testing.traces import MEMQOS_ON, trace_file

# every deciding setting, off its default, as a config file writes it
OFF_DEFAULT = {
    "mode": "observe",
    "kubelet-version": "1.37",
    "node-allocatable": "1Gi",
    "factor": 0.5,
    "policy": "TieredReservation",
    "protection-headroom-ratio": 0.25,
    "protection-headroom-min": "32Mi",
    "correct-kubelet-min": True,
    "page-size": 65536,
}
# a kubelet that owns memory.min (v1.36+ with the gate on and a memoryReservationPolicy): the one
# where correct-kubelet-min has something to correct
OWNS_MIN = {"memoryReservationPolicy": "TieredReservation"}
# (settings, the kubelet's config keys, the run whose values these must differ from)
RUNS = {name: ({name: value}, None, "defaults") for name, value in OFF_DEFAULT.items()}
# alone, correct-kubelet-min changes nothing beside this kubelet (no memory.min of its own to correct)
RUNS["correct-kubelet-min"] = ({"correct-kubelet-min": True}, None, None)
RUNS["correct-kubelet-min, kubelet owns memory.min"] = (
    {"kubelet-version": "1.37", "correct-kubelet-min": True}, OWNS_MIN, "kubelet 1.37 owns memory.min")
RUNS["all"] = (dict(OFF_DEFAULT), OWNS_MIN, "defaults")
BASELINES = {"defaults": ({}, None), "kubelet 1.37 owns memory.min": ({"kubelet-version": "1.37"}, OWNS_MIN)}


def test_every_deciding_setting_has_a_value_off_its_default_here():
    """A setting newly marked decides=True gets a run of its own below once it has a value here."""
    assert list(OFF_DEFAULT) == [o.name for o in DECIDING]
    for o in DECIDING:
        assert o.parse(OFF_DEFAULT[o.name]) != o.default, o.name


def _lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _record(tmp_path, settings: dict, kubelet_config: dict | None = None) -> tuple[str, str]:
    """`serve --config` with ``settings``, the kubelet's calls through it; (recording, audit log).
    ``kubelet_config``: keys set in the recorded kubelet's KubeletConfiguration."""
    from shim.cli.main import build_parser
    from shim.app.config import resolve
    from shim.app.service import Service
    from shim.tools.replay import drive
    from shim.tools.trace_runtime import TraceRuntime

    kubelet = read_trace(str(trace_file(MEMQOS_ON)))
    keep = MethodFilter(None)  # the lifecycle calls: the records depend only on them
    calls = [c for c in kubelet.calls if keep(c.method)]
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "meminfo").write_text(f"MemTotal:       {kubelet.header.mem_total_bytes // 1024} kB\n")
    (tmp_path / "kubelet.yaml").write_text(json.dumps({**kubelet.header.kubelet_config, **(kubelet_config or {})}))
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(settings))
    sockets = tempfile.mkdtemp(prefix="mq-")  # short: unix socket paths are limited to 107 bytes
    args = build_parser().parse_args([
        "serve", "--config", str(tmp_path / "serve.yaml"),
        "--listen", f"unix://{sockets}/shim.sock", "--upstream", f"unix://{sockets}/rt.sock",
        "--kubelet-config", str(tmp_path / "kubelet.yaml"), "--meminfo", str(tmp_path / "meminfo"),
        "--cgroup-root", str(tmp_path / "cg"), "--audit-log", str(tmp_path / "audit.jsonl"),
        "--record", str(tmp_path / "rec.jsonl"),
        # the reconciler asks the runtime directly: it would use up the recorded answers
        "--reconcile", "false", "--monitor-interval", "0",
    ])
    cfg = resolve(args)

    async def run():
        runtime = TraceRuntime(calls)
        await runtime.start(f"{sockets}/rt.sock")
        service = Service.from_config(cfg)
        try:
            await service.start()
            # like the kubelet: no replay metadata
            outcomes = await drive(f"unix://{sockets}/shim.sock", sorted(calls, key=lambda c: (c.start, c.seq)),
                                   tag_seq=False)
        finally:
            await service.stop()
            await runtime.stop(None)
            shutil.rmtree(sockets, ignore_errors=True)
        return runtime, outcomes

    runtime, outcomes = asyncio.run(run())
    assert [o.problem() for o in outcomes if o.problem()] == []
    assert runtime.misses == [] and runtime.mismatches == []
    return str(tmp_path / "rec.jsonl"), str(tmp_path / "audit.jsonl")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The records of the same traffic through a serve with the defaults (or beside the same
    kubelet without the setting): what a lost setting would give."""
    made: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in made:
            settings, kubelet_config = BASELINES[name]
            _, audit = _record(tmp_path_factory.mktemp("baseline"), settings, kubelet_config)
            made[name] = [_decided(r) for r in _lines(audit) if "method" in r]
        return made[name]
    return get


def _decided(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time"}


def _summary(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("replayed "))


@pytest.mark.parametrize("run", list(RUNS))
def test_a_recording_with_settings_off_their_defaults_replays_to_its_audit_records(tmp_path, capsys, run, baseline):
    settings, kubelet_config, unlike = RUNS[run]
    rec, audit = _record(tmp_path, settings, kubelet_config)
    served = [r for r in _lines(audit) if "method" in r]
    assert len(served) == 8
    if unlike is not None:  # the setting changes what is decided for this traffic
        assert [_decided(r) for r in served] != baseline(unlike)
    header = read_trace(rec).header
    recorded = header.shim["settings"]
    assert list(recorded) == [o.name for o in DECIDING]
    for name, value in settings.items():
        option = next(o for o in DECIDING if o.name == name)
        assert recorded[name] == json_form(option.parse(value)), name

    assert main(["replay", rec, "--json", "--expect", audit]) == 0
    out, err = capsys.readouterr()
    assert f"same as {audit} (8 records)" in err
    summary = _summary(err)
    for name in settings:
        assert f"{name} {recorded[name] if isinstance(recorded[name], str) else json.dumps(recorded[name])} " \
               f"(trace header)" in summary, (name, summary)
    assert "does not carry" not in err  # every deciding setting is in the header
    replayed = [json.loads(line) for line in out.splitlines()]
    assert [r["unified_after"] for r in replayed] == [r["unified_after"] for r in served]

    if run == "all":  # the values are not the defaults' ...
        assert [r["unified_after"] for r in served] != [r["unified_after"] for r in baseline("defaults")]
        # ... and a replay that lost the header's settings does not reproduce them
        trace = read_trace(rec)
        stripped = tmp_path / "stripped.jsonl"
        write_trace(str(stripped), {**trace.header.raw, "shim": {"version": trace.header.shim["version"]}},
                    trace.calls)
        assert main(["replay", str(stripped), "--json", "--expect", audit]) == 1
        _, err = capsys.readouterr()
        assert "DIFFERS" in err and "does not carry mode, kubelet-version" in err


def test_the_config_file_wins_over_the_header_and_its_unused_keys_are_named(tmp_path, capsys):
    rec, audit = _record(tmp_path, {"protection-headroom-ratio": 0.25})
    assert main(["replay", rec, "--json", "--expect", audit]) == 0
    capsys.readouterr()
    used_and_unused = tmp_path / "replay.yaml"
    # protection-headroom-ratio: used (over the header's 0.25); listen, reclaim: serve's, not replay's
    used_and_unused.write_text("protection-headroom-ratio: 0.5\nlisten: unix:///x.sock\nreclaim: true\n")
    assert main(["replay", rec, "--json", "--config", str(used_and_unused), "--expect", audit]) == 1
    out, err = capsys.readouterr()
    assert f"protection-headroom-ratio 0.5 (--config {used_and_unused})" in _summary(err)
    assert "DIFFERS" in err
    note = next(line for line in err.splitlines() if "does not use" in line)
    assert f"{used_and_unused}:2: listen" in note and f"{used_and_unused}:3: reclaim" in note
    assert "protection-headroom-ratio" not in note


# -- traces without shim.settings ---------------------------------------------------------------
def test_an_older_recording_replays_as_before_with_a_note_naming_the_defaults_taken(tmp_path, capsys):
    """A recording made before shim.settings (policy, allocatable, factor and kubelet_version in
    their own keys) replays with those and the defaults for the rest, and says which."""
    rec, audit = _record(tmp_path, {"policy": "Soft", "factor": 0.5})
    trace = read_trace(rec)
    older = {k: v for k, v in trace.header.shim.items() if k != "settings"}
    assert {"policy", "allocatable", "factor"} <= set(older)
    path = tmp_path / "older.jsonl"
    write_trace(str(path), {**trace.header.raw, "shim": older}, trace.calls)
    assert main(["replay", str(path), "--json", "--expect", audit]) == 0
    _, err = capsys.readouterr()
    note = next(line for line in err.splitlines() if "does not carry" in line)
    assert note.endswith("note: the trace header does not carry mode, kubelet-version, protection-headroom-ratio, "
                         "protection-headroom-min, correct-kubelet-min; replayed with mode enforce, kubelet-version "
                         "unknown, protection-headroom-ratio 0.1, protection-headroom-min 8388608, "
                         "correct-kubelet-min false")
    assert "policy Soft (trace header)" in _summary(err) and "factor 0.5 (trace header)" in _summary(err)


def test_a_kubelet_trace_replays_to_its_golden_file_with_a_note_naming_the_defaults_taken(capsys):
    from pathlib import Path

    golden = Path(__file__).parent / "golden" / f"{MEMQOS_ON}.replay.jsonl"
    assert main(["replay", str(trace_file(MEMQOS_ON)), "--json"]) == 0
    out, err = capsys.readouterr()
    # the same records (a unified map's key order is protobuf's map order, not the shim's)
    assert [json.loads(line) for line in out.splitlines()] == [json.loads(line) for line in
                                                               golden.read_text().splitlines()]
    assert ("note: the trace header does not carry mode, policy, protection-headroom-ratio, "
            "protection-headroom-min, correct-kubelet-min; replayed with mode enforce, policy Hard, "
            "protection-headroom-ratio 0.1, protection-headroom-min 8388608, correct-kubelet-min false") in err
    summary = _summary(err)
    assert "kubelet-version 1.23 (trace header)" in summary and "factor 0.8 (kubelet memoryThrottlingFactor)" \
        in summary and "node-allocatable 1850703872 (capacity - kubeReserved - systemReserved)" in summary


# -- settings changed while serve runs ----------------------------------------------------------
def test_a_setting_changed_while_running_is_in_the_next_files_header(tmp_path):
    """`mode` switched on SIGHUP and the kubelet's version found late reach the header of the
    recorder's next file (a reopen after logrotate here); the current file keeps its own."""
    import os

    from shim.cli.main import build_parser
    from shim.app.config import resolve
    from shim.app.service import Service
    from shim.transport.hooks import RpcCall

    (tmp_path / "meminfo").write_text("MemTotal:       2000000 kB\n")
    args = build_parser().parse_args([
        "serve", "--kubelet-config", "none", "--meminfo", str(tmp_path / "meminfo"),
        "--cgroup-root", str(tmp_path), "--audit-log", "none", "--record", str(tmp_path / "rec.jsonl"),
        "--reconcile", "false", "--monitor-interval", "0", "--kubelet-version", "unknown"])
    service = Service.from_config(resolve(args))
    recorder = service.recorder
    try:
        assert service.set_mode("observe", "test")
        service.kubelet_version_known((1, 37), "test")
        os.rename(tmp_path / "rec.jsonl", tmp_path / "rec.jsonl.old")
        recorder.reopen()
        recorder.finished(RpcCall("/runtime.v1.RuntimeService/StartContainer", 1.0, 0.1, b"", None, [b""], "OK", ""))
        assert recorder.flush()
    finally:
        recorder.close()
        service.audit.close()
    first, second = read_trace(str(tmp_path / "rec.jsonl.old")).header, read_trace(str(tmp_path / "rec.jsonl")).header
    assert (first.shim["settings"]["mode"], first.shim["settings"]["kubelet-version"]) == ("enforce", "unknown")
    assert "kubelet_version" not in first.shim
    assert (second.shim["settings"]["mode"], second.shim["settings"]["kubelet-version"]) == ("observe", "1.37")
    assert second.shim["kubelet_version"] == "1.37"
