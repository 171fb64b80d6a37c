"""The torch backend's prefix KV cache (``backends.torch.prefix_cache``), the radix tree alone.

References: a plain list of the sequences inserted (the longest common prefix
with any of them is what an unbounded cache must match) and payloads that
encode their own positions and tokens (so a wrong or misordered piece shows).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlengine.backends.torch.prefix_cache import PrefixCache, common_prefix

# -- the tree alone -------------------------------------------------------------------------

PER_TOKEN = 8
"""Payload bytes per token: (position, token) as two float32."""


def payload(tokens: np.ndarray, start: int, end: int) -> torch.Tensor:
    """The "KV" of positions start..end-1: their positions and tokens, [1, n, 2] (token axis -2)."""
    pos = torch.arange(start, end, dtype=torch.float32)
    return torch.stack([pos, torch.as_tensor(tokens[start:end], dtype=torch.float32)], -1)[None]


def check_pieces(tokens: np.ndarray, length: int, pieces: list[torch.Tensor]) -> None:
    got = torch.cat(pieces, -2) if pieces else torch.zeros((1, 0, 2))
    assert torch.equal(got, payload(tokens, 0, length)), (length, got)


def seqs(alphabet: int = 3, max_len: int = 12):
    return st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len).map(
        lambda t: np.asarray(t, dtype=np.int32))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), seqs()), min_size=1, max_size=30))
def test_unbounded_cache_matches_the_longest_common_prefix_with_any_inserted_sequence(ops):
    cache = PrefixCache(1 << 30, PER_TOKEN)
    inserted: list[np.ndarray] = []
    for is_insert, tokens in ops:
        expected = max((common_prefix(tokens, s) for s in inserted), default=0)
        if is_insert:
            added = cache.insert(tokens, lambda a, b, t=tokens: payload(t, a, b))
            assert added == len(tokens) - expected
            inserted.append(tokens)
        else:
            length, pieces = cache.match(tokens)
            assert length == expected
            check_pieces(tokens, length, pieces)
        cache.check()
    assert cache.nbytes == PER_TOKEN * len({tuple(s[:i + 1]) for s in inserted for i in range(len(s))})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), seqs(), st.integers(0, 12)), min_size=1, max_size=40),
       budget_tokens=st.integers(0, 20))
def test_bounded_cache_stays_in_budget_and_only_returns_what_was_inserted(ops, budget_tokens):
    cache = PrefixCache(budget_tokens * PER_TOKEN, PER_TOKEN)
    inserted: list[np.ndarray] = []
    for is_insert, tokens, limit in ops:
        if is_insert:
            cache.insert(tokens, lambda a, b, t=tokens: payload(t, a, b))
            inserted.append(tokens)
            cache.check()
            # The newest sequence stays whole when it fits the budget alone.
            if len(tokens) <= budget_tokens:
                assert cache.match(tokens)[0] == len(tokens)
        else:
            length, pieces = cache.match(tokens, limit)
            assert length <= min(limit, max((common_prefix(tokens, s) for s in inserted), default=0))
            check_pieces(tokens, length, pieces)
        cache.check()
        assert cache.nbytes <= cache.budget


def test_eviction_takes_the_least_recently_used_leaf():
    cache = PrefixCache(8 * PER_TOKEN, PER_TOKEN)
    a, b, c = (np.asarray([first] + [9] * 3, dtype=np.int32) for first in (1, 2, 3))
    for s in (a, b):
        cache.insert(s, lambda x, y, s=s: payload(s, x, y))
    assert cache.match(a)[0] == 4  # a is now more recent than b
    cache.insert(c, lambda x, y: payload(c, x, y))
    assert cache.match(b)[0] == 0 and cache.match(a)[0] == 4 and cache.match(c)[0] == 4
    assert cache.evicted == 1
    # A shared prefix outlives the branch evicted from it.
    shared = np.asarray([1, 9, 9, 9, 5, 5], dtype=np.int32)
    cache.insert(shared, lambda x, y: payload(shared, x, y))
    cache.check()
    assert cache.match(shared)[0] == 6 and cache.match(a)[0] == 4 and cache.match(c)[0] == 0


def test_an_insertion_larger_than_the_budget_is_cut_to_fit_and_clear_empties():
    cache = PrefixCache(5 * PER_TOKEN, PER_TOKEN)
    tokens = np.arange(10, dtype=np.int32)
    assert cache.insert(tokens, lambda a, b: payload(tokens, a, b)) == 5
    length, pieces = cache.match(tokens)
    assert length == 5
    check_pieces(tokens, 5, pieces)
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0 and cache.match(tokens)[0] == 0
