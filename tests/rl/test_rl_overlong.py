"""DAPO's overlong handling: ``overlong_filtering`` (a trajectory cut by the token limit trains
nothing) and the soft overlong punishment (``overlong_buffer_len``, ``overlong_buffer_penalty_factor``).

On the sim backend the tokens and the length of every answer are a function
of its seed alone, never of the weights, so two runs of one seed sample the
same rollouts whatever they train: a run without the option is the
reference for what was sampled (each trajectory's datum, its last action's
length), the group ledger for the rewards, and the advantages are
recomputed by hand from those rewards.
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

from rlengine.errors import ConfigurationError
from rlengine.rl.advantages import overlong_penalty, trajectory_overlong_penalty
from rlengine.rl.config import TrainConfig
from rlengine.rl.dump import read_step, step_files
from rlengine.rl.metrics import read_jsonl, summarize
from rlengine.rl.run import train
from rlengine.rl.types import Observation, Trajectory, Transition
from rlengine.types import ModelInput, SampledSequence

MAX_TOKENS = 5


def run(tmp_path, name, **settings):
    """A sim run with its dumps; (metrics lines, ledger entries, datums by (group, trajectory, segment))."""
    outcome = train("rl_sim:RECIPE", {"batches": 2, "gen_len": 4, "gen_len_sigma": 0.6, "max_tokens": MAX_TOKENS,
                                      "turns": 2, "eval_every": 0, "checkpoint_every": 0,
                                      "dump_rollouts": str(tmp_path / name / "dumps"), **settings},
                    run_dir=str(tmp_path / name))
    assert outcome.error is None, outcome.error
    datums = {}
    for step, path in enumerate(step_files(str(tmp_path / name / "dumps")), start=1):
        for d in read_step(path, step).datums:
            datums[d.group, d.trajectory, d.segment] = d
    return read_jsonl(outcome.metrics_path), read_jsonl(str(tmp_path / name / "groups.jsonl")), datums


def last_run(mask: np.ndarray) -> int:
    """The length of the last run of sampled tokens in a datum's mask: its last action."""
    sampled = np.flatnonzero(mask > 0)
    breaks = np.flatnonzero(np.diff(sampled) > 1)
    return int(sampled.size - (breaks[-1] + 1 if breaks.size else 0))


def grpo(rewards: list[float]) -> list[float]:
    """GRPO by hand: centred on the mean, over the population std (+1e-6)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def test_a_cut_trajectory_trains_no_token_and_its_reward_stays_in_the_baseline(tmp_path):
    plain_steps, plain_ledger, plain = run(tmp_path, "plain")
    steps, ledger, filtered = run(tmp_path, "filtered", overlong_filtering=True)
    # What was sampled: two turns per episode, one datum each; cut where its last action took all MAX_TOKENS.
    cut = {(g, t) for (g, t, _), d in plain.items() if last_run(d.mask.to_numpy()) == MAX_TOKENS}
    assert 0 < len(cut) < len(plain)
    # Not one token of a cut trajectory is trained: it has no datum at all, not even for its first turn.
    assert {(g, t) for g, t, _ in filtered} == {(g, t) for g, t, _ in plain} - cut
    by_group = {e["group"]: e for e in ledger}
    for (g, t, _), d in filtered.items():
        entry = by_group[g]
        assert entry["disposition"] == "trained" and t not in entry.get("overlong_filtered", [])
        # The advantage's baseline is over every surviving reward, the cut ones' too.
        advantage = grpo(entry["rewards"])[t]
        mask = d.mask.to_numpy()
        np.testing.assert_allclose(d.datum.loss_fn_inputs["advantages"].to_numpy(), advantage * mask, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_array_equal(d.datum.loss_fn_inputs["advantages"].to_numpy(),
                                      plain[g, t, 0].datum.loss_fn_inputs["advantages"].to_numpy())
    # The ledger and the metrics count them; the rewards of both runs are the same samples.
    assert sorted((e["group"], t) for e in ledger for t in e.get("overlong_filtered", [])) == sorted(cut)
    assert sum(s["attempts_overlong_filtered"] for s in steps) == len(cut)
    summary = summarize(str(tmp_path / "filtered"), 0.9)
    assert summary["attempts_overlong_filtered"] == len(cut)
    assert summary["groups_dropped_overlong"] == sum(e["disposition"] == "dropped_overlong" for e in ledger)
    assert all(s["attempts_overlong_filtered"] == 0 for s in plain_steps)
    assert [s["reward_mean"] for s in steps] == [s["reward_mean"] for s in plain_steps]
    assert [s["datums"] for s in steps] == [
        sum(1 for (g, _, _) in filtered if by_group[g]["step"] == s["step"]) for s in steps]
    assert {e["group"] for e in plain_ledger if e["disposition"] == "trained"} == {
        e["group"] for e in ledger if e["disposition"] in ("trained", "dropped_overlong")}


def test_a_group_cut_everywhere_is_dropped_and_nothing_is_trained(tmp_path):
    # Every answer would run to 8 tokens: each one is cut at MAX_TOKENS.
    steps, ledger, datums = run(tmp_path, "cut", overlong_filtering=True, gen_len=8, gen_len_sigma=0.0, batches=1)
    [path] = step_files(str(tmp_path / "cut" / "dumps"))
    assert datums == {} and steps[0]["datums"] == 0 and read_step(path, 1).calls == []  # no training call at all
    dropped = [e for e in ledger if e["disposition"] == "dropped_overlong"]
    assert dropped and all(e["overlong_filtered"] == [0, 1, 2, 3] for e in dropped)
    assert steps[0]["groups_dropped_overlong"] == len(dropped)
    assert steps[0]["groups_dropped_overlong"] + steps[0]["groups_dropped_constant_reward"] == 4
    assert steps[0]["attempts_overlong_filtered"] == 4 * len(dropped)


def runs(mask: np.ndarray) -> list[int]:
    """The lengths of the runs of sampled tokens in a datum's mask: its actions, in order."""
    sampled = np.flatnonzero(mask > 0)
    cuts = np.flatnonzero(np.diff(sampled) > 1) + 1
    return [len(r) for r in np.split(sampled, cuts)]


