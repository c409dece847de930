"""The memory.high guard across a shim restart (shim/guard/episodes.py): a container the guard
relaxed gets its computed memory.high back from the next shim once it is calm; the episode file
is trusted only when it is the shim's own, and its entries are checked like request data."""
from __future__ import annotations

import json
import os
import stat
from dataclasses import replace

from shim.app.config import Config
from shim.decision.guard import GuardConfig
from shim.guard.episodes import EpisodeFile
from shim.guard.monitor import Monitor, episode_file
from shim.node.facts import KubeletFacts

try:
    from tests.test_metrics import CID, CID2, MI, UID, fake_root, pressure_text, ref, write_cgroup
except ImportError:
    from test_metrics import CID, CID2, MI, UID, fake_root, pressure_text, ref, write_cgroup

GUARD = GuardConfig(window=10.0, cooldown=20.0)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def monitor(root, refs, episodes, records, clock) -> Monitor:
    return Monitor(cgroup_root=str(root), kubelet=KubeletFacts(source="test", cgroup_driver="cgroupfs"),
                   guard=GUARD, interval=5.0, emit=records.append, sources=[lambda: list(refs)], clock=clock,
                   episodes=episodes)


def relax(root, path, records):
    """A first shim relaxes the container (crawling at 64 MiB); returns its cgroup dir."""
    cdir = root / "kubepods" / "burstable" / f"pod{UID}" / CID
    write_cgroup(cdir, current=64 * MI, high=64 * MI, max=128 * MI, pressure=pressure_text(95.0, 90.0))
    clock = Clock()
    first = monitor(root, [ref()], EpisodeFile(str(path)), records, clock)
    first.tick()
    clock.t += 10
    assert [d.verdict.value for _, d in first.tick()] == ["relax"]
    assert (cdir / "memory.high").read_text() == "max\n"
    return cdir


def calm_ticks(m: Monitor, clock: Clock, n: int) -> list[str]:
    verdicts = []
    for _ in range(n):
        clock.t += 5
        verdicts += [d.verdict.value for _, d in m.tick()]
    return verdicts


def test_relaxed_container_is_restored_by_the_next_shim(tmp_path):
    root = fake_root(tmp_path)
    path = tmp_path / "run" / "guard-episodes.json"
    records = []
    cdir = relax(root, path, records)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [entry] = json.loads(path.read_text())["episodes"]
    assert entry["mode"] == "relaxed" and entry["restore_high"] == 64 * MI and entry["ref"]["id"] == CID

    # the shim restarts; the container has calmed down; no source lists it yet (the reconciler
    # is still rebuilding its state from the runtime)
    write_cgroup(cdir, current=30 * MI, high="max", max=128 * MI, pressure=pressure_text(3.0, 1.0))
    clock = Clock(50.0)  # a new process: another monotonic origin
    second = monitor(root, [], EpisodeFile(str(path)), records, clock)
    second.tick()
    assert second.guard_states()[CID].mode == "relaxed"
    assert calm_ticks(second, clock, 4) == ["restore"]  # the cool-down (20 s) restarted with the new shim
    assert (cdir / "memory.high").read_text() == f"{64 * MI}\n"
    assert not path.exists()  # no episode open any more
    events = [r["event"] for r in records if r["event"].startswith("guard-")]
    assert events == ["guard-relax", "guard-resume", "guard-restore"]


def test_without_the_file_the_next_shim_leaves_max(tmp_path):
    """What the file is for: the same restart with episodes in memory only."""
    root = fake_root(tmp_path)
    records = []
    cdir = relax(root, tmp_path / "ge.json", records)
    write_cgroup(cdir, current=30 * MI, high="max", max=128 * MI, pressure=pressure_text(3.0, 1.0))
    clock = Clock()
    second = monitor(root, [ref()], None, records, clock)
    assert calm_ticks(second, clock, 10) == []
    assert (cdir / "memory.high").read_text() == "max\n"


def test_resumed_episode_stands_down_when_memory_high_was_rewritten(tmp_path):
    """The kubelet updated the container while no shim watched: its value stays, the episode ends."""
    root = fake_root(tmp_path)
    path = tmp_path / "ge.json"
    records = []
    cdir = relax(root, path, records)
    write_cgroup(cdir, current=30 * MI, high=96 * MI, max=128 * MI, pressure=pressure_text(3.0, 1.0))
    clock = Clock()
    second = monitor(root, [ref()], EpisodeFile(str(path)), records, clock)
    assert [d.verdict.value for _, d in second.tick()] == ["released"]
    assert calm_ticks(second, clock, 6) == []
    assert (cdir / "memory.high").read_text() == f"{96 * MI}\n"
    assert not path.exists()


