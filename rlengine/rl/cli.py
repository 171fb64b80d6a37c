"""``rlengine train [RECIPE] key=value ...``: run an RL recipe and show its progress.

``add_parser(subparsers)`` registers the command on the ``rlengine`` parser;
``run(args)`` executes it and returns the exit code:

* 0 - the run finished;
* 1 - a stage raised, or the data ran out before the requested steps (the
  error is printed with the stage it came from; a run stopped by its failure
  budget also prints its first failure's cause, from ``groups.jsonl``);
* 2 - nothing was started: a configuration error, a module the recipe needs
  that is not installed (with the extra that brings it), a ``--resume``
  directory that is no run or holds no checkpoint yet (``--start-over``
  starts such a run over), or a ``--train-from`` directory whose
  ``meta.json`` cannot be read;
* 128 + N - stopped by signal N (130 for SIGINT, 143 for SIGTERM): the first
  signal stops the run (in-flight rollouts aborted, the last step finished
  checkpointed) and one line on stderr names the newest checkpoint and how
  to resume; a second signal exits at once (``rlengine.signals``). Signals
  are handled from the start, model building and engine start-up included.

SIGUSR1 writes a hang dump to the run directory and the run goes on; one is
also written when nothing progresses for ``hang_timeout_s``
(``rlengine.core.hangs``; ``docs/debugging.md``).

Without a recipe it runs ``copy``. Progress goes to stderr
(``rlengine.rl.progress``): a bar on a terminal, else a plain line every few
seconds. vLLM's, transformers' and torch's own logs are quiet unless ``-v``
(``rlengine.console``). At the end a short summary is printed and, as the
very last line of output, the path of the run's ``metrics.jsonl``.
``python -m rlengine.rl.cli`` runs the same command standalone.

It parses and prints; the run itself is ``rlengine.rl.run.train``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from typing import Any

from rlengine.console import plain, quiet_third_party, setting_docs
from rlengine.rl.progress import Progress, failures, shown

__all__ = ["add_parser", "main", "run"]

_EXIT_FAILED, _EXIT_CONFIG = 1, 2
_DESCRIPTION = "Run an RL recipe, with its progress on stderr and a summary at the end."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("train", help="train a recipe with RL (default: copy, which learns on CPU)",
                              description=_DESCRIPTION)
    _arguments(p)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("settings", nargs="*", metavar="[RECIPE] key=value",
                   help="a recipe (built-in name or package.module:ATTRIBUTE; default copy) followed by "
                        "settings, e.g. steps=200 max_steps_off_policy=1 (--list shows them all)")
    p.add_argument("--run-dir", default=None,
                   help="directory for metrics, checkpoints and the reward curve (default: ./runs/RECIPE-TIME)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its newest checkpoint, with its stored settings "
                        "(refused when it has none yet: see --start-over)")
    p.add_argument("--start-over", action="store_true",
                   help="with --resume: a run without a checkpoint yet starts over from step 1 with its stored "
                        "settings, replacing its metrics, instead of being refused")
    p.add_argument("--dump-rollouts", metavar="DIR", default=None,
                   help="write each step's training calls, their datums (tokens, logprobs, advantages, masks, "
                        "policy versions) and trained groups to DIR (setting dump_rollouts)")
    p.add_argument("--rollout-only", action="store_true",
                   help="sample and dump (needs --dump-rollouts) without training: the policy stays the initial "
                        "one (setting rollout_only)")
    p.add_argument("--train-from", metavar="DIR", default=None,
                   help="train on the steps dumped in DIR with the dumping run's settings, sampling nothing "
                        "(setting train_from)")
    p.add_argument("--list", action="store_true",
                   help="list the built-in recipes and every setting with its description and the recipe's "
                        "value (RECIPE --list: that recipe's), then exit")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (on a terminal a bar, elsewhere a line every few seconds)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show vLLM's, transformers' and torch's own logs and loading bars (on stderr)")


def _split(settings: list[str]) -> tuple[str | None, list[str]]:
    if settings and "=" not in settings[0]:
        return settings[0], settings[1:]
    return None, settings


# -- --list ------------------------------------------------------------------------------------

_LINE = 110
"""Longest description --list prints on one line."""


def _one_line(text: str) -> str:
    """``text`` within ``_LINE`` characters: parentheses dropped first, then cut at a word."""
    if len(text) <= _LINE:
        return text
    text = re.sub(r"\s*\([^()]*\)", "", text)
    if len(text) <= _LINE:
        return text
    return text[:text.rfind(" ", 0, _LINE - 4)].rstrip(",;:") + " ..."


def _settings(struct: Any, changed: set[str]) -> list[str]:
    """``key=value  description`` for each field of ``struct``; ``*`` marks a value in ``changed``."""
    import msgspec

    values = msgspec.to_builtins(struct)
    docs = setting_docs(type(struct))
    pairs = {key: f"{key}={value}" + (" *" if key in changed else "") for key, value in values.items()}
    width = min(max(map(len, pairs.values()), default=0), 36)
    return [f"  {pairs[key]:<{width}}  {_one_line(docs.get(key, ''))}".rstrip() for key in values]


def _list(recipe_name: str | None) -> int:
    from rlengine.rl.config import TrainConfig
    from rlengine.rl.recipes import BUILTIN, load_recipe
    from rlengine.rl.run import build_config

    listed = recipe_name or "copy"
    print("recipes (rlengine train RECIPE key=value ...):")
    for name in BUILTIN:
        print(f"  {name:<8} {plain(load_recipe(name).description)}")
    if recipe_name is not None and recipe_name not in BUILTIN:
        print(f"  {recipe_name}  {plain(load_recipe(recipe_name).description)}")
    recipe = load_recipe(listed)
    config, options = build_config(recipe, {})
    generic = TrainConfig()
    changed = {key for key in recipe.defaults if getattr(config, key) != getattr(generic, key)}
    if recipe.Options.__struct_fields__:
        print(f"\noptions of recipe {listed}:")
        print("\n".join(_settings(options, set())))
    others = "" if recipe_name is not None else " (rlengine train RECIPE --list shows another recipe's)"
    print(f"\nsettings of recipe {listed}, * where the recipe changes the default{others}:")
    print("\n".join(_settings(config, changed)))
    return 0


# -- the summary -------------------------------------------------------------------------------

def _summary(outcome: Any, recipe: str) -> list[str]:
    s = outcome.summary
    lines = [f"rlengine train {recipe}: {s.get('steps', 0)} steps in {shown(s.get('time_s'), 1)} s"
             + (f" (resumed from step {outcome.resumed_from})" if outcome.resumed_from is not None else "")]
    if s.get("steps"):
        reached = (f"reached at step {s['step_to_target']} ({shown(s['time_to_target_s'], 1)} s)"
                   if s.get("step_to_target") is not None else "not reached")
        tail = min(5, s["steps"])  # ``summarize`` averages the last five steps, or as many as there were
        last = "last step" if tail == 1 else f"mean of the last {tail} steps"
        lines.append(f"  reward: {shown(s.get('first_reward_mean'))} (first step) -> {shown(s.get('last_reward_mean'))}"
                     f" ({last}); target {s['target_reward']} {reached}")
    if "eval_reward_last" in s:
        lines.append(f"  held-out eval: {shown(s['eval_reward_last'])} (last), best {shown(s['eval_reward_best'])}")
    if s.get("steps"):
        idle = s.get("sampler_idle_frac_median")
        lines.append(f"  groups dropped: {s['groups_dropped_constant_reward']} constant reward, "
                     f"{s['groups_dropped_too_few_survivors']} too few survivors; re-sampled stale: "
                     f"{s['groups_resampled_stale']}, constant {s['groups_resampled_constant']}; failed attempts: "
                     f"{failures(s)}; sampler idle {shown(100 * idle if idle is not None else None, 0)}%")
        if s.get("attempts_overlong_filtered"):
            lines.append(f"  overlong filtered: {s['attempts_overlong_filtered']} attempts untrained, "
                         f"{s.get('groups_dropped_overlong', 0)} groups with nothing left to train")
    lines.append(f"  run dir: {outcome.run_dir}" + ("  (reward curve: reward.png)" if outcome.png_path else ""))
    return lines


def _first_failure(run_dir: str) -> str | None:
    """The first failed attempt of the steps a failure budget looks at (``failure_window_steps``),
    from the run's ``groups.jsonl``: where it happened and its cause."""
    import msgspec

    from rlengine.rl.metrics import CONFIG_FILE, GROUPS_FILE, read_jsonl

    groups = read_jsonl(os.path.join(run_dir, GROUPS_FILE))
    try:
        with open(os.path.join(run_dir, CONFIG_FILE), "rb") as f:
            window = int(msgspec.json.decode(f.read())["train"]["failure_window_steps"])
    except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
        window = 1
    last = max((g.get("step", 0) for g in groups), default=0)
    for group in groups:
        if group.get("step", 0) > last - window and group.get("failures"):
            f = group["failures"][0]
            where = f"step {group['step']}, group {group['group']}, attempt {f['attempt']}, in the {f['stage']}"
            return f"first failure ({where}): {f['error']}: {f['message']}"
    return None


