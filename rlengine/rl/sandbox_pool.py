"""The trainer's side of sandboxes: a supervised pool of worker processes that play episodes' jobs.

``SandboxPool`` keeps ``size`` worker processes, ``python -m <module> fds:N
[args]``, and hands each episode to one of them (round robin) as a JSON
line on its stdin; the worker answers with a JSON line on stdout (the
worker's side: ``rlengine.rl.sandbox_worker``). N is the worker's end of a
channel on which the pool hands over connections to the engine's IPC server,
already connected, so a worker never needs the socket's path: first the one
its games share, then one for each job played in quarantine. Workers of a
pool started without a socket (HTTP agents) get no channel.

Job lines: ``{"id": n, "session": ..., "token": ..., "task": ..., "sampling":
{...}, "seed": ..., "max_turns": ...}``, with ``"isolate": true`` for a game
to be played in a process of its own; answers: ``{"id": n, "ok": true,
"result": {...}}`` or ``{"id": n, "ok": false, "kind": ..., "error": "..."}``.
A worker's first line is ``{"ready": true}``; it is in service once it says
so, within ``start_timeout_s``.

Supervision. Every episode has a deadline (``job_timeout_s``); closing the
pool ends the workers (stdin closed, then killed after ``grace_s``). A
worker that dies is replaced on the next episode for its slot, and the
episodes in flight on it fail as ``crash`` *suspects* (``SandboxError.suspect``):
any of them may have crashed it, or none. The environment plays each suspect
again from the start with ``"isolate": true`` (``rlengine.rl.sandbox.SessionEnv``),
in a process of its own, so the game that crashes crashes alone (a ``crash``,
no longer a suspect) and the others finish. Nothing is isolated until a
worker dies: a game costs a coroutine in its worker, not a process. A slot
whose workers keep failing before they answer anything (at start-up, or
killed young with no game in flight) is restarted with an exponential
backoff and, after ``max_failed_starts`` such failures in a row, gives up
loudly: ``SandboxUnavailable``, which fails the run, not an attempt.

Confinement. Each worker starts with a scrubbed environment (an allow-list:
``PATH``, ``LANG``, ``PYTHONPATH`` to import rlengine and the module, a
private ``HOME`` / ``TMPDIR``, the thread settings, plus the pool's own
``env``), in a private 0700 working directory removed when it exits, under
resource limits (address space, open files, no core files; CPU time when
set), and makes itself non-dumpable before it reads a job
(``sandbox_worker``), so a sibling of the same user cannot read its memory
or environment through ``/proc``. A trainer running as root (as CI does)
starts each worker slot through ``_confine``: limits set, then an
unprivileged uid of its own, so a worker reads neither a sibling's memory
nor the trainer's files and environment; what it needs from directories
closed to other users (Python under a 0700 ``/root``) is mounted back
read-only in a mount namespace of its own, where the rest of those
directories is an empty tmpfs. (Where the kernel refuses the namespace, it
runs as uid 0 with no capability at all: memory and environments stay
private, root's files do not.) A worker module must be in a directory other
users can read. A non-root trainer's own environment stays readable by its
same-uid workers (it is dumpable): keep secrets out of it, or run as root.
Session tokens reach a worker only in job lines on its stdin, never in argv
or the environment. Stronger isolation (pid and network namespaces,
bubblewrap) is the system's: run the trainer itself under it.

This module starts and supervises processes; it knows nothing of sessions
or trajectories (``rlengine.rl.sandbox``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import msgspec

from rlengine.backends.torch.threads import THREAD_VARIABLES
from rlengine.errors import RLEngineError
from rlengine.rl.config import check_integer, check_number
from rlengine.rl.sandbox_limits import hidden, limit, rlimits
from rlengine.rl.sandbox_worker import WORKER_CONNECTION
from rlengine.timeline import current as current_timeline

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SandboxError", "SandboxPool", "SandboxUnavailable", "running_snapshots"]

log = logging.getLogger("rlengine")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class SandboxError(RLEngineError, RuntimeError):
    """A sandbox episode failed: the worker crashed, timed out, or reported an error (``kind``:
    ``crash``, ``timeout`` or ``error``)."""

    def __init__(self, message: str, kind: str = "error", *, suspect: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.suspect = suspect
        """No verdict on the episode: its worker died while it was in flight (it may have crashed
        the worker, or another game did), or the job never reached a worker. Played again in a
        process of its own (``"isolate": true``), it either finishes or crashes alone."""


class SandboxUnavailable(SandboxError):
    """A worker slot failed ``max_failed_starts`` times in a row before answering anything (its
    workers exit or hang at start-up, or die young with no game in flight): the pool gives up. It fails the run, not an
    attempt: every later episode would fail the same way."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "crash")


