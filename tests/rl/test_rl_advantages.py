"""Advantages, group filtering, datums and the staleness rule, against hand-written references."""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

from rlengine.rl.advantages import assess_group, group_advantages, is_stale, trajectory_datums
from rlengine.rl.types import AttemptFailure, Observation, Trajectory, TrajectoryGroup, Transition
from rlengine.types import ModelInput, SampledSequence


def seq(tokens: list[int], logprobs: list[float] | None = None, version: int = 1,
        stop_reason: str = "stop") -> SampledSequence:
    logprobs = logprobs or [-0.5] * len(tokens)
    return SampledSequence(stop_reason=stop_reason, tokens_raw=array("i", tokens).tobytes(),
                           logprobs_raw=array("f", logprobs).tobytes(),
                           versions_raw=array("i", [version] * len(tokens)).tobytes())


def traj(reward: float, failed: bool = False, version: int = 1, cut: bool = False) -> Trajectory:
    t = Transition(observation=Observation(prompt=ModelInput.from_ints([1, 2])),
                   action=seq([3, 4], version=version, stop_reason="length" if cut else "stop"), reward=reward, done=True)
    failure = AttemptFailure(stage="step", error="ConnectionError", message="gone", turn=0) if failed else None
    return Trajectory(transitions=[] if failed else [t], failure=failure)


def group(rewards: list[float], failed: tuple[int, ...] = (), bonus: list[float] | None = None,
          cut: tuple[int, ...] = ()) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[traj(r, i in failed, cut=i in cut) for i, r in enumerate(rewards)],
                           group_rewards=bonus or [0.0] * len(rewards))


