"""The trace format (reader/writer) and the recorder: filter, rotation, never blocking,
surviving kill -9. `serve --record` end to end is in test_replay_recording.py."""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shim.evidence.recorder import HIGH_VOLUME_METHODS, MethodFilter, Recorder, shim_header
from shim.evidence.trace import TraceCall, TraceError, make_header, open_text, read_trace, trace_stem, write_trace
from shim.cri.methods import CREATE_CONTAINER
from shim.transport.hooks import RpcCall
from memqos_dev.testing.traces import all_traces

ROOT = Path(__file__).resolve().parents[1]

VERSION = "/runtime.v1.RuntimeService/Version"
LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
START = "/runtime.v1.RuntimeService/StartContainer"


def header(**kw):
    return make_header(source="test", mem_total_bytes=2060419072, page_size=4096, cgroup_driver="cgroupfs",
                       kubelet_config={"kubeReserved": {"memory": "100Mi"}}, **kw)


def finished(method=START, request=b"\x0a\x03abc", forwarded=None, responses=(b"",), code="OK", details=""):
    return RpcCall(method, 1763702400.5, 1.25, request, forwarded, list(responses), code, details)


def lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------- the format


@pytest.mark.parametrize("path", all_traces(), ids=lambda p: p.name)
def test_recorded_traces_read_and_write_back_identically(path):
    trace = read_trace(str(path))
    with open_text(str(path)) as f:
        original = [json.loads(line) for line in f if line.strip()]
    assert trace.header.raw == original[0]
    assert [c.to_json() for c in trace.calls] == original[1:]
    assert trace.problems == []


