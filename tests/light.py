"""Which tests a light install (the base package, no torch) can run: the selection ``conftest.py``
applies, in a module of its own so tests can import it (``conftest`` is a name every test
directory's conftest shares)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_PLANE = ("torch", "transformers")
"""Without these, the tests marked ``model_plane`` are left out."""


def missing_imports(path: Path, seen: set[Path] | None = None) -> list[str]:
    """The absent top-level packages that ``path`` imports at module level (a helper module of
    tests/ or a module beside it that it imports is followed)."""
    seen = seen if seen is not None else set()
    if path in seen:
        return []
    seen.add(path)
    missing: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
            importorskip_of(node)
        for name in names:
            top = name.split(".")[0]
            local = next((d / f"{top}.py" for d in (HERE, path.parent) if (d / f"{top}.py").exists()), None)
            if local is not None:  # a helper module of tests/, or a test module beside this one
                missing += missing_imports(local, seen)
            elif importlib.util.find_spec(top) is None:
                missing.append(top)
    return missing


def importorskip_of(node: ast.stmt) -> list[str]:
    """``x = pytest.importorskip("name")`` at a module's top: the package it needs."""
    call = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
    if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "importorskip" and call.args \
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return [call.args[0].value]
    return []
