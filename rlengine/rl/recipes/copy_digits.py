"""Recipe ``copy``: learn to copy digits ("123=" -> "123$") from random init, by RL alone.

The model is a character-level Qwen2 (``models.build_char_model``: 13
tokens - padding, the ten digits, ``=`` and the end token ``$``; hidden 64,
2 layers, 2 heads, about 100k parameters), built locally and cached. A
prompt is ``digits`` random digits and ``=``; the answer is sampled at
temperature 1 for at most ``digits + 1`` tokens. The shaped reward is the
fraction of the target ``"123$"`` matched from its first character on (end
token included), so partial progress pays. A random model earns about 0.02.

What makes it learn on two CPU cores in a few minutes (measured with this
engine; see bench/RESULTS.md): GRPO groups of 8 over 32 prompts per step,
each batch used for 8 optimizer steps on eighths of it (``num_substeps``:
PPO's clipping keeps the later ones near the sampling policy; with one step
per batch, or four, some seeds sat at 0.4-0.5 for hundreds of steps), Adam at
2e-3 with grad-norm clipping, and an entropy bonus of 0.05 over the sampled
tokens, kept on for groups whose rewards are all equal
(``skip_constant_reward=False``). Without the bonus the end token's
probability collapses and runs stall at 0.75 (three digits, no end).
Seeds differ a lot in how long they take, hence 500 steps by default
(about 3.5 minutes on two cores).

The loss is the Tinker sum over tokens (``loss_aggregation="sum"``), whose
gradient norm (about 160) the clip at 1.0 cuts at every optimizer step, so
Adam is fed unit-norm gradients. Measured against the peers' means, on the
torch backend, the first step whose batch mean reward reaches 0.9 (median
over seeds 0-9; a seed that never does counts as slowest): ``sum`` 93 steps
(9 of 10 seeds; lr 2e-3, clip 1.0), ``token_mean`` 100.5 (9 of 10; gradient
norm about 1.3, clipped at half the steps), ``seq_mean_token_mean`` 108 (8
of 10), ``seq_mean_token_sum_norm`` 136 (seeds 0-2). Within the seeds'
spread, none is faster. On seeds 0-2, lr 1e-3 was slower in every mode;
``token_mean`` with lr 3e-3, or with clips 0 (none), 0.5 and 2.0, was
slower too; and lr 5e-3 or 1e-2 never reached 0.9 in 200 steps in any mode.

Sampling one step ahead while the step before trains
(``max_steps_off_policy=1``; the run stays reproducible, batch b sampling
policy b - 1 exactly) is an option, not the default: on two cores training
is most of a step and shares them with the sampler, so a step took about as
long (0.15-0.20 s either way), and seeds 0-2 reached 0.9 at steps 134, 81,
129 one step ahead against 115, 148, 173 on-policy (bench/RESULTS.md, issue
29): not a difference these seeds can tell.

``eval_size`` numbers (default 100 of the 1000) are held out of training; every ``eval_every`` steps
they are answered greedily and scored with the same reward.

It must not depend on anything but the engine and the RL types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig, check_integer
from rlengine.rl.recipes import Recipe, SeededBatches
from rlengine.rl.types import Env, EnvGroupBuilder, Observation, RLDataset, StepResult
from rlengine.types import ModelInput

__all__ = ["ALPHABET", "RECIPE", "CopyDigits", "CopyEnv", "CopyOptions", "shaped_reward"]

ALPHABET = "0123456789=$"
END = "$"
_IDS = {c: i + 1 for i, c in enumerate(ALPHABET)}


def encode(text: str) -> list[int]:
    return [_IDS[c] for c in text]


def shaped_reward(target: Sequence[int], action: Sequence[int]) -> float:
    """The fraction of ``target`` that ``action`` matches from the first token on."""
    n = 0
    for want, got in zip(target, action):
        if want != got:
            break
        n += 1
    return n / len(target)


class CopyOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    digits: int = 3
    """Digits per prompt."""
    eval_size: int | None = None
    """Numbers held out of training and used for evaluation; None: a tenth of them, at most 100."""

    def __post_init__(self) -> None:
        check_integer("digits", self.digits, minimum=1, maximum=8)
        if self.eval_size is not None:
            check_integer("eval_size", self.eval_size, minimum=0, maximum=10 ** self.digits // 2)

    @property
    def held_out(self) -> int:
        return min(100, 10 ** self.digits // 10) if self.eval_size is None else self.eval_size


class CopyEnv(Env):
    """One attempt at copying one number."""

    def __init__(self, number: str) -> None:
        self.number = number
        self.target = encode(number + END)

    async def initial_observation(self) -> Observation:
        return Observation(prompt=ModelInput.from_ints(encode(self.number + "=")), max_tokens=len(self.target))

    async def step(self, action: list[int]) -> StepResult:
        reward = shaped_reward(self.target, action)
        return StepResult(reward=reward, done=True, metrics={"exact": float(reward == 1.0)})


class CopyGroup(EnvGroupBuilder):
    def __init__(self, number: str, size: int) -> None:
        self.number = number
        self.size = size

    async def make_envs(self) -> list[Env]:
        return [CopyEnv(self.number) for _ in range(self.size)]

    def metadata(self) -> dict[str, Any]:
        return {"number": self.number}


def _split(options: CopyOptions, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training numbers, held-out numbers): a seeded partition of 0 .. 10**digits - 1."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(10 ** options.digits)
    return order[options.held_out:], order[:options.held_out]


class CopyDataset(SeededBatches):
    """``batches`` batches of ``groups`` numbers drawn from ``pool``."""

    def __init__(self, pool: np.ndarray, batches: int, groups: int, group_size: int, digits: int, seed: int) -> None:
        super().__init__(batches, seed)
        self.pool = pool
        self.groups = groups
        self.group_size = group_size
        self.digits = digits

    def build(self, rng: np.random.Generator, index: int) -> list[EnvGroupBuilder]:
        picks = rng.choice(self.pool, self.groups)
        return [CopyGroup(f"{int(n):0{self.digits}d}", self.group_size) for n in picks]


class HeldOut(RLDataset):
    """The held-out numbers, one attempt each, as one batch."""

    def __init__(self, numbers: np.ndarray, digits: int) -> None:
        self.numbers = numbers
        self.digits = digits

    def __len__(self) -> int:
        return 1

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if index != 0:
            raise IndexError(f"batch {index} of 1")
        return [CopyGroup(f"{int(n):0{self.digits}d}", 1) for n in self.numbers]


class CopyDigits(Recipe):
    name = "copy"
    description = "copy digits ('123=' -> '123$'), a character-level model learning by RL from random init"
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 500, "groups_per_batch": 32, "group_size": 8, "max_tokens": 4, "temperature": 1.0,
        "loss_fn": "ppo", "entropy_coef": 0.05, "loss_aggregation": "sum", "learning_rate": 2e-3, "num_substeps": 8,
        "grad_clip_norm": 1.0,
        "skip_constant_reward": False, "eval_every": 25, "eval_temperature": 0.0, "checkpoint_every": 100,
    }
    Options = CopyOptions

    def engine_config(self, config: TrainConfig, options: CopyOptions) -> EngineConfig:
        backend = config.backend
        if backend == "sim":
            raise ConfigurationError("backend='sim': the copy recipe needs a model backend (torch or vllm)")
        path = prepare_char_model(ALPHABET, END, cache_dir=config.cache_dir, seed=config.seed,
                                  max_position_embeddings=max(64, 2 * options.digits + 4))
        return EngineConfig(model=path, backend=backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: CopyOptions) -> tuple[RLDataset, RLDataset | None]:
        if config.max_tokens < options.digits + 1:
            raise ConfigurationError(f"max_tokens={config.max_tokens}: the answer needs digits + 1 = "
                                     f"{options.digits + 1} tokens")
        train, held_out = _split(options, config.seed)
        batches = config.steps if config.steps is not None else 500
        dataset = CopyDataset(train, batches, config.groups_per_batch, config.group_size, options.digits,
                              config.seed)
        return dataset, (HeldOut(held_out, options.digits) if len(held_out) else None)


RECIPE = CopyDigits()
