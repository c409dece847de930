"""The house plan holds: rooms are folders, modules stay readable, rooms meet only through
public names, the runtime package imports neither the development package beside it nor
grpcio (the generated service stubs aside), and the docs' layout tables name the folders that exist
(docs/architecture.md)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "shim"
DEV = REPO / "memqos_dev"  # tests, benchmarks and scripts: beside the wheel, not in it
E2E = REPO / "e2e"  # the real-kernel suite's guest and host helpers
GENERATED = {"shim/cri/api_pb2.py", "memqos_dev/testing/cri_grpc.py"}
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
    too_long = {rel(p): n for p in modules() + modules(DEV) + modules(E2E)
                if rel(p) not in GENERATED and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert too_long == {}


def test_the_size_rule_sees_the_e2e_guest():
    assert "e2e/guest.py" in {rel(p) for p in modules(E2E)}


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


@pytest.mark.parametrize("doc", ["docs/architecture.md"])
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


def dev_imports(path: Path, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found += [f"{rel(path)}:{node.lineno} imports {n}" for n in names
                  if n == "memqos_dev" or n.startswith("memqos_dev.")]
    return found


def test_the_runtime_package_imports_nothing_of_the_dev_package():
    """The wheel holds shim/ only: an import of memqos_dev there breaks every installed node.
    (A module run as ``python -m memqos_dev...`` is spelled in a string; these are searched too.)"""
    found = []
    for p in modules():
        text = p.read_text(encoding="utf-8")
        found += dev_imports(p, ast.parse(text))
        found += [f"{rel(p)}: names memqos_dev" for line in text.splitlines()
                  if "memqos_dev" in line and not line.lstrip().startswith("#")][:1]
    assert found == []


def test_the_dev_import_check_sees_one():
    tree = ast.parse("import memqos_dev.testing\nfrom memqos_dev.tools import bench_ab\nimport shim.cri\n")
    assert dev_imports(SHIM / "tools" / "x.py", tree) == [
        "shim/tools/x.py:1 imports memqos_dev.testing", "shim/tools/x.py:2 imports memqos_dev.tools"]


def imports_of_room(room: str) -> set[str]:
    """The other rooms (and top-level modules) a room imports from."""
    out = set()
    for p in (SHIM / room).rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("shim."):
                out.add(room_of_module(node.module))
            elif isinstance(node, ast.Import):
                out.update(room_of_module(a.name) for a in node.names if a.name.startswith("shim."))
    return out - {room}


@pytest.mark.parametrize("room, allowed", [
    ("decision", set()),  # pure: nothing of the shim's
    ("effects", {"decision"}),
    ("transport", set()),  # knows no CRI, no policy: the method table and hooks are handed to it
    # the NRI protocol over the transport's ttrpc, and its messages as decision facts and events
    # (as cri/ does for CRI); policy comes in through a Handler
    ("nri", {"transport", "decision"}),
])
def test_the_lower_rooms_import_only_below_them(room, allowed):
    assert imports_of_room(room) <= allowed


def docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def cri_paths_spelled(path: Path, tree: ast.AST) -> list[str]:
    """String constants (docstrings aside) that spell a CRI method path."""
    skip = docstrings(tree)
    return [f"{rel(path)}:{node.lineno}: {node.value}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and re.search(r"/runtime\.v1\w*\.\w+Service/", node.value)]


def test_the_transport_names_no_cri_method():
    spelled = []
    for p in (SHIM / "transport").rglob("*.py"):
        spelled += cri_paths_spelled(p, ast.parse(p.read_text(encoding="utf-8")))
    assert spelled == []


def test_the_method_check_sees_one():
    tree = ast.parse('"""Holds /runtime.v1.RuntimeService/CreateContainer."""\n'
                     'HELD = {"/runtime.v1.RuntimeService/CreateContainer"}\n')
    assert cri_paths_spelled(SHIM / "transport" / "x.py", tree) == [
        "shim/transport/x.py:2: /runtime.v1.RuntimeService/CreateContainer"]


def test_nothing_in_the_shim_imports_grpcio():
    """grpcio is no dependency of the shim: ``serve``, ``nri`` and the operator's commands run
    without it (tests/test_wheel.py runs them in a virtual environment that lacks it)."""
    found = set()
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "grpc" or n.startswith("grpc.") for n in names):
                found.add(rel(p))
    assert found == set()


def test_a_held_create_container_walks_few_modules_and_rarely_back():
    """The request side of a rewritten CreateContainer, from the relay's data_received until it
    returns (``memqos_dev/tools/call_walk.py``, the rewrite hook counted as one module): at most
    10 modules, at most 2 calls back into a module already left. A callback into the owner,
    two halves of one class calling each other or a frame generator resumed between other
    modules each add returns."""
    from memqos_dev.tools.call_walk import walk

    result = walk(hook_as_one=True)
    assert result["modules"] <= 10 and result["returns"] <= 2, result["walk"]
