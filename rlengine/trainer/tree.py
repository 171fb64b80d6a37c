"""Tree packing of a trainer micro-batch: every shared prefix computed once.

The datums of a GRPO group share their prompt; each turn of an agent's
session repeats the conversation so far. A causal LM's hidden state at
position ``p`` depends only on tokens ``0..p``, so datums that start with the
same tokens have the same hidden states, logits and logprobs there. A
*tree batch* holds each shared prefix once and each datum's own tokens after
it: the packed sequence is the token trie of the micro-batch in pre-order,
each packed token keeps its datum's position (its depth in the trie) as its
position id, and each attends to its ancestors only. Each datum reads its
per-token results back through ``TreeBatch.index``.

* ``tree_groups(sequences, min_prefix, budget)``: micro-batches (datum
  indices, lexicographic order) whose packed tokens stay within ``budget``,
  or None when no two sequences share ``min_prefix`` tokens.
* ``pack(sequences, min_prefix)``: the ``TreeBatch`` of one micro-batch.
  Prefixes are found by sorting: in lexicographic order the longest prefix a
  sequence shares with any earlier one is the one it shares with its
  predecessor. Shared prefixes shorter than ``min_prefix`` are not shared.
* ``tree_attention``: the attention of a tree batch, with the signature of
  transformers' attention interface (the trainer registers it; the model
  passes its ``rlengine_tree`` keyword, a ``TreeAttention``, through). The
  ancestor mask is not materialised: the packed tokens fall into
  *segments*, chains of consecutive packed tokens each the child of the
  one before, so each segment attends to its ancestors' key ranges (all of
  them) and to itself (causally). A root segment is a plain causal
  attention, as in the flat forward; a chain (an agent's turns) is one
  segment. Cost: each query against its ancestors plus the tokens of its own
  segment before it, never the whole packed length.

Pure numpy and torch; this module knows nothing of datums, losses or models.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["Segment", "TreeAttention", "TreeBatch", "pack", "tree_attention", "tree_groups"]

Ranges = tuple[tuple[int, int], ...]


class Segment(NamedTuple):
    """Packed tokens ``[start, stop)``, a chain: each the child of the one before."""

    start: int
    stop: int
    ancestors: Ranges
    """The packed ranges of the first token's proper ancestors, root first."""


class TreeBatch(NamedTuple):
    """One micro-batch packed as a tree (module docstring)."""

    tokens: np.ndarray
    """int64 [N]: the packed tokens, trie pre-order."""
    positions: np.ndarray
    """int64 [N]: each packed token's position in its datums (its depth)."""
    parents: np.ndarray
    """int64 [N]: each packed token's parent, -1 at a root."""
    index: np.ndarray
    """int64 [sum of lengths]: the packed token of each datum token, datums concatenated in the order given."""
    segments: tuple[Segment, ...]

    def attention(self, device: torch.device) -> TreeAttention:
        """The segments as ``tree_attention`` takes them, masks built on ``device``."""
        plans = []
        for seg in self.segments:
            n = seg.stop - seg.start
            keys = _merge((*seg.ancestors, (seg.start, seg.stop)))
            mask = None
            if seg.ancestors:
                shared = sum(b - a for a, b in seg.ancestors)
                mask = torch.ones((n, shared + n), dtype=torch.bool, device=device)
                mask[:, shared:] = torch.ones((n, n), dtype=torch.bool, device=device).tril()
            plans.append((seg.start, seg.stop, keys, mask))
        return TreeAttention(tuple(plans))


class TreeAttention(NamedTuple):
    """Per segment: its packed range, the key ranges it attends to (ancestors, then itself)
    and its mask over them (None: no ancestors, plain causal attention)."""

    segments: tuple[tuple[int, int, Ranges, torch.Tensor | None], ...]


