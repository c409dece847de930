"""The house plan holds: rooms are folders, modules stay readable, rooms meet only through
public names, and the docs' layout tables name the folders that exist (docs/architecture.md)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "shim"
DEV = REPO / "memqos_dev"  # tests, benchmarks and scripts: beside the wheel, not in it
GENERATED = {"shim/cri/api_pb2.py", "shim/cri/api_pb2_grpc.py"}
MAX_LINES = 600


def modules(top: Path = SHIM) -> list[Path]:
    return sorted(p for p in top.rglob("*.py") if "__pycache__" not in p.parts)


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def room_of_module(dotted: str) -> str:
    """'shim.node.state' -> 'node'; a top-level module ('shim.worker') is a room of its own."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def room_of_path(p: Path) -> str:
    parts = p.relative_to(SHIM).with_suffix("").parts
    return parts[0] if parts else ""


def rooms() -> set[str]:
    return {p.name for p in SHIM.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_no_module_above_the_limit_outside_generated_code():
    too_long = {rel(p): n for p in modules() + modules(DEV)
                if rel(p) not in GENERATED and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert too_long == {}


def private_imports_across_rooms(path: Path, tree: ast.AST) -> list[str]:
    here = room_of_path(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shim") and node.level == 0:
            there = room_of_module(node.module)
            if there == here:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{rel(path)}:{node.lineno} imports {node.module}.{alias.name}")
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")):
                found.append(f"{rel(path)}:{node.lineno} imports from the private module {node.module}")
    return found


def test_no_room_imports_a_private_name_of_another():
    found = []
    for p in modules():
        found += private_imports_across_rooms(p, ast.parse(p.read_text(encoding="utf-8")))
    assert found == []


def test_the_private_import_check_sees_one():
    tree = ast.parse("from shim.node.state import _pod_facts\nfrom shim.node.state import NodeState\n")
    assert private_imports_across_rooms(SHIM / "container" / "rewriter.py", tree) == [
        "shim/container/rewriter.py:1 imports shim.node.state._pod_facts"]
    assert private_imports_across_rooms(SHIM / "node" / "reconciler.py", tree) == []


def test_no_flat_modules_beside_the_rooms():
    """Only the package's entry points and the side-thread base sit at the top of shim/."""
    flat = sorted(p.name for p in SHIM.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "worker.py"]


def layout_rows(doc: Path) -> set[str]:
    """The folders named in the first column of a doc's table of rooms (`shim/<room>/`)."""
    text = doc.read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1] if "## Layout" in text else text.split("## The rooms", 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    return set(re.findall(r"^\| `shim/([a-z_]+)/` \|", section, flags=re.M))


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_layout_tables_name_exactly_the_room_folders(doc):
    assert layout_rows(REPO / doc) == rooms()


def dev_rows(doc: Path) -> set[str]:
    """The folders named in the first column of the table of `memqos_dev/`."""
    section = doc.read_text(encoding="utf-8").split("## Outside the runtime package", 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    return set(re.findall(r"^\| `memqos_dev/([a-z_]+)/` \|", section, flags=re.M))


def test_the_dev_table_names_exactly_the_dev_folders():
    folders = {p.name for p in DEV.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders and dev_rows(REPO / "docs" / "architecture.md") == folders
