"""The training-loop stage of a run: one RL step, top-down.

``TrainingLoop._train_step`` is the step, in the order it happens; each phase
is one method below it, in the same order, and each hands its data down to
``StepBatch`` (``rlengine.rl.batch``), which queues training calls and never
calls back:

1. **gather** ``groups_per_batch`` groups from the rollout workers into a
   ``StepBatch`` (in a reproducible run, only groups of the step's own batch);
   each passes one intake (``StepBatch.intake``): stale groups, failures,
   advantages, datums. A group sent back (stale, or constant under dynamic
   sampling) goes to the dataloader to be issued again;
2. **recompute** (``TrainConfig.recomputes``): the trainer's logprobs of the
   step's datums, before its first update;
3. **submit** the step's ``forward_backward`` and optimizer calls;
4. **install**: once the evaluations asked for have sampled (and, in a
   reproducible off-policy run, the batches released before this install),
   the new weights through the gate, queued after the training calls;
5. **train**: await the calls and the install;
6. **finish**: the metrics line, the group ledger, the failure budget, a
   checkpoint when one is due (``rlengine.rl.checkpointing``) and the next
   evaluation request (``rlengine.rl.evaluation``).

With ``train_from`` a step is read back from its dump and its calls submitted
again (``_replay_step``); with ``rollout_only`` nothing is submitted.

``TrainingLoop`` is a part of ``TrainingRun`` (``rlengine.rl.loop``), which
holds the run's state; this part has one job, the training loop, and reads
and writes only the state listed in its class body. This module must not
import torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rlengine.core.clients import TrainingClient
from rlengine.core.engine import Engine
from rlengine.rl.batch import GroupScorer, RolloutResult, StepBatch, WorkItem, prepare_group
from rlengine.rl.checkpoint import LoopState, PendingGroup, SampledGroup, capture_rng
from rlengine.rl.checkpointing import RunCheckpoints
from rlengine.rl.config import TrainConfig
from rlengine.rl.dump import read_step, write_step
from rlengine.rl.errors import FailureBudgetExceeded, RunInterrupted
from rlengine.rl.evaluation import Evaluation
from rlengine.rl.metrics import RunLog, memory_metrics
from rlengine.rl.supervisor import Supervisor, awaited
from rlengine.timeline import Timeline
from rlengine.types import AdamParams

__all__ = ["TrainingLoop"]


class TrainingLoop:
    """The training loop of a ``TrainingRun``: its steps, one at a time; see the module docstring.

    Why one class: a step's six phases and the replay of a dumped step are one sequence
    over one set of books: split, a step would no longer read top-down in one place."""

    # The run's state this part uses (``TrainingRun.__init__`` makes it).
    cfg: TrainConfig
    training: TrainingClient
    supervisor: Supervisor
    evaluation: Evaluation
    checkpoints: RunCheckpoints
    log: RunLog
    on_step: Callable[[dict[str, Any]], None] | None
    step: int
    updates: int
    total_steps: int
    results_q: asyncio.Queue[RolloutResult | None]
    _issued: dict[int, PendingGroup]
    _requeued: deque[WorkItem]
    _unconsumed: dict[int, RolloutResult]
    _arrived: dict[int, int]
    _early: dict[int, list[RolloutResult]]
    _batch: StepBatch | None
    _boundary: LoopState | None
    _interrupted: RunInterrupted | None
    _failure_window: deque[tuple[int, int, int, int]]
    _dumps: list[str]
    _finished: bool
    _clock0: float
    _last_step_end: float
    _last_busy: tuple[float | None, ...]
    engine: Engine
    scorer: GroupScorer | None
    resume: tuple[str, LoopState] | None
    cursor: int
    _v0: int

    async def _trainer(self) -> None:
        """The stage: steps until the last; then it asks for the last evaluation and stops the others."""
        try:
            while self.step < self.total_steps:
                if not await self._train_step():
                    return
            self._finished = True
        finally:
            # The training loop signals evaluation: a last evaluation after a
            # normal end, then stop.
            if self._finished and self.cfg.eval_every and self.cfg.train_from is None:
                self.evaluation.request(self.step)
            self.evaluation.stop()
            self.supervisor.request_stop()

    async def _train_step(self) -> bool:
        """One step, phase by phase (see the module docstring); False when the run stopped in it."""
        cfg = self.cfg
        step = self.step + 1
        if cfg.train_from is not None:
            return await self._replay_step(step)
        batch = await self._gather(step)
        if batch is None:
            return False
        train_started = time.monotonic()
        lr = cfg.learning_rate
        if cfg.lr_schedule == "linear":
            lr *= 1.0 - (step - 1) / self.total_steps
        adam = AdamParams(learning_rate=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, grad_clip_norm=cfg.grad_clip_norm)
        if cfg.recomputes and not cfg.rollout_only and batch.plan() and not await self._recompute(batch):
            return False
        optims = batch.submit(adam)
        train_metrics: dict[str, float] = {}
        if optims and not cfg.rollout_only:
            if not await self._ready_to_install(step):
                return False
            install = self.training.save_weights_for_sampler()
            trained = await self._train(batch, optims, lr, install)
            if trained is None:
                return False
            train_metrics = trained
        if cfg.dump_rollouts is not None:
            await asyncio.to_thread(write_step, cfg.dump_rollouts, batch.to_dump(lr))
        return await self._finish_step(batch, train_metrics, train_started)

    # -- 1. gather -------------------------------------------------------------------------

    async def _gather(self, step: int) -> StepBatch | None:
        """The step's ``StepBatch``, with its ``groups_per_batch`` groups taken in; None on abort."""
        batch = self._batch = StepBatch(self.cfg, None if self.cfg.rollout_only else self.training, step,
                                        self.updates, self._policy_version)
        while batch.consumed < self.cfg.groups_per_batch:
            result = await self._next_result_for(step)
            if result is not None and result.prepared is None and self.scorer is not None:
                # Restored from a checkpoint, sampled by an earlier process: scored only now.
                result = await self._scored(result)
            if result is None:
                return None
            self._intake(result, batch)
        return batch

    async def _next_result_for(self, step: int) -> RolloutResult | None:
        """The next group for step ``step``: in a reproducible run, one of its own batch (groups of
        later batches, sampled ahead, wait for their step); otherwise whichever arrives first."""
        if not self.cfg.reproducible:
            return await self._next_result()
        own = step - 1
        while not self._early.get(own):
            result = await self._next_result()
            if result is None:
                return None
            self._early.setdefault(result.item.index // self.cfg.groups_per_batch, []).append(result)
        return self._early[own].pop(0)

    async def _next_result(self) -> RolloutResult | None:
        """The next group a worker sampled; None on abort. The workers all stopping first (the
        results queue's None) is an error: the step can never have its groups."""
        result = await self.supervisor.until_aborted(self.results_q.get())
        if result is None:
            if self.supervisor.abort.is_set():
                return None
            raise RuntimeError(f"step {self.step + 1}: every rollout worker stopped before the step had its "
                               f"{self.cfg.groups_per_batch} groups")
        return result

    async def _scored(self, result: RolloutResult) -> RolloutResult | None:
        """``result`` prepared and scored by the run's ``scorer``; None on abort."""
        assert self.scorer is not None
        prepared = await self.supervisor.until_aborted(
            self.scorer.score(result.item.index, result.group, prepare_group(self.cfg, result.group)),
            timeout=self.cfg.call_timeout_s)
        return None if prepared is None else result._replace(prepared=prepared)

    def _intake(self, result: RolloutResult, batch: StepBatch) -> None:
        """One group into the step's batch (``StepBatch.intake``) and into the dataloader's books:
        a stale group (or, with dynamic sampling, a constant one) is issued again, any other is done."""
        item = result.item
        self._unconsumed.pop(item.index, None)
        retry = batch.intake(result)
        if retry is not None:
            self._issued[item.index] = PendingGroup(item.index, retry.attempt)
            self._requeued.append(retry)
        else:
            del self._issued[item.index]
        self.supervisor.progress.set()

    # -- 2. recompute ----------------------------------------------------------------------

    async def _recompute(self, batch: StepBatch) -> bool:
        """The recompute pass (``TrainConfig.recomputes``): the trainer's logprobs of the step's
        datums, before its first update, into the datums; False on abort."""
        futures = [(self.training.forward(data, "cross_entropy"), idx) for data, idx in batch.recompute_calls()]
        outputs = [(await self._call(f), idx) for f, idx in futures]
        if self.supervisor.abort.is_set():
            return False
        batch.apply_recompute(outputs)
        return True

    # -- 4. install ------------------------------------------------------------------------

    async def _ready_to_install(self, step: int) -> bool:
        """Wait until step ``step``'s weights may be installed; False on abort.

        The evaluation of step k samples policy k only: the install waits for the evaluations
        asked for. In a reproducible off-policy run it also waits for every batch released
        before it (the fixed-lag schedule: batches up to ``step + max_steps_off_policy``) to
        have all its groups sampled."""
        if await self.supervisor.until_aborted(self.evaluation.settled.wait()) is None:
            return False
        if not (self.cfg.reproducible and self.cfg.max_steps_off_policy):
            return True
        g = self.cfg.groups_per_batch
        last = min(step + self.cfg.max_steps_off_policy, self.total_steps)
        progress = self.supervisor.progress
        while any(self._arrived.get(b, 0) < g for b in range(step, last)):
            if self.supervisor.abort.is_set():
                return False
            progress.clear()
            # Bounded, so that a missed wake-up costs a second, never a hang.
            try:
                await asyncio.wait_for(progress.wait(), 1.0)
            except TimeoutError:
                pass
        return not self.supervisor.abort.is_set()

    # -- 5. train --------------------------------------------------------------------------

    async def _train(self, batch: StepBatch, optims: list[Any], lr: float,
                     install: Any = None) -> dict[str, float] | None:
        """Await a step's training calls (and its install); its training columns, None on abort."""
        outputs = [(await self._call(f), idx) for f, idx in batch.fb]
        optim_outs = [await self._call(o) for o in optims]
        if install is not None:
            await self._call(install)
        if self.supervisor.abort.is_set():
            return None
        self.updates += 1
        return batch.train_metrics(outputs, optim_outs) | {"learning_rate": lr}

    # -- 6. finish -------------------------------------------------------------------------

    async def _finish_step(self, batch: StepBatch, train_metrics: dict[str, float], train_started: float) -> bool:
        """The step's metrics line, ledger, failure check, checkpoint and evaluation request."""
        step = batch.step
        now = time.monotonic()
        busy = self._busy()
        wall = now - self._last_step_end
        share = [min(1.0, max(0.0, (b - last) / wall)) if wall and b is not None and last is not None else None
                 for b, last in zip(busy[:2], self._last_busy[:2])]
        record = batch.record(self.updates, train_metrics, wall=wall, train_time_s=now - train_started,
                              sampler_idle_frac=None if share[0] is None else 1.0 - share[0],
                              trainer_busy_frac=share[1], time_s=now - self._clock0)
        # Beside tokens_per_s (sampled, per second of the step): trained, per second of its training.
        trained, train_s = train_metrics.get("sampled_tokens_trained", 0), now - train_started
        record |= {"tokens_trained_per_s": trained / train_s if train_s else 0.0, **memory_metrics()}
        drafted, accepted = (int(b - (last or 0)) if b is not None else 0 for b, last in zip(busy[2:], self._last_busy[2:]))
        if drafted:  # speculative decoding drafted this step (torch backend, engine_args["speculative"])
            record |= {"spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
                       "spec_acceptance": accepted / drafted}
        if self.engine.timeline is not None:
            self._record_step(self.engine.timeline, step, self._last_step_end, train_started, now)
        self._last_step_end, self._last_busy = now, busy
        # The step is complete: advance, and snapshot the loop state before any
        # await lets the dataloader issue the next batch.
        self.step = step
        self.supervisor.progress.set()
        self._batch = None
        snapshot = self._boundary = self._snapshot()
        self.log.step(record)
        self.log.groups(batch.ledger)
        if self.on_step is not None:
            self.on_step(record)
        self._check_failures(batch)
        if self._interrupted is not None:  # the step it waited for is done: stop (its checkpoint is the stop's)
            self.supervisor.fail("signal handler", self._interrupted)
            return False
        if self.checkpoints.due(step):
            await self.checkpoints.save(snapshot)
        if self.evaluation.due(step):
            self.evaluation.request(step)
        return True

    def _record_step(self, timeline: Timeline, step: int, start: float, train_started: float, end: float) -> None:
        """The step into the timeline, over the same bounds as its metrics line: gathering its groups,
        then recomputing, training and installing; the step's breakdown is the timeline's."""
        track = timeline.track("rl steps")
        timeline.step(step, start, end, {"version": self.updates})
        timeline.span(track, "gather", start, train_started, "step")
        timeline.span(track, "train", train_started, end, "step")

    def _check_failures(self, batch: StepBatch) -> None:
        """Stop the run when the failure shares of the last steps exceed ``max_failure_share``."""
        cfg = self.cfg
        window = self._failure_window
        counts = batch.counts
        window.append((counts["attempts_failed"], counts["attempts_failed"] + len(batch.rewards),
                       counts["groups_dropped_too_few_survivors"], batch.consumed))
        failed = sum(w[0] for w in window)
        attempts = sum(w[1] for w in window)
        untrained = sum(w[2] for w in window)
        groups = sum(w[3] for w in window)
        if attempts and failed / attempts > cfg.max_failure_share:
            self.supervisor.fail("training loop", FailureBudgetExceeded(
                "failed attempts", failed / attempts, cfg.max_failure_share, len(window)))
        elif groups and untrained / groups > cfg.max_failure_share:
            self.supervisor.fail("training loop", FailureBudgetExceeded(
                "groups untrained for too few surviving attempts", untrained / groups, cfg.max_failure_share,
                len(window)))

    # -- train_from ------------------------------------------------------------------------

    async def _replay_step(self, step: int) -> bool:
        """One step of ``train_from``: its dump read back and its training calls submitted again."""
        dump = await asyncio.to_thread(read_step, self._dumps[step - 1], step)
        batch = self._batch = StepBatch.from_dump(self.cfg, self.training, dump)
        train_started = time.monotonic()
        # A rollout_only dump was never recomputed: its replay runs the pass itself.
        if self.cfg.recomputes and batch.unrecomputed() and not await self._recompute(batch):
            return False
        optims = batch.replay()
        train_metrics: dict[str, float] = {}
        if optims:
            trained = await self._train(batch, optims, dump.learning_rate)
            if trained is None:
                return False
            train_metrics = trained
        return await self._finish_step(batch, train_metrics, train_started)

    # -- versions, books, calls -----------------------------------------------------------

    def _policy_version(self, engine_version: int) -> int:
        """The run's policy version (updates applied) of an engine install counter value.

        The engine counts installs from 1 in every process; the run installs
        its starting weights once (``_v0``) and once per update after that."""
        start_updates = self.resume[1].updates if self.resume else 0
        return start_updates + engine_version - self._v0

    def _snapshot(self) -> LoopState:
        """The loop state at a step boundary: what a checkpoint of that step holds."""
        shift = self._policy_version(0)
        sampled = [SampledGroup(index=r.item.index, attempt=r.item.attempt, group=r.group,
                                version_shift=shift if r.version_shift is None else r.version_shift)
                   for r in sorted(self._unconsumed.values(), key=lambda r: r.item.index)]
        return LoopState(step=self.step, updates=self.updates, cursor=self.cursor,
                         pending=sorted(self._issued.values(), key=lambda p: p.index), sampled=sampled,
                         rng=capture_rng(), elapsed_s=time.monotonic() - self._clock0)

    def _busy(self) -> tuple[float | None, ...]:
        """Seconds the engine's sampler has spent in backend steps and its training lane in training
        calls, then the tokens speculative decoding drafted and accepted, so far (each None if the
        engine does not say: no lane, training blocks sampling)."""
        stats = self.engine.stats()
        return tuple(None if stats.get(key) is None else float(stats[key])
                     for key in ("busy_s", "train_busy_s", "drafted_tokens", "accepted_tokens"))

    async def _call(self, future: Any) -> Any:
        """Await one engine call of the training loop, bounded and abort-aware."""
        return await self.supervisor.until_aborted(awaited(future), timeout=self.cfg.call_timeout_s)
