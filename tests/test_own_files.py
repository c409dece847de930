"""The files the shim writes (audit log, trace recorder, guard state) are never written through
a symlink planted at their path: refused at start (serve exits 2 with a message), or replaced
by a rename; the link's target stays untouched. New files get a private mode."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shim.effects.files import UnsafeFile, open_append
from shim.evidence.audit import AuditLog
from shim.evidence.recorder import Recorder
from shim.guard.episodes import Episode, EpisodeFile
from shim.transport.hooks import RpcCall

TARGET_TEXT = "precious\n"


def planted(tmp_path: Path, name: str, *, dangling: bool = False) -> tuple[Path, Path]:
    """(a symlink at tmp_path/name, its target): an existing file, or one that does not exist."""
    target = tmp_path / f"target-of-{name}"
    if not dangling:
        target.write_text(TARGET_TEXT)
    link = tmp_path / name
    link.symlink_to(target)
    return link, target


def untouched(target: Path, dangling: bool) -> bool:
    return not target.exists() if dangling else target.read_text() == TARGET_TEXT


@pytest.mark.parametrize("dangling", [False, True], ids=["existing-target", "dangling"])
def test_the_audit_log_is_not_written_through_a_symlink(tmp_path, dangling):
    link, target = planted(tmp_path, "audit.jsonl", dangling=dangling)
    log = AuditLog(str(link))
    with pytest.raises(UnsafeFile, match="symbolic link"):
        log.start()
    assert untouched(target, dangling) and link.is_symlink()


@pytest.mark.parametrize("dangling", [False, True], ids=["existing-target", "dangling"])
def test_the_recorder_does_not_start_on_a_symlink(tmp_path, dangling):
    # an empty target: a non-empty one would be rotated away (renamed, not followed)
    target = tmp_path / "target-of-calls.jsonl"
    if not dangling:
        target.write_text("")
    link = tmp_path / "calls.jsonl"
    link.symlink_to(target)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        Recorder(str(link), {"format": "cri-trace"}).start()
    assert (not target.exists()) if dangling else target.read_text() == ""
    assert link.is_symlink()


def _call():
    return RpcCall("/runtime.v1.RuntimeService/RunPodSandbox", 1763702400.5, 1.25, b"x" * 300, None, [b""],
                        "OK", "")


def test_recorder_rotation_leaves_planted_symlinks_alone_and_never_writes_through_them(tmp_path):
    path = tmp_path / "calls.jsonl"
    rec = Recorder(str(path), {"format": "cri-trace"}, max_bytes=600, keep=2, methods=".")
    rec.start()
    try:
        links = {}
        for name in ("calls.jsonl.1", "calls.jsonl.2"):
            links[name] = planted(tmp_path, name)
        for _ in range(6):
            rec.finished(_call())
        assert rec.flush(10)
    finally:
        rec.close()
    assert rec.rotations >= 2 and rec.write_errors == 0
    for link, target in links.values():
        assert target.read_text() == TARGET_TEXT
        assert link.is_symlink()  # not the shim's: neither replaced nor followed
    assert sorted(os.listdir(tmp_path)) == sorted(["calls.jsonl", *links, *(f"target-of-{n}" for n in links)])


def test_a_symlink_planted_where_the_recorder_reopens_is_refused_not_followed(tmp_path):
    path = tmp_path / "calls.jsonl"
    rec = Recorder(str(path), {"format": "cri-trace"}, max_bytes=10**6, keep=1, methods=".")
    rec.start()
    try:
        # the file is renamed away (logrotate) and a symlink takes its place before the reopen
        path.rename(tmp_path / "calls.jsonl.rotated")
        link, target = planted(tmp_path, "calls.jsonl")
        rec.reopen()
        rec.finished(_call())
        assert rec.flush(10)
    finally:
        rec.close()
    assert target.read_text() == TARGET_TEXT and link.is_symlink()
    assert rec.write_errors == 1 and rec.recorded == 0 and rec.reopens == 1


def test_audit_rotation_leaves_planted_symlinks_and_foreign_files_alone(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), max_bytes=300, keep=4).start()
    links = [planted(tmp_path, "audit.jsonl.2"), planted(tmp_path, "audit.jsonl.3", dangling=True)]
    (tmp_path / "audit.jsonl.4").write_text(TARGET_TEXT)  # someone else's file
    for i in range(20):
        log.emit({"event": "x", "i": i, "pad": "p" * 60})
    log.flush()
    log.close()
    assert log.rotations >= 2 and log.write_errors == 0
    assert untouched(links[0][1], False) and untouched(links[1][1], True)
    assert all(link.is_symlink() for link, _ in links)
    assert (tmp_path / "audit.jsonl.4").read_text() == TARGET_TEXT
    # the chain ends below the first name that is not the shim's: FILE and FILE.1 only
    one = tmp_path / "audit.jsonl.1"
    assert json.loads(one.read_text().splitlines()[0])["event"] == "x"
    assert stat.S_IMODE(one.stat().st_mode) == 0o640


@pytest.mark.parametrize("keep", [0, 2])
def test_a_file_of_someone_elses_at_the_audit_or_record_path_is_refused_and_kept(tmp_path, keep):
    """Neither appended to nor rotated away (with keep 0: deleted) at start."""
    for make in (lambda p: AuditLog(str(p), keep=keep),
                 lambda p: Recorder(str(p), {"format": "cri-trace"}, keep=keep)):
        path = tmp_path / "precious.txt"
        path.write_text(TARGET_TEXT)
        with pytest.raises(UnsafeFile, match="did not write"):
            make(path).start()
        assert sorted(os.listdir(tmp_path)) == ["precious.txt"] and path.read_text() == TARGET_TEXT


def test_serve_exits_2_on_a_file_of_someone_elses_at_the_record_path(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text(TARGET_TEXT)
    (tmp_path / "cgroup").mkdir()
    r = subprocess.run([sys.executable, "-m", "shim", "serve", "--listen", str(tmp_path / "s.sock"),
                        "--upstream", str(tmp_path / "rt.sock"), "--cgroup-root", str(tmp_path / "cgroup"),
                        "--kubelet-config", "none", "--kubelet-version", "1.30", "--audit-log", "none",
                        "--record", str(precious)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "did not write" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert precious.read_text() == TARGET_TEXT and sorted(os.listdir(tmp_path)) == ["cgroup", "notes.txt"]


def test_a_symlink_planted_where_the_audit_log_reopens_is_refused_not_followed(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path)).start()
    try:
        log.emit({"event": "before"})
        log.flush()
        path.rename(tmp_path / "audit.jsonl.rotated")
        link, target = planted(tmp_path, "audit.jsonl")
        log.reopen()
        log.emit({"event": "refused"})
        log.flush()
        assert target.read_text() == TARGET_TEXT and link.is_symlink()
        assert log.write_errors == 1 and log.reopens == 1
        link.unlink()  # the operator removes it: the next record opens a regular file again
        log.emit({"event": "after"})
        log.flush()
    finally:
        log.close()
    assert target.read_text() == TARGET_TEXT
    assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["after"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_new_files_get_a_private_mode(tmp_path):
    old = os.umask(0o022)
    try:
        log = AuditLog(str(tmp_path / "audit.jsonl")).start()
        log.emit({"event": "x"})
        log.close()
        Recorder(str(tmp_path / "calls.jsonl"), {"format": "cri-trace"}).start().close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "audit.jsonl").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "calls.jsonl").stat().st_mode) == 0o600


def test_open_append_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFile, match="not a regular file"):
        open_append(str(fifo))  # no reader: refused at once, not blocked
    with pytest.raises(UnsafeFile, match="directory"):
        open_append(str(tmp_path))


def test_guard_state_is_never_written_through_nor_over_a_symlink(tmp_path):
    link, target = planted(tmp_path, "guard-episodes.json")
    f = EpisodeFile(str(link))
    assert f.load() == [] and "symbolic link" in f.problem
    ref = {k: "x" for k in ("id", "namespace", "pod", "container", "uid", "cgroup_parent", "qos")}
    assert not f.save([Episode(ref, "relaxed", 1 << 20)])  # kept in memory only
    assert not f.save([])
    assert target.read_text() == TARGET_TEXT and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["guard-episodes.json", "target-of-guard-episodes.json"]


@pytest.mark.parametrize("text", [TARGET_TEXT, '["a list"]', '{"other": 1}'])
def test_guard_state_never_replaces_nor_removes_a_file_of_someone_elses(tmp_path, text):
    path = tmp_path / "guard-episodes.json"
    path.write_text(text)
    f = EpisodeFile(str(path))
    assert f.load() == []
    ref = {k: "x" for k in ("id", "namespace", "pod", "container", "uid", "cgroup_parent", "qos")}
    assert not f.save([Episode(ref, "relaxed", 1 << 20)]) and not f.save([])
    assert path.read_text() == text and os.listdir(tmp_path) == ["guard-episodes.json"]


def test_guard_state_replaces_and_removes_its_own_file(tmp_path):
    path = tmp_path / "guard-episodes.json"
    ref = {k: "x" for k in ("id", "namespace", "pod", "container", "uid", "cgroup_parent", "qos")}
    f = EpisodeFile(str(path))
    assert f.save([Episode(ref, "relaxed", 1 << 20)]) and f.save([Episode(ref, "relaxed", 2 << 20)])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and os.listdir(tmp_path) == ["guard-episodes.json"]
    assert [e.restore_high for e in EpisodeFile(str(path)).load()] == [2 << 20]
    assert f.save([]) and os.listdir(tmp_path) == []


# -- serve refuses at start ------------------------------------------------------------------------
def serve(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    return subprocess.run(
        [sys.executable, "-m", "shim", "serve", "--listen", f"unix://{tmp_path}/s.sock",
         "--upstream", f"unix://{tmp_path}/rt.sock", "--kubelet-config", "none", "--cgroup-root", str(tmp_path),
         "--meminfo", str(tmp_path / "meminfo"), "--kubelet-version", "1.30", *extra],
        capture_output=True, text=True, timeout=20)


@pytest.mark.parametrize("what", ["audit-log", "record", "audit-log-fifo"])
def test_serve_exits_2_when_a_file_it_writes_is_a_symlink(tmp_path, what):
    if what == "audit-log-fifo":
        os.mkfifo(tmp_path / "audit.jsonl")
        out = serve(tmp_path, "--audit-log", str(tmp_path / "audit.jsonl"))
        assert out.returncode == 2 and "not a regular file" in out.stderr
        return
    if what == "record":
        target = tmp_path / "target"
        target.write_text("")
        (tmp_path / "calls.jsonl").symlink_to(target)
        out = serve(tmp_path, "--audit-log", "none", "--record", str(tmp_path / "calls.jsonl"))
        assert target.read_text() == ""
    else:
        link, target = planted(tmp_path, "audit.jsonl")
        out = serve(tmp_path, "--audit-log", str(link))
        assert target.read_text() == TARGET_TEXT
    assert out.returncode == 2, out.stderr
    assert "is a symbolic link; refusing to write through it" in out.stderr
    assert not (tmp_path / "s.sock").exists()
