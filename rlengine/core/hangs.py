"""The hang watch: when a process stops making progress, a dump of what it is doing.

Progress is a token sampled, a request settled or a training call finished.
When work is pending and none of these has happened for ``timeout_s``, the
watch writes a dump (``hang-<time>-<pid>-<n>.json``) to its directory (the
run directory of ``rlengine train``; ``--dump-dir`` or the state directory of
``rlengine serve``) and prints one line on stderr naming the file. It never
stops anything, and it dumps once per hang: the next progress re-arms it.
``request_dump`` writes the same dump on demand (SIGUSR1, installed through
``rlengine.signals``).

A dump holds every thread's stack (names and frames, innermost last), and
per watched subject its ``snapshot()``: for an engine (``Engine.snapshot``)
the requests in flight and queued with their ages and states, the install
gate, the blocking work running, what the compute thread and the training
lane run and for how long; for an RL run its books and its sandboxes'
workers (pid, alive, the episodes in flight on each). Sources added with
``add_source`` are further sections (a timeline's recent events, say).

Cost on the hot path: nothing per token. The watch polls counters the
engines keep anyway (``Engine.progress``: backend steps, blocking calls and
training calls run, and the work pending) from a thread of its own,
``rlengine-hang-watch``, every second (a quarter of the timeout when that is
shorter). A count that moved is progress, seen at the poll after it; a
backend step shows when its compute job returns to the loop, after at most
64 steps (``rlengine.core.sampler``). Idle time is no hang: the quiet clock
starts again at every poll that finds nothing pending.

The automatic timeout (``timeout_s=None``) is ``max(120 s, 10 x the longest
quiet spell seen so far while work was pending)``: 120 s is well above one
backend step or training call of the models this engine trains on one node,
and the factor follows what the run shows (slow environments, long training
calls), measured by the watch itself at no cost to the run. A false alarm
costs one file and one line.

Reading from a thread that is not the loop's: the read-outs (``snapshot``
of the engine, the sampler, the scheduler, the sandbox pool) copy each
table in one C-level step (``list(d.values())``, ``list(deque)``), which
runs no Python code and so cannot interleave with a loop callback under the
GIL, then read plain attributes of the copied records; figures may be a
moment apart, never torn containers. Each section is read on its own, and
one that fails all the same (a race no copy covered) holds its error
instead of failing the dump. Nothing takes a lock of the loop's or waits
for it, so a dump is written while the loop itself is stuck.

This module reads; it changes no engine state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from rlengine.validation import check_number

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AUTO_FACTOR", "AUTO_FLOOR_S", "HangWatch", "Watched", "task_stacks", "thread_stacks"]

AUTO_FLOOR_S = 120.0
"""The automatic timeout's least value (seconds)."""
AUTO_FACTOR = 10.0
"""The automatic timeout is this many times the longest quiet spell seen (when above ``AUTO_FLOOR_S``)."""
_POLL_S = 1.0
_encode = msgspec.json.Encoder(enc_hook=repr).encode


class Watched(Protocol):
    """What the watch reads of a subject (an ``Engine``, an RL run), from its own thread."""

    def progress(self) -> tuple[int, int]:
        """(a count that grows with every unit of progress, the work pending now)."""

    def snapshot(self) -> Any:
        """What it is doing, for the dump (JSON-able; safe from any thread)."""


