"""Where tests, benchmarks and CI find the shared material (shim/shared.py, scripts/shared-dir)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shim.shared import REPO, find_shared


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def _layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """work/main (a repository) with work/shared/traces beside it, and a clone of it (made
    from inside it, as `git clone -q . /elsewhere/fresh` does) elsewhere."""
    main = tmp_path / "work" / "main"
    main.mkdir(parents=True)
    (tmp_path / "work" / "shared" / "traces").mkdir(parents=True)
    _git("init", "-q", cwd=main)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x", cwd=main)
    fresh = tmp_path / "elsewhere" / "fresh"
    fresh.parent.mkdir()
    _git("clone", "-q", ".", str(fresh), cwd=main)
    return main, fresh, tmp_path / "work" / "shared"


def test_beside_the_checkout_then_beside_its_origin(tmp_path):
    main, fresh, shared = _layout(tmp_path)
    assert find_shared(main, None) == shared.resolve()
    assert find_shared(fresh, None) == shared.resolve()  # origin is ".../work/main/."
    other = tmp_path / "other"
    (other / "reference").mkdir(parents=True)
    assert find_shared(fresh, str(other)) == other.resolve()  # MEMQOS_SHARED first
    lone = tmp_path / "lone"
    lone.mkdir()
    _git("init", "-q", cwd=lone)
    assert find_shared(lone, None) is None


def test_the_ci_script_agrees(tmp_path):
    _, fresh, shared = _layout(tmp_path)
    (fresh / "scripts").mkdir()
    (fresh / "scripts" / "shared-dir").write_text((REPO / "scripts" / "shared-dir").read_text())
    env = {k: v for k, v in os.environ.items() if k != "MEMQOS_SHARED"}
    out = subprocess.run(["bash", str(fresh / "scripts" / "shared-dir")], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == str(shared.resolve())
    (shared / "traces").rmdir()
    out = subprocess.run(["bash", str(fresh / "scripts" / "shared-dir")], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "no shared material" in out.stderr
