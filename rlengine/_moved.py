"""Old import paths of moved modules: each alias warns once and is the new module itself.

A module that moved leaves a two-line file at its old path calling ``alias``; the alias
replaces itself in ``sys.modules`` with the new module, so ``from old import X`` and
``import old`` keep working (the same objects, not copies) for one minor version, with a
``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module ``old`` (being imported now) an alias of ``new``."""
    warnings.warn(f"{old} moved to {new}; the old path goes in the next minor version", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
