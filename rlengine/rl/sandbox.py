"""Agent episodes in sandbox processes, sampling through the engine's IPC server.

The training process runs the engine and its IPC server (``rlengine.serve``);
environments run as agents in other processes, which sample through the
server with ``rlengine.sandbox_client`` and send their reward there. The trainer
never re-tokenizes anything: it trains on the session's trace, the exact
tokens, logprobs and policy versions the server stored.

* ``SandboxPool`` (trainer side) keeps ``size`` worker processes,
  ``python -m <module> fd:N`` (N: a socket already connected to the IPC
  server, so the worker never needs the socket's path), and hands each episode to one of them as
  a JSON line on its stdin; the worker answers with a JSON line on stdout.
  A worker that dies fails its episodes in flight (``SandboxError`` of kind
  ``crash``) and no later episode is sent to it: the next ones go to its
  replacement, so a crash costs only the games that were running in it; every episode has a deadline; closing the pool
  ends the workers (stdin closed, then killed after a grace period).
* ``SessionEnv`` (an ``AgentEnv``) opens a session on the server for its
  episode, sends the worker the session's id and token with the task, then
  collects the session's trace and turns it into a ``Trajectory``
  (``session_trajectory``): one transition per sampled segment, whose
  observation is everything before it, the reward on the last one (a
  session that branched: ``rlengine.rl.agents`` says how, ``branches``).
* ``worker_main(play)`` (sandbox side) is the worker loop: it connects one
  ``AsyncClient`` to the socket and runs ``play(client, job)`` for every job
  line, concurrently, until stdin closes (``serve_job_lines``; HTTP agents
  use ``rlengine.rl.agents.agent_main``, in a pool started without a socket).
  An answer that failed says its ``kind`` (``failure_kind``: ``http``,
  ``timeout`` or ``error``); a worker that died is a ``crash``.

Workers are confined: each starts with a scrubbed environment (an allow-list:
``PATH``, ``LANG``, ``PYTHONPATH`` to import rlengine and the module, a
private ``HOME`` / ``TMPDIR``, the thread settings, plus the pool's own
``env``), in a private 0700 working directory removed when it exits, under
resource limits (address space, open files, no core files; CPU time when
set), and makes itself non-dumpable before it reads a job (``worker_main``),
so a sibling of the same user cannot read its memory or environment through
``/proc``. A trainer running as root (as CI does) starts each worker slot
through ``_confine``: limits set, then an unprivileged uid of its own, so a
worker reads neither a sibling's memory nor the trainer's files and
environment; what it needs from directories closed to other users (Python
under a 0700 ``/root``) is mounted back read-only in a mount namespace of its
own, where the rest of those directories is an empty tmpfs. (Where the
kernel refuses the namespace, it runs as uid 0 with no capability at all:
memory and environments stay private, root's files do not.) A worker module
must be in a directory other users can read. A non-root trainer's own
environment stays readable by its same-uid workers (it is dumpable): keep
secrets out of it, or run as root. Session tokens reach a
worker only in job lines on its stdin, never in argv or the environment.
Stronger isolation (pid and network namespaces, bubblewrap) is the system's:
run the trainer itself under it.

Job lines: ``{"id": n, "session": ..., "token": ..., "task": ..., "sampling":
{...}, "seed": ..., "max_turns": ...}``; answers: ``{"id": n, "ok": true,
"result": {...}}`` or ``{"id": n, "ok": false, "error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from rlengine.backends.torch.threads import THREAD_VARIABLES
from rlengine.errors import RLEngineError
from rlengine.rl.types import AgentEnv, Observation, Trajectory, Transition
from rlengine.types import ModelInput, SampledSequence, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Branches", "SandboxError", "SandboxPool", "SessionEnv", "failure_kind", "job_sampling", "not_dumpable",
           "result_metrics", "serve_job_lines", "session_trajectory", "worker_main"]

Branches = Literal["all", "last"]
"""Which branches of a session an episode trains (``rlengine.rl.agents`` says how)."""

log = logging.getLogger("rlengine")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class SandboxError(RLEngineError, RuntimeError):
    """A sandbox episode failed: the worker crashed, timed out, or reported an error (``kind``:
    ``crash``, ``timeout`` or ``error``)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


