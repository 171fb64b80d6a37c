"""The sandbox side of ``rlengine.rl.sandbox``: the worker loops that play episodes' jobs.

A ``SandboxPool`` worker reads job lines on stdin and writes one answer line
per job on stdout, after a first ready line ``{"ready": true}`` (the
protocol: ``rlengine.rl.sandbox_pool``).

* ``serve_job_lines(play)``: ``play(job)`` for every line, concurrently, in
  the worker's own process: games cost a coroutine each, so one worker
  plays many at once (HTTP agents, ``rlengine.rl.agents.agent_main``, and
  the agent-program worker). A game that crashes the process (exits, is
  killed, segfaults) ends the worker and every game in flight in it; the
  pool replaces the worker and has those games played again, each in
  quarantine.
* Quarantine: a job with ``"isolate": true`` (a game that was in flight on
  a worker that died) is played in a process of its own, forked from the
  worker for that job, so a game that crashes again crashes alone: the
  worker answers it as a ``crash`` with its exit code or signal and plays
  on. The game's process is non-dumpable (inherited from the worker, which
  made itself so before reading any job), killed when its worker dies
  (``die_with_parent``), holds none of the worker's descriptors but its
  own connection, its answer pipe and stderr (what it prints goes to
  stderr, never into the answers), and its collector leaves the worker's
  objects alone. Its copy of the worker holds the job lines the worker has
  read: the boundary between games of one worker is for crashes, not for
  secrets (that one is between workers).
* ``worker_main(play)``: ``serve_job_lines`` for agents that sample over
  IPC (``python -m ... fds:N``, as a pool starts it): ``play(client, job)``
  with one ``AsyncClient`` for all the worker's games, on the connection
  the pool handed over first on channel N; a game in quarantine gets a
  client of its own, on a connection the pool hands over for that job
  (the worker never needs the server's socket path).

Failed answers say their ``kind`` (``failure_kind``: ``http``, ``timeout``
or ``error``; ``crash`` for a game process that died). This module imports
no numpy, no torch and no engine: only the standard library, msgspec and
the sandbox client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlengine.sandbox_client import AsyncClient

__all__ = ["WORKER_CONNECTION", "die_with_parent", "failure_kind", "not_dumpable", "serve_job_lines", "worker_main"]

WORKER_CONNECTION = "worker"
"""The tag of the first connection the pool hands a worker over its channel: the one its
in-process games share (every later one is tagged with the id of the job it is for)."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

