"""Loss aggregation (``TrainConfig.loss_aggregation``), against hand-written references.

Groups of trajectories of different lengths go through a ``StepBatch`` (its
intake, split into calls, and the weighting of each call), each recorded
``forward_backward`` call into the sim trainer, and its gradient is compared
with the gradient of each mode's objective written out by hand in numpy
(ppo plus the entropy bonus, and the reference KL in one case), taken by
central differences: nothing of the reference goes through the weighting
or the losses module. Also: the old names, the resume of a run stored with
one, and the gradient-norm metrics.
"""

from __future__ import annotations

import math
import os
from array import array

import msgspec
import numpy as np
import pytest

from rlengine.config import SimConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.batch import RolloutResult, StepBatch, WorkItem
from rlengine.rl.config import TrainConfig, convert
from rlengine.rl.dump import ForwardBackwardCall
from rlengine.rl.metrics import CONFIG_FILE, read_jsonl
from rlengine.rl.run import train
from rlengine.rl.types import Observation, Trajectory, TrajectoryGroup, Transition
from rlengine.trainer.losses import loss_settings
from rlengine.trainer.sim import SimTrainer
from rlengine.types import AdamParams, ModelInput, SampledSequence

VOCAB = 12
MAX_TOKENS = 8
ENTROPY_COEF = 0.05
LENGTHS = [[1, 2, 3, 5], [4, 2, 6, 1]]
"""Sampled tokens of each attempt, per group."""
REWARDS = [[0.0, 0.25, 1.0, 0.5], [1.0, 0.0, 0.0, 0.75]]


def log_softmax(theta: np.ndarray) -> np.ndarray:
    t = theta - theta.max()
    return t - math.log(np.exp(t).sum())


def make_groups(theta: np.ndarray) -> list[TrajectoryGroup]:
    """Single-turn attempts whose sampler logprobs are the sim model's under ``theta`` moved by up to
    +-0.35, so that some ratios fall outside ppo's [0.8, 1.2] and some inside."""
    rng = np.random.default_rng(7)
    logp = log_softmax(theta)
    groups = []
    for lengths, rewards in zip(LENGTHS, REWARDS):
        trajectories = []
        for n, reward in zip(lengths, rewards):
            tokens = rng.integers(1, VOCAB, n).tolist()
            sampled = (logp[tokens] + rng.uniform(-0.35, 0.35, n)).astype(np.float32)
            action = SampledSequence(stop_reason="stop", tokens_raw=array("i", tokens).tobytes(),
                                     logprobs_raw=sampled.tobytes(), versions_raw=array("i", [1] * n).tobytes())
            prompt = ModelInput.from_ints(rng.integers(1, VOCAB, 3).tolist())
            trajectories.append(Trajectory(transitions=[Transition(observation=Observation(prompt=prompt),
                                                                   action=action, reward=reward, done=True)]))
        groups.append(TrajectoryGroup(trajectories=trajectories, group_rewards=[0.0] * len(trajectories)))
    return groups


def hand_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def hand_objective(theta: np.ndarray, attempts: list[tuple[np.ndarray, np.ndarray, float]], mode: str,
                   kl: tuple[float, np.ndarray] | None) -> float:
    """One call's objective by hand: per sampled token ``ppo - entropy_coef * H (+ kl_coef * k3)``,
    aggregated over the call's ``attempts`` (tokens, sampler logprobs, advantage) as ``mode`` says."""
    logp_all = log_softmax(theta)
    entropy = -float((np.exp(logp_all) * logp_all).sum())  # the sim model's, at every position
    per_attempt = []
    for tokens, sampled, advantage in attempts:
        logp = logp_all[tokens]
        ratio = np.exp(logp - sampled.astype(np.float64))
        token_loss = -np.minimum(ratio * advantage, np.clip(ratio, 0.8, 1.2) * advantage) - ENTROPY_COEF * entropy
        if kl is not None:
            coef, ref = kl
            x = ref[tokens] - logp
            token_loss = token_loss + coef * (np.exp(x) - 1.0 - x)
        per_attempt.append(token_loss)
    n_tokens = sum(len(t) for t in per_attempt)
    if mode in ("sum", "token"):
        return sum(float(t.sum()) for t in per_attempt)
    if mode == "token_mean":
        return sum(float(t.sum()) for t in per_attempt) / n_tokens
    if mode == "seq_mean_token_mean":
        return sum(float(t.mean()) for t in per_attempt) / len(per_attempt)
    assert mode == "seq_mean_token_sum_norm"
    return sum(float(t.sum()) / MAX_TOKENS for t in per_attempt) / len(per_attempt)