@pytest.mark.parametrize(("length", "penalty"), [(0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0),
                                                  (25, -1.0)])
def test_the_soft_overlong_punishment_is_dapos_piecewise_line(length, penalty):
    # L_max = 20, L_cache = 4: nothing up to 16 tokens, then (16 - n) / 4, and -1 from 20 on.
    assert overlong_penalty(length, 20, 4, 1.0) == penalty
    assert overlong_penalty(length, 20, 4, 0.5) == penalty / 2
    assert overlong_penalty(length, 20, 0, 1.0) == 0.0


def test_a_multi_turn_trajectory_takes_the_penalty_of_its_longest_action():
    def action(n: int) -> Transition:
        return Transition(observation=Observation(prompt=ModelInput.from_ints([1])), reward=0.0, done=False,
                          action=SampledSequence(stop_reason="stop", tokens_raw=array("i", [2] * n).tobytes(),
                                                 logprobs_raw=array("f", [-0.5] * n).tobytes(),
                                                 versions_raw=array("i", [0] * n).tobytes()))

    trajectory = Trajectory(transitions=[action(3), action(19), action(10)])  # 32 tokens in all: each is capped
    assert trajectory_overlong_penalty(trajectory, 20, 4, 1.0) == -0.75
    assert trajectory_overlong_penalty(Trajectory(transitions=[]), 20, 4, 1.0) == 0.0


def test_the_penalty_is_added_to_each_reward_before_the_advantages(tmp_path):
    # The buffer is the last 2 of MAX_TOKENS = 5: an action of 4 tokens costs 0.25, one of 5 costs 0.5.
    common = {"skip_constant_reward": False}  # every group trains, so every trajectory has a datum
    _, plain_ledger, plain = run(tmp_path, "plain", **common)
    steps, ledger, shaped = run(tmp_path, "shaped", overlong_buffer_len=2, overlong_buffer_penalty_factor=0.5,
                                **common)
    assert shaped.keys() == plain.keys()
    expected = {(g, t): {3: 0.0, 4: -0.25, 5: -0.5}.get(max(runs(d.mask.to_numpy())), 0.0)
                for (g, t, _), d in plain.items()}
    assert {0.0, -0.25, -0.5} <= set(expected.values())
    plain_rewards = {e["group"]: e["rewards"] for e in plain_ledger}
    for e in ledger:
        g = e["group"]
        penalties = [expected[g, t] for t in range(4)]
        assert e["overlong_penalties"] == penalties
        np.testing.assert_allclose(e["rewards"], np.add(plain_rewards[g], penalties), rtol=0, atol=1e-12)
        advantages = grpo(e["rewards"])
        for t in range(4):
            d = shaped[g, t, 0]
            np.testing.assert_allclose(d.datum.loss_fn_inputs["advantages"].to_numpy(),
                                       advantages[t] * d.mask.to_numpy(), rtol=1e-5, atol=1e-6)
    for s in steps:
        mine = [p for e in ledger if e["step"] == s["step"] for p in e["overlong_penalties"]]
        assert s["overlong_penalty_mean"] == pytest.approx(float(np.mean(mine)))
    # A replay of the dumps reproduces the column (the penalties travel in the step dumps).
    replay = train(None, {"train_from": str(tmp_path / "shaped" / "dumps")}, run_dir=str(tmp_path / "replay"))
    assert replay.error is None, replay.error
    assert [s["overlong_penalty_mean"] for s in read_jsonl(replay.metrics_path)] == [
        s["overlong_penalty_mean"] for s in steps]


def test_the_overlong_settings_are_validated_naming_field_and_value(tmp_path):
    with pytest.raises(ConfigurationError, match="overlong_filtering='maybe'"):
        train("rl_sim:RECIPE", {"overlong_filtering": "maybe"}, run_dir=str(tmp_path / "a"))
    with pytest.raises(ConfigurationError, match="overlong_filtering=2: must be true or false"):
        TrainConfig(overlong_filtering=2)
    with pytest.raises(ConfigurationError, match="overlong_buffer_len=-1: must be an integer >= 0"):
        TrainConfig(overlong_buffer_len=-1)
    with pytest.raises(ConfigurationError, match="overlong_buffer_len=9: exceeds max_tokens=8"):
        train("rl_sim:RECIPE", {"overlong_buffer_len": "9"}, run_dir=str(tmp_path / "b"))  # the recipe's max_tokens
    with pytest.raises(ConfigurationError, match="overlong_buffer_len='long'"):
        train("rl_sim:RECIPE", {"overlong_buffer_len": "long"}, run_dir=str(tmp_path / "c"))
    for bad in (-0.5, float("nan"), True):
        with pytest.raises(ConfigurationError, match=f"overlong_buffer_penalty_factor={bad!r}: must be a finite"):
            TrainConfig(overlong_buffer_len=4, overlong_buffer_penalty_factor=bad)
    assert TrainConfig(max_tokens=8, overlong_buffer_len=8).overlong_buffer_len == 8  # every token in the buffer
    assert not any((tmp_path / d).exists() for d in "abc")
