"""The shutdown cascade of a training run: the first error, the abort, the stages' supervision.

A run's stages (``rlengine.rl.loop``) are tasks on one event loop. Any stage
raising (or an interrupt, for signals) records the first error
(``Supervisor.fail``) and sets the abort event that every wait of every stage
also watches (``until_aborted``); ``supervise`` then gives the stages the grace
period to finish, cancels what is left, drains the queues and checks that no
task of the run is left behind. A normal end needs none of it: each stage
returns once the one before it has stopped.

This module knows nothing of what the stages do; it must not import torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rlengine.rl.errors import StageTimeout

__all__ = ["Supervisor", "awaited", "cancel_and_wait"]


def _serving(task: asyncio.Task[Any]) -> bool:
    """A task of the engine or a server beside it, which outlive the loop: named ``rlengine-...``,
    or an HTTP connection's handler (aiohttp's, unnamed; it lives as long as its client keeps
    the connection open, as an agent's connection pool does)."""
    if task.get_name().startswith("rlengine-"):
        return True
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    return (getattr(coro, "__qualname__", "") == "RequestHandler.start" and frame is not None
            and frame.f_globals.get("__name__") == "aiohttp.web_protocol")


async def awaited(awaitable: Awaitable[Any]) -> Any:
    """``awaitable`` (an engine call's future) as a coroutine, which a task can run."""
    return await awaitable


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and let it finish (a cancelled task is not done until the loop runs it)."""
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)


class Supervisor:
    """The run's first error and its abort, stop and progress events; see the module docstring."""

    def __init__(self, shutdown_grace_s: float) -> None:
        self.shutdown_grace_s = shutdown_grace_s
        self.error: BaseException | None = None
        self.left_behind: list[str] = []
        """Stages that had to be cancelled after the grace period."""
        self.drained = 0
        """Items still in the queues at the end (discarded)."""
        # Made with the run, not when it starts: a signal during start-up aborts it before it runs.
        self.abort = asyncio.Event()
        self.stop = asyncio.Event()
        """No more work is to be issued (set on abort, and when the training loop ends)."""
        self.progress = asyncio.Event()
        """Something the dataloader or the fixed-lag schedule waits on changed."""

    def fail(self, stage: str, exc: BaseException) -> None:
        """Record ``exc`` as the run's error (the first one only, noted with its stage) and abort."""
        if self.error is None:
            self.error = exc
            exc.add_note(f"rlengine.rl: raised in the {stage}")
        self.abort.set()
        self.stop.set()
        self.progress.set()

    def request_stop(self) -> None:
        self.stop.set()
        self.progress.set()

    async def until_aborted(self, awaitable: Awaitable[Any], timeout: float | None = None) -> Any:
        """Await ``awaitable`` unless the run aborts first (then cancel it and return None).

        ``timeout`` bounds the wait (``StageTimeout``)."""
        task = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self.abort.wait())
        try:
            done, _ = await asyncio.wait({task, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(stopper)
        if task in done:
            return task.result()
        task.cancel()
        # Cancelled rollouts abort their engine requests; give them the grace period.
        await asyncio.wait({task}, timeout=self.shutdown_grace_s)
        if not done:
            raise StageTimeout(f"a wait ran past its bound of {timeout} s")
        return None

    async def supervise(self, stages: dict[str, Callable[[], Awaitable[None]]],
                        queues: tuple[asyncio.Queue[Any], ...]) -> None:
        """Run the stages as tasks until all have returned or the run aborts; then the cascade's
        end: the grace period, the cancellation of what is left, the queues drained, no task left."""
        tasks = {asyncio.create_task(self._stage(name, fn), name=f"rlengine.rl: {name}"): name
                 for name, fn in stages.items()}
        pending = set(tasks)
        aborted = asyncio.ensure_future(self.abort.wait())
        try:
            while pending and not self.abort.is_set():
                pending = (await asyncio.wait(pending | {aborted}, return_when=asyncio.FIRST_COMPLETED))[1]
                pending.discard(aborted)
        finally:
            await cancel_and_wait(aborted)
        if pending:
            pending = (await asyncio.wait(pending, timeout=self.shutdown_grace_s))[1]
        if pending:
            self.left_behind = sorted(tasks[t] for t in pending)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
            if self.error is not None:
                self.error.add_note(f"rlengine.rl: cancelled after shutdown_grace_s={self.shutdown_grace_s}: "
                                    f"{', '.join(self.left_behind)}")
        for queue in queues:
            while not queue.empty():
                queue.get_nowait()
                self.drained += 1
        current = asyncio.current_task()
        # Every task but this one and the servers' own: stages, rollouts and the
        # waits they started must all be finished by now.
        orphans = [t for t in asyncio.all_tasks() if t is not current and not _serving(t)]
        if orphans and self.error is None:
            self.fail("supervisor", RuntimeError(f"tasks left behind: {[(t.get_name(), t.get_coro()) for t in orphans]}"))

    async def _stage(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by the run
            self.fail("rollout workers" if name.startswith("rollout worker") else name, exc)
