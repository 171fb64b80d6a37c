"""The RL abstractions: environments, trajectories, groups of them, datasets of groups.

Shaped like the Tinker cookbook's, so its users feel at home:

* ``Env`` - one episode of one task. ``initial_observation()`` gives the
  first prompt (an ``Observation``: token ids plus how to sample the
  answer); ``step(action)`` takes the sampled tokens and returns a
  ``StepResult``: reward, whether the episode is done, and the next
  observation. Both are coroutines, so an environment may live elsewhere
  (a sandbox process reached over IPC): the loop only awaits it, and an
  exception it raises (a crashed sandbox, a broken connection) marks that one
  attempt failed instead of ending the run.
* ``AgentEnv`` - an episode the environment drives itself, typically an
  agent in a sandbox process that samples through the engine's IPC server
  (``rlengine.sandbox_client``) and sends its reward there: ``run`` returns the
  ``Trajectory``, built from the session's exact trace (see
  ``rlengine.rl.sandbox``). Its exceptions fail the attempt, as ``Env``'s do.
* ``MultiAgentEnv`` - an episode in which several agents act, each an ``Agent``:
  a role, a model slot (the policy trained, or any sampler: a frozen model,
  a teacher, a scripted agent) and whether it trains. ``run`` returns one
  ``Trajectory`` per agent, carrying its role and flag; a group's attempts
  of one role are compared only with each other (``advantages``) and an
  untrainable role's trajectories never reach the trainer. The turn-taking
  shape (``step(role, action)``) and the HTTP sessions' roles are in
  ``rlengine.rl.multi_agent``.
* ``EnvGroupBuilder`` - makes the ``group_size`` environments of one group
  (the same task, several attempts: GRPO compares attempts within a group)
  and may add a reward computed over the whole group.
* ``RLDataset`` - ``get_batch(i)`` returns the builders of batch ``i``. It must
  be a pure function of ``i`` (seeded by the index, never by call order): a
  resumed run asks again for the batches it had not finished and must get
  the same groups.
* ``Transition``, ``Trajectory``, ``TrajectoryGroup`` - what a rollout
  produced: each turn's observation, the exact sampled tokens with their
  sampler logprobs and the policy version of every token, the rewards, and,
  for an attempt that failed, an ``AttemptFailure`` saying where and why.

Observations are token ids, not text: a multi-turn environment that
extends the previous observation token for token (observation + action +
new tokens) gives one training sequence per episode; the loop never
re-tokenizes what the model sampled.

This module defines values and interfaces only; it must not sample, train
or import torch.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from rlengine.errors import ConfigurationError
from rlengine.types import ModelInput, SampledSequence, SamplingParams
from rlengine.validation import check_role

__all__ = ["FAILURE_KINDS", "POLICY", "Agent", "AgentEnv", "AttemptFailure", "Env", "EnvGroupBuilder", "Metrics", "MultiAgentEnv", "Observation", "RLDataset",
           "StepResult",
           "Trajectory", "TrajectoryGroup", "Transition"]

Metrics = dict[str, float]
"""Numeric metrics an environment reports; the loop averages them per step under ``env/<name>``."""


class Observation(msgspec.Struct, kw_only=True, frozen=True):
    """A prompt for the policy and how to sample its answer."""

    prompt: ModelInput
    """The whole context of this turn, as token ids."""
    max_tokens: int | None = None
    """Most tokens of the answer; None takes the run's ``max_tokens``."""
    stop: list[str | int] | None = None
    """Extra stop strings or token ids for this turn (the model's end token always stops)."""


class StepResult(msgspec.Struct, kw_only=True, frozen=True):
    """What ``Env.step`` returns."""

    reward: float
    done: bool
    next_observation: Observation | None = None
    """Required when ``done`` is False."""
    metrics: Metrics = msgspec.field(default_factory=dict)


class Transition(msgspec.Struct, kw_only=True, frozen=True):
    """One turn: the observation, what the policy sampled, and the reward it got."""

    observation: Observation
    action: SampledSequence
    """Tokens, sampler logprobs and per-token policy versions, exactly as sampled."""
    reward: float
    done: bool
    metrics: Metrics = msgspec.field(default_factory=dict)


