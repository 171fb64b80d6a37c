"""Tinker's ``dro`` and ``gspo`` losses against hand-written references.

References: a few values worked out by hand; the PyTorch code Tinker's loss
pages give for each loss, run with autograd (the per-token derivative with
its stop-gradients); central finite differences through the sim trainer (for
``gspo``, of the GSPO-token surrogate whose gradient Tinker's is: the
sequence ratio held at its value); and autograd through the HF model's own
forward for the torch trainer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sim_gradients import central_difference

import rlengine as rle
from rlengine.errors import InvalidRequest
from rlengine.trainer.losses import LossSettings, elementwise, loss_settings, validate_data
from rlengine.trainer.sim import SimTrainer
from rlengine.trainer.torch_trainer import TorchTrainer

V = 16
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}


def rl_datum(seq, logp, advantages, ratio_mask=None) -> rle.Datum:
    inputs = {"target_tokens": np.array(seq[1:], dtype=np.int64), "logprobs": np.asarray(logp, np.float32),
              "advantages": np.asarray(advantages, np.float32)}
    if ratio_mask is not None:
        inputs["sequence_ratio_mask"] = np.asarray(ratio_mask, np.float32)
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def documented(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The loss as the code on Tinker's loss pages writes it (``target_logprobs`` is ``logp``)."""
    sampling_logprobs, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":
        quadratic_term = (logp - sampling_logprobs) ** 2
        return -(logp * advantages - 0.5 * config["beta"] * quadratic_term).sum()
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (logp.detach() - sampling_logprobs)[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    clipped_ratio = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.min(ratio * advantages, clipped_ratio * advantages).sum()


def test_worked_by_hand():
    dro = loss_settings("dro", {"beta": 0.1})
    loss, grad = elementwise("dro", np.array([-1.0]), {"logprobs": np.array([-2.0]), "advantages": np.array([0.5])},
                             dro)
    # -(-1 * 0.5 - 0.05 * 1^2) and -(0.5 - 0.1 * 1)
    assert loss.tolist() == pytest.approx([0.55]) and grad.tolist() == pytest.approx([-0.4])
    gspo = loss_settings("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    s = math.exp(0.5)  # one token in the ratio, logp - logprobs = 0.5: above the clip range
    inputs = {"logprobs": np.array([-1.5, -9.0]), "sequence_ratio_mask": np.array([1.0, 0.0])}
    loss, grad = elementwise("gspo", np.array([-1.0, -3.0]), {**inputs, "advantages": np.array([1.0, -1.0])}, gspo)
    # A > 0 takes the clipped ratio (no gradient); A < 0 the unclipped one; the unmasked token carries s too.
    assert loss.tolist() == pytest.approx([-1.2, s]) and grad.tolist() == pytest.approx([0.0, s])


def _fixed_inputs(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {"logprobs": rng.normal(-2.0, 0.5, n), "advantages": rng.normal(0.0, 1.0, n),
            "sequence_ratio_mask": (np.arange(n) >= 2).astype(np.float64)}


@pytest.mark.parametrize(("loss_fn", "config"), [("dro", {"beta": 0.3}), ("dro", {"beta": 0.0}),
                                                 ("gspo", CLIP)])
def test_loss_and_derivative_are_the_documented_code_under_autograd(loss_fn, config):
    rng = np.random.default_rng(7)
    settings = loss_settings(loss_fn, config)
    ratios = []
    # Shifts put the gspo sequence ratio below, inside and above the clip range.
    for shift in (-0.4, 0.0, 0.03, 0.5):
        inputs = _fixed_inputs(rng, 9)
        logp = inputs["logprobs"] + shift + rng.normal(0, 0.05, 9)
        loss, grad = elementwise(loss_fn, logp, inputs, settings)
        t_logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
        want = documented(loss_fn, t_logp, {k: torch.tensor(v) for k, v in inputs.items()}, config)
        want.backward()
        assert float(loss.sum()) == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
        np.testing.assert_allclose(grad, t_logp.grad.numpy(), rtol=1e-12, atol=1e-12)
        ratios.append(math.exp(float((logp - inputs["logprobs"])[2:].mean())))
    if loss_fn == "gspo":
        assert min(ratios) < 0.9 and any(0.9 <= r <= 1.1 for r in ratios) and max(ratios) > 1.1


def _sim_data(rng: np.random.Generator) -> list[rle.Datum]:
    return [rl_datum(rng.integers(0, V, 7).tolist(), -np.log(V) + rng.uniform(-0.3, 0.3, 6),
                     rng.normal(0, 1, 6), (np.arange(6) >= 1).astype(np.float32)) for _ in range(3)]


def test_sim_trainer_dro_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    data = [rl_datum(rng.integers(0, V, 6).tolist(), -np.log(V) + rng.uniform(-1, 1, 5), rng.normal(0, 1, 5))
            for _ in range(3)]
    settings = loss_settings("dro", {"beta": 0.8})
    trainer.forward_backward(data, "dro", settings)
    grad = trainer.grad.copy()
    numeric = central_difference(trainer.theta, lambda: trainer.forward(data, "dro", settings).metrics["loss:sum"])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)


def test_sim_trainer_gspo_gradient_is_the_finite_difference_of_the_gspo_token_surrogate():
    """Tinker's GSPO gradient is that of the surrogate ``-sum_t min(s0 exp(logp_t - logp0_t) A_t, clip(..) A_t)``
    (the sequence ratio ``s0`` and ``logp0`` held at their values): finite differences of it, written here
    over the sim model's unigram ``log_softmax(theta)``, match the trainer; those of the loss itself do not."""
    rng = np.random.default_rng(5)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=4))
    data = _sim_data(rng)
    settings = loss_settings("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05})

    def logp_of(theta: np.ndarray, datum: rle.Datum) -> np.ndarray:
        z = theta - theta.max()
        return (z - math.log(np.exp(z).sum()))[datum.loss_fn_inputs["target_tokens"].to_numpy()]

    frozen = []
    for datum in data:
        inputs = {k: v.to_numpy().astype(np.float64) for k, v in datum.loss_fn_inputs.items()}
        logp0 = logp_of(trainer.theta, datum)
        s0 = math.exp(float((logp0 - inputs["logprobs"])[inputs["sequence_ratio_mask"] != 0].mean()))
        frozen.append((inputs, logp0, s0))
    assert min(s for *_, s in frozen) < 0.95 or max(s for *_, s in frozen) > 1.05  # some clipping happens

    def surrogate(theta: np.ndarray) -> float:
        total = 0.0
        for datum, (inputs, logp0, s0) in zip(data, frozen):
            ratio = s0 * np.exp(logp_of(theta, datum) - logp0)
            adv = inputs["advantages"]
            total += float(-np.minimum(ratio * adv, np.clip(ratio, 0.95, 1.05) * adv).sum())
        return total

    trainer.forward_backward(data, "gspo", settings)
    grad = trainer.grad.copy()
    assert trainer.forward(data, "gspo", settings).metrics["loss:sum"] == pytest.approx(surrogate(trainer.theta))
    numeric = central_difference(trainer.theta, lambda: surrogate(trainer.theta))
    of_loss = central_difference(trainer.theta, lambda: trainer.forward(data, "gspo", settings).metrics["loss:sum"])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)
    assert not np.allclose(grad, of_loss, rtol=1e-3, atol=1e-4)  # the stop-gradient is real


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize(("loss_fn", "config"), [("dro", {"beta": 0.5}), ("gspo", CLIP)])
def test_torch_trainer_gradient_equals_autograd_of_the_documented_code(tiny_model, loss_fn, config):
    from transformers import AutoModelForCausalLM

    trainer = TorchTrainer(tiny_model, micro_batch_tokens=16)
    perturb(trainer.model, 1)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    perturb(policy, 1)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 1024, n).tolist() for n in (7, 12, 5)]
    data = []
    for seq in seqs:
        with torch.no_grad():
            lp = policy(torch.tensor([seq[:-1]])).logits[0].double().log_softmax(-1)[
                torch.arange(len(seq) - 1), torch.tensor(seq[1:])].numpy()
        # Sampler logprobs near the policy's: the gspo ratios fall on both sides of the clip range.
        data.append(rl_datum(seq, lp + rng.normal(0, 0.15, len(lp)), rng.normal(0, 1, len(lp)),
                             (np.arange(len(lp)) >= 1).astype(np.float32)))
    if loss_fn == "dro":
        data = [rl_datum(s, d.loss_fn_inputs["logprobs"].to_numpy(), d.loss_fn_inputs["advantages"].to_numpy())
                for s, d in zip(seqs, data)]
    settings = loss_settings(loss_fn, config)
    out = trainer.forward_backward(data, loss_fn, settings)
    total = torch.zeros((), dtype=torch.float64)
    for seq, datum in zip(seqs, data):
        pos, tgt = torch.arange(len(seq) - 1), torch.tensor(seq[1:])
        logp = policy(torch.tensor([seq[:-1]])).logits[0].double().log_softmax(-1)[pos, tgt]
        inputs = {k: torch.tensor(v.to_numpy(), dtype=torch.float64) for k, v in datum.loss_fn_inputs.items()}
        total = total + documented(loss_fn, logp, inputs, config)
    total.backward()
    assert out.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-4)
    got = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)


