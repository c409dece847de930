"""scripts/bench-ab runs end to end (no timing is asserted: numbers are for people, on a quiet
machine): two versions served side by side, the table's four rows, worktrees removed after."""
from __future__ import annotations

import subprocess

import pytest

from shim import bench_ab
from shim.bench import REPO


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
        assert set(result["median"][t]) == {"small", "create", "passthrough", "rewrite_extra"}
        assert len(result["blocks_us"][t]["create"]) == 1
        m = result["median"][t]
        assert m["rewrite_extra"] == m["create"] - m["passthrough"]
    assert _worktrees() == before
