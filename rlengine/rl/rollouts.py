"""Rollouts through the engine: one episode (single- or multi-turn), one group of them.

``run_episode`` drives one ``Env``: observation -> ``SamplingClient.sample``
-> ``env.step`` -> ... until the environment says done. Every sample is an
engine request with its own future, so the attempts of a group and the
groups of a batch proceed independently (no waves); the sampled tokens,
logprobs and per-token policy versions are kept exactly as the engine
returned them.

A group of plain ``Env`` episodes whose first observations are all equal (a
GRPO group: one prompt, ``group_size`` answers) samples its first turn as one
engine call of ``group_size`` samples, and steps its environments one after
the other; only episodes that go on past their first turn get a task of
their own. That spares the loop a request, a future and a task per attempt
(RL recipes with short answers spend most of their loop time there); the
samples are seeded from the group's seed (``mix_seed(seed, FIRST_TURN)``,
sample ``i`` deriving its own), so the path taken is a function of the
recipe, never of timing.

Failures are contained where they belong:

* an exception from the environment (``initial_observation``, ``step``), a
  rejected request (``RequestError``: e.g. a prompt longer than the context),
  too many turns or a timed-out episode fails that one attempt: the
  trajectory carries an ``AttemptFailure`` and its siblings go on;
* an engine that died (``EngineDeadError``), a sandbox pool that gave up
  restarting its workers (``SandboxUnavailable``), a failing
  ``EnvGroupBuilder`` and cancellation propagate: they are the rollout
  worker's failure.

Cancelling a rollout aborts its in-flight engine request, so shutdown never
waits for a generation nobody will read. Seeds are derived from the group's
index and attempt, never drawn from shared state, so a resumed run samples
what the uninterrupted one would have.

A ``MultiAgentEnv`` episode runs as a task of its own, bounded like any
episode; it gives one trajectory per agent (``rlengine.rl.multi_agent``),
and its failure fails every agent's trajectory, so that each role's
attempts stay aligned across the group.

This module must not train, filter or compute advantages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from rlengine.core.clients import SamplingClient
from rlengine.errors import EngineDeadError, RequestError
from rlengine.rl.errors import InvalidReward
from rlengine.rl.sandbox import SandboxUnavailable
from rlengine.rl.types import (
    FAILURE_KINDS,
    AgentEnv,
    AttemptFailure,
    Env,
    EnvGroupBuilder,
    MultiAgentEnv,
    Observation,
    StepResult,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from rlengine.seeding import mix_seed
from rlengine.timeline import current as current_timeline
from rlengine.types import SampledSequence, SamplingParams

__all__ = ["rollout_group", "run_episode", "turn_params"]

log = logging.getLogger("rlengine")

FIRST_TURN = 0x46495253
"""Mixed into a group's seed for its shared first turn (``rollout_group``), apart from the
per-attempt seeds ``mix_seed(seed, i)``."""

def _failure(stage: str, exc: BaseException, turn: int) -> AttemptFailure:
    # A sandbox's failure says what it was (``SandboxError.kind``); an engine that refused a
    # request failed the way an HTTP error does; anything else is the environment's own.
    kind = getattr(exc, "kind", None)
    if kind not in FAILURE_KINDS:
        kind = "http" if isinstance(exc, RequestError) else "timeout" if isinstance(exc, TimeoutError) else "other"
    return AttemptFailure(stage=stage, error=type(exc).__name__, message=str(exc)[:500], turn=turn, kind=kind)


def _environment_done(name: str, started: float, **args: Any) -> None:
    """An environment's call (``name``, since ``started``) into the run's timeline, if it records."""
    timeline = current_timeline()
    if timeline is not None:
        timeline.environment(name, started, time.monotonic(), args)


def _check_reward(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidReward(where, value)
    return float(value)


async def _sample(client: SamplingClient, observation: Observation, params: SamplingParams) -> SampledSequence:
    future = client.sample(observation.prompt, 1, params)
    try:
        response = await future
    except asyncio.CancelledError:
        # Nobody will read this generation: free the sampler for the others.
        future.abort()
        raise
    return response.sequences[0]


def turn_params(base: SamplingParams, observation: Observation, seed: int) -> SamplingParams:
    """``base`` for one turn: its seed, and the observation's ``max_tokens`` and extra stops."""
    changes: dict[str, object] = {"seed": seed}
    if observation.max_tokens is not None:
        changes["max_tokens"] = observation.max_tokens
    if observation.stop:
        own = list(base.stop) if isinstance(base.stop, list) else ([base.stop] if base.stop else [])
        changes["stop"] = own + list(observation.stop)
    return msgspec.structs.replace(base, **changes)


