"""The training lane: training calls on a thread of their own, beside sampling.

By default a training call (forward, forward_backward, optim_step, state
save/load) is blocking work: it waits in the sampler's FIFO and runs on the
compute thread with the sampler drained, because a trainer and a sampler
that share one GPU must not run at once. A trainer that shares no device
memory with the sampler (the CPU, or another device) may run while the
sampler generates: with ``EngineConfig.train_concurrently`` the engine gives
training calls this lane instead, so an RL loop can train step n while it
samples step n+1 (``rlengine.rl.loop``), and a step takes about the longer
of the two rather than their sum.

The lane hands every call to its ``ComputeThread`` at once, which runs them
in submission order back to back (no round trip through the loop between
two calls). On close or engine death the calls not yet started fail at once
(``EngineClosed`` or the death) and the thread skips them when it reaches
them; only the one running is waited for. A weight install still goes
through the gate; its weights are taken on this thread, after the calls
before it (``Engine.install_weights``). Every future it hands out settles
exactly once, on the loop thread. Loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rlengine.core.compute import ComputeThread
from rlengine.core.futures import RequestFuture
from rlengine.timeline import Timeline, category

__all__ = ["TrainingLane", "snapshot"]


class _Skipped:
    """What a call returns that the lane closed before it started."""


class TrainingLane:
    """Training calls in order on one thread; see the module docstring."""

    def __init__(self, thread: ComputeThread, loop: asyncio.AbstractEventLoop) -> None:
        self.thread = thread
        self.loop = loop
        self._pending: dict[int, RequestFuture[Any]] = {}
        """Calls handed to the thread and not yet finished, by submission number."""
        self._count = 0
        self._running: int | None = None
        """The call the thread runs now (written by the thread: one reference, read on the loop)."""
        self._running_call: Callable[[], Any] | None = None
        """What that call runs (for ``snapshot``; written by the thread, read by anyone)."""
        self._closed: BaseException | None = None
        self.runs = 0
        self.busy_s = 0.0
        """Seconds spent running training calls (the RL loop's overlap figures)."""
        self.timeline: Timeline | None = None
        """Where each call is recorded, on the track ``track`` (``Engine.timeline``); None: nowhere."""
        self.track = 0

    def submit(self, future: RequestFuture[Any], run: Callable[[], Any], kind: str = "training") -> None:
        """Queue ``run`` (called on the lane's thread) to settle ``future``; loop thread. ``kind``
        names the call in the timeline."""
        if self._closed is not None:
            future.set_exception(self._closed)
            return
        self._count += 1
        key = self._count
        self._pending[key] = future

        # When the call started and ended on the lane's thread (``time.monotonic``), for the timeline.
        span = [0.0, 0.0]

        def call() -> tuple[Any, float]:
            if self._closed is not None:
                return _Skipped(), 0.0
            self._running, self._running_call = key, run
            started = time.perf_counter()
            span[0] = time.monotonic()
            try:
                return run(), time.perf_counter() - started
            finally:
                self._running, self._running_call = None, None
                self.busy_s += time.perf_counter() - started  # this thread alone writes it
                span[1] = time.monotonic()

        done = self.thread.submit(self.loop, call)
        done.add_done_callback(lambda f: self._finished(key, f, kind, span))

    def _finished(self, key: int, done: asyncio.Future[Any], kind: str, span: list[float]) -> None:
        timeline = self.timeline
        if timeline is not None and span[1]:
            part = category(kind)
            timeline.span(self.track, kind, span[0], span[1], part, part=part)
        future = self._pending.pop(key)
        if done.cancelled():
            future.set_exception(self._closed or asyncio.CancelledError())
        elif done.exception() is not None:
            self.runs += 1
            future.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            value, _ = done.result()
            if not isinstance(value, _Skipped):
                self.runs += 1
                future.set_result(value)

    def close(self, error: BaseException) -> None:
        """Refuse new calls and fail the ones not started with ``error`` (the one running finishes)."""
        if self._closed is None:
            self._closed = error
        for key, future in list(self._pending.items()):
            if key != self._running:
                future.set_exception(error)

    @property
    def pending(self) -> int:
        """Calls queued or running."""
        return len(self._pending)

    def snapshot(self) -> dict[str, Any]:
        """For a hang dump: the calls pending, the one running (its function) and its thread's
        state (``ComputeThread.snapshot``). Safe from any thread: it reads counters and references."""
        run = self._running_call
        return {**self.thread.snapshot(), "pending": len(self._pending), "runs": self.runs,
                "running": None if run is None else getattr(run, "__qualname__", repr(run))}


def snapshot(weights: Any) -> Any:
    """A copy of a trainer's ``sampler_weights()`` that later training calls cannot change:
    named tensors (or arrays) are cloned; anything else (weights already packed into an object
    store) is kept as it is."""
    if not isinstance(weights, list):
        return weights
    return [(name, t.clone() if hasattr(t, "clone") else t.copy()) for name, t in weights]
