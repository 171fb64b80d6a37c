"""One RL run end to end: recipe -> config -> run directory -> engine -> pipeline -> summary.

``train(recipe, overrides, run_dir=..., resume=...)`` is what ``rlengine
train`` calls and what a program may call instead:

1. the recipe's defaults and the ``key=value`` overrides make the
   ``TrainConfig`` and the recipe's own options; a resumed run takes both
   from ``config.json`` in the run directory (only settings that do not
   change what is sampled or trained may be overridden); a ``train_from``
   run takes them from the dump directory's ``meta.json`` (overrides on top),
   so that it builds the same model from the same seed, and trains as many
   steps as were dumped, with no evaluations (they would sample);
2. on resume, the newest complete checkpoint is found and the run's
   JSON-lines logs are cut back to its step;
3. the engine starts on a fresh uvloop loop in this thread, with the first
   SIGINT or SIGTERM turned into ``TrainingRun.interrupt`` (a bounded,
   cascading stop that checkpoints the last step finished) and a second one
   exiting at once (``rlengine.signals``); a signal during start-up cancels
   it (what had started closes) and the run ends before any step; a hang
   watch (``rlengine.core.hangs``) dumps the engine, the run and its
   sandboxes to the run directory when nothing progresses, or on SIGUSR1;
4. the recipe's ``attach`` starts what its environments need beside the
   engine (a server, sandboxes; not for ``train_from``, which samples
   nothing), ``TrainingRun`` runs; both are closed, then the engine,
   whatever happened;
5. the summary is computed from the files and the reward curve drawn
   (``reward.png``; skipped with one log line where matplotlib is missing).

The outcome carries the error, if any, for the caller to re-raise or turn
into an exit code. This module must not define training logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.backends import resolve_backend
from rlengine.config import EngineConfig
from rlengine.core.engine import Engine, new_event_loop
from rlengine.core.hangs import HangWatch, task_stacks
from rlengine.core.heap import frozen_heap
from rlengine.errors import ConfigurationError
from rlengine.rl.batch import GroupScorer
from rlengine.rl.checkpoint import Checkpointer, rewind_jsonl
from rlengine.rl.config import RESUME_MUTABLE, TrainConfig, convert
from rlengine.rl.dump import read_meta, start_dump, step_files, step_path
from rlengine.rl.errors import CheckpointError, RunInterrupted
from rlengine.rl.loop import TrainingRun
from rlengine.rl.metrics import (
    CONFIG_FILE,
    ENGINE_FILE,
    EVAL_FILE,
    GROUPS_FILE,
    METRICS_FILE,
    RunLog,
    read_jsonl,
    replace_file,
    summarize,
)
from rlengine.rl.plot import write_reward_png
from rlengine.rl.recipes import Recipe, load_recipe
from rlengine.rl.sandbox_pool import running_snapshots
from rlengine.signals import StartUpInterrupted, StopSignals
from rlengine.timeline import Timeline, activate
from rlengine.timeline.files import new_segment, segment_path

__all__ = ["RunOutcome", "build_config", "train"]

logger = logging.getLogger("rlengine")


class RunOutcome(msgspec.Struct, kw_only=True):
    """What a run left: where, how far, its summary, its newest checkpoint, and the error that ended
    it (None: success)."""

    run_dir: str
    metrics_path: str
    summary: dict[str, Any]
    error: BaseException | None = None
    stage: str | None = None
    left_behind: list[str] = msgspec.field(default_factory=list)
    drained: int = 0
    resumed_from: int | None = None
    png_path: str | None = None
    checkpoint: str | None = None
    """The newest complete checkpoint in ``run_dir`` at the end (None: there is none)."""
    checkpoint_step: int | None = None


def build_config(recipe: Recipe, overrides: dict[str, Any]) -> tuple[TrainConfig, msgspec.Struct]:
    """The run's ``TrainConfig`` and recipe options: recipe defaults, then ``overrides``."""
    option_fields = set(recipe.Options.__struct_fields__)
    train_fields = set(TrainConfig.__struct_fields__)
    clash = option_fields & train_fields
    if clash:
        raise ConfigurationError(f"recipe {recipe.name!r}: options {sorted(clash)} shadow TrainConfig settings")
    unknown = sorted(set(overrides) - option_fields - train_fields)
    if unknown:
        raise ConfigurationError(f"{unknown[0]}={overrides[unknown[0]]!r}: not a setting of recipe {recipe.name!r} "
                                 f"(run settings: {', '.join(sorted(train_fields))}; recipe options: "
                                 f"{', '.join(sorted(option_fields)) or 'none'})")
    train = {**recipe.defaults, **{k: v for k, v in overrides.items() if k in train_fields}}
    options = {k: v for k, v in overrides.items() if k in option_fields}
    return convert(TrainConfig, train, "TrainConfig"), convert(recipe.Options, options, f"recipe {recipe.name!r}")


