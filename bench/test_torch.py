"""Torch backend and trainer benchmarks (pytest-benchmark); figures in bench/RESULTS.md.

Each figure is measured against its baseline in the same run, rounds
alternating, medians taken (the machine is a noisy 2-vCPU VM):

* uniform lengths: 16 requests of 64 greedy tokens each through the Engine
  (torch backend, continuous batching) vs one HF ``generate`` call on the
  same 16 prompts (batch 16, same tiny model); throughput ratio, target >= 1.
* heavy-tailed lengths: 12 requests of 24 tokens and 4 of 240 (10x); mean
  completion latency of the 16 requests, Engine vs HF ``generate`` (which
  returns the whole batch when its longest member is done); target >= 2x.
* weight install: ``backend.load_weights(trainer.sampler_weights())`` and the
  Engine's ``save_weights_for_sampler`` (gate, drain, compute-thread hop
  included), per MB of weights, vs a plain ``dst.copy_(src)`` loop over the
  same tensors; for the tiny model and a ~50 MB one.
* tree training (issue 19): seconds per ``TorchTrainer.forward_backward``,
  the flat path (``tree_min_prefix=0``) over tree batches (the default), on
  the tiny model's shape with 6 layers, for a GRPO group of 8 x (1,024
  shared prompt + 128 sampled tokens), target >= 3x, and for an 8-turn agent
  trace (one datum per turn, each extending the conversation), target >= 2x.
* issue 29, the copy recipe's sampling step (256 sequences of 4 tokens on the
  character model): batch-invariant over default (target <= 1.15x) and over
  HF ``generate`` per generated token (target <= 1).
* issue 19, on the tiny model's build with 6 layers: time to first token of
  turn 8 of an 8-turn session with and without prefix reuse (target >= 5x);
  prefill time of a group of 8 on one 1,024-token prompt with and without
  (target >= 4x); the Engine against HF ``generate`` at batch 1, 16 and 64
  (tiny and 6 layers; target >= 1 at each).

    OMP_NUM_THREADS=1 python -m pytest bench/test_torch.py --benchmark-only -s
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.models import build_tiny, prepare
from rlengine.trainer.torch_trainer import TorchTrainer

ROUNDS = 5
BATCH = 16
PROMPT_LEN = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rlengine-bench-cache"))


@pytest.fixture(scope="module")
def engine(cache):
    with rle.Engine(rle.EngineConfig(model="tiny", backend="torch", cache_dir=cache)) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.model_path, local_files_only=True).eval()


def _prompts(engine: rle.Engine, max_new: int) -> list[list[int]]:
    """16 prompts whose greedy continuations run ``max_new`` tokens without an eos,
    so the engine and HF generate produce exactly the same number of tokens."""
    rng = np.random.default_rng(0)
    sampler = engine.sampling_client()
    chosen: list[list[int]] = []
    while len(chosen) < BATCH:
        candidates = rng.integers(3, engine.backend.vocab_size, (BATCH, PROMPT_LEN)).tolist()
        futures = [sampler.sample(p, 1, rle.SamplingParams(max_tokens=max_new, temperature=0.0)) for p in candidates]
        chosen += [p for p, f in zip(candidates, futures) if f.result(120).sequences[0].length == max_new]
    return chosen[:BATCH]


def _engine_run(engine: rle.Engine, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list[float]]:
    """Wall time of the whole batch and each request's completion latency (seconds)."""
    sampler = engine.sampling_client()
    done: list[float] = [0.0] * len(prompts)
    lock = threading.Lock()
    t0 = time.perf_counter()
    futures = [sampler.sample(p, 1, rle.SamplingParams(max_tokens=n, temperature=0.0))
               for p, n in zip(prompts, lengths)]
    for i, f in enumerate(futures):
        def record(_f, i=i):
            with lock:
                done[i] = time.perf_counter() - t0
        f.add_done_callback(record)
    for f, n in zip(futures, lengths):
        assert f.result(300).sequences[0].length == n
    wall = time.perf_counter() - t0
    with lock:
        return wall, list(done)


