"""SIGINT and SIGTERM for ``rlengine train`` and ``rlengine serve``: one stop path.

A command installs ``StopSignals`` before its start-up work begins (model
builds, engine start, sandboxes), so a signal is never lost and never lands
as a ``KeyboardInterrupt`` traceback in the middle of a library:

* the **first** signal asks for a graceful stop. It is recorded (and one
  line says so on stderr); while the command's event loop runs it is also
  delivered there, to the callback given to ``on_loop`` (stop admitting,
  settle what is in flight, checkpoint). Start-up work on the loop runs
  inside ``start_up()``: a signal then cancels it at its next ``await``
  (whatever it had started closes on the way out) and it raises
  ``StartUpInterrupted``; one that arrives before the loop runs is recorded
  and ends start-up as soon as it enters ``start_up()``;
* a **second** signal exits at once, with the status of the first
  (``128 + N``: 130 for SIGINT, 143 for SIGTERM), without unwinding: no
  traceback and no interpreter finalization.

``StopSignals.leave(status)`` ends a command: it flushes stdio and, where a
worker thread of rlengine (named ``rlengine-...``, e.g. a compute thread
still inside a long training call) outlived its stop, leaves with
``os._exit``: finalizing the interpreter under a thread that still runs
torch destroys torch's thread pools under it, and the C++ runtime then
aborts the process (``terminate called without an active exception``).

``until_stopped`` is the serving commands' wait: the first signal or the
death of an engine, whichever comes first, with a death always winning
(a signal that follows a death must not turn a failure into a clean stop).

**SIGUSR1** asks for a dump of what the process is doing (``dumps``: the
command's ``rlengine.core.hangs.HangWatch.request_dump``, which only queues
the request, so it is safe in a handler; the watch's own thread writes the file).
Handled from ``__enter__`` on: outside ``dumps`` it prints one line and is
otherwise ignored, never the default action, which would end the process.
It is a process-level handler, not the loop's: it must work while the loop
is stuck (it runs on the main thread at its next Python instruction).

This module holds process-level policy only: it knows no engine, loop
internals or run state (engines are anything with a ``died`` attribute).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rlengine.errors import RLEngineError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DUMP_SIGNAL", "EXIT_ENGINE_DIED", "STOP_SIGNALS", "StartUpInterrupted", "StopSignals", "until_stopped"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

DUMP_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
"""The signal that asks for a dump (None where the platform has no SIGUSR1)."""

EXIT_ENGINE_DIED = 1
"""Exit status of a server whose engine died (its backend or compute thread failed)."""

_LEAVE_JOIN_S = 1.0
"""How long ``leave`` waits for this command's worker threads to end before it exits past them."""

_WATCH_S = 0.25
"""How often ``until_stopped`` checks that the engines live."""


