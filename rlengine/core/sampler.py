"""The sampler loop: admission -> backend steps -> per-request settlement.

One coroutine on the engine's loop thread drives everything that touches
the backend, through the single compute thread:

1. admit what the scheduler allows (stale requests fail fast here);
2. if blocking work heads the FIFO and the gate is drained (or paused), run
   it with the sampler asleep, then wake it and reopen;
3. otherwise run one backend step (adds, aborts, ``step()``) on the compute
   thread and settle every request that finished in it, at once: a request's
   future completes the moment its own generation completes (no waves).

Every sequence's tokens, logprobs and the version that produced each token
accumulate here, as compact arrays. This module owns settlement: every
request it accepts settles exactly once (completed, aborted or failed),
including on shutdown and engine death.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from array import array
from typing import Any

import msgspec

from rlengine.backends.base import Backend, BackendRequest, RequestOutput
from rlengine.core.compute import ComputeThread
from rlengine.core.scheduler import BlockingItem, Item, LeaseItem, SampleItem, Scheduler
from rlengine.errors import (
    BackendRequestError,
    DrainTimeout,
    EngineClosed,
    EngineDeadError,
    RequestAborted,
)
from rlengine.types import SampledSequence, SampleResponse

__all__ = ["SamplerLoop"]

log = logging.getLogger("rlengine")

_SEED_MASK = (1 << 63) - 1
_I32 = struct.Struct("<i")
# Upper bound on backend steps per compute-thread job (see ``_step_job``).
_STEPS_PER_JOB = 64


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


class _Seq(msgspec.Struct, gc=False):
    """One sequence in flight: a backend request plus what it produced so far.

    An untracked Struct (see ``rlengine.core.scheduler.Lease``): thousands are in
    flight and none is part of a reference cycle.
    """

    item: SampleItem
    index: int
    backend_id: str
    seed: int
    tokens: array | None = None
    logprobs: array | None = None
    version: int | None = None
    """The version of the latest tokens."""
    spans: list[tuple[int, int]] | None = None
    """(first token index, version) per version, once a second version appears
    (only across a pause); None while every token has ``version``."""
    stop_reason: str | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else len(self.tokens)

    def add(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        """Append a report. (A first report of the backend's own arrays is taken over
        without a copy by SamplerLoop._apply, the hot path, and never comes here.)"""
        if self.tokens is None:
            self.tokens = array("i", token_ids)
            self.logprobs = array("f", logprobs)
            self.version = version
            return
        if self.version != version:
            if self.spans is None:
                self.spans = [(0, self.version)]
            self.spans.append((len(self.tokens), version))
            self.version = version
        self.tokens.extend(token_ids)
        assert self.logprobs is not None
        self.logprobs.extend(logprobs)

    def _spans_raw(self) -> bytes:
        """The per-token versions of a sequence whose version changed (``spans``); the
        one-version case is built in ``to_sequence``."""
        assert self.spans is not None
        ends = [start for start, _ in self.spans[1:]] + [self.length]
        return b"".join(_I32.pack(v) * (end - start) for (start, v), end in zip(self.spans, ends))

    def to_sequence(self, stop_reason: str) -> SampledSequence:
        tokens = self.tokens
        if tokens is None:
            return SampledSequence(stop_reason=stop_reason)
        assert self.logprobs is not None
        versions = _I32.pack(self.version) * len(tokens) if self.spans is None else self._spans_raw()
        return SampledSequence(stop_reason=stop_reason, tokens_raw=tokens.tobytes(),
                               logprobs_raw=self.logprobs.tobytes(), versions_raw=versions)


class SamplerLoop:
    """Admission, stepping and settlement; loop thread only."""

    def __init__(self, backend: Backend, compute: ComputeThread, scheduler: Scheduler, *,
                 drain_policy: str, drain_timeout_s: float, seed: int) -> None:
        self.backend = backend
        self.compute = compute
        self.sched = scheduler
        self.drain_policy = drain_policy
        # Per-step token deltas are only needed to keep the partial tokens of
        # paused requests; otherwise each sequence reports once, finished.
        self._stream = drain_policy == "pause"
        self.drain_timeout_s = drain_timeout_s
        self._rng = random.Random(seed)
        self._seqs: dict[str, _Seq] = {}
        self._items: dict[str, SampleItem] = {}
        self._to_add: list[BackendRequest] = []
        self._to_abort: list[str] = []
        self._paused: list[_Seq] = []
        self._wave_hold: list[tuple[SampleItem, SampleResponse]] = []
        self._running_blocking: BlockingItem | None = None
        self._wake = asyncio.Event()
        self._interrupt = False
        """Set on the loop when new work arrives; read by the compute thread between steps."""
        scheduler.on_drained = self._signal
        self._stopping = False
        self.dead: EngineDeadError | None = None
        self.asleep = False
        self.steps = 0
        self.admitted = 0
        self.blocking_runs = 0
        self.busy_s = 0.0
        """Seconds spent running backend steps (the RL loop derives the sampler's idle share)."""

    # -- intake (loop thread) --------------------------------------------------

    def _signal(self) -> None:
        """New work or a state change: wake the loop and end any step run."""
        self._interrupt = True
        self._wake.set()

    def enqueue(self, item: Item) -> None:
        if self.dead is not None:
            item.future.set_exception(self.dead)
            return
        if self._stopping:
            item.future.set_exception(EngineClosed(f"request {item.request_id}: the engine is closing"))
            return
        self.sched.submit(item)
        self._signal()

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; it settles as aborted exactly once."""
        item = self.sched.remove(request_id)
        if item is not None:
            self._settle_unstarted(item, RequestAborted(f"request {request_id} aborted before it started"))
            return
        sample = self._items.get(request_id)
        if sample is not None:
            self._abort_sample(sample)
            self._signal()

    def abandon(self, request_id: str, reason: str) -> int | None:
        """Abort a request whose outcome its client can no longer learn.

        Admitted: its lease is marked unknown (poisoning the gate until
        written off) and its sequences are aborted in the same loop callback,
        so no blocking work can start while they still run in the backend.
        Returns that lease's id; None when the request had not started (it
        is simply aborted: nothing ran) or has already settled.
        """
        item = self._items.get(request_id)
        if item is None or item.lease is None or item.lease.state not in ("active", "paused"):
            self.abort(request_id)
            return None
        lease = item.lease
        lease.mark_unknown(reason)
        self._abort_sample(item)
        self._signal()
        return lease.lease_id

    def _settle_unstarted(self, item: Item, exc: BaseException) -> None:
        if isinstance(item, SampleItem):
            seqs = [SampledSequence(stop_reason="abort") for _ in range(item.num_samples)]
            item.future.set_result(SampleResponse(sequences=tuple(seqs), request_id=item.request_id))
        else:
            item.future.set_exception(exc)

    def _abort_sample(self, item: SampleItem) -> None:
        """Abort an admitted sample: partial tokens are kept, stop_reason 'abort'."""
        self._items.pop(item.request_id, None)
        for seq in item.seqs or ():
            if self._seqs.pop(seq.backend_id, None) is not None:
                self._to_abort.append(seq.backend_id)
            if seq.stop_reason is None:
                seq.stop_reason = "abort"
        self._paused = [s for s in self._paused if s.item is not item]
        self._complete(item, aborted=True)

    # -- admission ----------------------------------------------------------------

    def _admit(self) -> None:
        before = len(self._items)
        admitted, stale = self.sched.admit()
        for item in stale:
            item.future.set_exception(self.sched.stale_error(item))
        version = self.sched.version
        max_model_len = self.backend.max_model_len
        items, seqs, to_add, rng, stream_all = self._items, self._seqs, self._to_add, self._rng, self._stream
        # The per-request hot path: everything a fresh sequence needs is inlined
        # here (resumed ones use _backend_request).
        for item in admitted:
            if type(item) is LeaseItem:
                item.future.set_result(item.lease)
                continue
            rid = item.request_id
            items[rid] = item
            params = item.params
            base = params.seed
            room = max_model_len - (len(item.prompt) >> 2)
            max_tokens = params.max_tokens
            if max_tokens is None or max_tokens > room:
                max_tokens = room if room > 0 else 1
            stream = stream_all or item.on_tokens is not None
            n = item.num_samples
            item.remaining = n
            if n == 1:
                seed = rng.getrandbits(63) if base is None else derive_seed(base, 0)
                seq = _Seq(item, 0, rid, seed)
                item.seqs = [seq]
                seqs[rid] = seq
                to_add.append(BackendRequest(rid, item.prompt, params, seed, max_tokens, item.prompt_logprobs, stream))
            else:
                item.seqs = []
                for i in range(n):
                    seed = rng.getrandbits(63) if base is None else derive_seed(base, i)
                    seq = _Seq(item, i, f"{rid}.{i}", seed)
                    item.seqs.append(seq)
                    seqs[seq.backend_id] = seq
                    to_add.append(BackendRequest(seq.backend_id, item.prompt, params, seed, max_tokens,
                                                 item.prompt_logprobs and i == 0, stream))
            if version is not None:
                # Admitted items always hold a lease; a fresh one has no versions yet.
                item.lease.versions = {version}
        self.admitted += len(items) - before

    def _backend_request(self, seq: _Seq, prompt: bytes, seed: int) -> BackendRequest:
        item = seq.item
        room = self.backend.max_model_len - len(prompt) // 4
        want = item.params.max_tokens if item.params.max_tokens is not None else room
        return BackendRequest(request_id=seq.backend_id, prompt=prompt, params=item.params, seed=seed,
                              max_tokens=max(1, min(want - seq.length, room)),
                              prompt_logprobs=item.prompt_logprobs and seq.index == 0 and not seq.length,
                              stream=self._stream or item.on_tokens is not None)

    # -- stepping -------------------------------------------------------------------

    def _step_job(self, adds: list[BackendRequest], aborts: list[str], step: bool) -> tuple[
            list[tuple[str, BaseException]], list[RequestOutput], int]:
        """Runs on the compute thread: the only place backend requests change.

        Steps until some request reports (finishes, or streams a token), new
        work arrives (``_interrupt``), or ``_STEPS_PER_JOB`` steps ran: with
        non-streaming requests most steps report nothing, and going back to
        the loop after each would cost a thread round trip per step.
        """
        backend = self.backend
        rejected = []
        if aborts:
            backend.abort_request(aborts)
        for req in adds:
            try:
                backend.add_request(req)
            except Exception as exc:  # noqa: BLE001 - a per-request rejection, settled by the loop
                rejected.append((req.request_id, exc))
        outs: list[RequestOutput] = []
        steps = 0
        while step and backend.has_unfinished_requests():
            outs = backend.step()
            steps += 1
            if outs or self._interrupt or steps >= _STEPS_PER_JOB:
                break
        return rejected, outs, steps

    async def _run_step(self, step: bool = True) -> None:
        adds, self._to_add = self._to_add, []
        aborts, self._to_abort = self._to_abort, []
        version = self.sched.version
        # Cleared before the job starts: anything enqueued from now on stops
        # its step run, so new work waits at most one backend step.
        self._interrupt = False
        started = time.perf_counter()
        rejected, outs, steps = await self.compute.submit(
            asyncio.get_running_loop(), self._step_job, adds, aborts, step)
        self.busy_s += time.perf_counter() - started
        self.steps += steps
        for backend_id, exc in rejected:
            seq = self._seqs.get(backend_id)
            if seq is not None:
                self._fail_sample(seq.item, exc, unknown=False)
        self._apply(outs, -1 if version is None else version)
        if self._wave_hold and self.sched.quiesced:
            held, self._wave_hold = self._wave_hold, []
            for item, response in held:
                item.future.set_result(response)

    def _apply(self, outs: list[RequestOutput], version: int) -> None:
        seqs = self._seqs
        for out in outs:
            seq = seqs.get(out.request_id)
            if seq is None:  # aborted while this step ran
                continue
            item = seq.item
            token_ids = out.token_ids
            if token_ids:
                logprobs = out.logprobs
                if seq.tokens is None and type(token_ids) is array and type(logprobs) is array \
                        and token_ids.typecode == "i" and logprobs.typecode == "f":
                    # The hot path (a sequence reporting once, finished): take the
                    # backend's arrays over (see RequestOutput.token_ids).
                    seq.tokens, seq.logprobs, seq.version = token_ids, logprobs, version
                else:
                    seq.add(token_ids, logprobs, version)
                if item.on_tokens is not None:
                    self._deliver(seq, out, version)
            if out.prompt_logprobs is not None:
                item.prompt_logprobs_raw = array("f", out.prompt_logprobs).tobytes()
            if out.error is not None:
                self._fail_sample(item, BackendRequestError(
                    f"request {item.request_id}: backend failed mid-generation: {out.error}"), unknown=True)
            elif out.finished:
                del seqs[out.request_id]
                seq.stop_reason = out.stop_reason or "stop"
                item.remaining -= 1
                if item.remaining == 0:
                    self._items.pop(item.request_id, None)
                    self._complete(item, aborted=False)

    def _deliver(self, seq: _Seq, out: RequestOutput, version: int) -> None:
        try:
            seq.item.on_tokens(seq.index, out.token_ids, out.logprobs, version)
        except Exception:  # noqa: BLE001 - a consumer's bug must not kill the sampler
            log.exception("rlengine: on_tokens callback of request %s failed; streaming stops",
                          seq.item.request_id)
            seq.item.on_tokens = None

    def _complete(self, item: SampleItem, aborted: bool) -> None:
        seqs = item.seqs or ()
        if len(seqs) == 1:
            s = seqs[0]
            sequences: tuple[SampledSequence, ...] = (s.to_sequence(s.stop_reason or "abort"),)
        else:
            sequences = tuple([s.to_sequence(s.stop_reason or "abort") for s in seqs])
        response = SampleResponse(sequences=sequences, request_id=item.request_id,
                                  prompt_logprobs_raw=item.prompt_logprobs_raw)
        # Break the item <-> sequence cycle: both are untracked Structs, which the
        # cyclic collector never frees (it would keep every request alive).
        item.seqs = None
        if item.lease is not None and item.lease.state != "unknown":
            # The lease already knows its versions: the one at admission and
            # any it was resumed on after a pause. An abandoned request's lease
            # stays unknown (see ``abandon``).
            self.sched.release(item.lease, "aborted" if aborted else "completed")
        if not self.sched.continuous and not aborted:
            self._wave_hold.append((item, response))
        else:
            item.future.set_result(response)

    def _fail_sample(self, item: SampleItem, exc: BaseException, unknown: bool) -> None:
        """Fail a whole sample call; ``unknown`` poisons its lease until written off."""
        self._items.pop(item.request_id, None)
        for seq in item.seqs or ():
            if self._seqs.pop(seq.backend_id, None) is not None:
                self._to_abort.append(seq.backend_id)
        self._paused = [s for s in self._paused if s.item is not item]
        if item.lease is not None:
            if unknown:
                item.lease.mark_unknown(str(exc))
            elif item.lease.state != "unknown":
                item.lease.settle("failed")
        item.seqs = None  # the item <-> sequence cycle, as in _complete
        item.future.set_exception(exc)

    # -- blocking work --------------------------------------------------------------

    def _pause_in_flight(self) -> None:
        """Pause policy: abort running sequences in the backend, keeping their tokens."""
        leases = []
        for item in self._items.values():
            if item.lease is not None and item.lease.state == "active":
                leases.append(item.lease)
            for seq in item.seqs or ():
                if self._seqs.pop(seq.backend_id, None) is not None:
                    self._to_abort.append(seq.backend_id)
                    self._paused.append(seq)
        # Sequences admitted but not yet sent to the backend are paused too:
        # the abort of an id the backend never saw is a no-op.
        self._to_add.clear()
        self.sched.pause_active(leases)

    def _resume_paused(self) -> None:
        """Continue paused sequences on the (new) weights: prompt + tokens so far."""
        resumed, self._paused = self._paused, []
        self.sched.resume_paused()
        version = self.sched.version
        for seq in resumed:
            item = seq.item
            if item.request_id not in self._items:
                continue
            if self.sched.is_stale(item.version):
                self._fail_sample(item, self.sched.stale_error(item), unknown=False)
                continue
            if version is not None and item.lease is not None:
                item.lease.add_version(version)
            seq.seed = derive_seed(seq.seed, seq.length)
            self._seqs[seq.backend_id] = seq
            done = seq.tokens.tobytes() if seq.tokens is not None else b""
            self._to_add.append(self._backend_request(seq, item.prompt + done, seq.seed))

    async def _run_blocking(self, item: BlockingItem) -> None:
        loop = asyncio.get_running_loop()
        self.sched.pop_head()
        self.sched.seal()
        self._running_blocking = item
        noop = item.noop is not None and item.noop()
        try:
            if noop:
                # Nothing to do: in-flight samples keep running, nothing sleeps.
                result = item.after(None) if item.after is not None else None
            else:
                if self._to_abort or self._to_add:
                    await self._run_step(step=False)
                if not self.asleep and self.backend.capabilities.sleep:
                    await self.compute.submit(loop, self.backend.sleep, 1)
                    self.asleep = True
                if item.before is not None:
                    item.before()
                result = await self.compute.submit(loop, item.run)
                if item.after is not None:
                    result = item.after(result)
        except Exception as exc:  # noqa: BLE001 - blocking work fails its own future only
            item.future.set_exception(exc)
        else:
            item.future.set_result(result)
        finally:
            self._running_blocking = None
            self.sched.reopen()
            self.blocking_runs += 1
        # Also after a no-op: it may be the last of a run of blocking items
        # that put the sampler to sleep or paused requests.
        if self.sched.head_blocking() is None and not self._stopping:
            await self._wake_sampler()

    async def _wake_sampler(self) -> None:
        if self.asleep and self.sched.version is not None:
            await self.compute.submit(asyncio.get_running_loop(), self.backend.wake_up)
            self.asleep = False
        if self._paused:
            self._resume_paused()

    def _blocking_ready(self, head: BlockingItem) -> bool:
        """Whether ``head`` may run now; applies the drain policy and deadline."""
        if head.noop is not None and head.noop():
            return True
        if self.sched.quiesced:
            return True
        if self.drain_policy == "pause" and self._items:
            self._pause_in_flight()
            return self.sched.quiesced
        assert head.head_since is not None
        if time.monotonic() - head.head_since > self.drain_timeout_s:
            self.sched.pop_head()
            head.future.set_exception(DrainTimeout(
                f"{head.kind} {head.request_id}: {self.sched.in_flight} lease(s) still running after "
                f"drain_timeout_s={self.drain_timeout_s}"))
        return False

    # -- the loop -------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until ``stop`` (or death); never raises: a crash kills the engine."""
        try:
            while not (self._stopping and not self._seqs and not len(self.sched)):
                self._admit()
                head = self.sched.head_blocking()
                if head is not None and self._blocking_ready(head):
                    await self._run_blocking(head)
                    continue
                if self._to_add or self._to_abort or self._seqs:
                    await self._run_step(step=bool(self._seqs))
                    continue
                if head is not None:
                    # Waiting for external leases to drain: wake on settlement or deadline.
                    self._wake.clear()
                    assert head.head_since is not None
                    left = head.head_since + self.drain_timeout_s - time.monotonic()
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.0, left) + 0.001)
                    except TimeoutError:
                        pass
                    continue
                self._wake.clear()
                await self._wake.wait()
            if self._to_abort:
                await self._run_step(step=False)
        except asyncio.CancelledError:
            self.die(EngineClosed("the engine's loop was cancelled"))
            raise
        except BaseException as exc:  # noqa: BLE001 - any crash here is engine death
            log.exception("rlengine sampler loop crashed")
            self.die(EngineDeadError(f"engine died: {exc!r}"), cause=exc)

    def kick(self) -> None:
        self._signal()

    def stop(self) -> None:
        """Begin shutdown: refuse new work, abort queued and in-flight requests."""
        if self._stopping:
            return
        self._stopping = True
        closed = EngineClosed("the engine closed before this request ran")
        for item in self.sched.drain_pending():
            self._settle_unstarted(item, closed)
        for item in list(self._items.values()):
            self._abort_sample(item)
        self._flush_wave()
        self._signal()

    def _flush_wave(self) -> None:
        held, self._wave_hold = self._wave_hold, []
        for item, response in held:
            item.future.set_result(response)

    def die(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        """Fail every pending and in-flight request at once; later ones fail on arrival."""
        if self.dead is not None:
            return
        if cause is not None:
            error.__cause__ = cause
        self.dead = error
        self._stopping = True
        self._flush_wave()
        for item in self.sched.drain_pending():
            item.future.set_exception(error)
        for item in list(self._items.values()):
            self._items.pop(item.request_id, None)
            if item.lease is not None and item.lease.state != "settled":
                item.lease.mark_unknown(f"engine died: {cause or error}")
            item.future.set_exception(error)
        self._seqs.clear()
        self._paused.clear()
        if self._running_blocking is not None:
            self._running_blocking.future.set_exception(error)
        self._signal()

    @property
    def busy(self) -> bool:
        return bool(self._seqs or self._running_blocking or len(self.sched))

    def describe(self) -> dict[str, Any]:
        return {"in_flight_sequences": len(self._seqs), "queued": len(self.sched),
                "steps": self.steps, "busy_s": self.busy_s, "admitted": self.admitted,
                "blocking_runs": self.blocking_runs,
                "asleep": self.asleep,
                "version": self.sched.version, "sealed": self.sched.sealed}

