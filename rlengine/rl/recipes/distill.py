"""Recipe ``distill``: a base recipe's task, learnt from a teacher by on-policy distillation.

``rlengine train distill teacher=PATH [key=value ...]`` distils into the
``copy`` recipe's fresh student; another base recipe is named after a colon:
``rlengine train rlengine.rl.recipes.distill:guess teacher=PATH`` (a built-in
name, or ``package.module:ATTRIBUTE`` of a recipe of your own). The base
recipe gives the model, the datasets, the environments and their defaults;
its options are this recipe's too, beside the distillation's own:

* ``teacher`` - a model directory, a ``.gguf`` file, a run or checkpoint
  directory of ``rlengine train``, or a ``tinker://`` sampler path
  (``rlengine.rl.teacher.resolve_teacher``);
* ``teachers`` - teachers by task tag (``tag:PATH,tag:PATH``; a mapping in
  the library API): a group goes to the teacher of its first
  ``logging_tags()`` tag with one, else to ``teacher``;
* ``kl_penalty_coef``, ``reward_weight``, ``kl_baseline`` - the advantage
  ``reward_weight * A_group + kl_penalty_coef * (r_t - b_t)`` per sampled
  token, ``r_t = -(logp_student - logp_teacher)`` and ``b_t`` its group
  baseline (``"group"``, the default) or 0 (``none``: tinker-cookbook's)
  (``rlengine.rl.distill``);
* ``teacher_eval`` - evaluate each teacher once before training (its reward
  goes into every metrics line as ``teacher_reward_mean``);
* ``tinker_checkpoint_dir`` - where ``tinker://`` paths live (the local
  Tinker server's ``checkpoint_dir``).

The teachers start in ``attach``, on the running student engine's loop and
compute thread (``rlengine.rl.teacher``), are evaluated, and are handed to
the run as its ``GroupScorer``; they close before the student. Groups whose
rewards are all equal are trained (``skip_constant_reward`` must stay False):
the teacher's per-token signal is in them whatever the reward says.

The base recipe's entropy bonus is off by default (``entropy_coef=0``; set it
to have one): the reverse KL to the teacher already holds the student's
entropy (``KL = -H(student) - E[logp_teacher]``), so a bonus counts it twice
and moves the optimum from the teacher to a flatter ``p_teacher ** (1 / (1 + c))``
(measured on copy: docs/distillation.md).

It must not depend on anything but the engine, the RL types and the teacher.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec

from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig, convert
from rlengine.rl.distill import DistillScorer, parse_teachers
from rlengine.rl.recipes import Recipe, load_recipe
from rlengine.rl.teacher import TeacherSlot, resolve_teacher
from rlengine.rl.types import RLDataset
from rlengine.types import SamplingParams

__all__ = ["DISTILL_FIELDS", "DistillRecipe", "recipe_name"]

_MODULE = "rlengine.rl.recipes.distill"

DISTILL_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("teacher", str | None, None),
    ("teachers", dict[str, str] | str | None, None),
    ("kl_penalty_coef", float, 1.0),
    ("reward_weight", float, 0.0),
    ("kl_baseline", Literal["group"] | None, "group"),
    ("teacher_eval", bool, True),
    ("tinker_checkpoint_dir", str | None, None),
)
"""The distillation's own options: (name, type, default)."""


def recipe_name(base: str) -> str:
    """The recipe name that distils into ``base`` (what ``load_recipe`` resolves)."""
    return "distill" if base == "copy" else f"{_MODULE}:{base}"


