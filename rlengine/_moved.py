"""Old import paths of moved modules: each alias warns once and is the new module itself.

A module that moved leaves a two-line file at its old path calling ``alias``; the alias
replaces itself in ``sys.modules`` with the new module, so ``from old import X`` and
``import old`` keep working (the same objects, not copies) for one minor version, with a
``DeprecationWarning`` naming the new path and the version the old one goes in
(``REMOVED_IN``). CHANGELOG.md lists the moves.
"""

from __future__ import annotations

import importlib
import sys
import warnings

MOVED = {
    "rlengine.core.config": "rlengine.config",
    "rlengine.core.ray_replicas": "rlengine.backends.ray_replicas",
    "rlengine.core.ray_trainer": "rlengine.trainer.ray_trainer",
}
"""Old module path -> new one (moved in 0.2)."""

REMOVED_IN = "0.3"
"""The version whose release removes the aliases in ``MOVED``."""


def alias(old: str) -> None:
    """Make the module ``old`` (being imported now) an alias of where it moved."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old path goes in rlengine {REMOVED_IN}", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
