"""The torch backend, alone and through the Engine, against references.

References: HF ``generate`` (greedy), the HF model's own forward pass and the
torch trainer (logprobs), a numpy implementation of temperature/top-k/top-p
(sampling), solo runs of the same request (continuous batching must not
change what a request generates), and the tokenizer (stop strings).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.models import build_tiny, load_tokenizer
from rlengine.backends.torch.runtime import configure_threads
from rlengine.backends.torch.sampling import StopText, sample_tokens, uniforms
from rlengine.errors import ConfigurationError, InvalidRequest

WAIT = 60.0
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 250, 251, 252, 253], [700], [33, 44, 55, 66, 77, 88]]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()


@pytest.fixture(scope="module")
def engine(model_cache):
    # The torch backend by name: backend="auto" prefers vLLM where it is installed.
    with rle.Engine(rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache)) as eng:
        yield eng


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def request(rid: str, prompt: list[int], max_tokens: int, seed: int = 0, stream: bool = True,
            prompt_logprobs: bool = False, **params) -> BackendRequest:
    return BackendRequest(request_id=rid, prompt=np.asarray(prompt, dtype=np.int32).tobytes(),
                          params=rle.SamplingParams(max_tokens=max_tokens, **params), seed=seed,
                          max_tokens=max_tokens, stream=stream, prompt_logprobs=prompt_logprobs)


def drain(backend: TorchBackend, log: list[tuple[int, str, bool]] | None = None) -> dict[str, list[int]]:
    """Step until idle; returns tokens per request and logs (step, request, finished)."""
    tokens: dict[str, list[int]] = {}
    while backend.has_unfinished_requests():
        step = backend.steps
        for out in backend.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if log is not None:
                log.append((step, out.request_id, out.finished))
    return tokens


def solo(tiny_model, req: BackendRequest) -> list[int]:
    backend = TorchBackend(tiny_model)
    backend.add_request(req)
    return drain(backend)[req.request_id]


# -- greedy and logprobs against HF ------------------------------------------------------


def test_auto_backend_is_torch_with_the_prepared_model(engine, tiny_model):
    assert engine.backend.name == "torch" and engine.model_path == tiny_model
    assert engine.backend.capabilities.sleep is False and engine.backend.capabilities.why_not_sleep
    assert engine.backend.vocab_size == 1024 and engine.backend.max_model_len == 2048


def test_greedy_equals_hf_generate_token_for_token(engine, hf_model):
    sampler = engine.sampling_client()
    lengths = [12, 300, 5, 40]  # 300 grows the KV cache past its first capacity; others leave early
    futures = [sampler.sample(p, 1, rle.SamplingParams(max_tokens=n, temperature=0.0))
               for p, n in zip(PROMPTS, lengths)]
    for prompt, n, fut in zip(PROMPTS, lengths, futures):
        seq = fut.result(WAIT).sequences[0]
        expected = hf_greedy(hf_model, prompt, n)
        assert seq.tokens == expected
        assert seq.stop_reason == ("length" if len(expected) == n else "stop")


def test_sampled_logprobs_equal_a_trainer_forward_pass(engine):
    sampler, trainer = engine.sampling_client(), engine.training_client()
    prompt = PROMPTS[1]
    resp = sampler.sample(prompt, 3, rle.SamplingParams(max_tokens=24, temperature=0.7, top_k=50, top_p=0.9,
                                                        seed=3), include_prompt_logprobs=True).result(WAIT)
    data = []
    for seq in resp.sequences:
        full = prompt + seq.tokens
        data.append(rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]),
                              loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)}))
    out = trainer.forward(data, "cross_entropy").result(WAIT)
    for seq, record in zip(resp.sequences, out.loss_fn_outputs):
        trainer_lp = record["logprobs"].to_numpy()
        # Raw (untempered) logprobs: exactly what the trainer computes.
        np.testing.assert_allclose(seq.logprobs, trainer_lp[len(prompt) - 1:], atol=1e-4, rtol=0)
        np.testing.assert_allclose(resp.prompt_logprobs[1:], trainer_lp[:len(prompt) - 1], atol=1e-4, rtol=0)
    assert resp.prompt_logprobs[0] is None


def test_compute_logprobs_equals_the_hf_forward(engine, hf_model):
    prompt = PROMPTS[3] + PROMPTS[1]
    got = engine.sampling_client().compute_logprobs(prompt).result(WAIT)
    ref = hf_logits(hf_model, prompt).log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], ref.numpy(), atol=1e-5, rtol=0)


def test_render_chat_completion_equals_apply_chat_template(engine):
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "12+30=?"}]
    tok = load_tokenizer(engine.model_path)
    for add in (True, False):
        got = engine.sampling_client().render_chat_completion(messages, add_generation_prompt=add).to_ints()
        assert got == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                   add_generation_prompt=add))


# -- sampling ----------------------------------------------------------------------------


def reference_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top-k, then nucleus top-p, renormalised (float64 numpy)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, dtype=bool)
    keep[order[:top_k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros(z.shape, dtype=bool)
    nucleus[order[before < top_p]] = True
    p = np.where(keep & nucleus, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 50, 1.0), (0.8, 10, 0.8), (1.5, 50, 0.5),
                                                       (0.5, 3, 1.0)])
def test_sample_tokens_follows_the_reference_distribution(temperature, top_k, top_p):
    vocab, draws = 50, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    ref = reference_filtered_probs(logits.numpy(), temperature, top_k, top_p)
    rows = logits.expand(draws, vocab)
    seeds = list(range(draws))
    tokens, logprobs = sample_tokens(rows, seeds, [3] * draws, torch.full((draws,), temperature),
                                     torch.full((draws,), top_k), torch.full((draws,), top_p))
    counts = np.bincount(tokens.numpy(), minlength=vocab) / draws
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(ref))
    assert np.abs(counts - ref).max() < 0.015
    np.testing.assert_allclose(logprobs.numpy(), logits.log_softmax(-1)[tokens].numpy(), atol=1e-6)
    # Exactly the inverse CDF of the reference at the draw's uniform: in descending order for a
    # filtered row, in vocabulary order for one without top-k or top-p.
    u = uniforms(np.arange(20, dtype=np.uint64), np.full(20, 3))
    order = np.argsort(-ref, kind="stable") if top_k < vocab or top_p < 1.0 else np.arange(vocab)
    for seed in range(20):
        expected = order[np.searchsorted(np.cumsum(ref[order]), u[seed] * ref.sum())]
        assert tokens[seed].item() == expected


def test_a_rows_draw_depends_on_its_own_seed_settings_and_counter_only():
    """A plain row (vocabulary order) and a filtered one (sorted order) beside each other, or
    each alone, or among others: the same token and logprob."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    settings = (torch.tensor([1.0, 0.7, 1.3]), torch.tensor([40, 5, 40]), torch.tensor([1.0, 1.0, 0.6]))
    together = sample_tokens(logits, [11, 12, 13], [4, 0, 9], *settings, processed=[True, True, False])
    for i in range(3):
        alone = sample_tokens(logits[i:i + 1], [11 + i], [[4, 0, 9][i]], *(t[i:i + 1] for t in settings),
                              processed=[[True, True, False][i]])
        assert alone[0][0] == together[0][i] and alone[1][0] == together[1][i], i


