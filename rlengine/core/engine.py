"""The embeddable ``Engine``: one event loop, one compute thread, per-request futures.

Two ways to run it:

* ``with Engine(cfg) as engine`` owns a uvloop loop on a dedicated thread;
  synchronous callers wait with ``future.result(timeout)``.
* ``async with Engine(cfg) as engine`` runs on the caller's running loop;
  callers ``await`` the futures.

Either way all engine state lives on the loop thread. Other threads hand work
in through a thread-safe inbox drained by one ``call_soon_threadsafe`` per
burst (not one per request). Backend steps and training work run on one
compute thread (``rlengine.core.compute``), so the loop stays responsive while the
accelerator (or CPU) computes; with ``EngineConfig.train_concurrently``
training calls get a thread of their own beside it (``rlengine.core.training``).

This module owns lifecycle and submission, and validates every sample call
in one place (``validate_sample``; ``sample`` = validate + ``submit_sample``):
the in-process clients, the session layer, the Tinker API and the RL loop all
submit through it. It talks only to the sampler loop (``rlengine.core.sampler``),
which owns every request from submission to settlement and, through its
scheduler (``rlengine.core.scheduler``), admission and the request gate. It
imports no torch: model backends and trainers are imported lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from rlengine.backends import SPECS, Backend, load, resolve_backend
from rlengine.config import EngineConfig
from rlengine.core.clients import SamplingClient, TrainingClient
from rlengine.core.compute import ComputeThread
from rlengine.core.futures import RequestFuture
from rlengine.core.records import Entry, OnTokens, SampleSpec, new_blocking, new_lease, new_sample
from rlengine.core.sampler import SamplerLoop
from rlengine.core.scheduler import Lease, Scheduler
from rlengine.core.training import TrainingLane, snapshot
from rlengine.errors import (
    ConfigurationError,
    ContextLengthExceeded,
    EngineClosed,
    EngineDeadError,
    InvalidRequest,
    RLEngineError,
)
from rlengine.types import ModelInput, SampleResponse, SamplingParams, UnloadModelResponse, int32_bytes

if TYPE_CHECKING:
    from typing_extensions import Self


__all__ = ["Engine", "new_event_loop"]

_START_TIMEOUT_S = 900.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop event loop (plain asyncio where uvloop is missing): what every
    loop rlengine creates, and what a program driving ``async with Engine`` should run."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Engine:
    """Inference backend + trainer behind one admission-controlled FIFO."""

    def __init__(self, config: EngineConfig | None = None, *, backend: Backend | None = None,
                 trainer: Any = None) -> None:
        self.config = config or EngineConfig()
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
        self._tokenizer: Any = None
        """The resolved local model directory (None for the sim backend): load it
        with transformers to get the very same model."""

    # -- lifecycle ------------------------------------------------------------------

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

    def start(self, timeout: float = _START_TIMEOUT_S) -> Engine:
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

    async def start_async(self) -> Engine:
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
        self._compute = ComputeThread()
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
        self._serve_task = loop.create_task(self._sampler.serve(), name="rlengine-sampler")
        self._state = "running"
        self._drain_inbox()

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
        await asyncio.to_thread(compute.stop, timeout)

    def _finish_closed(self) -> None:
        died = self._sampler is not None and self._sampler.dead is not None \
            and not isinstance(self._sampler.dead, EngineClosed)
        self._state = "dead" if died or self._state == "dead" else "closed"
        # Anything that raced into the inbox after the loop stopped is failed here.
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        dead = self._sampler.dead if self._sampler is not None else None
        error = dead or EngineClosed("the engine is closed")
        while self._inbox:
            try:
                entry = self._inbox.popleft()
            except IndexError:
                return
            if type(entry) is not tuple:
                entry.future.set_exception(error)

    # -- thread-safe hand-over to the loop ---------------------------------------------

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread: directly if we are on it."""
        if threading.get_ident() == self._loop_ident:
            fn(*args)
            return
        self._hand_in((fn, args))

    def _hand_in(self, entry: Entry | tuple[Callable[..., None], tuple[Any, ...]]) -> None:
        self._inbox.append(entry)
        if self._state in ("closed", "dead") and (self._loop is None or not self._loop.is_running()):
            self._fail_inbox()
            return
        if not self._wake_pending and self._loop is not None:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._drain_inbox)
            except RuntimeError:  # the loop is closed
                self._fail_inbox()

    def _drain_inbox(self) -> None:
        # Clear the flag before draining: a producer that appends after this
        # point schedules another drain, so nothing is left behind.
        self._wake_pending = False
        inbox = self._inbox
        enqueue = self._sampler.enqueue if self._sampler is not None else None
        while inbox:
            entry = inbox.popleft()
            if type(entry) is tuple:
                entry[0](*entry[1])
            else:
                assert enqueue is not None
                enqueue(entry)

    def _submit(self, item: Entry) -> RequestFuture[Any]:
        if self._state not in ("running", "closing"):
            error = self._sampler.dead if self._sampler is not None and self._sampler.dead else None
            item.future.set_exception(error or EngineClosed(
                f"request {item.request_id}: the engine is {self._state}"))
            return item.future
        if threading.get_ident() == self._loop_ident:
            assert self._sampler is not None
            self._sampler.enqueue(item)
        else:
            self._hand_in(item)
        return item.future

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    # -- public state ---------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RLEngineError("the engine is not started: use 'with Engine(...)' or 'async with Engine(...)'")
        return self._backend

    @property
    def gate(self) -> Scheduler:
        """The request gate, to inspect (version, receipts, unknown leases; loop thread
        only; see ``rlengine.core.scheduler``). Changes go through the engine."""
        return self._started().gate

    def _started(self) -> SamplerLoop:
        if self._sampler is None:
            raise RLEngineError("the engine is not started")
        return self._sampler

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

    # -- requests -------------------------------------------------------------------------

    def _prompt_bytes(self, prompt: Any) -> bytes:
        raw = prompt.tokens_raw if isinstance(prompt, ModelInput) else int32_bytes("prompt", prompt)
        n = len(raw) >> 2
        if n == 0:
            raise InvalidRequest("prompt", "[]", "must hold at least one token")
        backend = self.backend
        if n >= backend.max_model_len:
            raise ContextLengthExceeded("prompt.length", n, backend.max_model_len,
                                        f"the prompt holds {n} tokens (it must leave room for one to generate)")
        if n < 256:  # short prompts: min() and max() over a memoryview beat numpy's call overhead
            ids = memoryview(raw).cast("i")
            low, top = min(ids), max(ids)
        else:
            values = np.frombuffer(raw, dtype=np.int32)
            low, top = int(values.min()), int(values.max())
        if top >= backend.vocab_size:
            raise InvalidRequest("prompt", top, f"token id >= vocab size {backend.vocab_size}")
        if low < 0:  # raw int32 (from a wire) can hold what ModelInput.from_ints refuses
            raise InvalidRequest("prompt", low, "token ids must be >= 0")
        return raw

    def validate_sample(self, prompt: Any, num_samples: int = 1, sampling_params: SamplingParams | None = None,
                        *, include_prompt_logprobs: bool = False, prompt_top_logprobs: int = 0) -> SampleSpec:
        """Check a sample call against this engine (prompt length and ids, the count,
        the parameters against the backend's capabilities); raises ``InvalidRequest``
        naming the field. The one place these rules are written; thread-safe.
        ``prompt_top_logprobs`` k > 0 also asks for the k most likely tokens at every
        prompt position after the first (``SampleResponse.prompt_top_logprobs``)."""
        raw = self._prompt_bytes(prompt)
        if type(num_samples) is not int or num_samples < 1:  # a bool is refused too
            raise InvalidRequest("num_samples", num_samples, "must be an integer >= 1")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("sampling_params", type(params).__name__, "must be a SamplingParams")
        if params.stop is not None and params.stop_strings and not self.backend.capabilities.stop_strings:
            raise InvalidRequest("sampling_params.stop", params.stop, f"backend {self.backend.name} has no stop strings")
        if params.top_logprobs > self.backend.capabilities.top_logprobs:
            raise InvalidRequest("sampling_params.top_logprobs", params.top_logprobs,
                                 f"backend {self.backend.name} reports at most "
                                 f"{self.backend.capabilities.top_logprobs}")
        if params.constraint is not None and not self.backend.capabilities.constraints:
            raise InvalidRequest("sampling_params.constraint", params.constraint[:60],
                                 f"backend {self.backend.name} has no constrained decoding")
        modes = self.backend.capabilities.logprobs_modes
        if params.logprobs_mode is None:
            if modes[0] != "raw":  # None means raw downstream
                params = msgspec.structs.replace(params, logprobs_mode=modes[0])
        elif params.logprobs_mode not in modes:
            raise InvalidRequest("sampling_params.logprobs_mode", params.logprobs_mode,
                                 f"backend {self.backend.name} records {' or '.join(modes)} logprobs")
        k, cap = prompt_top_logprobs, self.backend.capabilities.prompt_top_logprobs
        if type(k) is not int or not 0 <= k <= cap:
            raise InvalidRequest("prompt_top_logprobs", k, f"must be an integer in [0, {cap}] (backend "
                                 f"{self.backend.name} reports at most {cap})")
        return SampleSpec(raw, num_samples, params, bool(include_prompt_logprobs), k)

    def submit_sample(self, spec: SampleSpec, *, version: int | None = None, session_id: str | None = None,
                      on_tokens: OnTokens | None = None) -> RequestFuture[SampleResponse]:
        """Queue a validated sample call (``validate_sample``); thread-safe. Its future
        completes when its own ``num_samples`` generations complete. ``version`` pins a
        sampler version (None: whatever is loaded at admission). ``on_tokens(index,
        token_ids, logprobs, version)`` streams: it is called on the loop thread with
        each sequence's new tokens as they are produced (keep it short)."""
        if not isinstance(spec, SampleSpec):
            raise InvalidRequest("spec", type(spec).__name__, "must come from Engine.validate_sample")
        return self._submit(new_sample(self._new_id("s"), spec, version, session_id, on_tokens, self._abort_cb))

    def sample(self, prompt: Any, num_samples: int = 1, sampling_params: SamplingParams | None = None, *,
               version: int | None = None, session_id: str | None = None,
               include_prompt_logprobs: bool = False, prompt_top_logprobs: int = 0,
               on_tokens: OnTokens | None = None) -> RequestFuture[SampleResponse]:
        """Queue one sample call: ``validate_sample`` then ``submit_sample``; thread-safe."""
        spec = self.validate_sample(prompt, num_samples, sampling_params,
                                    include_prompt_logprobs=include_prompt_logprobs,
                                    prompt_top_logprobs=prompt_top_logprobs)
        return self.submit_sample(spec, version=version, session_id=session_id, on_tokens=on_tokens)

    def lease(self, session_id: str | None = None, version: int | None = None) -> RequestFuture[Lease]:
        """Queue for an external lease (a session turn driven outside the engine).

        It is admitted by the same FIFO rule as samples; the holder must
        ``settle`` it (or ``mark_unknown``) on the loop thread.
        """
        return self._submit(new_lease(self._new_id("l"), session_id, version, self._abort_cb))

    def abort(self, request_id: str) -> None:
        """Abort a request by id, wherever it is (thread-safe; idempotent)."""
        if self._sampler is not None and self._state in ("running", "closing"):
            self._call_soon(self._sampler.abort, request_id)

    def submit_blocking(self, kind: str, run: Callable[[], Any], *, noop: Callable[[], bool] | None = None,
                        before: Callable[[], None] | None = None,
                        after: Callable[[Any], Any] | None = None) -> RequestFuture[Any]:
        """Queue blocking work: it runs on the compute thread with the sampler drained."""
        return self._submit(new_blocking(self._new_id("b"), kind, run, self._abort_cb, noop=noop, before=before,
                                         after=after))

    def submit_training(self, kind: str, run: Callable[[], Any]) -> RequestFuture[Any]:
        """Queue a training call: on the training lane when training runs concurrently
        (``EngineConfig.train_concurrently``), else as blocking work. Calls run in submission
        order either way; thread-safe."""
        if self._lane is None:
            return self.submit_blocking(kind, run)
        future: RequestFuture[Any] = RequestFuture(self._new_id("t"))
        dead = self._sampler.dead if self._sampler is not None else None
        if self._state not in ("running", "closing") or dead is not None:
            future.set_exception(dead or EngineClosed(f"{kind}: the engine is {self._state}"))
        else:
            self._call_soon(self._lane.submit, future, run)
        return future

    def install_weights(self, weights: Callable[[], Any]) -> RequestFuture[int]:
        """Install ``weights()`` (named tensors, taken where training runs) as the next policy
        version, through the gate: seal, drain, install, reopen. With a training lane the
        weights are copied there first, after the training calls queued before this install,
        then installed on the compute thread."""
        if self._lane is None:
            return self._install(weights)
        taken = self.submit_training("weights", lambda: snapshot(weights()))
        out: RequestFuture[int] = RequestFuture(taken.request_id)

        def install(f: RequestFuture[Any]) -> None:
            error = f.exception(0)
            if error is not None:
                out.set_exception(error)
            else:
                copy = f.result(0)
                out.adopt(self._install(lambda: copy))

        taken.add_done_callback(install)
        return out

    def _install(self, weights: Callable[[], Any]) -> RequestFuture[int]:
        box: dict[str, int] = {}

        def before() -> None:
            self._started().check_installable()
            box["version"] = self._next_version

        def run() -> int:
            version = box["version"]
            self.backend.load_weights(weights(), version)
            return version

        def after(version: int) -> int:
            self._started().install_version(version)
            self._next_version = version + 1
            return version

        return self.submit_blocking("install", run, before=before, after=after)

    def unload(self) -> RequestFuture[UnloadModelResponse]:
        """Unload the sampler's model; later samples fail with ``ModelNotLoaded``
        until the next weight install. A no-op (nothing loaded) does not drain."""

        def run() -> bool:
            if self.backend.capabilities.sleep:
                self.backend.sleep(2)
            return True

        def after(_: bool) -> UnloadModelResponse:
            sampler = self._started()
            if sampler.version is None:
                return UnloadModelResponse(unloaded=False)
            sampler.install_version(None)
            return UnloadModelResponse(unloaded=True)

        def noop() -> bool:
            return self._started().version is None

        return self.submit_blocking("unload", run, noop=noop, after=after)

    def call_on_loop(self, fn: Callable[..., Any], *args: Any) -> RequestFuture[Any]:
        """Run ``fn(*args)`` on the loop thread (where gate and leases live); thread-safe."""
        future: RequestFuture[Any] = RequestFuture(self._new_id("c"))

        def call() -> None:
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                future.set_exception(exc)

        if self._state not in ("running", "closing"):
            future.set_exception(EngineClosed(f"the engine is {self._state}"))
        else:
            self._call_soon(call)
        return future

    def abandon(self, request_id: str, reason: str) -> RequestFuture[int | None]:
        """Abort a sample whose client went away mid-generation: its outcome is
        unknown, so its lease (if admitted) stays unknown and poisons the gate
        until ``write_off``. Resolves to that lease id, or None if the request
        had not started or had already settled (then nothing is poisoned)."""
        return self.call_on_loop(self._started().abandon, request_id, reason)

    def write_off(self, lease_id: int) -> RequestFuture[Any]:
        """Give up on a lease with an unknown outcome (un-poisons the gate for it)."""
        return self.call_on_loop(self._started().write_off, lease_id)

    def training_client(self) -> TrainingClient:
        return TrainingClient(self)

    def sampling_client(self, version: int | None = None) -> SamplingClient:
        """A sampling client; ``version`` None follows whatever is loaded."""
        return SamplingClient(self, version)
