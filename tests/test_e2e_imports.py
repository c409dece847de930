"""Every module of the real-kernel suite (e2e/) imports on the host as it does in the VM, so a
broken import fails here and not 20 minutes into a boot. scripts/e2e-vm runs
``.venv/bin/python e2e/guest.py ...`` in the guest: e2e/ is the script's directory and guest.py puts
the checkout and e2e/ first on sys.path; each module is imported alone in a fresh interpreter with
that path, and guest.py is run as the entry point it is. guest.py is only that entry point: no
module imports it (it would run a second time under the name ``guest``)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "e2e"
MODULES = sorted(p.stem for p in E2E.glob("*.py"))
# the path guest.py sets up in the VM: the checkout, then e2e/ (also the script's own directory)
GUEST_PATH = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(E2E)!r}, {str(E2E)!r}]"


def guest_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_suite_has_modules():
    assert {"guest", "guest_common", "guest_stack", "nri_scenario", "expect"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_e2e_module_imports_alone_on_the_guests_path(module, tmp_path):
    code = f"{GUEST_PATH}\nimport {module}\nprint('guest' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=guest_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    # importing a module never brings in the entry point (only guest itself is guest)
    assert p.stdout.split() == [str(module == "guest")]


def test_the_entry_point_runs_as_the_vm_runs_it(tmp_path):
    """``python e2e/guest.py`` as scripts/e2e-vm starts it, up to its arguments: every scenario
    module it imports at the top is importable under ``__main__``."""
    p = subprocess.run([sys.executable, str(E2E / "guest.py"), "--help"], cwd=tmp_path, env=guest_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--nri" in p.stdout and "--pressure" in p.stdout


def is_sys_modules(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" \
        and isinstance(node.value, ast.Name) and node.value.id == "sys"


def imports_of_the_entry_point(path: Path, tree: ast.AST) -> list[str]:
    """Imports (at any depth: lazy ones too) of the module ``guest``, and any module put into
    ``sys.modules`` by hand (a module registering itself under another name)."""
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n == "guest"]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("setdefault", "update", "__setitem__") and is_sys_modules(node.func.value) \
                or isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and is_sys_modules(node.value):
            found.append(f"{path.name}:{node.lineno} registers a module in sys.modules")
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def test_no_e2e_module_imports_the_entry_point_or_registers_itself():
    found = []
    for p in sorted(E2E.glob("*.py")):
        found += imports_of_the_entry_point(p, ast.parse(p.read_text(encoding="utf-8")))
    assert found == []


def test_the_entry_point_check_sees_one():
    tree = ast.parse("import sys\nsys.modules.setdefault('guest', sys.modules[__name__])\n"
                     "def f():\n    import guest as G\n    from guest import Report\n"
                     "sys.modules['g2'] = None\nimport guest_common\n")
    assert imports_of_the_entry_point(E2E / "x.py", tree) == [
        "x.py:2 registers a module in sys.modules", "x.py:4 imports guest", "x.py:5 imports guest",
        "x.py:6 registers a module in sys.modules"]
