"""Exact speculative decoding in the torch backend (``backends.torch.speculative``).

The claim: with ``speculative="ngram"`` a request's tokens and logprobs (and top logprobs, stop
reasons) are those of plain decoding with the same seed, bitwise in batch-invariant mode, while
its drafts are verified in fewer steps. The reference is the same model without speculation.
To exercise acceptance and rejection both, the models are ones whose weights copy
(``tests/copying_model.py``): the tiny model continuing a prompt of period 5 (sampled at
temperature 1 it deviates now and then, so drafts are rejected too), the copy recipe's character
model answering "123=" with "123$", and the untrained tiny model on random prompts (drafts rare,
then rejected). The speculative backends' cost model is frozen at "rows are free" there, so every
draft found is verified; the policy itself is tested alone. The bitwise tests run again under
adversarial kernels at every CPU capability level (``test_invariance_matrix``).
"""

from __future__ import annotations

import numpy as np
import pytest
from copying_model import build_copier, copy_rate

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.runtime import engine_args
from rlengine.backends.torch.speculative import BACKOFF_TOKENS, Drafter, StepCost, choose
from rlengine.errors import ConfigurationError

pytestmark = pytest.mark.model_plane

PERIOD = 5


# -- the drafter and the policy alone -----------------------------------------------------------


def test_the_drafter_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    d = Drafter([1, 2, 3, 9, 2, 3, 4, 7], k=4)
    # Suffix (3, 4, 7)... none before; (4, 7) none; 7 none: nothing.
    assert d.propose([], 4) == []
    # Context now ends "... 4 7 2 3": the 2-gram (2, 3) last occurred at 4..5, followed by 4, 7, 2, 3.
    assert d.propose([2, 3], 4) == [4, 7, 2, 3]
    # The 3-gram (7, 2, 3) never occurred before, (2, 3) did: longest first, then the latest.
    assert d.propose([2, 3, 5, 2, 3], 2) == [5, 2]
    # Past the context's end the draft continues with itself: "5 5" drafts 5s.
    assert Drafter([5, 5], k=3).propose([], 3) == [5, 5, 5]
    assert d.propose([2, 3, 5, 2, 3], 0) == []


def test_a_request_whose_drafts_are_rejected_pauses_with_a_doubling_backoff():
    d = Drafter([1, 2, 1, 2], k=4)
    assert d.propose([], 4) == [1, 2, 1, 2]
    d.settle(0, 1, 0, prior=0.5)
    d.settle(0, 1, 1, prior=0.5)
    assert d.propose([1, 2], 4) == []  # paused ...
    assert d.resume_at == 1 + BACKOFF_TOKENS
    assert d.propose([1] * (1 + BACKOFF_TOKENS), 4) != []  # ... until then
    d.settle(0, 1, 9, prior=0.5)
    assert d.resume_at == 9 + 2 * BACKOFF_TOKENS


def test_choose_verifies_drafts_where_a_step_costs_the_same_and_not_where_rows_are_the_cost():
    free, costly = StepCost(1.0, 0.0, frozen=True), StepCost(0.0, 1.0, frozen=True)
    assert choose([3, 2], [0.9, 0.1], rows=4, tile=1, cost=free) == [3, 2]
    assert choose([3, 2], [0.9, 0.1], rows=4, tile=1, cost=costly) == [0, 0]
    # A fixed cost and a row cost: the likely first tokens pay, the unlikely ones do not.
    assert choose([3, 2], [0.9, 0.05], rows=4, tile=1, cost=StepCost(4.0, 0.1, frozen=True)) == [3, 0]
    # Rows up to the tile's end are free in batch-invariant mode.
    assert choose([3, 2], [0.2, 0.05], rows=4, tile=8, cost=costly) == [3, 1]


def test_the_step_cost_fit_recovers_a_fixed_and_a_per_row_cost():
    cost = StepCost()
    rng = np.random.default_rng(0)
    for units in rng.integers(1, 300, 40):
        cost.observe(int(units), 0.002 + 3e-5 * int(units))
    assert cost.fixed == pytest.approx(0.002, rel=1e-6) and cost.per_unit == pytest.approx(3e-5, rel=1e-6)


def test_bad_speculative_options_are_configuration_errors():
    cfg = rle.EngineConfig(engine_args={"speculative": "eagle"})
    with pytest.raises(ConfigurationError, match=r"engine_args\['speculative'\]='eagle'"):
        engine_args(cfg)
    for k in (0, 65, True, 2.0):
        with pytest.raises(ConfigurationError, match=r"engine_args\['speculative_k'\]"):
            engine_args(rle.EngineConfig(engine_args={"speculative": "ngram", "speculative_k": k}))
    assert engine_args(rle.EngineConfig())["speculative"] is None  # off by default