async def _agent_episode(env: AgentEnv, params: SamplingParams, seed: int, max_turns: int,
                         metadata: dict[str, Any]) -> Trajectory:
    """One episode an ``AgentEnv`` drives; its failure (a crashed sandbox) fails the attempt, a
    sandbox pool that gave up (``SandboxUnavailable``) the run."""
    started = time.monotonic()
    try:
        try:
            trajectory = await env.run(params, seed, max_turns)
        finally:
            _environment_done("agent episode", started, env=type(env).__name__)
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"{type(env).__name__}.run returned {type(trajectory).__name__}, not a Trajectory")
        for turn, t in enumerate(trajectory.transitions):
            _check_reward(f"turn {turn} reward", t.reward)
    except (EngineDeadError, SandboxUnavailable, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's failure, contained
        return Trajectory(transitions=[], failure=_failure("agent", exc, -1), metadata=metadata)
    return msgspec.structs.replace(trajectory, metadata={**metadata, **trajectory.metadata})


async def run_episode(env: Env | AgentEnv, client: SamplingClient, params: SamplingParams, seed: int, *,
                      max_turns: int) -> Trajectory:
    """One episode of ``env``; an environment or request failure ends it as a failed attempt."""
    try:
        metadata = env.metadata()
    except Exception as exc:  # noqa: BLE001 - a broken environment fails its attempt only
        return Trajectory(transitions=[], failure=_failure("metadata", exc, 0))
    try:
        if isinstance(env, AgentEnv):
            return await _agent_episode(env, params, seed, max_turns, metadata)
        return await _turns(env, client, params, seed, max_turns, metadata)
    finally:
        try:
            await env.close()
        except Exception:
            log.warning("rlengine.rl: %s.close() failed", type(env).__name__, exc_info=True)


async def _first_observation(env: Env, metadata: dict[str, Any]) -> Observation | Trajectory:
    """The episode's first observation, or its failed trajectory."""
    started = time.monotonic()
    try:
        return await env.initial_observation()
    except (EngineDeadError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's failure, contained
        return Trajectory(transitions=[], failure=_failure("initial_observation", exc, 0), metadata=metadata)
    finally:
        _environment_done("initial observation", started, env=type(env).__name__)


class _Episode:
    """One ``Env`` episode under way: its turns so far, the next observation and, when the group
    sampled it, the action for it."""

    def __init__(self, env: Env, client: SamplingClient, params: SamplingParams, seed: int, max_turns: int,
                 metadata: dict[str, Any], observation: Observation, action: SampledSequence | None = None) -> None:
        self.env = env
        self.client = client
        self.params = params
        self.seed = seed
        self.max_turns = max_turns
        self.metadata = metadata
        self.observation = observation
        self.action = action
        self.transitions: list[Transition] = []

    def end(self, failure: AttemptFailure | None = None) -> Trajectory:
        return Trajectory(transitions=self.transitions, metadata=self.metadata, failure=failure)

    async def turn(self) -> Trajectory | None:
        """Sample (unless the action is given) and step one turn; the trajectory once it ended."""
        turn, observation, action = len(self.transitions), self.observation, self.action
        if action is None:
            params = turn_params(self.params, observation, mix_seed(self.seed, turn))
            try:
                action = await _sample(self.client, observation, params)
            except RequestError as exc:
                return self.end(_failure("sample", exc, turn))
        if action.stop_reason == "abort":
            # The engine is shutting down; the loop is stopping this rollout anyway.
            raise asyncio.CancelledError(f"turn {turn}: the engine aborted the sample")
        started = time.monotonic()
        try:
            try:
                result = await self.env.step(action.tokens)
            finally:
                _environment_done("env step", started, env=type(self.env).__name__, turn=turn)
            if not isinstance(result, StepResult):
                raise TypeError(f"Env.step returned {type(result).__name__}, not a StepResult")
            reward = _check_reward(f"turn {turn} reward", result.reward)
            if not result.done and result.next_observation is None:
                raise ValueError(f"turn {turn}: StepResult(done=False) needs a next_observation")
        except (EngineDeadError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's failure, contained
            return self.end(_failure("step", exc, turn))
        self.transitions.append(Transition(observation=observation, action=action, reward=reward,
                                           done=result.done, metrics=dict(result.metrics)))
        if result.done:
            return self.end()
        if turn + 1 >= self.max_turns:
            return self.end(AttemptFailure(stage="max_turns", error="MaxTurns",
                                            message=f"not done after max_turns={self.max_turns}", turn=turn + 1))
        assert result.next_observation is not None
        self.observation, self.action = result.next_observation, None
        return None

    async def finish(self) -> Trajectory:
        while True:
            trajectory = await self.turn()
            if trajectory is not None:
                return trajectory


async def _turns(env: Env, client: SamplingClient, params: SamplingParams, seed: int, max_turns: int,
                 metadata: dict[str, Any]) -> Trajectory:
    """The observe -> sample -> step loop of one ``Env`` episode."""
    first = await _first_observation(env, metadata)
    if isinstance(first, Trajectory):
        return first
    return await _Episode(env, client, params, seed, max_turns, metadata, first).finish()


async def _bounded_episode(env: Env | AgentEnv, client: SamplingClient, params: SamplingParams, seed: int,
                           max_turns: int, timeout_s: float) -> Trajectory:
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            return await run_episode(env, client, params, seed, max_turns=max_turns)
    except TimeoutError as exc:
        return Trajectory(transitions=[], failure=AttemptFailure(
            stage="timeout", error=type(exc).__name__,
            message=f"episode_timeout_s={timeout_s}: not done after {time.monotonic() - started:.1f} s", turn=-1,
            kind="timeout"))


async def _agents_episode(env: MultiAgentEnv, client: SamplingClient, params: SamplingParams, seed: int,
                          max_turns: int, timeout_s: float) -> list[Trajectory]:
    """One bounded ``MultiAgentEnv`` episode: a trajectory per agent; the episode's failure (the
    environment's error, its deadline) fails each agent's, with the agent's role and flag."""
    roles: list[tuple[str | None, bool]] = [(None, True)]
    metadata: dict[str, Any] = {}
    try:
        agents = env.agents()
        roles = [(a.role, a.trainable) for a in agents]
        metadata = env.metadata()
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                trajectories = await env.run(client, params, seed, max_turns)
        finally:
            _environment_done("multi-agent episode", started, env=type(env).__name__)
        if [(t.role, t.trainable) for t in trajectories] != roles:
            raise ValueError(f"{type(env).__name__}.run returned the roles {[t.role for t in trajectories]}, not "
                             f"one trajectory per agent of {[r for r, _ in roles]} (with their trainable flags)")
        for t in trajectories:
            for turn, transition in enumerate(t.transitions):
                _check_reward(f"role {t.role!r} turn {turn} reward", transition.reward)
    except (EngineDeadError, SandboxUnavailable, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's failure (or its deadline), contained
        failure = _failure("agent", exc, -1)
        return [Trajectory(transitions=[], failure=failure, metadata=metadata, role=role, trainable=trainable)
                for role, trainable in roles]
    finally:
        try:
            await env.close()
        except Exception:
            log.warning("rlengine.rl: %s.close() failed", type(env).__name__, exc_info=True)
    return [msgspec.structs.replace(t, metadata={**metadata, **t.metadata}) for t in trajectories]


def _timed_out(timeout_s: float, started: float) -> Trajectory:
    return Trajectory(transitions=[], failure=AttemptFailure(
        stage="timeout", error="TimeoutError",
        message=f"episode_timeout_s={timeout_s}: not done after {time.monotonic() - started:.1f} s", turn=-1,
        kind="timeout"))


async def _shared_first_turn(observation: Observation, n: int, client: SamplingClient, params: SamplingParams,
                             seed: int) -> list[SampledSequence] | RequestError:
    """The first turn of ``n`` attempts with one ``observation``, as one engine call."""
    future = client.sample(observation.prompt, n, turn_params(params, observation, mix_seed(seed, FIRST_TURN)))
    try:
        return list((await future).sequences)
    except asyncio.CancelledError:
        future.abort()  # nobody will read these generations
        raise
    except RequestError as exc:
        return exc


async def _plain_group(envs: Sequence[Env], client: SamplingClient, params: SamplingParams, seed: int,
                       max_turns: int, timeout_s: float) -> list[Trajectory]:
    """A group of plain ``Env`` episodes (module docstring): first observations and first steps
    env by env, the first turns of equal observations as one call, the episodes that go on as
    tasks. Each attempt fails on its own; every environment that started is closed once."""
    started = time.monotonic()
    deadline = asyncio.get_running_loop().time() + timeout_s
    out: list[Trajectory | None] = [None] * len(envs)
    opened: list[Env] = []
    episodes: dict[int, _Episode] = {}
    try:
        try:
            async with asyncio.timeout_at(deadline):
                for i, env in enumerate(envs):
                    try:
                        metadata = env.metadata()
                    except Exception as exc:  # noqa: BLE001 - a broken environment fails its attempt only
                        out[i] = Trajectory(transitions=[], failure=_failure("metadata", exc, 0))
                        continue
                    opened.append(env)
                    first = await _first_observation(env, metadata)
                    if isinstance(first, Trajectory):
                        out[i] = first
                    else:
                        episodes[i] = _Episode(env, client, params, mix_seed(seed, i), max_turns, metadata, first)
                observations = [e.observation for e in episodes.values()]
                if len(observations) > 1 and all(o == observations[0] for o in observations[1:]):
                    shared = await _shared_first_turn(observations[0], len(observations), client, params, seed)
                    for k, (i, episode) in enumerate(list(episodes.items())):
                        if isinstance(shared, RequestError):
                            out[i] = episode.end(_failure("sample", shared, 0))
                            del episodes[i]
                        else:
                            episode.action = shared[k]
                for i, episode in list(episodes.items()):
                    trajectory = await episode.turn()
                    if trajectory is not None:
                        out[i] = trajectory
                        del episodes[i]
        except TimeoutError:
            for i in episodes:
                out[i] = _timed_out(timeout_s, started)
            episodes = {}
        if episodes:
            async with asyncio.TaskGroup() as tasks:
                going_on = {i: tasks.create_task(_bounded_finish(e, deadline, timeout_s, started))
                            for i, e in episodes.items()}
            for i, task in going_on.items():
                out[i] = task.result()
    finally:
        for env in opened:
            try:
                await env.close()
            except Exception:
                log.warning("rlengine.rl: %s.close() failed", type(env).__name__, exc_info=True)
    return [t if t is not None else _timed_out(timeout_s, started) for t in out]


async def _bounded_finish(episode: _Episode, deadline: float, timeout_s: float, started: float) -> Trajectory:
    try:
        async with asyncio.timeout_at(deadline):
            return await episode.finish()
    except TimeoutError:
        return _timed_out(timeout_s, started)


async def rollout_group(builder: EnvGroupBuilder, client: SamplingClient, params: SamplingParams, seed: int, *,
                        max_turns: int, episode_timeout_s: float) -> TrajectoryGroup:
    """Every attempt of one group; attempt ``i`` is seeded ``mix_seed(seed, i)`` (a group of plain
    envs with equal first observations shares its first turn: see the module docstring).

    A failing builder, a dead engine or cancellation cancels the sibling
    episodes and propagates.
    """
    envs: Sequence[Env | AgentEnv] = await builder.make_envs()
    if not envs:
        raise ValueError(f"{type(builder).__name__}.make_envs returned no environments")
    if len(envs) > 1 and all(isinstance(env, Env) for env in envs):
        trajectories = await _plain_group(envs, client, params, seed, max_turns, episode_timeout_s)  # type: ignore[arg-type]
    else:
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(_agents_episode(env, client, params, mix_seed(seed, i), max_turns,
                                                         episode_timeout_s) if isinstance(env, MultiAgentEnv)
                                         else _bounded_episode(env, client, params, mix_seed(seed, i), max_turns,
                                                               episode_timeout_s)) for i, env in enumerate(envs)]
        # A multi-agent episode gives a trajectory per agent: the group holds them all, episode by episode.
        results = [task.result() for task in running]
        trajectories = [t for r in results for t in (r if isinstance(r, list) else [r])]
    started = time.monotonic()
    try:
        group_rewards = await builder.compute_group_rewards(trajectories)
    finally:
        _environment_done("group rewards", started, builder=type(builder).__name__)
    if len(group_rewards) != len(trajectories):
        raise ValueError(f"{type(builder).__name__}.compute_group_rewards returned {len(group_rewards)} rewards "
                         f"for {len(trajectories)} trajectories")
    rewards = [_check_reward(f"group reward [{i}]", r) for i, r in enumerate(group_rewards)]
    return TrajectoryGroup(trajectories=trajectories, group_rewards=rewards, tags=list(builder.logging_tags()),
                           metadata=dict(builder.metadata()))