def _hf_run(model, prompts: list[list[int]], max_new: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=0)
    wall = time.perf_counter() - t0
    assert out.shape == (len(prompts), PROMPT_LEN + max_new)
    return wall


def _record(benchmark, result: dict) -> dict:
    benchmark.extra_info.update(result)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
    return result


def test_uniform_lengths_throughput_vs_hf_generate(benchmark, engine, hf_model):
    new = 64
    prompts = _prompts(engine, new)
    ours, theirs = [], []

    def run() -> None:
        _engine_run(engine, prompts, [new] * BATCH)  # warm-up
        _hf_run(hf_model, prompts, new)
        for _ in range(ROUNDS):
            ours.append(_engine_run(engine, prompts, [new] * BATCH)[0])
            theirs.append(_hf_run(hf_model, prompts, new))

    benchmark.pedantic(run, rounds=1, iterations=1)
    tokens = BATCH * new
    e, h = statistics.median(ours), statistics.median(theirs)
    r = _record(benchmark, {"batch": BATCH, "new_tokens_each": new, "engine_tokens_per_s": tokens / e,
                            "hf_generate_tokens_per_s": tokens / h, "throughput_ratio_engine_over_hf": h / e,
                            "target_ratio": 1.0})
    assert r["throughput_ratio_engine_over_hf"] >= r["target_ratio"], r


def test_heavy_tailed_mean_latency_vs_hf_generate(benchmark, engine, hf_model):
    short, long = 24, 240
    lengths = [long if i % 4 == 0 else short for i in range(BATCH)]  # 4 of 16 are 10x longer
    prompts = _prompts(engine, long)
    ours_mean, ours_wall, theirs = [], [], []

    def run() -> None:
        _engine_run(engine, prompts, lengths)  # warm-up
        for _ in range(ROUNDS):
            wall, latencies = _engine_run(engine, prompts, lengths)
            ours_mean.append(statistics.fmean(latencies))
            ours_wall.append(wall)
            # HF generate hands back the whole batch at once: every request's
            # latency is the call's wall time.
            theirs.append(_hf_run(hf_model, prompts, long))

    benchmark.pedantic(run, rounds=1, iterations=1)
    e, h = statistics.median(ours_mean), statistics.median(theirs)
    r = _record(benchmark, {"batch": BATCH, "short_tokens": short, "long_tokens": long, "long_requests": 4,
                            "engine_mean_latency_s": e, "engine_makespan_s": statistics.median(ours_wall),
                            "hf_generate_mean_latency_s": h, "latency_ratio_hf_over_engine": h / e,
                            "target_ratio": 2.0})
    assert r["latency_ratio_hf_over_engine"] >= r["target_ratio"], r


def _install_figures(model_path: str, engine: rle.Engine | None, reps: int = 30) -> dict:
    trainer = TorchTrainer(model_path)
    backend = TorchBackend(model_path)
    weights = trainer.sampler_weights()
    mb = sum(t.numel() * t.element_size() for _, t in weights) / 2**20
    targets = dict(backend.model.named_parameters())
    pairs = [(targets[name], tensor) for name, tensor in weights]
    install, copy = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        backend.load_weights(trainer.sampler_weights(), i + 1)
        install.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        copy.append(time.perf_counter() - t0)
    for name, tensor in weights:
        assert torch.equal(targets[name], tensor)
    out = {"weights_mb": mb, "load_weights_ms_per_mb": statistics.median(install) * 1e3 / mb,
           "copy_ms_per_mb": statistics.median(copy) * 1e3 / mb,
           "load_weights_over_copy": statistics.median(install) / statistics.median(copy)}
    if engine is not None:
        client = engine.training_client()
        client.save_weights_for_sampler().result(120)  # builds the engine's trainer
        through = []
        for _ in range(reps):
            t0 = time.perf_counter()
            client.save_weights_for_sampler().result(120)
            through.append(time.perf_counter() - t0)
        out["engine_install_ms_per_mb"] = statistics.median(through) * 1e3 / mb
        out["engine_install_over_copy"] = statistics.median(through) / statistics.median(copy)
    return out