# -- the backend: speculative against plain decoding ----------------------------------------------


@pytest.fixture(scope="module")
def copier(tiny_model, tmp_path_factory):
    """The tiny model continuing period-5 prompts, the copied token 10 logits above the rest."""
    path = build_copier(tiny_model, str(tmp_path_factory.mktemp("copier")), PERIOD, sharpness=10.0)
    rng = np.random.default_rng(0)
    assert copy_rate(path, [rng.integers(3, 1000, PERIOD).tolist() * 6 for _ in range(3)], PERIOD) == 1.0
    return path


def backends(path: str, batch_invariant: bool, k: int = 6) -> tuple[TorchBackend, TorchBackend]:
    plain = TorchBackend(path, batch_invariant=batch_invariant, prefix_cache_bytes=0, processed=True)
    spec = TorchBackend(path, batch_invariant=batch_invariant, prefix_cache_bytes=0, processed=True,
                        speculative="ngram", speculative_k=k)
    spec.step_cost = StepCost(1.0, 0.0, frozen=True)  # every draft found is verified
    return plain, spec


def request(rid: str, prompt: list[int], max_tokens: int, seed: int, **params) -> BackendRequest:
    params.setdefault("ignore_eos", True)
    return BackendRequest(request_id=rid, prompt=np.asarray(prompt, dtype=np.int32).tobytes(),
                          params=rle.SamplingParams(max_tokens=max_tokens, **params), seed=seed,
                          max_tokens=max_tokens, stream=bool(seed % 2))


def run(backend: TorchBackend, reqs: list[BackendRequest]) -> dict[str, dict]:
    """Every request's tokens, logprobs, top logprobs, stop reason and speculative counts."""
    for r in reqs:
        backend.add_request(r)
    out: dict[str, dict] = {r.request_id: {"tokens": [], "logprobs": [], "top": [], "drafted": 0, "accepted": 0}
                            for r in reqs}
    for _ in range(10_000):  # bounded: every request ends within max_tokens steps
        if not backend.has_unfinished_requests():
            break
        for o in backend.step():
            assert o.error is None, o.error
            got = out[o.request_id]
            got["tokens"] += list(o.token_ids)
            got["logprobs"] += list(o.logprobs)
            got["top"] += list(o.top_logprobs or [])
            got["drafted"] += o.drafted_tokens
            got["accepted"] += o.accepted_tokens
            if o.finished:
                got["stop"] = o.stop_reason
    assert not backend.has_unfinished_requests()
    return out


def assert_same(spec: dict[str, dict], plain: dict[str, dict], bitwise: bool) -> None:
    for rid, want in plain.items():
        got = spec[rid]
        assert got["tokens"] == want["tokens"] and got["stop"] == want["stop"], rid
        if bitwise:
            assert got["logprobs"] == want["logprobs"] and got["top"] == want["top"], rid
        else:
            np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-5, err_msg=rid)
        assert 0 <= got["accepted"] <= got["drafted"], rid
        assert want["drafted"] == 0


SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20, "logprobs_mode": "processed"},
    {"temperature": 1.3, "top_k": 50, "top_p": 0.95, "top_logprobs": 3},
]


def mixed_batch(rng: np.random.Generator, tag: str, n: int) -> list[BackendRequest]:
    """Periodic prompts (drafts accepted), random ones (no drafts until the copier's own output
    repeats), every setting, max_tokens landing anywhere in a draft."""
    out = []
    for i in range(n):
        prompt = (rng.integers(3, 1000, PERIOD).tolist() * int(rng.integers(1, 5)) if i % 3
                  else rng.integers(3, 1000, int(rng.integers(2, 40))).tolist())
        out.append(request(f"{tag}.{i}", prompt, int(rng.integers(1, 30)), seed=int(rng.integers(0, 2**31)),
                           **SETTINGS[i % len(SETTINGS)]))
    return out


@pytest.mark.bitwise
def test_speculative_sampling_is_bitwise_plain_sampling_over_seeds_prompts_and_settings(copier):
    plain, spec = backends(copier, batch_invariant=True)
    rng = np.random.default_rng(1)
    for round_ in range(3):
        reqs = mixed_batch(rng, f"r{round_}", 40)
        want, got = run(plain, reqs), run(spec, reqs)
        assert_same(got, want, bitwise=True)
    # Both paths ran: drafts accepted and drafts rejected, in fewer steps.
    assert 0 < spec.accepted_tokens < spec.drafted_tokens
    assert spec.steps < plain.steps


