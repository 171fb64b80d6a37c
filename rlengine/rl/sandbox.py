"""Agent episodes in sandbox processes, sampling through the engine's IPC server.

The training process runs the engine and its IPC server (``rlengine.serve``);
environments run as agents in other processes, which sample through the
server with ``rlengine.sandbox_client`` and send their reward there. The trainer
never re-tokenizes anything: it trains on the session's trace, the exact
tokens, logprobs and policy versions the server stored.

* ``SandboxPool`` (``rlengine.rl.sandbox_pool``) keeps the worker
  processes, confined, supervised and replaced when they die, and hands
  each episode to one of them as a job line.
* ``worker_main(play)`` and ``serve_job_lines`` (``rlengine.rl.sandbox_worker``)
  are the worker loops: many games in one worker process, concurrently; a
  job marked ``isolate`` in a process of its own.
* ``SessionEnv`` (an ``AgentEnv``) opens a session on the server for its
  episode, sends the worker the session's id and token with the task, then
  collects the session's trace and turns it into a ``Trajectory``
  (``session_trajectory``): one transition per sampled segment, whose
  observation is everything before it, the reward on the last one (a
  session that branched: ``rlengine.rl.agents`` says how, ``branches``).

A crashing game costs that game only. It takes its worker down with every
game in flight there; those games are suspects (``SandboxError.suspect``),
each played again from the start, in a fresh session and in a process of
its own (quarantine): the game that crashes crashes again, alone, and fails
as a ``crash``; the others finish. A game's result depends only on its
task and seed, never on the worker that played it nor on a replay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from rlengine.rl.config import check_integer
from rlengine.rl.sandbox_pool import SandboxError, SandboxPool, SandboxUnavailable
from rlengine.rl.sandbox_worker import die_with_parent, failure_kind, not_dumpable, serve_job_lines, worker_main
from rlengine.rl.types import AgentEnv, Observation, Trajectory, Transition
from rlengine.types import ModelInput, SampledSequence, SamplingParams

__all__ = ["Branches", "SandboxError", "SandboxPool", "SandboxUnavailable", "SessionEnv", "die_with_parent",
           "failure_kind", "job_sampling", "not_dumpable", "replay_suspects", "result_metrics", "serve_job_lines",
           "session_trajectory", "worker_main"]

Branches = Literal["all", "last"]
"""Which branches of a session an episode trains (``rlengine.rl.agents`` says how)."""

log = logging.getLogger("rlengine")

_T = TypeVar("_T")


async def replay_suspects(play: Callable[[dict[str, Any]], Awaitable[_T]], job: dict[str, Any],
                          max_reruns: int) -> tuple[_T, int]:
    """``play(job)``, played again from the start while it fails as a suspect (``SandboxError.suspect``:
    its worker died while it was in flight), at most ``max_reruns`` times, each replay in quarantine
    (``"isolate": true``: a process of its own), where a game that crashed crashes alone. Returns what
    the last play returned and the number of replays; any other failure, or a suspect past
    ``max_reruns``, is raised. ``play`` gets a fresh session each time: the partial one is its to drop."""
    reruns = 0
    while True:
        try:
            return await play(job), reruns
        except SandboxError as exc:
            if not exc.suspect or reruns >= max_reruns:
                raise
            reruns += 1
            job = job | {"isolate": True}
            log.info("rlengine.rl: an episode lost its sandbox (%s); playing it again in quarantine "
                     "(re-run %d of at most %d)", exc, reruns, max_reruns)


def _runs(mask: np.ndarray, start: int) -> list[tuple[int, int]]:
    """The runs of sampled tokens (``mask`` 1) at or after ``start``, as (begin, end)."""
    sampled = mask.astype(bool)
    sampled[:start] = False
    edges = np.flatnonzero(np.diff(np.concatenate(([False], sampled, [False])).astype(np.int8)))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def session_trajectory(trace: Any, reward: float, metrics: dict[str, float] | None = None,
                       branches: Branches = "all") -> Trajectory:
    """A ``Trajectory`` from a ``SessionTrace``: a transition per run of sampled tokens (its
    observation: every token before it on its branch), the branches as the module docstring
    says, ``reward`` and ``metrics`` on the last transition. Each action's stop reason is the
    engine's for the completion that ends where the run ends (``SessionTrace.stops``); a run
    that ends where no completion did (the client resent a history cut inside one) was not
    cut by the token limit, and says ``stop``. Its logprobs' transform is likewise the
    completion's (``SessionTrace.transforms``), so processed logprobs train under it."""
    paths = trace.trajectories
    if not paths:
        raise SandboxError(f"session {trace.session_id}: the agent made no turn")
    latest = trace.latest if trace.latest is not None else len(paths) - 1
    chosen = [(latest, 0)] if branches == "last" else [(i, p.shared_prefix) for i, p in enumerate(paths)]
    stops: list[dict[int, str]] = trace.stops
    transforms: list[dict[int, Any]] = trace.transforms
    transitions: list[Transition] = []
    for index, start in chosen:
        path = paths[index]
        ends = stops[index] if index < len(stops) else {}
        processed = transforms[index] if index < len(transforms) else {}
        tokens, logprobs, versions = path.tokens, path.logprobs, path.versions
        for a, b in _runs(path.loss_mask, start):
            action = SampledSequence(stop_reason=ends.get(b, "stop"),
                                     tokens_raw=tokens[a:b].astype(np.int32).tobytes(),
                                     logprobs_raw=logprobs[a:b].astype(np.float32).tobytes(),
                                     versions_raw=versions[a:b].astype(np.int32).tobytes(),
                                     logprobs_transform=processed.get(b))
            transitions.append(Transition(observation=Observation(prompt=ModelInput.from_ints(tokens[:a])),
                                          action=action, reward=0.0, done=False))
    if not transitions:
        raise SandboxError(f"session {trace.session_id}: the trace holds no sampled tokens")
    transitions[-1] = msgspec.structs.replace(transitions[-1], reward=reward, done=True, metrics=dict(metrics or {}))
    return Trajectory(transitions=transitions)


