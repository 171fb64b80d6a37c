"""The evaluation stage of a training run: the held-out split, rolled out when asked.

The training loop (``rlengine.rl.step``) asks for an evaluation at the start,
every ``eval_every`` steps and after the last; ``Evaluation.stage`` runs them in
order, beside the next step's rollouts, and re-checks the run's abort after
every wake-up. The next weight install waits for ``settled``, so the
evaluation of step k samples policy k alone (its ``version_min`` =
``version_max`` = k), whatever the timing. A resumed run starts with the steps
its evaluation log holds, so none is evaluated twice.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlengine.core.clients import SamplingClient
from rlengine.rl.config import TrainConfig
from rlengine.rl.metrics import RunLog, reward_stats
from rlengine.rl.rollouts import rollout_group
from rlengine.rl.supervisor import Supervisor
from rlengine.rl.types import RLDataset
from rlengine.seeding import mix_seed
from rlengine.types import SamplingParams

__all__ = ["Evaluation"]

_EVAL_SEED = 0x4556414C  # keeps evaluation seeds apart from training seeds


class Evaluation:
    """The run's evaluations: asked for by step, run by one stage; see the module docstring."""

    def __init__(self, config: TrainConfig, dataset: RLDataset | None, log: RunLog, supervisor: Supervisor,
                 policy_version: Callable[[int], int], *, on_eval: Callable[[dict[str, Any]], None] | None = None,
                 evaluated: Sequence[int] = ()) -> None:
        self.cfg = config
        self.dataset = dataset
        self.log = log
        self.supervisor = supervisor
        self.policy_version = policy_version
        """The run's policy version of an engine install counter value."""
        self.on_eval = on_eval
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        """Steps to evaluate, in order; None: stop."""
        self.settled = asyncio.Event()
        """Set while no evaluation asked for is unfinished: the next weight install waits for it."""
        self.settled.set()
        self._requested: set[int] = set(evaluated)
        """Steps evaluated or asked for (a resumed run starts with those its eval log holds)."""
        self._open = 0

    def due(self, step: int) -> bool:
        """Whether the run evaluates at ``step`` (every ``eval_every`` steps, step 0 included)."""
        return bool(self.cfg.eval_every and self.dataset is not None and step % self.cfg.eval_every == 0)

    def request(self, step: int) -> None:
        """Ask for the evaluation of step ``step`` (once per step)."""
        if self.dataset is not None and step not in self._requested:
            self._requested.add(step)
            self._open += 1
            self.settled.clear()
            self.queue.put_nowait(step)

    def stop(self) -> None:
        """No more requests: the stage returns once those queued are done."""
        self.queue.put_nowait(None)

    async def stage(self, sampler: SamplingClient) -> None:
        """The evaluation loop: one evaluation per request, until ``stop`` or the run aborts."""
        while True:
            step = await self.queue.get()
            # Re-check shutdown after every wake-up: an abort overrides queued requests.
            if self.supervisor.abort.is_set() or step is None:
                return
            record = await self.supervisor.until_aborted(self._evaluate(sampler, step))
            if record is None:
                return
            self.log.evaluation(record)
            self._open -= 1
            if not self._open:
                self.settled.set()
            if self.on_eval is not None:
                self.on_eval(record)

    async def _evaluate(self, sampler: SamplingClient, step: int) -> dict[str, Any]:
        assert self.dataset is not None
        cfg = self.cfg
        started = time.monotonic()
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.eval_temperature)
        builders = [b for i in range(len(self.dataset)) for b in self.dataset.get_batch(i)]
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(rollout_group(
                b, sampler, params, mix_seed(cfg.seed, _EVAL_SEED, step, i), max_turns=cfg.max_turns,
                episode_timeout_s=cfg.episode_timeout_s)) for i, b in enumerate(builders)]
        rewards: list[float] = []
        failed = 0
        versions: list[int] = []
        for task in running:
            group = task.result()
            for t, total in zip(group.trajectories, group.total_rewards()):
                if not t.trainable:  # a multi-agent episode's untrained agents: not the policy's reward
                    continue
                if t.failed:
                    failed += 1
                else:
                    rewards.append(total)
            spans = group.versions()
            if spans is not None:
                versions += [self.policy_version(spans[0]), self.policy_version(spans[1])]
        return {"step": step, **reward_stats(rewards), "attempts": len(rewards) + failed, "attempts_failed": failed,
                "version_min": min(versions) if versions else None, "version_max": max(versions) if versions else None,
                "eval_time_s": time.monotonic() - started}
