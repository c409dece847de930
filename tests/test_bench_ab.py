"""scripts/bench-ab runs end to end (no timing is asserted: numbers are for people, on a quiet
machine): two versions served side by side, the table's five rows, worktrees removed after."""
from __future__ import annotations

import subprocess

import pytest

from memqos_dev.tools import bench_ab
from memqos_dev.tools.bench.workload import REPO


def _worktrees() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "worktree", "list", "--porcelain"], capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("worktree ")]


def test_bench_ab_runs_both_versions_and_cleans_up():
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: bench-ab compares git refs")
    before = _worktrees()
    result = bench_ab.run("HEAD", "WORKTREE", blocks=1, calls=5)
    assert result["A"] == "HEAD" and result["B"] == "WORKTREE"
    for t in ("A", "B"):
        assert set(result["median"][t]) == {"small", "reply200k", "create", "passthrough", "rewrite_extra"}
        assert len(result["blocks_us"][t]["create"]) == 1
        m = result["median"][t]
        assert m["rewrite_extra"] == m["create"] - m["passthrough"]
    assert _worktrees() == before


def test_replay_slices_keep_every_call_once_in_order():
    from memqos_dev.tools.bench.workload import replay_slices

    schedule = [(0.1, "a", b"1"), (0.9, "b", b"2"), (1.0, "c", b"3"), (2.5, "d", b"4"), (2.99, "e", b"5")]
    parts = replay_slices(schedule, 1.0)
    assert [[c[1] for c in p] for p in parts] == [["a", "b"], ["c"], ["d", "e"]]
    assert all(0 <= c[0] < 1.0 for p in parts for c in p)
    assert [(round(c[0] + k * 1.0, 6), c[1], c[2]) for k, p in enumerate(parts) for c in p] == schedule
    gap = replay_slices([(0.5, "a", b""), (3.5, "b", b"")], 1.0)  # empty seconds are left out
    assert [[c[1] for c in p] for p in gap] == [["a"], ["b"]]


@pytest.mark.parametrize("mode", ["rewrite", "rewrite+finished"])
def test_bench_instructions_probe_runs_on_this_tree(mode):
    """scripts/bench-instructions' probe (run under callgrind there) works with today's hooks."""
    import sys

    from memqos_dev.tools.bench.hook_instructions import PROBE

    p = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); exec({PROBE!r})",
                        "5", mode], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