Play = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
Quarantine = Callable[[dict[str, Any]], tuple[Play, int | None]]
"""For a job played in a process of its own: what that process plays, and the descriptor it
needs (its own connection, or None), closed in the worker once the game has it."""


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: processes of the same user can no longer ptrace this one or read its
    ``/proc/<pid>/mem`` and ``environ`` (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: this process is killed (SIGKILL) when its parent dies, so a game or
    program outlives neither its crashed nor its killed worker (Linux; elsewhere a no-op)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def worker_main(play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """The sandbox worker loop (``python -m ... fds:N``, as a pool starts it, or ``... SOCKET``):
    ``play(client, job)`` per job line (module docstring). It makes itself non-dumpable before
    it reads any job (and so any token)."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} fds:N|SOCKET")
    not_dumpable()
    # A Ctrl-C reaches the whole process group: the trainer decides when its sandboxes stop
    # (stdin closed, then a kill), so that the games under way can settle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve_jobs(sys.argv[1], play))


class _Channel:
    """The worker's end of the channel on which the pool hands over connections to the IPC
    server, each tagged (``WORKER_CONNECTION`` or a job's id) and sent before the job's line, so
    it is already queued when the worker reads that line."""

    def __init__(self, fd: int) -> None:
        self.socket = socket.socket(fileno=fd)
        self.waiting: dict[Any, int] = {}
        """Connections received for jobs whose lines are not read yet, by tag."""

    def take(self, tag: Any) -> int | None:
        """The connection handed over for ``tag`` (None: none was)."""
        while tag not in self.waiting:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.socket, 256, 1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            if not data:
                return None
            if fds:
                self.waiting[_decode(data)] = fds[0]
        return self.waiting.pop(tag)


async def _serve_jobs(where: str, play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    channel = None
    if where.startswith("fds:"):
        channel = _Channel(int(where[4:]))
        own = channel.take(WORKER_CONNECTION)
        if own is None:
            raise SystemExit(f"{where}: the pool handed over no connection for the worker")
        where = f"fd:{own}"

    def quarantine(job: dict[str, Any]) -> tuple[Play, int | None]:
        if channel is None:  # started with the socket's path: the game connects to it
            return _connected(play, where), None
        conn = channel.take(job.get("id"))
        if conn is None:
            raise ConnectionError("no connection to the IPC server was handed over for this job")
        return _connected(play, f"fd:{conn}"), conn

    async with await AsyncClient.connect(where) as client:
        await serve_job_lines(lambda job: play(client, job), quarantine=quarantine)


def _connected(play: Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]], where: str) -> Play:
    async def alone(job: dict[str, Any]) -> dict[str, Any]:
        async with await AsyncClient.connect(where) as client:
            return await play(client, job)

    return alone


async def serve_job_lines(play: Play, *, quarantine: Quarantine | None = None) -> None:
    """A worker's job loop: the ready line, then ``play(job)`` per line of stdin, concurrently,
    each bounded by its ``deadline_s + scoring_s`` when it has a deadline; one answer line per job
    on stdout. A job with ``"isolate": true`` is played in a process of its own (module
    docstring): ``quarantine(job)`` says with what (default: ``play`` itself)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    out.write(_encode({"ready": True}) + b"\n")
    out.flush()
    tasks: set[asyncio.Task[None]] = set()
    alone: Quarantine = quarantine or (lambda _job: (play, None))

    async def one(job: dict[str, Any]) -> None:
        if job.get("isolate") is True:
            answer = await _in_quarantine(job, alone)
        else:
            answer = await _answer(job, play)
        out.write(_encode(answer) + b"\n")
        out.flush()

    while line := await reader.readline():
        task = loop.create_task(one(_decode(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def _in_quarantine(job: dict[str, Any], quarantine: Quarantine) -> dict[str, Any]:
    """The answer of a game played in a process of its own; a ``crash`` when it died without one."""
    job_id = job.get("id")
    try:
        game, conn = quarantine(job)
    except OSError as exc:  # its connection was not handed over
        return {"id": job_id, "ok": False, "kind": "http", "error": f"{type(exc).__name__}: {exc}"}
    readable, writable = os.pipe()
    worker = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: this game fails, the worker plays on
        for fd in (readable, writable, conn):
            if fd is not None:
                os.close(fd)
        return {"id": job_id, "ok": False, "kind": "error", "error": f"cannot fork the game's process: {exc}"}
    if pid == 0:
        _play_alone(job, game, worker, (writable, conn))
    os.close(writable)
    if conn is not None:
        os.close(conn)
    output = await _read_all(readable)
    # It closed its answer pipe: it is exiting, or lingering with nothing more to say.
    status = await _reap(pid)
    try:
        answer = _decode(output)
    except msgspec.DecodeError:
        answer = None
    if not isinstance(answer, dict):
        code = os.waitstatus_to_exitcode(status)
        how_ended = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
        answer = {"ok": False, "kind": "crash", "error": f"game (pid {pid}) {how_ended} before it answered"}
    return answer | {"id": job_id}  # its own id, whatever the game wrote


async def _reap(pid: int) -> int:
    """The wait status of a game that closed its answer pipe: it is exiting, or lingering with
    nothing more to say, and is killed (so this takes a few milliseconds at most)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
        if done:
            return status
        await asyncio.sleep(0.001)


async def _read_all(fd: int) -> bytes:
    """Everything written to the pipe ``fd`` until it is closed (``fd`` is closed after)."""
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    try:
        return await reader.read()
    finally:
        transport.close()


def _play_alone(job: dict[str, Any], play: Play, worker: int, keep: tuple[int, int | None]) -> None:
    """The game's process, forked from its ``worker``: it plays, writes its answer and exits; it
    never returns."""
    code = 1
    try:
        # Every object of the worker (its loop, its transports, its other games) is left alone:
        # never collected here, so nothing of it closes a descriptor this process reuses, and
        # its pages are not copied.
        gc.freeze()
        die_with_parent()
        if os.getppid() != worker:  # the worker died before the line above took effect
            os._exit(code)
        writable, conn = keep
        # Nothing of the worker's: not its job stream, its connection or its other games' pipes.
        _close_all_but(2, writable, *(() if conn is None else (conn,)))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        # asyncio knows the worker's loop belongs to another process (it checks the pid), so
        # this process runs a loop of its own.
        answer = asyncio.run(_answer(job, play))
        _write_all(writable, _encode(answer) + b"\n")
        code = 0
    except BaseException:  # noqa: BLE001 - the worker reports the game as crashed; say why here
        traceback.print_exc()
    finally:
        os._exit(code)


def _close_all_but(*keep: int) -> None:
    """Close every descriptor from 3 up except ``keep``."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_HTTP_ERRORS = ("openai.", "anthropic.", "httpx.", "httpcore.", "aiohttp.", "urllib.", "http.client.", "requests.")
"""Modules whose exceptions a worker reports as ``http`` failures (beside ``ConnectionError``)."""


def failure_kind(exc: BaseException) -> str:
    """How a worker reports an episode's exception: ``http`` (its connection to the engine or a
    request failed), ``timeout`` or ``error``."""
    for cls in type(exc).__mro__:
        if cls is ConnectionError or f"{cls.__module__}.{cls.__qualname__}".startswith(_HTTP_ERRORS):
            return "http"
    return "timeout" if isinstance(exc, TimeoutError) else "error"


async def _answer(job: dict[str, Any], play: Play) -> dict[str, Any]:
    """The answer line for one job: ``play(job)``, bounded by the job's ``deadline_s + scoring_s``
    when it has a deadline; its failure, with its kind, when it raised."""
    bound = job.get("deadline_s")
    try:
        async with asyncio.timeout(None if bound is None else float(bound) + float(job.get("scoring_s", 0.0))):
            result = await play(job)
    except Exception as exc:  # noqa: BLE001 - reported to the trainer as this episode's failure
        return {"id": job.get("id"), "ok": False, "kind": failure_kind(exc), "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"id": job["id"], "ok": True, "result": result if isinstance(result, dict) else {}}
