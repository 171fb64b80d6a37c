"""The token trie: a forest of radix tries over int32 token ids, one
implementation chosen at import.

``TokenTrie`` stores token sequences sharing prefixes, with a float32
logprob and an int32 policy version per token (-1 for prompt and
environment tokens) and, per stored segment, its kind and request id. It is
the storage under ``rlengine.trace.TraceStore``; use that unless you need
the raw structure.

The contract, for both implementations:

* A *handle* (an int) names a node: the position at the end of its edge.
  ``new_root()`` makes an empty tree. A handle stays valid, naming the same
  position, until its node is pruned; then every call with it raises
  ``InvalidRequest``. Handles of different trees never mix (a shared
  node's handle is a position of every view holding it, see below).
* ``insert(at, tokens, logprobs=None, versions=None, kind=KIND_PROMPT,
  request_id=-1) -> (handle, matched)`` follows ``tokens`` from ``at`` as far
  as stored paths go (``matched`` tokens, whose stored data is kept) and
  stores the rest as one new segment; the handle names the end of
  ``tokens``. Pass only a new turn's tokens with ``at`` = the previous
  turn's handle, or the whole conversation with ``at`` = the root: both give
  the same tree. ``logprobs`` and ``versions`` are indexed like ``tokens``
  (only ``[matched:]`` is read); sampled segments need both (versions >= 0),
  others default to logprob 0.0 and version -1.
* ``longest_prefix(at, tokens) -> int`` only reads. ``seek(at, tokens) ->
  (handle, matched)`` also returns a handle for the end of the match (which
  may split an edge, never store a token).
* ``path_tokens(h) -> bytes`` and ``export_path(h) -> (tokens, logprobs,
  versions, loss_mask)`` copy the path root -> ``h`` as raw int32 / float32 /
  int32 / uint8 bytes (view them with ``numpy.frombuffer``);
  ``path_segments(h)`` lists its runs as ``(start, end, kind, request_id)``;
  ``leaves(h)`` lists leaf handles depth first, children in creation order;
  ``depth``, ``parent``, ``root_of``, ``is_live`` navigate.
* ``prune(h) -> int`` frees ``h``'s edge and everything below it (a root: the
  whole tree) and returns how many tokens it freed. Data blocks it empties go
  back to the allocator at once; scattered leftovers are compacted once they
  outweigh the live data.
* Shared trees: ``new_shared_root()`` makes a tree sessions share and
  ``new_view(shared_root)`` one session's view of it, whose handle is the
  view's root. A view holds one shared path from the shared root (each shared
  node counts its views: ``refs(h)``) and private nodes of its own. A prompt
  segment with request id -1 and logprobs 0.0, stored at the end of the
  view's shared path while the view has nothing of its own there, extends
  that path: equal prompts of other views are followed, not stored again.
  Everything else is the view's own, so no two views share a logprob,
  version, request id or kind. A view sees only what it holds, so every
  answer (matched counts, exports, segments, leaves and their order) is
  that of a tree of its own fed the same calls; ``matched`` counts what the
  view held already. ``insert``, ``longest_prefix`` and ``seek`` take
  ``view=`` (needed where ``at`` is a shared node: a prompt's end is one
  handle in every view holding it); ``holds(root, h)`` says whether ``h`` is
  a position of the tree of ``root`` (a view root: of that view).
  ``prune(view root)`` drops the view, freeing its own nodes and the shared
  ones no other view holds (a shared root goes with its last view); pruning
  a shared node is refused, and so is ``leaves`` of one.
* Inputs are buffers: numpy int32 / float32 arrays, ``array('i')`` /
  ``array('f')``, or raw native-endian ``bytes`` (a list works, slowly).
  Wrong dtype, wrong shape, strided buffers, negative ids, mismatched
  lengths, NaN or positive logprobs and bad versions raise ``InvalidRequest``
  (a ``ValueError``) and change nothing. With ``max_bytes`` > 0, a call that
  would hold more raises ``TraceMemoryExceeded`` (a ``MemoryError``) and
  changes nothing; shared nodes are counted once.
* Not thread-safe: one thread (the engine's loop thread) owns a trie.

``IMPLEMENTATION`` says which implementation is loaded: ``"c"`` (the
compiled ``rlengine.trace._trie``), or ``"python-reference"`` when the environment
sets ``RLENGINE_NO_EXTENSIONS=1``. A missing extension is an ImportError,
never a silent fallback: the reference is an order of magnitude slower.

This module must stay a thin shim: no logic beyond choosing.
"""

from __future__ import annotations

import os

__all__ = ["IMPLEMENTATION", "KIND_ENVIRONMENT", "KIND_PROMPT", "KIND_SAMPLED", "TokenTrie"]

if os.environ.get("RLENGINE_NO_EXTENSIONS", "").strip() == "1":
    from rlengine.trace._trie_ref import KIND_ENVIRONMENT, KIND_PROMPT, KIND_SAMPLED, TokenTrie

    IMPLEMENTATION = "python-reference"
else:
    try:
        from rlengine.trace._trie import KIND_ENVIRONMENT, KIND_PROMPT, KIND_SAMPLED, TokenTrie
    except ImportError as exc:
        raise ImportError(
            f"rlengine.trace._trie, the compiled token trie, cannot be imported ({exc}). Build it with "
            "`python -m pip install -e .` in the repository (needs a C compiler and Cython>=3), or set "
            "RLENGINE_NO_EXTENSIONS=1 to run on the slow pure-Python reference."
        ) from exc

    IMPLEMENTATION = "c"
