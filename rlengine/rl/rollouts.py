"""Rollouts through the engine: one episode (single- or multi-turn), one group of them.

``run_episode`` drives one ``Env``: observation -> ``SamplingClient.sample``
-> ``env.step`` -> ... until the environment says done. Every sample is a
separate engine request with its own future, so the attempts of a group and
the groups of a batch proceed independently (no waves); the sampled tokens,
logprobs and per-token policy versions are kept exactly as the engine
returned them.

Failures are contained where they belong:

* an exception from the environment (``initial_observation``, ``step``), a
  rejected request (``RequestError``: e.g. a prompt longer than the context),
  too many turns or a timed-out episode fails that one attempt: the
  trajectory carries an ``AttemptFailure`` and its siblings go on;
* an engine that died (``EngineDeadError``), a failing ``EnvGroupBuilder``
  and cancellation propagate: they are the rollout worker's failure.

Cancelling a rollout aborts its in-flight engine request, so shutdown never
waits for a generation nobody will read. Seeds are derived from the group's
index and attempt, never drawn from shared state, so a resumed run samples
what the uninterrupted one would have.

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
from rlengine.rl.types import (
    FAILURE_KINDS,
    AgentEnv,
    AttemptFailure,
    Env,
    EnvGroupBuilder,
    Observation,
    StepResult,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from rlengine.seeding import mix_seed
from rlengine.types import SampledSequence, SamplingParams

__all__ = ["rollout_group", "run_episode"]

log = logging.getLogger("rlengine")

def _failure(stage: str, exc: BaseException, turn: int) -> AttemptFailure:
    # A sandbox's failure says what it was (``SandboxError.kind``); an engine that refused a
    # request failed the way an HTTP error does; anything else is the environment's own.
    kind = getattr(exc, "kind", None)
    if kind not in FAILURE_KINDS:
        kind = "http" if isinstance(exc, RequestError) else "timeout" if isinstance(exc, TimeoutError) else "other"
    return AttemptFailure(stage=stage, error=type(exc).__name__, message=str(exc)[:500], turn=turn, kind=kind)


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


def _turn_params(base: SamplingParams, observation: Observation, seed: int) -> SamplingParams:
    changes: dict[str, object] = {"seed": seed}
    if observation.max_tokens is not None:
        changes["max_tokens"] = observation.max_tokens
    if observation.stop:
        own = list(base.stop) if isinstance(base.stop, list) else ([base.stop] if base.stop else [])
        changes["stop"] = own + list(observation.stop)
    return msgspec.structs.replace(base, **changes)


async def _agent_episode(env: AgentEnv, params: SamplingParams, seed: int, max_turns: int,
                         metadata: dict[str, Any]) -> Trajectory:
    """One episode an ``AgentEnv`` drives; its failure (a crashed sandbox) fails the attempt."""
    try:
        trajectory = await env.run(params, seed, max_turns)
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"{type(env).__name__}.run returned {type(trajectory).__name__}, not a Trajectory")
        for turn, t in enumerate(trajectory.transitions):
            _check_reward(f"turn {turn} reward", t.reward)
    except (EngineDeadError, asyncio.CancelledError):
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


async def _turns(env: Env, client: SamplingClient, params: SamplingParams, seed: int, max_turns: int,
                 metadata: dict[str, Any]) -> Trajectory:
    """The observe -> sample -> step loop of one ``Env`` episode."""
    transitions: list[Transition] = []
    turn = 0
    try:
        observation = await env.initial_observation()
    except (EngineDeadError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's failure, contained
        return Trajectory(transitions=[], failure=_failure("initial_observation", exc, 0), metadata=metadata)
    while True:
        try:
            action = await _sample(client, observation, _turn_params(params, observation, mix_seed(seed, turn)))
        except RequestError as exc:
            return Trajectory(transitions=transitions, failure=_failure("sample", exc, turn), metadata=metadata)
        if action.stop_reason == "abort":
            # The engine is shutting down; the loop is stopping this rollout anyway.
            raise asyncio.CancelledError(f"turn {turn}: the engine aborted the sample")
        try:
            result = await env.step(action.tokens)
            if not isinstance(result, StepResult):
                raise TypeError(f"Env.step returned {type(result).__name__}, not a StepResult")
            reward = _check_reward(f"turn {turn} reward", result.reward)
            if not result.done and result.next_observation is None:
                raise ValueError(f"turn {turn}: StepResult(done=False) needs a next_observation")
        except (EngineDeadError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's failure, contained
            return Trajectory(transitions=transitions, failure=_failure("step", exc, turn), metadata=metadata)
        transitions.append(Transition(observation=observation, action=action, reward=reward,
                                      done=result.done, metrics=dict(result.metrics)))
        turn += 1
        if result.done:
            return Trajectory(transitions=transitions, metadata=metadata)
        if turn >= max_turns:
            return Trajectory(transitions=transitions, metadata=metadata, failure=AttemptFailure(
                stage="max_turns", error="MaxTurns", message=f"not done after max_turns={max_turns}",
                turn=turn))
        assert result.next_observation is not None
        observation = result.next_observation


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


async def rollout_group(builder: EnvGroupBuilder, client: SamplingClient, params: SamplingParams, seed: int, *,
                        max_turns: int, episode_timeout_s: float) -> TrajectoryGroup:
    """Every attempt of one group, concurrently; attempt ``i`` is seeded ``mix_seed(seed, i)``.

    A failing builder, a dead engine or cancellation cancels the sibling
    episodes (a task group) and propagates.
    """
    envs: Sequence[Env | AgentEnv] = await builder.make_envs()
    if not envs:
        raise ValueError(f"{type(builder).__name__}.make_envs returned no environments")
    async with asyncio.TaskGroup() as tasks:
        running = [tasks.create_task(_bounded_episode(env, client, params, mix_seed(seed, i), max_turns,
                                                      episode_timeout_s)) for i, env in enumerate(envs)]
    trajectories = [t.result() for t in running]
    group_rewards = await builder.compute_group_rewards(trajectories)
    if len(group_rewards) != len(trajectories):
        raise ValueError(f"{type(builder).__name__}.compute_group_rewards returned {len(group_rewards)} rewards "
                         f"for {len(trajectories)} trajectories")
    rewards = [_check_reward(f"group reward [{i}]", r) for i, r in enumerate(group_rewards)]
    return TrajectoryGroup(trajectories=trajectories, group_rewards=rewards, tags=list(builder.logging_tags()),
                           metadata=dict(builder.metadata()))
