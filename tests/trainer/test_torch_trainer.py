"""The torch trainer against hand-written references.

References: each loss written out by hand in torch with autograd (values and
gradients, including every clipping region), the HF model's own forward for
logprobs, a hand-written AdamW with global-norm clipping, and a second
trainer resumed from saved state (bit-identical next steps).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.backends.torch.models import build_tiny
from rlengine.errors import InvalidRequest
from rlengine.trainer.losses import elementwise
from rlengine.trainer.torch_trainer import TorchTrainer

WAIT = 60.0
THRESHOLDS = {"cross_entropy": (0.0, math.inf), "importance_sampling": (0.0, math.inf), "ppo": (0.8, 1.2),
              "cispo": (0.0, 4.0)}
# Ratios on every side of the PPO (0.8, 1.2) and CISPO (0, 4) clip ranges, with both advantage signs.
RATIOS = np.array([0.3, 0.79, 0.81, 1.0, 1.19, 1.21, 2.5, 4.5])
ADVANTAGES = np.array([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.0])


def reference_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor],
                   lo: float, hi: float) -> torch.Tensor:
    """Per-token losses, written out by hand (autograd gives the reference gradient)."""
    if loss_fn == "cross_entropy":
        return -inputs.get("weights", torch.ones_like(logp)) * logp
    ratio = torch.exp(logp - inputs["logprobs"])
    adv = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv
        # min() taking the unclipped branch on ties (inside the range both are equal).
        return -torch.where(unclipped <= clipped, unclipped, clipped)
    return -torch.clamp(ratio, lo, hi).detach() * adv * logp


@pytest.fixture
def trainer(tiny_model):
    return TorchTrainer(tiny_model)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1024, n).tolist()


def make_datum(seq: list[int], **extra: np.ndarray) -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(seq[1:], dtype=np.int64), **extra})


def loss_inputs(loss_fn: str, logp: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs that put each token's ratio at ``RATIOS`` (cycled) given current ``logp``."""
    n = logp.shape[0]
    if loss_fn == "cross_entropy":
        return {"weights": np.resize(np.array([1.0, 0.5, 0.0, 2.0], dtype=np.float32), n)}
    ratios, adv = np.resize(RATIOS, n), np.resize(ADVANTAGES, n)
    return {"logprobs": (logp - np.log(ratios)).astype(np.float32), "advantages": adv.astype(np.float32)}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- the loss definitions on small tensors ---------------------------------------------------


@pytest.mark.parametrize("loss_fn", list(THRESHOLDS))
def test_each_loss_value_and_gradient_equal_the_hand_written_reference(loss_fn):
    logp0 = np.log(np.array([0.9, 0.5, 0.2, 0.05, 0.6, 0.3, 0.01, 0.7]))
    inputs = loss_inputs(loss_fn, logp0)
    lo, hi = THRESHOLDS[loss_fn]
    loss, dlogp = elementwise(loss_fn, logp0, inputs, (lo, hi))
    logp = torch.tensor(logp0, requires_grad=True)
    ref = reference_loss(loss_fn, logp, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, lo, hi)
    ref.sum().backward()
    np.testing.assert_allclose(loss, ref.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dlogp, logp.grad.numpy(), rtol=1e-6, atol=1e-7)
    if loss_fn == "ppo":
        # The clipped regions really occur: zero gradient exactly where the clip binds.
        binding = ((RATIOS > 1.2) & (ADVANTAGES > 0)) | ((RATIOS < 0.8) & (ADVANTAGES < 0))
        assert (dlogp[binding] == 0).all() and (dlogp[~binding] != 0).all() and binding.any()


# -- the trainer against the HF model -----------------------------------------------------------


def test_logprobs_equal_the_hf_forward_and_ignore_padding(trainer, hf_model):
    seqs = [tokens(1, 5), tokens(2, 12), tokens(3, 8)]
    data = [make_datum(s) for s in seqs]
    batched = trainer.forward(data, "cross_entropy", THRESHOLDS["cross_entropy"])
    total = 0.0
    for seq, datum, record in zip(seqs, data, batched.loss_fn_outputs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq[:-1]])).logits[0]
        ref = logits.log_softmax(-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].numpy()
        np.testing.assert_allclose(record["logprobs"].to_numpy(), ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(record["elementwise_loss"].to_numpy(), -ref, atol=1e-5, rtol=0)
        single = trainer.forward([datum], "cross_entropy", THRESHOLDS["cross_entropy"]).loss_fn_outputs[0]
        np.testing.assert_allclose(single["logprobs"].to_numpy(), record["logprobs"].to_numpy(), atol=1e-5)
        total += -ref.sum()
    assert batched.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(p.grad is None for p in trainer.model.parameters())  # forward never accumulates


@pytest.mark.parametrize("loss_fn", list(THRESHOLDS))
def test_forward_backward_gradients_equal_autograd_of_the_reference_loss(tiny_model, hf_model, loss_fn):
    trainer = TorchTrainer(tiny_model, micro_batch_tokens=16)  # forces several micro-batches
    seqs = [tokens(10, 9), tokens(11, 17), tokens(12, 6)]
    lo, hi = THRESHOLDS[loss_fn]
    ref_model = hf_model
    ref_model.zero_grad(set_to_none=True)
    data, ref_total = [], 0.0
    for seq in seqs:
        logits = ref_model(torch.tensor([seq[:-1]])).logits[0]
        logp = logits.log_softmax(-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        inputs = loss_inputs(loss_fn, logp.detach().numpy())
        data.append(make_datum(seq, **inputs))
        ref = reference_loss(loss_fn, logp, {k: torch.tensor(v) for k, v in inputs.items()}, lo, hi)
        ref.sum().backward()
        ref_total += float(ref.detach().sum())
    assert len(trainer._micro_batches(data)) == 3
    out = trainer.forward_backward(data, loss_fn, (lo, hi))
    assert out.metrics["loss:sum"] == pytest.approx(ref_total, rel=1e-4, abs=1e-4)
    expected, got = grads(ref_model), grads(trainer.model)
    assert expected.keys() == got.keys()
    for name, ref in expected.items():
        # float32 sums in a different order: the absolute slack scales with the tensor.
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()), msg=name)
    ref_model.zero_grad(set_to_none=True)