def _stored_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read())
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"resume={run_dir!r}: cannot read {path}: {exc}") from None


def _resume_config(run_dir: str, recipe_name: str | None,
                   overrides: dict[str, Any]) -> tuple[str, TrainConfig, dict[str, Any]]:
    stored = _stored_config(run_dir)
    if recipe_name is not None and recipe_name != stored["recipe"]:
        raise ConfigurationError(f"recipe={recipe_name!r}: the run in {run_dir!r} trains {stored['recipe']!r}")
    for key, value in overrides.items():
        if key not in RESUME_MUTABLE:
            raise ConfigurationError(f"{key}={value!r}: a resumed run keeps the settings it started with "
                                     f"(may change: {', '.join(sorted(RESUME_MUTABLE))})")
    train = convert(TrainConfig, {**stored["train"], **overrides}, "TrainConfig")
    if overrides:
        _store_config(run_dir, stored["recipe"], train, stored["options"])
    return stored["recipe"], train, stored["options"]


def _store_config(run_dir: str, recipe: str, config: TrainConfig, options: Any) -> None:
    stored = {"recipe": recipe, "train": msgspec.to_builtins(config), "options": msgspec.to_builtins(options)}
    replace_file(os.path.join(run_dir, CONFIG_FILE), msgspec.json.format(msgspec.json.encode(stored)))


_NOT_REPLAYED = ("dump_rollouts", "rollout_only", "train_from")


def _train_from_config(recipe_name: str | None, overrides: dict[str, Any]) -> tuple[Recipe, TrainConfig,
                                                                                    msgspec.Struct]:
    """A ``train_from`` run's recipe and settings: the dumping run's (``meta.json``), with
    ``overrides`` on top, as many steps as were dumped and no evaluations."""
    directory = os.path.abspath(str(overrides["train_from"]))
    meta = read_meta(directory)
    if recipe_name is not None and recipe_name != meta["recipe"]:
        raise ConfigurationError(f"recipe={recipe_name!r}: the dumps in {directory!r} were sampled by recipe "
                                 f"{meta['recipe']!r}")
    files = step_files(directory)
    if not files:
        raise ConfigurationError(f"train_from={directory!r}: holds no step dumps (step-NNNNNN.msgpack)")
    stored = {k: v for k, v in meta["train"].items() if k not in _NOT_REPLAYED}
    the_recipe = load_recipe(meta["recipe"])
    config, options = build_config(the_recipe, {**stored, **meta["options"], "eval_every": 0, "steps": len(files),
                                                **overrides, "train_from": directory})
    if config.eval_every:
        raise ConfigurationError(f"eval_every={config.eval_every}: a train_from run samples nothing, "
                                 "evaluations included")
    assert config.steps is not None
    if config.steps > len(files):
        raise ConfigurationError(f"steps={config.steps}: {directory!r} holds {len(files)} step dumps")
    for step in range(1, config.steps + 1):
        if files[step - 1] != step_path(directory, step):
            raise ConfigurationError(f"train_from={directory!r}: {os.path.basename(step_path(directory, step))} "
                                     f"is missing (the dumps skip from step {step - 1})")
    return the_recipe, config, options