class AttemptFailure(msgspec.Struct, kw_only=True, frozen=True):
    """Why one attempt (one environment of a group) produced no usable trajectory."""

    stage: str
    """``metadata``, ``initial_observation``, ``sample``, ``step``, ``max_turns``, ``timeout`` or
    (an ``AgentEnv``) ``agent``."""
    error: str
    """The exception type."""
    message: str
    turn: int
    kind: str = "other"
    """What failed, for the counts: ``crash`` (the sandbox died), ``timeout`` (a deadline
    passed), ``http`` (the agent's connection to the engine failed, or the engine refused
    its request) or ``other`` (the environment's own error). Every failed attempt, of any
    kind, is left out of its group's advantage statistics."""


FAILURE_KINDS = ("crash", "timeout", "http", "other")


class Trajectory(msgspec.Struct, kw_only=True, frozen=True):
    """One attempt: its transitions, or where it failed."""

    transitions: list[Transition]
    failure: AttemptFailure | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """``Env.metadata()``: what the environment says about itself (sandbox id, task), for the logs."""
    role: str | None = None
    """The agent whose turns these are, in a multi-agent episode; None: a single-agent episode."""
    trainable: bool = True
    """False: the turns of an agent that does not train (a frozen or scripted one); never trained."""

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def step_reward(self) -> float:
        return math.fsum(t.reward for t in self.transitions)

    @property
    def sampled_tokens(self) -> int:
        return sum(t.action.length for t in self.transitions)

    @property
    def truncated(self) -> bool:
        """Its last action was cut by the token limit (stop reason ``length``: it reached its
        ``max_tokens``, not an end token or a stop string)."""
        return bool(self.transitions) and self.transitions[-1].action.stop_reason == "length"

    def versions(self) -> tuple[int, int] | None:
        """(oldest, newest) engine policy version of any sampled token; None without tokens."""
        lo = hi = None
        for t in self.transitions:
            v = t.action.versions_array()
            if v.size:
                a, b = int(v.min()), int(v.max())
                lo = a if lo is None else min(lo, a)
                hi = b if hi is None else max(hi, b)
        return None if lo is None else (lo, hi)  # type: ignore[return-value]


class TrajectoryGroup(msgspec.Struct, kw_only=True, frozen=True):
    """The attempts of one group, with the group-level rewards of its builder."""

    trajectories: list[Trajectory]
    group_rewards: list[float]
    """``EnvGroupBuilder.compute_group_rewards``, one per trajectory (0 where the builder adds none)."""
    tags: list[str] = msgspec.field(default_factory=list)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    def by_role(self) -> dict[str | None, list[int]]:
        """Each role's trajectories (their indices), roles in order of first appearance; a
        single-agent group is one entry, None."""
        out: dict[str | None, list[int]] = {}
        for i, t in enumerate(self.trajectories):
            out.setdefault(t.role, []).append(i)
        return out

    def total_rewards(self) -> list[float]:
        """Per trajectory: the sum of its step rewards plus its group reward."""
        return [t.step_reward + g for t, g in zip(self.trajectories, self.group_rewards)]

    def versions(self) -> tuple[int, int] | None:
        """(oldest, newest) engine policy version over the group's trainable sampled tokens (an
        untrainable agent's tokens come from another model slot: they are never stale)."""
        # One array for the group: a group of short answers holds about as many actions as tokens.
        v = np.frombuffer(b"".join(t.action.versions_raw for trajectory in self.trajectories if trajectory.trainable
                                   for t in trajectory.transitions), dtype=np.int32)
        return (int(v.min()), int(v.max())) if v.size else None


class Env(abc.ABC):
    """One episode of a task; see the module docstring."""

    @abc.abstractmethod
    async def initial_observation(self) -> Observation:
        """The first prompt."""

    @abc.abstractmethod
    async def step(self, action: list[int]) -> StepResult:
        """Take the sampled tokens of this turn; return the reward and what comes next."""

    async def close(self) -> None:
        """Release what the environment holds (a sandbox); called once per episode, also after a failure."""
        return

    def metadata(self) -> dict[str, Any]:
        """JSON-able facts about this environment for the logs (e.g. a sandbox id)."""
        return {}


