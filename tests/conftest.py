"""With MEMQOS_REQUIRE_SHARED=1 (as .ci/run sets), missing shared material (../shared: the
reference and the recorded kubelet traces) stops the run instead of skipping the tests that
read it."""
from __future__ import annotations

import os

import pytest

from shim.shared import shared_dir


def pytest_configure(config) -> None:
    if os.environ.get("MEMQOS_REQUIRE_SHARED") == "1" and shared_dir() is None:
        raise pytest.UsageError("MEMQOS_REQUIRE_SHARED=1 but no shared material was found: put it beside the "
                                "checkout (../shared) or set MEMQOS_SHARED (see shim/shared.py)")