def _engine_config(config: TrainConfig, base: EngineConfig) -> EngineConfig:
    """The recipe's engine settings plus what the run needs: seed, drain policy, room for
    every sequence a step may have in flight, a close no longer than the grace period,
    batch-invariant sampling on the torch backend for a reproducible run, speculative rollout
    (``speculative_k``), the run's
    ``logprobs_mode``, its placement (``placement``, ``sampler_replicas``, ``trainer_workers``) and,
    when it samples ahead (``max_steps_off_policy`` > 0), training beside sampling."""
    in_flight = config.groups_per_batch * config.group_size * (config.max_steps_off_policy + 1)
    engine_args = base.engine_args
    if config.reproducible and resolve_backend(base) == "torch":
        engine_args = {**(engine_args or {}), "batch_invariant": True}
    if config.speculative_k:
        if resolve_backend(base) != "torch":
            raise ConfigurationError(f"speculative_k={config.speculative_k}: speculative rollout is the torch "
                                     f"backend's; this run's backend is {resolve_backend(base)!r}")
        engine_args = {**(engine_args or {}), "speculative": "ngram", "speculative_k": config.speculative_k}
    mode = config.logprobs_mode
    if mode == "auto":
        mode = "processed" if resolve_backend(base) in ("torch", "vllm") else "raw"
    placement = base.placement
    if config.placement != "local" or config.sampler_replicas != 1 or config.trainer_workers != 1:
        placement = msgspec.structs.replace(placement, kind=config.placement, sampler_replicas=config.sampler_replicas,
                                            trainer_workers=config.trainer_workers)
    # Sampling ahead only pays if training can run beside it.
    concurrent = "auto" if config.max_steps_off_policy > 0 else base.train_concurrently
    return msgspec.structs.replace(base, seed=config.seed, drain_policy=config.drain_policy, placement=placement,
                                   close_timeout_s=min(base.close_timeout_s, config.shutdown_grace_s),
                                   max_num_seqs=max(base.max_num_seqs, in_flight), engine_args=engine_args,
                                   logprobs_mode=mode, train_concurrently=concurrent)


