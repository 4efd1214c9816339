"""DESIGN.md's import rules, enforced: import-linter contracts plus light-import checks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def installed_layout(tmp_path: Path) -> Path:
    """A copy of the Python sources laid out as the wheel installs them (`deepinfer/engine`,
    ...: setup.py maps the repository's top-level directories into the package); returns the
    folder to put on sys.path. import-linter and grimp walk a package's own folder."""
    package = tmp_path / "deepinfer"
    shutil.copytree(ROOT / "deepinfer", package, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("engine", "kernels", "kvstore", "server", "router"):
        shutil.copytree(ROOT / part, package / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.cpp", "*.h", "*.json"))
    return tmp_path


def test_import_linter_contracts_hold(tmp_path):
    """pyproject.toml's contracts over `deepinfer`, checked on the installed layout."""
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.fail("lint-imports is missing: install the test extras (pip install -e '.[test]')")
    installed_layout(tmp_path)
    result = subprocess.run([lint, str(ROOT / "pyproject.toml")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout and " 0 kept" not in result.stdout


@pytest.mark.parametrize("module", ["deepinfer.engine", "deepinfer.engine.scheduler", "deepinfer.engine.kv_cache",
                                    "deepinfer.engine.config", "deepinfer.router", "deepinfer.kvstore"])
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_engine_public_api_without_server():
    code = ("import sys; from deepinfer.engine import LLM, SamplingParams, AsyncLLM; "
            "assert not any(m == 'deepinfer.server' or m.startswith('deepinfer.server.') for m in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) of the graph `imports` (module -> modules it imports): Tarjan's algorithm, with an
    explicit stack."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in imports.get(node, ()):
                    components.append(sorted(component))
    return components


def test_cycle_finder_finds_a_lazy_two_module_cycle():
    assert _cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_among_deepinfer_modules(tmp_path):
    """DESIGN.md: arrows point one way, inside packages too. Every import counts, the ones
    inside functions (lazy) included; `if TYPE_CHECKING:` imports do not (grimp's graph of the
    installed layout)."""
    pytest.importorskip("grimp")   # comes with import-linter (the test extras)
    dump = ("import json, grimp; g = grimp.build_graph('deepinfer', cache_dir=None, "
            "exclude_type_checking_imports=True); print(json.dumps("
            "{m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))")
    layout = installed_layout(tmp_path)
    result = subprocess.run([sys.executable, "-c", dump], cwd=layout, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(layout)})
    assert result.returncode == 0, result.stderr
    imports = {m: set(targets) for m, targets in json.loads(result.stdout).items()}
    assert "deepinfer.kernels.rotary" in imports and len(imports) > 100   # the whole tree
    assert _cycles(imports) == []


def _private_cross_module_uses(path: Path) -> list[str]:
    """`from deepinfer.kernels.X import _name` and `X._name` (X a kernels module imported by
    name) in the source file `path`, as "line: text"."""
    import ast

    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepinfer.kernels"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif node.module == "deepinfer.kernels":
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_kernels_use_no_private_names_of_other_kernel_modules():
    found = {path.name: uses for path in sorted((ROOT / "kernels").rglob("*.py"))
             if (uses := _private_cross_module_uses(path))}
    assert found == {}
