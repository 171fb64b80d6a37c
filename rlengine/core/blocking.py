"""The install gate's side of the sampler loop: blocking work, run with the sampler asleep.

Weight installs, unloads and training calls queued as blocking work wait at the
head of the FIFO until the scheduler has sealed admission and drained every lease
(or, under the ``pause`` drain policy, paused the running sequences, keeping their
tokens); then ``_run_blocking`` runs the work on the compute thread with the
backend asleep where it can sleep, wakes it, reopens admission and resumes what
was paused on the new weights. A drain that outlasts ``drain_timeout_s`` fails
the work with ``DrainTimeout``. With a timeline the gate's phases (seal, drain,
sleep, the work, reopen, wake) are recorded.

``BlockingWorkPart`` is a part of ``SamplerLoop`` (``rlengine.core.sampler``),
which owns the request tables; this part reads and changes only the state listed
in its class body. Loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from rlengine.backends.base import Backend, BackendRequest
from rlengine.core.compute import ComputeThread
from rlengine.core.records import BlockingWork, SampleRequest, Sequence
from rlengine.core.scheduler import LeaseState, Scheduler
from rlengine.errors import DrainTimeout
from rlengine.seeding import derive_seed
from rlengine.timeline import Timeline, category

__all__ = ["BlockingWorkPart"]


class BlockingWorkPart:
    """Blocking work through the install gate; see the module docstring."""

    # The sampler loop's state this part uses (``SamplerLoop.__init__`` makes it).
    backend: Backend
    compute: ComputeThread
    scheduler: Scheduler
    drain_policy: str
    drain_timeout_s: float
    asleep: bool
    blocking_runs: int
    timeline: Timeline | None
    _requests: dict[str, SampleRequest]
    _seqs: dict[str, Sequence]
    _to_add: list[BackendRequest]
    _to_abort: list[str]
    _paused: list[Sequence]
    _running_blocking: BlockingWork | None
    _stopping: bool
    _tracks: tuple[int, int, int]

    if TYPE_CHECKING:  # provided by ``SamplerLoop``
        async def _run_step(self, step: bool = True) -> None: ...

        def _fail_sample(self, request: SampleRequest, exc: BaseException, unknown: bool) -> None: ...

        def _backend_request(self, seq: Sequence, prompt: bytes) -> BackendRequest: ...

    def _pause_in_flight(self) -> None:
        """Pause policy: abort running sequences in the backend, keeping their tokens."""
        leases = []
        for request in self._requests.values():
            if request.lease is not None and request.lease.state is LeaseState.ACTIVE:
                leases.append(request.lease)
            for seq in request.seqs or ():
                if self._seqs.pop(seq.backend_id, None) is not None:
                    self._to_abort.append(seq.backend_id)
                    self._paused.append(seq)
        # Sequences admitted but not yet sent to the backend are paused too:
        # the abort of an id the backend never saw is a no-op.
        self._to_add.clear()
        self.scheduler.pause_active(leases)

    def _resume_paused(self) -> None:
        """Continue paused sequences on the (new) weights: prompt + tokens so far."""
        resumed, self._paused = self._paused, []
        self.scheduler.resume_paused()
        version = self.scheduler.version
        for seq in resumed:
            request = seq.request
            if request.request_id not in self._requests:
                continue
            if self.scheduler.is_stale(request.version):
                self._fail_sample(request, self.scheduler.stale_error(request), unknown=False)
                continue
            if version is not None and request.lease is not None:
                request.lease.add_version(version)
            seq.seed = derive_seed(seq.seed, seq.length)
            self._seqs[seq.backend_id] = seq
            done = seq.tokens.tobytes() if seq.tokens is not None else b""
            self._to_add.append(self._backend_request(seq, request.spec.prompt + done))

    async def _run_blocking(self, work: BlockingWork) -> None:
        loop = asyncio.get_running_loop()
        # The gate's phases, for the timeline: sealed since the work reached the FIFO's head.
        times = {"arrived": time.monotonic() - self.scheduler.head_waited()} if self.timeline is not None else None
        self.scheduler.pop_head()
        self.scheduler.seal()
        self._running_blocking = work
        noop = work.noop is not None and work.noop()
        try:
            if noop:
                # Nothing to do: in-flight samples keep running, nothing sleeps.
                result = work.after(None) if work.after is not None else None
            else:
                if self._to_abort or self._to_add:
                    await self._run_step(step=False)
                if times is not None:
                    times["drained"] = time.monotonic()
                if not self.asleep and self.backend.capabilities.sleep:
                    await self.compute.submit(loop, self.backend.sleep, 1)
                    self.asleep = True
                    if times is not None:
                        times["slept"] = time.monotonic()
                if work.before is not None:
                    work.before()
                if times is not None:
                    times["ran"] = time.monotonic()
                result = await self.compute.submit(loop, work.run)
                if times is not None:
                    times["ended"] = time.monotonic()
                if work.after is not None:
                    result = work.after(result)
        except Exception as exc:  # noqa: BLE001 - blocking work fails its own future only
            work.future.set_exception(exc)
        else:
            work.future.set_result(result)
        finally:
            self._running_blocking = None
            self.scheduler.reopen()
            self.blocking_runs += 1
            if times is not None and not noop:
                self._record_blocking(work, times)
        # Also after a no-op: it may be the last of a run of blocking entries
        # that put the sampler to sleep or paused requests.
        if self.scheduler.head_blocking() is None and not self._stopping:
            await self._wake_sampler()

    def _record_blocking(self, work: BlockingWork, times: dict[str, float]) -> None:
        """Blocking work's gate phases into the timeline: on the gate's track the whole gating
        (sealed at the head of the FIFO until reopened) with its seal, drain and reopen; on the
        compute thread's track the sampler's sleep and the work itself (its part of a step)."""
        timeline = self.timeline
        if timeline is None:
            return
        compute, gate, _ = self._tracks
        reopened = time.monotonic()
        arrived = times["arrived"]
        timeline.span(gate, f"gate {work.kind}", arrived, reopened, "gate", {"request_id": work.request_id})
        timeline.instant(gate, "seal", arrived)
        if "drained" in times:
            timeline.span(gate, "drain", arrived, times["drained"], "gate")
        if "slept" in times:
            timeline.span(compute, "sleep", times["drained"], times["slept"], "gate")
        if "ran" in times:  # until it returned, or failed (then until the reopen)
            part = category(work.kind)
            timeline.span(compute, work.kind, times["ran"], times.get("ended", reopened), part,
                          {"request_id": work.request_id}, part=part)
        timeline.instant(gate, "reopen", reopened)

    async def _wake_sampler(self) -> None:
        if self.asleep and self.scheduler.version is not None:
            began = time.monotonic()
            await self.compute.submit(asyncio.get_running_loop(), self.backend.wake_up)
            self.asleep = False
            if self.timeline is not None:
                self.timeline.span(self._tracks[0], "wake", began, time.monotonic(), "gate")
        if self._paused:
            self._resume_paused()

    def _blocking_ready(self, head: BlockingWork) -> bool:
        """Whether ``head`` may run now; applies the drain policy and deadline."""
        if head.noop is not None and head.noop():
            return True
        if self.scheduler.quiesced:
            return True
        if self.drain_policy == "pause" and self._requests:
            self._pause_in_flight()
            return self.scheduler.quiesced
        if self.scheduler.head_waited() > self.drain_timeout_s:
            self.scheduler.pop_head()
            head.future.set_exception(DrainTimeout(
                f"{head.kind} {head.request_id}: {self.scheduler.in_flight} lease(s) still running after "
                f"drain_timeout_s={self.drain_timeout_s}"))
        return False
