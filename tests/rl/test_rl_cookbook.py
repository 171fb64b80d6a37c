"""tinker-cookbook environments run in rlengine's loop unchanged (``rlengine.rl.cookbook``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("tinker_cookbook")

from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train


def test_the_cookbooks_guess_the_number_game_trains_in_the_loop(tmp_path, model_cache):
    outcome = train("cookbook_guess:RECIPE", {"steps": 2, "cache_dir": model_cache, "skip_constant_reward": False},
                    run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    steps = read_jsonl(outcome.metrics_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["attempts_failed"] == 0 and s["groups_trained"] == 2, s
        # The cookbook's own rewards: -1 for a reply it cannot parse, 0 for a wrong guess, 1 if right.
        assert -10.0 <= s["reward_min"] <= s["reward_max"] <= 1.0, s
        assert s["kl_sample_train_v1"] < 1e-4, s  # exact tokens: what was sampled is what is trained
    groups = read_jsonl(str(tmp_path / "groups.jsonl"))
    assert len(groups) == 4 and all(len(g["rewards"]) == 4 for g in groups)


def test_a_cookbook_builders_group_rewards_and_cleanup_are_called():
    from tinker_cookbook.rl.types import EnvGroupBuilder

    from rlengine.rl.cookbook import CookbookGroup
    from rlengine.rl.types import AttemptFailure, Observation, Trajectory, Transition
    from rlengine.types import ModelInput, SampledSequence

    seen = {}

    class Pairwise(EnvGroupBuilder):
        async def make_envs(self):
            return ["env-a", "env-b", "env-c"]

        async def compute_group_rewards(self, trajectory_group, env_group):
            seen["group"] = ([t.transitions[0].ac.tokens for t in trajectory_group], list(env_group))
            return [(10.0 * len(t.transitions[0].ac.tokens), {}) for t in trajectory_group]

        async def cleanup(self):
            seen["cleaned"] = True

    def sampled(tokens):
        return SampledSequence(stop_reason="stop", tokens_raw=np.asarray(tokens, np.int32).tobytes(),
                               logprobs_raw=np.full(len(tokens), -0.1, np.float32).tobytes(),
                               versions_raw=np.zeros(len(tokens), np.int32).tobytes())

    async def main():
        group = CookbookGroup(Pairwise())
        await group.make_envs()
        obs = Observation(prompt=ModelInput.from_ints([1, 2]))
        seqs = [sampled([5, 6]), sampled([7]), sampled([8, 9, 10])]
        trajs = [Trajectory(transitions=[Transition(observation=obs, action=s, reward=0.0, done=True)]) for s in seqs]
        trajs[1] = Trajectory(transitions=[], failure=AttemptFailure(stage="sample", error="X", message="x", turn=0))
        return await group.compute_group_rewards(trajs)

    rewards = asyncio.run(main())
    assert rewards == [20.0, 0.0, 30.0]  # the failed attempt is left out of the group the builder sees
    assert seen["group"] == ([[5, 6], [8, 9, 10]], ["env-a", "env-c"]) and seen["cleaned"]
