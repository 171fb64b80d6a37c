"""Recipes: what to train on, with which model and defaults, by name.

A ``Recipe`` bundles the datasets (training and held-out), the engine
settings (which model, which backend), its defaults for ``TrainConfig`` and
its own options (an ``Options`` Struct; ``key=value`` on the command line
sets either kind). ``load_recipe`` resolves a built-in name or
``"package.module:ATTRIBUTE"`` for a recipe of your own.

Built in:

* ``copy`` - copy the digits of the prompt ("123=" -> "123$") with a
  character-level model built locally; single-turn, shaped reward, learns
  on CPU in minutes (``copy_digits``).
* ``guess`` - a multi-turn guessing game; each game runs in a sandbox
  process that samples through the engine's IPC server (``guess``,
  ``guess_sandbox``).
* ``guess-duo`` - the guessing game with two agents: a scripted hint-giver
  that never trains and a guesser that does (``guess_duo``; multi-agent
  episodes, ``rlengine.rl.multi_agent``).
* ``tools`` - an agent with the official ``openai`` client and
  ``tools=[...]`` over HTTP, in sandbox processes; the answer is what the
  tool returns; learns on CPU in minutes (``tools``, ``tools_agent``).
* ``distill`` - ``copy``'s task learnt from a teacher (``teacher=PATH``) by
  on-policy distillation; ``distill:<base>`` for another base (``distill``).

A recipe whose environments need something running beside the engine (a
server, sandbox processes) provides it in ``attach``, entered once the
engine runs and left before it closes.

``model=`` (``TrainConfig.model``) puts a model of the user's in place of a
recipe's own: ``given_model`` resolves it once (a Hugging Face directory, a
``.gguf`` file converted into the cache, a hub id from the local cache) and
loads its tokenizer; each recipe encodes its prompts with that tokenizer and
checks what it needs of the model (``GivenModel.check_context`` and its own
checks), refusing with a ``ConfigurationError`` that names the model.

This module must not run anything.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import importlib
import os
from typing import Any, ClassVar

import msgspec
import numpy as np

from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig
from rlengine.rl.types import EnvGroupBuilder, RLDataset

__all__ = ["BUILTIN", "DigitTasks", "EveryDigit", "GivenModel", "Recipe", "SeededBatches", "TaskGroup", "given_model",
           "load_recipe"]

BUILTIN: dict[str, str] = {
    "copy": "rlengine.rl.recipes.copy_digits:RECIPE",
    "guess": "rlengine.rl.recipes.guess:RECIPE",
    "guess-duo": "rlengine.rl.recipes.guess_duo:RECIPE",
    "tools": "rlengine.rl.recipes.tools:RECIPE",
    "distill": "rlengine.rl.recipes.distill:copy",
}


class NoOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A recipe without options of its own."""


class Recipe(abc.ABC):
    """A trainable task; see the module docstring."""

    name: ClassVar[str]
    description: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    """``TrainConfig`` settings this recipe starts from."""
    Options: ClassVar[type[msgspec.Struct]] = NoOptions
    requires: ClassVar[dict[str, str]] = {}
    """Modules the recipe needs beyond the base install -> the extra that brings them
    (``{"httpx": "agents"}``); ``check_requires`` imports each (``rlengine train`` calls it
    before anything starts)."""

    def check_requires(self) -> None:
        """A ``ConfigurationError`` naming the first module of ``requires`` that does not import,
        and the extra to install."""
        for module, extra in self.requires.items():
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigurationError(f"recipe {self.name!r} needs the module {module!r} ({exc}): "
                                         f"pip install 'rlengine[{extra}]'") from None

    @abc.abstractmethod
    def engine_config(self, config: TrainConfig, options: Any) -> EngineConfig:
        """The engine to train with (model, backend); runs before the engine starts."""

    @abc.abstractmethod
    def datasets(self, config: TrainConfig, options: Any) -> tuple[RLDataset, RLDataset | None]:
        """The training dataset and the held-out one (None: no evaluation)."""

    def attach(self, engine: Any, dataset: RLDataset,
               eval_dataset: RLDataset | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """What the environments need beside the running engine, for the run (default: nothing)."""
        return contextlib.nullcontext()


class GivenModel:
    """A model given with ``model=``: its local directory, tokenizer, context and end tokens."""

    def __init__(self, name: str, path: str, tokenizer: Any, context: int | None, eos_ids: frozenset[int]) -> None:
        self.name = name
        self.path = path
        self.tokenizer = tokenizer
        self.context = context
        self.eos_ids = eos_ids

    def refuse(self, reason: str) -> ConfigurationError:
        return ConfigurationError(f"model={self.name!r}: {reason}")

    def encode(self, text: str, special: bool = False) -> list[int]:
        """``text``'s token ids; ``special``: with the tokens the tokenizer adds to a whole input (a BOS)."""
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def check_context(self, need: int, what: str) -> None:
        """Refuse when ``need`` tokens (``what``: the recipe's longest sequence) exceed the context."""
        if self.context is not None and need > self.context:
            raise self.refuse(f"its context of {self.context} tokens cannot hold {what} ({need} tokens)")

    def engine_config(self, config: TrainConfig) -> EngineConfig:
        return EngineConfig(model=self.path, backend=config.backend, cache_dir=config.cache_dir)


def given_model(config: TrainConfig, recipe: str) -> GivenModel | None:
    """``config.model`` resolved and its tokenizer loaded (None: the recipe's own model); once per
    model and cache (a recipe asks in ``datasets`` and again in ``engine_config``)."""
    if config.model is None:
        return None
    if config.backend == "sim":
        raise ConfigurationError(f"backend='sim': the {recipe} recipe needs a model backend (torch or vllm)")
    return _given(config.model, config.cache_dir)


@functools.lru_cache(maxsize=4)
def _given(model: str, cache_dir: str | None) -> GivenModel:
    from rlengine.backends.torch.models import cache_root, describe, load_tokenizer, resolve

    path = resolve(model, cache_root(None) if cache_dir is None else os.path.abspath(cache_dir))
    # transformers makes an empty tokenizer for a directory without tokenizer files: look first.
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    found = [f for f in files if os.path.isfile(os.path.join(path, f))]
    try:
        if not found:
            raise OSError(f"none of {', '.join(files)}")
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"model={model!r}: no tokenizer loads from {path} ({exc}); the recipe encodes "
                                 "its prompts with the model's tokenizer") from None
    facts = describe(path)
    return GivenModel(model, path, tokenizer, facts.context, facts.eos_ids)


