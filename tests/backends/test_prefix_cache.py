"""The torch backend's prefix KV cache: the radix tree alone, then reuse inside the backend.

References: for the tree (``backends.torch.prefix_cache``), a plain list of the
sequences inserted (the longest common prefix with any of them is what an
unbounded cache must match) and payloads that encode their own positions and
tokens (so a wrong or misordered piece shows). For the backend, a backend
without a prefix cache: a request that reuses cached KV must get the tokens
and logprobs of a cold prefill (within 1e-5 by default, bitwise in
batch-invariant mode), for a multi-turn session's growing prompt, a group
sharing a prompt, across weight installs, under eviction pressure and with
prompt logprobs requested.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.invariant import block_start
from rlengine.backends.torch.prefix_cache import PrefixCache, common_prefix
from rlengine.backends.torch.runtime import engine_args
from rlengine.errors import ConfigurationError

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


def test_batch_invariant_blocks_are_small_then_large():
    assert [block_start(p) for p in (0, 15, 16, 255, 256, 319, 320, 1000)] == [0, 0, 16, 240, 256, 256, 320, 960]


# -- reuse inside the backend -----------------------------------------------------------------


def request(rid: str, prompt: list[int], max_tokens: int, seed: int = 0, prompt_logprobs: bool = False,
            prompt_top: int = 0, temperature: float = 1.0) -> BackendRequest:
    return BackendRequest(request_id=rid, prompt=np.asarray(prompt, dtype=np.int32).tobytes(),
                          params=rle.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True),
                          seed=seed, max_tokens=max_tokens, stream=False, prompt_logprobs=prompt_logprobs,
                          prompt_top_logprobs=prompt_top)


def run(backend: TorchBackend, reqs: list[BackendRequest]) -> dict[str, tuple]:
    """Add ``reqs`` together, step until done; (tokens, logprobs, prompt logprobs, prompt tops) each."""
    for r in reqs:
        backend.add_request(r)
    out: dict[str, tuple] = {}
    while backend.has_unfinished_requests():
        for o in backend.step():
            assert o.error is None, o.error
            out[o.request_id] = (o.token_ids, o.logprobs, o.prompt_logprobs, o.prompt_top_logprobs)
            if backend.prefix_cache is not None:
                assert backend.prefix_cache.nbytes <= backend.prefix_cache.budget
    return out


def assert_same(got: tuple, cold: tuple, bitwise: bool) -> None:
    assert got[0] == cold[0]  # tokens
    for a, b in zip(got[1:], cold[1:]):
        if bitwise:
            assert a == b  # == on floats
        elif a is not None or b is not None:
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


MODES = [pytest.param(False, id="default"), pytest.param(True, id="batch_invariant", marks=pytest.mark.bitwise)]


@pytest.mark.parametrize("invariant", MODES)
def test_a_multi_turn_sessions_growing_prompt_reuses_its_kv_and_gets_cold_results(tiny_model, invariant):
    """Each turn's prompt is the last one, its answer and a new message: reused, it samples what a
    cold prefill samples. Default mode also caches what it generated (decode-computed KV, equal to
    prefilled KV within rounding); batch-invariant mode only prefilled KV, bitwise."""
    warm = TorchBackend(tiny_model, batch_invariant=invariant)
    cold = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=0)
    rng = np.random.default_rng(0)
    conv = rng.integers(3, 1000, 40).tolist()
    reused, lengths = [], []
    for turn in range(5):
        before = warm.reused_tokens
        got = run(warm, [request(f"t{turn}", conv, 24, seed=turn)])[f"t{turn}"]
        assert_same(got, run(cold, [request(f"t{turn}", conv, 24, seed=turn)])[f"t{turn}"], invariant)
        reused.append(warm.reused_tokens - before)
        lengths.append(len(conv))
        conv = conv + got[0] + rng.integers(3, 1000, 20).tolist()
    assert reused[0] == 0
    if invariant:  # the previous prompt (only prefilled KV is kept)
        assert reused[1:] == lengths[:-1]
    else:  # the previous prompt and all but the last token of its answer
        assert reused[1:] == [n + 23 for n in lengths[:-1]]
    assert cold.describe()["prefix_cache_budget"] == 0 and cold.reused_tokens == 0


@pytest.mark.parametrize("invariant", MODES)
def test_a_group_sharing_a_prompt_prefills_it_once(tiny_model, invariant):
    """The engine fans num_samples out into requests with one prompt, arriving together: the
    prompt is prefilled once, its KV and last logits copied to the others."""
    warm = TorchBackend(tiny_model, batch_invariant=invariant)
    cold = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=0)
    prompt = np.random.default_rng(1).integers(3, 1000, 150).tolist()
    group = [request(f"g{i}", prompt, 16, seed=i) for i in range(8)]
    got = run(warm, group)
    expected = run(cold, group)
    for rid in expected:
        assert_same(got[rid], expected[rid], invariant)
    assert warm.reused_tokens == 7 * 150
    assert len({tuple(g[0]) for g in got.values()}) > 1  # the seeds differ, so do the samples


@pytest.mark.parametrize("invariant", MODES)
def test_joiners_sharing_a_long_prefix_prefill_it_once_and_the_rest_over_it(tiny_model, invariant):
    """Prompts of one step that share a long prefix but differ after it (a group's turns after a
    shared history): the first is prefilled and cached, the others in a second pass over its KV."""
    warm = TorchBackend(tiny_model, batch_invariant=invariant)
    cold = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=0)
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 1000, 150).tolist()
    group = [request(f"g{i}", shared + rng.integers(3, 1000, 1 + i).tolist(), 12, seed=i) for i in range(6)]
    got, expected = run(warm, group), run(cold, group)
    for rid in expected:
        assert_same(got[rid], expected[rid], invariant)
    assert warm.reused_tokens == 5 * 150


@pytest.mark.bitwise
@pytest.mark.parametrize("cached", [240, 241, 250, 255, 256, 257, 300, 319, 320, 383])
def test_batch_invariant_reuse_resumes_inside_a_block_bitwise(tiny_model, cached):
    """Batch-invariant reuse resumes at the first uncached position, inside its canonical block
    (small and large blocks; at a block's first row, its second, its middle and its last):
    bitwise a cold prefill, for one request alone and for several in one pass resuming at
    different rows of one block (every row: ``test_invariant``)."""
    warm = TorchBackend(tiny_model, batch_invariant=True)
    cold = TorchBackend(tiny_model, batch_invariant=True, prefix_cache_bytes=0)
    rng = np.random.default_rng(cached)
    base = rng.integers(3, 1000, cached).tolist()
    run(warm, [request("base", base, 1)])
    tails = [rng.integers(3, 1000, n).tolist() for n in (1, 2, 7, 70)]
    for batch in ([0], [1, 2, 3]):
        ask = [request(f"r{i}", base + tails[i], 8, seed=i) for i in batch]
        before = warm.reused_tokens
        got, expected = run(warm, ask), run(cold, ask)
        for rid in expected:
            assert_same(got[rid], expected[rid], bitwise=True)
        assert warm.reused_tokens - before == cached * len(batch)
        warm.prefix_cache.clear()
        run(warm, [request("base", base, 1)])


def test_weight_installs_invalidate_the_cache_so_a_cached_prefix_gets_the_new_weights_cold_logprobs(tiny_model):
    """Stale KV after an install is a known source of sampler/trainer KL: after ``load_weights`` a
    request whose prompt was cached gets exactly (bitwise) what a cold prefill with the new
    weights gives; and a request that ran across the install does not put its KV in the cache."""
    warm = TorchBackend(tiny_model)
    names = [name for name, _ in warm.model.named_parameters()]
    new = [(name, p.detach() * 1.05) for name, p in warm.model.named_parameters()]
    prompt = list(range(5, 105))
    run(warm, [request("a", prompt, 20)])
    # A request running across the install, and one on the cached prompt after it.
    warm.add_request(request("across", prompt[:60] + [7] * 20, 30))
    warm.step()
    warm.step()
    warm.load_weights(new, 1)
    assert warm.prefix_cache.nbytes == 0
    run(warm, [])
    assert warm.prefix_cache.match(np.asarray(prompt[:60] + [7] * 20, dtype=np.int32))[0] == 0
    before = warm.reused_tokens
    got = run(warm, [request("b", prompt + [3, 4, 5], 20, seed=2)])["b"]
    assert warm.reused_tokens == before  # nothing cached survived the install
    cold = TorchBackend(tiny_model, prefix_cache_bytes=0)
    cold.load_weights(new, 1)
    assert_same(got, run(cold, [request("b", prompt + [3, 4, 5], 20, seed=2)])["b"], bitwise=True)
    # From here on the new weights' KV is cached and reused again.
    again = run(warm, [request("c", prompt + [3, 4, 5, 6], 20, seed=3)])["c"]
    assert warm.reused_tokens > before
    assert_same(again, run(cold, [request("c", prompt + [3, 4, 5, 6], 20, seed=3)])["c"], bitwise=False)
    # What the install guards against: the same weights copied in behind the cache's back
    # leave the old KV in it, and the logprobs move by far more than rounding.
    stale = TorchBackend(tiny_model)
    run(stale, [request("a", prompt, 20)])
    params = dict(stale.model.named_parameters())
    with torch.no_grad():
        for name, tensor in new:
            params[name].copy_(tensor)
    wrong = run(stale, [request("b", prompt + [3, 4, 5], 20, seed=2)])["b"]
    assert stale.reused_tokens > 0
    assert max(abs(x - y) for x, y in zip(wrong[1], got[1])) > 1e-3
    assert names  # every parameter took part


@pytest.mark.parametrize("invariant", MODES)
def test_under_eviction_pressure_reuse_still_gives_cold_results_within_the_budget(tiny_model, invariant):
    """A budget of about 300 tokens' KV against sessions and groups of several times that: the cache
    evicts all the time, stays within its budget after every step, and every result is cold's."""
    per_token = TorchBackend(tiny_model, prefix_cache_bytes=0).runner.cache.bytes_per_token
    warm = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=300 * per_token)
    cold = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=0)
    rng = np.random.default_rng(2)
    sessions = [rng.integers(3, 1000, int(rng.integers(20, 120))).tolist() for _ in range(3)]
    for turn in range(3):
        reqs = []
        for i, conv in enumerate(sessions):
            reqs += [request(f"s{i}.{turn}.{k}", conv, 12, seed=10 * i + k) for k in range(1 + (i == 0) * 3)]
        got = run(warm, reqs)
        expected = run(cold, reqs)
        for rid in expected:
            assert_same(got[rid], expected[rid], invariant)
        warm.prefix_cache.check()
        for i in range(3):
            sessions[i] = sessions[i] + got[f"s{i}.{turn}.0"][0] + rng.integers(3, 1000, 30).tolist()
    assert warm.prefix_cache.evicted > 0 and warm.reused_tokens > 0


