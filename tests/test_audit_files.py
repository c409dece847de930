"""The audit log's and the recorder's files on a node: rotation by size with a bounded number of
files, no record lost or cut across a rotation (many writers at once), a write cut by a full
disk taken back, and reopen on SIGHUP (logrotate's create mode) in a real `serve` and `nri`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.tools import require_tool

from shim.app import cli
from shim.evidence.audit import AuditLog
from shim.evidence.metrics import Metrics
from shim.evidence.recorder import Recorder
from shim.evidence.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]


def chain(path: Path, keep: int) -> list[Path]:
    """The files of a rotated log, oldest first: path.<keep> ... path.1, path."""
    return [p for p in [Path(f"{path}.{i}") for i in range(keep, 0, -1)] + [path] if p.exists()]


def records(files: list[Path]) -> list[dict]:
    out = []
    for f in files:
        text = f.read_text()
        assert text == "" or text.endswith("\n"), f"{f.name} ends in a cut record"
        out += [json.loads(line) for line in text.splitlines()]  # every line a whole record
    return out


# -- rotation by size ----------------------------------------------------------------------------
def test_the_audit_log_rotates_by_size_and_keeps_n_files_of_whole_records(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), max_bytes=1000, keep=3).start()
    for i in range(200):
        log.emit({"event": "x", "i": i, "pad": "p" * (i % 50)})
    log.flush()
    log.close()
    assert sorted(os.listdir(tmp_path)) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl.3"]
    assert log.rotations >= 10
    files = chain(path, 3)
    assert all(f.stat().st_size <= 1000 for f in files)
    seen = [r["i"] for r in records(files)]
    assert seen == list(range(seen[0], 200))  # the newest records, in order, none lost between files


def test_keep_zero_starts_the_file_over_and_max_bytes_zero_never_rotates(tmp_path):
    over = tmp_path / "over" / "audit.jsonl"
    never = tmp_path / "never" / "audit.jsonl"
    over.parent.mkdir()
    never.parent.mkdir()
    a = AuditLog(str(over), max_bytes=500, keep=0).start()
    b = AuditLog(str(never), max_bytes=0, keep=3).start()
    for i in range(100):
        a.emit({"i": i})
        b.emit({"i": i})
    a.close()
    b.close()
    assert os.listdir(over.parent) == ["audit.jsonl"] and over.stat().st_size <= 500
    assert records([over])[-1]["i"] == 99
    assert os.listdir(never.parent) == ["audit.jsonl"] and b.rotations == 0
    assert [r["i"] for r in records([never])] == list(range(100))


def test_an_existing_audit_log_is_appended_to_and_rotated_once_full(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps({"i": "old"}) + "\n")
    log = AuditLog(str(path), max_bytes=40, keep=2).start()
    log.emit({"i": 0})
    log.emit({"i": 1, "pad": "p" * 20})
    log.close()
    assert [r["i"] for r in records(chain(path, 2))] == ["old", 0, 1]
    assert [r["i"] for r in records([path])] == [1]


def test_a_record_larger_than_max_bytes_is_written_whole_in_a_file_of_its_own(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), max_bytes=100, keep=3).start()
    log.emit({"i": 0})
    log.emit({"i": 1, "pad": "p" * 300})
    log.emit({"i": 2})
    log.close()
    assert [[r["i"] for r in records([f])] for f in chain(path, 3)] == [[0], [1], [2]]


@pytest.mark.parametrize("with_reopens", [False, True], ids=["rotations", "rotations-and-reopens"])
def test_many_writers_lose_no_record_and_cut_none_across_rotations(tmp_path, with_reopens):
    """16 threads emit at once while the file rotates every few records (and, in the second
    case, is renamed away and reopened as logrotate does): every record is in exactly one
    file, whole, and each writer's records are in the order it emitted them."""
    path = tmp_path / "audit.jsonl"
    writers, per_writer = 16, 400
    keep = 400  # enough to keep every file: nothing may be missing
    log = AuditLog(str(path), max_pending=writers * per_writer + 100, max_bytes=8192, keep=keep).start()
    start = threading.Barrier(writers + 1)

    def emit(w: int) -> None:
        start.wait()
        for n in range(per_writer):
            log.emit({"event": "x", "writer": w, "n": n, "pad": "p" * ((w * 7 + n) % 90)})

    threads = [threading.Thread(target=emit, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    renamed = []
    if with_reopens:
        for k in range(5):
            # logrotate's create mode: rename the file, then SIGHUP (here: what SIGHUP calls)
            target = tmp_path / f"rotated-{k}.jsonl"
            try:
                path.rename(target)
                renamed.append(target)
            except FileNotFoundError:  # between a size rotation's rename and its new file
                pass
            log.reopen()
            time.sleep(0.01)
    for t in threads:
        t.join()
    log.flush(30)
    log.close()
    assert log.dropped == 0 and log.write_errors == 0
    assert log.rotations >= 40
    got = records(renamed + chain(path, keep))
    assert len(got) == writers * per_writer
    assert sorted((r["writer"], r["n"]) for r in got) == [(w, n) for w in range(writers) for n in range(per_writer)]
    if not with_reopens:  # one chain of files: the order of the files is the order of the writes
        for w in range(writers):
            assert [r["n"] for r in got if r["writer"] == w] == list(range(per_writer))
    else:
        assert log.reopens >= 1


def test_a_write_cut_short_by_a_full_disk_is_taken_back(tmp_path):
    """A file size limit (RLIMIT_FSIZE, like a full disk) cuts a record part way: the part written
    is taken back, the record counted as a write error, and the file holds whole records."""
    path = tmp_path / "audit.jsonl"
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from shim.evidence.audit import AuditLog
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        log = AuditLog({str(path)!r}, max_bytes=0).start()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        for i in range(30):
            log.emit({{"i": i, "pad": "p" * 80}})
        log.flush()
        print(log.written, log.write_errors)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    written, errors = map(int, out.stdout.split())
    assert errors > 0 and written + errors == 30
    assert [r["i"] for r in records([path])] == list(range(written))


def test_file_counters_are_metrics(tmp_path):
    log = AuditLog(str(tmp_path / "audit.jsonl"), max_bytes=100, keep=1).start()
    rec = Recorder(str(tmp_path / "calls.jsonl"), {"format": "cri-trace"}, methods=".")
    m = Metrics().attach(audit=log, recorder=rec)
    for i in range(10):
        log.emit({"i": i, "pad": "p" * 40})
    log.reopen()
    log.flush()
    log.close()
    text = m.render().decode()
    assert f'memqos_file_rotations_total{{file="audit"}} {float(log.rotations)}' in text and log.rotations >= 3
    assert 'memqos_file_reopens_total{file="audit"} 1.0' in text
    assert 'memqos_file_write_errors_total{file="audit"} 0.0' in text
    assert 'memqos_file_rotations_total{file="record"} 0.0' in text
    assert "memqos_recorder_calls_dropped_total 0.0" in text


# -- SIGHUP --------------------------------------------------------------------------------------
def test_a_sighup_while_the_shim_starts_is_remembered_not_fatal():
    before = signal.getsignal(signal.SIGHUP)
    try:
        cli.hold_sighup()
        os.kill(os.getpid(), signal.SIGHUP)  # default action: the process would end here
        time.sleep(0.05)  # the Python-level handler runs between bytecodes of the main thread
        assert cli._early_sighup is True  # noqa: SLF001
        done = []
        cli.on_sighup([lambda: done.append(1), lambda: 1 / 0, lambda: done.append(2)])
        assert done == [1, 2]  # one action that raises does not stop the others
    finally:
        signal.signal(signal.SIGHUP, before)
        cli._early_sighup = False  # noqa: SLF001


def wait_for(what, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def complete_records(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def test_serve_reopens_the_audit_log_and_the_recording_on_sighup():
    """logrotate's create mode against a real `serve`: the files are renamed, SIGHUP, a call: the
    call's records are in new files, the renamed ones keep the earlier records whole."""
    from shim.cri import pb
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer

    try:
        from tests.test_serve import Shim, create, run_pod, short_dir
    except ImportError:  # run from tests/
        from test_serve import Shim, create, run_pod, short_dir

    base = short_dir()
    calls = base / "calls.jsonl"
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        settings = base / "shim.yaml"
        settings.write_text("record-methods: all\n")  # a config-file key only
        shim = Shim(base, runtime.address, extra=("--config", str(settings), "--record", str(calls),
                                                  "--reconcile", "false", "--kubelet-version", "1.30"))
        try:
            sid, sb = run_pod(shim, "before", "11111111-0000-4000-8000-000000000001", "burstable")
            first = create(shim, runtime.runtime, sid, sb, "app", "burstable", request=64 << 20, limit=128 << 20)[0]
            shim.record_for(first)
            assert wait_for(lambda: len(complete_records(calls)) >= 3)  # header, RunPodSandbox, CreateContainer
            shim.audit.rename(base / "audit.jsonl.1")
            calls.rename(base / "calls.jsonl.1")
            shim.proc.send_signal(signal.SIGHUP)
            # the reopen happens on the writers' threads: the new files appear without a call
            assert wait_for(lambda: shim.audit.exists() and calls.exists())
            sid2, sb2 = run_pod(shim, "after", "11111111-0000-4000-8000-000000000002", "burstable")
            second = create(shim, runtime.runtime, sid2, sb2, "app", "burstable", request=64 << 20,
                            limit=128 << 20)[0]
            after = shim.record_for(second)
            shim.rt.Version(pb.VersionRequest(), timeout=10)
            assert wait_for(lambda: any(c.get("method", "").endswith("/Version") for c in complete_records(calls)))
            assert shim.proc.poll() is None  # SIGHUP did not end it
        finally:
            shim.stop()
    old_audit = records([base / "audit.jsonl.1"])
    new_audit = records([shim.audit])
    old_ids = {r.get("container_id") for r in old_audit}
    assert first in old_ids and second not in old_ids
    assert after in new_audit and first not in {r.get("container_id") for r in new_audit}
    assert old_audit[0]["event"] == "start"
    old_trace, new_trace = read_trace(str(base / "calls.jsonl.1")), read_trace(str(calls))
    assert [c.method.rsplit("/", 1)[-1] for c in old_trace.calls][:2] == ["RunPodSandbox", "CreateContainer"]
    new_methods = [c.method.rsplit("/", 1)[-1] for c in new_trace.calls]
    assert new_methods[:2] == ["RunPodSandbox", "CreateContainer"] and "Version" in new_methods
    assert min(c.seq for c in new_trace.calls) > max(c.seq for c in old_trace.calls)  # none in both
    log = (base / "shim.log").read_text()
    assert "audit log" in log and "reopened" in log


def test_nri_reopens_the_audit_log_on_sighup(tmp_path):
    """`memqos-shim nri` handles SIGHUP too (without a handler SIGHUP would end the process)."""
    audit = tmp_path / "audit.jsonl"
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    log = open(tmp_path / "nri.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shim", "nri", "--nri-socket", str(tmp_path / "no-runtime.sock"),
         "--kubelet-config", "none", "--cgroup-root", str(tmp_path), "--meminfo", str(tmp_path / "meminfo"),
         "--kubelet-version", "1.30", "--audit-log", str(audit), "--reconcile", "false",
         "--monitor-interval", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: complete_records(audit)), (tmp_path / "nri.log").read_text()
        assert wait_for(lambda: "NRI plugin" in (tmp_path / "nri.log").read_text())  # the loop runs
        audit.rename(tmp_path / "audit.jsonl.1")
        proc.send_signal(signal.SIGHUP)
        assert wait_for(audit.exists), (tmp_path / "nri.log").read_text()
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0
    assert complete_records(tmp_path / "audit.jsonl.1")[0]["event"] == "start"


# -- logrotate -----------------------------------------------------------------------------------
LOGROTATE = ROOT / "deploy" / "logrotate" / "memqos-shim"


def test_the_logrotate_rules_name_the_deployed_audit_log_and_signal_the_main_process():
    import yaml

    text = LOGROTATE.read_text()
    rules = [line.split("#")[0].strip() for line in text.splitlines()]
    rules = [r for r in rules if r]
    audit_log = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())["audit-log"]
    assert rules[0] == f"{audit_log} {{" and rules[-1] == "}"
    assert "create 0640 root root" in rules and "copytruncate" not in rules
    assert "dateext" in rules  # never FILE.1: the shim's own rotation uses those names
    script = rules[rules.index("postrotate") + 1:rules.index("endscript")]
    assert script == ["systemctl kill --kill-who=main --signal=HUP memqos-shim.service >/dev/null 2>&1 || true"]
    assert (ROOT / "deploy" / "memqos-shim.service").exists()


def test_logrotate_with_the_shipped_rules_rotates_a_running_shim_without_losing_a_record():
    """The shipped rules, run by logrotate itself against a real `serve` (the path and the signal's
    target replaced by this test's): three forced rotations with calls in between; every record
    is in exactly one file, whole, and the shim writes to the file logrotate created."""
    logrotate = require_tool("logrotate")
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer

    try:
        from tests.test_serve import Shim, create, run_pod, short_dir
    except ImportError:  # run from tests/
        from test_serve import Shim, create, run_pod, short_dir

    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        shim = Shim(base, runtime.address, extra=("--reconcile", "false", "--kubelet-version", "1.30"))
        try:
            text = LOGROTATE.read_text().replace("/var/log/memqos-shim/audit.jsonl", str(shim.audit))
            text = text.replace("systemctl kill --kill-who=main --signal=HUP memqos-shim.service",
                                f"kill -HUP {shim.proc.pid}")
            text = text.replace("create 0640 root root", "create 0640")
            assert f"kill -HUP {shim.proc.pid}" in text
            conf = base / "logrotate.conf"
            conf.write_text(text)
            conf.chmod(0o644)
            created = []
            for round_ in range(4):
                sid, sb = run_pod(shim, f"pod{round_}", f"11111111-0000-4000-8000-00000000000{round_}", "burstable")
                for n in range(3):
                    cid = create(shim, runtime.runtime, sid, sb, f"c{n}", "burstable", request=64 << 20,
                                 limit=128 << 20)[0]
                    created.append(cid)
                    shim.record_for(cid)
                if round_ < 3:
                    time.sleep(1.1)  # a new second for logrotate's dated name (%s)
                    out = subprocess.run([logrotate, "-f", "-s", str(base / "logrotate.state"), str(conf)],
                                         capture_output=True, text=True, timeout=60)
                    assert out.returncode == 0, out.stderr
                    assert wait_for(lambda: shim.audit.exists())
            assert shim.proc.poll() is None
            last = created[-1]
        finally:
            shim.stop()
    import gzip

    rotated = sorted(p for p in base.iterdir() if p.name.startswith("audit.jsonl-"))
    assert [p.name.endswith(".gz") for p in rotated] == [True, True, False]  # delaycompress
    texts = [gzip.open(p, "rt").read() if p.name.endswith(".gz") else p.read_text() for p in rotated]
    texts.append(shim.audit.read_text())
    got = []
    for t in texts:
        assert t.endswith("\n")
        got += [json.loads(line) for line in t.splitlines()]
    creates = [r["container_id"] for r in got if r.get("method") == "CreateContainer"]
    assert creates == created  # each once, in order, across the four files
    assert last in texts[-1] and oct(shim.audit.stat().st_mode & 0o777) == "0o640"