def test_settings_round_trip_and_bad_configs_name_the_field():
    dro, gspo = loss_settings("dro", {"beta": 0.05}), loss_settings("gspo", CLIP)
    assert dro == LossSettings(0.0, math.inf, beta=0.05) and (gspo.clip_low, gspo.clip_high) == (0.9, 1.1)
    for loss_fn, settings in (("dro", dro), ("gspo", gspo)):
        assert loss_settings(loss_fn, settings.config(loss_fn)) == settings
    # No config: the defaults the module docstring gives (Tinker documents none).
    assert loss_settings("dro", None).beta == 0.05
    assert (loss_settings("gspo", None).clip_low, loss_settings("gspo", {"clip_low_threshold": 0.8}).clip_high) \
        == (1.0 - 3e-4, 1.0 + 4e-4)
    for loss_fn, config, field in (("dro", {"beta": -1.0}, "beta"),
                                   ("dro", {"beta": math.nan}, "beta"), ("ppo", {"beta": 0.1}, "beta"),
                                   ("dro", {"beta": 0.1, "clip_low_threshold": 0.5}, "loss_fn_config"),
                                   ("gspo", {"clip_low_threshold": 1.1}, "clip_low"),
                                   ("gspo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8}, "clip_low")):
        with pytest.raises(InvalidRequest, match=field):
            loss_settings(loss_fn, config)
    with pytest.raises(InvalidRequest, match="needs 'sequence_ratio_mask'"):
        validate_data([rl_datum([1, 2, 3], np.zeros(2), np.ones(2))], "gspo", CLIP, V, 64)
    with pytest.raises(InvalidRequest, match=r"data\[1\]\.loss_fn_inputs\['sequence_ratio_mask'\]") as err:
        validate_data([rl_datum([1, 2, 3], np.zeros(2), np.ones(2), [0, 1]),
                       rl_datum([1, 2, 3], np.zeros(2), np.ones(2), [0, 0])], "gspo", CLIP, V, 64)
    assert err.value.value == "all zero"
    with pytest.raises(InvalidRequest, match="sequence_ratio_mask"):
        validate_data([rl_datum([1, 2, 3], np.zeros(2), np.ones(2), [1, 1])], "dro", {"beta": 0.1}, V, 64)