class SeededBatches(RLDataset):
    """``batches`` batches; batch ``i`` is ``build(np.random.default_rng([seed, i]), i)``, so
    it is a pure function of the index (what a resumed run needs)."""

    def __init__(self, batches: int, seed: int) -> None:
        self.batches = batches
        self.seed = seed

    def __len__(self) -> int:
        return self.batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < self.batches:
            raise IndexError(f"batch {index} of {self.batches}")
        return self.build(np.random.default_rng([self.seed, index]), index)

    @abc.abstractmethod
    def build(self, rng: np.random.Generator, index: int) -> list[EnvGroupBuilder]:
        """The builders of batch ``index``, drawn from ``rng`` only."""


class TaskGroup(EnvGroupBuilder):
    """``size`` attempts at one task: each attempt's environment is ``world.env(task, index)``
    (``index``: the group's batch, -1 for evaluation); its ledger metadata is ``{key: task}``."""

    def __init__(self, world: Any, key: str, task: Any, index: int, size: int) -> None:
        self.world = world
        self.key = key
        self.task = task
        self.index = index
        self.size = size

    async def make_envs(self) -> list[Any]:
        return [self.world.env(self.task, self.index) for _ in range(self.size)]

    def metadata(self) -> dict[str, Any]:
        return {self.key: self.task}


class DigitTasks(SeededBatches):
    """``batches`` batches of ``groups`` tasks, each a random digit, as ``TaskGroup``s of ``world``."""

    def __init__(self, world: Any, key: str, batches: int, groups: int, group_size: int, seed: int) -> None:
        super().__init__(batches, seed)
        self.world = world
        self.key = key
        self.groups = groups
        self.group_size = group_size

    def build(self, rng: np.random.Generator, index: int) -> list[EnvGroupBuilder]:
        return [TaskGroup(self.world, self.key, int(d), index, self.group_size) for d in rng.integers(0, 10, self.groups)]


class EveryDigit(RLDataset):
    """Evaluation: each of the ten digits once, one attempt each."""

    def __init__(self, world: Any, key: str) -> None:
        self.world = world
        self.key = key

    def __len__(self) -> int:
        return 1

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if index != 0:
            raise IndexError(f"batch {index} of 1")
        return [TaskGroup(self.world, self.key, d, -1, 1) for d in range(10)]


def load_recipe(name: str) -> Recipe:
    """A built-in recipe by name, or ``module:attribute`` (a Recipe instance or class)."""
    ref = BUILTIN.get(name, name)
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ConfigurationError(f"recipe={name!r}: not a built-in recipe ({', '.join(BUILTIN)}) "
                                 "nor 'package.module:ATTRIBUTE'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ConfigurationError(f"recipe={name!r}: cannot import {module!r}: {exc}") from None
    except AttributeError:
        raise ConfigurationError(f"recipe={name!r}: {module!r} has no {attr!r}") from None
    recipe = obj() if isinstance(obj, type) else obj
    if not isinstance(recipe, Recipe):
        raise ConfigurationError(f"recipe={name!r}: {ref} is a {type(recipe).__name__}, not a Recipe")
    return recipe