def test_weight_install_per_mb_vs_plain_copy(benchmark, engine, cache, tmp_path):
    figures: dict = {}

    def run() -> None:
        figures["tiny"] = _install_figures(prepare(rle.EngineConfig(model="tiny", cache_dir=cache)), engine)
        medium = build_tiny(str(tmp_path / "medium"), hidden_size=384, num_heads=6, num_kv_heads=2,
                            intermediate_size=1152, num_layers=6)
        figures["medium"] = _install_figures(medium, None, reps=10)

    benchmark.pedantic(run, rounds=1, iterations=1)
    _record(benchmark, {f"{size}_{k}": v for size, fig in figures.items() for k, v in fig.items()})


# -- constrained vs free decoding ---------------------------------------------------------------

CONSTRAINED_TARGET_RATIO = 1.3
# The call cannot close within the benchmark's tokens (its first argument is at
# least 300 characters), so constrained and free runs decode the same number of
# tokens in the same batch shapes: the ratio is the mask's cost alone.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 300}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}


def _per_token_s(backend: TorchBackend, constraint: str | None, seed: int, batch: int = 8,
                 max_tokens: int = 48) -> float:
    """Seconds per generated token of ``batch`` sequences decoded together, ``max_tokens`` each."""
    from rlengine.backends.base import BackendRequest

    prompt = np.arange(3, 3 + PROMPT_LEN, dtype=np.int32).tobytes()
    for i in range(batch):
        params = rle.SamplingParams(max_tokens=max_tokens, temperature=1.0, constraint=constraint,
                                    ignore_eos=constraint is None)
        backend.add_request(BackendRequest(f"r{i}", prompt, params, seed * 100 + i, max_tokens))
    tokens = 0
    t0 = time.perf_counter()
    while backend.has_unfinished_requests():
        tokens += sum(len(o.token_ids) for o in backend.step())
    wall = time.perf_counter() - t0
    assert tokens == batch * max_tokens, tokens
    return wall / tokens


def test_constrained_vs_free_decoding_per_token(benchmark, engine):
    """A forced tool call (``tool_choice="required"``: xgrammar's mask on every row, every step)
    against free sampling of the same batch, per generated token; 12 alternating pairs,
    the median of the pairs' ratios."""
    from rlengine.constraints import output_constraint
    from rlengine.tool_parsers import HermesParser

    backend = TorchBackend(engine.model_path)
    constraint = output_constraint(HermesParser(), [WEATHER], "required")
    _per_token_s(backend, constraint, 0)  # compiles the grammar (cached from then on) and warms up
    _per_token_s(backend, None, 0)
    pairs: list[tuple[float, float]] = []

    def run() -> None:
        for k in range(12):
            first_free = k % 2 == 0
            a = _per_token_s(backend, None if first_free else constraint, k + 1)
            b = _per_token_s(backend, constraint if first_free else None, k + 1)
            pairs.append((b, a) if first_free else (a, b))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ratios = [c / f for c, f in pairs]
    r = _record(benchmark, {"batch": 8, "constrained_us_per_token": statistics.median(c for c, _ in pairs) * 1e6,
                            "free_us_per_token": statistics.median(f for _, f in pairs) * 1e6,
                            "ratio_constrained_over_free": statistics.median(ratios),
                            "pairs": [round(x, 3) for x in ratios], "target_ratio": CONSTRAINED_TARGET_RATIO})
    assert r["ratio_constrained_over_free"] <= CONSTRAINED_TARGET_RATIO, r


# -- batch-invariant vs default decoding ----------------------------------------------------------

BATCH_INVARIANT_TARGET_RATIO = {8: 2.2, 32: 1.6}
"""What batch invariance may cost in decoding the tiny model at batch 8 and 32. Every call has a
fixed shape since issue 29 (a batch of 8 pads its attention to a whole call: 1.9x measured; the
old design, which rested on one machine's kernel thresholds, measured 1.2-1.35x there and failed
on AVX-512); the RL recipes' shapes are held to RECIPE_INVARIANT_TARGET_RATIO."""
RECIPE_INVARIANT_TARGET_RATIO = 1.15
"""What it may cost at the copy recipe's shapes (issue 29)."""


