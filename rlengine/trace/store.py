"""The trace store: every session's conversation as the exact token ids the
model saw and sampled, in one token trie.

Multi-turn agents resend their whole conversation each turn; re-tokenizing
it does not give back what the model sampled. The store keeps each
session's tokens as stored, with each sampled token's logprob and policy
version, so the next prompt is the stored path plus only the newly rendered
suffix, and the training data is exact:

    store = TraceStore()
    turn = store.append_turn("s1", prompt_ids)                 # kind="prompt"
    turn = store.append_turn("s1", sampled_ids, logprobs, versions,
                             kind="sampled", request_id="r1", parent=turn.handle)
    turn = store.append_turn("s1", tool_output_ids, kind="environment", parent=turn.handle)
    prompt = store.path_tokens("s1", turn.handle)              # the next prompt, exactly
    # a client that resends a history diverging at some point:
    match = store.longest_prefix("s1", resent_ids)             # (length, handle)
    store.append_turn("s1", resent_ids[match.length:], parent=match.handle)  # a branch
    trajectories = store.export("s1")                          # one per leaf
    store.drop("s1")                                           # memory back

Sessions map to trees of one trie; a session's branches share their
prefixes. Sessions opened with the same ``share`` key also share stored
prompts: the sessions of a group, or every session of a run, store an
identical system prompt or group prompt once (with a reference count), not
once per session:

    store.open("g7-s0", share="run")                           # or share="group-7"
    store.append_turn("g7-s0", system_and_task_ids)           # stored once for all of them

What is shared is a session's prompt before anything else it stores (one
or more ``kind="prompt"`` turns without request id or logprobs, from the
root on); every sampled and environment token, and anything after them,
stays the session's own, so two sessions never share a logprob, a version,
a request id or a kind. Sharing changes no answer: a session's matches,
exports and segments are exactly those of a session of its own, its
handles name positions in its own conversation (a shared prompt's end is
one handle in every session holding it), and ``drop`` frees what no other
session holds. The trie's memory is bounded (``max_bytes``, shared tokens
counted once): a call that would exceed it raises ``TraceMemoryExceeded``
and stores nothing.

Loop-thread only: like all engine state, a store is touched only on the
engine's loop thread. Each call is atomic under the GIL, but a turn is
several calls (match, render, append) whose handles must not be pruned in
between, and only one thread can guarantee that.

This module must not import torch or the engine, and must not copy a
conversation into Python lists: tokens stay int32 buffers end to end.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any, NamedTuple

import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.trace.errors import TraceMemoryExceeded, UnknownSession
from rlengine.trace.trajectory import KINDS, Segment, SegmentKind, Trajectory
from rlengine.trace.trie import KIND_ENVIRONMENT, KIND_PROMPT, KIND_SAMPLED, TokenTrie

__all__ = ["DEFAULT_MAX_BYTES", "PrefixMatch", "TraceStore", "TurnEnd"]

_KIND_CODES: dict[str, int] = {"prompt": KIND_PROMPT, "sampled": KIND_SAMPLED, "environment": KIND_ENVIRONMENT}
_KIND_NAMES: dict[int, SegmentKind] = {KIND_PROMPT: "prompt", KIND_SAMPLED: "sampled",
                                       KIND_ENVIRONMENT: "environment"}

DEFAULT_MAX_BYTES = 1 << 30
"""1 GiB: about 85 M stored tokens at 12 bytes each plus node records."""


class TurnEnd(NamedTuple):
    """Where an appended turn ends."""

    handle: int
    """Names the end of the turn; pass it as ``parent`` to continue from there."""
    depth: int
    """Tokens from the session's root to the end of the turn."""
    reused: int
    """Tokens of this call that were already stored (kept as stored, not stored again)."""


class PrefixMatch(NamedTuple):
    """How much of a token sequence a session already holds."""

    length: int
    """Leading tokens found on a stored path (from ``parent``, or from the root)."""
    handle: int
    """Names the end of the match: append the rest there to branch off."""


