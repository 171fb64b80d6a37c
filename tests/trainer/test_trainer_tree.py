"""Tree batches in the torch trainer against its flat path.

Reference: the same trainer with ``tree_min_prefix=0`` (the flat, padded
forward), same weights, same data. For every loss, with and without the
options on top (entropy bonus, reference KL, an off-policy correction, the
temperature / top-k / top-p inputs), and for each tree shape (branching
depth 1 to 3, ragged and equal branches, datums sharing nothing, duplicates,
a datum that is a prefix of another, an agent's turns), the outputs
(``logprobs``, ``elementwise_loss``), every metric and every parameter's
gradient equal the flat ones within 1e-5 (gradients: relative to each
tensor's largest entry; float32 sums run in another order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.backends.torch.runtime import engine_args
from rlengine.errors import ConfigurationError
from rlengine.trainer import torch_trainer
from rlengine.trainer.lora import LoraSpec, LoraTrainer
from rlengine.trainer.losses import loss_settings
from rlengine.trainer.torch_trainer import TorchTrainer, build
from rlengine.types import LOSS_FNS

MIN_PREFIX = 4
RATIOS = np.array([0.3, 0.79, 0.81, 1.0, 1.19, 1.21, 2.5, 4.5])
CORRECTIONS = {"cross_entropy": {}, "importance_sampling": {"tis_cap": 1.5},
               "ppo": {"icepop_low": 0.5, "icepop_high": 2.0, "geo_mask_low": 0.5, "geo_mask_high": 2.0},
               "cispo": {"mis_cap": 2.0}, "dro": {}, "gspo": {}, "stable_reinforce": {}}
REQUIRED = {"dro": {"beta": 0.1}, "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "stable_reinforce": {"kl_coeff": 0.1, "geo_mask_high": 3.0}}
"""Config the Tinker losses need (no documented default), and stable_reinforce's own KL term and a mask
range its datums' ratios fall in (no old_logprobs: it takes no corrections)."""