def test_greedy_rows_ignore_their_neighbours_and_take_the_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample_tokens(logits, [None, 1, None, 2], [0] * 4, torch.tensor([1.0, 0.9, 1.0, 1.2]),
                              torch.full((4,), 30), torch.full((4,), 1.0))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_k_one_and_tiny_top_p_are_greedy(engine, hf_model):
    sampler = engine.sampling_client()
    expected = hf_greedy(hf_model, PROMPTS[0], 16)
    for params in (rle.SamplingParams(max_tokens=16, top_k=1, seed=5),
                   rle.SamplingParams(max_tokens=16, top_p=1e-9, temperature=2.0, seed=5)):
        assert sampler.sample(PROMPTS[0], 2, params).result(WAIT).sequences[1].tokens == expected


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.3)])
def test_sampled_tokens_stay_in_the_reference_top_k_and_top_p_sets(engine, hf_model, top_k, top_p):
    params = rle.SamplingParams(max_tokens=16, temperature=1.0, top_k=top_k, top_p=top_p, seed=11)
    for seq in engine.sampling_client().sample(PROMPTS[2], 3, params).result(WAIT).sequences:
        logits = hf_logits(hf_model, PROMPTS[2] + seq.tokens)[len(PROMPTS[2]) - 1:-1].numpy()
        for position, token in enumerate(seq.tokens):
            allowed = reference_filtered_probs(logits[position], 1.0, top_k if top_k > 0 else 1024, top_p)
            assert allowed[token] > 0, (position, token)


