"""The house plan holds: rooms are folders, modules stay readable, rooms meet only through
public names, the runtime package imports neither the development package beside it nor
grpcio (the generated service stubs aside), the docs' layout tables name the folders that exist
(docs/architecture.md), and imports run one way: no circle between the project's modules (shim/,
e2e/, memqos_dev/; imports inside functions included) and no room of shim/ importing one on its
own or a later line of the rooms' order, which docs/architecture.md's "Who imports whom" writes
down and this file reads."""
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


# -- imports run one way ---------------------------------------------------------------------------
ARCHITECTURE = REPO / "docs" / "architecture.md"
# Lazy imports (inside a function) that may run against the rooms' order, each named with the reason:
# {(importing module, imported module): why}. None today.
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {}


def room_order(doc: Path = ARCHITECTURE) -> dict[str, int]:
    """The level of each room (a folder of shim/) and top-level module of shim/, as the numbered
    list of docs/architecture.md's "Who imports whom" writes them: "1. `decision/`, `worker.py`"."""
    section = doc.read_text(encoding="utf-8").split("\n## Who imports whom\n", 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    order = {}
    for level, line in re.findall(r"^(\d+)\. (.+)$", section, flags=re.M):
        for name, _kind in re.findall(r"`(\w+)(/|\.py)`", line):
            assert name not in order, f"{name} is on two lines of the order"
            order[name] = int(level)
    return order


def project_modules() -> dict[str, Path]:
    """Every module of the project by the name it is imported as: shim.* and memqos_dev.* from the
    checkout, e2e's modules by their file name (e2e/ is on the guest's path)."""
    out = {}
    for top in (SHIM, DEV):
        for p in modules(top):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    for p in modules(E2E):
        out[p.stem] = p
    return out


def imported_names(path: Path, tree: ast.AST, package: str) -> list[tuple[int, str, bool]]:
    """(line, dotted name, lazy) of every import in a module, at any depth; ``from a import b``
    gives ``a.b`` (a module, or a name of ``a``: the caller resolves); relative imports resolved
    against ``package``."""
    lazy_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
    found = []
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, lazy) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if base else a.name, lazy) for a in node.names]
    return found


def resolve(name: str, known) -> str | None:
    """The longest prefix of a dotted name that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def import_graph(sources: dict[str, tuple[Path, str]]) -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """module -> {imported project module: [(line, lazy)]}, from {module: (path, source)}."""
    graph: dict[str, dict[str, list[tuple[int, bool]]]] = {}
    for mod, (path, text) in sources.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for line, name, lazy in imported_names(path, ast.parse(text), package):
            there = resolve(name, sources)
            if there and there != mod:
                edges.setdefault(there, []).append((line, lazy))
    return graph


def project_graph():
    return import_graph({m: (p, p.read_text(encoding="utf-8")) for m, p in project_modules().items()})


def circles(graph) -> list[list[str]]:
    """The import circles: each strongly connected group of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # recursive: import chains are far shorter than Python's limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_between_the_projects_modules():
    assert circles(project_graph()) == []


def test_the_circle_check_sees_one_through_a_lazy_import():
    sources = {"guest": (E2E / "guest.py", "import nri_scenario\nimport guest_common\n"),
               "nri_scenario": (E2E / "nri_scenario.py", "import guest_common\ndef f():\n    import guest\n"),
               "guest_common": (E2E / "guest_common.py", "import os\n"),
               "shim.app.cli": (SHIM / "app" / "cli.py", "def f():\n    from shim.tools.explain import register\n"),
               "shim.tools.explain": (SHIM / "tools" / "explain.py", "from shim.app import cli\n"),
               "shim.app": (SHIM / "app" / "__init__.py", "")}
    assert circles(import_graph(sources)) == [["guest", "nri_scenario"], ["shim.app.cli", "shim.tools.explain"]]


def in_shim(module: str) -> bool:
    return module == "shim" or module.startswith("shim.")


def room_of(module: str) -> str:
    """A room as the order names it: 'shim.node.state' -> 'node', 'shim.worker' -> 'worker',
    'shim' (the package's __init__) -> '__init__'."""
    return room_of_module(module) or "__init__"


def imports_against_the_order(graph, order: dict[str, int], exceptions=LAZY_EXCEPTIONS) -> list[str]:
    """Imports in shim/ from a room to a room on the same or a later line of the order; a lazy
    import is let through only when ``exceptions`` names it."""
    found = []
    for mod, edges in sorted(graph.items()):
        if not in_shim(mod):
            continue
        here = room_of(mod)
        for there_mod, sites in sorted(edges.items()):
            there = room_of(there_mod)
            if there == here or not in_shim(there_mod):
                continue
            if order[there] < order[here]:
                continue
            for line, lazy in sites:
                if lazy and (mod, there_mod) in exceptions:
                    continue
                found.append(f"{mod}:{line} ({here}, line {order[here]}) imports {there_mod} "
                             f"({there}, line {order[there]}){' in a function' if lazy else ''}")
    return found


def test_the_order_names_every_room_and_top_level_module_once():
    top = {p.stem for p in SHIM.glob("*.py")}
    assert set(room_order()) == rooms() | top


def test_no_room_imports_upward_in_the_order():
    assert imports_against_the_order(project_graph(), room_order()) == []


def test_the_order_check_sees_an_upward_import_and_an_unnamed_lazy_one():
    sources = {"shim.app.cli": (SHIM / "app" / "cli.py", "from shim.app.config import OPTIONS\n"
                                "def f():\n    from shim.tools.explain import register\n"),
               "shim.app.config": (SHIM / "app" / "config.py", ""),
               "shim.tools.explain": (SHIM / "tools" / "explain.py", "from shim.app.config import OPTIONS\n"),
               "shim.cri.facts": (SHIM / "cri" / "facts.py", "import shim.nri.facts\n"),
               "shim.nri.facts": (SHIM / "nri" / "facts.py", "from shim.decision import facts\n"),
               "shim.decision.facts": (SHIM / "decision" / "facts.py", ""),
               "shim.decision": (SHIM / "decision" / "__init__.py", "")}
    graph = import_graph(sources)
    order = room_order()
    assert imports_against_the_order(graph, order) == [
        "shim.app.cli:3 (app, line 6) imports shim.tools.explain (tools, line 7) in a function",
        "shim.cri.facts:1 (cri, line 2) imports shim.nri.facts (nri, line 2)"]
    named = {("shim.app.cli", "shim.tools.explain"): "the reason, written here"}
    assert imports_against_the_order(graph, order, named) == [
        "shim.cri.facts:1 (cri, line 2) imports shim.nri.facts (nri, line 2)"]