def reference_advantages(rewards: list[float], normalize: bool) -> list[float]:
    """GRPO by hand: centre on the mean; divide by the population std (+1e-6)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + 1e-6) if normalize else r - mean for r in rewards]


@pytest.mark.parametrize("normalize", [True, False])
def test_group_advantages_equal_the_hand_written_grpo(normalize):
    rewards = [0.0, 0.25, 1.0, 0.5, 0.5]
    np.testing.assert_allclose(group_advantages(np.array(rewards), normalize),
                               reference_advantages(rewards, normalize), rtol=1e-12)


def test_failed_attempts_are_filtered_and_survivors_get_advantages_among_themselves():
    g = group([1.0, 0.0, 0.5, 0.25], failed=(1,), bonus=[0.0, 0.0, 0.5, 0.0])
    v = assess_group(g, min_surviving_attempts=2, skip_constant_reward=True, normalize=True)
    assert v.dropped is None and v.failed == 1 and v.kept == [0, 2, 3]
    # The failed attempt's reward never enters the statistics; group rewards add to step rewards.
    assert v.rewards == [1.0, 1.0, 0.25]
    np.testing.assert_allclose(v.advantages, reference_advantages([1.0, 1.0, 0.25], True))


def test_too_few_survivors_drops_the_group():
    g = group([1.0, 0.0, 0.5, 0.25], failed=(0, 1, 3))
    v = assess_group(g, min_surviving_attempts=2, skip_constant_reward=False, normalize=True)
    assert v.dropped == "too_few_survivors" and v.kept == [] and v.failed == 3 and v.rewards == [0.5]
    every_attempt_failed = assess_group(group([1.0, 0.0], failed=(0, 1)), min_surviving_attempts=1,
                                        skip_constant_reward=False, normalize=True)
    assert every_attempt_failed.dropped == "too_few_survivors"


def test_constant_reward_is_dropped_only_when_configured():
    g = group([0.5, 0.5, 0.5])
    assert assess_group(g, min_surviving_attempts=1, skip_constant_reward=True, normalize=True).dropped \
        == "constant_reward"
    kept = assess_group(g, min_surviving_attempts=1, skip_constant_reward=False, normalize=True)
    assert kept.dropped is None and kept.advantages == [0.0, 0.0, 0.0]


def test_overlong_filtering_keeps_a_cut_attempts_reward_in_the_baseline_and_leaves_it_out_of_training():
    g = group([1.0, 0.0, 0.5, 0.25], failed=(1,), cut=(0, 3))
    plain = assess_group(g, min_surviving_attempts=2, skip_constant_reward=True, normalize=True)
    assert plain.kept == [0, 2, 3] and plain.filtered == []
    v = assess_group(g, min_surviving_attempts=2, skip_constant_reward=True, normalize=True, overlong_filtering=True)
    assert v.dropped is None and v.failed == 1 and v.filtered == [0, 3] and v.kept == [2]
    assert v.rewards == [1.0, 0.5, 0.25]
    np.testing.assert_allclose(v.advantages, reference_advantages([1.0, 0.5, 0.25], True)[1:2])
    everywhere = assess_group(group([1.0, 0.0], cut=(0, 1)), min_surviving_attempts=1, skip_constant_reward=True,
                              normalize=True, overlong_filtering=True)
    assert everywhere.dropped == "overlong" and everywhere.kept == [] and everywhere.filtered == [0, 1]
    # A constant group is dropped as such before anything is filtered.
    constant = assess_group(group([0.5, 0.5], cut=(0,)), min_surviving_attempts=1, skip_constant_reward=True,
                            normalize=True, overlong_filtering=True)
    assert constant.dropped == "constant_reward" and constant.filtered == []


@pytest.mark.parametrize(("oldest", "current", "k", "stale"), [
    (5, 5, 0, False), (4, 5, 0, True), (4, 5, 1, False), (3, 5, 1, True), (None, 9, 0, False)])
def test_staleness_rule(oldest, current, k, stale):
    assert is_stale(oldest, current, k) is stale


def test_single_turn_datum_targets_logprobs_advantages_and_mask():
    t = Transition(observation=Observation(prompt=ModelInput.from_ints([5, 6, 7])),
                   action=seq([8, 9], [-0.1, -0.2]), reward=1.0, done=True)
    [(datum, mask, versions)] = trajectory_datums(Trajectory(transitions=[t]), 1.5, with_mask=True)
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    np.testing.assert_allclose(inputs["logprobs"], [0, 0, -0.1, -0.2], rtol=1e-6)
    assert inputs["advantages"].tolist() == [0, 0, 1.5, 1.5]
    assert inputs["mask"].tolist() == mask.tolist() == [0, 0, 1, 1]
    assert versions.tolist() == [-1, -1, 1, 1]  # the version that sampled each target token
    [(bare, _, _)] = trajectory_datums(Trajectory(transitions=[t]), 1.5, with_mask=False)
    assert "mask" not in bare.loss_fn_inputs


def test_multi_turn_extending_observations_share_one_datum_and_a_rewrite_splits():
    t1 = Transition(observation=Observation(prompt=ModelInput.from_ints([1, 2])), action=seq([3, 4]), reward=0.0,
                    done=False)
    # Turn 2 extends the context token for token: prompt + action + environment tokens.
    t2 = Transition(observation=Observation(prompt=ModelInput.from_ints([1, 2, 3, 4, 50, 51])),
                    action=seq([6], [-0.3], version=2), reward=1.0, done=False)
    # Turn 3 rewrote the context (not a prefix): a new datum.
    t3 = Transition(observation=Observation(prompt=ModelInput.from_ints([9, 9])), action=seq([7]), reward=0.0,
                    done=True)
    out = trajectory_datums(Trajectory(transitions=[t1, t2, t3]), -1.0, with_mask=True)
    assert len(out) == 2
    (first, mask1, versions1), (second, mask2, _) = out
    assert first.model_input.to_ints() == [1, 2, 3, 4, 50, 51]
    assert first.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 50, 51, 6]
    assert mask1.tolist() == [0, 1, 1, 0, 0, 1]
    assert versions1.tolist() == [-1, 1, 1, -1, -1, 2]  # turn 2 was sampled after a weight install
    assert first.loss_fn_inputs["advantages"].tolist() == [0, -1, -1, 0, 0, -1]
    assert second.model_input.to_ints() == [9, 9] and mask2.tolist() == [0, 1]