def test_seeds_reproduce_regardless_of_batch_neighbours(engine):
    sampler = engine.sampling_client()
    params = rle.SamplingParams(max_tokens=30, seed=7, temperature=1.0)
    alone = sampler.sample(PROMPTS[3], 2, params).result(WAIT)
    early = sampler.sample(PROMPTS[1], 3, rle.SamplingParams(max_tokens=50, seed=1))
    crowded = sampler.sample(PROMPTS[3], 2, params)
    late = [sampler.sample(p, 1, rle.SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, (3, 9, 27, 64))]
    crowded = crowded.result(WAIT)
    for f in [early, *late]:
        f.result(WAIT)
    for a, b in zip(alone.sequences, crowded.sequences):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert alone.sequences[0].tokens != alone.sequences[1].tokens  # each sample has its own stream
    other = sampler.sample(PROMPTS[3], 1, rle.SamplingParams(max_tokens=30, seed=8)).result(WAIT)
    assert other.sequences[0].tokens != alone.sequences[0].tokens


# -- stopping ----------------------------------------------------------------------------


def test_stop_strings_cut_at_the_completing_token(engine):
    sampler = engine.sampling_client()
    tok = load_tokenizer(engine.model_path)
    free = sampler.sample(PROMPTS[0], 1, rle.SamplingParams(max_tokens=40, temperature=0.0)).result(WAIT)
    tokens = free.sequences[0].tokens
    text = tok.decode(tokens)
    # A stop string that starts inside the text and is not at its very start.
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    resp = sampler.sample(PROMPTS[0], 1, rle.SamplingParams(max_tokens=40, temperature=0.0, stop=stop)).result(WAIT)
    cut = resp.sequences[0]
    assert cut.stop_reason == "stop"
    assert cut.tokens == tokens[:len(cut.tokens)]
    assert stop in tok.decode(cut.tokens) and stop not in tok.decode(cut.tokens[:-1])
    assert tok.decode(cut.tokens).index(stop) == text.index(stop)


@pytest.mark.parametrize("stop", ["é😀", "\n\n", "ne 1", "<|im_end|>", "ü"])
def test_incremental_stop_text_finds_stops_where_full_decoding_does(tiny_model, stop):
    tok = load_tokenizer(tiny_model)
    text = "Kalo mi é😀 ne 12+3=15\n\n<|im_end|> wörld ünï 😀😀 end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    watcher = StopText(tok, (stop,))
    # Reference: the first prefix whose full decoding contains the stop string.
    expected = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    got = next(i for i in range(1, len(ids) + 1) if watcher.feed(ids[:i]))
    assert got == expected
    for i in range(got + 1, len(ids) + 1):
        watcher.feed(ids[:i])
    assert watcher.text == text


def test_stop_token_ids_end_generation_and_are_included(engine):
    sampler = engine.sampling_client()
    tokens = sampler.sample(PROMPTS[1], 1, rle.SamplingParams(max_tokens=30, temperature=0.0)).result(
        WAIT).sequences[0].tokens
    stop_id = tokens[6]
    cut = sampler.sample(PROMPTS[1], 1, rle.SamplingParams(max_tokens=30, temperature=0.0, stop=[stop_id])).result(
        WAIT).sequences[0]
    assert cut.tokens == tokens[:tokens.index(stop_id) + 1] and cut.stop_reason == "stop"


def test_eos_stops_generation(tiny_model, hf_model):
    backend = TorchBackend(tiny_model)
    assert backend.eos_ids == {0, 2}
    # Steer the model to emit <|im_end|> (id 2) first: with every other LM-head row
    # zero and row 2 equal to the prompt's final hidden state, logit 2 = |h|^2 > 0.
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
        backend.model.lm_head.weight.zero_()
        backend.model.lm_head.weight[2] = hidden
    backend.add_request(request("r", PROMPTS[0], 10, temperature=0.0))
    (out,) = backend.step()
    assert out.finished and out.stop_reason == "stop" and out.token_ids == [2]