class DistillRecipe(Recipe):
    """Distillation into ``base``'s task; see the module docstring."""

    def __init__(self, base: str) -> None:
        self.base_name = base
        self.base = load_recipe(base)
        self.name = recipe_name(base)  # type: ignore[misc]
        self.description = (f"on-policy distillation from teacher=PATH into {base}'s student "  # type: ignore[misc]
                            f"(per-token reverse KL to the teacher as the advantage)")
        self.defaults = {**self.base.defaults, "skip_constant_reward": False,  # type: ignore[misc]
                         "entropy_coef": 0.0}
        self.requires = self.base.requires  # type: ignore[misc]
        self.Options = _options(self.base)  # type: ignore[misc]
        self._run: tuple[TrainConfig, Any] | None = None
        """The run's settings and options, from ``datasets`` (which the run calls before ``attach``)."""

    def _split(self, options: Any) -> tuple[dict[str, Any], Any]:
        """(the distillation's options, the base recipe's Options)."""
        values = msgspec.structs.asdict(options)
        own = {name: values.pop(name) for name, _, _ in DISTILL_FIELDS}
        return own, convert(self.base.Options, values, f"recipe {self.base_name!r}")

    def engine_config(self, config: TrainConfig, options: Any) -> EngineConfig:
        return self.base.engine_config(config, self._split(options)[1])

    def datasets(self, config: TrainConfig, options: Any) -> tuple[RLDataset, RLDataset | None]:
        own, base_options = self._split(options)
        if config.skip_constant_reward:
            raise ConfigurationError("skip_constant_reward=True: distillation trains groups whose rewards are all "
                                     "equal (the teacher's per-token signal is in them)")
        for name, path in parse_teachers(own["teacher"], own["teachers"]).items():
            resolve_teacher(path, field="teacher" if name == "default" else f"teachers[{name!r}]",
                            tinker_checkpoint_dir=own["tinker_checkpoint_dir"], cache_dir=config.cache_dir)
        self._run = (config, options)
        return self.base.datasets(config, base_options)

    @contextlib.asynccontextmanager
    async def attach(self, engine: Any, dataset: RLDataset, eval_dataset: RLDataset | None) -> AsyncIterator[Any]:
        if self._run is None:
            raise ConfigurationError(f"recipe {self.name!r}: attach before datasets (the run calls datasets first)")
        config, options = self._run
        own, _ = self._split(options)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.base.attach(engine, dataset, eval_dataset))
            slots: dict[str, TeacherSlot] = {}
            for name, path in parse_teachers(own["teacher"], own["teachers"]).items():
                source = resolve_teacher(path, field="teacher" if name == "default" else f"teachers[{name!r}]",
                                         tinker_checkpoint_dir=own["tinker_checkpoint_dir"],
                                         cache_dir=config.cache_dir)
                slot = TeacherSlot(name, source)
                await slot.start(engine, config.call_timeout_s)
                stack.push_async_callback(slot.close)
                slots[name] = slot
            scorer = DistillScorer(slots, kl_penalty_coef=own["kl_penalty_coef"],
                                   reward_weight=own["reward_weight"], call_timeout_s=config.call_timeout_s,
                                   kl_baseline=own["kl_baseline"])
            if own["teacher_eval"]:
                params = SamplingParams(max_tokens=config.max_tokens, temperature=config.eval_temperature)
                await scorer.evaluate(eval_dataset or dataset, params, config.seed, max_turns=config.max_turns,
                                      episode_timeout_s=config.episode_timeout_s)
            yield scorer


def _options(base: Recipe) -> type[msgspec.Struct]:
    """The base recipe's Options with the distillation's fields added (a clash is refused)."""
    fields = msgspec.structs.fields(base.Options)
    clash = {f.name for f in fields} & {name for name, _, _ in DISTILL_FIELDS}
    if clash:
        raise ConfigurationError(f"recipe {base.name!r}: options {sorted(clash)} clash with distillation's")
    own = [(name, kind, default) for name, kind, default in DISTILL_FIELDS]
    theirs: list[tuple[Any, ...]] = []
    for f in fields:
        if f.default is not msgspec.NODEFAULT:
            theirs.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            theirs.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            theirs.append((f.name, f.type))
    return msgspec.defstruct(f"Distill{type(base).__name__}Options", [*own, *theirs], kw_only=True, frozen=True,
                             forbid_unknown_fields=True)


@functools.cache
def __getattr__(base: str) -> DistillRecipe:
    """``rlengine.rl.recipes.distill:<base>``: distillation into recipe ``base`` (a built-in name or
    ``package.module:ATTRIBUTE``), for ``load_recipe``."""
    if base.startswith("__"):
        raise AttributeError(base)
    return DistillRecipe(base)
