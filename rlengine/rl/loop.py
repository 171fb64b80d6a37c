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
* the **training loop** consumes ``groups_per_batch`` groups per step,
  gathered in a ``StepBatch`` (``batch``). Every group passes one intake
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
* the **evaluation loop** evaluates the held-out split when asked (at the
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
and re-raises the original error with a note naming its stage.

This module must not own the engine or the run directory (``run`` does) and
must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError
from rlengine.rl.batch import RolloutResult, StepBatch, WorkItem, prepare_group
from rlengine.rl.checkpoint import Checkpointer, LoopState, PendingGroup, SampledGroup, capture_rng, restore_rng
from rlengine.rl.config import TrainConfig
from rlengine.rl.dump import read_step, step_files, write_step
from rlengine.rl.errors import DataExhausted, FailureBudgetExceeded, RunInterrupted, StageTimeout
from rlengine.rl.metrics import RunLog, reward_stats
from rlengine.rl.rollouts import rollout_group
from rlengine.rl.types import EnvGroupBuilder, RLDataset
from rlengine.seeding import mix_seed
from rlengine.types import AdamParams, SamplingParams

__all__ = ["TrainingRun"]

logger = logging.getLogger("rlengine")

_EVAL_SEED = 0x4556414C  # keeps evaluation seeds apart from training seeds


def _serving(task: asyncio.Task[Any]) -> bool:
    """A task of the engine or a server beside it, which outlive the loop: named ``rlengine-...``,
    or an HTTP connection's handler (aiohttp's, unnamed; it lives as long as its client keeps
    the connection open, as an agent's connection pool does)."""
    if task.get_name().startswith("rlengine-"):
        return True
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    return (getattr(coro, "__qualname__", "") == "RequestHandler.start" and frame is not None
            and frame.f_globals.get("__name__") == "aiohttp.web_protocol")


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


NO_MORE_WORK = _Sentinel("no more work")
WORKERS_DONE = _Sentinel("workers done")
EVAL_STOP = _Sentinel("evaluation stop")


class TrainingRun:
    """One run of the pipeline on a started engine; see the module docstring."""

    def __init__(self, engine: Engine, config: TrainConfig, dataset: RLDataset, eval_dataset: RLDataset | None,
                 log: RunLog, *, checkpointer: Checkpointer | None = None,
                 resume: tuple[str, LoopState] | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_eval: Callable[[dict[str, Any]], None] | None = None, evaluated: Sequence[int] = ()) -> None:
        self.engine = engine
        self.cfg = config
        self.dataset = dataset
        self.eval_dataset = eval_dataset
        self.log = log
        self.checkpointer = checkpointer
        self.resume = resume
        self.on_step = on_step
        self.on_eval = on_eval
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
        self.error: BaseException | None = None
        self.left_behind: list[str] = []
        """Stages that had to be cancelled after the grace period."""
        self.drained = 0
        """Items still in the queues at the end (discarded)."""
        self._issued: dict[int, PendingGroup] = {}
        self._requeued: deque[WorkItem] = deque()
        self._builders: tuple[int, Sequence[EnvGroupBuilder]] | None = None
        self._workers_left = self.n_workers
        self._finished = False
        self._eval_requested: set[int] = set(evaluated)
        """Steps evaluated or asked for (a resumed run starts with those its eval log holds)."""
        self._evals_open = 0
        """Evaluations asked for and not yet finished: the next weight install waits for them."""
        self._arrived: dict[int, int] = {}
        """Per batch, its groups whose first rollout came back (the fixed-lag schedule waits on them)."""
        self._unconsumed: dict[int, RolloutResult] = {}
        """Groups sampled and not yet consumed by the training loop (a checkpoint keeps them)."""
        self._early: dict[int, list[RolloutResult]] = {}
        """By batch, groups that arrived before their step (a reproducible run's steps take their own)."""
        self._failure_window: deque[tuple[int, int, int, int]] = deque(maxlen=self.cfg.failure_window_steps)
        """(attempts failed, attempts, groups untrained for too few survivors, groups) of the last steps."""
        self._v0 = 0
        self._clock0 = 0.0
        self._last_step_end = 0.0
        self._last_busy: tuple[float | None, float | None] = (None, None)
        self._dumps = step_files(config.train_from) if config.train_from is not None else []
        self.last_checkpoint: str | None = resume[0] if resume else None
        """The newest checkpoint committed (the one resumed from, until this run commits one)."""
        self._batch: StepBatch | None = None
        """The step being gathered or trained (None at a step boundary)."""
        self._boundary: LoopState | None = None
        """The loop state at the end of the last step this run finished (what a checkpoint at a stop holds)."""
        self._saving: asyncio.Task[None] | None = None
        self._interrupted: RunInterrupted | None = None
        """An interrupt waiting for the step in training to finish (``interrupt``)."""
        """The checkpoint being written: it finishes even when the run aborts (see ``_checkpoint``)."""
        # Made here, not in run(): a signal during start-up interrupts the run before it runs.
        self._abort = asyncio.Event()
        self._stop = asyncio.Event()
        self._progress = asyncio.Event()

    # -- shutdown --------------------------------------------------------------------

    def _fail(self, stage: str, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            exc.add_note(f"rlengine.rl: raised in the {stage}")
        self._abort.set()
        self._stop.set()
        self._progress.set()

    def interrupt(self, signum: int, name: str) -> None:
        """Stop the run as failed with ``RunInterrupted`` (a signal handler calls this on the loop).

        A step whose training calls are under way finishes first (within ``shutdown_grace_s``, else
        the run stops all the same), so that the checkpoint at the stop holds it: the trainer's state
        is then that of a finished step, never a step half-trained."""
        exc = RunInterrupted(signum, name)
        batch = self._batch
        if batch is not None and batch.calls and not self.cfg.rollout_only and not self._abort.is_set():
            self._interrupted = exc
            asyncio.get_running_loop().call_later(self.cfg.shutdown_grace_s, self._fail, "signal handler", exc)
            return
        self._fail("signal handler", exc)

    def _request_stop(self) -> None:
        self._stop.set()
        self._progress.set()

    async def _until_aborted(self, awaitable: Awaitable[Any], timeout: float | None = None) -> Any:
        """Await ``awaitable`` unless the run aborts first (then cancel it and return None).

        ``timeout`` bounds the wait (``StageTimeout``)."""
        task = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._abort.wait())
        try:
            done, _ = await asyncio.wait({task, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancelled(stopper)
        if task in done:
            return task.result()
        task.cancel()
        # Cancelled rollouts abort their engine requests; give them the grace period.
        await asyncio.wait({task}, timeout=self.cfg.shutdown_grace_s)
        if not done:
            raise StageTimeout(f"a wait ran past its bound of {timeout} s")
        return None

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> None:
        """Run to the end; raises the first stage error (with a note naming the stage). Interrupted
        (``interrupt``), it checkpoints the last step it finished first (``_checkpoint_at_stop``)."""
        self.work_q: asyncio.Queue[Any] = asyncio.Queue()
        self.results_q: asyncio.Queue[Any] = asyncio.Queue()
        self.eval_q: asyncio.Queue[Any] = asyncio.Queue()
        self._evals_settled = asyncio.Event()
        self._evals_settled.set()
        cfg = self.cfg
        self.training = self.engine.training_client()
        self._clock0 = time.monotonic() - self._elapsed0
        if self.resume is not None:
            if not cfg.rollout_only:
                await self._call(self.training.load_state(f"{self.resume[0]}/trainer"))
            restore_rng(self.resume[1].rng)
        if cfg.rollout_only:
            self._v0 = self.engine.stats()["version"]
        elif cfg.train_from is None and not self._abort.is_set():
            installed = await self._call(self.training.save_weights_for_sampler())
            self._v0 = installed.version if installed is not None else 0
        if self._abort.is_set():  # interrupted during start-up: nothing ran, nothing to checkpoint
            assert self.error is not None
            raise self.error
        self.sampler = self.engine.sampling_client()
        self.params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
        self._last_step_end = time.monotonic()
        self._last_busy = self._busy()
        if cfg.train_from is not None:
            stages: dict[str, Callable[[], Awaitable[None]]] = {"training loop": self._trainer}
        else:
            if cfg.eval_every and self.eval_dataset is not None and self.step % cfg.eval_every == 0:
                # Step 0's evaluation, or a resumed run's at its checkpoint when the run was
                # killed between the checkpoint and that evaluation (once: see ``evaluated``).
                self._request_eval(self.step)
            self._restore_sampled()
            stages = {"dataloader": self._dataloader}
            for i in range(self.n_workers):
                stages[f"rollout worker {i}"] = self._worker
            stages["training loop"] = self._trainer
            stages["evaluation loop"] = self._evaluator
        tasks = {asyncio.create_task(self._stage(name, fn), name=f"rlengine.rl: {name}"): name
                 for name, fn in stages.items()}
        await self._supervise(tasks)
        await self._settle_checkpoint()
        if isinstance(self.error, RunInterrupted):
            await self._checkpoint_at_stop()
        if self.error is not None:
            raise self.error

    async def _stage(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by run()
            self._fail("rollout workers" if name.startswith("rollout worker") else name, exc)

    async def _supervise(self, tasks: dict[asyncio.Task[None], str]) -> None:
        pending = set(tasks)
        aborted = asyncio.ensure_future(self._abort.wait())
        try:
            while pending and not self._abort.is_set():
                pending = (await asyncio.wait(pending | {aborted}, return_when=asyncio.FIRST_COMPLETED))[1]
                pending.discard(aborted)
        finally:
            await _cancelled(aborted)
        if pending:
            pending = (await asyncio.wait(pending, timeout=self.cfg.shutdown_grace_s))[1]
        if pending:
            self.left_behind = sorted(tasks[t] for t in pending)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
            if self.error is not None:
                self.error.add_note(f"rlengine.rl: cancelled after shutdown_grace_s={self.cfg.shutdown_grace_s}: "
                                    f"{', '.join(self.left_behind)}")
        for queue in (self.work_q, self.results_q, self.eval_q):
            while not queue.empty():
                queue.get_nowait()
                self.drained += 1
        current = asyncio.current_task()
        # Every task but this one and the servers' own: stages, rollouts and the
        # waits they started must all be finished by now.
        orphans = [t for t in asyncio.all_tasks() if t is not current and not _serving(t)]
        if orphans and self.error is None:
            self._fail("supervisor", RuntimeError(f"tasks left behind: {[(t.get_name(), t.get_coro()) for t in orphans]}"))

    # -- versions ------------------------------------------------------------------------

    def _policy_version(self, engine_version: int) -> int:
        """The run's policy version (updates applied) of an engine install counter value.

        The engine counts installs from 1 in every process; the run installs
        its starting weights once (``_v0``) and once per update after that."""
        start_updates = self.resume[1].updates if self.resume else 0
        return start_updates + engine_version - self._v0

    def _busy(self) -> tuple[float | None, float | None]:
        """Seconds the engine's sampler has spent in backend steps, and its training lane in
        training calls (each None if the engine does not say: no lane, training blocks sampling)."""
        stats = self.engine.stats()
        return tuple(None if stats.get(key) is None else float(stats[key])  # type: ignore[return-value]
                     for key in ("busy_s", "train_busy_s"))

    async def _call(self, future: Any) -> Any:
        """Await one engine call of the training loop, bounded and abort-aware."""
        return await self._until_aborted(_await(future), timeout=self.cfg.call_timeout_s)

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
        try:
            for p in self._reissue:
                self._issue(WorkItem(p.index, p.attempt, self._builder(p.index)))
            while not self._stop.is_set():
                if self._requeued:
                    self._issue(self._requeued.popleft())
                    continue
                if self.cursor < needed and self.cursor // g <= self.step + ahead:
                    self._issue(WorkItem(self.cursor, 0, self._builder(self.cursor)))
                    self.cursor += 1
                    continue
                if self.cursor >= needed and not self._issued:
                    return
                self._progress.clear()
                # Bounded, so that a missed wake-up costs a second, never a hang.
                try:
                    await asyncio.wait_for(self._progress.wait(), 1.0)
                except TimeoutError:
                    pass
        finally:
            for _ in range(self.n_workers):
                self.work_q.put_nowait(NO_MORE_WORK)

    # -- rollout workers ---------------------------------------------------------------

    async def _worker(self) -> None:
        try:
            while True:
                item = await self.work_q.get()
                if item is NO_MORE_WORK:
                    return
                if self._abort.is_set():
                    continue
                started = time.monotonic()
                seed = mix_seed(self.cfg.seed, item.index, item.attempt)
                group = await self._until_aborted(rollout_group(
                    item.builder, self.sampler, self.params, seed, max_turns=self.cfg.max_turns,
                    episode_timeout_s=self.cfg.episode_timeout_s))
                if group is not None:
                    self._arrive(RolloutResult(item, group, time.monotonic() - started,
                                               prepared=prepare_group(self.cfg, group)))
        finally:
            self._workers_left -= 1
            if self._workers_left == 0:
                self.results_q.put_nowait(WORKERS_DONE)

    # -- training loop ---------------------------------------------------------------------

    async def _trainer(self) -> None:
        try:
            while self.step < self.total_steps:
                if not await self._train_step():
                    return
            self._finished = True
        finally:
            # The training loop signals evaluation: a last evaluation after a
            # normal end, then stop.
            if self._finished and self.cfg.eval_every and self.eval_dataset is not None \
                    and self.cfg.train_from is None:
                self._request_eval(self.step)
            self.eval_q.put_nowait(EVAL_STOP)
            self._request_stop()

    def _arrive(self, result: RolloutResult) -> None:
        """A sampled group, for the training loop (and for a checkpoint until it is consumed)."""
        item = result.item
        self.results_q.put_nowait(result)
        self._unconsumed[item.index] = result
        if item.attempt == 0:
            batch = item.index // self.cfg.groups_per_batch
            self._arrived[batch] = self._arrived.get(batch, 0) + 1
            self._progress.set()

    def _restore_sampled(self) -> None:
        """A resumed run's groups that its checkpoint holds sampled, back in the results queue."""
        for s in self._restored:
            item = WorkItem(s.index, s.attempt, self._builder(s.index))
            self._issued[s.index] = PendingGroup(s.index, s.attempt)
            self._arrive(RolloutResult(item, s.group, 0.0, s.version_shift))

    async def _next_result(self) -> RolloutResult | None:
        result = await self._until_aborted(self.results_q.get())
        if result is None:
            return None
        if result is WORKERS_DONE:
            if self._abort.is_set():
                return None
            raise RuntimeError(f"step {self.step + 1}: every rollout worker stopped before the step had its "
                               f"{self.cfg.groups_per_batch} groups")
        return result

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
        self._progress.set()

    async def _train_step(self) -> bool:
        cfg = self.cfg
        step = self.step + 1
        if cfg.train_from is not None:
            return await self._replay_step(step)
        batch = self._batch = StepBatch(cfg, None if cfg.rollout_only else self.training, step, self.updates,
                                        self._policy_version)
        while batch.consumed < cfg.groups_per_batch:
            result = await self._next_result_for(step)
            if result is None:
                return False
            self._intake(result, batch)
        train_started = time.monotonic()
        train_metrics: dict[str, float] = {}
        lr = cfg.learning_rate
        if cfg.lr_schedule == "linear":
            lr *= 1.0 - (step - 1) / self.total_steps
        adam = AdamParams(learning_rate=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, grad_clip_norm=cfg.grad_clip_norm)
        if cfg.recomputes and not cfg.rollout_only and batch.plan() and not await self._recompute(batch):
            return False
        optims = batch.submit(adam)
        if optims and not cfg.rollout_only:
            # The evaluation of step k samples policy k only: the install waits for it.
            if await self._until_aborted(self._evals_settled.wait()) is None:
                return False
            if cfg.reproducible and cfg.max_steps_off_policy and not await self._released_sampled(step):
                return False
            install = self.training.save_weights_for_sampler()
            train_metrics = await self._train(batch, optims, lr, install)
            if train_metrics is None:
                return False
        if cfg.dump_rollouts is not None:
            await asyncio.to_thread(write_step, cfg.dump_rollouts, batch.to_dump(lr))
        return await self._finish_step(batch, train_metrics, train_started)

    async def _released_sampled(self, step: int) -> bool:
        """Wait until every batch released before step ``step``'s install (the fixed-lag schedule:
        batches up to ``step + max_steps_off_policy``) has all its groups sampled; False on abort."""
        g = self.cfg.groups_per_batch
        last = min(step + self.cfg.max_steps_off_policy, self.total_steps)
        while any(self._arrived.get(b, 0) < g for b in range(step, last)):
            if self._abort.is_set():
                return False
            self._progress.clear()
            # Bounded, so that a missed wake-up costs a second, never a hang.
            try:
                await asyncio.wait_for(self._progress.wait(), 1.0)
            except TimeoutError:
                pass
        return not self._abort.is_set()

    async def _recompute(self, batch: StepBatch) -> bool:
        """The recompute pass (``TrainConfig.recomputes``): the trainer's logprobs of the step's
        datums, before its first update, into the datums; False on abort."""
        futures = [(self.training.forward(data, "cross_entropy"), idx) for data, idx in batch.recompute_calls()]
        outputs = [(await self._call(f), idx) for f, idx in futures]
        if self._abort.is_set():
            return False
        batch.apply_recompute(outputs)
        return True

    async def _train(self, batch: StepBatch, optims: list[Any], lr: float,
                     install: Any = None) -> dict[str, float] | None:
        """Await a step's training calls (and its install); its training columns, None on abort."""
        outputs = [(await self._call(f), idx) for f, idx in batch.fb]
        optim_outs = [await self._call(o) for o in optims]
        if install is not None:
            await self._call(install)
        if self._abort.is_set():
            return None
        self.updates += 1
        return batch.train_metrics(outputs, optim_outs) | {"learning_rate": lr}

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
            train_metrics = await self._train(batch, optims, dump.learning_rate)
            if train_metrics is None:
                return False
        return await self._finish_step(batch, train_metrics, train_started)

    async def _finish_step(self, batch: StepBatch, train_metrics: dict[str, float], train_started: float) -> bool:
        """The step's metrics line, ledger, failure check, checkpoint and evaluation request."""
        cfg = self.cfg
        step = batch.step
        now = time.monotonic()
        busy = self._busy()
        wall = now - self._last_step_end
        share = [min(1.0, max(0.0, (b - last) / wall)) if wall and b is not None and last is not None else None
                 for b, last in zip(busy, self._last_busy)]
        record = batch.record(self.updates, train_metrics, wall=wall, train_time_s=now - train_started,
                              sampler_idle_frac=None if share[0] is None else 1.0 - share[0],
                              trainer_busy_frac=share[1], time_s=now - self._clock0)
        self._last_step_end, self._last_busy = now, busy
        # The step is complete: advance, and snapshot the loop state before any
        # await lets the dataloader issue the next batch.
        self.step = step
        self._progress.set()
        self._batch = None
        snapshot = self._boundary = self._snapshot()
        self.log.step(record)
        self.log.groups(batch.ledger)
        if self.on_step is not None:
            self.on_step(record)
        self._check_failures(batch)
        if self._interrupted is not None:  # the step it waited for is done: stop (its checkpoint is the stop's)
            self._fail("signal handler", self._interrupted)
            return False
        if self._checkpoint_due():
            await self._checkpoint(snapshot)
        if cfg.eval_every and self.eval_dataset is not None and step % cfg.eval_every == 0:
            self._request_eval(step)
        return True

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
            self._fail("training loop", FailureBudgetExceeded("failed attempts", failed / attempts,
                                                              cfg.max_failure_share, len(window)))
        elif groups and untrained / groups > cfg.max_failure_share:
            self._fail("training loop", FailureBudgetExceeded("groups untrained for too few surviving attempts",
                                                              untrained / groups, cfg.max_failure_share, len(window)))

    def _request_eval(self, step: int) -> None:
        if step not in self._eval_requested:
            self._eval_requested.add(step)
            self._evals_open += 1
            self._evals_settled.clear()
            self.eval_q.put_nowait(step)

    # -- checkpoints -----------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        k = self.cfg.checkpoint_every
        return bool(self.checkpointer and k and (self.step % k == 0 or self.step == self.total_steps))

    def _snapshot(self) -> LoopState:
        shift = self._policy_version(0)
        sampled = [SampledGroup(index=r.item.index, attempt=r.item.attempt, group=r.group,
                                version_shift=shift if r.version_shift is None else r.version_shift)
                   for r in sorted(self._unconsumed.values(), key=lambda r: r.item.index)]
        return LoopState(step=self.step, updates=self.updates, cursor=self.cursor,
                         pending=sorted(self._issued.values(), key=lambda p: p.index), sampled=sampled,
                         rng=capture_rng(), elapsed_s=time.monotonic() - self._clock0)

    async def _checkpoint(self, state: LoopState) -> None:
        # Its own task, awaited unless the run aborts: a save under way is never abandoned
        # half-written, nor raced by the checkpoint at a stop (``_settle_checkpoint``).
        self._saving = asyncio.create_task(self._save(state), name=f"rlengine.rl: checkpoint {state.step}")
        await self._until_aborted(asyncio.shield(self._saving))

    async def _save(self, state: LoopState) -> None:
        """Save the trainer state (submitted at once, so before any training call of the next step:
        the trainer is at ``state``'s step) and commit the checkpoint."""
        assert self.checkpointer is not None
        staging = self.checkpointer.staging_dir(state.step)
        # A blocking item: it runs with the sampler drained, after this step's install.
        await asyncio.wait_for(_await(self.training.save_state(f"{staging}/trainer")), self.cfg.call_timeout_s)
        self.last_checkpoint = self.checkpointer.commit(staging, state)

    async def _settle_checkpoint(self) -> None:
        """Wait for a checkpoint still being written (bounded by ``call_timeout_s``); its failure is the
        run's error if it has none."""
        saving = self._saving
        if saving is None:
            return
        await asyncio.wait({saving}, timeout=self.cfg.call_timeout_s)
        if not saving.done():
            saving.cancel()
            await asyncio.wait({saving}, timeout=1.0)
        if not saving.cancelled() and saving.exception() is not None and self.error is None:
            self._fail("training loop", saving.exception())  # type: ignore[arg-type]

    async def _checkpoint_at_stop(self) -> None:
        """After an interrupt: checkpoint the last step this run finished, unless it is checkpointed
        already or the interrupted step had sent training calls (the trainer is then past that step,
        and its state matches no step: the newest checkpoint stays the last one committed)."""
        state = self._boundary
        if self.checkpointer is None or state is None:
            return
        if self.last_checkpoint is not None and os.path.basename(self.last_checkpoint) == f"step-{state.step:06d}":
            return
        batch = self._batch
        if batch is not None and batch.calls and not self.cfg.rollout_only:
            logger.warning("rlengine.rl: no checkpoint at the stop: step %d had sent training calls (the newest "
                           "checkpoint is %s)", batch.step, self.last_checkpoint)
            return
        self._saving = asyncio.create_task(self._save(state), name=f"rlengine.rl: checkpoint {state.step}")
        await self._settle_checkpoint()

    # -- evaluation loop -------------------------------------------------------------------

    async def _evaluator(self) -> None:
        while True:
            request = await self.eval_q.get()
            # Re-check shutdown after every wake-up: an abort overrides queued requests.
            if self._abort.is_set() or request is EVAL_STOP:
                return
            record = await self._until_aborted(self._evaluate(request))
            if record is None:
                return
            self.log.evaluation(record)
            self._evals_open -= 1
            if not self._evals_open:
                self._evals_settled.set()
            if self.on_eval is not None:
                self.on_eval(record)

    async def _evaluate(self, step: int) -> dict[str, Any]:
        assert self.eval_dataset is not None
        started = time.monotonic()
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.eval_temperature)
        builders = [b for i in range(len(self.eval_dataset)) for b in self.eval_dataset.get_batch(i)]
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(rollout_group(
                b, self.sampler, params, mix_seed(self.cfg.seed, _EVAL_SEED, step, i), max_turns=self.cfg.max_turns,
                episode_timeout_s=self.cfg.episode_timeout_s)) for i, b in enumerate(builders)]
        rewards: list[float] = []
        failed = 0
        versions: list[int] = []
        for task in running:
            group = task.result()
            for t, total in zip(group.trajectories, group.total_rewards()):
                if t.failed:
                    failed += 1
                else:
                    rewards.append(total)
            spans = group.versions()
            if spans is not None:
                versions += [self._policy_version(spans[0]), self._policy_version(spans[1])]
        return {"step": step, **reward_stats(rewards), "attempts": len(rewards) + failed, "attempts_failed": failed,
                "version_min": min(versions) if versions else None, "version_max": max(versions) if versions else None,
                "eval_time_s": time.monotonic() - started}


async def _await(future: Any) -> Any:
    return await future


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and let it finish (a cancelled task is not done until the loop runs it)."""
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
