"""The RL pipeline: dataloader -> rollout workers -> training loop -> evaluation loop.

All four stages are tasks on one event loop (the engine's, in async mode),
connected by queues:

* the **dataloader** issues group builders in dataset order to the work
  queue. Batch ``b`` is released once ``b <= step + max_steps_off_policy``
  (0: synchronous, each batch sampled with the newest weights); groups the
  training loop found stale come back and are re-issued first. When the
  data needed is issued and every issued group consumed, or on stop, it
  sends one sentinel per worker.

  With ``max_steps_off_policy`` k > 0 the next batches sample while a step
  trains (the engine trains on its own thread where it can:
  ``EngineConfig.train_concurrently``). In a ``reproducible`` run every
  batch samples one policy, fixed by the schedule, not by timing: step n
  installs its weights only once every group released before it (batches
  up to n + k) has been sampled, so batch b always samples policy
  ``max(0, b - 1 - k)``: exactly k steps behind, the one-step-off-policy
  pipeline of AReaL and verl for k = 1. Without ``reproducible`` an install
  happens as soon as its step has trained, and a batch may sample any
  policy within k of its step.
* **rollout workers** take a builder, roll the group out through the
  engine (``rollouts.rollout_group``) and put the group on the results
  queue. Each worker decrements a counter in ``finally`` (so a crashed
  worker counts too); the last one to stop tells the training loop that no
  more results will come.
* the **training loop** (``rlengine.rl.step``, which reads a step
  top-down) consumes ``groups_per_batch`` groups per step, gathered in a
  ``StepBatch`` (``batch``). Every group passes one intake
  (``StepBatch.intake``): the stale-group filter first
  (``max_steps_off_policy``, from the per-token policy versions the engine
  recorded; a stale group is re-sampled, not trained), then failed attempts
  and ``min_surviving_attempts``, constant rewards, GRPO advantages. Both
  the batch path and the streaming path (``num_minibatches > 1``, each
  minibatch sent to ``forward_backward`` as soon as it is complete) go
  through it. Then one optimizer step (or ``num_substeps`` of them, each on
  a part of the batch), one weight install (a new policy version), one
  metrics line, and every K steps a quiescent checkpoint. Outside streaming,
  the batch's datums are put in group order first: groups arrive in the
  order their rollouts finish, and the training must not depend on timing
  (a seed gives the same run with or without evaluations, checkpoints or a
  slow sandbox).
  When it stops, for whatever reason, it signals the evaluation loop.
* the **evaluation loop** (``rlengine.rl.evaluation``) evaluates the held-out split when asked (at the
  start, every N steps, after the last) and re-checks shutdown after every
  wake-up. It runs beside the next step's rollouts, but the next weight
  install waits for it, so the evaluation of step k samples policy k alone
  (its ``version_min`` = ``version_max`` = k), whatever the timing.

Two modes change the stages (``TrainConfig``). With ``rollout_only`` the
training loop records the training calls of each step (``dump_rollouts``)
and submits none: no forward_backward, optimizer step or weight install,
and the starting weights are not installed either, so every step samples
the initial policy. With ``train_from`` only the training loop runs: each
step is read from its dump and its calls submitted again (``replay``); no
dataloader, rollout worker or evaluation, and no weight install (nothing
samples). With ``dump_rollouts`` every step's dump is written once its
training calls have completed, before its metrics line.

Shutdown is a cascade, never a hope. A normal end flows down the chain
above. Any stage raising (or ``interrupt``, for signals) records the first
error, sets the abort event that every wait in every stage also watches,
and cancels in-flight rollouts (which aborts their engine requests); the
supervisor gives the stages ``shutdown_grace_s`` to finish, cancels what is
left, drains the queues, checks that no task of the run is left behind,
and re-raises the original error with a note naming its stage
(``rlengine.rl.supervisor``). Checkpoints, when due and at a stop, are
``rlengine.rl.checkpointing``'s.

This module holds the run's state and books (what is issued, sampled and
not yet consumed: what a checkpoint's ``LoopState`` holds), starts the run
(a resume restores it), and runs the dataloader and the rollout workers;
the training loop is its part ``TrainingLoop``.

This module must not own the engine or the run directory (``run`` does) and
must not import torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError
from rlengine.rl.batch import GroupScorer, PreparedGroup, RolloutResult, StepBatch, WorkItem, prepare_group
from rlengine.rl.checkpoint import Checkpointer, LoopState, PendingGroup, restore_rng
from rlengine.rl.checkpointing import RunCheckpoints
from rlengine.rl.config import TrainConfig
from rlengine.rl.dump import step_files
from rlengine.rl.errors import DataExhausted, RunInterrupted
from rlengine.rl.evaluation import Evaluation
from rlengine.rl.metrics import RunLog
from rlengine.rl.rollouts import rollout_group
from rlengine.rl.step import TrainingLoop
from rlengine.rl.supervisor import Supervisor
from rlengine.rl.types import EnvGroupBuilder, RLDataset
from rlengine.seeding import mix_seed
from rlengine.types import SamplingParams

__all__ = ["TrainingRun"]


class TrainingRun(TrainingLoop):
    """One run of the pipeline on a started engine; see the module docstring.

    Why one class: its books (groups issued, sampled and not yet consumed) are written by the
    dataloader and the workers and read by the training loop, the checkpoints and the hang watch;
    split, each part would reach into another's state."""

    def __init__(self, engine: Engine, config: TrainConfig, dataset: RLDataset, eval_dataset: RLDataset | None,
                 log: RunLog, *, checkpointer: Checkpointer | None = None,
                 resume: tuple[str, LoopState] | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_eval: Callable[[dict[str, Any]], None] | None = None, evaluated: Sequence[int] = (),
                 scorer: GroupScorer | None = None) -> None:
        self.engine = engine
        self.scorer = scorer
        """Rewrites each group's datums before training (a distillation teacher); None: none."""
        self.cfg = config
        self.dataset = dataset
        self.log = log
        self.resume = resume
        self.on_step = on_step
        start = resume[1] if resume else None
        self.step = start.step if start else 0
        self.updates = start.updates if start else 0
        self.cursor = start.cursor if start else 0
        self._restored = list(start.sampled) if start else []
        """Groups the checkpoint holds sampled: fed to the training loop as they are."""
        restored = {s.index for s in self._restored}
        self._reissue = [PendingGroup(p.index, p.attempt) for p in start.pending if p.index not in restored] \
            if start else []
        self._elapsed0 = start.elapsed_s if start else 0.0
        self.total_steps = config.steps if config.steps is not None else len(dataset)
        self.n_workers = config.resolved_workers
        # Made here, not in run(): a signal during start-up interrupts the run before it runs.
        self.supervisor = Supervisor(config.shutdown_grace_s)
        self.evaluation = Evaluation(config, eval_dataset, log, self.supervisor, self._policy_version,
                                     on_eval=on_eval, evaluated=evaluated)
        self.checkpoints = RunCheckpoints(config, checkpointer, self.supervisor, self.total_steps,
                                          resume[0] if resume else None)
        self.work_q: asyncio.Queue[WorkItem | None] = asyncio.Queue()
        """The dataloader's work items for the rollout workers; None: no more work."""
        self.results_q: asyncio.Queue[RolloutResult | None] = asyncio.Queue()
        """The workers' groups for the training loop; None: every worker has stopped."""
        self._issued: dict[int, PendingGroup] = {}
        self._requeued: deque[WorkItem] = deque()
        self._builders: tuple[int, Sequence[EnvGroupBuilder]] | None = None
        self._workers_left = self.n_workers
        self._finished = False
        self._arrived: dict[int, int] = {}
        """Per batch, its groups whose first rollout came back (the fixed-lag schedule waits on them)."""
        self.groups_arrived = 0
        """Groups rolled out so far, retries included (the hang watch's progress)."""
        self._unconsumed: dict[int, RolloutResult] = {}
        """Groups sampled and not yet consumed by the training loop (a checkpoint keeps them)."""
        self._early: dict[int, list[RolloutResult]] = {}
        """By batch, groups that arrived before their step (a reproducible run's steps take their own)."""
        self._failure_window: deque[tuple[int, int, int, int]] = deque(maxlen=self.cfg.failure_window_steps)
        """(attempts failed, attempts, groups untrained for too few survivors, groups) of the last steps."""
        self._v0 = 0
        self._clock0 = 0.0
        self._last_step_end = 0.0
        self._last_busy: tuple[float | None, ...] = (None, None, None, None)
        self._dumps = step_files(config.train_from) if config.train_from is not None else []
        self._batch: StepBatch | None = None
        """The step being gathered or trained (None at a step boundary)."""
        self._boundary: LoopState | None = None
        """The loop state at the end of the last step this run finished (what a checkpoint at a stop holds)."""
        self._interrupted: RunInterrupted | None = None
        """An interrupt waiting for the step in training to finish (``interrupt``)."""

    @property
    def error(self) -> BaseException | None:
        """The run's first error (with a note naming its stage); None while it has none."""
        return self.supervisor.error

    @property
    def left_behind(self) -> list[str]:
        """Stages that had to be cancelled after the grace period."""
        return self.supervisor.left_behind

    @property
    def drained(self) -> int:
        """Items still in the queues at the end (discarded)."""
        return self.supervisor.drained

    @property
    def last_checkpoint(self) -> str | None:
        """The newest checkpoint committed (the one resumed from, until this run commits one)."""
        return self.checkpoints.last

    def interrupt(self, signum: int, name: str) -> None:
        """Stop the run as failed with ``RunInterrupted`` (a signal handler calls this on the loop).

        A step whose training calls are under way finishes first (within ``shutdown_grace_s``, else
        the run stops all the same), so that the checkpoint at the stop holds it: the trainer's state
        is then that of a finished step, never a step half-trained."""
        exc = RunInterrupted(signum, name)
        batch = self._batch
        if batch is not None and batch.calls and not self.cfg.rollout_only and not self.supervisor.abort.is_set():
            self._interrupted = exc
            asyncio.get_running_loop().call_later(self.cfg.shutdown_grace_s, self.supervisor.fail,
                                                  "signal handler", exc)
            return
        self.supervisor.fail("signal handler", exc)

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> None:
        """Run to the end; raises the first stage error (with a note naming the stage). Interrupted
        (``interrupt``), it checkpoints the last step it finished first (``RunCheckpoints.at_stop``)."""
        cfg = self.cfg
        aborted = self.supervisor.abort
        self.training = self.checkpoints.training = self.engine.training_client()
        self._clock0 = time.monotonic() - self._elapsed0
        if self.resume is not None:
            if not cfg.rollout_only:
                await self._call(self.training.load_state(f"{self.resume[0]}/trainer"))
            restore_rng(self.resume[1].rng)
        if cfg.rollout_only:
            self._v0 = self.engine.stats()["version"]
        elif cfg.train_from is None and not aborted.is_set():
            installed = await self._call(self.training.save_weights_for_sampler())
            self._v0 = installed.version if installed is not None else 0
        if aborted.is_set():  # interrupted during start-up: nothing ran, nothing to checkpoint
            assert self.error is not None
            raise self.error
        self.sampler = self.engine.sampling_client()
        self.params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
        self._last_step_end = time.monotonic()
        self._last_busy = self._busy()
        if self.engine.timeline is not None:  # the steps' breakdown counts the work from here on
            self.engine.timeline.start_steps()
        if cfg.train_from is not None:
            stages: dict[str, Callable[[], Awaitable[None]]] = {"training loop": self._trainer}
        else:
            if self.evaluation.due(self.step):
                # Step 0's evaluation, or a resumed run's at its checkpoint when the run was
                # killed between the checkpoint and that evaluation (once: see ``evaluated``).
                self.evaluation.request(self.step)
            self._restore_sampled()
            stages = {"dataloader": self._dataloader}
            for i in range(self.n_workers):
                stages[f"rollout worker {i}"] = self._worker
            stages["training loop"] = self._trainer
            stages["evaluation loop"] = lambda: self.evaluation.stage(self.sampler)
        await self.supervisor.supervise(stages, (self.work_q, self.results_q, self.evaluation.queue))
        await self.checkpoints.settle()
        if isinstance(self.error, RunInterrupted):
            await self.checkpoints.at_stop(self._boundary, self._batch)
        if self.error is not None:
            raise self.error

    # -- books ---------------------------------------------------------------------------

    def _arrive(self, result: RolloutResult) -> None:
        """A sampled group, for the training loop (and for a checkpoint until it is consumed)."""
        item = result.item
        self.results_q.put_nowait(result)
        self._unconsumed[item.index] = result
        self.groups_arrived += 1
        if item.attempt == 0:
            batch = item.index // self.cfg.groups_per_batch
            self._arrived[batch] = self._arrived.get(batch, 0) + 1
            self.supervisor.progress.set()

    def progress(self) -> tuple[int, int]:
        """For the hang watch: (groups rolled out plus steps finished, groups issued and not consumed)."""
        return self.groups_arrived + self.step, len(self._issued)

    def snapshot(self) -> dict[str, Any]:
        """The run's books for a hang dump; any thread (``sorted`` and ``len`` copy in one C-level step)."""
        batch = self._batch
        return {"step": self.step, "total_steps": self.total_steps, "updates": self.updates,
                "groups_issued": sorted(self._issued)[:256], "groups_arrived": self.groups_arrived,
                "groups_unconsumed": len(self._unconsumed), "work_queue": self.work_q.qsize(),
                "results_queue": self.results_q.qsize(), "workers_left": self._workers_left,
                "gathering": None if batch is None else {"step": batch.step, "groups_consumed": batch.consumed}}

    def _restore_sampled(self) -> None:
        """A resumed run's groups that its checkpoint holds sampled, back in the results queue."""
        for s in self._restored:
            item = WorkItem(s.index, s.attempt, self._builder(s.index))
            self._issued[s.index] = PendingGroup(s.index, s.attempt)
            self._arrive(RolloutResult(item, s.group, 0.0, s.version_shift))

    # -- dataloader ----------------------------------------------------------------------

    def _builder(self, index: int) -> EnvGroupBuilder:
        g = self.cfg.groups_per_batch
        batch = index // g
        if self._builders is None or self._builders[0] != batch:
            if batch >= len(self.dataset):
                raise DataExhausted(batch, self.total_steps, len(self.dataset))
            try:
                builders = self.dataset.get_batch(batch)
            except IndexError:
                raise DataExhausted(batch, self.total_steps, len(self.dataset)) from None
            if len(builders) != g:
                raise ConfigurationError(f"groups_per_batch={g}: batch {batch} of the dataset holds "
                                         f"{len(builders)} group builders")
            self._builders = (batch, builders)
        return self._builders[1][index % g]

    def _issue(self, item: WorkItem) -> None:
        self._issued[item.index] = PendingGroup(item.index, item.attempt)
        self.work_q.put_nowait(item)

    async def _dataloader(self) -> None:
        g, ahead = self.cfg.groups_per_batch, self.cfg.max_steps_off_policy
        needed = self.total_steps * g
        progress = self.supervisor.progress
        try:
            for p in self._reissue:
                self._issue(WorkItem(p.index, p.attempt, self._builder(p.index)))
            while not self.supervisor.stop.is_set():
                if self._requeued:
                    self._issue(self._requeued.popleft())
                    continue
                if self.cursor < needed and self.cursor // g <= self.step + ahead:
                    self._issue(WorkItem(self.cursor, 0, self._builder(self.cursor)))
                    self.cursor += 1
                    continue
                if self.cursor >= needed and not self._issued:
                    return
                progress.clear()
                # Bounded, so that a missed wake-up costs a second, never a hang.
                try:
                    await asyncio.wait_for(progress.wait(), 1.0)
                except TimeoutError:
                    pass
        finally:
            for _ in range(self.n_workers):
                self.work_q.put_nowait(None)

    # -- rollout workers ---------------------------------------------------------------

    async def _worker(self) -> None:
        try:
            while True:
                item = await self.work_q.get()
                if item is None:
                    return
                if self.supervisor.abort.is_set():
                    continue
                started = time.monotonic()
                seed = mix_seed(self.cfg.seed, item.index, item.attempt)
                group = await self.supervisor.until_aborted(rollout_group(
                    item.builder, self.sampler, self.params, seed, max_turns=self.cfg.max_turns,
                    episode_timeout_s=self.cfg.episode_timeout_s))
                if group is None:
                    continue
                prepared: PreparedGroup | None = prepare_group(self.cfg, group)
                if self.scorer is not None:
                    # Scored here, beside the other groups' sampling, not on the step's critical path.
                    prepared = await self.supervisor.until_aborted(self.scorer.score(item.index, group, prepared),
                                                                    timeout=self.cfg.call_timeout_s)
                    if prepared is None:
                        continue
                self._arrive(RolloutResult(item, group, time.monotonic() - started, prepared=prepared))
        finally:
            self._workers_left -= 1
            if self._workers_left == 0:
                self.results_q.put_nowait(None)
