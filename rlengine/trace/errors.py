"""Errors of the trace store and the token trie under it.

Both are recoverable (``RequestError``): the engine keeps serving, and the
caller can drop finished sessions, or open the session it named, and retry.
Each also inherits the stdlib type a generic handler would catch. Bad input
(a wrong dtype, a negative token id, a stale handle) is not here: it raises
``rlengine.errors.InvalidRequest``, a ``ValueError``.

This module imports only ``rlengine.errors``: the compiled trie imports it,
so it must not pull in the store (which imports the trie).
"""

from __future__ import annotations

from rlengine.errors import RequestError

__all__ = ["TraceMemoryExceeded", "UnknownSession"]


class TraceMemoryExceeded(RequestError, MemoryError):
    """Storing more tokens would exceed the store's memory bound.

    Nothing was stored. ``max_bytes`` is the bound, ``memory_bytes`` what the
    store held when it refused, ``tokens`` how many new tokens were refused.
    """

    def __init__(self, max_bytes: int, memory_bytes: int, tokens: int) -> None:
        self.max_bytes = max_bytes
        self.memory_bytes = memory_bytes
        self.tokens = tokens
        super().__init__(
            f"max_bytes={max_bytes}: storing {tokens} more token(s) would exceed the bound "
            f"(holding {memory_bytes} bytes); drop finished sessions or raise max_bytes"
        )


class UnknownSession(RequestError, LookupError):
    """A session id the store does not hold (never opened, or dropped)."""

    def __init__(self, session: str) -> None:
        self.session = session
        super().__init__(f"session={session!r}: no such session in the trace store (never opened, or dropped)")