def perturb(model: torch.nn.Module) -> None:
    """Move the weights off their initial values, so that the reference KL is not zero."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def trainers(tiny_model):
    flat, tree = TorchTrainer(tiny_model, tree_min_prefix=0), TorchTrainer(tiny_model, tree_min_prefix=MIN_PREFIX)
    perturb(flat.model)
    perturb(tree.model)
    return flat, tree


def ints(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 1024, n).tolist()


def shape(name: str) -> list[list[int]]:
    """Token sequences (model input plus the last target) of one tree shape."""
    rng = np.random.default_rng(sum(map(ord, name)))
    p = ints(rng, 30)
    if name == "depth1_ragged":  # a GRPO group: one prompt, samples of different lengths
        return [p + ints(rng, n) for n in (3, 25, 9, 14, 1)]
    if name == "depth1_equal":
        return [p + ints(rng, 12) for _ in range(4)]
    if name == "depth2":
        a, b = p + ints(rng, 12), p + ints(rng, 7)
        return [a + ints(rng, 5), a + ints(rng, 11), b + ints(rng, 4), b + ints(rng, 9)]
    if name == "depth3":
        a = p + ints(rng, 10)
        a1, a2 = a + ints(rng, 6), a + ints(rng, 8)
        return [a1 + ints(rng, 3), a1 + ints(rng, 7), a2 + ints(rng, 5), p + ints(rng, 9), a + ints(rng, 4)]
    if name == "unshared_mixed_in":  # a group beside datums sharing nothing, or less than MIN_PREFIX tokens
        group = [p + ints(rng, n) for n in (6, 10, 4)]
        return [ints(rng, 20), group[0], p[:2] + ints(rng, 15), group[1], ints(rng, 9), group[2]]
    if name == "duplicates":
        x = p + ints(rng, 8)
        return [x, p + ints(rng, 5), list(x), list(x)]
    if name == "prefix_of_another":
        long = p + ints(rng, 20)
        return [long, long[:40], p + ints(rng, 6), long[:31]]
    if name == "agent_turns":  # each turn's datum extends the conversation so far
        turns, seqs = list(p), []
        for _ in range(4):
            turns += ints(rng, 6) + ints(rng, 10)
            seqs.append(list(turns))
        return seqs
    raise AssertionError(name)


SHAPES = ("depth1_ragged", "depth1_equal", "depth2", "depth3", "unshared_mixed_in", "duplicates",
          "prefix_of_another", "agent_turns")


def batch(flat: TorchTrainer, seqs: list[list[int]], loss_fn: str, options: bool) -> tuple[list[rle.Datum], object]:
    """Datums of ``loss_fn`` on ``seqs`` (ratios spread over the clip ranges) and their settings;
    ``options``: the entropy bonus, the reference KL, the corrections and the transform inputs too."""
    plain = [rle.Datum(model_input=rle.ModelInput.from_ints(s[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(s[1:], dtype=np.int64)}) for s in seqs]
    logps = [o["logprobs"].to_numpy() for o in flat.forward(plain, "cross_entropy", (0.0, math.inf)).loss_fn_outputs]
    rng = np.random.default_rng(len(seqs))
    data = []
    for datum, logp in zip(plain, logps):
        n = logp.shape[0]
        inputs = dict(datum.loss_fn_inputs)
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0.0, 2.0, n).astype(np.float32)
        else:
            inputs["logprobs"] = (logp - np.log(np.resize(RATIOS, n))).astype(np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = (rng.random(n) > 0.3).astype(np.float32)
                inputs["sequence_ratio_mask"][0] = 1.0
            if options and loss_fn not in REQUIRED:  # the proximal policy of the ratio losses' corrections
                inputs["old_logprobs"] = (logp + rng.normal(0.0, 0.2, n)).astype(np.float32)
        if options:
            inputs["mask"] = (rng.random(n) > 0.25).astype(np.float32)
            inputs["temperature"] = rng.choice([1.0, 0.7], n).astype(np.float32)
            inputs["top_k"] = rng.choice([0.0, 20.0], n).astype(np.float32)
            inputs["top_p"] = rng.choice([1.0, 0.9], n).astype(np.float32)
        data.append(rle.Datum(model_input=datum.model_input,
                              loss_fn_inputs={k: rle.TensorData.from_numpy(v) if isinstance(v, np.ndarray) else v
                                              for k, v in inputs.items()}))
    config = {"entropy_coef": 0.05, "kl_coef": 0.1, **CORRECTIONS[loss_fn]} if options else {}
    config |= REQUIRED.get(loss_fn, {})
    return data, loss_settings(loss_fn, config)


def run(trainer: TorchTrainer, data, loss_fn: str, settings, backward: bool = True):
    trainer.model.zero_grad(set_to_none=True)
    out = (trainer.forward_backward if backward else trainer.forward)(data, loss_fn, settings)
    return out, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same(flat_result, tree_result, params: set[str] | None) -> None:
    (want, want_grads), (got, got_grads) = flat_result, tree_result
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    for w, g in zip(want.loss_fn_outputs, got.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].to_numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(g["elementwise_loss"].to_numpy(), w["elementwise_loss"].to_numpy(),
                                   rtol=1e-5, atol=1e-5)
    if params is None:
        assert not want_grads and not got_grads
        return
    assert got_grads.keys() == want_grads.keys() == params
    for name, ref in want_grads.items():
        torch.testing.assert_close(got_grads[name], ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max())),
                                   msg=name)


def packed_tokens(trainer: TorchTrainer, data) -> int:
    plan = trainer._plan(data)
    assert all(tree is not None for _, tree in plan)
    return sum(tree.tokens.shape[0] for _, tree in plan)


@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_tree_equals_flat_for_every_loss(trainers, loss_fn, options):
    flat, tree = trainers
    seqs = shape("depth3") + shape("depth1_ragged") + shape("unshared_mixed_in")[:2] + shape("duplicates")[2:]
    seqs += shape("prefix_of_another")
    data, settings = batch(flat, seqs, loss_fn, options)
    assert packed_tokens(tree, data) < sum(d.model_input.length for d in data) // 2
    params = set(dict(flat.model.named_parameters()))
    got = run(tree, data, loss_fn, settings)
    assert_same(run(flat, data, loss_fn, settings), got, params)
    if options:
        ratio = {"mismatch_k1:sum"} if loss_fn != "cross_entropy" else set()
        ratio |= {"is_tokens:sum"} if CORRECTIONS[loss_fn] and loss_fn != "cross_entropy" else set()
        assert {"entropy:sum", "kl_ref:sum", *ratio} <= set(got[0].metrics)


@pytest.mark.parametrize("name", SHAPES)
def test_tree_equals_flat_for_each_shape(trainers, name):
    flat, tree = trainers
    data, settings = batch(flat, shape(name), "ppo", options=True)
    total = sum(d.model_input.length for d in data)
    assert packed_tokens(tree, data) < total
    params = set(dict(flat.model.named_parameters()))
    assert_same(run(flat, data, "ppo", settings), run(tree, data, "ppo", settings), params)
    assert_same(run(flat, data, "ppo", settings, backward=False), run(tree, data, "ppo", settings, backward=False),
                None)


def test_an_agent_trace_packs_to_its_last_turn(trainers):
    _, tree = trainers
    seqs = shape("agent_turns")
    data, _ = batch(trainers[0], seqs, "cross_entropy", options=False)
    ((group, packed),) = tree._plan(data)
    assert sorted(group) == [0, 1, 2, 3]
    np.testing.assert_array_equal(packed.tokens, seqs[-1][:-1])


def test_micro_batches_hold_packed_tokens_within_the_budget(trainers):
    flat, tree = trainers
    data, settings = batch(flat, shape("depth2") + shape("depth1_ragged"), "importance_sampling", options=True)
    budget = 64
    tree.micro_batch_tokens = budget
    try:
        plan = tree._plan(data)
        assert len(plan) > 2
        assert all(packed.tokens.shape[0] <= budget for _, packed in plan)
        assert sorted(i for group, _ in plan for i in group) == list(range(len(data)))
        params = set(dict(flat.model.named_parameters()))
        assert_same(run(flat, data, "importance_sampling", settings), run(tree, data, "importance_sampling", settings),
                    params)
    finally:
        tree.micro_batch_tokens = 8192


def test_the_reference_forward_takes_the_tree(trainers, monkeypatch):
    flat, tree = trainers
    data, _ = batch(flat, shape("depth3"), "cross_entropy", options=False)
    switched = []
    real = torch_trainer._tree_attention_in

    def spy(model):
        switched.append(model)
        return real(model)

    monkeypatch.setattr(torch_trainer, "_tree_attention_in", spy)
    ((group, packed),) = tree._plan(data)
    ours = tree._reference_logprobs([data[i] for i in group], packed)
    assert switched == [tree._reference]
    want = flat._reference_logprobs([data[i] for i in group], None)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5)


def test_the_setting_off_is_the_flat_path(trainers, monkeypatch):
    flat, tree = trainers
    data, settings = batch(flat, shape("depth1_ragged"), "ppo", options=True)
    assert flat._plan(data) == [(group, None) for group in flat._micro_batches(data)]

    def refuse(model):
        raise AssertionError("the flat path switched to the tree attention")

    monkeypatch.setattr(torch_trainer, "_tree_attention_in", refuse)
    run(flat, data, "ppo", settings)
    # A shared prefix below the threshold: flat as well; at the threshold: a tree.
    prompt = shape("depth1_equal")[0][:30]
    seqs = [prompt + [5, 6, 7], prompt + [8, 9]]
    short = [rle.Datum(model_input=rle.ModelInput.from_ints(s[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(s[1:], dtype=np.int64)}) for s in seqs]
    tree.tree_min_prefix = 31
    try:
        assert all(packed is None for _, packed in tree._plan(short))
        tree.tree_min_prefix = 30
        assert all(packed is not None for _, packed in tree._plan(short))
    finally:
        tree.tree_min_prefix = MIN_PREFIX


def test_tree_min_prefix_is_an_engine_arg(tiny_model):
    config = rle.EngineConfig(model="tiny")
    assert engine_args(config)["tree_min_prefix"] == 64
    for bad in (-1, True, 2.5, "64"):
        with pytest.raises(ConfigurationError, match="tree_min_prefix"):
            engine_args(rle.EngineConfig(model="tiny", engine_args={"tree_min_prefix": bad}))
    built = build(rle.EngineConfig(model="tiny", engine_args={"tree_min_prefix": 0}), tiny_model)
    assert built.tree_min_prefix == 0


def test_lora_tree_equals_flat(tiny_model):
    spec = LoraSpec(rank=4, seed=3)
    flat, tree = LoraTrainer(tiny_model, spec, tree_min_prefix=0), LoraTrainer(tiny_model, spec,
                                                                               tree_min_prefix=MIN_PREFIX)
    for trainer in (flat, tree):
        with torch.no_grad():
            for p in trainer.named_params.values():
                p.add_(0.01)  # lora_B starts at zero: make the adapters count
    data, settings = batch(flat, shape("depth2"), "ppo", options=True)
    assert packed_tokens(tree, data) < sum(d.model_input.length for d in data)
    results = []
    for trainer in (flat, tree):
        out = trainer.forward_backward(data, "ppo", settings)
        results.append((out, {n: p.grad.clone() for n, p in trainer.named_params.items()}))
        assert trainer.model.config._attn_implementation == "sdpa"  # restored after the tree forward
    assert_same(results[0], results[1], set(flat.named_params))


def test_an_engines_trainer_packs_a_group_by_default(engine_config):
    rng = np.random.default_rng(7)
    prompt = ints(rng, 70)
    seqs = [prompt + ints(rng, 12) for _ in range(4)]  # a group: its prompt is 70 >= 64 tokens
    data = [rle.Datum(model_input=rle.ModelInput.from_ints(s[:-1]),
                      loss_fn_inputs={"target_tokens": np.array(s[1:], dtype=np.int64)}) for s in seqs]
    with rle.Engine(engine_config("torch")) as engine:
        out = engine.training_client().forward(data, "cross_entropy").result(120)
        trainer = engine.submit_blocking("forward", engine.get_trainer).result(120)
    ((_, packed),) = trainer._plan(data)
    assert packed is not None and packed.tokens.shape[0] == 70 + 4 * 11
    want = TorchTrainer(trainer.model_path, tree_min_prefix=0).forward(data, "cross_entropy", (0.0, math.inf))
    for w, g in zip(want.loss_fn_outputs, out.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].to_numpy(), rtol=0, atol=1e-5)
