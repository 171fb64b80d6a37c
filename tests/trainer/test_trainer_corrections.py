"""Off-policy corrections and processed logprobs in the trainers, against hand-written references.

References: the TIS / MIS / IcePop / geometric-mask formulas written out per
token; PPO's clipped objective written by hand with a proximal policy; the
temperature / top-k / top-p transform written in numpy over the HF model's own
logits; and, for the corrections' purpose, the exact on-policy policy gradient
of a categorical policy, which importance-weighted samples from a different
(mismatched) sampler estimate without bias and unweighted ones do not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rlengine as rle
from rlengine.errors import InvalidRequest
from rlengine.trainer.losses import correction_weights, elementwise, loss_settings, validate_data
from rlengine.trainer.sim import SimTrainer
from rlengine.trainer.torch_trainer import TorchTrainer

V = 16


def datum(seq, **inputs) -> rle.Datum:
    values = {"target_tokens": np.array(seq[1:], dtype=np.int64)}
    values |= {k: np.asarray(v, np.float32) for k, v in inputs.items()}
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=values)


def arrays(**inputs) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64 if k != "target_tokens" else np.int64) for k, v in inputs.items()}


SAMPLER = np.log([0.5, 0.2, 0.1, 0.4, 0.3])
W = np.array([0.5, 1.0, 3.0, 1.5, 6.0])  # trainer over sampler, per token
OLD = SAMPLER + np.log(W)


@pytest.mark.parametrize("config, want_c, truncated, masked", [
    ({"tis_cap": 2.0}, [0.5, 1.0, 2.0, 1.5, 2.0], 2, 0),
    ({"mis_cap": 2.0}, [0.5, 1.0, 0.0, 1.5, 0.0], 0, 2),
    ({"icepop_low": 0.8, "icepop_high": 2.0}, [0.0, 1.0, 0.0, 1.5, 0.0], 0, 3),
])
def test_token_level_corrections_are_their_formulas(config, want_c, truncated, masked):
    inputs = arrays(target_tokens=[1, 2, 3, 4, 5], logprobs=SAMPLER, old_logprobs=OLD, advantages=[1.0] * 5)
    c, counts = correction_weights(inputs, loss_settings("importance_sampling", config))
    np.testing.assert_allclose(c, want_c, rtol=1e-12)
    assert counts == {"is_tokens": 5.0, "is_truncated": float(truncated), "is_masked": float(masked)}


def test_the_geometric_mask_keeps_or_drops_a_whole_sequence_over_its_action_tokens():
    # Action tokens: the non-zero advantages (no mask given). Their mean log w decides.
    adv = [0.0, 1.0, 1.0, 0.0, 1.0]
    g = math.exp(np.log(W)[[1, 2, 4]].mean())  # (1 * 3 * 6) ** (1/3) = 2.62
    inputs = arrays(target_tokens=[1] * 5, logprobs=SAMPLER, old_logprobs=OLD, advantages=adv)
    kept, counts = correction_weights(inputs, loss_settings("ppo", {"geo_mask_low": 0.5, "geo_mask_high": 3.0}))
    assert g < 3.0 and kept.tolist() == [1.0] * 5 and counts["is_masked"] == 0
    dropped, counts = correction_weights(inputs, loss_settings("ppo", {"geo_mask_low": 0.5, "geo_mask_high": 2.5}))
    assert dropped.tolist() == [0.0] * 5 and counts == {"is_tokens": 3.0, "is_truncated": 0.0, "is_masked": 3.0}
    # With a token-level correction the mask multiplies it; a mask input names the action tokens.
    both, _ = correction_weights(arrays(target_tokens=[1] * 5, logprobs=SAMPLER, old_logprobs=OLD, advantages=adv,
                                        mask=[1, 1, 0, 0, 0]),
                                 loss_settings("ppo", {"tis_cap": 2.0, "geo_mask_low": 0.5, "geo_mask_high": 3.0}))
    np.testing.assert_allclose(both, np.minimum(W, 2.0))  # mean log w over tokens 0, 1: w 0.5, 1 -> g 0.71


def test_a_proximal_policy_takes_the_ratio_of_every_ratio_loss():
    logp = np.log([0.3, 0.6, 0.2])
    old = np.log([0.25, 0.4, 0.3])
    inputs = arrays(target_tokens=[1, 2, 3], logprobs=np.log([0.9, 0.1, 0.5]), old_logprobs=old,
                    advantages=[1.0, -1.0, 2.0])
    r = np.exp(logp - old)  # not exp(logp - logprobs)
    a = inputs["advantages"]
    want = -np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)  # clip-higher: asymmetric thresholds
    loss, _ = elementwise("ppo", logp, inputs, loss_settings("ppo", {"clip_low_threshold": 0.8,
                                                                     "clip_high_threshold": 1.28}))
    np.testing.assert_allclose(loss, want)
    loss, _ = elementwise("importance_sampling", logp, inputs, loss_settings("importance_sampling", None))
    np.testing.assert_allclose(loss, -r * a)


def test_validation_names_the_field():
    d = datum([1, 2, 3, 4], logprobs=[0, 0, 0], advantages=[1, 1, 1])
    with pytest.raises(InvalidRequest, match="old_logprobs"):
        validate_data([d], "ppo", {"tis_cap": 2.0}, V, 64)  # a correction needs the proximal policy
    for config, field in (({"tis_cap": 0.0}, "tis_cap"), ({"mis_cap": math.inf}, "mis_cap"),
                          ({"tis_cap": 2.0, "mis_cap": 2.0}, "at most one"),
                          ({"icepop_low": 0.5}, "icepop_high"), ({"geo_mask_low": 1.1, "geo_mask_high": 2.0}, "<= 1")):
        with pytest.raises(InvalidRequest, match=field):
            loss_settings("ppo", config)
    with pytest.raises(InvalidRequest, match="no importance ratio"):
        loss_settings("cross_entropy", {"tis_cap": 2.0})
    with pytest.raises(InvalidRequest, match="old_logprobs"):  # cross_entropy has no ratio to take it
        validate_data([datum([1, 2, 3], old_logprobs=[0, 0])], "cross_entropy", None, V, 64)
    for key, bad in (("temperature", 0.0), ("top_k", 2.5), ("top_p", 1.5)):
        with pytest.raises(InvalidRequest, match=key):
            validate_data([datum([1, 2, 3], **{key: [1.0, bad]})], "cross_entropy", None, V, 64)
    ok = datum([1, 2, 3, 4], logprobs=[0, 0, 0], old_logprobs=[0, 0, 0], advantages=[1, 1, 1],
               temperature=[0.7] * 3, top_k=[5] * 3, top_p=[0.9] * 3)
    assert validate_data([ok], "ppo", {"tis_cap": 2.0}, V, 64).correction("tis_cap") == 2.0


def test_the_sim_trainer_refuses_a_sampling_transform():
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    with pytest.raises(InvalidRequest, match="raw logprobs only"):
        trainer.forward([datum([1, 2, 3], temperature=[0.7, 0.7])], "cross_entropy", (0.0, math.inf))


def test_corrections_remove_a_mismatched_samplers_bias_from_the_policy_gradient():
    """Tokens drawn from a sampler mu that is not the trainer's policy pi. The exact on-policy
    gradient of E_pi[A] over the sim's logits is sum_x pi(x) A(x) (onehot(x) - pi). Trained on
    mu's samples, the uncorrected importance_sampling loss (ratio pi/pi_old = 1, pi_old = pi)
    estimates sum_x mu(x) A(x) (...) instead; TIS with a cap above every weight and MIS are
    unbiased; TIS with a tight cap trades a little bias for bounded weights."""
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    logp = trainer._log_softmax()
    pi = np.exp(logp)
    rng = np.random.default_rng(0)
    mu = pi * np.exp(rng.normal(0.0, 0.5, V))  # a perturbed copy of the policy
    mu /= mu.sum()
    adv = rng.normal(0.0, 1.0, V)
    exact = -(pi[:, None] * adv[:, None] * (np.eye(V) - pi[None, :])).sum(0)  # d loss / d theta
    n = 200_000
    x = rng.choice(V, size=n, p=mu)

    def gradient(config):
        d = datum([0, *x.tolist()], logprobs=np.log(mu)[x], old_logprobs=logp[x], advantages=adv[x])
        trainer.grad[:] = 0.0
        trainer.forward_backward([d], "importance_sampling", loss_settings("importance_sampling", config))
        return trainer.grad / n

    def error(g):
        return float(np.linalg.norm(g - exact) / np.linalg.norm(exact))

    wmax = float((pi / mu).max())
    assert error(gradient(None)) > 0.2  # biased
    assert error(gradient({"tis_cap": wmax + 1.0})) < 0.05  # no weight truncated: plain IS
    assert error(gradient({"mis_cap": wmax + 1.0})) < 0.05
    assert error(gradient({"tis_cap": 1.5})) < error(gradient(None))


def test_torch_trainer_logprobs_under_a_sampling_transform_match_numpy(tiny_model):
    trainer = TorchTrainer(tiny_model)
    seq = [1, 5, 9, 2, 7, 3, 8, 4]
    t, k, p = [0.7, 1.0, 0.5, 1.3, 0.7, 1.0, 2.0], [0, 5, 0, 20, 3, 0, 1], [0.9, 1.0, 1.0, 0.8, 1.0, 0.95, 1.0]
    out = trainer.forward([datum(seq, temperature=t, top_k=k, top_p=p)], "cross_entropy", (0.0, math.inf))
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([seq[:-1]])).logits[0].double().numpy()
    want = []
    for pos, target in enumerate(seq[1:]):
        z = logits[pos] / t[pos]
        order = np.argsort(-z, kind="stable")
        keep = np.zeros(z.shape[0], dtype=bool)
        ranked = order[:k[pos]] if k[pos] > 0 else order
        probs = np.exp(z[ranked] - z[ranked].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        keep[ranked[before < p[pos]]] = True
        keep[target] = True  # the target always stays in the support
        want.append(z[target] - np.log(np.exp(z[keep] - z[keep].max()).sum()) - z[keep].max())
    np.testing.assert_allclose(got, want, atol=2e-5)
    # Without transform inputs (or with the identity) the logprob is the raw log_softmax.
    raw = trainer.forward([datum(seq)], "cross_entropy", (0.0, math.inf)).loss_fn_outputs[0]["logprobs"].to_numpy()
    ident = trainer.forward([datum(seq, temperature=[1.0] * 7, top_k=[0] * 7, top_p=[1.0] * 7)], "cross_entropy",
                            (0.0, math.inf)).loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(raw, ident) and not np.allclose(raw, got, atol=1e-3)


def test_every_ratio_loss_reports_the_mismatch_of_its_action_tokens():
    trainer = SimTrainer(rle.SimConfig(vocab_size=V, seed=2))
    logp = trainer._log_softmax()
    seq = [0, 3, 5, 7, 9]
    sampler = logp[seq[1:]] + np.array([0.1, -0.2, 0.0, 0.3])
    adv = [1.0, 0.0, -1.0, 2.0]  # the second token is no action (zero advantage)
    out = trainer.forward([datum(seq, logprobs=sampler, advantages=adv)], "ppo", loss_settings("ppo", None))
    d = np.array([0.1, 0.0, 0.3])
    assert out.metrics["mismatch_k1:sum"] == pytest.approx(d.sum(), abs=1e-6)
    assert out.metrics["mismatch_k3:sum"] == pytest.approx(float((np.exp(-d) - 1 + d).sum()), abs=1e-6)
    assert out.metrics["mismatch_tokens:sum"] == 3.0
    assert (out.metrics["mismatch_ratio:min"], out.metrics["mismatch_ratio:max"]) == pytest.approx(
        (math.exp(-0.3), 1.0), abs=1e-6)
    ce = trainer.forward([datum(seq, weights=[1.0] * 4)], "cross_entropy", (0.0, math.inf))
    assert not any(key.startswith("mismatch") for key in ce.metrics)  # no sampler logprobs, no diagnostics