def job_sampling(params: SamplingParams) -> dict[str, Any]:
    """How a job line tells the agent to sample (``job["sampling"]``)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_tokens": params.max_tokens}


def result_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among an answer's ``metrics`` (what goes into the logs as ``env/<name>``)."""
    got = result.get("metrics")
    if not isinstance(got, dict):
        return {}
    return {str(k): float(v) for k, v in got.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class SessionEnv(AgentEnv):
    """One episode in a sandbox worker, traced through an engine session; see the module docstring.

    ``sessions`` is the server's ``SessionManager`` (``Server.sessions``); the
    worker gets the job ``{"task": task, ...}`` with the session's credentials
    and must send its reward through the session. ``result`` metrics the
    worker returns (numbers) go into the logs under ``env/<name>``. A session
    that branched trains as ``branches`` says (``session_trajectory``).

    An episode that failed as a suspect (``SandboxError.suspect``: its worker
    died while it was in flight) is played again from the start in a fresh
    session, in quarantine (``"isolate": true``: a process of its own), up to
    ``max_reruns`` times (a replay whose worker died again is still a
    suspect); the partial session is dropped. A game that crashes in
    quarantine fails as a ``crash`` at once. The game's seed and task are the
    same, so a reproducible run's result does not change; the trajectory's
    metadata counts the ``reruns``.
    """

    def __init__(self, pool: SandboxPool, sessions: Any, task: Any, metadata: dict[str, Any] | None = None,
                 branches: Branches = "all", max_reruns: int = 2) -> None:
        if branches not in ("all", "last"):
            raise ValueError(f"branches={branches!r}: must be 'all' or 'last'")
        check_integer("max_reruns", max_reruns, minimum=0)
        self.branches = branches
        self.max_reruns = max_reruns
        self.pool = pool
        self.sessions = sessions
        self.task = task
        self._metadata = dict(metadata or {})

    def metadata(self) -> dict[str, Any]:
        return self._metadata

    async def run(self, params: SamplingParams, seed: int, max_turns: int) -> Trajectory:
        job: dict[str, Any] = {"task": self.task, "seed": seed, "max_turns": max_turns,
                               "sampling": job_sampling(params)}
        (sid, result), reruns = await replay_suspects(self._play, job, self.max_reruns)
        trace = self.sessions.collect(sid)
        reward = None if trace.latest is None else trace.rewards[trace.latest]
        if reward is None:
            raise SandboxError(f"session {sid}: the agent sent no reward for its last turn")
        trajectory = session_trajectory(trace, reward, result_metrics(result), self.branches)
        metadata: dict[str, Any] = {"session": sid, "branches": len(trace.trajectories)}
        if reruns:
            metadata["reruns"] = reruns
        return msgspec.structs.replace(trajectory, metadata=metadata)

    async def _play(self, job: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """One play of the episode in a fresh session: (the session's id, the worker's result)."""
        session = self.sessions.open()
        sid = session.session_id
        try:
            return sid, await self.pool.run(job | {"session": sid, "token": session.token})
        except BaseException:
            self.sessions.collect(sid)  # the partial game is dropped
            raise
