"""A test that skips for a missing host tool is counted at the end of the run, with the script
that installs the tools (tests/conftest.py), without -rs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_skips_for_missing_tools_are_counted_with_the_remedy(tmp_path):
    (tmp_path / "test_needs_tools.py").write_text(
        "from tests.tools import require_tool\n"
        "def test_one():\n    require_tool('memqos-no-such-tool-1')\n"
        "def test_two():\n    require_tool('memqos-no-such-tool-2')\n"
        "def test_other_skip():\n    import pytest; pytest.skip('not this host')\n")
    env = {k: v for k, v in os.environ.items() if k != "MEMQOS_REQUIRE_TOOLS"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_needs_tools.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 tests skipped: host tools not installed; scripts/install-test-deps installs them" in p.stdout
