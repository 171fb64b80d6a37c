"""The entropy bonus (``loss_fn_config["entropy_coef"]``) against hand-written references.

The bonus is an option on top of the Tinker losses: the objective becomes
``loss - c * sum(mask * H)``. References: autograd through the HF model's own
forward (torch trainer) and central finite differences of the objective
(sim trainer). Without the option, the losses and their validation are
exactly as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sim_gradients import central_difference

import rlengine as rle
from rlengine.errors import InvalidRequest
from rlengine.trainer.losses import LossSettings, loss_settings, validate_data
from rlengine.trainer.sim import SimTrainer
from rlengine.trainer.torch_trainer import TorchTrainer

V = 16


def rl_datum(seq: list[int], logp: np.ndarray, advantages: np.ndarray, mask: np.ndarray | None) -> rle.Datum:
    inputs = {"target_tokens": np.array(seq[1:], dtype=np.int64), "logprobs": logp.astype(np.float32),
              "advantages": advantages.astype(np.float32)}
    if mask is not None:
        inputs["mask"] = mask.astype(np.float32)
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def test_settings_and_validation():
    assert loss_settings("ppo", {"entropy_coef": 0.05}) == LossSettings(0.8, 1.2, 0.05)
    assert loss_settings("importance_sampling", {"entropy_coef": 0.1}).entropy_coef == 0.1
    with pytest.raises(InvalidRequest, match="entropy_coef"):
        loss_settings("ppo", {"entropy_coef": -1.0})
    with pytest.raises(InvalidRequest, match="takes no clip thresholds"):
        loss_settings("cross_entropy", {"clip_low_threshold": 0.5})
    datum = rl_datum([1, 2, 3], np.zeros(2), np.ones(2), np.ones(2))
    # Tinker semantics are untouched: ``mask`` is not an input of the plain losses.
    with pytest.raises(InvalidRequest, match="mask"):
        validate_data([datum], "ppo", None, V, 64)
    assert validate_data([datum], "ppo", {"entropy_coef": 0.05}, V, 64).entropy_coef == 0.05


def reference_objective(model, seqs, data, coef: float, lo: float, hi: float) -> torch.Tensor:
    """PPO by hand plus ``-coef * sum(mask * H)``, through the HF model's own forward."""
    total = torch.zeros((), dtype=torch.float64)
    for seq, datum in zip(seqs, data):
        logits = model(torch.tensor([seq[:-1]])).logits[0].double()
        logp_all = logits.log_softmax(-1)
        logp = logp_all[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        inputs = {k: torch.tensor(v.to_numpy(), dtype=torch.float64) for k, v in datum.loss_fn_inputs.items()}
        ratio = torch.exp(logp - inputs["logprobs"])
        adv = inputs["advantages"]
        ppo = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        mask = inputs.get("mask", torch.ones_like(logp))
        total = total + ppo.sum() - coef * (mask * entropy).sum()
    return total


@pytest.mark.parametrize("with_mask", [True, False])
def test_torch_trainer_gradient_equals_autograd_of_the_reference_objective(tiny_model, with_mask):
    from transformers import AutoModelForCausalLM

    coef = 0.3
    trainer = TorchTrainer(tiny_model, micro_batch_tokens=16)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 1024, n).tolist() for n in (7, 12, 5)]
    data = []
    for seq in seqs:
        n = len(seq) - 1
        mask = (np.arange(n) >= n // 2).astype(np.float32) if with_mask else None
        # Sampler logprobs near the model's own, so ratios fall both inside and outside the clip range.
        data.append(rl_datum(seq, rng.normal(-7.0, 0.3, n), rng.normal(0, 1, n), mask))
    out = trainer.forward_backward(data, "ppo", LossSettings(0.8, 1.2, coef))
    plain = trainer.forward(data, "ppo", (0.8, 1.2)) if not with_mask else None
    objective = reference_objective(ref, seqs, data, coef, 0.8, 1.2)
    objective.backward()
    assert out.metrics["loss:sum"] - coef * out.metrics["entropy:sum"] == pytest.approx(float(objective.detach()), rel=1e-4)
    if plain is not None:
        # The Tinker loss reported is the same with and without the bonus.
        assert plain.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)
    got = {n: p.grad for n, p in trainer.model.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)


def test_sim_trainer_entropy_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    data = [rl_datum(rng.integers(0, V, 6).tolist(), -np.log(V) + rng.uniform(-1, 1, 5), rng.normal(0, 1, 5),
                     (rng.uniform(0, 1, 5) > 0.4).astype(np.float32)) for _ in range(3)]
    settings = LossSettings(0.8, 1.2, 0.7)

    def objective() -> float:
        m = trainer.forward(data, "ppo", settings).metrics
        return m["loss:sum"] - settings.entropy_coef * m["entropy:sum"]

    trainer.forward_backward(data, "ppo", settings)
    grad = trainer.grad.copy()
    numeric = central_difference(trainer.theta, objective)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)
    # The bonus really contributes: without it the gradient differs.
    trainer.grad[:] = 0
    trainer.forward_backward(data, "ppo", (0.8, 1.2))
    assert not np.allclose(trainer.grad, grad)