def test_max_tokens_is_exact_with_stop_reason_length(engine):
    resp = engine.sampling_client().sample(PROMPTS[2], 2, rle.SamplingParams(max_tokens=7, seed=0)).result(WAIT)
    for seq in resp.sequences:
        assert (seq.length == 7 and seq.stop_reason == "length") or seq.stop_reason == "stop"


# -- continuous batching ---------------------------------------------------------------------


def test_short_request_leaves_while_a_long_one_runs_and_a_late_one_joins(tiny_model):
    backend = TorchBackend(tiny_model)
    reqs = {"long": request("long", PROMPTS[1], 30, seed=1, temperature=1.0),
            "short": request("short", PROMPTS[0], 5, seed=2, temperature=1.0),
            "late": request("late", PROMPTS[3], 8, seed=3, temperature=0.0)}
    backend.add_request(reqs["long"])
    backend.add_request(reqs["short"])
    log: list[tuple[int, str, bool]] = []
    tokens: dict[str, list[int]] = {}
    while backend.has_unfinished_requests():
        if backend.steps == 10:
            backend.add_request(reqs["late"])
        step = backend.steps
        for out in backend.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            log.append((step, out.request_id, out.finished))
    finished_at = {rid: step for step, rid, done in log if done}
    first_at = {rid: min(step for step, r, _ in log if r == rid) for rid in reqs}
    assert finished_at["short"] == 4 and finished_at["long"] == 29  # one token per step from step 0
    assert first_at["late"] == 10 and finished_at["late"] == 17  # joins at the next step boundary
    for rid, req in reqs.items():
        assert tokens[rid] == solo(tiny_model, req), rid  # batching never changes a request's tokens


def _run_with_neighbours(backend: TorchBackend, target: BackendRequest, rng: np.random.Generator | None,
                         ) -> tuple[list[int], list[float], list[float] | None]:
    """``target``'s tokens, logprobs and prompt logprobs, run alone (``rng`` None) or among
    random neighbours (random prompt lengths, a third of them the target's, sampled or
    greedy, joining at random steps)."""
    joins: dict[int, list[BackendRequest]] = {}
    target_length = len(target.prompt) // 4
    if rng is not None:
        for n in range(int(rng.integers(5, 40))):
            length = target_length if rng.random() < 1 / 3 else int(rng.integers(1, 150))
            prompt = rng.integers(1, 1000, size=length).tolist()
            temperature = float(rng.choice([0.0, 0.7, 1.0]))
            joins.setdefault(int(rng.integers(0, 30)), []).append(
                request(f"n{n}", prompt, int(rng.integers(1, 60)), seed=n, temperature=temperature))
    start = int(rng.integers(0, 10)) if rng is not None else 0
    joins.setdefault(start, []).append(target)
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_lps: list[float] | None = None
    step = 0
    while joins or backend.has_unfinished_requests():
        for req in joins.pop(step, []):
            backend.add_request(req)
        for out in backend.step():
            if out.request_id == target.request_id:
                tokens += out.token_ids
                logprobs += out.logprobs
                prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
        step += 1
    return tokens, logprobs, prompt_lps


INVARIANT_TARGET = request("t", PROMPTS[1] * 7, 90, seed=11, temperature=1.0, prompt_logprobs=True)


@pytest.mark.bitwise
def test_batch_invariant_mode_gives_every_request_the_same_bits_whatever_shares_its_batches(tiny_model):
    """Multi-turn runs batch by timing: in batch-invariant mode a request's tokens, logprobs and
    prompt logprobs are bitwise those of a solo run, among any neighbours (more than one row
    tile and attention call, key spans past one block). (The default mode differs here in the
    last bits.)"""
    alone = _run_with_neighbours(TorchBackend(tiny_model, batch_invariant=True), INVARIANT_TARGET, None)
    assert len(alone[0]) == 90 and len(alone[2]) == len(PROMPTS[1]) * 7 - 1
    backend = TorchBackend(tiny_model, batch_invariant=True)
    for trial in range(4):
        crowded = _run_with_neighbours(backend, INVARIANT_TARGET, np.random.default_rng(trial))
        assert crowded[0] == alone[0], trial
        assert crowded[1] == alone[1], trial  # bitwise: == on floats
        assert crowded[2] == alone[2], trial


