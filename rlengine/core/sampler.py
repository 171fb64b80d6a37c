"""The sampler loop: admission -> backend steps -> per-request settlement.

One coroutine on the engine's loop thread drives everything that touches
the backend, through the single compute thread:

1. admit what the scheduler allows (stale requests fail fast here);
2. if blocking work heads the FIFO and the scheduler has sealed admission
   and drained every lease (or paused them), run it with the sampler asleep,
   then wake it and reopen;
3. otherwise run one backend step (adds, aborts, ``step()``) on the compute
   thread and settle every request that finished in it, at once: a request's
   future completes the moment its own generation completes (no waves).

This module is the one that changes and settles the engine's per-request
records (``rlengine.core.records``: sample calls and their sequences,
external leases, blocking work): every request it accepts settles exactly
once (completed, aborted or failed), including on shutdown and engine death.
Every sequence's tokens, logprobs and the version that produced each token
accumulate here, as compact arrays. The scheduler owns the leases; this
module settles a lease only through it.

With a timeline (``record_to``: ``rlengine.timeline``) it records each
request at its settlement, each backend job and the install gate's phases
around each piece of blocking work; without one, that is one attribute
check per admission, job and settlement.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from typing import Any

from rlengine.backends.base import Backend, BackendRequest, RequestOutput
from rlengine.core.blocking import BlockingWorkPart
from rlengine.core.compute import ComputeThread
from rlengine.core.futures import RequestFuture, settle_all
from rlengine.core.records import BlockingWork, Entry, LeaseRequest, SampleRequest, Sequence, describe
from rlengine.core.scheduler import LeaseState, Scheduler
from rlengine.errors import (
    BackendRequestError,
    EngineClosed,
    EngineDeadError,
    ReplicaLost,
    RequestAborted,
)
from rlengine.seeding import derive_seed
from rlengine.timeline import Timeline
from rlengine.types import Receipt, SampledSequence, SampleResponse

__all__ = ["SamplerLoop"]

log = logging.getLogger("rlengine")

# Upper bound on backend steps per compute-thread job (see ``_step_job``).
_STEPS_PER_JOB = 64

Outcome = tuple[RequestFuture[Any], bool, Any]
"""(future, ok, result or exception): a settlement, made in bulk by ``settle_all``."""


class SamplerLoop(BlockingWorkPart):
    """Admission, stepping and settlement; loop thread only (but the ``new_*`` constructors).

    Why one class: admission, stepping and settlement change the same request tables, and one
    owner of them on the loop thread is what settles every request exactly once (vLLM's
    ``EngineCore.step`` keeps its phases in one class for the same reason).
    """

    def __init__(self, backend: Backend, compute: ComputeThread, *, continuous: bool, drain_policy: str,
                 drain_timeout_s: float, seed: int) -> None:
        self.backend = backend
        self.compute = compute
        self.scheduler = Scheduler(continuous=continuous, version=0)
        """The FIFO's admission rule, the lease ledger and the install gate (read it on the loop thread)."""
        self.drain_policy = drain_policy
        # Per-step token deltas are only needed to keep the partial tokens of
        # paused requests; otherwise each sequence reports once, finished.
        self._stream = drain_policy == "pause"
        self.drain_timeout_s = drain_timeout_s
        self._rng = random.Random(seed)
        self._seqs: dict[str, Sequence] = {}
        self._requests: dict[str, SampleRequest] = {}
        self._to_add: list[BackendRequest] = []
        self._to_abort: list[str] = []
        self._paused: list[Sequence] = []
        self._wave_hold: list[Outcome] = []
        self._running_blocking: BlockingWork | None = None
        self._wake = asyncio.Event()
        self._interrupt = False
        """Set on the loop when new work arrives; read by the compute thread between steps."""
        self.scheduler.on_drained = self._signal
        self._stopping = False
        self.dead: EngineDeadError | None = None
        self.asleep = False
        self.steps = 0
        self.admitted = 0
        self.blocking_runs = 0
        self.drafted_tokens = self.accepted_tokens = 0
        """Tokens drafted and accepted by speculative decoding, since the engine started."""
        self.busy_s = 0.0
        """Seconds spent running backend steps (the RL loop derives the sampler's idle share)."""
        self.timeline: Timeline | None = None
        """Where requests, backend jobs and gate phases are recorded (``record_to``); None: nowhere,
        at the cost of one attribute check per admission, job and settlement."""
        self._tracks = (0, 0, 0)
        """The timeline's tracks of this sampler: its compute thread, its gate, its requests."""
        self._settling_at = 0.0
        """While a backend job's outputs are applied, when it ended: the settlement time of the requests
        it finished, for the timeline (one clock read per job, not per request); 0 otherwise."""

    def record_to(self, timeline: Timeline | None, label: str = "engine") -> None:
        """Record into ``timeline`` (None: stop), on tracks named after ``label``; any thread."""
        if timeline is not None:
            self._tracks = (timeline.track(f"{label} compute"), timeline.track(f"{label} gate"),
                            timeline.track(f"{label} requests"))
        self.timeline = timeline

    # -- the scheduler, for the engine (loop thread) -------------------------------------

    @property
    def version(self) -> int | None:
        """The policy version loaded in the sampler (None: unloaded)."""
        return self.scheduler.version

    def check_installable(self) -> None:
        """Raise ``GatePoisoned`` while a lease with an unknown outcome exists."""
        self.scheduler.assert_healthy()

    def install_version(self, version: int | None) -> None:
        """Record a weight install (or unload: None); called by blocking work, sealed and drained."""
        self.scheduler.install_version(version)

    def write_off(self, lease_id: int) -> Receipt:
        """Give up on a lease with an unknown outcome (un-poisons the gate for it)."""
        return self.scheduler.write_off(lease_id)

    # -- intake (loop thread) --------------------------------------------------

    def _signal(self) -> None:
        """New work or a state change: wake the loop and end any step run."""
        self._interrupt = True
        self._wake.set()

    def enqueue(self, entry: Entry) -> None:
        if self.dead is not None:
            entry.future.set_exception(self.dead)
            return
        if self._stopping:
            entry.future.set_exception(EngineClosed(f"request {entry.request_id}: the engine is closing"))
            return
        self.scheduler.submit(entry)
        self._signal()

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; it settles as aborted exactly once."""
        entry = self.scheduler.remove(request_id)
        if entry is not None:
            self._settle_unstarted(entry, RequestAborted(f"request {request_id} aborted before it started"))
            return
        request = self._requests.get(request_id)
        if request is not None:
            self._abort_sample(request)
            self._signal()

    def abandon(self, request_id: str, reason: str) -> int | None:
        """Abort a request whose outcome its client can no longer learn.

        Admitted: its lease is marked unknown (poisoning the gate until
        written off) and its sequences are aborted in the same loop callback,
        so no blocking work can start while they still run in the backend.
        Returns that lease's id; None when the request had not started (it
        is simply aborted: nothing ran) or has already settled.
        """
        request = self._requests.get(request_id)
        if request is None or request.lease is None \
                or request.lease.state not in (LeaseState.ACTIVE, LeaseState.PAUSED):
            self.abort(request_id)
            return None
        lease = request.lease
        self.scheduler.mark_unknown(lease, reason)
        self._abort_sample(request)
        self._signal()
        return lease.lease_id

    def _settle_unstarted(self, entry: Entry, exc: BaseException) -> None:
        if isinstance(entry, SampleRequest):
            seqs = tuple(SampledSequence(stop_reason="abort") for _ in range(entry.spec.num_samples))
            entry.future.set_result(SampleResponse(sequences=seqs, request_id=entry.request_id))
        else:
            entry.future.set_exception(exc)

    def _abort_sample(self, request: SampleRequest) -> None:
        """Abort an admitted sample: partial tokens are kept, stop_reason 'abort'."""
        self._forget_sequences(request)
        for seq in request.seqs or ():
            if seq.stop_reason is None:
                seq.stop_reason = "abort"
        self._complete(request, aborted=True)

    def _forget_sequences(self, request: SampleRequest) -> None:
        """Stop tracking ``request``: its running sequences are aborted in the backend."""
        self._requests.pop(request.request_id, None)
        for seq in request.seqs or ():
            if self._seqs.pop(seq.backend_id, None) is not None:
                self._to_abort.append(seq.backend_id)
        if self._paused:
            self._paused = [s for s in self._paused if s.request is not request]

    # -- admission ----------------------------------------------------------------

    def _admit(self) -> None:
        """Start what the scheduler admits: one sequence per sample, each sent to the backend
        with its seed (stale requests fail here, external leases get their lease).

        The per-request hot path: a fresh sequence's backend request is built
        here, not through ``_backend_request`` (which resumed sequences use), and
        a one-sample call skips the loop. Interleaved A/B on the sim backend
        (bench/RESULTS.md): this saves 1.3 us per request over the helper, more
        than the 0.5 us a hand-inlined copy must save to stay;
        ``tests/core/test_sampler.py`` checks that both build the same request.
        """
        admission = self.scheduler.admit()
        for entry in admission.stale:
            entry.future.set_exception(self.scheduler.stale_error(entry))
        max_model_len = self.backend.max_model_len
        requests, seqs, to_add, rng, stream_all = self._requests, self._seqs, self._to_add, self._rng, self._stream
        for request, lease in zip(admission.admitted, admission.leases):
            if type(request) is LeaseRequest:
                request.future.set_result(lease)
                continue
            request.lease = lease
            rid = request.request_id
            requests[rid] = request
            spec = request.spec
            params = spec.params
            base = params.seed
            room = max_model_len - (len(spec.prompt) >> 2)
            max_tokens = params.max_tokens
            if max_tokens is None or max_tokens > room:
                max_tokens = room if room > 0 else 1
            stream = stream_all or request.on_tokens is not None
            affinity = request.session_id or rid  # a session, else this call's samples: one replica
            n = request.remaining = spec.num_samples
            if n == 1:
                seed = rng.getrandbits(63) if base is None else derive_seed(base, 0)
                seq = seqs[rid] = Sequence(request, 0, rid, seed)
                request.seqs = [seq]
                to_add.append(BackendRequest(rid, spec.prompt, params, seed, max_tokens, spec.prompt_logprobs, stream,
                                             spec.prompt_top_logprobs, affinity, spec.prompt_scoring))
            else:
                request.seqs = []
                for i in range(n):
                    seed = rng.getrandbits(63) if base is None else derive_seed(base, i)
                    seq = Sequence(request, i, f"{rid}.{i}", seed)
                    request.seqs.append(seq)
                    seqs[seq.backend_id] = seq
                    to_add.append(BackendRequest(seq.backend_id, spec.prompt, params, seed, max_tokens,
                                                 spec.prompt_logprobs and i == 0, stream,
                                                 spec.prompt_top_logprobs if i == 0 else 0, affinity,
                                                 spec.prompt_scoring if i == 0 else None))
            self.admitted += 1
        if self.timeline is not None:
            now = time.monotonic()
            for request in admission.admitted:
                if type(request) is SampleRequest:
                    request.admitted_at = now

    def _backend_request(self, seq: Sequence, prompt: bytes) -> BackendRequest:
        """The backend request of ``seq``: its prompt (with its tokens so far, when it resumes),
        the tokens still wanted within the context (at least one), and its seed."""
        request = seq.request
        spec = request.spec
        params = spec.params
        room = self.backend.max_model_len - (len(prompt) >> 2)
        want = params.max_tokens if params.max_tokens is not None else room
        first = seq.index == 0 and not seq.length
        return BackendRequest(seq.backend_id, prompt, params, seq.seed, max(1, min(want - seq.length, room)),
                              spec.prompt_logprobs and first, self._stream or request.on_tokens is not None,
                              spec.prompt_top_logprobs if first else 0, request.session_id or request.request_id,
                              spec.prompt_scoring if first else None)

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
        version = self.scheduler.version
        # Cleared before the job starts: anything enqueued from now on stops
        # its step run, so new work waits at most one backend step.
        self._interrupt = False
        timeline = self.timeline
        began = time.monotonic() if timeline is not None else 0.0
        started = time.perf_counter()
        rejected, outs, steps = await self.compute.submit(
            asyncio.get_running_loop(), self._step_job, adds, aborts, step)
        self.busy_s += time.perf_counter() - started
        self.steps += steps
        if timeline is not None:
            self._settling_at = time.monotonic()
            timeline.job(self._tracks[0], began, self._settling_at, steps, len(adds), len(outs), len(self._seqs))
        for backend_id, exc in rejected:
            seq = self._seqs.get(backend_id)
            if seq is not None:
                self._fail_sample(seq.request, exc, unknown=False)
        settled: list[Outcome] = []
        self._apply(outs, -1 if version is None else version, settled)
        self._settling_at = 0.0
        if self._wave_hold and self.scheduler.quiesced:
            settled += self._wave_hold
            self._wave_hold = []
        # Every request that finished in this step is settled before any of
        # their done-callbacks runs (``settle_all``).
        settle_all(settled)

    def _apply(self, outs: list[RequestOutput], version: int, settled: list[Outcome]) -> None:
        seqs = self._seqs
        timed = self.timeline is not None
        for out in outs:
            seq = seqs.get(out.request_id)
            if seq is None:  # aborted while this step ran
                continue
            request = seq.request
            if out.token_ids:
                seq.add(out.token_ids, out.logprobs, version, out.top_ids, out.top_logprobs,
                        adopt=request.on_tokens is None)
                if request.on_tokens is not None:
                    if timed and not request.first_token_at:  # a streamed request's prefill ends here
                        request.first_token_at = self._settling_at
                    self._deliver(seq, out, version)
            if out.drafted_tokens:
                request.drafted += out.drafted_tokens
                request.accepted += out.accepted_tokens
                self.drafted_tokens += out.drafted_tokens
                self.accepted_tokens += out.accepted_tokens
            if out.prompt_logprobs is not None:
                request.prompt_logprobs_raw = array("f", out.prompt_logprobs).tobytes()
            if out.cached_tokens is not None:
                hit = request.prompt_cache_hit_tokens
                request.prompt_cache_hit_tokens = out.cached_tokens if hit is None else min(hit, out.cached_tokens)
            if out.prompt_top_ids is not None:
                request.prompt_top_ids_raw = array("i", out.prompt_top_ids).tobytes()
                request.prompt_top_logprobs_raw = array("f", out.prompt_top_logprobs).tobytes()
            if out.prompt_scores is not None:
                request.prompt_scores = out.prompt_scores
            if out.error is not None:
                if out.lost:
                    self._fail_sample(request, ReplicaLost(f"request {request.request_id}: {out.error}"),
                                      unknown=False, settled=settled)
                else:
                    self._fail_sample(request, BackendRequestError(
                        f"request {request.request_id}: backend failed mid-generation: {out.error}"), unknown=True,
                        settled=settled)
            elif out.finished:
                del seqs[out.request_id]
                seq.stop_reason = out.stop_reason or "stop"
                request.remaining -= 1
                if request.remaining == 0:
                    self._requests.pop(request.request_id, None)
                    self._complete(request, aborted=False, settled=settled)

    def _deliver(self, seq: Sequence, out: RequestOutput, version: int) -> None:
        request = seq.request
        assert request.on_tokens is not None
        try:
            request.on_tokens(seq.index, out.token_ids, out.logprobs, version)
        except Exception:  # a consumer's bug must not kill the sampler
            log.exception("rlengine: on_tokens callback of request %s failed; streaming stops", request.request_id)
            request.on_tokens = None

    def _complete(self, request: SampleRequest, aborted: bool, settled: list[Outcome] | None = None) -> None:
        """Settle ``request`` with its sequences; into ``settled`` when given (a step's batch)."""
        transform = request.spec.params.logprob_transform
        response = SampleResponse(sequences=tuple([s.to_sequence(transform) for s in request.seqs or ()]),
                                  request_id=request.request_id, prompt_logprobs_raw=request.prompt_logprobs_raw,
                                  prompt_top_k=0 if request.prompt_top_ids_raw is None
                                  else request.spec.prompt_top_logprobs,
                                  prompt_top_ids_raw=request.prompt_top_ids_raw,
                                  prompt_top_logprobs_raw=request.prompt_top_logprobs_raw,
                                  prompt_cache_hit_tokens=request.prompt_cache_hit_tokens or 0,
                                  drafted_tokens=request.drafted, accepted_tokens=request.accepted,
                                  prompt_scores=request.prompt_scores)
        if self.timeline is not None:
            self.timeline.request(self._tracks[2], request, "aborted" if aborted else "completed",
                                  self._settling_at or time.monotonic())
        # Break the request <-> sequence cycle: both are untracked Structs, which the
        # cyclic collector never frees (it would keep every request alive).
        request.seqs = None
        lease = request.lease
        if lease is not None and lease.state is not LeaseState.UNKNOWN:
            # The lease already knows its versions: the one at admission and
            # any it was resumed on after a pause. An abandoned request's lease
            # stays unknown (see ``abandon``).
            self.scheduler.settle(lease, "aborted" if aborted else "completed")
        outcome = (request.future, True, response)
        if not self.scheduler.continuous and not aborted:
            self._wave_hold.append(outcome)
        elif settled is not None:
            settled.append(outcome)
        else:
            request.future.set_result(response)

    def _fail_sample(self, request: SampleRequest, exc: BaseException, unknown: bool,
                     settled: list[Outcome] | None = None) -> None:
        """Fail a whole sample call; ``unknown`` poisons its lease until written off."""
        self._forget_sequences(request)
        lease = request.lease
        if lease is not None:
            if unknown:
                self.scheduler.mark_unknown(lease, str(exc))
            elif lease.state is not LeaseState.UNKNOWN:
                self.scheduler.settle(lease, "failed")
        if self.timeline is not None:
            self.timeline.request(self._tracks[2], request, "failed", self._settling_at or time.monotonic())
        request.seqs = None  # the request <-> sequence cycle, as in _complete
        if settled is not None:
            settled.append((request.future, False, exc))
        else:
            request.future.set_exception(exc)

    # -- the loop -------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until ``stop`` (or death); never raises: a crash kills the engine."""
        try:
            while not (self._stopping and not self._seqs and not len(self.scheduler)):
                self._admit()
                head = self.scheduler.head_blocking()
                if head is not None and self._blocking_ready(head):
                    await self._run_blocking(head)
                    continue
                if self._to_add or self._to_abort or self._seqs:
                    await self._run_step(step=bool(self._seqs))
                    continue
                if head is not None:
                    # Waiting for external leases to drain: wake on settlement or deadline.
                    self._wake.clear()
                    left = self.drain_timeout_s - self.scheduler.head_waited()
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
        except BaseException as exc:  # any crash here is engine death
            log.exception("rlengine sampler loop crashed")
            self.die(EngineDeadError(f"engine died: {exc!r}"), cause=exc)

    def stop(self) -> None:
        """Begin shutdown: refuse new work, abort queued and in-flight requests."""
        if self._stopping:
            return
        self._stopping = True
        closed = EngineClosed("the engine closed before this request ran")
        for entry in self.scheduler.drain_pending():
            self._settle_unstarted(entry, closed)
        for request in list(self._requests.values()):
            self._abort_sample(request)
        self._flush_wave()
        self._signal()

    def _flush_wave(self) -> None:
        held, self._wave_hold = self._wave_hold, []
        settle_all(held)

    def die(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        """Fail every pending and in-flight request at once; later ones fail on arrival."""
        if self.dead is not None:
            return
        if cause is not None:
            error.__cause__ = cause
        self.dead = error
        self._stopping = True
        self._flush_wave()
        failed: list[Outcome] = [(entry.future, False, error) for entry in self.scheduler.drain_pending()]
        for request in list(self._requests.values()):
            self._requests.pop(request.request_id, None)
            if request.lease is not None and request.lease.state is not LeaseState.SETTLED:
                self.scheduler.mark_unknown(request.lease, f"engine died: {cause or error}")
            failed.append((request.future, False, error))
        self._seqs.clear()
        self._paused.clear()
        if self._running_blocking is not None:
            failed.append((self._running_blocking.future, False, error))
        settle_all(failed)
        self._signal()

    # -- read-outs from any thread (the hang watch, ``rlengine.core.hangs``) ---------------

    def progress(self) -> tuple[int, int]:
        """(backend steps and blocking calls run: counts kept anyway, nothing added per token; the
        requests and blocking work pending). Any thread: counters and ``len``."""
        return (self.steps + self.blocking_runs,
                len(self._requests) + len(self.scheduler) + (self._running_blocking is not None))

    def snapshot(self) -> dict[str, Any]:
        """For a hang dump: the requests in flight and queued (``records.describe``), the blocking
        work running, the install gate. Any thread, no lock: each table is copied in one C-level step
        (no Python code runs inside, so no loop callback interleaves), then plain attributes are read."""
        now, work = time.monotonic(), self._running_blocking
        return {"requests": [describe(r, now) for r in list(self._requests.values())],
                "queued": [describe(e, now) for e in self.scheduler.queued()],
                "blocking": None if work is None else {**describe(work, now), "state": "running"},
                "asleep": self.asleep, "steps": self.steps, "dead": None if self.dead is None else str(self.dead),
                "gate": self.scheduler.snapshot()}

    def describe(self) -> dict[str, Any]:
        return {"in_flight_sequences": len(self._seqs), "queued": len(self.scheduler),
                "steps": self.steps, "busy_s": self.busy_s, "admitted": self.admitted,
                "blocking_runs": self.blocking_runs,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "asleep": self.asleep,
                "version": self.scheduler.version, "sealed": self.scheduler.sealed}
