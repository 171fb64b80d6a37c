"""The compute thread: the one thread that runs backend steps and training work.

The loop thread is the control plane; this thread is the data plane. Every
backend call and every piece of blocking work (forward_backward, weight
install, ...) runs here, one job at a time, so GPU work is serialized by
construction (what colocation needs) while the loop stays free for IPC,
HTTP and new submissions. (A trainer that shares no device with the sampler
may run its calls on a second one, beside sampling: ``rlengine.core.training``.) Results go back to the loop with
``call_soon_threadsafe``; the thread never touches engine state. What it runs now, and since
when, is one reference any thread may read (``snapshot``: the hang watch, ``rlengine.core.hangs``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ComputeThread"]


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class ComputeThread:
    """A single worker thread fed by a queue; jobs resolve asyncio futures."""

    def __init__(self, name: str = "rlengine-compute", init: Callable[[], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._init = init
        self._running: tuple[Callable[..., Any], float] | None = None
        """The call running now and its start (``time.monotonic``): one reference, written by the
        thread alone (a store per job, not per token), read by anyone."""
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> dict[str, Any]:
        """The thread's name and id (its stack in a dump's ``threads``), whether it lives, and the
        call it runs now with its seconds so far (``running`` None: idle). Safe from any thread: it
        reads one reference."""
        running = self._running
        call = None if running is None else getattr(running[0], "__qualname__", repr(running[0]))
        return {"thread": self._thread.name, "ident": self._thread.ident, "alive": self._thread.is_alive(),
                "running": call,
                "running_s": None if running is None else time.monotonic() - running[1]}

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` on the compute thread; await the returned future on ``loop``."""
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def _work(self) -> None:
        if self._init is not None:
            self._init()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fut, fn, args = job
            self._running = (fn, time.monotonic())
            try:
                value, ok = fn(*args), True
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting side
                value, ok = exc, False
            self._running = None
            try:
                loop.call_soon_threadsafe(_deliver, fut, ok, value)
            except RuntimeError:
                # The loop is closed: nobody is waiting for this result any more.
                pass

    def stop(self, timeout: float) -> bool:
        """Finish queued jobs and stop; False if the thread is still busy after ``timeout``."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