def test_episode_of_a_container_that_is_gone_is_dropped(tmp_path):
    root = fake_root(tmp_path)
    path = tmp_path / "ge.json"
    records = []
    cdir = relax(root, path, records)
    for f in cdir.iterdir():
        f.unlink()
    cdir.rmdir()
    second = monitor(root, [], EpisodeFile(str(path)), records, Clock())
    second.tick()
    assert second.guard_states() == {}
    assert not path.exists()
    assert [r["event"] for r in records if r["event"].startswith("guard-")] == ["guard-relax"]  # no resume


def _episode_doc(**over) -> dict:
    entry = {"ref": {"id": CID, "namespace": "default", "pod": "web-1", "container": "app", "uid": UID,
                     "cgroup_parent": f"/kubepods/burstable/pod{UID}", "qos": "Burstable"},
             "mode": "relaxed", "restore_high": 64 * MI}
    for k, v in over.items():
        if k in entry["ref"]:
            entry["ref"][k] = v
        else:
            entry[k] = v
    return {"version": 1, "episodes": [entry]}


def _write(path, doc, mode=0o600) -> None:
    path.write_text(json.dumps(doc))
    os.chmod(path, mode)


def test_untrusted_or_malformed_files_are_ignored(tmp_path, caplog):
    path = tmp_path / "ge.json"
    good = _episode_doc()
    _write(path, good)
    assert [e.ref["id"] for e in EpisodeFile(str(path)).load()] == [CID]

    _write(path, good, 0o666)  # anyone could have forged it
    assert EpisodeFile(str(path)).load() == []
    assert "writable by others" in caplog.text

    target = tmp_path / "elsewhere.json"
    _write(target, good)
    path.unlink()
    path.symlink_to(target)
    assert EpisodeFile(str(path)).load() == []
    path.unlink()

    for bad in (_episode_doc(restore_high=0), _episode_doc(restore_high="64Mi"), _episode_doc(restore_high=True),
                _episode_doc(restore_high=None), _episode_doc(mode="watch"), _episode_doc(id=""),
                _episode_doc(cgroup_parent=["x"]), {"version": 2, "episodes": []}, ["not", "a", "doc"]):
        _write(path, bad)
        assert EpisodeFile(str(path)).load() == [], bad
    path.write_bytes(b"\xff{")
    assert EpisodeFile(str(path)).load() == []
    assert EpisodeFile(str(tmp_path / "missing.json")).load() == []


def test_hostile_entry_is_refused_and_nothing_is_written_outside_the_tree(tmp_path):
    root = fake_root(tmp_path)
    outside = tmp_path / "outside" / CID2
    write_cgroup(outside, current=30 * MI, high="max", pressure=pressure_text(0.0, 0.0))
    path = tmp_path / "ge.json"
    _write(path, {"version": 1, "episodes": [
        _episode_doc(id=CID2, cgroup_parent="/kubepods/burstable/../../../outside")["episodes"][0],
        _episode_doc(id="../../outside")["episodes"][0]]})
    records = []
    clock = Clock()
    m = monitor(root, [], EpisodeFile(str(path)), records, clock)
    (root / "kubepods" / "burstable").mkdir(parents=True)
    calm_ticks(m, clock, 8)
    assert (outside / "memory.high").read_text() == "max\n"
    refused = [r for r in records if r["event"] == "cgroup-refused"]
    assert len(refused) == 2
    assert m.guard_states() == {}


def test_unwritable_file_keeps_the_episode_in_memory(tmp_path):
    root = fake_root(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    records = []
    cdir = relax(root, blocker / "ge.json", records)  # the save fails: logged, the guard goes on
    assert (cdir / "memory.high").read_text() == "max\n"


def test_auto_path_is_next_to_the_socket(tmp_path):
    cfg = Config(guard_state="auto", listen=f"unix://{tmp_path}/s/memqos-shim.sock")
    assert episode_file(cfg).path == f"{tmp_path}/s/guard-episodes.json"
    assert episode_file(replace(cfg, guard_state=None, listen="unix:///x.sock")) is None