def test_batch_invariant_vs_default_decoding_per_token(benchmark, engine):
    """Batch-invariant decoding (fixed row tiles and attention calls, ``invariant``) against the
    default path, per generated token, at batch 8 and 32; 10 alternating pairs per batch size,
    the median of the pairs' ratios."""
    backends = {False: TorchBackend(engine.model_path), True: TorchBackend(engine.model_path, batch_invariant=True)}
    pairs: dict[int, list[tuple[float, float]]] = {8: [], 32: []}

    def run() -> None:
        for batch, got in pairs.items():
            for b in backends.values():
                _per_token_s(b, None, 0, batch=batch)  # warm-up
            for k in range(10):
                order = (True, False) if k % 2 else (False, True)
                t = {inv: _per_token_s(backends[inv], None, k + 1, batch=batch) for inv in order}
                got.append((t[True], t[False]))

    benchmark.pedantic(run, rounds=1, iterations=1)
    result: dict = {"target_ratio": {str(k): v for k, v in BATCH_INVARIANT_TARGET_RATIO.items()}}
    for batch, got in pairs.items():
        ratios = [i / d for i, d in got]
        result |= {f"batch{batch}_invariant_us_per_token": statistics.median(i for i, _ in got) * 1e6,
                   f"batch{batch}_default_us_per_token": statistics.median(d for _, d in got) * 1e6,
                   f"batch{batch}_ratio_invariant_over_default": statistics.median(ratios),
                   f"batch{batch}_pairs": [round(x, 3) for x in ratios]}
    r = _record(benchmark, result)
    for batch in pairs:
        assert r[f"batch{batch}_ratio_invariant_over_default"] <= BATCH_INVARIANT_TARGET_RATIO[batch], r


def _copy_batch(rng: np.random.Generator, tag: int) -> list:
    """One step of the copy recipe's sampling: 32 prompts ("123=") x 8 samples of at most 4
    tokens at temperature 1, processed logprobs, as the engine fans a group out."""
    from rlengine.backends.base import BackendRequest
    from rlengine.rl.recipes.copy_digits import encode

    out = []
    for g in range(32):
        prompt = np.asarray(encode(f"{int(rng.integers(0, 1000)):03d}="), dtype=np.int32).tobytes()
        for i in range(8):
            out.append(BackendRequest(f"{tag}.{g}.{i}", prompt, rle.SamplingParams(
                max_tokens=4, temperature=1.0, logprobs_mode="processed"), g * 8 + i, 4, stream=False))
    return out


def _sample_all(backend: TorchBackend, requests: list) -> float:
    t0 = time.perf_counter()
    for r in requests:
        backend.add_request(r)
    while backend.has_unfinished_requests():
        backend.step()
    return time.perf_counter() - t0