def test_batch_invariant_mode_changes_no_number_beyond_rounding(tiny_model):
    """It computes what the default path computes, in another order: the same tokens, logprobs
    within rounding."""
    alone = _run_with_neighbours(TorchBackend(tiny_model, batch_invariant=True), INVARIANT_TARGET, None)
    default = _run_with_neighbours(TorchBackend(tiny_model), INVARIANT_TARGET, None)
    assert alone[0][:20] == default[0][:20]
    np.testing.assert_allclose(alone[1][:20], default[1][:20], atol=1e-5)
    np.testing.assert_allclose(alone[2], default[2], atol=1e-5)


def test_max_num_seqs_caps_the_running_batch(tiny_model):
    backend = TorchBackend(tiny_model, max_num_seqs=2)
    for i, n in enumerate((3, 6, 4)):
        backend.add_request(request(f"r{i}", PROMPTS[i], n, temperature=0.0))
    log: list[tuple[int, str, bool]] = []
    drain(backend, log)
    steps_of = {rid: [s for s, r, _ in log if r == rid] for rid in ("r0", "r1", "r2")}
    assert steps_of["r0"] == [0, 1, 2] and steps_of["r1"] == list(range(6))
    assert steps_of["r2"] == [3, 4, 5, 6]  # waits for a free slot, joins the step after r0 leaves
    assert all(len({r for s, r, _ in log if s == step}) <= 2 for step in range(8))


