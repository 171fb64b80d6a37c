"""When a training run checkpoints, and the saves themselves: every K steps, at the last step, at a stop.

``rlengine.rl.checkpoint`` is the format and the directory (``Checkpointer``,
``LoopState``); this module is the run's side of it. A step's checkpoint is
taken at the step boundary (the training loop hands over the ``LoopState`` it
snapshot there) and saved in a task of its own: the trainer's state is
submitted at once, so before any training call of the next step, and a save
under way is never abandoned half-written, not even by an abort
(``settle``). After an interrupt the last step the run finished is
checkpointed too (``at_stop``), unless the interrupted step had sent training
calls: the trainer is then past that step and its state matches none.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import os

from rlengine.core.clients import TrainingClient
from rlengine.rl.batch import StepBatch
from rlengine.rl.checkpoint import Checkpointer, LoopState
from rlengine.rl.config import TrainConfig
from rlengine.rl.supervisor import Supervisor, awaited

__all__ = ["RunCheckpoints"]

logger = logging.getLogger("rlengine")


class RunCheckpoints:
    """The run's checkpoints: when one is due, its save, the one at a stop; see the module docstring."""

    def __init__(self, config: TrainConfig, checkpointer: Checkpointer | None, supervisor: Supervisor,
                 total_steps: int, last: str | None) -> None:
        self.cfg = config
        self.checkpointer = checkpointer
        self.supervisor = supervisor
        self.total_steps = total_steps
        self.last: str | None = last
        """The newest checkpoint committed (the one resumed from, until this run commits one)."""
        self.training: TrainingClient | None = None
        """The trainer whose state a checkpoint saves (set when the run starts)."""
        self._saving: asyncio.Task[None] | None = None
        """The checkpoint being written: it finishes even when the run aborts (``settle``)."""

    def due(self, step: int) -> bool:
        k = self.cfg.checkpoint_every
        return bool(self.checkpointer and k and (step % k == 0 or step == self.total_steps))

    async def save(self, state: LoopState) -> None:
        """Checkpoint ``state`` (a step boundary): awaited unless the run aborts, never abandoned."""
        # Its own task: a save under way is never abandoned half-written, nor raced by the
        # checkpoint at a stop (``settle``).
        self._saving = asyncio.create_task(self._save(state), name=f"rlengine.rl: checkpoint {state.step}")
        await self.supervisor.until_aborted(asyncio.shield(self._saving))

    async def _save(self, state: LoopState) -> None:
        """Save the trainer state (submitted at once, so before any training call of the next step:
        the trainer is at ``state``'s step) and commit the checkpoint."""
        assert self.checkpointer is not None and self.training is not None
        staging = self.checkpointer.staging_dir(state.step)
        # A blocking item: it runs with the sampler drained, after this step's install.
        await asyncio.wait_for(awaited(self.training.save_state(f"{staging}/trainer")), self.cfg.call_timeout_s)
        self.last = self.checkpointer.commit(staging, state)

    async def settle(self) -> None:
        """Wait for a checkpoint still being written (bounded by ``call_timeout_s``); its failure is the
        run's error if it has none."""
        saving = self._saving
        if saving is None:
            return
        await asyncio.wait({saving}, timeout=self.cfg.call_timeout_s)
        if not saving.done():
            saving.cancel()
            await asyncio.wait({saving}, timeout=1.0)
        if not saving.cancelled() and saving.exception() is not None and self.supervisor.error is None:
            self.supervisor.fail("training loop", saving.exception())  # type: ignore[arg-type]

    async def at_stop(self, boundary: LoopState | None, in_training: StepBatch | None) -> None:
        """After an interrupt: checkpoint ``boundary``, the last step this run finished, unless it is
        checkpointed already or the interrupted step (``in_training``) had
        sent training calls (the trainer is then past that step, and its state matches no step: the
        newest checkpoint stays the last one committed)."""
        if self.checkpointer is None or boundary is None:
            return
        if self.last is not None and os.path.basename(self.last) == f"step-{boundary.step:06d}":
            return
        if in_training is not None and in_training.calls and not self.cfg.rollout_only:
            logger.warning("rlengine.rl: no checkpoint at the stop: step %d had sent training calls (the newest "
                           "checkpoint is %s)", in_training.step, self.last)
            return
        self._saving = asyncio.create_task(self._save(boundary), name=f"rlengine.rl: checkpoint {boundary.step}")
        await self.settle()
