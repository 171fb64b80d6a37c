"""The LoRA trainer (``rlengine.trainer.lora``) behind ``create_lora_training_client``.

References: peft's own in-place merge (``merge_adapter``) for the merged
sampler weights, the HF model's forward on those weights against the
adapted model's forward, the base weights for a fresh adapter, and a second
trainer resumed from saved state (bit-identical next step).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import rlengine as rle
from rlengine.errors import ConfigurationError, InvalidRequest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rlengine.trainer.lora import LoraSpec, LoraTrainer, merge_adapter, read_adapter

pytestmark = pytest.mark.slow
INF = (0.0, float("inf"))


def _data(seed: int = 0) -> list[rle.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (9, 14):
        toks = rng.integers(3, 1000, size=n + 1)
        out.append(rle.Datum(model_input=rle.ModelInput.from_ints(toks[:-1]),
                             loss_fn_inputs={"target_tokens": toks[1:].astype(np.int64)}))
    return out


def _step(trainer: LoraTrainer, seed: int = 0, lr: float = 1e-2) -> float:
    loss = trainer.forward_backward(_data(seed), "cross_entropy", INF).metrics["loss:sum"]
    trainer.optim_step(rle.AdamParams(learning_rate=lr))
    return loss


@pytest.fixture(scope="module")
def trained(tiny_model):
    trainer = LoraTrainer(tiny_model, LoraSpec(rank=4, seed=0))
    _step(trainer)
    _step(trainer, seed=1)
    return trainer


def _base(tiny_model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(tiny_model, "model.safetensors"))


def test_a_fresh_adapter_leaves_the_model_unchanged(tiny_model):
    trainer = LoraTrainer(tiny_model, LoraSpec(rank=4, seed=0))
    base = _base(tiny_model)
    merged = dict(trainer.sampler_weights())
    assert set(merged) == set(base)
    for name, tensor in base.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0)


def test_merged_weights_equal_peft_merge_and_the_adapted_forward(trained, tiny_model):
    ours = {n: t.clone() for n, t in trained.sampler_weights()}
    base = _base(tiny_model)
    changed = [n for n in ours if not torch.equal(ours[n], base[n])]
    # Attention, MLP and unembedding projections of both layers were trained.
    assert len(changed) == 2 * 7 + 1 and "lm_head.weight" in changed
    frozen = {n: p.detach().clone() for n, p in trained._base_weights}
    trained.model.merge_adapter()
    try:
        theirs = {n: p.detach().clone() for n, p in trained._base_weights}
    finally:
        # Unmerging subtracts in floating point: put the exact base weights back.
        trained.model.unmerge_adapter()
        with torch.no_grad():
            for n, p in trained._base_weights:
                p.copy_(frozen[n])
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-6, atol=1e-6)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    hf.load_state_dict(ours)
    ids = torch.tensor([_data(3)[0].model_input.to_ints()])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, trained.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_snapshots_and_saved_adapters_merge_to_the_same_weights(tiny_model, tmp_path):
    trainer = LoraTrainer(tiny_model, LoraSpec(rank=4, seed=2))
    _step(trainer)
    snapshot = trainer.adapter_state()
    before = {n: t.clone() for n, t in trainer.sampler_weights()}
    trainer.save_state(str(tmp_path / "s"), include_optimizer=False)
    _step(trainer, seed=1)
    assert any(not torch.equal(before[n], t) for n, t in trainer.sampler_weights())
    for name, tensor in trainer.sampler_weights(snapshot):
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    spec, adapter, base_dir = read_adapter(str(tmp_path / "s"))
    assert spec == trainer.lora and base_dir == tiny_model
    for name, tensor in merge_adapter(_base(tiny_model).items(), adapter, spec):
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("switch,modules", [
    ({"train_mlp": False, "train_unembed": False}, {"q_proj", "k_proj", "v_proj", "o_proj"}),
    ({"train_attn": False, "train_unembed": False}, {"gate_proj", "up_proj", "down_proj"}),
    ({"train_attn": False, "train_mlp": False}, {"lm_head"}),
])
def test_switches_choose_the_adapted_modules(tiny_model, switch, modules):
    trainer = LoraTrainer(tiny_model, LoraSpec(rank=2, seed=0, **switch))
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainer.named_params}
    assert adapted == modules
    assert all(".lora_A." in n or ".lora_B." in n for n in trainer.named_params)


def test_seeds_make_adapters_reproducible(tiny_model):
    a, b, c = (LoraTrainer(tiny_model, LoraSpec(rank=2, seed=s)) for s in (5, 5, 6))
    for name, tensor in a.adapter_state().items():
        assert torch.equal(tensor, b.adapter_state()[name])
    assert any(not torch.equal(t, c.adapter_state()[n]) for n, t in a.adapter_state().items() if "lora_A" in n)
    assert LoraTrainer(tiny_model, LoraSpec(rank=2)).lora.seed is not None


def test_resumed_state_takes_a_bit_identical_step(trained, tiny_model, tmp_path):
    trained.save_state(str(tmp_path / "state"))
    assert sorted(os.listdir(tmp_path / "state")) == ["adapter.safetensors", "lora.json", "optimizer.safetensors"]
    resumed = LoraTrainer(tiny_model, LoraSpec(rank=4, seed=99))
    resumed.load_state(str(tmp_path / "state"))
    assert _step(resumed, seed=4) == _step(trained, seed=4)
    for (n1, t1), (n2, t2) in zip(resumed.sampler_weights(), trained.sampler_weights(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2)
    with pytest.raises(InvalidRequest, match="rank 4"):
        LoraTrainer(tiny_model, LoraSpec(rank=8, seed=0)).load_state(str(tmp_path / "state"))
    weights_only = tmp_path / "weights-only"
    trained.save_state(str(weights_only), include_optimizer=False)
    with pytest.raises(InvalidRequest, match="without optimizer"):
        resumed.load_state(str(weights_only))


def test_invalid_specs_and_tied_embeddings_are_refused(tiny_model, tmp_path):
    with pytest.raises(InvalidRequest, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(InvalidRequest, match="at least one"):
        LoraSpec(rank=2, train_attn=False, train_mlp=False, train_unembed=False)
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model, tied)
    with open(tied / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    with open(tied / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(ConfigurationError, match="train_unembed"):
        LoraTrainer(str(tied), LoraSpec(rank=2))
    assert LoraTrainer(str(tied), LoraSpec(rank=2, train_unembed=False)).named_params