def test_abort_removes_running_and_waiting_requests(tiny_model):
    backend = TorchBackend(tiny_model, max_num_seqs=2)
    keep = request("keep", PROMPTS[1], 12, seed=4, temperature=1.0)
    backend.add_request(request("gone", PROMPTS[0], 50, temperature=0.0))
    backend.add_request(keep)
    backend.add_request(request("queued", PROMPTS[2], 50, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in backend.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    backend.abort_request(["gone", "queued", "unknown"])
    rest = drain(backend)
    assert set(rest) == {"keep"}
    assert tokens["keep"] + rest["keep"] == solo(tiny_model, keep)
    assert backend.runner.cache.nbytes == 0  # freed once nothing runs


def test_non_streaming_requests_report_once_with_everything(tiny_model):
    backend = TorchBackend(tiny_model)
    backend.add_request(request("s", PROMPTS[1], 9, seed=5, temperature=1.0, prompt_logprobs=True))
    backend.add_request(request("f", PROMPTS[1], 9, seed=5, temperature=1.0, prompt_logprobs=True, stream=False))
    streamed: list = []
    final: list = []
    while backend.has_unfinished_requests():
        for out in backend.step():
            (streamed if out.request_id == "s" else final).append(out)
    assert len(streamed) == 9 and len(final) == 1 and final[0].finished
    assert final[0].token_ids == [t for o in streamed for t in o.token_ids]
    # Same tokens; logprobs equal up to float reduction order (the two rows sit
    # in different batch slots).
    np.testing.assert_allclose(final[0].logprobs, [lp for o in streamed for lp in o.logprobs], atol=1e-5)
    np.testing.assert_allclose(final[0].prompt_logprobs, streamed[0].prompt_logprobs, atol=1e-5)
    assert len(final[0].prompt_logprobs) == 10


# -- weights -------------------------------------------------------------------------------


def test_load_weights_validates_everything_before_copying(tiny_model):
    backend = TorchBackend(tiny_model)
    good = [(n, p.detach().clone()) for n, p in backend.model.named_parameters()]
    before = solo_greedy(backend)
    bad_cases = [
        ([*good, ("model.bogus.weight", torch.zeros(1))], "unknown tensor"),
        ([(n, t[:1] if n.endswith("q_proj.weight") else t * 0) for n, t in good], "shape"),
        (good[1:], "missing"),
    ]
    for weights, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            backend.load_weights(weights, 1)
        assert solo_greedy(backend) == before and backend.version == 0


def solo_greedy(backend: TorchBackend) -> list[int]:
    backend.add_request(request("g", PROMPTS[0], 8, temperature=0.0))
    return drain(backend)["g"]


def test_non_finite_weights_fail_requests_not_the_backend(tiny_model):
    backend = TorchBackend(tiny_model)
    good = [(n, p.detach().clone()) for n, p in backend.model.named_parameters()]
    backend.load_weights([(n, torch.full_like(t, float("nan")) if n == "lm_head.weight" else t) for n, t in good], 1)
    backend.add_request(request("a", PROMPTS[0], 5, seed=1, temperature=1.0))
    backend.add_request(request("b", PROMPTS[1], 5, temperature=0.0))
    outs = backend.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and "non-finite" in o.error for o in outs)
    assert not backend.has_unfinished_requests()
    backend.load_weights(good, 2)
    assert len(solo_greedy(backend)) == 8


def test_tied_embedding_models_generate_and_take_trainer_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlengine.trainer.torch_trainer import TorchTrainer

    path = build_tiny(str(tmp_path / "tied"), vocab_size=320, hidden_size=64, num_heads=2, num_kv_heads=1,
                      intermediate_size=96, tie_word_embeddings=True)
    backend = TorchBackend(path)
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    backend.add_request(request("t", [5, 6, 7], 20, temperature=0.0))
    assert drain(backend)["t"] == hf_greedy(ref, [5, 6, 7], 20)
    trainer = TorchTrainer(path)
    names = [n for n, _ in trainer.sampler_weights()]
    assert "lm_head.weight" not in names  # tied: one tensor, installed once
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.mul_(1.5)
    backend.load_weights(trainer.sampler_weights(), 1)
    assert torch.equal(backend.model.lm_head.weight, trainer.model.model.embed_tokens.weight)
    backend.load_weights([*trainer.sampler_weights(), ("lm_head.weight", trainer.model.lm_head.weight)], 2)


def test_weight_install_changes_samples_to_the_trainers_and_tags_versions(model_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    with rle.Engine(rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache)) as eng:
        trainer = eng.training_client()
        greedy = rle.SamplingParams(max_tokens=16, temperature=0.0)
        before = eng.sampling_client().sample(PROMPTS[0], 1, greedy).result(WAIT).sequences[0]
        assert before.versions == [0] * before.length
        full = PROMPTS[0] + before.tokens
        datum = rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]),
                          loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                                          "weights": -np.ones(len(full) - 1, dtype=np.float32)})
        trainer.forward_backward([datum], "cross_entropy").result(WAIT)  # push the greedy path away
        trainer.optim_step(rle.AdamParams(learning_rate=0.05)).result(WAIT)
        sampler = trainer.save_weights_and_get_sampling_client(timeout=WAIT)
        assert sampler.version == 1
        after = sampler.sample(PROMPTS[0], 1, greedy, include_prompt_logprobs=True).result(WAIT)
        trainer.save_state(str(tmp_path / "state")).result(WAIT)
    seq = after.sequences[0]
    assert seq.versions == [1] * seq.length
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "state"), local_files_only=True).eval()
    assert seq.tokens == hf_greedy(ref, PROMPTS[0], 16) != before.tokens
    lp = hf_logits(ref, PROMPTS[0] + seq.tokens).log_softmax(-1)
    np.testing.assert_allclose(seq.logprobs, lp[torch.arange(3, 3 + seq.length), torch.tensor(seq.tokens)].numpy(),
                               atol=1e-4)


# -- bad input and configuration --------------------------------------------------------------


def test_bad_prompts_raise_typed_errors_and_the_engine_keeps_serving(engine, tiny_model):
    sampler = engine.sampling_client()
    with pytest.raises(InvalidRequest, match="vocab"):
        sampler.sample([1, 2, 1024], 1, rle.SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="context"):
        sampler.sample([5] * 2048, 1, rle.SamplingParams(max_tokens=2))
    backend = TorchBackend(tiny_model)
    with pytest.raises(InvalidRequest) as info:
        backend.add_request(request("x", [1, 5000], 2))
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequest) as info:
        backend.add_request(request("x", [1] * 2000, 49))
    assert info.value.field == "max_tokens"
    backend.add_request(request("x", [1, 2], 2))
    with pytest.raises(InvalidRequest, match="already"):
        backend.add_request(request("x", [1, 2], 2))
    resp = sampler.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=3)).result(WAIT)
    assert resp.sequences[0].length >= 1


