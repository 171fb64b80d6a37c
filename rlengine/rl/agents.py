"""Agent programs as environments: any agent that speaks OpenAI (or Anthropic) over HTTP, in a sandbox.

An episode of an ``HttpAgentEnv`` is an agent, written with any framework,
that only knows a base URL and an API key. The trainer:

1. opens a session on the engine's server; the session's own base URL is
   ``<server>/sessions/<id>/v1`` and its token is the API key there (every
   request on it is traced, whatever client sends it);
2. hands both to the agent in a sandbox process, with the task, the
   sampling settings, the seed and the deadline (a job for a worker of a
   ``SandboxPool``, see below);
3. retires the session at the rollout deadline ``deadline_s``: a turn still
   in flight is aborted and the attempt fails as ``timeout``, later requests
   are refused (410); the agent then has ``scoring_s`` to answer (to run
   its own checks and return a reward). The pool's ``job_timeout_s`` bounds
   the sandbox's work on the episode and must exceed
   ``deadline_s + scoring_s`` (checked here);
4. takes the reward: ``reward_fn(trace, task, result)`` when one is given
   (a function over the final trace, sync or async), else the reward the
   agent posted to the session for its latest turn (``POST
   /v1/sessions/<id>/reward``), else the ``reward`` the agent returned. An
   episode with none of them fails (``other``);
5. trains on the session's exact trace (``session_trajectory``): the tokens,
   logprobs and policy versions the engine sampled, never re-tokenized text.

An episode whose worker died with it (a suspect: another episode of that
worker may have crashed it) is played again from the start in a fresh
session, in quarantine (a process of its own), up to ``max_reruns`` times,
as ``SessionEnv`` does: the episode that crashed crashes again, alone.
Failures are sorted for the counts (``AttemptFailure.kind``): a sandbox that
died is ``crash``, a deadline ``timeout``, an agent whose HTTP connection or
request failed (the worker names the exception) ``http``; a trace the
client may have seen more of than it holds (``tainted``) is ``http`` too. A
malformed tool call is not a failure: the server hands it back as text and
the agent's reward says what it was worth.

Agents come in two shapes:

* **A Python agent in a long-lived worker**: ``python -m your.module``,
  whose main is ``agent_main(play)``; every job line is one episode, run
  concurrently: ``await play(job)`` with ``job["base_url"]``,
  ``job["api_key"]``, ``job["model"]``, ``job["anthropic_base_url"]``,
  ``job["reward_url"]`` (where to post a reward), ``job["task"]``,
  ``job["sampling"]``, ``job["seed"]``, ``job["max_turns"]`` and
  ``job["deadline_s"]``; it returns ``{"reward": ..., "metrics": {...}}``
  (both optional). One interpreter serves many episodes: what a fast RL
  recipe needs.
* **Any program, one process per episode** (``AgentProgram``): the pool's
  workers (``rlengine.rl.agent_program``) start the program for every job,
  with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` /
  ``ANTHROPIC_API_KEY`` (which the official SDKs read by themselves) and
  ``RLENGINE_*`` variables (see that module); its arguments may name
  ``{base_url}``, ``{session_id}``, ``{seed}``, ``{max_turns}`` and
  ``{task}``. The key is never put in arguments: every local user can read
  a process's command line, while its environment is its own uid's (and the
  sandboxes run under uids of their own, see ``rlengine.rl.sandbox``).

Branches: an agent that edits its history (drops or rewrites earlier
messages) makes its session a tree, with one trajectory per branch.
``branches="all"`` (the default) trains every branch: each sampled token
once, in the first branch that holds it (the tokens a branch shares with an
earlier one are its prompt, not trained again), and every branch with the
episode's advantage, weight 1 per token, like the turns of one branch.
``branches="last"`` trains only the branch that ends at the session's latest
turn (what the agent finished on) and drops the others' tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlengine.errors import ConfigurationError
from rlengine.rl.config import check_integer, check_number
from rlengine.rl.sandbox import (
    Branches,
    SandboxError,
    SandboxPool,
    job_sampling,
    not_dumpable,
    replay_suspects,
    result_metrics,
    serve_job_lines,
    session_trajectory,
)
from rlengine.rl.types import AgentEnv, Trajectory
from rlengine.types import SamplingParams

__all__ = ["AgentProgram", "Branches", "HttpAgentEnv", "agent_main", "session_trajectory"]

RewardFn = Callable[[Any, Any, dict[str, Any]], "float | Awaitable[float]"]
"""``reward_fn(trace, task, result)``: the episode's reward from its final ``SessionTrace``,
its task and what the agent returned."""

class HttpAgentEnv(AgentEnv):
    """One episode of an HTTP agent in a sandbox; see the module docstring.

    ``server`` is the running ``rlengine.serve.Server`` (its HTTP endpoint
    on); ``pool`` a started ``SandboxPool`` of agent workers; ``task`` any
    JSON value the agent gets as ``job["task"]``. ``deadline_s`` None leaves
    a tenth of the pool's ``job_timeout_s`` beyond ``deadline_s + scoring_s``.
    """

    def __init__(self, pool: SandboxPool, server: Any, task: Any, *, metadata: dict[str, Any] | None = None,
                 reward_fn: RewardFn | None = None, branches: Branches = "all", deadline_s: float | None = None,
                 scoring_s: float = 0.0, max_reruns: int = 2) -> None:
        if branches not in ("all", "last"):
            raise ConfigurationError(f"branches={branches!r}: must be 'all' or 'last'")
        check_number("scoring_s", scoring_s, minimum=0.0)
        check_integer("max_reruns", max_reruns, minimum=0)
        self.max_reruns = max_reruns
        """Replays of an episode whose worker died with it (each in quarantine), at most."""
        self.scoring_s = float(scoring_s)
        if deadline_s is None:  # what the sandbox's bound leaves, with a margin of a tenth of it
            deadline_s = 0.9 * pool.job_timeout_s - self.scoring_s
        check_number("deadline_s", deadline_s, minimum=0.0)
        self.deadline_s = float(deadline_s)
        if not pool.job_timeout_s > self.deadline_s + self.scoring_s:
            raise ConfigurationError(f"job_timeout_s={pool.job_timeout_s!r}: a sandbox's bound on an episode must "
                                     f"exceed deadline_s + scoring_s = {self.deadline_s + self.scoring_s}")
        if server.http_url is None:
            raise ConfigurationError("the server has no HTTP endpoint (ServeConfig(http=True))")
        self.pool = pool
        self.server = server
        self.task = task
        self.reward_fn = reward_fn
        self.branches = branches
        self._metadata = dict(metadata or {})
        self.result: dict[str, Any] | None = None
        """What the agent returned for the episode, once it has (for debugging and tests)."""

    def metadata(self) -> dict[str, Any]:
        return self._metadata

    async def run(self, params: SamplingParams, seed: int, max_turns: int) -> Trajectory:
        job = {"task": self.task, "seed": seed, "max_turns": max_turns, "deadline_s": self.deadline_s,
               "scoring_s": self.scoring_s, "sampling": job_sampling(params)}
        # An episode whose worker died with it (a suspect) is played again, in quarantine.
        (result, trace, sid), reruns = await replay_suspects(self._episode, job, self.max_reruns)
        self.result = result
        reward = await self._reward(trace, result)
        trajectory = session_trajectory(trace, reward, result_metrics(result), self.branches)
        metadata: dict[str, Any] = {"session": sid, "branches": len(trace.trajectories)}
        if reruns:
            metadata["reruns"] = reruns
        return msgspec.structs.replace(trajectory, metadata=metadata)

    async def _episode(self, job: dict[str, Any]) -> tuple[dict[str, Any], Any, str]:
        """One play of the episode in a session of its own: (the agent's result, the trace, the id)."""
        sessions = self.server.sessions
        session = sessions.open()
        sid = session.session_id
        root = self.server.http_url.removesuffix("/v1")
        cut: list[bool] = []

        def deadline() -> None:
            cut.append(bool(session.in_flight))
            sessions.retire(sid)

        timer = asyncio.get_running_loop().call_later(self.deadline_s, deadline)
        try:
            result = await self.pool.run({
                **job, "session": sid, "base_url": f"{root}/sessions/{sid}/v1",
                "anthropic_base_url": f"{root}/sessions/{sid}", "reward_url": f"{root}/sessions/{sid}/v1/reward",
                "api_key": session.token, "model": self.server.model_name})
        except SandboxError as exc:
            if cut and exc.kind != "crash":  # the agent failed once its deadline cut it off
                raise SandboxError(f"deadline_s={self.deadline_s} passed: {exc}", "timeout") from None
            raise
        finally:
            timer.cancel()
            trace = sessions.collect(sid)
        if cut and cut[0]:
            raise SandboxError(f"deadline_s={self.deadline_s}: a turn was still being sampled", "timeout")
        if trace.tainted:
            raise SandboxError(f"session {sid}: a client went away mid-turn, after it may have read tokens the "
                               "trace lacks", "http")
        return result, trace, sid

    async def _reward(self, trace: Any, result: dict[str, Any]) -> float:
        if self.reward_fn is not None:
            value = self.reward_fn(trace, self.task, result)
            if inspect.isawaitable(value):
                value = await value
            return value  # type: ignore[no-any-return]  # checked by the rollout
        if trace.latest is not None and trace.rewards[trace.latest] is not None:
            return trace.rewards[trace.latest]  # type: ignore[no-any-return]
        if "reward" in result:
            return result["reward"]  # type: ignore[no-any-return]
        raise SandboxError(f"session {trace.session_id}: no reward (none returned by the agent, none posted to "
                           "the session, no reward_fn)")


class AgentProgram:
    """A program run once per episode (any language): ``SandboxPool`` arguments for it.

    ``argv`` is the command line; ``{base_url}``, ``{session_id}``,
    ``{seed}``, ``{max_turns}`` and ``{task}`` (JSON) in its items are
    replaced per episode (``{api_key}`` is refused: see the module
    docstring). ``env`` adds variables. Its stdout's last line, when it is a
    JSON object, is its result (``reward``, ``metrics``); an exit code other
    than 0 fails the episode with the end of its stderr.
    """

    MODULE = "rlengine.rl.agent_program"

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigurationError(f"argv={argv!r}: must be a non-empty list of strings")
        for a in argv:
            if "{api_key}" in a:
                raise ConfigurationError(f"argv item {a!r}: the API key is never put in arguments (every local "
                                         "user can read a command line); the program finds it in OPENAI_API_KEY")
            try:
                a.format(base_url="", session_id="", seed=0, max_turns=0, task="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigurationError(f"argv item {a!r}: {type(exc).__name__}: {exc} (known placeholders: "
                                         "{base_url} {session_id} {seed} {max_turns} {task}; {{ }} for braces)") \
                    from None
        self.argv = list(argv)
        self.env = dict(env or {})

    def pool(self, size: int, *, job_timeout_s: float, **kwargs: Any) -> SandboxPool:
        """A pool of ``size`` workers that run this program per episode (start it with ``start(None)``);
        the directories of the files its arguments name are readable to them."""
        spec = json.dumps({"argv": self.argv, "env": self.env})
        files = tuple(os.path.dirname(os.path.abspath(a)) for a in self.argv if os.path.isfile(a))
        return SandboxPool(self.MODULE, size, args=(spec,), job_timeout_s=job_timeout_s,
                           readable=(*files, *kwargs.pop("readable", ())), **kwargs)


def agent_main(play: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """The worker loop of a Python HTTP agent (``python -m your.module`` in a ``SandboxPool``
    started with ``start(None)``): ``await play(job)`` per job line, concurrently, each bounded
    by its ``deadline_s + scoring_s``; it makes itself non-dumpable before it reads a job."""
    not_dumpable()
    asyncio.run(serve_job_lines(play))