class _StartFailed(RLEngineError, RuntimeError):
    """A new worker exited, hung or said something else before its ready line (``message`` says which)."""


_UID_BASE = 200_000
_UID_SLOTS = 100
"""A root trainer runs worker slot i as uid ``_UID_BASE + (pid % 1000) * _UID_SLOTS + i % _UID_SLOTS``."""


_CONFINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_confine.py")

_RUNNING: dict[int, SandboxPool] = {}
"""The pools started and not yet closed, for hang dumps (``running_snapshots``). A plain dict: the
watch's thread copies it in one C-level step."""


def running_snapshots() -> list[dict[str, Any]]:
    """``SandboxPool.snapshot`` of every pool of this process that is running (any thread)."""
    return [pool.snapshot() for pool in list(_RUNNING.values())]


_STDERR_TAIL = 2048
"""Bytes of a worker's stderr kept to say why it failed to start (all of it is passed on)."""


class _Worker:
    __slots__ = ("answered", "channel", "dead", "index", "jobs", "pending", "proc", "reader", "stderr",
                 "stderr_tail", "workdir")

    def __init__(self, index: int, proc: asyncio.subprocess.Process, workdir: str,
                 channel: socket.socket | None) -> None:
        self.index = index
        self.proc = proc
        self.workdir = workdir
        self.channel = channel
        """The pool's end of the channel that hands the worker its connections (None: no socket)."""
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.jobs: dict[int, tuple[Any, float]] = {}
        """Per job in flight: its session and when it was sent (``time.monotonic``), for ``SandboxPool.snapshot``."""
        self.reader: asyncio.Task[None] | None = None
        self.stderr: asyncio.Task[None] | None = None
        self.stderr_tail = b""
        self.answered = 0
        self.dead = False
        """Its output ended (it exited or was killed): set at once, before the exit is reaped,
        so that no episode is sent to it in between (they would all fail)."""

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.returncode is None and self.reader is not None and not self.reader.done()

    def stderr_said(self) -> str:
        """The last line of its stderr, for an error message ("" when it wrote nothing)."""
        lines = self.stderr_tail.decode("utf-8", "replace").strip().splitlines()
        return f": {lines[-1][-300:]}" if lines else ""


