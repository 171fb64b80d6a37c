"""The embeddable ``Engine``: one event loop, one compute thread, per-request futures.

Two ways to run it:

* ``with Engine(cfg) as engine`` owns a uvloop loop on a dedicated thread;
  synchronous callers wait with ``future.result(timeout)``.
* ``async with Engine(cfg) as engine`` runs on the caller's running loop;
  callers ``await`` the futures.

A second engine on the same loop may run its backend on the first one's
compute thread (``Engine(cfg, share_compute=first)``): a second model slot
(a distillation teacher, ``rlengine.rl.teacher``) whose work queues behind
the first's instead of competing with it for the cores.

Either way all engine state lives on the loop thread. Other threads hand work
in through a thread-safe inbox drained by one ``call_soon_threadsafe`` per
burst (not one per request). Backend steps and training work run on one
compute thread (``rlengine.core.compute``), so the loop stays responsive while the
accelerator (or CPU) computes; with ``EngineConfig.train_concurrently``
training calls get a thread of their own beside it (``rlengine.core.training``).

``Engine`` holds the state and the public read-outs (state, stats, the scheduler
to inspect, the clients); its work is in three parts, one job each:

* ``rlengine.core.lifecycle`` - start and close, the threads, the backend and
  trainer it builds;
* ``rlengine.core.submission`` - the one validated submission path
  (``validate_sample``; ``sample`` = validate + ``submit_sample``) and the
  thread-safe hand-over to the loop;
* ``rlengine.core.installs`` - weight installs and unloads through the
  install gate, and the unknown leases that poison it.

It talks only to the sampler loop (``rlengine.core.sampler``), which owns
every request from submission to settlement and, through its scheduler
(``rlengine.core.scheduler``), admission, the leases and the install gate. It imports no
torch: model backends and trainers are imported lazily.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from rlengine.backends import Backend
from rlengine.config import EngineConfig
from rlengine.core.clients import SamplingClient, TrainingClient
from rlengine.core.compute import ComputeThread
from rlengine.core.installs import WeightInstalls
from rlengine.core.lifecycle import EngineLifecycle, new_event_loop
from rlengine.core.records import Entry
from rlengine.core.sampler import SamplerLoop
from rlengine.core.scheduler import Scheduler
from rlengine.core.submission import SubmissionAPI
from rlengine.core.training import TrainingLane
from rlengine.errors import EngineClosed, RLEngineError
from rlengine.timeline import Timeline

__all__ = ["Engine", "new_event_loop"]


class Engine(EngineLifecycle, SubmissionAPI, WeightInstalls):
    """Inference backend + trainer behind one admission-controlled FIFO; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, *, backend: Backend | None = None,
                 trainer: Any = None, share_compute: Engine | None = None, timeline: Timeline | None = None) -> None:
        self.config = config or EngineConfig()
        self._timeline = timeline
        self._timeline_label = "engine" if timeline is None else timeline.label("engine")
        self._share_compute = share_compute
        """A started engine whose compute thread this one's backend runs on (a second model slot
        beside it: the two models never compute at once); None: a thread of its own."""
        self._given_backend = backend
        self._trainer = trainer
        self._given_trainer = trainer
        self._backend: Backend | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._compute: ComputeThread | None = None
        self._lane: TrainingLane | None = None
        """Training calls' own thread (``EngineConfig.train_concurrently``); None: they are blocking work."""
        self._sampler: SamplerLoop | None = None
        self._serve_task: asyncio.Task[None] | None = None
        # Work handed in from other threads: queued items themselves (the hot
        # path, no wrapper allocated) or (function, args) calls.
        self._inbox: deque[Entry | tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._wake_pending = False
        self._ids = itertools.count(1)
        self._abort_cb = self.abort
        self._state = "new"
        self._next_version = 1
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._spec_name = "sim"
        self.model_path: str | None = None
        """The resolved local model directory (None for the sim backend): load it
        with transformers to get the very same model."""
        self._tokenizer: Any = None

    # -- public state ---------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RLEngineError("the engine is not started: use 'with Engine(...)' or 'async with Engine(...)'")
        return self._backend

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler, to inspect (version, receipts, unknown leases; loop thread
        only; see ``rlengine.core.scheduler``). Changes go through the engine."""
        return self._started().scheduler

    @property
    def gate(self) -> Scheduler:
        """Deprecated: ``scheduler`` (the same object, under its one name)."""
        warnings.warn("Engine.gate is deprecated: use Engine.scheduler", DeprecationWarning, stacklevel=2)
        return self.scheduler

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RLEngineError("the engine is not started")
        return self._loop

    @property
    def state(self) -> str:
        """new, starting, running, closing, closed or dead (crashed; stays dead once closed)."""
        if self._sampler is not None and self._sampler.dead is not None and self._state != "closed":
            return "dead"
        return self._state

    @property
    def died(self) -> BaseException | None:
        """What the engine died of (its backend or compute thread failed); None while it lives
        or after a clean close. Supervisors (health checks, ``rlengine serve``) read it."""
        dead = self._sampler.dead if self._sampler is not None else None
        return None if dead is None or isinstance(dead, EngineClosed) else dead

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (loaded once, offline); None for the sim backend."""
        if self.model_path is None:
            return None
        if self._tokenizer is None:
            from rlengine.backends.torch.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.config.model_name or self.config.model

    def stats(self) -> dict[str, Any]:
        """A snapshot of the sampler's counters (approximate off the loop thread), and with
        ``train_concurrently`` the training lane's (``train_busy_s``, ``train_runs``)."""
        lane = {} if self._lane is None else {"train_busy_s": self._lane.busy_s, "train_runs": self._lane.runs}
        return {"state": self.state, **(self._sampler.describe() if self._sampler else {}), **lane}

    @property
    def timeline(self) -> Timeline | None:
        """Where the engine records its requests, backend jobs, training calls and gate phases
        (``rlengine.timeline``); None: nowhere (the default)."""
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        """Start (or, with None, stop) recording; any thread, while the engine runs too."""
        if timeline is not None and timeline is not self._timeline:
            self._timeline_label = timeline.label("engine")
        self._timeline = timeline
        self._record_timeline()

    def _record_timeline(self) -> None:
        """Hand the timeline to the sampler loop and the training lane (each records its own events)."""
        timeline, label = self._timeline, self._timeline_label
        if self._sampler is not None:
            self._sampler.record_to(timeline, label)
        if self._lane is not None:
            self._lane.track = 0 if timeline is None else timeline.track(f"{label} training")
            self._lane.timeline = timeline

    def progress(self) -> tuple[int, int]:
        """(a count that grows with every backend step, blocking call and training call run, the
        work pending: requests queued or in flight, blocking work, training calls). Safe from any
        thread: the hang watch (``rlengine.core.hangs``) polls it."""
        sampler, lane = self._sampler, self._lane
        done, pending = (0, 0) if sampler is None else sampler.progress()
        if lane is not None:
            done, pending = done + lane.runs, pending + lane.pending
        return done, pending

    def snapshot(self) -> dict[str, Any]:
        """What the engine is doing, for a hang dump (``rlengine.core.hangs``): its state, its
        requests in flight and queued with their ages, the install gate, and what its compute thread
        and training lane run and for how long. Safe from any thread (``SamplerLoop.snapshot``)."""
        out: dict[str, Any] = {"state": self.state, "model": self.model_name,
                               "backend": None if self._backend is None else self._backend.name}
        if self._compute is not None:
            out["compute"] = self._compute.snapshot()
        if self._lane is not None:
            out["training_lane"] = self._lane.snapshot()
        if self._sampler is not None:
            out |= self._sampler.snapshot()
        return out

    # -- clients ----------------------------------------------------------------------------

    def training_client(self) -> TrainingClient:
        return TrainingClient(self)

    def sampling_client(self, version: int | None = None) -> SamplingClient:
        """A sampling client; ``version`` None follows whatever is loaded."""
        return SamplingClient(self, version)
