"""Tree packing (``rlengine.trainer.tree``) against plain references.

References: each sequence read back through the index, the token trie's node
count (the distinct prefixes), the ancestor relation followed through
``parents``, the dense ancestor mask built from it, and torch's SDPA with
that mask for ``tree_attention`` (outputs and gradients). Hypothesis draws
the batches from a tiny alphabet so that prefixes are shared often.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlengine.trainer.tree import Segment, pack, tree_attention, tree_groups


def arrays(*seqs: list[int]) -> list[np.ndarray]:
    return [np.array(s, dtype=np.int32) for s in seqs]


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """``mask[i, j]``: packed token ``j`` is ``i`` or one of its ancestors (followed through parents)."""
    n = parents.shape[0]
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def segment_mask(n: int, segments: tuple[Segment, ...]) -> np.ndarray:
    """The mask the segments stand for: each token sees its segment's ancestors and its segment up to itself."""
    mask = np.zeros((n, n), dtype=bool)
    for seg in segments:
        for i in range(seg.start, seg.stop):
            for a, b in seg.ancestors:
                mask[i, a:b] = True
            mask[i, seg.start:i + 1] = True
    return mask


def check_packing(seqs: list[np.ndarray], min_prefix: int) -> None:
    tree = pack(seqs, min_prefix)
    offset = 0
    for seq in seqs:
        nodes = tree.index[offset:offset + seq.shape[0]]
        offset += seq.shape[0]
        np.testing.assert_array_equal(tree.tokens[nodes], seq)
        np.testing.assert_array_equal(tree.positions[nodes], np.arange(seq.shape[0]))
        np.testing.assert_array_equal(tree.parents[nodes], np.concatenate([[-1], nodes[:-1]]))
    assert offset == tree.index.shape[0]
    # Every packed token is used, in pre-order: parents come first.
    assert set(tree.index.tolist()) == set(range(tree.tokens.shape[0]))
    assert (tree.parents < np.arange(tree.tokens.shape[0])).all()
    np.testing.assert_array_equal(segment_mask(tree.tokens.shape[0], tree.segments), ancestor_mask(tree.parents))
    covered = [i for seg in tree.segments for i in range(seg.start, seg.stop)]
    assert covered == list(range(tree.tokens.shape[0]))


def test_a_small_batch_by_hand():
    seqs = arrays([1, 2, 3, 4], [1, 2, 5], [1, 2, 3], [7, 8], [1, 2, 5])
    tree = pack(seqs, 1)
    # Sorted: [1 2 3] [1 2 3 4] [1 2 5] [1 2 5] [7 8]; the trie: 1 2 (3 4) (5), then 7 8.
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert tree.positions.tolist() == [0, 1, 2, 3, 2, 0, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, -1, 5]
    assert tree.index.tolist() == [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 5, 6, 0, 1, 4]
    # [1 2 3 4] continues [1 2 3]: one chain; [5] hangs off 2; [7 8] is a second root.
    assert tree.segments == (Segment(0, 4, ()), Segment(4, 5, ((0, 2),)), Segment(5, 7, ()))
    check_packing(seqs, 1)


def test_min_prefix_keeps_short_shared_prefixes_apart():
    seqs = arrays([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 9])
    tree = pack(seqs, 3)
    # [1 2 3 *] share 3 tokens (>= 3): once; [1 2 9 9] shares 2 with them (< 3): its own root.
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 1, 2, 9, 9]
    assert tree.segments == (Segment(0, 4, ()), Segment(4, 5, ((0, 3),)), Segment(5, 9, ()))
    assert tree_groups(seqs, 5, 100) is None
    assert tree_groups(seqs, 3, 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="min_prefix"):
        pack(seqs, 0)


def test_an_agent_trace_is_one_causal_chain():
    turns = np.arange(3, 83, dtype=np.int32)
    seqs = [turns[:n] for n in (10, 30, 55, 80)]
    tree = pack(seqs, 4)
    np.testing.assert_array_equal(tree.tokens, turns)
    assert tree.segments == (Segment(0, 80, ()),)
    plan = tree.attention(torch.device("cpu"))
    assert plan.segments[0][3] is None  # no mask: plain causal attention, as in the flat forward


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=8),
       st.integers(1, 4))
def test_packing_matches_the_references(raw, min_prefix):
    seqs = arrays(*raw)
    check_packing(seqs, min_prefix)
    if min_prefix == 1:
        # Each distinct prefix once: the packed tokens are the trie's nodes.
        prefixes = {tuple(s[:k].tolist()) for s in seqs for k in range(1, s.shape[0] + 1)}
        assert pack(seqs, 1).tokens.shape[0] == len(prefixes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=10),
       st.integers(1, 3), st.integers(1, 30))
def test_groups_stay_within_the_budget(raw, min_prefix, budget):
    seqs = arrays(*raw)
    groups = tree_groups(seqs, min_prefix, budget)
    if groups is None:
        assert pack(seqs, min_prefix).tokens.shape[0] == sum(s.shape[0] for s in seqs)
        return
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    for group in groups:
        packed = pack([seqs[i] for i in group], min_prefix).tokens.shape[0]
        assert packed <= budget or len(group) == 1


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_tree_attention_equals_sdpa_with_the_ancestor_mask(heads, kv_heads):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 20).tolist()
    seqs = arrays(prompt + [1, 2, 3], prompt + [1, 2, 4, 5, 6], prompt + [7] * 9, prompt, [9, 9, 9], prompt[:15] + [0])
    tree = pack(seqs, 4)
    n, d = tree.tokens.shape[0], 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, d, generator=gen, requires_grad=True)
    k = torch.randn(1, kv_heads, n, d, generator=gen, requires_grad=True)
    v = torch.randn(1, kv_heads, n, d, generator=gen, requires_grad=True)
    cotangent = torch.randn(1, n, heads, d, generator=gen)
    out, weights = tree_attention(None, q, k, v, None, scaling=0.3, rlengine_tree=tree.attention(torch.device("cpu")))
    assert weights is None
    grads = torch.autograd.grad((out * cotangent).sum(), (q, k, v))
    mask = torch.from_numpy(ancestor_mask(tree.parents))
    rep = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=0.3).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * cotangent).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rlengine_tree"):
        tree_attention(None, q, k, v, None)