class SandboxPool:
    """``size`` sandbox worker processes running ``python -m module fds:N [args]``; see the module docstring.

    Why one class: the workers, their jobs and the replacement of a dead one are one table of
    processes (the worker side is ``sandbox_worker``, confinement ``_confine``).
    """

    def __init__(self, module: str, size: int, *, args: tuple[str, ...] = (), job_timeout_s: float = 120.0,
                 grace_s: float = 3.0, env: dict[str, str] | None = None, address_space_bytes: int | None = 8 << 30,
                 open_files: int = 1024, cpu_seconds: int | None = None, readable: tuple[str, ...] = (),
                 start_timeout_s: float = 60.0, max_failed_starts: int = 5, restart_backoff_s: float = 0.1) -> None:
        check_integer("size", size, minimum=1)
        check_integer("max_failed_starts", max_failed_starts, minimum=1)
        check_number("start_timeout_s", start_timeout_s, minimum=0)
        check_number("restart_backoff_s", restart_backoff_s, minimum=0)
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
        self.start_timeout_s = float(start_timeout_s)
        """How long a new worker may take to say it is ready."""
        self.max_failed_starts = max_failed_starts
        self.restart_backoff_s = float(restart_backoff_s)
        """The wait before restarting a slot after its first failure; doubled for each further
        failure in a row, at most 5 s."""
        self.socket_path: str | None = None
        self._started = False
        self._workers: list[_Worker | None] = [None] * size
        self._spawning: dict[int, asyncio.Task[_Worker]] = {}
        self._failures = [0] * size
        """Per slot: workers in a row that failed before answering anything."""
        self._last_failure: list[str] = [""] * size
        self._broken: SandboxUnavailable | None = None
        self._next_job = 0
        self._closed = False
        self.spawned = 0
        """Processes started so far (more than ``size`` after replacing crashed ones)."""
        self.crashed = 0
        """Workers that died while the pool ran (a game that crashed in quarantine is not one)."""

    async def start(self, socket_path: str | None) -> SandboxPool:
        """Start the workers and wait until each is ready; ``socket_path`` is the IPC server's (each
        worker gets connected sockets over its channel), None for workers that reach the engine otherwise
        (HTTP agents, ``rlengine.rl.agents``: their command line is then ``python -m module [args]``).
        ``SandboxUnavailable`` when a slot fails to start ``max_failed_starts`` times in a row."""
        self.socket_path = socket_path
        self._started = True
        _RUNNING[id(self)] = self
        await asyncio.gather(*(self._replace(i) for i in range(self.size)))
        return self

    @staticmethod
    def _import_paths() -> list[str]:
        """Where rlengine and the environment module import from; nothing secret."""
        import rlengine

        return [os.path.dirname(os.path.dirname(os.path.abspath(rlengine.__file__))), os.getcwd(),
                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]

    @functools.cached_property
    def _hide_plan(self) -> dict[str, list[str]]:
        """What a worker under another uid needs of directories closed to others (``sandbox_limits.hidden``),
        worked out once per pool; it warns once about what such a worker cannot read at all."""
        import site

        needed = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
                  *site.getsitepackages(), *self._import_paths(), *self.readable]
        plan, closed = hidden(needed)
        if closed:
            log.warning("rlengine.rl: sandbox workers run under uids of their own and cannot read %s (closed to "
                        "other users): a worker module there cannot be imported", ", ".join(closed))
        return plan

    def _confinement(self, uid: int, workdir: str) -> tuple[str, ...]:
        """The arguments that start a root trainer's worker through ``_confine`` (under ``uid``,
        what it needs of directories closed to others mounted back for it)."""
        plan = {"uid": uid, "hide": self._hide_plan, "stage": os.path.join(workdir, ".confine"),
                "limits": rlimits(self.limits)}
        return ("-I", _CONFINE, _encode(plan).decode())

    def _worker_env(self, workdir: str) -> dict[str, str]:
        paths = self._import_paths()
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONDONTWRITEBYTECODE": "1"}
        env |= {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ}  # the trainer's thread settings
        return env | self.env

    async def _spawn(self, index: int) -> _Worker:
        """One new worker for slot ``index``, in service once it said it is ready (``_StartFailed``
        when it did not)."""
        workdir = tempfile.mkdtemp(prefix="rlengine-sandbox-")  # 0700
        uid = None if self._uid_base is None else self._uid_base + index % _UID_SLOTS
        if uid is not None:
            os.chown(workdir, uid, uid)
        channel = theirs = None
        try:
            fds: tuple[int, ...] = ()
            if self.socket_path is not None:
                # Datagrams keep each hand-over (a tag and its connection) whole.
                channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                channel.setblocking(False)
                fds = (theirs.fileno(),)
                await self._connect_over(channel, WORKER_CONNECTION)  # queued before the worker starts
            # A root trainer's worker gives up root before any of its own code runs
            # (``_confine``, which then execs the worker's command line).
            confine = () if uid is None else self._confinement(uid, workdir)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *confine, "-m", self.module, *(f"fds:{fd}" for fd in fds), *self.args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=fds, cwd=workdir, env=self._worker_env(workdir))
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            if channel is not None:
                channel.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()  # the worker holds its own copy
        self.spawned += 1
        worker = _Worker(index, proc, workdir, channel)
        worker.stderr = asyncio.get_running_loop().create_task(_pass_on_stderr(worker),
                                                               name=f"rlengine-sandbox-stderr-{index}")
        try:
            if uid is None:
                limit(proc.pid, self.limits)
            await self._await_ready(worker)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # never a worker nobody ends
            await proc.wait()
            await _settle(worker)
            raise
        worker.reader = asyncio.get_running_loop().create_task(self._read(worker),
                                                               name=f"rlengine-sandbox-{index}")
        self._workers[index] = worker
        return worker

    async def _await_ready(self, worker: _Worker) -> None:
        """The worker's first line, its ready line, within ``start_timeout_s``; else ``_StartFailed``."""
        assert worker.proc.stdout is not None
        try:
            async with asyncio.timeout(self.start_timeout_s):
                line = await worker.proc.stdout.readline()
        except TimeoutError:
            raise _StartFailed(f"not ready within start_timeout_s={self.start_timeout_s}") from None
        try:
            hello = _decode(line) if line else None
        except msgspec.DecodeError:
            hello = None
        if isinstance(hello, dict) and hello.get("ready") is True:
            return
        if line:
            raise _StartFailed(f"its first line {line[:200]!r} is not the ready line")
        code = await _wait_exit(worker.proc, 1.0)
        with contextlib.suppress(TimeoutError):  # the rest of what it said, to say why
            async with asyncio.timeout(1.0):
                await asyncio.shield(worker.stderr)  # type: ignore[arg-type]
        raise _StartFailed(f"exited with code {code} before it was ready{worker.stderr_said()}")

    async def _start(self, index: int) -> _Worker:
        """A worker for slot ``index``, after the backoff its failures in a row call for, or
        ``SandboxUnavailable`` once they reach ``max_failed_starts``."""
        while True:
            failures = self._failures[index]
            if failures >= self.max_failed_starts:
                if self._broken is None:
                    self._broken = SandboxUnavailable(
                        f"sandbox {index} (python -m {self.module}) failed {failures} times in a row before it "
                        f"answered anything (max_failed_starts={self.max_failed_starts}); the last one "
                        f"{self._last_failure[index]}")
                raise self._broken
            if failures:
                await asyncio.sleep(min(self.restart_backoff_s * 2 ** (failures - 1), 5.0))
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            try:
                return await self._spawn(index)
            except _StartFailed as exc:
                self._failures[index] += 1
                self._last_failure[index] = str(exc)
                log.warning("rlengine.rl: sandbox %d (python -m %s) failed to start: %s", index, self.module, exc)

    async def _replace(self, index: int) -> _Worker:
        """A new worker for slot ``index``; concurrent callers share one start."""
        spawning = self._spawning.get(index)
        if spawning is None:
            spawning = asyncio.get_running_loop().create_task(self._start(index), name=f"rlengine-sandbox-spawn-{index}")
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
                worker.answered += 1
                self._failures[worker.index] = 0
                # None: a job that timed out or whose caller gave up; its late answer is dropped.
                if future is not None and not future.done():
                    future.set_result(answer)
        finally:
            worker.dead = True
            # Its episodes in flight fail now; no new one reaches it (``alive``) while it is reaped.
            pending, worker.pending = worker.pending, {}
            code = await _wait_exit(worker.proc, 1.0)
            await _settle(worker)
            message = error or f"sandbox {worker.index} (pid {worker.proc.pid}) exited with code {code}"
            if not self._closed:
                self.crashed += 1
                # Died young with no game in flight: the worker's own failure, toward giving the
                # slot up. With games in flight, one of them may be the cause: each is replayed in
                # quarantine, and one that crashes again is recorded as a crash, not the slot's.
                if not worker.answered and not pending:
                    self._failures[worker.index] += 1
                    self._last_failure[worker.index] = message
            for future in pending.values():
                if not future.done():
                    future.set_exception(SandboxError(f"{message} with this game and {len(pending) - 1} other(s) "
                                                      "in flight", "crash", suspect=True))

    async def _connect_over(self, channel: socket.socket, tag: Any) -> None:
        """A new connection to the IPC server, handed over on a worker's ``channel`` under ``tag``."""
        assert self.socket_path is not None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            try:
                await asyncio.get_running_loop().sock_connect(conn, self.socket_path)
            except OSError as exc:
                raise SandboxError(f"cannot connect to the IPC server at {self.socket_path!r}: {exc}",
                                   "http") from None
            await _hand_over(channel, tag, conn)
        finally:
            conn.close()  # the worker holds its own copy

    async def _send(self, worker: _Worker, job_id: int, job: dict[str, Any]) -> None:
        """The job's line; for a game played in quarantine, its own connection to the server first
        (when the pool has a socket), so it is there when the worker reads the line."""
        if worker.channel is not None and job.get("isolate") is True:
            await self._connect_over(worker.channel, job_id)
        stdin = worker.proc.stdin
        assert stdin is not None
        stdin.write(_encode({**job, "id": job_id}) + b"\n")
        await stdin.drain()

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job on a worker; its ``result``, or ``SandboxError`` (``SandboxUnavailable``
        when the worker's slot gave up)."""
        if self._broken is not None:
            raise self._broken
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
        sent = time.monotonic()
        worker.jobs[job_id] = (job.get("session"), sent)
        try:
            async with asyncio.timeout(self.job_timeout_s):
                try:
                    await self._send(worker, job_id, job)
                except SandboxError:
                    raise
                except (OSError, RuntimeError) as exc:  # it died: the job never reached it
                    raise SandboxError(f"sandbox {index}: cannot send the job ({type(exc).__name__}: {exc})",
                                       "crash", suspect=True) from None
                answer = await future
        except TimeoutError:
            raise SandboxError(f"sandbox {index}: no answer within job_timeout_s={self.job_timeout_s}",
                               "timeout") from None
        finally:
            worker.pending.pop(job_id, None)
            worker.jobs.pop(job_id, None)
            timeline = current_timeline()
            if timeline is not None:  # the job's turn in the run's timeline (``rlengine.timeline``)
                timeline.environment("sandbox job", sent, time.monotonic(),
                                     {"slot": index, "job": job_id, "session": str(job.get("session"))})
        if not answer.get("ok"):
            kind = answer.get("kind")
            raise SandboxError(f"sandbox {index}: {answer.get('error', 'failed')}",
                               kind if kind in ("http", "timeout", "crash") else "error")
        result = answer.get("result")
        return result if isinstance(result, dict) else {}

    def snapshot(self) -> dict[str, Any]:
        """The pool for a hang dump: per slot its worker's pid, whether it lives, and the episodes
        in flight on it (job id, session, seconds since sent). Safe from any thread: each table is
        copied in one C-level step and plain attributes are read (a job just ended may still show)."""
        now = time.monotonic()
        slots = []
        for index, worker in enumerate(list(self._workers)):
            if worker is None:
                slots.append({"slot": index, "pid": None, "alive": False, "jobs": []})
                continue
            slots.append({"slot": index, "pid": worker.proc.pid, "alive": worker.alive, "answered": worker.answered,
                          "jobs": [{"job": job_id, "session": session, "age_s": now - sent}
                                   for job_id, (session, sent) in list(worker.jobs.items())]})
        return {"module": self.module, "size": self.size, "spawned": self.spawned, "crashed": self.crashed,
                "broken": None if self._broken is None else str(self._broken), "workers": slots}

    async def aclose(self) -> None:
        """End every worker: stdin closed (they finish and exit), killed after ``grace_s``."""
        self._closed = True
        _RUNNING.pop(id(self), None)
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
            await _settle(w)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _pass_on_stderr(worker: _Worker) -> None:
    """Everything the worker (and its games) write to stderr goes to the trainer's; the end is
    kept to say why a worker failed to start."""
    assert worker.proc.stderr is not None
    while chunk := await worker.proc.stderr.read(65536):
        worker.stderr_tail = (worker.stderr_tail + chunk)[-_STDERR_TAIL:]
        sys.stderr.write(chunk.decode("utf-8", "replace"))


async def _settle(worker: _Worker) -> None:
    """After a worker exited: its stderr passed on (bounded: a game that outlived it is killed by
    ``die_with_parent`` at once), its channel closed, its directory removed."""
    if worker.stderr is not None and not worker.stderr.done():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await asyncio.shield(worker.stderr)
        worker.stderr.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker.stderr
    if worker.channel is not None:
        worker.channel.close()
    shutil.rmtree(worker.workdir, ignore_errors=True)


async def _hand_over(channel: socket.socket, tag: Any, conn: socket.socket) -> None:
    """Pass the worker ``conn`` under ``tag`` (SCM_RIGHTS); for a job, before its line is written,
    so it is always there when the worker reads the line."""
    loop = asyncio.get_running_loop()
    message = [_encode(tag)]
    while True:
        try:
            socket.send_fds(channel, message, [conn.fileno()])
            return
        except BlockingIOError:  # the worker is behind on its channel: wait until it has room
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(channel.fileno(), functools.partial(_wake, writable))
            try:
                await writable
            finally:
                loop.remove_writer(channel.fileno())


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_exit(proc: asyncio.subprocess.Process, grace_s: float) -> int:
    try:
        async with asyncio.timeout(grace_s):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        return await proc.wait()
