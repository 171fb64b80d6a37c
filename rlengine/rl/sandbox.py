"""Agent episodes in sandbox processes, sampling through the engine's IPC server.

The training process runs the engine and its IPC server (``rlengine.serve``);
environments run as agents in other processes, which sample through the
server with ``rlengine.sandbox_client`` and send their reward there. The trainer
never re-tokenizes anything: it trains on the session's trace, the exact
tokens, logprobs and policy versions the server stored.

* ``SandboxPool`` (trainer side) keeps ``size`` worker processes,
  ``python -m <module> <socket>``, and hands each episode to one of them as
  a JSON line on its stdin; the worker answers with a JSON line on stdout.
  A worker that dies fails its episodes in flight (``SandboxError`` of kind
  ``crash``) and no later episode is sent to it: the next ones go to its
  replacement, so a crash costs only the games that were running in it; every episode has a deadline; closing the pool
  ends the workers (stdin closed, then killed after a grace period).
* ``SessionEnv`` (an ``AgentEnv``) opens a session on the server for its
  episode, sends the worker the session's id and token with the task, then
  collects the session's trace and turns it into a ``Trajectory``
  (``trace_trajectory``): one transition per sampled segment, whose
  observation is everything before it, the reward on the last one.
* ``worker_main(play)`` (sandbox side) is the worker loop: it connects one
  ``AsyncClient`` to the socket and runs ``play(client, job)`` for every job
  line, concurrently, until stdin closes.

Job lines: ``{"id": n, "session": ..., "token": ..., "task": ..., "sampling":
{...}, "seed": ..., "max_turns": ...}``; answers: ``{"id": n, "ok": true,
"result": {...}}`` or ``{"id": n, "ok": false, "error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from rlengine.errors import RLEngineError
from rlengine.rl.types import AgentEnv, Observation, Trajectory, Transition
from rlengine.types import ModelInput, SampledSequence, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SandboxError", "SandboxPool", "SessionEnv", "trace_trajectory", "worker_main"]

log = logging.getLogger("rlengine")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class SandboxError(RLEngineError, RuntimeError):
    """A sandbox episode failed: the worker crashed, timed out, or reported an error (``kind``:
    ``crash``, ``timeout`` or ``error``)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


class _Worker:
    __slots__ = ("dead", "index", "pending", "proc", "reader")

    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.dead = False
        """Its output ended (it exited or was killed): set at once, before the exit is reaped,
        so that no episode is sent to it in between (they would all fail)."""

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.returncode is None and self.reader is not None and not self.reader.done()