def central_gradient(f, theta: np.ndarray, h: float = 1e-5) -> np.ndarray:
    out = np.zeros_like(theta)
    for k in range(theta.shape[0]):
        step = np.zeros_like(theta)
        step[k] = h
        out[k] = (f(theta + step) - f(theta - step)) / (2 * h)
    return out


def batch_of(cfg: TrainConfig, groups: list[TrajectoryGroup]) -> StepBatch:
    """A step's batch over ``groups`` (recorded, not submitted: no training client)."""
    batch = StepBatch(cfg, None, step=1, updates=1, policy_version=lambda v: v)
    for index, group in enumerate(groups):
        assert batch.intake(RolloutResult(WorkItem(index, 0, None), group, 0.0)) is None
    batch.submit(AdamParams(learning_rate=1e-3))
    return batch


SPLITS = {"one_call": {}, "substeps": {"num_substeps": 3}, "minibatches": {"num_minibatches": 2}}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", ["sum", "token", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_each_calls_gradient_is_the_hand_written_aggregation_of_its_tokens(mode, split):
    sim = SimConfig(vocab_size=VOCAB, seed=3)
    theta = sim.initial_weights().astype(np.float64)
    groups = make_groups(theta)
    kl = mode == "seq_mean_token_mean"  # the reference KL is weighted like the rest
    cfg = TrainConfig(loss_fn="ppo", entropy_coef=ENTROPY_COEF, kl_coef=0.3 if kl else None, loss_aggregation=mode,
                      max_tokens=MAX_TOKENS, groups_per_batch=2, group_size=4, **SPLITS[split])
    batch = batch_of(cfg, groups)
    calls = [c for c in batch.calls if isinstance(c, ForwardBackwardCall)]
    assert len(calls) == {"one_call": 1, "substeps": 3, "minibatches": 2}[split]
    assert sorted(i for c in calls for i in c.datums) == list(range(8))
    advantages = [hand_advantages(r) for r in REWARDS]
    outputs, ratios = [], []
    for call in calls:
        trainer = SimTrainer(sim)
        # Away from the initial weights, so that the reference KL and its gradient are not zero.
        trainer.theta = theta + np.linspace(-0.2, 0.2, VOCAB)
        kl_term = (0.3, trainer.reference_logp.copy()) if kl else None
        out = trainer.forward_backward([batch.datums[i] for i in call.datums], call.loss_fn,
                                       loss_settings(call.loss_fn, call.loss_fn_config))
        outputs.append((out, call.datums))
        attempts = []
        for i in call.datums:
            g, t, _ = batch.keys[i]
            action = groups[g].trajectories[t].transitions[0].action
            attempts.append((np.array(action.tokens_array()), action.logprobs_array(), advantages[g][t]))
        ratios += [np.exp(log_softmax(trainer.theta)[tok] - lp.astype(np.float64)) for tok, lp, _ in attempts]
        expected = central_gradient(lambda th, a=attempts, k=kl_term: hand_objective(th, a, mode, k), trainer.theta)
        np.testing.assert_allclose(trainer.grad, expected, rtol=0, atol=1e-6)
    # Both of ppo's branches are taken, and no ratio is within reach of a kink of the min and the clip.
    ratio = np.concatenate(ratios)
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    assert np.abs(ratio - 0.8).min() > 1e-3 and np.abs(ratio - 1.2).min() > 1e-3
    # The bonus's mean is taken under the weights sent: the sim model's entropy is the same at every token.
    metrics = batch.train_metrics(outputs, [])
    probs = np.exp(log_softmax(theta + np.linspace(-0.2, 0.2, VOCAB)))
    assert metrics["entropy_mean"] == pytest.approx(-float((probs * np.log(probs)).sum()), rel=1e-6)
    assert metrics["sampled_tokens_trained"] == sum(map(sum, LENGTHS))