class AgentEnv(abc.ABC):
    """An episode driven by the environment itself (an agent in a sandbox); see the module docstring."""

    @abc.abstractmethod
    async def run(self, params: SamplingParams, seed: int, max_turns: int) -> Trajectory:
        """Play one episode, sampling with ``params`` (per-turn seeds derived from ``seed``),
        at most ``max_turns`` turns; return its trajectory (exact tokens, logprobs, versions)."""

    async def close(self) -> None:
        """Release what the episode holds; called once per episode, also after a failure."""
        return

    def metadata(self) -> dict[str, Any]:
        """JSON-able facts about this environment for the logs (e.g. a sandbox id)."""
        return {}


POLICY = "policy"
"""``Agent.sampler`` for the policy being trained: the run's own sampling client."""


class Agent(msgspec.Struct, kw_only=True, frozen=True):
    """One agent of a multi-agent episode: its role, its model slot, whether it trains."""

    role: str
    """Its name in the episode (``rlengine.validation.check_role``); unique within the episode."""
    sampler: Any = POLICY
    """``POLICY`` (the policy trained; several roles may share it), or any object with
    ``sample(prompt, num_samples, sampling_params)`` returning an awaitable ``SampleResponse``,
    the ``SamplingClient`` shape: a frozen model's client, a teacher slot, a ``ScriptedAgent``."""
    trainable: bool = True
    """False: its turns are recorded, rewarded and exported, never trained."""

    def __post_init__(self) -> None:
        check_role("role", self.role, ConfigurationError)
        if self.sampler != POLICY and not callable(getattr(self.sampler, "sample", None)):
            raise ConfigurationError(f"sampler={self.sampler!r}: must be {POLICY!r} or have a sample(prompt, "
                                     f"num_samples, sampling_params) method (role {self.role!r})")
        if not isinstance(self.trainable, bool):
            raise ConfigurationError(f"trainable={self.trainable!r}: must be a bool (role {self.role!r})")


class MultiAgentEnv(abc.ABC):
    """An episode in which several agents act; see the module docstring."""

    @abc.abstractmethod
    def agents(self) -> Sequence[Agent]:
        """The episode's agents, roles unique; ``run``'s trajectories come in this order."""

    @abc.abstractmethod
    async def run(self, policy: Any, params: SamplingParams, seed: int, max_turns: int) -> list[Trajectory]:
        """Play one episode, the ``POLICY`` agents sampling with ``policy`` (the run's
        ``SamplingClient``) under ``params``, per-turn seeds derived from ``seed``, at most
        ``max_turns`` turns in all; one ``Trajectory`` per agent, in ``agents()`` order, each
        with its agent's ``role`` and ``trainable``."""

    async def close(self) -> None:
        """Release what the episode holds; called once per episode, also after a failure."""
        return

    def metadata(self) -> dict[str, Any]:
        """JSON-able facts about this environment for the logs."""
        return {}


class EnvGroupBuilder(abc.ABC):
    """Makes the environments of one group; see the module docstring."""

    @abc.abstractmethod
    async def make_envs(self) -> Sequence[Env | AgentEnv | MultiAgentEnv]:
        """The group's environments, one per attempt."""

    async def compute_group_rewards(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """A reward per trajectory computed over the whole group, added to its step rewards."""
        return [0.0] * len(trajectories)

    def logging_tags(self) -> list[str]:
        """Tags under which the loop also reports this group's mean reward (``reward_mean/<tag>``)."""
        return []

    def metadata(self) -> dict[str, Any]:
        """JSON-able facts about this group (the task) for the group ledger."""
        return {}


class RLDataset(abc.ABC):
    """Batches of group builders; ``get_batch`` must be a pure function of the index."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of batches."""

    @abc.abstractmethod
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        """The builders of batch ``index``: the same ones every time it is asked."""