class SandboxPool:
    """``size`` sandbox worker processes running ``python -m module SOCKET [args]``; see the module docstring."""

    def __init__(self, module: str, size: int, *, args: tuple[str, ...] = (), job_timeout_s: float = 120.0,
                 grace_s: float = 3.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size={size!r}: must be an integer >= 1")
        self.module = module
        self.size = size
        self.args = args
        self.job_timeout_s = job_timeout_s
        self.grace_s = grace_s
        self.socket_path: str | None = None
        self._workers: list[_Worker | None] = [None] * size
        self._spawning: dict[int, asyncio.Task[_Worker]] = {}
        self._next_job = 0
        self._closed = False
        self.spawned = 0
        """Processes started so far (more than ``size`` after replacing crashed ones)."""
        self.crashed = 0


    async def start(self, socket_path: str) -> SandboxPool:
        self.socket_path = socket_path
        for i in range(self.size):
            await self._spawn(i)
        return self

    async def _spawn(self, index: int) -> _Worker:
        assert self.socket_path is not None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, self.socket_path, *self.args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self.spawned += 1
        worker = _Worker(index, proc)
        worker.reader = asyncio.get_running_loop().create_task(self._read(worker),
                                                               name=f"rlengine-sandbox-{index}")
        self._workers[index] = worker
        return worker

    async def _replace(self, index: int) -> _Worker:
        """A new worker for slot ``index``; concurrent callers share one spawn."""
        spawning = self._spawning.get(index)
        if spawning is None:
            spawning = asyncio.get_running_loop().create_task(self._spawn(index), name=f"rlengine-sandbox-spawn-{index}")
            self._spawning[index] = spawning
            spawning.add_done_callback(lambda _t: self._spawning.pop(index, None))
        return await asyncio.shield(spawning)

    async def _read(self, worker: _Worker) -> None:
        assert worker.proc.stdout is not None
        error: str | None = None
        try:
            while True:
                line = await worker.proc.stdout.readline()
                if not line:
                    break
                try:
                    answer = _decode(line)
                    future = worker.pending.pop(answer["id"])
                except (msgspec.DecodeError, KeyError, TypeError) as exc:
                    error = f"sandbox {worker.index}: unreadable answer {line[:200]!r} ({exc})"
                    worker.proc.kill()
                    break
                if not future.done():
                    future.set_result(answer)
        finally:
            worker.dead = True
            # Its episodes in flight fail now; no new one reaches it (``alive``) while it is reaped.
            pending, worker.pending = worker.pending, {}
            code = await _wait_exit(worker.proc, 1.0)
            if not self._closed:
                self.crashed += 1
            message = error or f"sandbox {worker.index} (pid {worker.proc.pid}) exited with code {code}"
            for future in pending.values():
                if not future.done():
                    future.set_exception(SandboxError(message, "crash"))

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job on a worker; its ``result``, or ``SandboxError``."""
        if self._closed or self.socket_path is None:
            raise SandboxError("the sandbox pool is not running")
        job_id = self._next_job
        self._next_job += 1
        index = job_id % self.size
        worker = self._workers[index]
        if worker is None or not worker.alive:
            worker = await self._replace(index)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        worker.pending[job_id] = future
        stdin = worker.proc.stdin
        assert stdin is not None
        try:
            stdin.write(_encode({**job, "id": job_id}) + b"\n")
            await stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            worker.pending.pop(job_id, None)
            raise SandboxError(f"sandbox {index}: cannot send the job ({type(exc).__name__}: {exc})",
                               "crash") from None
        try:
            async with asyncio.timeout(self.job_timeout_s):
                answer = await future
        except TimeoutError:
            raise SandboxError(f"sandbox {index}: no answer within job_timeout_s={self.job_timeout_s}",
                               "timeout") from None
        finally:
            worker.pending.pop(job_id, None)
        if not answer.get("ok"):
            raise SandboxError(f"sandbox {index}: {answer.get('error', 'failed')}")
        result = answer.get("result")
        return result if isinstance(result, dict) else {}

    async def aclose(self) -> None:
        """End every worker: stdin closed (they finish and exit), killed after ``grace_s``."""
        self._closed = True
        if self._spawning:  # a worker starting now must be ended too
            await asyncio.gather(*self._spawning.values(), return_exceptions=True)
        workers = [w for w in self._workers if w is not None]
        for w in workers:
            if w.proc.stdin is not None and not w.proc.stdin.is_closing():
                w.proc.stdin.close()
        await asyncio.gather(*(_wait_exit(w.proc, self.grace_s) for w in workers))
        for w in workers:
            if w.reader is not None:
                w.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w.reader

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _wait_exit(proc: asyncio.subprocess.Process, grace_s: float) -> int:
    try:
        async with asyncio.timeout(grace_s):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        return await proc.wait()


def trace_trajectory(tokens: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, loss_mask: np.ndarray,
                     reward: float, metrics: dict[str, float] | None = None) -> Trajectory:
    """A ``Trajectory`` from one traced path: a transition per run of sampled tokens (its
    observation: every token before it), ``reward`` on the last. The trace keeps no stop
    reasons: every action says ``length``."""
    sampled = loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], sampled, [False])).astype(np.int8)))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    if not runs:
        raise SandboxError("the session's trace holds no sampled tokens")
    transitions = []
    for k, (a, b) in enumerate(runs):
        last = k == len(runs) - 1
        action = SampledSequence(stop_reason="length", tokens_raw=tokens[a:b].astype(np.int32).tobytes(),
                                 logprobs_raw=logprobs[a:b].astype(np.float32).tobytes(),
                                 versions_raw=versions[a:b].astype(np.int32).tobytes())
        transitions.append(Transition(observation=Observation(prompt=ModelInput.from_ints(tokens[:a])),
                                      action=action, reward=reward if last else 0.0, done=last,
                                      metrics=dict(metrics or {}) if last else {}))
    return Trajectory(transitions=transitions)


class SessionEnv(AgentEnv):
    """One episode in a sandbox worker, traced through an engine session; see the module docstring.

    ``sessions`` is the server's ``SessionManager`` (``Server.sessions``); the
    worker gets the job ``{"task": task, ...}`` with the session's credentials
    and must send its reward through the session. ``result`` metrics the
    worker returns (numbers) go into the logs under ``env/<name>``.
    """

    def __init__(self, pool: SandboxPool, sessions: Any, task: Any, metadata: dict[str, Any] | None = None) -> None:
        self.pool = pool
        self.sessions = sessions
        self.task = task
        self._metadata = dict(metadata or {})

    def metadata(self) -> dict[str, Any]:
        return self._metadata

    async def run(self, params: SamplingParams, seed: int, max_turns: int) -> Trajectory:
        session = self.sessions.open()
        sid = session.session_id
        try:
            result = await self.pool.run({
                "session": sid, "token": session.token, "task": self.task, "seed": seed, "max_turns": max_turns,
                "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                             "max_tokens": params.max_tokens}})
        finally:
            trace = self.sessions.collect(sid)
        if len(trace.trajectories) != 1:
            raise SandboxError(f"session {sid}: {len(trace.trajectories)} branches (the agent rewrote its "
                               "context); this environment expects one")
        path, reward = trace.trajectories[0], trace.rewards[0]
        if reward is None:
            raise SandboxError(f"session {sid}: the agent sent no reward for its last turn")
        metrics = {k: float(v) for k, v in result.get("metrics", {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        trajectory = trace_trajectory(path.tokens, path.logprobs, path.versions, path.loss_mask, reward, metrics)
        return msgspec.structs.replace(trajectory, metadata={"session": sid})


def worker_main(play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """The sandbox worker loop (``python -m ... SOCKET``): ``play(client, job)`` per job line."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} SOCKET")
    asyncio.run(_serve_jobs(sys.argv[1], play))


async def _serve_jobs(socket_path: str, play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    from rlengine.sandbox_client import AsyncClient

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    tasks: set[asyncio.Task[None]] = set()

    async def one(job: dict[str, Any]) -> None:
        try:
            answer = {"id": job["id"], "ok": True, "result": await play(client, job)}
        except Exception as exc:  # noqa: BLE001 - reported to the trainer as this episode's failure
            answer = {"id": job.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(_encode(answer) + b"\n")
        out.flush()

    async with await AsyncClient.connect(socket_path) as client:
        while line := await reader.readline():
            task = loop.create_task(one(_decode(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