def thread_stacks() -> list[dict[str, Any]]:
    """Every thread's name and Python stack (frames innermost last: file, line, function, code)."""
    frames = sys._current_frames()
    named = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        thread = named.get(ident)
        stack = [{"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line}
                 for f in traceback.extract_stack(frame)]
        out.append({"name": thread.name if thread is not None else f"<thread {ident}>", "ident": ident,
                    "daemon": None if thread is None else thread.daemon, "stack": stack})
    return sorted(out, key=lambda t: t["name"])


def task_stacks(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    """The unfinished tasks of ``loop``: name, the await chain of each (frames outermost first:
    file, line, function) and what its innermost coroutine awaits (the task's future, where asyncio
    keeps one: a future's iterator would say nothing).

    From any thread: ``asyncio.all_tasks`` copies its weak set (retrying if the loop changes it
    meanwhile); a suspended coroutine's frame does not move while it is read."""
    out = []
    for task in asyncio.all_tasks(loop):
        frames: list[dict[str, Any]] = []
        awaits: Any = task.get_coro()
        while len(frames) < 64 and hasattr(awaits, "cr_await"):  # coroutines (and their await chains)
            frame = awaits.cr_frame
            if frame is not None:
                frames.append({"file": frame.f_code.co_filename, "line": frame.f_lineno,
                               "function": frame.f_code.co_name})
            awaits = awaits.cr_await
        if awaits is not None and not hasattr(awaits, "cr_await"):
            awaits = getattr(task, "_fut_waiter", None) or awaits
        out.append({"name": task.get_name(), "stack": frames,
                    "awaiting": None if awaits is None else repr(awaits)[:300]})
    return sorted(out, key=lambda t: t["name"])


class HangWatch:
    """Watches subjects for progress and dumps them when they hang; see the module docstring.

    ``directory``: where dumps go (made when the first is written), or a function that names it
    when a dump is written (one that raises costs that dump, reported in its line); ``prog``: the
    stderr line's prefix; ``timeout_s``: None for the automatic timeout, 0 for no automatic dumps
    (on demand only), else seconds (``setting`` names it in an error). Use as a context manager
    (or ``start``/``stop``) from any thread; subjects and sources may be added while it runs."""

    def __init__(self, directory: str | Callable[[], str], *, prog: str, timeout_s: float | None = None,
                 setting: str = "hang_timeout_s") -> None:
        if timeout_s is not None:
            check_number(setting, timeout_s, minimum=0)
        self.directory = directory
        self.prog = prog
        self.fixed_timeout_s = None if timeout_s is None else float(timeout_s)
        self._interval = _POLL_S if not self.fixed_timeout_s else min(_POLL_S, self.fixed_timeout_s / 4)
        self._subjects: dict[str, Watched] = {}
        self._sources: dict[str, Callable[[], Any]] = {}
        self._asked: collections.deque[str] = collections.deque()
        """Reasons for dumps on demand (``request_dump``): an append, safe in a signal handler, taken
        by the watch's thread with ``popleft`` (both atomic, so no request is lost between them)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._numbers = itertools.count(1)
        self.longest_quiet_s = 0.0
        """The longest quiet spell (no progress while work was pending) seen so far, in seconds."""
        self._seen: tuple[int, float] | None = None
        """The progress count at the last poll, and when it last changed (or work was last idle)."""
        self._quiet_s = 0.0
        self._armed = True
        self.dumps: list[str] = []
        """The files written, oldest first."""

    # -- what is watched ----------------------------------------------------------------------

    def watch(self, name: str, subject: Watched) -> None:
        """Watch ``subject``'s progress and put its ``snapshot()`` in every dump, under ``name``."""
        self._subjects = {**self._subjects, name: subject}  # replaced whole: the watch thread reads it unlocked

    def add_source(self, name: str, read: Callable[[], Any]) -> None:
        """Put ``read()`` in every dump under ``name`` (called on the watch's thread: safe from any thread)."""
        self._sources = {**self._sources, name: read}

    @property
    def timeout_s(self) -> float:
        """The timeout in force now (0: no automatic dumps)."""
        if self.fixed_timeout_s is not None:
            return self.fixed_timeout_s
        return max(AUTO_FLOOR_S, AUTO_FACTOR * self.longest_quiet_s)

    # -- running --------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlengine-hang-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (a dump being written is finished first, within a bound)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request_dump(self, reason: str = "SIGUSR1") -> None:
        """Have the watch's thread write a dump at its next poll (within a second). Safe in a
        signal handler: one append, no lock, no I/O."""
        self._asked.append(reason)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            while self._asked:
                asked = self._asked.popleft()
                self._write(asked, f"dump ({asked})")
            self._check(time.monotonic())

    def _progress(self) -> tuple[int, int]:
        done = pending = 0
        for subject in self._subjects.values():
            d, p = subject.progress()
            done, pending = done + d, pending + p
        return done, pending

    def _check(self, now: float) -> None:
        """One poll: measure the quiet spell; dump once when it passes the timeout while work is pending."""
        done, pending = self._progress()
        seen = self._seen
        if seen is None or done != seen[0] or not pending:
            if seen is not None and done != seen[0] and pending and self._armed:
                # A spell ended by progress (not by idleness, nor one already dumped as a hang):
                # the automatic timeout learns from it.
                self.longest_quiet_s = max(self.longest_quiet_s, self._quiet_s)
            self._seen, self._quiet_s, self._armed = (done, now), 0.0, True
            return
        self._quiet_s = now - seen[1]
        timeout = self.timeout_s
        if self._armed and timeout and self._quiet_s > timeout:
            self._armed = False
            self._write(f"no progress for {self._quiet_s:.1f} s with {pending} item(s) pending "
                        f"(timeout {timeout:g} s)", f"possible hang, no progress for {self._quiet_s:.0f} s")

    # -- the dump -----------------------------------------------------------------------------

    def dump(self, reason: str) -> str:
        """Write a dump now (from any thread) and return its path; no stderr line."""
        document: dict[str, Any] = {
            "reason": reason, "prog": self.prog, "pid": os.getpid(),
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "monotonic": time.monotonic(), "quiet_s": self._quiet_s, "timeout_s": self.timeout_s,
            "longest_quiet_s": self.longest_quiet_s}
        document["threads"] = _section(thread_stacks)
        for name, subject in self._subjects.items():
            document[name] = _section(subject.snapshot)
        for name, read in self._sources.items():
            document[name] = _section(read)
        directory = os.path.abspath(self.directory if isinstance(self.directory, str) else self.directory())
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(directory, f"hang-{stamp}-{os.getpid()}-{next(self._numbers)}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:  # then renamed: a reader never sees half a dump
            f.write(msgspec.json.format(_encode(document), indent=1))
        os.replace(tmp, path)
        self.dumps.append(path)
        return path

    def _write(self, reason: str, short: str) -> None:
        """A dump and its one stderr line; a dump that cannot be written is one line too, never a crash."""
        try:
            path = self.dump(reason)
        except Exception as exc:  # noqa: BLE001 - the watch must outlive a full disk
            _say(f"{self.prog}: {short}: cannot write a hang dump: {exc}\n")
            return
        _say(f"{self.prog}: {short}: hang dump written to {path}\n")


def _section(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
        return {"error": f"{type(exc).__name__}: {exc}"}


def _say(text: str) -> None:
    """One write to stderr's descriptor: no lock of Python's buffered writer is taken."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
