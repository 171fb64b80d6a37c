"""rlengine.trace: exact token traces of multi-turn sessions.

``TraceStore`` keeps every session's conversation as the token ids the model
saw and sampled (with logprobs and policy versions) in the token trie of
``rlengine.trace.trie``, and exports one ``Trajectory`` per branch for training.
See ``rlengine.trace.store`` for the contract.

The store's names load on first use (PEP 562): the compiled trie imports
``rlengine.trace.errors``, which runs this file, so this file must not import
the store (which imports the trie) at import time.

This package must import without torch, the engine or a backend: the serve
layer and the sandboxes' tests use it alone.
"""

from typing import Any

from rlengine.trace.errors import TraceMemoryExceeded, UnknownSession
from rlengine.trace.trajectory import KINDS, Segment, SegmentKind, Trajectory

__all__ = [
    "DEFAULT_MAX_BYTES", "KINDS", "PrefixMatch", "Segment", "SegmentKind", "TraceMemoryExceeded", "TraceStore",
    "Trajectory", "TurnEnd", "UnknownSession",
]

_FROM_STORE = ("DEFAULT_MAX_BYTES", "PrefixMatch", "TraceStore", "TurnEnd")


def __getattr__(name: str) -> Any:
    if name in _FROM_STORE:
        from rlengine.trace import store

        return getattr(store, name)
    raise AttributeError(f"module 'rlengine.trace' has no attribute {name!r}")