def test_a_shorter_context_caps_generation(model_cache):
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache, max_model_len=12)
    with rle.Engine(cfg) as eng:
        assert eng.backend.max_model_len == 12
        with pytest.raises(InvalidRequest):
            eng.sampling_client().sample([5] * 12, 1)
        seq = eng.sampling_client().sample([5] * 9, 1, rle.SamplingParams(temperature=0.0)).result(WAIT).sequences[0]
        assert seq.length <= 3


@pytest.mark.parametrize("overrides, match", [
    ({"engine_args": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
    ({"engine_args": {"prefill_tokens": 0}}, "prefill_tokens"),
    ({"engine_args": {"device": "tpu"}}, "device"),
    ({"max_model_len": 4096}, "max_model_len"),
])
def test_bad_configuration_fails_engine_start(model_cache, overrides, match):
    engine = rle.Engine(rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache, **overrides))
    with pytest.raises(ConfigurationError, match=match):
        engine.start()
    engine.close()


@pytest.mark.parametrize("env, expected", [({}, 1), ({"RLENGINE_TORCH_THREADS": "2"}, 2),
                                           ({"OMP_NUM_THREADS": "1"}, None)])
def test_thread_default_and_overrides(env, expected):
    # In a fresh process: once a vLLM CPU engine has run in this one, vLLM has
    # replaced torch.set_num_threads with a no-op (it pins its own threads).
    code = (
        "import threading, torch, rlengine.backends.torch.runtime as rt, rlengine.backends.torch.threads as th\n"
        "th.usable_cpus = lambda: 2\n"
        "got = []\n"
        # The setting is per thread (OpenMP): check it on a fresh thread, like the compute thread.
        "t = threading.Thread(target=lambda: got.append((torch.get_num_threads(), rt.configure_threads())))\n"
        "t.start(); t.join()\n"
        "print(*got[0])\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("RLENGINE_TORCH_THREADS", "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], check=False, env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert after == (before if expected is None else expected)


def test_bad_thread_override_is_a_configuration_error(monkeypatch):
    monkeypatch.setenv("RLENGINE_TORCH_THREADS", "zero")
    with pytest.raises(ConfigurationError, match="RLENGINE_TORCH_THREADS"):
        configure_threads()


def test_pause_policy_continues_a_request_on_new_weights_with_the_same_tokens(model_cache):
    """drain_policy='pause' aborts in-flight sequences and re-adds them (prompt + tokens so
    far) after the install; with unchanged weights greedy decoding must not notice."""
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache, drain_policy="pause")
    greedy = rle.SamplingParams(max_tokens=400, temperature=0.0)
    with rle.Engine(cfg) as eng:
        trainer = eng.training_client()
        trainer.forward([rle.Datum(model_input=rle.ModelInput.from_ints([1, 2]),
                                   loss_fn_inputs={"target_tokens": np.array([2, 3])})]).result(WAIT)
        sampler = eng.sampling_client()
        reference = sampler.sample(PROMPTS[1], 1, greedy).result(WAIT).sequences[0]
        assert reference.length == 400
        future = sampler.sample(PROMPTS[1], 1, greedy)
        while eng.stats()["steps"] < 20 + 400:  # well inside the second generation
            time.sleep(0.002)
        trainer.save_weights_for_sampler().result(WAIT)  # same weights, version 1
        seq = future.result(WAIT).sequences[0]
    assert seq.tokens == reference.tokens
    switch = seq.versions.index(1)
    assert 0 < switch < 400 and seq.versions == [0] * switch + [1] * (400 - switch)
    np.testing.assert_allclose(seq.logprobs, reference.logprobs, atol=1e-5)


