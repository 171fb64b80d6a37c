"""Multi-agent episodes: several agents act in one episode, each with a role, a model slot and a flag.

The abstractions are in ``rlengine.rl.types``: an ``Agent`` is a role, a
model slot (``POLICY``, the policy trained, which several roles may share;
or any object with the ``SamplingClient`` shape ``sample(prompt,
num_samples, sampling_params)``: a frozen model's client, a teacher slot,
a ``ScriptedAgent``) and whether it trains; a ``MultiAgentEnv``'s ``run``
returns one ``Trajectory`` per agent, carrying its role and flag. Past the
episode, roles are the only thing that changes: a group of ``group_size``
episodes holds each role's ``group_size`` attempts, each role's advantages
are computed against its own baseline (``advantages.assess_group``), an
untrainable role's trajectories are recorded and exported apart (the
group ledger's ``roles``, the metrics' ``reward_mean/role:<role>``) and
never reach ``forward_backward``.

Two ways to write one:

* ``TurnTakingEnv`` - agents take turns, the cookbook's ``Env`` with a role:
  ``initial_turn()`` says who acts first and on what ``Observation`` (each
  agent sees its own view, token ids), ``step(role, action)`` takes that
  agent's sampled tokens and returns a ``RoleStep``: rewards by role, done,
  and the next ``Turn``. The loop samples each turn from the acting agent's
  slot, so the environment never samples. Chosen over a ``run`` that each
  environment writes itself because a game then reads as its rules alone,
  and every turn's tokens, logprobs and versions are kept exactly as sampled.
* over HTTP, for agents written with any framework: a session opened with
  ``roles={"guesser": True, "hinter": False}`` (``SessionManager.open``),
  each call naming its role in the ``X-RLEngine-Role`` header; the session's
  trace comes back split per role (``SessionTrace.by_role``), the
  untrainable roles' tokens out of its loss mask, and ``role_trajectories``
  turns it into the per-agent trajectories a ``MultiAgentEnv.run`` returns.

Nothing here trains or computes advantages; it must not import torch.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from rlengine.errors import ConfigurationError, RLEngineError
from rlengine.rl.rollouts import turn_params
from rlengine.rl.sandbox import Branches, session_trajectory
from rlengine.rl.types import POLICY, Agent, Metrics, MultiAgentEnv, Observation, Trajectory, Transition
from rlengine.seeding import mix_seed
from rlengine.types import ModelInput, SampledSequence, SampleResponse, SamplingParams
from rlengine.validation import check_role

__all__ = ["EpisodeError", "RoleStep", "ScriptedAgent", "Turn", "TurnTakingEnv", "role_trajectories"]


class EpisodeError(RLEngineError, RuntimeError):
    """A multi-agent episode broke its rules (an unknown role's turn, too many turns); it fails its attempt."""


class Turn(msgspec.Struct, kw_only=True, frozen=True):
    """Whose turn it is, and what that agent sees."""

    role: str
    observation: Observation
    """The acting agent's whole context, as token ids (its own view of the episode)."""


class RoleStep(msgspec.Struct, kw_only=True, frozen=True):
    """What ``TurnTakingEnv.step`` returns."""

    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    """Reward by role for this step: the acting role's goes on this turn, another's on its latest
    turn (on its next one if it has not acted yet; a role that never acts has no turn to carry it)."""
    done: bool
    next_turn: Turn | None = None
    """Required when ``done`` is False."""
    metrics: Metrics = msgspec.field(default_factory=dict)


class _Turns:
    """One agent's turns under way: each turn's parts, and a reward waiting for its next turn."""

    __slots__ = ("pending", "turns")

    def __init__(self) -> None:
        self.turns: list[dict[str, Any]] = []
        self.pending = 0.0

    def reward(self, value: float) -> None:
        if self.turns:
            self.turns[-1]["reward"] += value
        else:
            self.pending += value


class TurnTakingEnv(MultiAgentEnv):
    """A multi-agent episode whose agents take turns; see the module docstring.

    ``agents``: the episode's agents, roles unique. ``run`` plays it: each
    turn is sampled from the acting agent's slot (``POLICY``: the run's
    client), seeded ``mix_seed(seed, turn)``; an agent may act at most
    ``max_turns`` times."""

    def __init__(self, agents: Sequence[Agent]) -> None:
        agents = list(agents)
        if not agents or not all(isinstance(a, Agent) for a in agents):
            raise ConfigurationError(f"agents={agents!r}: must be one Agent or more")
        roles = [a.role for a in agents]
        if len(set(roles)) != len(roles):
            raise ConfigurationError(f"agents: the roles {roles} are not unique")
        self._agents = agents

    def agents(self) -> list[Agent]:
        return self._agents

    @abc.abstractmethod
    async def initial_turn(self) -> Turn:
        """The first agent to act and what it sees."""

    @abc.abstractmethod
    async def step(self, role: str, action: list[int]) -> RoleStep:
        """Take agent ``role``'s sampled tokens; return the rewards, whether it is done, who is next."""

    async def run(self, policy: Any, params: SamplingParams, seed: int, max_turns: int) -> list[Trajectory]:
        agents = {a.role: a for a in self._agents}
        played = {role: _Turns() for role in agents}
        turn = await self.initial_turn()
        for k in range(max_turns * len(agents)):
            role = self._check_turn(turn, agents)
            if len(played[role].turns) >= max_turns:
                raise EpisodeError(f"role {role!r}: not done after max_turns={max_turns} turns of its own")
            agent = agents[role]
            sampler = policy if agent.sampler == POLICY else agent.sampler
            action = await _sample(sampler, turn.observation, turn_params(params, turn.observation, mix_seed(seed, k)))
            result = await self.step(role, action.tokens)
            if not isinstance(result, RoleStep):
                raise TypeError(f"{type(self).__name__}.step returned {type(result).__name__}, not a RoleStep")
            mine = played[role]
            mine.turns.append({"observation": turn.observation, "action": action, "reward": mine.pending,
                               "metrics": dict(result.metrics)})
            mine.pending = 0.0
            for rewarded, value in result.rewards.items():
                check_role("RoleStep.rewards", rewarded, EpisodeError, agents)
                played[rewarded].reward(value)
            if result.done:
                return [self._trajectory(agent, played[agent.role]) for agent in self._agents]
            if result.next_turn is None:
                raise ValueError(f"turn {k}: RoleStep(done=False) needs a next_turn")
            turn = result.next_turn
        raise EpisodeError(f"not done after max_turns={max_turns} turns of each of its {len(agents)} agents")

    @staticmethod
    def _check_turn(turn: Any, agents: Mapping[str, Agent]) -> str:
        if not isinstance(turn, Turn):
            raise TypeError(f"a turn must be a Turn, not {type(turn).__name__}")
        return check_role("Turn.role", turn.role, EpisodeError, agents)

    @staticmethod
    def _trajectory(agent: Agent, played: _Turns) -> Trajectory:
        last = len(played.turns) - 1
        return Trajectory(transitions=[Transition(observation=t["observation"], action=t["action"],
                                                  reward=t["reward"], done=i == last, metrics=t["metrics"])
                                       for i, t in enumerate(played.turns)],
                          role=agent.role, trainable=agent.trainable)


async def _sample(sampler: Any, observation: Observation, params: SamplingParams) -> SampledSequence:
    """One completion from ``sampler`` (the ``SamplingClient`` shape); a cancelled wait aborts an
    engine request (one with ``abort``), so nobody's generation runs for nothing."""
    pending = sampler.sample(observation.prompt, 1, params)
    try:
        response = await pending
    except asyncio.CancelledError:
        abort = getattr(pending, "abort", None)
        if abort is not None:
            abort()
        raise
    sequence = response.sequences[0]
    if sequence.stop_reason == "abort":
        # The engine is shutting down; the loop is stopping this rollout anyway.
        raise asyncio.CancelledError("the engine aborted the sample")
    return sequence


class ScriptedAgent:
    """A model slot whose answers a function computes: ``reply(prompt tokens) -> answer tokens``.

    It has the ``SamplingClient`` shape (``sample``), so a scripted agent, a frozen model and
    the policy are interchangeable in an ``Agent``. Its tokens carry logprob 0 and version -1
    (no policy sampled them); an agent with it must not train (``Agent(trainable=False)``)."""

    def __init__(self, reply: Callable[[list[int]], list[int]]) -> None:
        self.reply = reply

    async def sample(self, prompt: ModelInput, num_samples: int = 1,
                     sampling_params: SamplingParams | None = None) -> SampleResponse:
        tokens = [int(t) for t in self.reply(prompt.to_ints())]
        n = len(tokens)
        sequence = SampledSequence(stop_reason="stop", tokens_raw=np.asarray(tokens, dtype=np.int32).tobytes(),
                                   logprobs_raw=np.zeros(n, dtype=np.float32).tobytes(),
                                   versions_raw=np.full(n, -1, dtype=np.int32).tobytes())
        return SampleResponse(sequences=(sequence,) * num_samples)


def role_trajectories(trace: Any, agents: Sequence[Agent], rewards: Mapping[str, float],
                      metrics: Metrics | None = None, branches: Branches = "all") -> list[Trajectory]:
    """One ``Trajectory`` per agent (in ``agents`` order) from the ``SessionTrace`` of an HTTP
    session whose calls named roles: each from the role's view (``SessionTrace.by_role``, built
    by ``session_trajectory``), with its agent's role and flag, its reward ``rewards[role]`` (0 if
    absent) and ``metrics`` on its last turn. A role that made no turn gets an empty trajectory."""
    out = []
    for agent in agents:
        view = trace.by_role.get(agent.role)
        made = view is not None and any(np.frombuffer(t.loss_mask_raw, dtype=np.uint8).any()
                                        for t in view.trajectories)
        trajectory = (session_trajectory(view, float(rewards.get(agent.role, 0.0)), metrics, branches) if made
                      else Trajectory(transitions=[]))
        out.append(msgspec.structs.replace(trajectory, role=agent.role, trainable=agent.trainable))
    return out
