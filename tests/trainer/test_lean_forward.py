"""The torch trainer's lean forward (``rlengine.trainer.lean``) against the HF forward it replaces.

Exact, not close: on each decoder shape the torch backend runs (the copy
recipe's character model, the tiny model, Qwen2 with q/k/v biases and GQA,
Llama with an attention and MLP bias and a tied head, Qwen3 with q/k norms)
the lean path's logits and every parameter's gradient are the HF forward's
bits, and so are a training call's logprobs, losses, metrics and gradients
(a ragged right-padded batch, PPO with the entropy bonus, two optimizer steps
so the second call runs on updated weights), in float32 and under bfloat16
autocast. A model the lean path does not serve falls back to HF, and says why.
Last, the batch concatenation the training call now does in one join
(``losses.concat_inputs``) against ``np.concatenate``.
"""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.backends.torch.models import prepare_char_model
from rlengine.rl.recipes.copy_digits import ALPHABET, END
from rlengine.trainer import torch_trainer
from rlengine.trainer.lean import lean_forward
from rlengine.trainer.losses import concat_inputs, concat_tokens, loss_settings
from rlengine.trainer.torch_trainer import TorchTrainer
from rlengine.types import AdamParams

LENGTHS = [5, 9, 1, 7, 9, 3, 6]
"""Ragged datum lengths: every row but the longest is right-padded, one is a single token."""
SETTINGS = loss_settings("ppo", {"entropy_coef": 0.05, "clip_low_threshold": 0.8, "clip_high_threshold": 1.2})


def _build(tmp_path_factory: pytest.TempPathFactory, name: str, **fields: object) -> str:
    """A random model of ``name``'s architecture saved to a fresh directory; every parameter
    (biases and norm weights too) drawn at random so that each one shows in the numbers."""
    import transformers

    config = getattr(transformers, f"{name}Config")(
        vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, f"{name}ForCausalLM")(config)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and torch.all(p == 1) else 0.0))
    path = str(tmp_path_factory.mktemp(name.lower()))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tiny_model: str, model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "char": prepare_char_model(ALPHABET, END, cache_dir=model_cache),
        "tiny": tiny_model,
        "qwen2_bias_gqa": _build(tmp_path_factory, "Qwen2", num_key_value_heads=2, use_sliding_window=False),
        "llama_bias_tied": _build(tmp_path_factory, "Llama", num_key_value_heads=1, attention_bias=True,
                                  mlp_bias=True, tie_word_embeddings=True),
        "qwen3_qk_norm": _build(tmp_path_factory, "Qwen3", num_key_value_heads=2, head_dim=32),
    }


MODELS = ["char", "tiny", "qwen2_bias_gqa", "llama_bias_tied", "qwen3_qk_norm"]