def test_top_logprobs_are_the_hf_forward_passes_most_likely_tokens(engine, hf_model):
    prompt = PROMPTS[1]
    seq = engine.sampling_client().sample(prompt, 1, rle.SamplingParams(
        max_tokens=12, temperature=1.0, seed=5, top_logprobs=5)).result(WAIT).sequences[0]
    top = seq.top_logprobs
    assert len(top) == seq.length and all(len(row) == 5 for row in top)
    reference = hf_logits(hf_model, prompt + seq.tokens)[len(prompt) - 1:-1].log_softmax(-1).topk(5, dim=-1)
    for row, values, ids in zip(top, reference.values.tolist(), reference.indices.tolist()):
        assert [t for t, _ in row] == ids
        np.testing.assert_allclose([lp for _, lp in row], values, atol=1e-5)
    # The sampled token's own logprob is where it ranks among them (when it does).
    for token, lp, row in zip(seq.tokens, seq.logprobs, top):
        if token in dict(row):
            assert abs(dict(row)[token] - lp) < 1e-6
    plain = engine.sampling_client().sample(prompt, 1, rle.SamplingParams(max_tokens=4)).result(WAIT).sequences[0]
    assert plain.top_logprobs == [] and plain.top_ids_raw == b""
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        rle.SamplingParams(top_logprobs=21)


def test_prompt_top_logprobs_are_the_hf_forward_passes_most_likely_tokens(engine, hf_model, tiny_model):
    # Past its first two tokens, the prompt is HF's greedy continuation: each token is its position's argmax.
    prompt = PROMPTS[1][:2] + hf_greedy(hf_model, PROMPTS[1][:2], 9)
    reference = hf_logits(hf_model, prompt)[:-1].log_softmax(-1)
    top = reference.topk(4, dim=-1)

    def check(rows: list) -> None:
        assert rows[0] is None and len(rows) == len(prompt)
        for row, values, ids in zip(rows[1:], top.values.tolist(), top.indices.tolist()):
            assert [t for t, _ in row] == ids
            np.testing.assert_allclose([lp for _, lp in row], values, atol=1e-5)

    resp = engine.sample(prompt, 2, rle.SamplingParams(max_tokens=3, seed=1), include_prompt_logprobs=True,
                         prompt_top_logprobs=4).result(WAIT)
    check(resp.prompt_top_logprobs)
    # A greedy token ranks first, with its own logprob.
    for token, lp, row in zip(prompt[2:], resp.prompt_logprobs[2:], resp.prompt_top_logprobs[2:]):
        assert row[0][0] == token and abs(row[0][1] - lp) < 1e-6
    alone = engine.sample(prompt, 1, rle.SamplingParams(max_tokens=2), prompt_top_logprobs=4).result(WAIT)
    assert alone.prompt_logprobs is None
    check(alone.prompt_top_logprobs)
    one = engine.sample([700], 1, rle.SamplingParams(max_tokens=2), prompt_top_logprobs=3).result(WAIT)
    assert one.prompt_top_logprobs == [None]
    plain = engine.sample(prompt, 1, rle.SamplingParams(max_tokens=2)).result(WAIT)
    assert plain.prompt_top_logprobs is None and plain.prompt_top_ids_raw is None
    for bad in (21, -1, True):
        with pytest.raises(InvalidRequest, match="prompt_top_logprobs"):
            engine.validate_sample(prompt, 1, prompt_top_logprobs=bad)
    # Batch-invariant prefill (runs of equal lengths apart) reports the same alternatives.
    backend = TorchBackend(tiny_model, batch_invariant=True)
    for rid, p in (("a", prompt), ("b", PROMPTS[0]), ("c", prompt)):
        backend.add_request(BackendRequest(rid, np.asarray(p, dtype=np.int32).tobytes(),
                                           rle.SamplingParams(max_tokens=1), 0, 1, False, True, 4))
    outs = {out.request_id: out for out in backend.step()}
    for rid in ("a", "c"):
        assert outs[rid].prompt_logprobs is None
        ids, lps = outs[rid].prompt_top_ids, outs[rid].prompt_top_logprobs
        assert ids == top.indices.flatten().tolist()
        np.testing.assert_allclose(lps, top.values.flatten().numpy(), atol=1e-5)
    assert len(outs["b"].prompt_top_ids) == 4 * (len(PROMPTS[0]) - 1)