def test_reader_tolerates_a_cut_last_line_gaps_and_unknown_keys(tmp_path):
    p = tmp_path / "t.jsonl"
    call = TraceCall(5, 1.0, 0.5, VERSION, b"", None, [b"\x0a\x01x"], "OK", "")
    extra = dict(call.to_json(), seq=9, something_new={"x": 1})
    p.write_text(json.dumps(header()) + "\n" + call.to_line() + json.dumps(extra) + "\n"
                 + call.to_line()[:40])
    trace = read_trace(str(p))
    assert [c.seq for c in trace.calls] == [5, 9]
    assert trace.calls[1].responses == [b"\x0a\x01x"]
    assert len(trace.problems) == 1 and "last line" in trace.problems[0]


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ('{"format": "other", "version": 1}\n', "not a cri-trace header"),
    ('{"format": "cri-trace", "version": 2}\n', "version 2"),
    ('{"format": "cri-trace", "version": 1}\nnot json\n{"seq": 1}\n', ":2: not JSON"),
    ('{"format": "cri-trace", "version": 1}\n{"seq": 1, "start": 1, "method": "/a/b", "request": "!!", '
     '"responses": [], "code": "OK"}\n', "'request' is not valid base64"),
    ('{"format": "cri-trace", "version": 1}\n{"seq": 1, "start": 1, "method": "/a/b", "request": "", '
     '"code": "OK"}\n', "'responses'"),
])
def test_reader_rejects_what_is_not_a_trace(tmp_path, text, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_trace(str(p))


# ----------------------------------------------------------------------- the filter


def test_default_filter_leaves_out_exactly_the_high_volume_methods():
    f = MethodFilter(None)
    for name in HIGH_VOLUME_METHODS:
        service = "ImageService" if "Image" in name else "RuntimeService"
        assert not f(f"/runtime.v1.{service}/{name}")
    assert not f("/runtime.v1alpha2.RuntimeService/Version")
    for name in ("CreateContainer", "UpdateContainerResources", "RunPodSandbox", "StopContainer",
                 "RemovePodSandbox", "PullImage", "ExecSync", "NoSuch"):
        assert f(f"/runtime.v1.RuntimeService/{name}")
    assert len(HIGH_VOLUME_METHODS) == 13


def test_filter_regex_and_all():
    f = MethodFilter("Container$|Resources$")
    assert f(CREATE_CONTAINER) and f("/runtime.v1.RuntimeService/UpdateContainerResources")
    assert not f("/runtime.v1.RuntimeService/RunPodSandbox") and not f(LIST_CONTAINERS + "X")
    assert MethodFilter("all")(LIST_CONTAINERS) and MethodFilter(".")(VERSION)


# ----------------------------------------------------------------------- the recorder


def test_recorder_writes_a_trace_the_reader_reads_back(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = Recorder(str(path), header()).start()
    rec.finished(finished(VERSION))  # filtered out by default, but numbered
    rec.finished(finished(CREATE_CONTAINER, b"\x0a\x01a", forwarded=b"\x0a\x01b", responses=[b"\x0a\x02id"]))
    rec.finished(finished(START, b"\x0a\x02id", responses=[], code="NOT_FOUND", details="no such container"))
    rec.close()
    trace = read_trace(str(path))
    assert trace.header.mem_total_bytes == 2060419072 and trace.header.kubelet_config == {
        "kubeReserved": {"memory": "100Mi"}}
    assert [c.seq for c in trace.calls] == [2, 3]  # the gap is the filtered Version call
    create, start = trace.calls
    assert (create.request, create.forwarded, create.responses) == (b"\x0a\x01a", b"\x0a\x01b", [b"\x0a\x02id"])
    assert (start.forwarded, start.responses, start.code, start.details) == (None, [], "NOT_FOUND",
                                                                             "no such container")
    raw = lines(path)
    assert "forwarded" in raw[1] and "forwarded" not in raw[2]
    assert raw[1]["request"] == base64.b64encode(b"\x0a\x01a").decode()
    assert (rec.recorded, rec.filtered, rec.dropped) == (2, 1, 0)


def test_recorder_rotates_by_size_and_keeps_n_files_each_a_whole_trace(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = Recorder(str(path), header(), max_bytes=2000, keep=2, methods=".").start()
    for i in range(60):
        rec.finished(finished(START, request=bytes([i]) * 50))
    rec.close()
    files = sorted(os.listdir(tmp_path))
    assert files == ["rec.jsonl", "rec.jsonl.1", "rec.jsonl.2"]
    assert rec.rotations >= 3
    seqs = []
    for name in ("rec.jsonl.2", "rec.jsonl.1", "rec.jsonl"):
        p = tmp_path / name
        assert p.stat().st_size <= 2000
        trace = read_trace(str(p))  # every file starts with its own header
        assert trace.header.mem_total_bytes == 2060419072 and trace.calls
        seqs += [c.seq for c in trace.calls]
    assert seqs == list(range(seqs[0], 61))  # the newest calls, in order, none lost between files


def test_keep_zero_starts_the_file_over(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = Recorder(str(path), header(), max_bytes=1500, keep=0, methods=".").start()
    for i in range(40):
        rec.finished(finished(START))
    rec.close()
    assert os.listdir(tmp_path) == ["rec.jsonl"]
    assert read_trace(str(path)).calls[-1].seq == 40


def test_a_previous_recording_is_rotated_away_at_start(tmp_path):
    path = tmp_path / "rec.jsonl"
    first = Recorder(str(path), header(), methods=".").start()
    first.finished(finished(START))
    first.close()
    second = Recorder(str(path), header(), methods=".").start()
    second.finished(finished(START))
    second.finished(finished(START))
    second.close()
    assert len(read_trace(str(path) + ".1").calls) == 1
    assert len(read_trace(str(path)).calls) == 2


def test_finished_never_blocks_when_the_writer_is_behind(tmp_path):
    rec = Recorder(str(tmp_path / "rec.jsonl"), header(), methods=".", max_pending=3)
    # not started: nothing drains the queue
    for _ in range(10):
        rec.finished(finished(START))
    assert rec.dropped == 7
    rec2 = Recorder(str(tmp_path / "rec2.jsonl"), header(), methods=".", max_pending_bytes=1000)
    for _ in range(5):
        rec2.finished(finished(START, request=b"x" * 400))
    assert rec2.dropped == 3


def test_kill_9_loses_nothing_already_finished(tmp_path):
    path = tmp_path / "rec.jsonl"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from shim.evidence.recorder import Recorder
        from shim.evidence.trace import make_header
        from shim.transport.hooks import RpcCall
        rec = Recorder({str(path)!r}, make_header(source="t", mem_total_bytes=1, page_size=4096,
                       cgroup_driver="cgroupfs", kubelet_config={{}}), methods=".").start()
        for i in range(200):
            rec.finished(RpcCall("/runtime.v1.RuntimeService/StartContainer", 1.0, 0.1,
                                      bytes([i % 256]) * 100, None, [b""], "OK", ""))
        rec.flush()
        print("written", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    trace = read_trace(str(path))  # never closed, never flushed at exit
    assert [c.seq for c in trace.calls] == list(range(1, 201)) and trace.problems == []


def test_shim_header_holds_node_facts_and_settings():
    h = shim_header(version="0.1.0", mem_total_bytes=2060419072, page_size=4096, cgroup_driver="systemd",
                    kubelet_config={"cgroupDriver": "systemd"}, allocatable=1850703872, factor=None,
                    policy="tiered", cgroup_v2=True, methods="default")
    assert h["format"] == "cri-trace" and h["version"] == 1
    assert h["node"]["mem_total_bytes"] == 2060419072 and h["node"]["cgroup_driver"] == "systemd"
    assert h["shim"]["factor"] is None and h["shim"]["policy"] == "tiered"


# ----------------------------------------------------------------------- compressed traces


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.xz"])
def test_compressed_traces_read_like_plain_ones(tmp_path, suffix):
    import gzip
    import lzma

    calls = [TraceCall(1, 1.0, 0.5, "/runtime.v1.RuntimeService/Version", b"\x0a\x02v1", None, [b"\x0a\x01x"], "OK", ""),
             TraceCall(2, 2.0, 0.1, "/runtime.v1.RuntimeService/Status", b"", None, [], "NOT_FOUND", "gone")]
    plain = tmp_path / "t.jsonl"
    write_trace(str(plain), header(), calls)
    data = plain.read_bytes()
    path = tmp_path / f"c{suffix}"
    path.write_bytes({".jsonl": data, ".jsonl.gz": gzip.compress(data), ".jsonl.xz": lzma.compress(data)}[suffix])
    trace = read_trace(str(path))
    assert [c.to_json() for c in trace.calls] == [c.to_json() for c in calls]
    assert trace.header.raw == read_trace(str(plain)).header.raw
    assert trace.problems == []
    assert trace_stem(str(path)) == "c"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.xz"])
def test_a_damaged_compressed_trace_is_a_trace_error(tmp_path, suffix):
    import gzip
    import lzma

    plain = tmp_path / "t.jsonl"
    write_trace(str(plain), header(), [])
    packed = (gzip.compress if suffix.endswith("gz") else lzma.compress)(plain.read_bytes() * 50)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(packed[: len(packed) // 2])  # a download or copy cut short
    with pytest.raises(TraceError, match="cut"):
        read_trace(str(path))
    (tmp_path / f"junk{suffix}").write_bytes(b"not compressed at all")
    with pytest.raises(TraceError, match="junk"):
        read_trace(str(tmp_path / f"junk{suffix}"))


def test_serve_refuses_to_record_to_a_compressed_file_name(tmp_path, capsys):
    """The recorder writes plain lines; a .gz/.xz name would make every reader fail on it."""
    from shim.cli.main import main

    for name in ("cri.jsonl.gz", "cri.jsonl.xz"):
        rc = main(["serve", "--listen", str(tmp_path / "s.sock"), "--upstream", str(tmp_path / "u.sock"),
                   "--record", str(tmp_path / name), "--kubelet-config", "none"])
        assert rc == 2
        assert "plain JSON lines" in capsys.readouterr().err
        assert not (tmp_path / name).exists()


def test_write_trace_never_overwrites_a_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("someone's\n")
    with pytest.raises(FileExistsError):
        write_trace(str(path), header(), [])
    assert path.read_text() == "someone's\n"
