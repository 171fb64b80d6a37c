"""The engine's lifecycle: start and close, its threads, its backend and trainer.

An ``Engine`` starts once and closes once. ``start`` runs it on a uvloop loop
of its own, on a thread named ``rlengine-loop``; ``start_async`` on the
caller's running loop. Either way start-up builds the backend on the compute
thread (``rlengine.core.compute``; a start cancelled mid-build closes the
backend it made), then the sampler loop (``rlengine.core.sampler``) and, with
``EngineConfig.train_concurrently``, the training lane
(``rlengine.core.training``). Closing is a cascade: the sampler stops (queued
requests settle aborted or failed, those in flight aborted with their partial
tokens), then the lane, the backend and a trainer the engine built close on
their own threads, each wait bounded; past ``close_timeout_s`` whatever is
left fails ``EngineClosed`` rather than leave a caller waiting.

``EngineLifecycle`` is a part of ``Engine`` (``rlengine.core.engine``), which
holds the state; its one job is the above. It hands calls to the loop through
the engine's hand-over (``rlengine.core.submission``: ``_call_soon``,
``_drain_inbox``, ``_fail_inbox``). It imports no torch: backends and
trainers load through the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

from rlengine.backends import SPECS, Backend, load, resolve_backend
from rlengine.config import EngineConfig
from rlengine.core.compute import ComputeThread
from rlengine.core.sampler import SamplerLoop
from rlengine.core.training import TrainingLane
from rlengine.errors import ConfigurationError, EngineClosed, EngineDeadError, RLEngineError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["EngineLifecycle", "new_event_loop"]

_START_TIMEOUT_S = 900.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop event loop (plain asyncio where uvloop is missing): what every
    loop rlengine creates, and what a program driving ``async with Engine`` should run."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EngineLifecycle:
    """Start, close and the threads of an ``Engine``; see the module docstring.

    Why one class: start and close are one cascade in two modes (an owned loop thread, the
    caller's loop): split, each half would have to know the other's states."""

    # The engine's state this part uses (``Engine.__init__`` makes it).
    config: EngineConfig
    model_path: str | None
    _state: str
    _given_backend: Backend | None
    _backend: Backend | None
    _trainer: Any
    _given_trainer: Any
    _spec_name: str
    _loop: asyncio.AbstractEventLoop | None
    _loop_thread: threading.Thread | None
    _loop_ident: int | None
    _ready: threading.Event
    _start_error: BaseException | None
    _compute: ComputeThread | None
    _share_compute: Any
    _lane: TrainingLane | None
    _sampler: SamplerLoop | None
    _serve_task: asyncio.Task[None] | None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        await self.start_async()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self, timeout: float = _START_TIMEOUT_S) -> Self:
        """Start on an owned uvloop loop thread; returns once the backend is up."""
        self._check_new()
        loop = new_event_loop()
        self._loop = loop
        self._loop_thread = threading.Thread(target=self._run_owned_loop, name="rlengine-loop", daemon=True)
        self._loop_thread.start()
        if not self._ready.wait(timeout):
            self._state = "dead"
            raise EngineDeadError(f"the engine did not start within {timeout} s")
        if self._start_error is not None:
            raise self._start_error
        return self

    def _run_owned_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._owned_main())
        finally:
            self._finish_closed()
            loop.run_until_complete(loop.shutdown_asyncgens())
            # The thread the tear-down's waits ran on ends with the loop.
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _owned_main(self) -> None:
        try:
            await self._bring_up()
        except BaseException as exc:  # noqa: BLE001 - a failed start is handed to the starting thread
            self._start_error = exc
            self._state = "dead"
            self._ready.set()
            return
        self._ready.set()
        assert self._serve_task is not None
        await self._serve_task
        await self._tear_down()

    async def start_async(self) -> Self:
        """Start on the caller's running loop (uvloop recommended)."""
        self._check_new()
        self._loop = asyncio.get_running_loop()
        try:
            await self._bring_up()
        except BaseException:
            self._state = "dead"
            raise
        return self

    def _check_new(self) -> None:
        if self._state != "new":
            raise RLEngineError(f"Engine.start: the engine is {self._state}; an Engine starts once")
        self._state = "starting"

    async def _bring_up(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_ident = threading.get_ident()
        self._compute = self._shared_compute(loop) or ComputeThread()
        made: list[Backend] = []

        def build() -> Backend:
            made.append(self._build_backend())
            return made[0]

        def close_unowned() -> None:
            for backend in made:
                if backend is not self._given_backend:
                    with contextlib.suppress(Exception):
                        backend.close()

        try:
            self._backend = await self._compute.submit(loop, build)
        except asyncio.CancelledError:
            # Start-up cancelled mid-build (a stop signal): the build runs on; the backend it makes,
            # which nobody will own, is closed after it on the same thread, and the thread then ends.
            self._compute.submit(loop, close_unowned)
            if self._share_compute is None:
                self._compute.stop(0)
            raise
        self._sampler = SamplerLoop(self._backend, self._compute, continuous=self.config.resolved_continuous(),
                                    drain_policy=self.config.drain_policy,
                                    drain_timeout_s=self.config.drain_timeout_s, seed=self.config.seed)
        mode = self.config.train_concurrently
        if mode != "off":
            device = str(getattr(self._backend, "describe", dict)().get("device", "cpu"))
            if not device.startswith("cuda"):
                self._lane = TrainingLane(ComputeThread("rlengine-trainer"), loop)
            elif mode == "on":
                raise ConfigurationError(f"train_concurrently='on': the sampler runs on {device}, which the trainer "
                                         "shares (training must wait for the sampler to drain there)")
        self._record_timeline()
        self._serve_task = loop.create_task(self._sampler.serve(), name="rlengine-sampler")
        self._state = "running"
        self._drain_inbox()

    def _shared_compute(self, loop: asyncio.AbstractEventLoop) -> ComputeThread | None:
        """The compute thread of ``share_compute`` (None without one): that engine must run, on this loop."""
        other = self._share_compute
        if other is None:
            return None
        if other._state != "running" or other._loop is not loop or other._compute is None:
            raise RLEngineError(f"Engine(share_compute=...): the engine to share a compute thread with is "
                                f"{other._state}{'' if other._loop is loop else ' on another loop'}; it must run "
                                "on this engine's loop")
        return other._compute

    def _build_backend(self) -> Backend:
        """Compute thread: resolve the backend, prepare the model, build the backend."""
        self._spec_name = resolve_backend(self.config)
        spec = SPECS[self._spec_name]
        if spec.prepare is not None:
            self.model_path = load(spec.prepare)(self.config)
        if self.config.placement.kind == "ray":
            if self._given_backend is not None:
                raise ConfigurationError("placement.kind='ray': the replicas build their own backends "
                                         "(Engine(backend=...) is for placement 'local')")
            try:
                from rlengine.backends.ray_replicas import build as build_replicas  # imports Ray: only here
            except ImportError as exc:
                raise ConfigurationError(f"placement.kind='ray' needs Ray ({exc}): pip install 'rlengine[ray]'") \
                    from None

            backend = build_replicas(self.config, self.model_path, self._spec_name)
        else:
            backend = self._given_backend or load(spec.backend)(self.config, self.model_path)
        if self.config.logprobs_mode not in backend.capabilities.logprobs_modes:
            if backend is not self._given_backend:
                backend.close()
            raise ConfigurationError(f"logprobs_mode={self.config.logprobs_mode!r}: backend {backend.name} records "
                                     f"{' or '.join(backend.capabilities.logprobs_modes)} logprobs")
        return backend

    def get_trainer(self) -> Any:
        """The trainer, created on first use (call it from a training call's ``run``, on the thread
        that runs training, as ``TrainingClient`` does)."""
        if self._trainer is None:
            if self.config.placement.trainer_workers > 1:
                if SPECS[self._spec_name].trainer != SPECS["torch"].trainer:
                    raise ConfigurationError(f"placement.trainer_workers={self.config.placement.trainer_workers}: "
                                             f"the sharded trainer is the torch trainer; backend "
                                             f"{self._spec_name!r} trains with another")
                from rlengine.trainer.ray_trainer import build as build_sharded  # imports Ray: only here

                self._trainer = build_sharded(self.config, self.model_path)
            else:
                self._trainer = load(SPECS[self._spec_name].trainer)(self.config, self.model_path)
        return self._trainer

    def close(self, timeout: float | None = None) -> None:
        """Stop: queued requests settle aborted/failed, in-flight ones aborted with
        their partial tokens; returns within about ``timeout`` seconds whatever happens."""
        timeout = self.config.close_timeout_s if timeout is None else timeout
        if self._loop_thread is None:
            if self._state == "running":
                raise RLEngineError("Engine.close: this engine runs on your loop; use 'await engine.aclose()'")
            self._state = "closed"
            return
        if threading.get_ident() == self._loop_ident:
            raise RLEngineError("Engine.close: called on the engine's own loop thread; it would wait for itself")
        if self._state in ("running", "dead"):
            self._state = "closing" if self._state == "running" else self._state
            self._call_soon(self._begin_close)
        self._loop_thread.join(timeout)
        if self._loop_thread.is_alive():
            # Something (a long blocking item, a stuck backend) did not finish in
            # time: fail whatever is left now rather than leave callers waiting.
            self._call_soon(self._force_dead, EngineClosed(f"the engine did not close within {timeout} s"))
            self._loop_thread.join(1.0)
        self._finish_closed()

    async def aclose(self, timeout: float | None = None) -> None:
        """Async-mode close (on the loop the engine runs on)."""
        timeout = self.config.close_timeout_s if timeout is None else timeout
        if self._serve_task is None:
            self._state = "closed"
            return
        if self._state == "running":
            self._state = "closing"
        self._begin_close()
        try:
            await asyncio.wait_for(asyncio.shield(self._serve_task), timeout)
        except TimeoutError:
            self._force_dead(EngineClosed(f"the engine did not close within {timeout} s"))
            self._serve_task.cancel()
        await self._tear_down(timeout)
        self._finish_closed()

    def _begin_close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self._lane is not None:
            self._lane.close(EngineClosed("the engine closed before this training call ran"))

    def _force_dead(self, error: EngineDeadError) -> None:
        if self._sampler is not None:
            self._sampler.die(error)
        if self._lane is not None:
            self._lane.close(error)

    async def _tear_down(self, timeout: float | None = None) -> None:
        timeout = self.config.close_timeout_s if timeout is None else timeout
        compute, backend = self._compute, self._backend
        if compute is None:
            return
        lane = self._lane
        if lane is not None:
            dead = self._sampler.dead if self._sampler is not None else None
            lane.close(dead or EngineClosed("the engine closed before this training call ran"))
        if backend is not None and compute.is_alive():
            # Closing a broken backend must not block shutdown.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(compute.submit(asyncio.get_running_loop(), backend.close), timeout)
        # A trainer this engine built with processes of its own (the sharded one) ends with it.
        close_trainer = getattr(self._trainer, "close", None) if self._trainer is not self._given_trainer else None
        trainer_thread = lane.thread if lane is not None else compute
        if close_trainer is not None and trainer_thread.is_alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(trainer_thread.submit(asyncio.get_running_loop(), close_trainer), timeout)
        if lane is not None:
            await asyncio.to_thread(lane.thread.stop, timeout)
        if self._share_compute is None:  # a shared thread is its owner's to stop
            await asyncio.to_thread(compute.stop, timeout)

    def _finish_closed(self) -> None:
        died = self._sampler is not None and self._sampler.dead is not None \
            and not isinstance(self._sampler.dead, EngineClosed)
        self._state = "dead" if died or self._state == "dead" else "closed"
        # Anything that raced into the inbox after the loop stopped is failed here.
        self._fail_inbox()

    def _started(self) -> SamplerLoop:
        if self._sampler is None:
            raise RLEngineError("the engine is not started")
        return self._sampler
