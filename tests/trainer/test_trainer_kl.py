"""The KL penalty to a reference policy (``loss_fn_config["kl_coef"]``) against hand-written references.

The reference is the model's initial weights. References: the k1 / k2 / k3
formulas written out, autograd through the HF model's own forward of an
objective written by hand (torch trainer), central finite differences
(sim trainer), and a run with the penalty at 0 against one without it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sim_gradients import central_difference

import rlengine as rle
from rlengine.errors import InvalidRequest
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train
from rlengine.trainer.losses import LossSettings, loss_settings, reference_kl, validate_data
from rlengine.trainer.sim import SimTrainer
from rlengine.trainer.torch_trainer import TorchTrainer

V = 16


def rl_datum(seq, logp, advantages, mask=None) -> rle.Datum:
    inputs = {"target_tokens": np.array(seq[1:], dtype=np.int64), "logprobs": np.asarray(logp, np.float32),
              "advantages": np.asarray(advantages, np.float32)}
    if mask is not None:
        inputs["mask"] = np.asarray(mask, np.float32)
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def test_estimators_and_their_derivatives_are_the_formulas():
    logp, ref = np.array([-1.0, -2.0, -0.5]), np.array([-1.5, -2.0, -0.25])
    x = ref - logp
    for k, want in ((1, -x), (2, x * x / 2), (3, np.exp(x) - 1 - x)):
        value, grad = reference_kl(logp, ref, k)
        np.testing.assert_allclose(value, want)
        h = 1e-6
        numeric = (reference_kl(logp + h, ref, k)[0] - reference_kl(logp - h, ref, k)[0]) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
    assert (reference_kl(logp, ref, 3)[0] >= 0).all() and reference_kl(logp, logp, 3)[0].tolist() == [0.0] * 3


def test_settings_and_validation():
    assert loss_settings("ppo", {"kl_coef": 0.1}) == LossSettings(0.8, 1.2, 0.0, 0.1, 3)
    assert loss_settings("ppo", {"kl_coef": 0.0, "kl_estimator": 1.0}).kl_estimator == 1
    for config, field in (({"kl_coef": -1.0}, "kl_coef"), ({"kl_coef": math.inf}, "kl_coef"),
                          ({"kl_coef": 0.1, "kl_estimator": 4}, "kl_estimator"), ({"kl_estimator": 2}, "kl_estimator")):
        with pytest.raises(InvalidRequest, match=field):
            loss_settings("ppo", config)
    datum = rl_datum([1, 2, 3], np.zeros(2), np.ones(2), np.ones(2))
    with pytest.raises(InvalidRequest, match="mask"):
        validate_data([datum], "ppo", None, V, 64)  # Tinker semantics untouched without the option
    assert validate_data([datum], "ppo", {"kl_coef": 0.1}, V, 64).kl_coef == 0.1


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("estimator", [1, 2, 3])
def test_torch_trainer_gradient_equals_autograd_of_ppo_plus_the_kl_penalty(tiny_model, estimator):
    from transformers import AutoModelForCausalLM

    coef = 0.4
    trainer = TorchTrainer(tiny_model, micro_batch_tokens=16)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 1024, n).tolist() for n in (7, 12, 5)]
    data = [rl_datum(s, rng.normal(-7.0, 0.3, len(s) - 1), rng.normal(0, 1, len(s) - 1),
                     (np.arange(len(s) - 1) >= 2).astype(np.float32)) for s in seqs]
    settings = LossSettings(0.8, 1.2, 0.0, coef, estimator)
    # At the initial weights the policy is its reference: the KL is exactly 0.
    assert trainer.forward(data, "ppo", settings).metrics["kl_ref:sum"] == 0.0
    perturb(trainer.model, 1)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    perturb(policy, 1)
    out = trainer.forward_backward(data, "ppo", settings)
    total = torch.zeros((), dtype=torch.float64)
    kl_total = 0.0
    for seq, datum in zip(seqs, data):
        pos, tgt = torch.arange(len(seq) - 1), torch.tensor(seq[1:])
        logp = policy(torch.tensor([seq[:-1]])).logits[0].double().log_softmax(-1)[pos, tgt]
        with torch.no_grad():
            ref = reference(torch.tensor([seq[:-1]])).logits[0].double().log_softmax(-1)[pos, tgt]
        inputs = {k: torch.tensor(v.to_numpy(), dtype=torch.float64) for k, v in datum.loss_fn_inputs.items()}
        ratio = torch.exp(logp - inputs["logprobs"])
        ppo = -torch.minimum(ratio * inputs["advantages"], torch.clamp(ratio, 0.8, 1.2) * inputs["advantages"])
        x = ref - logp
        kl = {1: -x, 2: x * x / 2, 3: torch.exp(x) - 1 - x}[estimator]
        kl_total += float((inputs["mask"] * kl).sum().detach())
        total = total + ppo.sum() + coef * (inputs["mask"] * kl).sum()
    total.backward()
    assert out.metrics["kl_ref:sum"] == pytest.approx(kl_total, rel=1e-4) and kl_total != 0
    got = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)


def test_sim_trainer_kl_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    trainer.theta += rng.normal(0, 0.5, V)  # away from the reference (the initial weights)
    data = [rl_datum(rng.integers(0, V, 6).tolist(), -np.log(V) + rng.uniform(-1, 1, 5), rng.normal(0, 1, 5),
                     (rng.uniform(0, 1, 5) > 0.4).astype(np.float32)) for _ in range(3)]
    settings = LossSettings(0.8, 1.2, 0.0, 0.7, 3)

    def objective() -> float:
        m = trainer.forward(data, "ppo", settings).metrics
        return m["loss:sum"] + settings.kl_coef * m["kl_ref:sum"]

    trainer.forward_backward(data, "ppo", settings)
    grad = trainer.grad.copy()
    numeric = central_difference(trainer.theta, objective)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)
    trainer.grad[:] = 0
    trainer.forward_backward(data, "ppo", (0.8, 1.2))
    assert not np.allclose(trainer.grad, grad)  # the penalty really contributes


def test_a_run_reports_the_reference_kl_and_a_zero_coefficient_only_measures(tmp_path, model_cache):
    def run(name, **extra):
        outcome = train("copy", {"steps": 3, "eval_every": 0, "checkpoint_every": 0, "backend": "torch",
                                 "cache_dir": model_cache, "groups_per_batch": 4, **extra},
                        run_dir=str(tmp_path / name))
        assert outcome.error is None, outcome.error
        return read_jsonl(outcome.metrics_path)

    plain, measured, penalised = run("plain"), run("measured", kl_coef=0.0), run("penalised", kl_coef=1.0)
    assert "kl_ref_mean" not in plain[0]
    for a, b in zip(plain, measured):
        assert (a["loss_sum"], a["grad_norm"]) == (b["loss_sum"], b["grad_norm"])  # measured, not trained on
    assert 0 < measured[0]["kl_ref_mean"] < measured[-1]["kl_ref_mean"]  # the policy moves off its reference
    assert penalised[1]["grad_norm"] != measured[1]["grad_norm"]