@pytest.mark.parametrize("invariant", MODES)
def test_requests_for_prompt_logprobs_get_all_of_them_over_a_cached_prefix(tiny_model, invariant):
    """Prompt logprobs (and their top k) need every prompt position's logits: such a request runs its
    whole prompt (and still leaves its KV for others), so it gets the full lists, equal to cold's."""
    warm = TorchBackend(tiny_model, batch_invariant=invariant)
    cold = TorchBackend(tiny_model, batch_invariant=invariant, prefix_cache_bytes=0)
    prompt = list(range(10, 90))
    run(warm, [request("a", prompt, 8)])
    ask = [request("p", prompt + [1, 2, 3], 8, seed=4, prompt_logprobs=True, prompt_top=3),
           request("q", prompt + [1, 2, 4], 8, seed=5)]
    before = warm.reused_tokens
    got = run(warm, ask)
    expected = run(cold, ask)
    assert len(got["p"][2]) == len(prompt) + 2 and len(got["p"][3]) == 3 * (len(prompt) + 2)
    for rid in expected:
        assert_same(got[rid], expected[rid], invariant)
    assert warm.reused_tokens - before == len(prompt)  # only "q" reused


def test_the_engine_fans_a_group_out_onto_one_prefill_and_installs_clear_the_cache(model_cache):
    prompt = list(range(3, 203))
    config = {"model": "tiny", "backend": "torch", "cache_dir": model_cache}
    outs = {}
    for budget in (0, 1 << 24):
        with rle.Engine(rle.EngineConfig(**config, engine_args={"prefix_cache_bytes": budget})) as engine:
            sampler = engine.sampling_client()
            resp = sampler.sample(prompt, 8, rle.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result(60)
            outs[budget] = [(s.tokens, s.logprobs) for s in resp.sequences]
            described = engine.backend.describe()
            assert described["prefix_reused_tokens"] == (7 * 200 if budget else 0)
            if budget:
                assert described["prefix_cache_bytes"] > 0
                engine.training_client().save_weights_for_sampler().result(120)
                assert engine.backend.describe()["prefix_cache_bytes"] == 0
    for (tokens, lps), (cold_tokens, cold_lps) in zip(outs[1 << 24], outs[0]):
        assert tokens == cold_tokens
        np.testing.assert_allclose(lps, cold_lps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("value", [-1, 1.5, True, "1GB"])
def test_prefix_cache_bytes_must_be_a_non_negative_integer(value):
    with pytest.raises(ConfigurationError, match="prefix_cache_bytes"):
        engine_args(rle.EngineConfig(model="tiny", engine_args={"prefix_cache_bytes": value}))
