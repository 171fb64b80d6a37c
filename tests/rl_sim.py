"""A recipe on the sim backend for the RL loop's plumbing tests, with fault injection.

The sim model cannot learn (its tokens are a hash of the seed, whatever the
weights), but everything else is real: the engine, per-token versions, the
sim trainer's weights and logprobs, checkpoints. Rewards are a pure
function of the sampled tokens (the fraction below ``vocab_size / 2``), so
two runs that sample with the same seeds see the same rewards, and a
resumed run can be compared with an uninterrupted one number for number.

``SimOptions`` injects faults by name and position: the dataset raising at
a batch, a builder at a group, the training loop (a non-numeric env metric)
at a step, the held-out dataset at an evaluation, attempts failing in a
pattern, groups that take long (to go stale), multi-turn episodes. The
subprocess tests load it as ``rl_sim:RECIPE`` with ``tests/`` on the path.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, ClassVar

import msgspec

from rlengine.config import EngineConfig, SimConfig
from rlengine.rl.config import TrainConfig
from rlengine.rl.recipes import Recipe
from rlengine.rl.types import Env, EnvGroupBuilder, Observation, RLDataset, StepResult
from rlengine.types import ModelInput

VOCAB = 64
FAULT_TIMES: dict[str, float] = {}
"""When each injected fault was raised (time.monotonic), for the bounded-exit checks."""


def reset() -> None:
    """Forget faults raised and slow groups served (module state shared by in-process runs)."""
    FAULT_TIMES.clear()
    _SLOW_DONE.clear()


class InjectedFault(RuntimeError):
    """The error the fault injection raises."""


def _raise(stage: str, where: str) -> None:
    FAULT_TIMES[stage] = time.monotonic()
    raise InjectedFault(f"injected fault in the {stage} at {where}")


class SimOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    batches: int = 20
    """Length of the training dataset."""
    gen_len: int = 4
    gen_len_sigma: float = 0.0
    """> 0: each answer's length is drawn, seeded by its request, from a lognormal of median
    ``gen_len`` (an answer as long as its ``max_tokens`` ends there, stop reason ``length``)."""
    step_time_s: float = 0.0
    """Simulated backend time per step."""
    env_delay_s: float = 0.0
    """Every env step sleeps this long."""
    delay_jitter: int = 0
    """n > 0: each env step sleeps a multiple (0 to 2) of env_delay_s drawn from (n, group, attempt):
    it changes the order in which rollouts finish, not what they produce."""
    turns: int = 1
    """Turns per episode: each turn's observation extends the previous context."""
    fail_dataloader_at: int = -1
    """``get_batch`` raises at this batch index."""
    fail_worker_at: int = -1
    """``make_envs`` raises for the group with this global index."""
    fail_trainer_at: int = -1
    """Envs of batch N report a non-numeric metric, which the training loop fails on."""
    fail_eval_at: int = -1
    """The held-out dataset raises when evaluated at this step."""
    fail_attempts_every: int = 0
    """Attempt ``i`` of group ``g`` fails (raises in ``step``) when ``(g * group_size + i) % N == 0``."""
    slow_group: int = -1
    """This global group index sleeps ``slow_s`` in its first attempt's steps (to go stale)."""
    slow_s: float = 0.0