_UID_BASE = 200_000
_UID_SLOTS = 100
"""A root trainer runs worker slot i as uid ``_UID_BASE + (pid % 1000) * _UID_SLOTS + i % _UID_SLOTS``."""


_CONFINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_confine.py")


def _reachable(path: str) -> bool:
    """Whether other users can traverse a directory (or read a file) at ``path``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    need = 0o005 if os.path.isdir(path) else 0o004
    return mode & need == need


def _hidden(needed: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """For the directories a worker under another uid needs: the topmost directory on each one's
    path that other users cannot traverse, mapped to the needed directories under it (what
    ``_confine.hide`` mounts back for the worker); and the needed directories that are themselves
    closed to others (mounting them back would not open them)."""
    dirs = sorted({os.path.realpath(d) for d in needed if os.path.isdir(d)})
    dirs = [d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs)]
    plan: dict[str, list[str]] = {}
    closed: list[str] = []
    for d in dirs:
        if not _reachable(d):
            closed.append(d)
            continue
        parts = d.split(os.sep)
        top = next((os.sep.join(parts[:i]) or os.sep for i in range(2, len(parts))
                    if not _reachable(os.sep.join(parts[:i]))), None)
        if top is not None:
            plan.setdefault(top, []).append(d)
    return plan, closed


def _rlimits(limits: dict[str, int | None]) -> list[tuple[int, int]]:
    """(resource, value) for every limit set: no core files, open files, address space, CPU time."""
    import resource

    settings = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, limits["open_files"]),
                (resource.RLIMIT_AS, limits["address_space_bytes"]), (resource.RLIMIT_CPU, limits["cpu_seconds"])]
    return [(which, value) for which, value in settings if value is not None]


def _limit(pid: int, limits: dict[str, int | None]) -> None:
    """Resource limits for a new worker of the trainer's own uid, set from outside (uvloop runs no
    code between fork and exec). A root trainer's workers set them themselves (``_confine``),
    before they give up root: from outside, limiting another uid's process needs CAP_SYS_RESOURCE."""
    import resource

    for which, value in _rlimits(limits):
        with contextlib.suppress(ProcessLookupError):  # it died already: its exit says why
            resource.prlimit(pid, which, (value, value))


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: processes of the same user can no longer ptrace this one or read its
    ``/proc/<pid>/mem`` and ``environ`` (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


class _Worker:
    __slots__ = ("dead", "index", "pending", "proc", "reader", "workdir")

    def __init__(self, index: int, proc: asyncio.subprocess.Process, workdir: str) -> None:
        self.index = index
        self.proc = proc
        self.workdir = workdir
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
                 grace_s: float = 3.0, env: dict[str, str] | None = None, address_space_bytes: int | None = 8 << 30,
                 open_files: int = 1024, cpu_seconds: int | None = None, readable: tuple[str, ...] = ()) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size={size!r}: must be an integer >= 1")
        self.module = module
        self.readable = tuple(readable)
        """Directories workers read beyond the import paths (an agent program's own), mounted back
        for workers under uids of their own when they are in directories closed to others."""
        self.env = dict(env or {})
        """Variables a worker gets beyond the allow-list (nothing else of the trainer's environment)."""
        self.limits = {"address_space_bytes": address_space_bytes, "open_files": open_files,
                       "cpu_seconds": cpu_seconds}
        self._uid_base = _UID_BASE + (os.getpid() % 1000) * _UID_SLOTS if os.geteuid() == 0 else None
        self.size = size
        self.args = args
        self.job_timeout_s = job_timeout_s
        self.grace_s = grace_s
        self.socket_path: str | None = None
        self._started = False
        self._workers: list[_Worker | None] = [None] * size
        self._spawning: dict[int, asyncio.Task[_Worker]] = {}
        self._next_job = 0
        self._closed = False
        self.spawned = 0
        """Processes started so far (more than ``size`` after replacing crashed ones)."""
        self.crashed = 0


    async def start(self, socket_path: str | None) -> SandboxPool:
        """Start the workers; ``socket_path`` is the IPC server's (each worker gets a connected
        socket as ``fd:N``), None for workers that reach the engine otherwise (HTTP agents,
        ``rlengine.rl.agents``: their command line is then ``python -m module [args]``)."""
        self.socket_path = socket_path
        self._started = True
        for i in range(self.size):
            await self._spawn(i)
        return self

    @staticmethod
    def _import_paths() -> list[str]:
        """Where rlengine and the environment module import from; nothing secret."""
        import rlengine

        return [os.path.dirname(os.path.dirname(os.path.abspath(rlengine.__file__))), os.getcwd(),
                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]

    @functools.cached_property
    def _hide_plan(self) -> dict[str, list[str]]:
        """What a worker under another uid needs of directories closed to others (``_hidden``),
        worked out once per pool; it warns once about what such a worker cannot read at all."""
        import site

        needed = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
                  *site.getsitepackages(), *self._import_paths(), *self.readable]
        plan, closed = _hidden(needed)
        if closed:
            log.warning("rlengine.rl: sandbox workers run under uids of their own and cannot read %s (closed to "
                        "other users): a worker module there cannot be imported", ", ".join(closed))
        return plan

    def _confinement(self, uid: int, workdir: str) -> tuple[str, ...]:
        """The arguments that start a root trainer's worker through ``_confine`` (under ``uid``,
        what it needs of directories closed to others mounted back for it)."""
        plan = {"uid": uid, "hide": self._hide_plan, "stage": os.path.join(workdir, ".confine"),
                "limits": _rlimits(self.limits)}
        return ("-I", _CONFINE, _encode(plan).decode())

    def _worker_env(self, workdir: str) -> dict[str, str]:
        paths = self._import_paths()
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONDONTWRITEBYTECODE": "1"}
        env |= {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ}  # the trainer's thread settings
        return env | self.env

    async def _spawn(self, index: int) -> _Worker:
        workdir = tempfile.mkdtemp(prefix="rlengine-sandbox-")  # 0700
        uid = None if self._uid_base is None else self._uid_base + index % _UID_SLOTS
        if uid is not None:
            os.chown(workdir, uid, uid)
        conn = None
        try:
            fds: tuple[int, ...] = ()
            if self.socket_path is not None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.setblocking(False)
                await asyncio.get_running_loop().sock_connect(conn, self.socket_path)
                conn.setblocking(True)
                fds = (conn.fileno(),)
            # A root trainer's worker gives up root before any of its own code runs
            # (``_confine``, which then execs the worker's command line).
            confine = () if uid is None else self._confinement(uid, workdir)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *confine, "-m", self.module, *(f"fd:{fd}" for fd in fds), *self.args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=fds,
                cwd=workdir, env=self._worker_env(workdir))
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            if conn is not None:
                conn.close()  # the worker holds its own copy
        if uid is None:
            try:
                _limit(proc.pid, self.limits)
            except BaseException:
                proc.kill()  # never a worker nobody ends
                await proc.wait()
                shutil.rmtree(workdir, ignore_errors=True)
                raise
        self.spawned += 1
        worker = _Worker(index, proc, workdir)
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
                    future = worker.pending.pop(answer["id"], None)
                except (msgspec.DecodeError, KeyError, TypeError) as exc:
                    error = f"sandbox {worker.index}: unreadable answer {line[:200]!r} ({exc})"
                    worker.proc.kill()
                    break
                # None: a job that timed out or whose caller gave up; its late answer is dropped.
                if future is not None and not future.done():
                    future.set_result(answer)
        finally:
            worker.dead = True
            # Its episodes in flight fail now; no new one reaches it (``alive``) while it is reaped.
            pending, worker.pending = worker.pending, {}
            code = await _wait_exit(worker.proc, 1.0)
            shutil.rmtree(worker.workdir, ignore_errors=True)
            if not self._closed:
                self.crashed += 1
            message = error or f"sandbox {worker.index} (pid {worker.proc.pid}) exited with code {code}"
            for future in pending.values():
                if not future.done():
                    future.set_exception(SandboxError(message, "crash"))

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job on a worker; its ``result``, or ``SandboxError``."""
        if self._closed or not self._started:
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
            kind = answer.get("kind")
            raise SandboxError(f"sandbox {index}: {answer.get('error', 'failed')}",
                               kind if kind in ("http", "timeout") else "error")
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
    """

    def __init__(self, pool: SandboxPool, sessions: Any, task: Any, metadata: dict[str, Any] | None = None,
                 branches: Branches = "all") -> None:
        if branches not in ("all", "last"):
            raise ValueError(f"branches={branches!r}: must be 'all' or 'last'")
        self.branches = branches
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
            result = await self.pool.run({"session": sid, "token": session.token, "task": self.task, "seed": seed,
                                          "max_turns": max_turns, "sampling": job_sampling(params)})
        finally:
            trace = self.sessions.collect(sid)
        reward = None if trace.latest is None else trace.rewards[trace.latest]
        if reward is None:
            raise SandboxError(f"session {sid}: the agent sent no reward for its last turn")
        trajectory = session_trajectory(trace, reward, result_metrics(result), self.branches)
        return msgspec.structs.replace(trajectory, metadata={"session": sid, "branches": len(trace.trajectories)})


