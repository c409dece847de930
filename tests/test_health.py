"""The heartbeat file and `memqos-shim health` (the DaemonSet's exec probes): fresh → exit 0,
stale, missing, garbled or (with --ready) not registered → exit 1, through the real command."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from shim.evidence.health import Heartbeat, check


def health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", "health", *args],
                          capture_output=True, text=True, timeout=60)


def test_fresh_registered_heartbeat_passes_both_probes(tmp_path):
    f = tmp_path / "health.json"
    assert Heartbeat(str(f)).beat("registered")
    live = health("--file", str(f))
    ready = health("--file", str(f), "--ready", "--max-age", "10")
    assert live.returncode == 0 and ready.returncode == 0, (live.stdout, ready.stdout)
    assert "registered" in ready.stdout


def test_connecting_is_alive_but_not_ready(tmp_path):
    f = tmp_path / "health.json"
    Heartbeat(str(f)).beat("connecting")
    assert health("--file", str(f)).returncode == 0
    r = health("--file", str(f), "--ready")
    assert r.returncode == 1 and "not registered" in r.stdout


def test_stale_missing_and_garbled_files_fail(tmp_path):
    f = tmp_path / "health.json"
    now = [1000.0]
    Heartbeat(str(f), clock=lambda: now[0]).beat("registered")
    assert check(str(f), 30, now=1029.0)[0]
    ok, why = check(str(f), 30, now=1031.0)
    assert not ok and "stuck" in why
    r = health("--file", str(tmp_path / "none.json"))
    assert r.returncode == 1 and "no heartbeat" in r.stdout
    f.write_text('{"time": ')
    assert health("--file", str(f)).returncode == 1
    f.write_text(json.dumps({"time": "x", "state": "registered"}))
    assert not check(str(f), 30)[0]


def test_state_change_restarts_since_and_write_is_atomic(tmp_path):
    f = tmp_path / "health.json"
    t = [10.0]
    hb = Heartbeat(str(f), clock=lambda: t[0])
    hb.beat("connecting")
    t[0] = 20.0
    hb.beat("connecting")
    assert json.loads(f.read_text())["since"] == 10.0
    hb.beat("registered")
    doc = json.loads(f.read_text())
    assert doc == {"pid": os.getpid(), "time": 20.0, "state": "registered", "since": 20.0}
    assert sorted(os.listdir(tmp_path)) == ["health.json"]  # no temporary file left behind


def test_unwritable_place_is_counted_not_raised(tmp_path):
    hb = Heartbeat(str(tmp_path / "missing-dir" / "health.json"))
    assert hb.beat("registered") is False and hb.failures == 1


def test_run_task_beats_and_removes_the_file_when_cancelled(tmp_path):
    f = tmp_path / "health.json"
    states = iter(["connecting", "registered", "registered", "registered"])

    async def main():
        hb = Heartbeat(str(f), interval=0.01)
        task = asyncio.create_task(hb.run(lambda: next(states, "registered")))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if f.exists() and json.loads(f.read_text())["state"] == "registered":
                break
        assert json.loads(f.read_text())["state"] == "registered"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    assert not f.exists()


def test_the_heartbeat_replaces_and_removes_only_its_own_file(tmp_path):
    """A file of someone else's (or a symlink) at the path is neither replaced nor removed: the
    beat fails (the probe then fails too); the heartbeat's own file is removed at the end."""
    f = tmp_path / "health.json"
    f.write_text("precious\n")
    link = tmp_path / "link.json"
    link.symlink_to(f)
    for path in (f, link):
        hb = Heartbeat(str(path))
        assert not hb.beat("registered") and hb.failures == 1
        hb.clear()
    assert f.read_text() == "precious\n" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["health.json", "link.json"]
    own = tmp_path / "own.json"
    hb = Heartbeat(str(own))
    assert hb.beat("connecting") and Heartbeat(str(own)).beat("registered")  # a heartbeat file: replaced
    assert hb.beat("registered")
    hb.clear()
    assert not own.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["health.json", "link.json"]


def test_a_registration_is_written_at_once_not_a_heartbeat_later(tmp_path):
    """A readiness probe right after the plugin registered sees it: the state is looked at
    between two heartbeats, and a change is written then (not up to `interval` later)."""
    f = tmp_path / "health.json"
    state = {"now": "connecting"}

    async def main():
        hb = Heartbeat(str(f), interval=60.0)
        task = asyncio.create_task(hb.run(lambda: state["now"]))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if f.exists():
                break
        assert json.loads(f.read_text())["state"] == "connecting"
        state["now"] = "registered"
        for _ in range(300):  # 3 s at most, far below the 60 s heartbeat
            await asyncio.sleep(0.01)
            if json.loads(f.read_text())["state"] == "registered":
                break
        assert json.loads(f.read_text())["state"] == "registered"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
