"""scripts/demo on a fresh checkout (a copy of what the demo needs, without .venv): it says what
it installs, installs the runtime package alone (none of the test extras) into .venv, where the
command then is, runs the demo, and a second run installs nothing."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_ONLY = {"grpcio", "grpcio-tools", "matplotlib", "pytest", "hypothesis", "kubernetes-validate"}
RUNTIME = {"memqos-shim", "protobuf", "pyyaml", "prometheus-client", "uvloop", "hpack", "jeepney"}


def fresh_checkout(base: Path) -> Path:
    root = base / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "scripts/setup", "scripts/demo"):
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "shim", root / "shim", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def run(root: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHON"] = getattr(sys, "_base_executable", None) or "python3"
    return subprocess.run(list(cmd), cwd=root, env=env, capture_output=True, text=True, timeout=900)


def test_a_first_demo_installs_the_runtime_package_only_and_says_so(tmp_path):
    root = fresh_checkout(tmp_path)
    first = run(root, "bash", "scripts/demo")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "== installing memqos-shim and its runtime dependencies into .venv" in first.stderr
    assert "== installed in " in first.stderr and "== running the demo" in first.stderr
    assert "{} -> {memory.low=256Mi (268435456), memory.min=230.4Mi (241590272)}" in first.stdout
    listed = run(root, ".venv/bin/python", "-c", "import importlib.metadata as m, json; "
                 "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))")
    names = {name.lower().replace("_", "-") for name in json.loads(listed.stdout)}
    assert RUNTIME <= names and not names & TEST_ONLY, names & TEST_ONLY
    assert run(root, ".venv/bin/memqos-shim", "--version").stdout.startswith("memqos-shim ")
    again = run(root, "bash", "scripts/demo")
    assert again.returncode == 0 and "== install" not in again.stderr, again.stderr