def test_the_old_names_keep_their_meaning():
    sim = SimConfig(vocab_size=VOCAB, seed=3)
    groups = make_groups(sim.initial_weights().astype(np.float64))

    def sent(mode):
        cfg = TrainConfig(loss_fn="ppo", entropy_coef=ENTROPY_COEF, loss_aggregation=mode, max_tokens=MAX_TOKENS,
                          groups_per_batch=2, group_size=4)
        batch = batch_of(cfg, groups)
        return {key: datum.loss_fn_inputs for key, datum in zip(batch.keys, batch.datums)}

    plain, token, sequence = sent("sum"), sent("token"), sent("sequence")
    for key, inputs in plain.items():
        g, t, _ = key
        assert {k: v.to_numpy().tobytes() for k, v in token[key].items()} == \
            {k: v.to_numpy().tobytes() for k, v in inputs.items()}
        # ``sequence``: the advantage over the trajectory's sampled tokens, the mask (bonus) unweighted.
        np.testing.assert_allclose(sequence[key]["advantages"].to_numpy(),
                                   inputs["advantages"].to_numpy() / LENGTHS[g][t], rtol=1e-6)
        assert sequence[key]["mask"].to_numpy().tolist() == inputs["mask"].to_numpy().tolist()


def test_a_bad_aggregation_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="loss_aggregation='mean'"):
        TrainConfig(loss_aggregation="mean")
    with pytest.raises(ConfigurationError, match="loss_aggregation"):
        convert(TrainConfig, {"loss_aggregation": "mean"}, "TrainConfig")


def test_a_run_stored_with_the_old_name_resumes(tmp_path):
    assert convert(TrainConfig, {"loss_aggregation": "token"}, "TrainConfig").loss_aggregation == "token"
    first = train("rl_sim:RECIPE", {"batches": "3", "steps": "1", "checkpoint_every": "1", "eval_every": "0"},
                  run_dir=str(tmp_path))
    assert first.error is None, first.error
    # As a run from before the new names stored it.
    path = os.path.join(tmp_path, CONFIG_FILE)
    with open(path, "rb") as f:
        stored = msgspec.json.decode(f.read())
    assert stored["train"]["loss_aggregation"] == "sum"
    stored["train"]["loss_aggregation"] = "token"
    with open(path, "wb") as f:
        f.write(msgspec.json.encode(stored))
    resumed = train(None, {"steps": "2"}, run_dir=str(tmp_path), resume=True)
    assert resumed.error is None and resumed.resumed_from == 1
    assert [r["step"] for r in read_jsonl(resumed.metrics_path)] == [1, 2]


class _Optim(msgspec.Struct):
    metrics: dict[str, float]


def test_the_step_reports_the_gradient_norm_before_clipping_and_the_share_clipped():
    trainer = SimTrainer(SimConfig(vocab_size=4, seed=0))
    trainer.grad = np.array([3.0, 4.0, 0.0, 0.0])
    assert trainer.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).metrics["grad_norm"] == 5.0
    norms = [0.5, 2.0, 3.0, 1.0]  # 1.0 is at the bound, not above it
    clipped = StepBatch(TrainConfig(grad_clip_norm=1.0), None, 1, 0, int)
    metrics = clipped.train_metrics([], [_Optim({"grad_norm": n}) for n in norms])
    assert metrics["grad_norm"] == pytest.approx(1.625) and metrics["grad_clipped_frac"] == 0.5
    never = StepBatch(TrainConfig(grad_clip_norm=0.0), None, 1, 0, int)
    assert never.train_metrics([], [_Optim({"grad_norm": n}) for n in norms])["grad_clipped_frac"] == 0.0
