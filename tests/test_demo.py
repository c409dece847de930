"""`memqos-shim demo` end to end: real processes (the demo's stand-in runtime, memqos-shim serve)
on real unix sockets, driven by a kubelet-shaped client."""
import json
import subprocess
import sys

import pytest

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


def _demo_cli(*args):
    return subprocess.run([sys.executable, "-m", "shim", "demo", *args], capture_output=True, text=True, timeout=120)


def test_demo_refuses_a_folder_it_did_not_make_and_removes_nothing(tmp_path):
    """`demo --out DIR` on a non-empty directory without the demo's marker: exit 2, one line,
    nothing in it touched (the run that deleted the file beside it)."""
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.txt").write_text("mine too\n")
    r = _demo_cli("--out", str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "not empty" in r.stderr and demo.MARKER in r.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and (tmp_path / "sub" / "more.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "sub"]


def test_demo_refuses_a_file_or_a_symlink_as_its_folder(tmp_path):
    f = tmp_path / "f"
    f.write_text("keep\n")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / demo.MARKER).write_text("")
    (target / "x").write_text("keep\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    for out in (f, link):
        with pytest.raises(demo.NotTheDemosDir):
            demo.prepare_out_dir(out)
    assert f.read_text() == "keep\n" and (target / "x").read_text() == "keep\n"


def test_demo_reuses_an_empty_folder_or_its_own(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    demo.prepare_out_dir(out)  # empty: taken, and marked
    assert [p.name for p in out.iterdir()] == [demo.MARKER]
    (out / "audit.jsonl").write_text("{}\n")
    (out / "cgroup" / "kubepods").mkdir(parents=True)
    demo.prepare_out_dir(out)  # its own, from an earlier run: emptied
    assert [p.name for p in out.iterdir()] == [demo.MARKER]


def test_demo_help_says_what_it_removes():
    out = _demo_cli("--help").stdout
    assert demo.MARKER in out and "refused" in out
