"""Where the project's shared material is (``../shared``: reference documents, recorded
kubelet traces): the benchmarks and the tests read it.

In order: ``$MEMQOS_SHARED``; ``shared`` beside this checkout; ``shared`` beside the
repository this checkout was cloned from, when its origin is a local path (a clone made for
CI somewhere else, e.g. ``git clone -q . /tmp/fresh``). None when none of them exists.
"""
from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _origin_sibling(repo: Path) -> Path | None:
    try:
        url = subprocess.run(["git", "-C", str(repo), "config", "--get", "remote.origin.url"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if url.startswith("file://"):
        url = url[len("file://"):]
    if not url.startswith("/"):
        return None
    return Path(url).resolve().parent / "shared"  # resolve: a clone of "." has origin /x/main/.


def find_shared(repo: Path, env: str | None) -> Path | None:
    candidates = [Path(env)] if env else []
    candidates.append(repo.parent / "shared")
    origin = _origin_sibling(repo)
    if origin is not None:
        candidates.append(origin)
    for c in candidates:
        if (c / "traces").is_dir() or (c / "reference").is_dir():
            return c.resolve()
    return None


@lru_cache(maxsize=1)
def shared_dir() -> Path | None:
    return find_shared(REPO, os.environ.get("MEMQOS_SHARED"))


def shared_path(*parts: str) -> Path:
    """A path under the shared directory (under ``../shared`` when there is none, so that
    messages name the expected place)."""
    return (shared_dir() or REPO.parent / "shared").joinpath(*parts)