def _hf_generate_s(model, requests: list) -> float:
    """HF ``generate`` on the same prompts (what TRL's GRPOTrainer samples with): sampled at
    temperature 1, no top-k, 4 new tokens; the logprobs would cost TRL another forward."""
    ids = torch.as_tensor(np.stack([np.frombuffer(r.prompt, dtype=np.int32) for r in requests]), dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                       max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
    return time.perf_counter() - t0


def test_copy_recipe_sampling_reproducible_vs_default_vs_hf_generate(benchmark, cache):
    """The copy recipe's sampling step (256 sequences of 4 tokens on the character model, the
    backend alone): batch-invariant against the default path (target <= 1.15x) and against HF
    ``generate`` on the same prompts, per generated token; 10 rounds, each runs all three in an
    alternating order; medians of the per-round ratios."""
    from transformers import AutoModelForCausalLM

    from rlengine.backends.torch.models import prepare_char_model
    from rlengine.rl.recipes.copy_digits import ALPHABET, END

    path = prepare_char_model(ALPHABET, END, cache_dir=cache, seed=0, max_position_embeddings=64)
    backends = {"invariant": TorchBackend(path, batch_invariant=True, processed=True),
                "default": TorchBackend(path, processed=True)}
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    rng = np.random.default_rng(0)
    rounds: list[dict[str, float]] = []

    def run() -> None:
        for tag in range(3):  # warm-up
            for b in backends.values():
                _sample_all(b, _copy_batch(rng, tag))
            _hf_generate_s(hf, _copy_batch(rng, tag))
        for k in range(10):
            requests = _copy_batch(rng, 100 + k)
            order = ["invariant", "default", "hf"] if k % 2 else ["hf", "default", "invariant"]
            t = {name: _hf_generate_s(hf, requests) if name == "hf" else _sample_all(backends[name], requests)
                 for name in order}
            rounds.append(t)

    benchmark.pedantic(run, rounds=1, iterations=1)
    tokens = 256 * 4
    result = {f"{name}_us_per_token": statistics.median(r[name] for r in rounds) / tokens * 1e6
              for name in ("invariant", "default", "hf")}
    result |= {"ratio_invariant_over_default": statistics.median(r["invariant"] / r["default"] for r in rounds),
               "ratio_invariant_over_hf_generate": statistics.median(r["invariant"] / r["hf"] for r in rounds),
               "pairs_invariant_over_default": [round(r["invariant"] / r["default"], 3) for r in rounds],
               "target_ratio": RECIPE_INVARIANT_TARGET_RATIO}
    r = _record(benchmark, result)
    assert r["ratio_invariant_over_default"] <= RECIPE_INVARIANT_TARGET_RATIO, r
    assert r["ratio_invariant_over_hf_generate"] <= 1.0, r


# -- tree training (issue 19) ------------------------------------------------------------------

TREE_LAYERS = 6
GROUP, PROMPT, SAMPLED = 8, 1024, 128
TURNS, FIRST_PROMPT, TURN_IN, TURN_OUT = 8, 256, 64, 128
TREE_ROUNDS = 5


@pytest.fixture(scope="module")
def tree_trainers(cache):
    """The flat and the tree path of the torch trainer on the tiny model's shape with 6 layers."""
    path = prepare(rle.EngineConfig(model="tiny", cache_dir=cache, model_args={"num_layers": TREE_LAYERS}))
    return TorchTrainer(path, tree_min_prefix=0), TorchTrainer(path)


def _rl_datum(seq: np.ndarray, actions: np.ndarray, rng: np.random.Generator) -> rle.Datum:
    """An importance_sampling datum: advantage on the action tokens (``actions``, per target) only."""
    n = seq.shape[0] - 1
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1].tolist()), loss_fn_inputs={
        "target_tokens": seq[1:].astype(np.int64),
        "logprobs": np.full(n, -7.0, dtype=np.float32),
        "advantages": (actions * rng.normal()).astype(np.float32)})


def _grpo_group(rng: np.random.Generator) -> list[rle.Datum]:
    prompt = rng.integers(3, 1024, PROMPT)
    actions = (np.arange(PROMPT + SAMPLED - 1) >= PROMPT - 1).astype(np.float32)
    return [_rl_datum(np.concatenate([prompt, rng.integers(3, 1024, SAMPLED)]), actions, rng) for _ in range(GROUP)]


def _agent_trace(rng: np.random.Generator) -> list[rle.Datum]:
    """One datum per turn, each the whole conversation so far: the first prompt, then per turn
    the model's reply (the action tokens) and, before the next one, a tool result."""
    conversation, actions, data = rng.integers(3, 1024, FIRST_PROMPT), np.zeros(FIRST_PROMPT), []
    for turn in range(TURNS):
        conversation = np.concatenate([conversation, rng.integers(3, 1024, TURN_OUT)])
        actions = np.concatenate([actions, np.ones(TURN_OUT)])
        data.append(_rl_datum(conversation, actions[1:], rng))
        if turn + 1 < TURNS:
            conversation = np.concatenate([conversation, rng.integers(3, 1024, TURN_IN)])
            actions = np.concatenate([actions, np.zeros(TURN_IN)])
    return data