@pytest.mark.bitwise
def test_stop_tokens_and_max_tokens_inside_an_accepted_draft_end_where_plain_decoding_ends(copier):
    plain, spec = backends(copier, batch_invariant=True, k=8)
    rng = np.random.default_rng(2)
    reqs = []
    for i in range(12):
        period = rng.integers(3, 1000, PERIOD).tolist()
        # Greedy: the continuation is the period repeated; the stop token is one of its tokens, so
        # it lands inside a draft of up to 8 accepted tokens (or max_tokens does first).
        reqs.append(request(f"s{i}", period * 2, 3 + i, seed=i, temperature=0.0, stop=[period[i % PERIOD]]))
        reqs.append(request(f"m{i}", period * 2, 2 + i, seed=i, temperature=0.0))
    want, got = run(plain, reqs), run(spec, reqs)
    assert_same(got, want, bitwise=True)
    assert {g["stop"] for g in got.values()} == {"stop", "length"}
    assert all(g["accepted"] > 0 for rid, g in got.items() if len(g["tokens"]) > 2), got


@pytest.mark.bitwise
def test_the_copy_recipes_prompts_accept_drafts_and_keep_their_bits(model_cache, tmp_path):
    from rlengine.backends.torch.models import prepare_char_model
    from rlengine.rl.recipes.copy_digits import ALPHABET, END, encode

    digits = 3
    char = prepare_char_model(ALPHABET, END, cache_dir=model_cache)
    path = build_copier(char, str(tmp_path / "copy"), digits + 1, sharpness=10.0,
                        remap={encode("=")[0]: encode(END)[0]})
    plain, spec = backends(path, batch_invariant=True)
    rng = np.random.default_rng(3)
    reqs = [request(f"{g}.{i}", encode(f"{int(rng.integers(0, 1000)):03d}="), digits + 1, seed=g * 8 + i,
                    temperature=1.0, logprobs_mode="processed", ignore_eos=False)
            for g in range(8) for i in range(8)]  # 8 groups of 8, as the recipe samples
    want, got = run(plain, reqs), run(spec, reqs)
    assert_same(got, want, bitwise=True)
    assert spec.accepted_tokens > 0.5 * spec.drafted_tokens > 0
    # Most answers took one verification after their first digit: the other digits all accepted.
    assert sum(g["accepted"] >= digits - 1 for g in got.values()) > len(got) // 2


@pytest.mark.bitwise
def test_an_untrained_model_on_random_prompts_rejects_drafts_and_keeps_its_bits(tiny_model):
    plain, spec = backends(tiny_model, batch_invariant=True)
    rng = np.random.default_rng(4)
    reqs = [request(f"u{i}", rng.integers(3, 1000, 30).tolist(), 48, seed=i, temperature=1.0) for i in range(16)]
    want, got = run(plain, reqs), run(spec, reqs)
    assert_same(got, want, bitwise=True)
    assert spec.accepted_tokens <= 0.1 * spec.drafted_tokens


@pytest.mark.parametrize("matmul_decode", [True, False], ids=["cpu_attention", "sdpa"])
def test_without_batch_invariance_the_tokens_are_the_same_and_logprobs_within_rounding(copier, matmul_decode):
    """The default path (and its SDPA attention, the one it takes on a GPU): the same tokens here,
    logprobs equal up to float rounding (the law is exact; bits may follow the pass's shape)."""
    plain, spec = backends(copier, batch_invariant=False)
    plain.runner._matmul_decode = spec.runner._matmul_decode = matmul_decode
    reqs = mixed_batch(np.random.default_rng(5), "d", 24)
    want, got = run(plain, reqs), run(spec, reqs)
    assert_same(got, want, bitwise=False)
    assert spec.accepted_tokens > 0


def test_the_engine_runs_speculative_decoding_from_engine_args(copier):
    """Through the Engine: the option reaches the backend, which reports its counts."""
    cfg = rle.EngineConfig(model=copier, backend="torch",
                           engine_args={"speculative": "ngram", "speculative_k": 4, "batch_invariant": True})
    prompt = list(range(10, 10 + PERIOD)) * 3
    with rle.Engine(cfg) as engine:
        sampler = engine.sampling_client()
        responses = [sampler.sample(prompt, n, rle.SamplingParams(max_tokens=20, temperature=0.0)).result(60)
                     for n in (1, 2)]
        stats, counted = engine.backend.describe(), engine.stats()
    for response in responses:
        assert all(s.tokens == (prompt * 5)[len(prompt):len(prompt) + 20] for s in response.sequences)
        assert 0 < response.accepted_tokens <= response.drafted_tokens  # each response its own
    assert stats["speculative_k"] == 4 and 0 < stats["speculative_accepted_tokens"] <= stats["speculative_drafted_tokens"]
    # The responses' counts add up to the backend's, and the engine's stats (what an RL step reads) agree.
    assert sum(r.drafted_tokens for r in responses) == stats["speculative_drafted_tokens"] == counted["drafted_tokens"]
    assert sum(r.accepted_tokens for r in responses) == stats["speculative_accepted_tokens"] == counted["accepted_tokens"]