# -- the run -----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Execute ``rlengine train``; returns the exit code."""
    # Before anything imports vLLM, transformers or torch: they read these as they load.
    quiet_third_party(getattr(args, "verbose", False))
    from rlengine.signals import StopSignals

    with StopSignals("rlengine train") as signals:
        return signals.leave(_run(args, signals))


def _interrupted(outcome: Any, error: Any) -> str:
    """The one line a stop by signal prints: where the newest checkpoint is, and how to resume."""
    where = (f"newest checkpoint {outcome.checkpoint} (step {outcome.checkpoint_step}); resume with: "
             f"rlengine train --resume {outcome.run_dir}" if outcome.checkpoint is not None
             else "no checkpoint was written (no step finished)")
    return f"rlengine train: {error} after {outcome.summary.get('steps', 0)} steps; {where}"


def _check_resume(run_dir: str, start_over: bool) -> str:
    """The recipe of the run in ``run_dir``; refuses a directory that holds no run, and one without a
    checkpoint unless ``start_over`` (resuming it would start over and replace its metrics)."""
    import msgspec

    from rlengine.errors import ConfigurationError
    from rlengine.rl.checkpoint import Checkpointer
    from rlengine.rl.metrics import CONFIG_FILE, METRICS_FILE, read_jsonl

    path = os.path.join(run_dir, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            recipe = msgspec.json.decode(f.read())["recipe"]
    except (OSError, msgspec.DecodeError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"--resume {run_dir}: not a run directory ({path}: "
                                 f"{getattr(exc, 'strerror', None) or exc})") from None
    if Checkpointer(run_dir, 1).latest() is None and not start_over:
        steps = len(read_jsonl(os.path.join(run_dir, METRICS_FILE)))
        raise ConfigurationError(
            f"--resume {run_dir}: holds no checkpoint to resume from ({steps} steps logged; checkpoint_every=K "
            f"writes one every K steps); resuming would start the run over and replace its metrics: "
            f"add --start-over for that, or start a new run with --run-dir")
    return str(recipe)


def _check_requires(recipe_name: str) -> None:
    """The modules the recipe needs (``Recipe.requires``), before anything starts."""
    from rlengine.rl.recipes import load_recipe

    load_recipe(recipe_name).check_requires()


def _run(args: argparse.Namespace, signals: Any) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlengine.errors import ConfigurationError
    from rlengine.rl.config import parse_overrides
    from rlengine.rl.errors import CheckpointError, FailureBudgetExceeded, RolloutDumpError, RunInterrupted
    from rlengine.rl.run import train

    recipe, pairs = _split(args.settings)
    progress = Progress.for_stream(enabled=not args.no_progress)
    try:
        if args.list:
            return _list(recipe)
        if args.start_over and args.resume is None:
            raise ConfigurationError("--start-over: only with --resume RUN_DIR")
        overrides = parse_overrides(pairs)
        for key, value in (("dump_rollouts", args.dump_rollouts), ("rollout_only", "true" if args.rollout_only else None),
                           ("train_from", args.train_from)):
            if value is not None:
                if key in overrides:
                    raise ConfigurationError(f"{key}={overrides[key]!r}: given twice (also as "
                                             f"--{key.replace('_', '-')})")
                overrides[key] = value
        if args.resume is not None:
            run_dir = args.resume
            _check_requires(_check_resume(run_dir, args.start_over))
        else:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            name = recipe or ("train-from" if args.train_from is not None else "copy")
            run_dir = args.run_dir or os.path.join("runs", f"{name.rpartition(':')[2]}-{stamp}")
            if args.train_from is None:  # a train_from run samples nothing: its agents need nothing
                _check_requires(recipe or "copy")
        outcome = train(recipe, overrides, run_dir=run_dir, resume=args.resume is not None,
                        on_step=progress.step, on_eval=progress.evaluation, on_start=progress.start,
                        signals=signals)
    except (ConfigurationError, RolloutDumpError, CheckpointError) as exc:
        progress.close()
        print(f"rlengine train: {plain(str(exc))}", file=sys.stderr)
        return _EXIT_CONFIG
    progress.close()
    for line in _summary(outcome, recipe or "copy"):
        print(line)
    code = 0
    error = outcome.error
    if isinstance(error, RunInterrupted):
        print(_interrupted(outcome, error), file=sys.stderr)
        code = 128 + error.signum
    elif error is not None:
        where = f" in the {outcome.stage}" if outcome.stage else ""
        print(f"rlengine train: failed{where}: {type(error).__name__}: {error}", file=sys.stderr)
        first = _first_failure(outcome.run_dir) if isinstance(error, FailureBudgetExceeded) else None
        if first is not None:
            print(f"rlengine train: {first} (every failure is in {os.path.join(outcome.run_dir, 'groups.jsonl')})",
                  file=sys.stderr)
        code = _EXIT_FAILED
    if error is not None and outcome.left_behind:
        print(f"rlengine train: cancelled after the grace period: {', '.join(outcome.left_behind)}", file=sys.stderr)
    sys.stderr.flush()
    print(outcome.metrics_path, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlengine train", description=_DESCRIPTION)
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
