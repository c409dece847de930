"""README.md says where the command is in a checkout (what scripts/setup makes), how to install
the package elsewhere and how to get the tools some tests need; docs/testing.md gives the suite's
time as measured, with the machine."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_says_where_the_command_is_in_a_checkout():
    assert "`.venv/bin/memqos-shim`" in README and "`scripts/setup`" in README
    # what scripts/setup reports when it installs is the same path
    assert "installed in $(( $(date +%s) - t0 )) s: .venv/bin/memqos-shim" in (REPO / "scripts" / "setup").read_text()
    if Path(sys.prefix).resolve() == (REPO / ".venv").resolve():  # the suite runs in the checkout's .venv
        assert (REPO / ".venv" / "bin" / "memqos-shim").is_file()


def test_readme_has_an_install_line_outside_a_checkout():
    assert re.search(r"`python3 -m venv (\S+) && \1/bin/pip install \.`", README)
    assert "/opt/memqos-shim/bin/memqos-shim" in README


def test_readme_development_line_names_the_test_tools_script():
    dev = README.split("Development: ", 1)[1]
    assert "scripts/install-test-deps" in dev and (REPO / "scripts" / "install-test-deps").is_file()
    assert "-rs" in dev


def test_the_suite_time_is_measured_with_the_machine():
    text = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("scripts/test "))
    assert "~1 min" not in line
    assert re.search(r"\d+(\.\d+)? min \(\d+ s\) on a \d+-core host at load \d", line), line