def _hf_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers built after this run the HF forward (the reference)."""
    monkeypatch.setattr(torch_trainer, "lean_forward", lambda model, attention: (None, "hf: the test's reference"))


def _batch(vocab: int, seed: int) -> list[rle.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in LENGTHS:
        seq = rng.integers(1, vocab, n + 1)
        mask = (np.arange(n) >= n // 3).astype(np.float32)
        data.append(rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1].tolist()), loss_fn_inputs={
            "target_tokens": seq[1:].astype(np.int64),
            "logprobs": rng.normal(-3.0, 0.5, n).astype(np.float32),
            "advantages": (mask * rng.normal()).astype(np.float32), "mask": mask}))
    return data


def _padded(trainer: TorchTrainer, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(1, trainer.vocab_size, (len(LENGTHS), max(LENGTHS))))
    for i, n in enumerate(LENGTHS):
        ids[i, n:] = 0
    return ids


@pytest.mark.parametrize("name", MODELS)
def test_lean_logits_and_every_gradient_are_the_hf_forwards_bits(models, name):
    trainer = TorchTrainer(models[name])
    assert trainer.forward_path == "lean"
    model, ids = trainer.model, _padded(trainer, 1)
    weights = torch.randn((*ids.shape, trainer.vocab_size), generator=torch.Generator().manual_seed(2))
    results = []
    for forward in (trainer._lean, lambda x: model(input_ids=x).logits):
        model.zero_grad(set_to_none=True)
        logits = forward(ids)
        (logits * weights).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lean, lean_grads), (hf, hf_grads) = results
    assert torch.equal(lean, hf)
    assert lean_grads.keys() == hf_grads.keys()
    differing = [n for n in hf_grads if not torch.equal(lean_grads[n], hf_grads[n])]
    assert not differing


def _train(trainer: TorchTrainer, steps: int) -> list[tuple[rle.ForwardBackwardOutput, dict[str, torch.Tensor]]]:
    out = []
    for step in range(steps):
        result = trainer.forward_backward(_batch(trainer.vocab_size, step), "ppo", SETTINGS)
        out.append((result, {n: p.grad.clone() for n, p in trainer.named_params.items()}))
        trainer.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    return out


# Every shape in float32; bfloat16 autocast on the three built ones.
CASES = [(name, torch.float32) for name in MODELS] + [(name, torch.bfloat16) for name in MODELS[2:]]


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_training_calls_on_the_lean_path_equal_the_hf_path(models, name, dtype, monkeypatch):
    lean = TorchTrainer(models[name], compute_dtype=dtype)
    assert lean.forward_path == "lean"
    calls = []
    lean.model.forward = lambda *args, **kwargs: calls.append(1)  # the lean path never calls it
    _hf_only(monkeypatch)
    hf = TorchTrainer(models[name], compute_dtype=dtype)
    assert hf.forward_path == "hf: the test's reference"
    for (a, a_grads), (b, b_grads) in zip(_train(lean, 2), _train(hf, 2)):
        assert a.metrics == b.metrics
        assert a.metrics["entropy:sum"] > 0
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            assert x == y
        assert [n for n in b_grads if not torch.equal(a_grads[n], b_grads[n])] == []
    assert not calls
    assert all(torch.equal(p, hf.named_params[n]) for n, p in lean.named_params.items())


def test_forward_only_calls_take_the_lean_path_without_a_graph(models):
    trainer = TorchTrainer(models["tiny"])
    out = trainer.forward(_batch(trainer.vocab_size, 0), "ppo", SETTINGS)
    assert trainer.forward_path == "lean"
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[n] for n in LENGTHS]
    assert all(p.grad is None for p in trainer.named_params.values())


def test_a_model_the_lean_path_does_not_serve_falls_back_to_hf_with_the_reason(models, tmp_path_factory):
    path = _build(tmp_path_factory, "Llama", num_key_value_heads=2,
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    trainer = TorchTrainer(path)
    assert trainer.forward_path == "hf: RoPE type 'linear' (the lean forward runs the default RoPE)"
    out = trainer.forward_backward(_batch(trainer.vocab_size, 0), "ppo", SETTINGS)
    assert np.isfinite(out.metrics["loss:sum"])
    supported = TorchTrainer(models["tiny"]).model
    lean, path = lean_forward(supported, "eager")
    assert lean is None and path == "hf: attention implementation 'eager' (the lean forward is SDPA's)"


def test_gradient_checkpointing_keeps_the_hf_forward_and_the_check_warns_nothing(models, monkeypatch):
    model = TorchTrainer(models["tiny"]).model

    def deprecated(self):  # as newer transformers have it: every `rlengine train` printed the warning
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=2)
        return False

    monkeypatch.setattr(type(model), "is_gradient_checkpointing", property(deprecated), raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lean_forward(model, "sdpa")[1] == "lean"
        model.gradient_checkpointing_enable()
        lean, path = lean_forward(model, "sdpa")
    assert lean is None and path == "hf: gradient checkpointing is on"


def test_a_model_fsdp2_has_sharded_is_another_class_and_keeps_the_hf_forward(models):
    trainer = TorchTrainer(models["tiny"])
    wrapped = type("FSDPQwen2ForCausalLM", (type(trainer.model),), {})  # what FSDP2's fully_shard makes
    trainer.model.__class__ = wrapped
    assert trainer.forward_path.startswith("hf: architecture FSDPQwen2ForCausalLM")


def test_the_lora_trainer_keeps_the_hf_forward(models):
    pytest.importorskip("peft")
    from rlengine.trainer.lora import LoraSpec, LoraTrainer

    trainer = LoraTrainer(models["tiny"], LoraSpec(rank=2, seed=0))
    trainer.forward(_batch(trainer.vocab_size, 0), "ppo", SETTINGS)
    assert trainer.forward_path.startswith("hf: architecture PeftModel ")


def test_concatenated_inputs_are_what_np_concatenate_gives_mixed_dtypes_too():
    data = _batch(48, 0)
    for key in ("target_tokens", "logprobs", "mask"):
        got = concat_inputs(data, key)
        want = np.concatenate([d.loss_fn_inputs[key].to_numpy() for d in data])
        assert got.dtype == want.dtype and np.array_equal(got, want) and got.flags.writeable
    # One datum's mask as int64: promoted as np.concatenate promotes (float64), not reinterpreted.
    mixed = [*data[:2], msgspec.structs.replace(data[2], loss_fn_inputs={
        **data[2].loss_fn_inputs, "mask": np.ones(LENGTHS[2], dtype=np.int64)})]
    got = concat_inputs(mixed, "mask")
    assert got.dtype == np.float64
    assert np.array_equal(got, np.concatenate([*(d.loss_fn_inputs["mask"].to_numpy() for d in data[:2]),
                                               np.ones(LENGTHS[2])]))
    assert concat_inputs(data, "weights").shape == (0,)
    assert np.array_equal(concat_tokens(data), np.concatenate([d.model_input.to_numpy() for d in data]))