class SimEnv(Env):
    def __init__(self, options: SimOptions, index: int, attempt: int, prompt: list[int], batch: int,
                 slow: bool) -> None:
        self.options = options
        self.index = index
        self.attempt = attempt
        self.context = list(prompt)
        self.batch = batch
        self.slow = slow
        self.turn = 0

    async def initial_observation(self) -> Observation:
        return Observation(prompt=ModelInput.from_ints(self.context))

    async def step(self, action: list[int]) -> StepResult:
        o = self.options
        if o.env_delay_s:
            scale = 1.0 if not o.delay_jitter else random.Random(hash((o.delay_jitter, self.index, self.attempt,
                                                                       self.turn))).uniform(0.0, 2.0)
            await asyncio.sleep(o.env_delay_s * scale)
        if self.slow:
            await asyncio.sleep(o.slow_s)
        if o.fail_attempts_every and self.attempt % o.fail_attempts_every == 0:
            raise ConnectionError(f"sandbox of attempt {self.attempt} went away")
        self.turn += 1
        reward = sum(t < VOCAB // 2 for t in action) / max(1, len(action)) / o.turns
        metrics: dict[str, Any] = {"turn_tokens": float(len(action))}
        if self.batch == o.fail_trainer_at:
            FAULT_TIMES.setdefault("training loop", time.monotonic())
            metrics["broken"] = "not a number"
        if self.turn >= o.turns:
            return StepResult(reward=reward, done=True, metrics=metrics)
        self.context += action + [self.turn % VOCAB]
        return StepResult(reward=reward, done=False, metrics=metrics,
                          next_observation=Observation(prompt=ModelInput.from_ints(self.context)))

    def metadata(self) -> dict[str, Any]:
        return {"sandbox": f"sim-{self.index}-{self.attempt}"}


_SLOW_DONE: set[int] = set()


class SimGroup(EnvGroupBuilder):
    def __init__(self, options: SimOptions, index: int, size: int, batch: int) -> None:
        self.options = options
        self.index = index
        self.size = size
        self.batch = batch

    async def make_envs(self) -> list[Env]:
        if self.index == self.options.fail_worker_at:
            _raise("rollout workers", f"group {self.index}")
        slow = self.index == self.options.slow_group and self.index not in _SLOW_DONE
        if slow:
            _SLOW_DONE.add(self.index)
        prompt = [1 + (self.index * 7 + k) % (VOCAB - 1) for k in range(3)]
        return [SimEnv(self.options, self.index, self.index * self.size + i, prompt, self.batch, slow)
                for i in range(self.size)]

    def logging_tags(self) -> list[str]:
        return ["even" if self.index % 2 == 0 else "odd"]

    def metadata(self) -> dict[str, Any]:
        return {"index": self.index}


class SimDataset(RLDataset):
    def __init__(self, options: SimOptions, groups: int, size: int) -> None:
        self.options = options
        self.groups = groups
        self.size = size

    def __len__(self) -> int:
        return self.options.batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if index == self.options.fail_dataloader_at:
            _raise("dataloader", f"batch {index}")
        if not 0 <= index < self.options.batches:
            raise IndexError(index)
        return [SimGroup(self.options, index * self.groups + j, self.size, index) for j in range(self.groups)]


class SimHeldOut(RLDataset):
    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.calls = 0

    def __len__(self) -> int:
        return 1

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        self.calls += 1
        # Evaluations run at step 0, then every eval_every steps: the n-th call is the (n-1)-th evaluation.
        if self.options.fail_eval_at >= 0 and self.calls - 1 == self.options.fail_eval_at:
            _raise("evaluation loop", f"evaluation {self.calls - 1}")
        return [SimGroup(self.options, 10_000 + j, 1, -1) for j in range(4)]


class SimRecipe(Recipe):
    name = "sim"
    description = "plumbing test recipe on the sim backend"
    defaults: ClassVar[dict[str, Any]] = {"backend": "sim", "groups_per_batch": 4, "group_size": 4, "max_tokens": 8,
                                "learning_rate": 1e-2, "eval_every": 0, "shutdown_grace_s": 2.0}
    Options = SimOptions

    def engine_config(self, config: TrainConfig, options: SimOptions) -> EngineConfig:
        lengths: dict[str, Any] = {"gen_len_dist": "lognormal", "gen_len_sigma": options.gen_len_sigma} \
            if options.gen_len_sigma > 0 else {}
        return EngineConfig(backend="sim", sim=SimConfig(vocab_size=VOCAB, gen_len=options.gen_len,
                                                         step_time_s=options.step_time_s, seed=1, **lengths))

    def datasets(self, config: TrainConfig, options: SimOptions) -> tuple[RLDataset, RLDataset | None]:
        return SimDataset(options, config.groups_per_batch, config.group_size), SimHeldOut(options)


RECIPE = SimRecipe()