def _flat_vs_tree(trainers: tuple[TorchTrainer, TorchTrainer], data: list[rle.Datum], target: float) -> dict:
    """Seconds per forward_backward, flat and tree, in alternating rounds after a warm-up of each."""
    times: dict[str, list[float]] = {"flat": [], "tree": []}
    losses = {}
    for k in range(TREE_ROUNDS + 1):
        for name in (("flat", "tree") if k % 2 else ("tree", "flat")):
            trainer = trainers[name == "tree"]
            trainer.model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = trainer.forward_backward(data, "importance_sampling", (0.0, math.inf))
            if k:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
            losses[name] = out.metrics["loss:sum"]
    assert losses["tree"] == pytest.approx(losses["flat"], rel=1e-4, abs=1e-4)
    flat_s, tree_s = statistics.median(times["flat"]), statistics.median(times["tree"])
    packed = sum(tree.tokens.shape[0] for _, tree in trainers[1]._plan(data))
    return {"datums": len(data), "flat_tokens": sum(d.model_input.length for d in data), "packed_tokens": packed,
            "layers": TREE_LAYERS, "flat_s_per_forward_backward": flat_s, "tree_s_per_forward_backward": tree_s,
            "ratio_flat_over_tree": flat_s / tree_s,
            "round_ratios": [round(f / t, 2) for f, t in zip(times["flat"], times["tree"])], "target_ratio": target}


def test_tree_training_grpo_group_vs_flat(record, tree_trainers):
    """A GRPO group, 8 x (1,024 shared prompt + 128 sampled tokens): flat / tree >= 3x."""
    data = _grpo_group(np.random.default_rng(0))
    r = record(lambda: _flat_vs_tree(tree_trainers, data, 3.0))
    assert r["ratio_flat_over_tree"] >= r["target_ratio"], r


def test_tree_training_agent_trace_vs_flat(record, tree_trainers):
    """An 8-turn agent trace, one datum per turn extending the conversation: flat / tree >= 2x."""
    data = _agent_trace(np.random.default_rng(1))
    r = record(lambda: _flat_vs_tree(tree_trainers, data, 2.0))
    assert r["ratio_flat_over_tree"] >= r["target_ratio"], r


# -- issue 19: prefix KV reuse, and the backend against static batching -------------------------

MEDIUM = {"num_layers": 6, "max_position_embeddings": 4096}
"""The tiny model's build parameters with 6 layers and room for an 8-turn session (built locally)."""
TURNS, TURN_NEW, FIRST_PROMPT, USER_TOKENS = 8, 256, 192, 64
GROUP, GROUP_PROMPT = 8, 1024
TTFT_TARGET, GROUP_TARGET = 5.0, 4.0


@pytest.fixture(scope="module")
def medium(cache):
    return prepare(rle.EngineConfig(model="tiny", model_args=MEDIUM, cache_dir=cache))


def _request(rid: str, prompt: list[int], max_tokens: int, seed: int = 0):
    from rlengine.backends.base import BackendRequest

    params = rle.SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    return BackendRequest(rid, np.asarray(prompt, dtype=np.int32).tobytes(), params, seed, max_tokens)