class _Session:
    """A session's root and the request ids its segments refer to."""

    __slots__ = ("request_ids", "request_index", "root", "share", "view")

    def __init__(self, root: int, share: str | None) -> None:
        self.root = root
        self.share = share
        self.view = None if share is None else root
        """The trie view its walks see through (its root), or None for a tree of its own."""
        # Request ids are interned per session so the trie stores an int64;
        # they go away with the session.
        self.request_ids: list[str] = []
        self.request_index: dict[str, int] = {}

    def intern(self, request_id: str) -> int:
        idx = self.request_index.get(request_id)
        if idx is None:
            idx = self.request_index[request_id] = len(self.request_ids)
            self.request_ids.append(request_id)
        return idx


class TraceStore:
    """Sessions of exact token traces over one token trie. Loop-thread only.

    ``max_bytes`` bounds the memory the trie holds (0: unbounded).
    ``trie_class`` replaces the implementation ``rlengine.trace.trie`` chose (the
    tests run the store over both).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, *, trie_class: type | None = None) -> None:
        self._trie: Any = (trie_class or TokenTrie)(max_bytes)
        self._sessions: dict[str, _Session] = {}
        self._shared: dict[str, int] = {}
        """share key -> the root of its shared tree (freed by the trie with its last session)."""

    # -- sessions -------------------------------------------------------------

    def open(self, session: str, *, share: str | None = None) -> int:
        """The root handle of ``session``, which is created if new.

        A new session opened with a ``share`` key shares stored prompts with
        the other sessions of that key (see the module docstring); None
        gives it a tree of its own. Opening an existing session returns its
        root; naming another key than it was opened with is refused.
        """
        if not isinstance(session, str):
            raise InvalidRequest("session", session, "must be a str")
        if share is not None and not isinstance(share, str):
            raise InvalidRequest("share", share, "must be a str or None")
        s = self._sessions.get(session)
        if s is None:
            root = self._trie.new_root() if share is None else self._new_view(share)
            s = self._sessions[session] = _Session(root, share)
        elif share is not None and share != s.share:
            raise InvalidRequest("share", share, f"session {session!r} was opened with share={s.share!r}")
        return s.root

    def _new_view(self, share: str) -> int:
        shared = self._shared.get(share)
        if shared is None:
            shared = self._shared[share] = self._trie.new_shared_root()
        try:
            return self._trie.new_view(shared)
        except TraceMemoryExceeded:
            if self._trie.refs(shared) == 0:  # made for this session alone: nothing to keep
                self._trie.prune(shared)
                del self._shared[share]
            raise

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> Iterator[str]:
        return iter(list(self._sessions))

    def _session(self, session: str) -> _Session:
        s = self._sessions.get(session)
        if s is None:
            raise UnknownSession(session)
        return s

    def _position(self, s: _Session, parent: int | None, field: str = "parent") -> int:
        """``parent`` checked to be a live position of session ``s``; the root for None."""
        if parent is None:
            return s.root
        if not self._trie.holds(s.root, parent):
            raise InvalidRequest(field, parent, "a handle of another session")
        return parent

    # -- turns ----------------------------------------------------------------

    def append_turn(self, session: str, tokens: Any, logprobs: Any = None, versions: Any = None,
                    kind: SegmentKind = "prompt", request_id: str | None = None, *,
                    parent: int | None = None) -> TurnEnd:
        """Store ``tokens`` after ``parent`` (the root if None) in ``session``.

        Tokens already on a stored path from ``parent`` keep their stored
        data; the rest become one segment of ``kind``. So a client may pass
        only its new tokens with the previous turn's handle, or its whole
        conversation with ``parent=None``. ``kind="sampled"`` needs
        ``logprobs`` and ``versions`` (indexed like ``tokens``). A new session
        is opened on its first append from the root (with no share key).
        ``reused`` counts the tokens the session itself held already: a
        prompt another session of its share key stored is taken up, not
        reused, though it is stored only once.
        """
        code = _KIND_CODES.get(kind) if isinstance(kind, str) else None
        if code is None:
            raise InvalidRequest("kind", kind, f"must be one of {KINDS}")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest("request_id", request_id, "must be a str or None")
        if parent is None:
            self.open(session)
        s = self._session(session)
        at = self._position(s, parent)
        rid = -1 if request_id is None else s.intern(request_id)
        handle, reused = self._trie.insert(at, tokens, logprobs, versions, code, rid, s.view)
        return TurnEnd(handle, self._trie.depth(handle), reused)

    def longest_prefix(self, session: str, tokens: Any, *, parent: int | None = None) -> PrefixMatch:
        """How many leading ``tokens`` ``session`` holds after ``parent`` (root if None).

        The returned handle marks the end of the match, so appending the rest
        there branches at the divergence point. Marking it may split a stored
        edge; it never stores a token.
        """
        s = self._session(session)
        handle, length = self._trie.seek(self._position(s, parent), tokens, s.view)
        return PrefixMatch(length, handle)

    def path_tokens(self, session: str, handle: int) -> np.ndarray:
        """The token ids from the root of ``session`` to ``handle``: a read-only int32 array."""
        s = self._session(session)
        return np.frombuffer(self._trie.path_tokens(self._position(s, handle, "handle")), dtype=np.int32)

    def depth(self, session: str, handle: int) -> int:
        s = self._session(session)
        return self._trie.depth(self._position(s, handle, "handle"))

    def on_path(self, session: str, handle: int, marked: Container[int]) -> dict[int, int]:
        """Of the ``marked`` handles of ``session``, those on the path from its root to ``handle``
        (``handle`` included), each with its depth: where on that path each marked position lies.

        A handle names one position for as long as it lives, whatever edges later splits
        made, so a position marked when a turn was stored is found on every branch through it."""
        s = self._session(session)
        at: int | None = self._position(s, handle, "handle")
        found: dict[int, int] = {}
        while at is not None and at != s.root:
            if at in marked:
                found[at] = self._trie.depth(at)
            at = self._trie.parent(at)
        return found

    # -- export and drop ------------------------------------------------------

    def export(self, session: str) -> list[Trajectory]:
        """One trajectory per leaf of ``session``, depth first, branches in creation order."""
        s = self._session(session)
        out: list[Trajectory] = []
        prev: np.ndarray | None = None
        for leaf in self._trie.leaves(s.root):
            tokens, logprobs, versions, mask = self._trie.export_path(leaf)
            current = np.frombuffer(tokens, dtype=np.int32)
            shared = 0
            if prev is not None:
                # In a trie, equal token prefixes from one root are one path,
                # so the common token prefix is exactly the shared one.
                m = min(len(prev), len(current))
                diff = np.flatnonzero(prev[:m] != current[:m])
                shared = int(diff[0]) if diff.size else m
            segments = tuple(
                Segment(start=start, end=end, kind=_KIND_NAMES[kind],
                        request_id=None if rid < 0 else s.request_ids[rid])
                for start, end, kind, rid in self._trie.path_segments(leaf)
            )
            out.append(Trajectory(session=session, leaf=leaf, shared_prefix=shared, tokens_raw=tokens,
                                  logprobs_raw=logprobs, versions_raw=versions, loss_mask_raw=mask,
                                  segments=segments))
            prev = current
        return out

    def drop(self, session: str) -> int:
        """Forget ``session`` and free its memory; returns the tokens freed.

        Its handles become invalid, except those of shared prompt positions
        other sessions still hold (valid for them, no longer for it). What
        other sessions of its share key hold stays, so the tokens freed may
        be fewer than the session held. Data blocks it empties go back to
        the allocator at once; scattered leftovers once they outweigh live
        data.
        """
        s = self._session(session)
        freed = self._trie.prune(s.root)
        del self._sessions[session]
        if s.share is not None and not self._trie.is_live(self._shared[s.share]):
            del self._shared[s.share]  # its last session: the trie freed the shared root
        return freed

    # -- accounting -----------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Bytes the trie holds (arena capacity and node records)."""
        return self._trie.memory_bytes

    @property
    def max_bytes(self) -> int:
        return self._trie.max_bytes

    @property
    def live_tokens(self) -> int:
        """Tokens stored across all sessions (shared prefixes counted once)."""
        return self._trie.live_tokens

    def stats(self) -> dict[str, int]:
        """The trie's figures (``rlengine.trace.trie``), with ``sessions`` and ``share_keys`` in use."""
        return {"sessions": len(self._sessions), "share_keys": len(self._shared), **self._trie.stats()}
