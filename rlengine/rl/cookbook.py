"""tinker-cookbook environments in rlengine's loop, unchanged: ``from_cookbook(dataset)``.

The cookbook's ``Env`` / ``EnvGroupBuilder`` / ``RLDataset`` have the shapes
of rlengine's (``rlengine.rl.types``) with the cookbook's own types at the
edges; these wrappers translate only those edges, so a cookbook environment
(its ``Renderer``, its parsing, its rewards) runs as written:

* an observation is a ``tinker.ModelInput`` and a stop condition (stop
  strings or token ids): it becomes an ``Observation`` of the same tokens
  and stops;
* ``step(action)`` gets the sampled token ids, as in the cookbook; its
  ``StepResult`` (``episode_done``, ``next_observation``,
  ``next_stop_condition``, ``metrics``) becomes rlengine's; its ``logs`` are
  the cookbook's display-only diagnostics and are not kept;
* an ``InitialObservationOverflow`` (a prompt over the env's token budget)
  fails the attempt, counted like any failed attempt;
* a builder's ``compute_group_rewards`` (when it overrides the cookbook's
  default) receives cookbook ``Trajectory`` objects rebuilt from the
  attempts that did not fail, and its ``cleanup`` runs after the group;
  ``logging_tags`` pass through.

Importing this module imports no tinker or tinker-cookbook: the wrappers use
the objects they are given, and the cookbook's types only where a builder's
group reward needs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rlengine.rl.types import Env, EnvGroupBuilder, Observation, RLDataset, StepResult, Trajectory
from rlengine.types import ModelInput

__all__ = ["CookbookDataset", "CookbookEnv", "CookbookGroup", "from_cookbook"]


def _observation(model_input: Any, stop: Any) -> Observation:
    """A cookbook observation (``tinker.ModelInput`` + stop condition) as rlengine's."""
    stops = list(stop) if stop else None
    return Observation(prompt=ModelInput.from_ints([int(t) for t in model_input.to_ints()]), stop=stops)


class CookbookEnv(Env):
    """One cookbook ``Env`` as an rlengine ``Env``; see the module docstring."""

    def __init__(self, env: Any) -> None:
        self.env = env

    async def initial_observation(self) -> Observation:
        first = await self.env.initial_observation()
        if not isinstance(first, tuple):  # InitialObservationOverflow: nothing to sample
            raise TypeError(f"the cookbook environment's initial observation is over its budget ({first!r})")
        model_input, stop = first
        return _observation(model_input, stop)

    async def step(self, action: list[int]) -> StepResult:
        result = await self.env.step(action)
        done = bool(result.episode_done)
        metrics = {k: float(v) for k, v in dict(result.metrics or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        return StepResult(reward=float(result.reward), done=done, metrics=metrics,
                          next_observation=None if done else _observation(result.next_observation,
                                                                          result.next_stop_condition))


class CookbookGroup(EnvGroupBuilder):
    """One cookbook ``EnvGroupBuilder`` as rlengine's; see the module docstring."""

    def __init__(self, builder: Any) -> None:
        self.builder = builder
        self._envs: Sequence[Any] = ()

    async def make_envs(self) -> Sequence[CookbookEnv]:
        self._envs = await self.builder.make_envs()
        return [CookbookEnv(e) for e in self._envs]

    async def compute_group_rewards(self, trajectories: Sequence[Trajectory]) -> list[float]:
        try:
            if not _overrides_group_rewards(self.builder):
                return [0.0] * len(trajectories)
            kept = [i for i, t in enumerate(trajectories) if not t.failed]
            rewards = await self.builder.compute_group_rewards([_cookbook_trajectory(trajectories[i]) for i in kept],
                                                               [self._envs[i] for i in kept])
            out = [0.0] * len(trajectories)
            for i, (reward, _metrics) in zip(kept, rewards, strict=True):
                out[i] = float(reward)
            return out
        finally:
            await self.builder.cleanup()

    def logging_tags(self) -> list[str]:
        return list(self.builder.logging_tags())


class CookbookDataset(RLDataset):
    """A cookbook ``RLDataset`` as rlengine's: the same batches, each builder wrapped."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def get_batch(self, index: int) -> list[CookbookGroup]:
        return [CookbookGroup(b) for b in self.dataset.get_batch(index)]


def from_cookbook(dataset: Any) -> CookbookDataset:
    """A tinker-cookbook ``RLDataset`` for ``Recipe.datasets``."""
    return CookbookDataset(dataset)


def _overrides_group_rewards(builder: Any) -> bool:
    from tinker_cookbook.rl.types import EnvGroupBuilder as Base

    return getattr(type(builder), "compute_group_rewards", None) is not Base.compute_group_rewards


def _cookbook_trajectory(trajectory: Trajectory) -> Any:
    """An rlengine trajectory as the cookbook's (observations as ``tinker.ModelInput``)."""
    import tinker
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.types import Trajectory as CookbookTrajectory
    from tinker_cookbook.rl.types import Transition as CookbookTransition

    def ob(observation: Observation) -> Any:
        return tinker.ModelInput.from_ints(observation.prompt.to_ints())

    transitions = [CookbookTransition(ob=ob(t.observation), ac=TokensWithLogprobs(
        tokens=t.action.tokens, maybe_logprobs=t.action.logprobs), reward=t.reward, episode_done=t.done,
        metrics=dict(t.metrics)) for t in trajectory.transitions]
    last = trajectory.transitions[-1]
    final = tinker.ModelInput.from_ints([*last.observation.prompt.to_ints(), *last.action.tokens])
    return CookbookTrajectory(transitions=transitions, final_ob=final)
