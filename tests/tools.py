"""Host tools some tests run (promtool, logrotate, dbus-daemon, systemd-analyze, kubectl): where they are,
and what a test does when one is missing. scripts/install-test-deps installs them; without one
a test skips, unless MEMQOS_REQUIRE_TOOLS=1 (as .ci/run sets), which makes that a failure."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# beside PATH: the sbin directories (root's tools) and what install-test-deps unpacks under out/tools
EXTRA_DIRS = ("/usr/sbin", "/sbin", str(ROOT / "out" / "tools" / "prometheus" / "usr" / "bin"),
              str(ROOT / "out" / "tools" / "kubectl" / "usr" / "bin"))


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in EXTRA_DIRS:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


def require_tool(name: str) -> str:
    """The tool's path; a skip (or, with MEMQOS_REQUIRE_TOOLS=1, a failure) when it is missing."""
    path = find_tool(name)
    if path is None:
        why = f"{name} is not installed (scripts/install-test-deps installs it)"
        if os.environ.get("MEMQOS_REQUIRE_TOOLS") == "1":
            pytest.fail(f"MEMQOS_REQUIRE_TOOLS=1 but {why}", pytrace=False)
        pytest.skip(why)
    return path