def worker_main(play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """The sandbox worker loop (``python -m ... fd:N`` or ``... SOCKET``): ``play(client, job)``
    per job line. It makes itself non-dumpable before it reads any job (and so any token)."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} fd:N|SOCKET")
    not_dumpable()
    asyncio.run(_serve_jobs(sys.argv[1], play))


async def _serve_jobs(socket_path: str, play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    from rlengine.sandbox_client import AsyncClient

    async with await AsyncClient.connect(socket_path) as client:
        await serve_job_lines(functools.partial(play, client))


_HTTP_ERRORS = ("openai.", "anthropic.", "httpx.", "httpcore.", "aiohttp.", "urllib.", "http.client.", "requests.")
"""Modules whose exceptions a worker reports as ``http`` failures (beside ``ConnectionError``)."""


def failure_kind(exc: BaseException) -> str:
    """How a worker reports an episode's exception: ``http`` (its connection to the engine or a
    request failed), ``timeout`` or ``error``."""
    for cls in type(exc).__mro__:
        if cls is ConnectionError or f"{cls.__module__}.{cls.__qualname__}".startswith(_HTTP_ERRORS):
            return "http"
    return "timeout" if isinstance(exc, TimeoutError) else "error"


async def serve_job_lines(play: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """A worker's job loop: ``play(job)`` per line of stdin, concurrently, each bounded by its
    ``deadline_s + scoring_s`` when the job has a deadline; one answer line per job on stdout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    tasks: set[asyncio.Task[None]] = set()

    async def one(job: dict[str, Any]) -> None:
        bound = job.get("deadline_s")
        try:
            async with asyncio.timeout(None if bound is None else float(bound) + float(job.get("scoring_s", 0.0))):
                result = await play(job)
            answer: dict[str, Any] = {"id": job["id"], "ok": True, "result": result if isinstance(result, dict) else {}}
        except Exception as exc:  # noqa: BLE001 - reported to the trainer as this episode's failure
            answer = {"id": job.get("id"), "ok": False, "kind": failure_kind(exc),
                      "error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(_encode(answer) + b"\n")
        out.flush()

    while line := await reader.readline():
        task = loop.create_task(one(_decode(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
