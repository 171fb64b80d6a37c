"""The layer table, enforced: the import contract, torch-free control plane, no private imports.

The contract itself lives in ``pyproject.toml`` (``[tool.importlinter]``);
these tests run it, show that it catches a violation, and check what
import-linter cannot see: that importing a control-plane module loads no
torch at module level, and that no module reaches into another module's
private names.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlengine._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlengine"

CONTROL_PLANE = [
    "rlengine", "rlengine.errors", "rlengine.types", "rlengine.protocol", "rlengine.sandbox_client",
    "rlengine.render", "rlengine.trace", "rlengine.trace.store", "rlengine.trace.trie", "rlengine.core",
    "rlengine.core.engine", "rlengine.core.sampler", "rlengine.core.records", "rlengine.core.scheduler",
    "rlengine.core.futures", "rlengine.core.compute", "rlengine.config", "rlengine.core.clients", "rlengine.seeding",
    "rlengine.serve",
    "rlengine.serve.server", "rlengine.serve.sessions", "rlengine.serve.ipc", "rlengine.serve.http",
    "rlengine.serve.router", "rlengine.rl", "rlengine.rl.loop", "rlengine.rl.run", "rlengine.rl.sandbox",
    "rlengine.backends", "rlengine.backends.sim", "rlengine.backends.torch", "rlengine.backends.torch.models",
    "rlengine.trainer.sim", "rlengine.workloads", "rlengine.cli", "rlengine.signals", "rlengine.rl.sandbox_pool",
    "rlengine.rl.sandbox_worker",
]


def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports")
    assert exe is not None, "lint-imports is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([exe, "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_import_contract_holds():
    proc = _lint_imports(ROOT, ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("how", ["import", "typing_only"])
def test_the_import_contract_catches_a_backend_importing_the_core(tmp_path, how):
    shutil.copytree(PACKAGE, tmp_path / "rlengine", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    base = tmp_path / "rlengine" / "backends" / "base.py"
    line = "from rlengine.core.engine import Engine  # noqa"
    if how == "typing_only":  # a lower layer may not import a higher one for typing either
        line = "import typing\nif typing.TYPE_CHECKING:\n    " + line
    base.write_text(base.read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    proc = _lint_imports(tmp_path, tmp_path)
    assert proc.returncode != 0
    assert "backends and trainers never import the core or serve BROKEN" in proc.stdout
    assert "rlengine.backends.base -> rlengine.core.engine" in proc.stdout


def test_importing_any_control_plane_module_loads_no_torch():
    code = (
        "import importlib, sys\n"
        f"for name in {CONTROL_PLANE!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'aiohttp') if m in sys.modules)\n"
        "assert heavy in ([], ['aiohttp']), heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


# Underscore names that are public APIs: namedtuple's methods, os._exit (a
# sandbox child process ending without running the parent's cleanup), and
# sys._current_frames (every thread's stack, for a hang dump).
_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_current_frames"}


def _defined_in(tree: ast.AST) -> set[str]:
    """Every name a module defines or assigns (functions, classes, attributes, slots, arguments)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return names


def _private_reaches(path: Path, root: Path) -> list[str]:
    """Private names of other modules a file uses: ``from rlengine.x import _name``, and
    ``obj._name`` (obj not ``self``/``cls``) where this file does not define ``_name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = _defined_in(tree)
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlengine"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # a class's own (or its base class's) members
            if node.attr not in defined and node.attr not in _PUBLIC_UNDERSCORE:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _private_reaches(path, ROOT)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("snippet, expected", [
    ("from rlengine.core.engine import _helper\n", "from rlengine.core.engine import _helper"),
    ("import rlengine.core.engine as eng\neng._helper()\n", "eng._helper"),
    ("def f(engine):\n    return engine._build_trainer()\n", "engine._build_trainer"),
    ("class A:\n    def f(self, other):\n        self._x = 1\n        return other._x + self._y\n", None),
])
def test_the_private_name_check_sees_each_kind_of_reach(tmp_path, snippet, expected):
    path = tmp_path / "probe.py"
    path.write_text(snippet, encoding="utf-8")
    found = _private_reaches(path, tmp_path)
    if expected is None:
        assert found == []  # its own members, and those of its kind, through self
    else:
        assert len(found) == 1 and found[0].endswith(expected), found


def _module_imports(path: Path) -> set[str]:
    """The rlengine modules a file imports at module level, typing-only imports included (not
    those inside functions: a lazy import is how a module reaches up without a cycle at import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            nodes.extend(node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("rlengine")}


def test_no_two_modules_import_each_other():
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _module_imports(path) if m in modules and m != name} for name, path in modules.items()}
    cycles = []
    for start in graph:  # a path back to ``start`` (depth-first; the graph has ~170 nodes)
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start and not start.startswith(tuple(f"{m}." for m in trail[1:])):
                    cycles.append(trail)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    # A package's __init__ importing its own submodules is not a cycle of two modules.
    cycles = [c for c in cycles if not all(c[0].startswith(m + ".") or m.startswith(c[0] + ".") or m == c[0]
                                           for m in c)]
    assert cycles == [], cycles


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_a_moved_module_old_path_warns_and_is_the_new_module(old, new):
    code = ("import importlib, warnings, sys\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    old = importlib.import_module({old!r})\n"
            f"print(old is sys.modules[{new!r}], [str(x.message) for x in w if x.category is DeprecationWarning])")
    if new.endswith(("ray_replicas", "ray_trainer")):
        pytest.importorskip("ray")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"True ['{old} moved to {new}; the old path goes in rlengine 0.3']"


# -- one job per file (issue 30) ------------------------------------------------------------------

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 250
"""A class longer than this says in its docstring why it is one class ("Why one class: ...")."""


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_source_file_is_over_600_lines():
    over = {str(p.relative_to(ROOT)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not over, f"split these by job (issue 30): {over}"


def test_a_class_over_250_lines_says_why_it_is_one_class():
    unexplained = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            size = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if size > MAX_CLASS_LINES and "Why one class:" not in (ast.get_docstring(node) or ""):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.name} ({size})")
    assert not unexplained, unexplained