def test_gradients_accumulate_across_calls_until_optim_step(tiny_model):
    d1, d2 = make_datum(tokens(20, 7)), make_datum(tokens(21, 10))
    one, two = TorchTrainer(tiny_model), TorchTrainer(tiny_model)
    one.forward_backward([d1, d2], "cross_entropy", THRESHOLDS["cross_entropy"])
    two.forward_backward([d1], "cross_entropy", THRESHOLDS["cross_entropy"])
    two.forward_backward([d2], "cross_entropy", THRESHOLDS["cross_entropy"])
    for name, g in grads(one.model).items():
        torch.testing.assert_close(grads(two.model)[name], g, rtol=1e-5, atol=1e-5)
    two.optim_step(rle.AdamParams(learning_rate=1e-3))
    assert all(p.grad is None for p in two.model.parameters())


def reference_adamw(params: dict[str, torch.Tensor], grad: dict[str, torch.Tensor], state: dict[str, list],
                    step: int, hp: rle.AdamParams) -> float:
    """One AdamW step by hand (float64), global-norm clipping first; returns the pre-clip norm."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grad.values()))
    scale = hp.grad_clip_norm / (norm + 1e-6) if 0 < hp.grad_clip_norm < norm else 1.0
    for name, p in params.items():
        g = grad[name].double() * scale
        m, v = state.setdefault(name, [torch.zeros_like(g), torch.zeros_like(g)])
        m.mul_(hp.beta1).add_((1 - hp.beta1) * g)
        v.mul_(hp.beta2).add_((1 - hp.beta2) * g * g)
        m_hat, v_hat = m / (1 - hp.beta1 ** step), v / (1 - hp.beta2 ** step)
        p.mul_(1 - hp.learning_rate * hp.weight_decay)
        p.sub_(hp.learning_rate * m_hat / (v_hat.sqrt() + hp.eps))
    return norm


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_optim_step_is_adamw_with_global_norm_clipping(trainer, clip):
    hp = rle.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip)
    params = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
    state: dict[str, list] = {}
    for step in (1, 2):
        trainer.forward_backward([make_datum(tokens(30 + step, 12))], "cross_entropy", THRESHOLDS["cross_entropy"])
        norm = reference_adamw(params, grads(trainer.model), state, step, hp)
        metrics = trainer.optim_step(hp).metrics
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert norm > 0.5  # so clipping really binds when enabled
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach().double(), params[name], rtol=1e-5, atol=1e-6, msg=name)


# -- state -------------------------------------------------------------------------------------


def run_steps(trainer: TorchTrainer, seeds: list[int]) -> None:
    hp = rle.AdamParams(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)
    for seed in seeds:
        seq = tokens(seed, 10)
        with torch.no_grad():
            logp = trainer.forward([make_datum(seq)], "cross_entropy", (0, math.inf)).loss_fn_outputs[0]
        inputs = loss_inputs("ppo", logp["logprobs"].to_numpy())
        trainer.forward_backward([make_datum(seq, **inputs)], "ppo", (0.8, 1.2))
        trainer.optim_step(hp)


def test_save_and_load_state_resume_bit_identically(tiny_model, tmp_path):
    first = TorchTrainer(tiny_model)
    run_steps(first, [40, 41])
    first.forward_backward([make_datum(tokens(42, 9))], "cross_entropy", (0, math.inf))  # pending gradients
    first.save_state(str(tmp_path / "s"))
    resumed = TorchTrainer(tiny_model)
    resumed.load_state(str(tmp_path / "s"))
    for trainer in (first, resumed):
        trainer.optim_step(rle.AdamParams(learning_rate=1e-3))
        run_steps(trainer, [43, 44])
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    for p in first.model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            other = resumed.optimizer.state[dict(zip(first.model.parameters(), resumed.model.parameters()))[p]]
            assert torch.equal(first.optimizer.state[p][key], other[key])


def test_load_state_without_optimizer_starts_a_fresh_optimizer(tiny_model, tmp_path):
    trained = TorchTrainer(tiny_model)
    run_steps(trained, [50])
    trained.save_state(str(tmp_path / "s"), include_optimizer=False)
    assert not os.path.exists(tmp_path / "s" / "optimizer.safetensors")
    with pytest.raises(InvalidRequest, match="without optimizer"):
        TorchTrainer(tiny_model).load_state(str(tmp_path / "s"))
    loaded = TorchTrainer(tiny_model)
    run_steps(loaded, [51])  # optimizer state that the load must discard
    loaded.load_state(str(tmp_path / "s"), include_optimizer=False)
    assert not loaded.optimizer.state
    for (_, a), (_, b) in zip(trained.model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(a, b)


def test_load_state_rejects_foreign_or_missing_state_and_changes_nothing(tiny_model, tmp_path):
    other = build_tiny(str(tmp_path / "other"), vocab_size=320, hidden_size=64, num_heads=2, num_kv_heads=1,
                       intermediate_size=96)
    TorchTrainer(other).save_state(str(tmp_path / "foreign"))
    trainer = TorchTrainer(tiny_model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(InvalidRequest, match="shape"):
        trainer.load_state(str(tmp_path / "foreign"))
    with pytest.raises(InvalidRequest, match="model.safetensors"):
        trainer.load_state(str(tmp_path))
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_saved_state_is_a_loadable_model_directory(trainer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_steps(trainer, [60])
    path = trainer.save_state(str(tmp_path / "s"))
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    assert AutoTokenizer.from_pretrained(path, local_files_only=True).chat_template
    seq = tokens(61, 8)
    with torch.no_grad():
        expected = trainer.model(torch.tensor([seq])).logits
        assert torch.equal(model(torch.tensor([seq])).logits, expected)


def test_sampler_weights_are_the_parameters_themselves(trainer):
    weights = trainer.sampler_weights()
    params = dict(trainer.model.named_parameters())
    assert [n for n, _ in weights] == list(params)
    assert all(t.data_ptr() == params[n].data_ptr() and not t.requires_grad for n, t in weights)


def test_bfloat16_compute_keeps_float32_master_weights(tiny_model, trainer):
    low = TorchTrainer(tiny_model, compute_dtype=torch.bfloat16)
    data = [make_datum(tokens(70, 10))]
    exact = trainer.forward(data, "cross_entropy", (0, math.inf)).loss_fn_outputs[0]["logprobs"].to_numpy()
    out = low.forward_backward(data, "cross_entropy", (0, math.inf)).loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(out, exact, atol=0.1)
    assert all(p.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in low.model.parameters())


# -- through the engine: bad input is typed, the engine keeps serving ---------------------------


@pytest.fixture(scope="module")
def engine(model_cache):
    with rle.Engine(rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache)) as eng:
        yield eng


def test_bad_training_input_raises_typed_errors_and_the_engine_keeps_serving(engine):
    client = engine.training_client()
    good = make_datum(tokens(80, 8))
    short = rle.Datum(model_input=rle.ModelInput.from_ints([5, 6, 7]),
                      loss_fn_inputs={"target_tokens": np.array([6, 7], dtype=np.int64)})
    cases = [
        (lambda: client.forward_backward([good], "dpo"), "loss_fn"),
        (lambda: client.forward_backward([short], "cross_entropy"), "data[0].loss_fn_inputs['target_tokens'].shape"),
        (lambda: client.forward([make_datum([5, 1024, 6])], "cross_entropy"), "data[0].model_input"),
        (lambda: client.forward([good], "ppo"), "data[0].loss_fn_inputs"),
        (lambda: client.forward([make_datum([5] * 2050)], "cross_entropy"), "data[0].model_input.length"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidRequest) as info:
            call()
        assert info.value.field == field
    trainer = engine.get_trainer()
    with pytest.raises(InvalidRequest):
        trainer.forward([short], "cross_entropy", (0, math.inf))  # the trainer checks on its own too
    out = client.forward([good], "cross_entropy").result(WAIT)
    assert out.loss_fn_outputs[0]["logprobs"].shape == [7]
    assert engine.sampling_client().sample([1, 2], 1, rle.SamplingParams(max_tokens=2)).result(WAIT).sequences


def test_training_through_the_engine_lowers_the_loss(engine):
    client = engine.training_client()
    data = [make_datum(tokens(90, 12)), make_datum(tokens(91, 9))]
    losses = []
    for _ in range(4):
        losses.append(client.forward_backward(data, "cross_entropy").result(WAIT).metrics["loss:sum"])
        client.optim_step(rle.AdamParams(learning_rate=1e-2)).result(WAIT)
    assert losses[-1] < losses[0] - 1.0
