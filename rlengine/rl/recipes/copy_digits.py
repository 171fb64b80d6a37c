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

With ``model=`` (a model of the user's; ``given_model``) the digits are
encoded with that model's tokenizer (``TokenizerDigits``): the prompt is a
user message asking for the digits under the model's chat template (the raw
``"123="`` where it has none), the answer is read back as text up to the
first of the model's end tokens, and the same shaped reward counts the
matching leading characters and then the end token. The answer may take up
to ``max_tokens`` tokens; the recipe refuses a model whose canonical answer
or longest prompt does not fit.

It must not depend on anything but the engine and the RL types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig, check_integer
from rlengine.rl.recipes import GivenModel, Recipe, SeededBatches, given_model
from rlengine.rl.types import Env, EnvGroupBuilder, Observation, RLDataset, StepResult
from rlengine.types import ModelInput
from rlengine.validation import Bound, NonNegativeInt, validate

__all__ = ["ALPHABET", "RECIPE", "CharDigits", "CopyDigits", "CopyEnv", "CopyOptions", "TokenizerDigits",
           "shaped_reward"]

ALPHABET = "0123456789=$"
END = "$"
_IDS = {c: i + 1 for i, c in enumerate(ALPHABET)}


def encode(text: str) -> list[int]:
    return [_IDS[c] for c in text]


def shaped_reward(target: Sequence[Any], action: Sequence[Any]) -> float:
    """The fraction of ``target`` that ``action`` matches from the first token (or character) on."""
    n = 0
    for want, got in zip(target, action):
        if want != got:
            break
        n += 1
    return n / len(target)


class CharDigits:
    """The recipe's own character model: a prompt and an answer are one token per character."""

    def prompt(self, number: str) -> list[int]:
        return encode(number + "=")

    def target(self, number: str) -> list[Any]:
        return encode(number + END)

    def answer(self, action: Sequence[int]) -> Sequence[Any]:
        return action

    def max_tokens(self, number: str) -> int:
        return len(number) + 1


_ENDED = object()
"""Stands for "the model stopped at an end token" in a ``TokenizerDigits`` target and answer."""


class TokenizerDigits:
    """A given model's tokenizer (see the module docstring): the answer compares as text, so a
    tokenization other than the canonical one of the same digits earns the same reward."""

    def __init__(self, model: GivenModel, max_tokens: int) -> None:
        self.model = model
        self.limit = max_tokens
        self.chat = bool(getattr(model.tokenizer, "chat_template", None))

    def prompt(self, number: str) -> list[int]:
        if self.chat:
            # As the chat endpoints render: the template's text, tokenized without added specials.
            text = self.model.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Copy these digits exactly: {number}"}], tokenize=False,
                add_generation_prompt=True)
            return self.model.encode(text)
        return self.model.encode(number + "=", special=True)

    def target(self, number: str) -> list[Any]:
        return [*number, _ENDED]

    def answer(self, action: Sequence[int]) -> Sequence[Any]:
        ids = list(action)
        end = next((i for i, t in enumerate(ids) if t in self.model.eos_ids), None)
        text = self.model.tokenizer.decode(ids[:end], skip_special_tokens=False)
        return [*text, _ENDED] if end is not None else list(text)

    def max_tokens(self, number: str) -> int:
        return self.limit

    def check(self, digits: int) -> None:
        """Refuse a model the recipe cannot fit: no end token, an answer or prompt too long."""
        if not self.model.eos_ids:
            raise self.model.refuse("names no end-of-sequence token (config.json, generation_config.json): the "
                                    "copy answer ends with one")
        probes = [(str(i) * digits) for i in range(10)] + ["1234567890"[:digits]]
        answer = max(len(self.model.encode(n)) for n in probes) + 1
        if answer > self.limit:
            raise ConfigurationError(f"max_tokens={self.limit}: {self.model.name!r} answers {digits} digits and its "
                                     f"end token in {answer} tokens")
        prompt = max(len(self.prompt(n)) for n in probes)
        self.model.check_context(prompt + self.limit, f"a copy prompt and max_tokens={self.limit}")


class CopyOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    digits: Annotated[int, Bound(ge=1, le=8)] = 3
    """Digits per prompt."""
    eval_size: NonNegativeInt | None = None
    """Numbers held out of training and used for evaluation (at most half of them); None: a tenth of
    them, at most 100."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        if self.eval_size is not None:
            check_integer("eval_size", self.eval_size, minimum=0, maximum=10 ** self.digits // 2)

    @property
    def held_out(self) -> int:
        return min(100, 10 ** self.digits // 10) if self.eval_size is None else self.eval_size


Digits = CharDigits | TokenizerDigits


class CopyEnv(Env):
    """One attempt at copying one number."""

    def __init__(self, number: str, digits: Digits) -> None:
        self.number = number
        self.digits = digits
        self.target = digits.target(number)

    async def initial_observation(self) -> Observation:
        return Observation(prompt=ModelInput.from_ints(self.digits.prompt(self.number)),
                           max_tokens=self.digits.max_tokens(self.number))

    async def step(self, action: list[int]) -> StepResult:
        reward = shaped_reward(self.target, self.digits.answer(action))
        return StepResult(reward=reward, done=True, metrics={"exact": float(reward == 1.0)})


class CopyGroup(EnvGroupBuilder):
    def __init__(self, number: str, size: int, digits: Digits) -> None:
        self.number = number
        self.size = size
        self.digits = digits

    async def make_envs(self) -> list[Env]:
        return [CopyEnv(self.number, self.digits) for _ in range(self.size)]

    def metadata(self) -> dict[str, Any]:
        return {"number": self.number}


def _split(options: CopyOptions, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training numbers, held-out numbers): a seeded partition of 0 .. 10**digits - 1."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(10 ** options.digits)
    return order[options.held_out:], order[:options.held_out]


class CopyDataset(SeededBatches):
    """``batches`` batches of ``groups`` numbers drawn from ``pool``."""

    def __init__(self, pool: np.ndarray, batches: int, groups: int, group_size: int, digits: int, seed: int,
                 codec: Digits) -> None:
        super().__init__(batches, seed)
        self.pool = pool
        self.groups = groups
        self.group_size = group_size
        self.digits = digits
        self.codec = codec

    def build(self, rng: np.random.Generator, index: int) -> list[EnvGroupBuilder]:
        picks = rng.choice(self.pool, self.groups)
        return [CopyGroup(f"{int(n):0{self.digits}d}", self.group_size, self.codec) for n in picks]


class HeldOut(RLDataset):
    """The held-out numbers, one attempt each, as one batch."""

    def __init__(self, numbers: np.ndarray, digits: int, codec: Digits) -> None:
        self.numbers = numbers
        self.digits = digits
        self.codec = codec

    def __len__(self) -> int:
        return 1

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if index != 0:
            raise IndexError(f"batch {index} of 1")
        return [CopyGroup(f"{int(n):0{self.digits}d}", 1, self.codec) for n in self.numbers]


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
        model = given_model(config, self.name)
        if model is not None:
            return model.engine_config(config)
        path = prepare_char_model(ALPHABET, END, cache_dir=config.cache_dir, seed=config.seed,
                                  max_position_embeddings=max(64, 2 * options.digits + 4))
        return EngineConfig(model=path, backend=backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: CopyOptions) -> tuple[RLDataset, RLDataset | None]:
        model = given_model(config, self.name)
        codec: Digits
        if model is None:
            if config.max_tokens < options.digits + 1:
                raise ConfigurationError(f"max_tokens={config.max_tokens}: the answer needs digits + 1 = "
                                         f"{options.digits + 1} tokens")
            codec = CharDigits()
        else:
            codec = TokenizerDigits(model, config.max_tokens)
            codec.check(options.digits)
        train, held_out = _split(options, config.seed)
        batches = config.steps if config.steps is not None else 500
        dataset = CopyDataset(train, batches, config.groups_per_batch, config.group_size, options.digits,
                              config.seed, codec)
        return dataset, (HeldOut(held_out, options.digits, codec) if len(held_out) else None)


RECIPE = CopyDigits()