class StartUpInterrupted(RLEngineError, RuntimeError):
    """A stop signal came while the command was starting (``StopSignals.start_up``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} during start-up")


class StopSignals:
    """The first SIGINT/SIGTERM asks for a graceful stop, a second exits at once; see the module docstring.

    Use as a context manager around a whole command (from the main thread); ``on_loop`` routes the
    first signal to the command's loop while it runs."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.signum: int | None = None
        """The first signal received (None: none yet)."""
        self._callback: Callable[[int, str], None] | None = None
        self._saved: dict[int, Any] = {}
        self._threads_before: set[threading.Thread] = set()
        self._start_up: asyncio.Task[Any] | None = None
        """The task inside ``start_up()`` (a first signal cancels it)."""
        self._dump: Callable[[], None] | None = None
        """What SIGUSR1 calls (``dumps``); None: nothing to dump."""

    @property
    def status(self) -> int:
        """``128 + N`` for the first signal N (130 for SIGINT, 143 for SIGTERM)."""
        if self.signum is None:
            raise ValueError("StopSignals.status: no signal was received")
        return 128 + self.signum

    @property
    def name(self) -> str:
        return "" if self.signum is None else signal.Signals(self.signum).name

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: a program running us elsewhere keeps its own
        self._threads_before = set(threading.enumerate())
        for sig in STOP_SIGNALS:
            self._saved[sig] = signal.signal(sig, self._on_signal)
        if DUMP_SIGNAL is not None:
            self._saved[DUMP_SIGNAL] = signal.signal(DUMP_SIGNAL, self._on_dump)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _on_signal(self, signum: int, _frame: Any = None) -> None:
        """Both the process-level handler and the loop's (``on_loop``)."""
        if self.signum is not None:
            _say(f"{self.prog}: {signal.Signals(signum).name} again: exiting at once\n")
            _flush()
            os._exit(self.status)
        self.signum = signum
        _say(f"{self.prog}: {signal.Signals(signum).name}: stopping ({signal.Signals(signum).name} again to exit "
             "at once)\n")
        if self._start_up is not None:
            self._start_up.cancel()
        elif self._callback is not None:
            self._callback(signum, signal.Signals(signum).name)

    def _on_dump(self, _signum: int, _frame: Any = None) -> None:
        if self._dump is None:
            _say(f"{self.prog}: SIGUSR1: nothing to dump now\n")
        else:
            self._dump()

    @contextlib.contextmanager
    def dumps(self, request: Callable[[], None]) -> Iterator[None]:
        """While inside, SIGUSR1 calls ``request()``: in the signal handler, on the main thread, so it
        must take no lock and do no I/O (``HangWatch.request_dump`` queues the request). Nothing happens where ``__enter__`` did not
        install the handlers (not the main thread)."""
        previous, self._dump = self._dump, request
        try:
            yield
        finally:
            self._dump = previous

    @contextlib.contextmanager
    def on_loop(self, loop: asyncio.AbstractEventLoop,
                callback: Callable[[int, str], None]) -> Iterator[None]:
        """While inside, the first signal calls ``callback(signum, name)`` on ``loop`` (the running loop,
        in its thread); one received before is delivered at once (on the loop's next turn)."""
        if not self._saved:
            yield  # not installed (not the main thread): nothing reaches us
            return
        self._callback = callback
        # The loop's own handling wakes a loop blocked in its selector; a plain handler
        # would run only when the loop next returns to Python code.
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, int(sig))
        if self.signum is not None:
            loop.call_soon(callback, self.signum, self.name)
        try:
            yield
        finally:
            self._callback = None
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                # remove_signal_handler restores the default action: the command is not over.
                signal.signal(sig, self._on_signal)

    @contextlib.asynccontextmanager
    async def start_up(self) -> AsyncIterator[None]:
        """Start-up work inside is cancelled by a first signal (within ``on_loop``) and raises
        ``StartUpInterrupted``, as it does on entry when a signal came already."""
        if self.signum is not None:
            raise StartUpInterrupted(self.signum)
        task = asyncio.current_task()
        self._start_up = task
        try:
            yield
        except asyncio.CancelledError:
            if self.signum is None or task is None:
                raise  # a cancellation of someone else's
            task.uncancel()
            raise StartUpInterrupted(self.signum) from None
        else:
            if self.signum is not None and task is not None:  # the cancellation was swallowed inside
                if task.cancelling():
                    task.uncancel()
                raise StartUpInterrupted(self.signum)
        finally:
            self._start_up = None

    def leave(self, status: int) -> int:
        """Return ``status`` for ``sys.exit``, or exit now with it where an rlengine worker thread
        that this command started is still alive (see the module docstring; threads a program
        calling us in-process had before are its own)."""
        _flush()
        ours = [t for t in threading.enumerate() if t.name.startswith("rlengine-") and t not in self._threads_before]
        deadline = time.monotonic() + _LEAVE_JOIN_S
        for thread in ours:  # a pool told to stop without waiting ends a moment later
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in ours if t.is_alive()]
        if alive:
            _say(f"{self.prog}: {', '.join(sorted(alive))} still busy after the stop: exiting without "
                 "interpreter finalization\n")
            logging.shutdown()
            os._exit(status)
        return status


async def until_stopped(stop: asyncio.Event, engines: Sequence[Any], prog: str) -> int | None:
    """Wait until ``stop`` is set or one of ``engines`` dies; None for a stop, ``EXIT_ENGINE_DIED``
    (after one line naming the replica and the cause) when an engine died, even where a stop
    came as well: a death is checked first, every ``_WATCH_S`` and once more at the stop."""
    while True:
        for i, engine in enumerate(engines):
            if engine.died is not None:
                print(f"{prog}: engine replica {i} died: {engine.died}", file=sys.stderr, flush=True)
                return EXIT_ENGINE_DIED
        if stop.is_set():
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _WATCH_S)


def _say(text: str) -> None:
    """Write to stderr without Python's buffered writer (a handler may interrupt it mid-write)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
