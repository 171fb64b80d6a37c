"""The engine's submission API: every call validated in one place and handed to the loop.

Every sample call goes through ``validate_sample`` (prompt length and ids,
the count, the parameters against the backend's capabilities; a typed
``InvalidRequest`` naming the field) and ``submit_sample``; ``sample`` is
the two. The in-process clients, the session layer, the Tinker API and the
RL loop all submit through it. Leases, blocking work, training calls and
calls on the loop are queued the same way.

All engine state lives on the loop thread. A call from another thread is
handed in through a thread-safe inbox drained by one
``call_soon_threadsafe`` per burst, not one per request; a call on the loop
thread goes straight to the sampler loop (``rlengine.core.sampler``), which
owns every request from submission to settlement.

``SubmissionAPI`` is a part of ``Engine`` (``rlengine.core.engine``), which
holds the state; its one job is the above. It imports no torch.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from rlengine.backends import Backend
from rlengine.core.futures import RequestFuture
from rlengine.core.records import Entry, OnTokens, SampleSpec, new_blocking, new_lease, new_sample
from rlengine.core.sampler import SamplerLoop
from rlengine.core.scheduler import Lease
from rlengine.core.training import TrainingLane
from rlengine.errors import ContextLengthExceeded, EngineClosed, InvalidRequest
from rlengine.types import ModelInput, SampleResponse, SamplingParams, int32_bytes

__all__ = ["SubmissionAPI"]


class SubmissionAPI:
    """Validation, submission and the hand-over to the loop of an ``Engine``; see the module docstring."""

    # The engine's state this part uses (``Engine.__init__`` makes it).
    backend: Backend
    _state: str
    _loop: asyncio.AbstractEventLoop | None
    _loop_ident: int | None
    _sampler: SamplerLoop | None
    _lane: TrainingLane | None
    _inbox: deque[Entry | tuple[Callable[..., None], tuple[Any, ...]]]
    _wake_pending: bool
    _ids: itertools.count[int]
    _abort_cb: Callable[[str], None]

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
            self._call_soon(self._lane.submit, future, run, kind)
        return future

    def call_on_loop(self, fn: Callable[..., Any], *args: Any) -> RequestFuture[Any]:
        """Run ``fn(*args)`` on the loop thread (where the scheduler and its leases live); thread-safe."""
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