def _merge(ranges: Ranges) -> Ranges:
    """``ranges`` with adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _truncate(path: Ranges, length: int) -> Ranges:
    """The first ``length`` packed tokens of a root-first path of ranges."""
    out: list[tuple[int, int]] = []
    for a, b in path:
        if length <= 0:
            break
        take = min(b - a, length)
        out.append((a, a + take))
        length -= take
    return tuple(out)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


def _shares(sequences: list[np.ndarray], min_prefix: int) -> tuple[list[int], list[int]]:
    """Lexicographic order of ``sequences`` and, in that order, how many leading tokens each
    shares with its predecessor (0 below ``min_prefix``)."""
    # Big-endian fixed-width bytes compare token by token, a prefix before its extensions.
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].astype(">u4").tobytes())
    shares = [0]
    for prev, cur in pairwise(order):
        lcp = _common_prefix(sequences[prev], sequences[cur])
        shares.append(lcp if lcp >= min_prefix else 0)
    return order, shares


def tree_groups(sequences: list[np.ndarray], min_prefix: int, budget: int) -> list[list[int]] | None:
    """Micro-batches of sequence indices, in lexicographic order, each holding at most ``budget``
    packed tokens (a sequence longer than that alone); None when none shares ``min_prefix``
    tokens with another."""
    if min_prefix < 1:
        raise ValueError(f"min_prefix={min_prefix}: must be >= 1")
    order, shares = _shares(sequences, min_prefix)
    if not any(shares):
        return None
    groups: list[list[int]] = []
    packed = 0
    for i, share in zip(order, shares):
        n = sequences[i].shape[0]
        if groups and packed + n - share <= budget:
            groups[-1].append(i)
            packed += n - share
        else:
            # A new micro-batch holds no prefix yet: the sequence is packed whole.
            groups.append([i])
            packed = n
    return groups


def pack(sequences: list[np.ndarray], min_prefix: int) -> TreeBatch:
    """The ``TreeBatch`` of ``sequences`` (1-D integer arrays, at least one token each)."""
    if min_prefix < 1:
        raise ValueError(f"min_prefix={min_prefix}: must be >= 1")
    order, shares = _shares(sequences, min_prefix)
    tokens, positions, parents = [], [], []
    paths: list[Ranges] = [()] * len(sequences)
    segments: list[Segment] = []
    size = 0
    path: Ranges = ()
    for i, share in zip(order, shares):
        seq = sequences[i]
        n = seq.shape[0]
        ancestors = _truncate(path, share)
        if n > share:
            start, stop = size, size + n - share
            parent = ancestors[-1][1] - 1 if ancestors else -1
            tokens.append(seq[share:])
            positions.append(np.arange(share, n))
            parents.append(np.concatenate([[parent], np.arange(start, stop - 1)]))
            if segments and parent >= 0 and parent == segments[-1].stop - 1 == start - 1:
                # The new tokens continue the last segment's chain: one segment.
                segments[-1] = segments[-1]._replace(stop=stop)
            else:
                segments.append(Segment(start, stop, ancestors))
            path = _merge((*ancestors, (start, stop)))
            size = stop
        else:
            path = ancestors  # a duplicate, or a prefix of its predecessor: nothing new
        paths[i] = path
    index = np.concatenate([np.arange(a, b) for p in paths for a, b in p])
    return TreeBatch(tokens=np.concatenate(tokens).astype(np.int64), positions=np.concatenate(positions),
                     parents=np.concatenate(parents).astype(np.int64), index=index, segments=tuple(segments))


def tree_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                   rlengine_tree: TreeAttention | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over one packed tree (``query`` [1, heads, N, d]; ``key`` and ``value`` may have
    fewer heads, grouped-query style); ``attention_mask`` is ignored (the tree is the mask).
    Returns ``[1, N, heads, d]`` and no weights, as transformers' SDPA attention does."""
    if rlengine_tree is None:
        raise ValueError("tree_attention needs the rlengine_tree= keyword (a TreeAttention)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = []
    for start, stop, keys, mask in rlengine_tree.segments:
        if len(keys) == 1:
            k, v = key[:, :, keys[0][0]:keys[0][1]], value[:, :, keys[0][0]:keys[0][1]]
        else:
            k = torch.cat([key[:, :, a:b] for a, b in keys], dim=2)
            v = torch.cat([value[:, :, a:b] for a, b in keys], dim=2)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:stop], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None