def train(recipe: str | None, overrides: dict[str, Any], *, run_dir: str, resume: bool = False,
          on_step: Callable[[dict[str, Any]], None] | None = None,
          on_eval: Callable[[dict[str, Any]], None] | None = None,
          on_start: Callable[[TrainConfig, int], None] | None = None,
          signals: StopSignals | None = None) -> RunOutcome:
    """Run (or resume) an RL run in ``run_dir``; see the module docstring.

    Configuration errors raise at once; an error during the run is returned in
    ``RunOutcome.error`` after the shutdown cascade (nothing is left running); a
    stop by signal is ``RunInterrupted``. ``signals``: the caller's, installed
    before its own start-up work (``rlengine train`` passes its own); None
    installs one for the run (from the main thread).
    """
    if signals is None:
        with StopSignals("rlengine train") as own:
            return train(recipe, overrides, run_dir=run_dir, resume=resume, on_step=on_step, on_eval=on_eval,
                         on_start=on_start, signals=own)
    run_dir = os.path.abspath(run_dir)
    checkpoint = None
    if resume:
        recipe_name, config, stored_options = _resume_config(run_dir, recipe, overrides)
        the_recipe = load_recipe(recipe_name)
        options = convert(the_recipe.Options, stored_options, f"recipe {recipe_name!r}")
        checkpoint = Checkpointer(run_dir, config.keep_checkpoints).latest()
        # Without a checkpoint the run starts over, step 0's evaluation included: nothing is kept.
        last = checkpoint[1].step if checkpoint else -1
        for name in (METRICS_FILE, EVAL_FILE, GROUPS_FILE):
            rewind_jsonl(os.path.join(run_dir, name), last)
    else:
        if overrides.get("train_from") not in (None, "none", "null"):
            the_recipe, config, options = _train_from_config(recipe, overrides)
            recipe_name = the_recipe.name
        else:
            recipe_name = recipe or "copy"
            the_recipe = load_recipe(recipe_name)
            config, options = build_config(the_recipe, overrides)
        if config.dump_rollouts is not None:
            config = msgspec.structs.replace(config, dump_rollouts=os.path.abspath(config.dump_rollouts))
        if os.path.exists(os.path.join(run_dir, METRICS_FILE)):
            raise ConfigurationError(f"run_dir={run_dir!r}: holds a run already (resume it with --resume, "
                                     "or choose another directory)")
        os.makedirs(run_dir, exist_ok=True)
        _store_config(run_dir, recipe_name, config, options)
    if config.dump_rollouts is not None:
        start_dump(config.dump_rollouts, recipe_name, config, options, resume=resume)
    dataset, eval_dataset = the_recipe.datasets(config, options)
    engine_config = _engine_config(config, the_recipe.engine_config(config, options))
    total = config.steps if config.steps is not None else len(dataset)
    if on_start is not None:
        on_start(config, total)
    log = RunLog(run_dir, msgspec.to_builtins(config), config.wandb_project)
    checkpointer = Checkpointer(run_dir, config.keep_checkpoints)
    outcome = RunOutcome(run_dir=run_dir, metrics_path=log.metrics_path, summary={},
                         resumed_from=checkpoint[1].step if checkpoint else None)
    # From start-up on: a SIGUSR1 then still shows every thread's stack (docs/debugging.md).
    hangs = HangWatch(run_dir, prog="rlengine train", timeout_s=config.hang_timeout_s)
    hangs.add_source("sandboxes", running_snapshots)
    # ``timeline=true``: written when the run ends, however it ends: timeline.json, and a resumed
    # run's to the next timeline-<k>.json, so that each segment's steps stay (rlengine.timeline).
    timeline = Timeline(config.timeline_max_events, otel=config.timeline_otel) if config.timeline else None
    if timeline is not None:
        hangs.add_source("timeline", timeline.recent)

    async def main() -> None:
        run: TrainingRun | None = None

        def on_signal(signum: int, name: str) -> None:
            if run is not None:
                run.interrupt(signum, name)

        loop = asyncio.get_running_loop()
        hangs.add_source("tasks", lambda: task_stacks(loop))
        with signals.on_loop(loop, on_signal), signals.dumps(hangs.request_dump), hangs, activate(timeline):
            async with contextlib.AsyncExitStack() as stack:
                try:
                    async with signals.start_up():  # a signal cancels it (what started closes with the stack)
                        engine = await stack.enter_async_context(Engine(engine_config, timeline=timeline))
                        hangs.watch("engine", engine)
                        attached = None
                        if config.train_from is None:
                            attached = await stack.enter_async_context(the_recipe.attach(engine, dataset,
                                                                                         eval_dataset))
                except StartUpInterrupted as exc:
                    raise RunInterrupted(exc.signum, signal.Signals(exc.signum).name) from None
                replace_file(os.path.join(run_dir, ENGINE_FILE), msgspec.json.format(msgspec.json.encode(
                    {"backend": engine.backend.name, "capabilities": engine.backend.capabilities})))
                evaluated = [e["step"] for e in read_jsonl(os.path.join(run_dir, EVAL_FILE))] if resume else []
                # A recipe whose attach yields a GroupScorer (distillation's teachers) has the groups scored.
                run = TrainingRun(engine, config, dataset, eval_dataset, log, checkpointer=checkpointer,
                                  resume=checkpoint, on_step=on_step, on_eval=on_eval, evaluated=evaluated,
                                  scorer=attached if isinstance(attached, GroupScorer) else None)
                hangs.watch("run", run)
                try:
                    # Start-up's objects out of the collector's full passes (rlengine.core.heap).
                    with frozen_heap():
                        await run.run()
                finally:
                    outcome.left_behind, outcome.drained = run.left_behind, run.drained

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(main())
    except Exception as exc:  # noqa: BLE001 - returned to the caller with its stage note
        outcome.error = exc
        outcome.stage = _stage_of(exc)
    finally:
        log.close()
        if timeline is not None:
            resumed_from = (checkpoint[1].step if checkpoint else -1) if resume else None
            segment = new_segment(run_dir, resumed_from)
            replace_file(segment_path(run_dir, segment),
                         timeline.to_json({"segment": segment, "resumed_from": resumed_from}))
    try:
        newest = checkpointer.latest()
    except CheckpointError as exc:
        logger.warning("rlengine.rl: %s", exc)
        newest = None
    if newest is not None:
        outcome.checkpoint, outcome.checkpoint_step = newest[0], newest[1].step
    outcome.summary = summarize(run_dir, config.target_reward)
    outcome.png_path = _draw(run_dir, the_recipe.name)
    return outcome


def _stage_of(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", ()):
        if note.startswith("rlengine.rl: raised in the "):
            return note.removeprefix("rlengine.rl: raised in the ")
    return None


def _draw(run_dir: str, recipe_name: str) -> str | None:
    """Write ``reward.png`` from the run's files; None when there is nothing to draw or no matplotlib."""
    steps = read_jsonl(os.path.join(run_dir, METRICS_FILE))
    if not steps:
        return None
    evals = read_jsonl(os.path.join(run_dir, EVAL_FILE))
    path = os.path.join(run_dir, "reward.png")
    try:
        write_reward_png(path, steps, evals, title=f"recipe {recipe_name}: {os.path.basename(run_dir)}")
    except ImportError as exc:
        # matplotlib is optional (it comes with the torch extra): a missing plot must not fail the run it shows.
        logger.warning("rlengine.rl: reward curve not drawn, matplotlib is not importable (%s); "
                       "pip install matplotlib to get %s", exc, path)
        return None
    return path
