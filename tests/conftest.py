"""The suite's end says how many tests skipped for host tools that are not installed (Go and
grpc-go's sources, dbus-daemon, systemd-analyze, logrotate, promtool), and what installs them:
without it those skips show only with -rs."""
from __future__ import annotations

MISSING_TOOL_MARKS = ("scripts/install-test-deps", "apt-get install")


def missing_tool_skips(reports) -> int:
    return sum(any(mark in str(r.longrepr) for mark in MISSING_TOOL_MARKS) for r in reports)


def pytest_terminal_summary(terminalreporter):
    n = missing_tool_skips(terminalreporter.stats.get("skipped", []))
    if n:
        terminalreporter.write_line(
            f"{n} test{'s' if n > 1 else ''} skipped: host tools not installed; scripts/install-test-deps "
            "installs them (-rs lists the skips)", yellow=True, bold=True)