def _until_done(backend: TorchBackend) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while backend.has_unfinished_requests():
        for out in backend.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def _prefill_s(backend: TorchBackend, prompts: list[list[int]]) -> float:
    """Seconds from adding ``prompts`` (one token each) to their last first token."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        backend.add_request(_request(f"p{i}", p, 1, seed=i))
    _until_done(backend)
    return time.perf_counter() - t0


def test_multi_turn_time_to_first_token_with_and_without_prefix_reuse(benchmark, medium):
    """Turn 8 of an 8-turn session (192-token first prompt, 256 sampled tokens and a 64-token user
    message per turn): time to its first token on a backend that ran turns 1-7 (its prefix cache
    holds them) and on one without a prefix cache; 5 alternating rounds, each with a new
    turn-8 message. Default mode (target >= 5x); batch-invariant mode too, whose cache holds
    only prefilled KV (turn 7's answer is prefilled again)."""
    rng = np.random.default_rng(0)
    warm = TorchBackend(medium)
    conv = rng.integers(3, 1000, FIRST_PROMPT).tolist()
    prompts = []
    for turn in range(TURNS - 1):
        prompts.append(conv)
        answer = _until_done(_add(warm, _request(f"turn{turn}", conv, TURN_NEW, seed=turn)))[f"turn{turn}"]
        conv = conv + answer + rng.integers(3, 1000, USER_TOKENS).tolist()
    base = conv[:-USER_TOKENS]
    invariant = TorchBackend(medium, batch_invariant=True)
    for p in prompts:  # what its cache holds after turns 1-7: their prompts, prefilled
        _prefill_s(invariant, [p])
    backends = {"cold": TorchBackend(medium, prefix_cache_bytes=0), "warm": warm,
                "invariant_cold": TorchBackend(medium, batch_invariant=True, prefix_cache_bytes=0),
                "invariant_warm": invariant}
    # Each measurement starts from the cache as turns 1-7 left it (a measured turn 8 would
    # otherwise leave its prompt, and with it turn 7's answer, for the next round).
    after_turn7 = {name: copy.deepcopy(b.prefix_cache) for name, b in backends.items()}
    times: dict[str, list[float]] = {name: [] for name in backends}

    def measure(name: str, prompt: list[int]) -> float:
        backends[name].prefix_cache = copy.deepcopy(after_turn7[name])
        return _prefill_s(backends[name], [prompt])

    def run() -> None:
        for name in backends:  # warm-up
            measure(name, base + rng.integers(3, 1000, USER_TOKENS).tolist())
        for k in range(ROUNDS):
            prompt = base + rng.integers(3, 1000, USER_TOKENS).tolist()
            for name in (list(backends) if k % 2 == 0 else list(reversed(backends))):
                times[name].append(measure(name, prompt))

    benchmark.pedantic(run, rounds=1, iterations=1)
    m = {name: statistics.median(t) for name, t in times.items()}
    r = _record(benchmark, {"turn8_prompt_tokens": len(base) + USER_TOKENS, "layers": MEDIUM["num_layers"],
                            "cold_ttft_s": m["cold"], "reuse_ttft_s": m["warm"],
                            "ttft_ratio_cold_over_reuse": m["cold"] / m["warm"],
                            "invariant_cold_ttft_s": m["invariant_cold"], "invariant_reuse_ttft_s": m["invariant_warm"],
                            "invariant_ttft_ratio": m["invariant_cold"] / m["invariant_warm"],
                            "target_ratio": TTFT_TARGET})
    assert r["ttft_ratio_cold_over_reuse"] >= TTFT_TARGET, r


def _add(backend: TorchBackend, request) -> TorchBackend:
    backend.add_request(request)
    return backend


def test_group_sharing_a_prompt_prefill_time_with_and_without_prefix_reuse(benchmark, medium):
    """8 requests with one 1,024-token prompt, added together (the engine's fan-out of
    num_samples=8), one token each: prefill time without a prefix cache and with one emptied
    before each round (so the sharing happens within the step); 5 alternating rounds, a new
    prompt each. Default mode and batch-invariant mode (target >= 4x each)."""
    rng = np.random.default_rng(1)
    backends = {"cold": TorchBackend(medium, prefix_cache_bytes=0), "warm": TorchBackend(medium),
                "invariant_cold": TorchBackend(medium, batch_invariant=True, prefix_cache_bytes=0),
                "invariant_warm": TorchBackend(medium, batch_invariant=True)}
    times: dict[str, list[float]] = {name: [] for name in backends}

    def measure(name: str, prompt: list[int]) -> float:
        b = backends[name]
        if b.prefix_cache is not None:
            b.prefix_cache.clear()
        return _prefill_s(b, [prompt] * GROUP)

    def run() -> None:
        for name in backends:
            measure(name, rng.integers(3, 1000, GROUP_PROMPT).tolist())
        for k in range(ROUNDS):
            prompt = rng.integers(3, 1000, GROUP_PROMPT).tolist()
            for name in (list(backends) if k % 2 == 0 else list(reversed(backends))):
                times[name].append(measure(name, prompt))

    benchmark.pedantic(run, rounds=1, iterations=1)
    m = {name: statistics.median(t) for name, t in times.items()}
    r = _record(benchmark, {"group": GROUP, "prompt_tokens": GROUP_PROMPT, "layers": MEDIUM["num_layers"],
                            "cold_prefill_s": m["cold"], "reuse_prefill_s": m["warm"],
                            "prefill_ratio_cold_over_reuse": m["cold"] / m["warm"],
                            "invariant_cold_prefill_s": m["invariant_cold"],
                            "invariant_reuse_prefill_s": m["invariant_warm"],
                            "invariant_prefill_ratio": m["invariant_cold"] / m["invariant_warm"],
                            "target_ratio": GROUP_TARGET})
    assert r["prefill_ratio_cold_over_reuse"] >= GROUP_TARGET, r
    assert r["invariant_prefill_ratio"] >= GROUP_TARGET, r


def _greedy_prompts(engine: rle.Engine, count: int, max_new: int) -> list[list[int]]:
    """``count`` prompts whose greedy continuations run ``max_new`` tokens without an eos."""
    rng = np.random.default_rng(0)
    sampler = engine.sampling_client()
    chosen: list[list[int]] = []
    while len(chosen) < count:
        candidates = rng.integers(3, engine.backend.vocab_size, (count, PROMPT_LEN)).tolist()
        futures = [sampler.sample(p, 1, rle.SamplingParams(max_tokens=max_new, temperature=0.0)) for p in candidates]
        chosen += [p for p, f in zip(candidates, futures) if f.result(300).sequences[0].length == max_new]
    return chosen[:count]


@pytest.mark.parametrize("model_args", [pytest.param({}, id="tiny"), pytest.param(MEDIUM, id="6_layers")])
def test_engine_vs_hf_generate_at_batch_1_16_64(benchmark, cache, model_args):
    """Static batching's home ground: every prompt of 16 tokens, every continuation 64 greedy
    tokens, all requests sent at once. The Engine (torch backend, continuous batching, no prefix
    cache: HF keeps nothing between calls) against one HF ``generate`` call on the whole batch;
    5 alternating rounds per batch size, throughput ratio of the medians (target >= 1 at each)."""
    from transformers import AutoModelForCausalLM

    new = 64
    result: dict = {"new_tokens_each": new, "target_ratio": 1.0}
    config = rle.EngineConfig(model="tiny", model_args=model_args, backend="torch", cache_dir=cache,
                              engine_args={"prefix_cache_bytes": 0})
    with rle.Engine(config) as engine:
        hf = AutoModelForCausalLM.from_pretrained(engine.model_path, local_files_only=True).eval()
        prompts = _greedy_prompts(engine, 64, new)

        def run() -> None:
            for batch in (1, 16, 64):
                chosen = prompts[:batch]
                _engine_run(engine, chosen, [new] * batch)  # warm-up
                _hf_run(hf, chosen, new)
                ours, theirs = [], []
                for k in range(ROUNDS):
                    if k % 2:
                        theirs.append(_hf_run(hf, chosen, new))
                        ours.append(_engine_run(engine, chosen, [new] * batch)[0])
                    else:
                        ours.append(_engine_run(engine, chosen, [new] * batch)[0])
                        theirs.append(_hf_run(hf, chosen, new))
                e, h = statistics.median(ours), statistics.median(theirs)
                result.update({f"batch{batch}_engine_tokens_per_s": batch * new / e,
                               f"batch{batch}_hf_tokens_per_s": batch * new / h,
                               f"batch{batch}_ratio_engine_over_hf": h / e})

        benchmark.pedantic(run, rounds=1, iterations=1)
    r = _record(benchmark, result)
    for batch in (1, 16, 64):
        assert r[f"batch{batch}_ratio_engine_over_hf"] >= 1.0, r
