"""``rlengine train [RECIPE] key=value ...``: run an RL recipe with a live progress bar.

``add_parser(subparsers)`` registers the command on the ``rlengine`` parser;
``run(args)`` executes it and returns the exit code:

* 0 - the run finished;
* 1 - a stage raised, or the data ran out before the requested steps (the
  error is printed with the stage it came from);
* 2 - a configuration error, or a ``--train-from`` directory whose
  ``meta.json`` cannot be read (nothing was started);
* 128 + N - stopped by signal N (130 for SIGINT, 143 for SIGTERM): the first
  signal stops the run (in-flight rollouts aborted, the last step finished
  checkpointed) and one line on stderr names the newest checkpoint and how
  to resume; a second signal exits at once (``rlengine.signals``). Signals
  are handled from the start, model building and engine start-up included.

Without a recipe it runs ``copy``. The progress bar (tqdm, on stderr, only
on a terminal) shows the step, the mean reward and the last evaluation; at
the end a short summary is printed and, as the very last line of output,
the path of the run's ``metrics.jsonl``. ``python -m rlengine.rl.cli`` runs
the same command standalone.

It parses and prints; the run itself is ``rlengine.rl.run.train``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

__all__ = ["add_parser", "main", "run"]

_EXIT_FAILED, _EXIT_CONFIG = 1, 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("train", help="train a recipe with RL (default: copy, which learns on CPU)",
                              description="Run an RL recipe with a live progress bar.")
    _arguments(p)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("settings", nargs="*", metavar="[RECIPE] key=value",
                   help="a recipe (built-in name or package.module:ATTRIBUTE; default copy) followed by "
                        "settings, e.g. steps=200 max_steps_off_policy=1 (--list shows them all)")
    p.add_argument("--run-dir", default=None,
                   help="directory for metrics, checkpoints and the reward curve (default: ./runs/RECIPE-TIME)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its newest checkpoint, with its stored settings")
    p.add_argument("--dump-rollouts", metavar="DIR", default=None,
                   help="write each step's training calls, their datums (tokens, logprobs, advantages, masks, "
                        "policy versions) and trained groups to DIR (setting dump_rollouts)")
    p.add_argument("--rollout-only", action="store_true",
                   help="sample and dump (needs --dump-rollouts) without training: the policy stays the initial "
                        "one (setting rollout_only)")
    p.add_argument("--train-from", metavar="DIR", default=None,
                   help="train on the steps dumped in DIR with the dumping run's settings, sampling nothing "
                        "(setting train_from)")
    p.add_argument("--list", action="store_true", help="list the built-in recipes and every setting, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway off a terminal)")


def _split(settings: list[str]) -> tuple[str | None, list[str]]:
    if settings and "=" not in settings[0]:
        return settings[0], settings[1:]
    return None, settings


def _list() -> int:
    import msgspec

    from rlengine.rl.config import TrainConfig
    from rlengine.rl.recipes import BUILTIN, load_recipe

    print("recipes:")
    for name in BUILTIN:
        recipe = load_recipe(name)
        options = ", ".join(f"{k}={v!r}" for k, v in msgspec.to_builtins(recipe.Options()).items())
        print(f"  {name:<8} {recipe.description}")
        if options:
            print(f"           options: {options}")
    print("settings (TrainConfig defaults; a recipe may change them):")
    for key, value in msgspec.to_builtins(TrainConfig()).items():
        print(f"  {key}={value}")
    return 0


class _Progress:
    """A tqdm bar over the steps, with the reward and the last evaluation as postfix."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.eval: float | None = None

    def start(self, config: Any, total: int) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                            disable=None)

    def step(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.n = record["step"]
            post = {"reward": _fmt(record.get("reward_mean"))}
            if record.get("kl_sample_train_k3") is not None:
                post["kl"] = f"{record['kl_sample_train_k3']:.1e}"
            if record.get("attempts_failed"):
                post["failed"] = _failures(record)
            if self.eval is not None:
                post["eval"] = _fmt(self.eval)
            self.bar.set_postfix(post, refresh=False)
            self.bar.refresh()

    def evaluation(self, record: dict[str, Any]) -> None:
        self.eval = record.get("reward_mean")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _failures(record: dict[str, Any]) -> str:
    """Failed attempts, with their kinds: ``3 (crash 2, timeout 1)``."""
    from rlengine.rl.types import FAILURE_KINDS

    kinds = [f"{kind} {record[f'attempts_failed_{kind}']}" for kind in FAILURE_KINDS
             if record.get(f"attempts_failed_{kind}")]
    return f"{record.get('attempts_failed', 0)}" + (f" ({', '.join(kinds)})" if kinds else "")


def _summary(outcome: Any, recipe: str) -> list[str]:
    s = outcome.summary
    lines = [f"rlengine train {recipe}: {s.get('steps', 0)} steps in {_fmt(s.get('time_s'), 1)} s"
             + (f" (resumed from step {outcome.resumed_from})" if outcome.resumed_from is not None else "")]
    if s.get("steps"):
        reached = (f"reached at step {s['step_to_target']} ({_fmt(s['time_to_target_s'], 1)} s)"
                   if s.get("step_to_target") is not None else "not reached")
        lines.append(f"  reward: {_fmt(s.get('first_reward_mean'))} (first step) -> {_fmt(s.get('last_reward_mean'))}"
                     f" (last 5 steps); target {s['target_reward']} {reached}")
    if "eval_reward_last" in s:
        lines.append(f"  held-out eval: {_fmt(s['eval_reward_last'])} (last), best {_fmt(s['eval_reward_best'])}")
    if s.get("steps"):
        lines.append(f"  groups dropped: {s['groups_dropped_constant_reward']} constant reward, "
                     f"{s['groups_dropped_too_few_survivors']} too few survivors; re-sampled stale: "
                     f"{s['groups_resampled_stale']}, constant {s['groups_resampled_constant']}; failed attempts: {_failures(s)}; sampler idle "
                     f"{_fmt(100 * s['sampler_idle_frac_median'] if s.get('sampler_idle_frac_median') is not None else None, 0)}%")
        if s.get("attempts_overlong_filtered"):
            lines.append(f"  overlong filtered: {s['attempts_overlong_filtered']} attempts untrained, "
                         f"{s.get('groups_dropped_overlong', 0)} groups with nothing left to train")
    lines.append(f"  run dir: {outcome.run_dir}" + ("  (reward curve: reward.png)" if outcome.png_path else ""))
    return lines


def run(args: argparse.Namespace) -> int:
    """Execute ``rlengine train``; returns the exit code."""
    from rlengine.signals import StopSignals

    with StopSignals("rlengine train") as signals:
        return signals.leave(_run(args, signals))


def _interrupted(outcome: Any, error: Any) -> str:
    """The one line a stop by signal prints: where the newest checkpoint is, and how to resume."""
    where = (f"newest checkpoint {outcome.checkpoint} (step {outcome.checkpoint_step}); resume with: "
             f"rlengine train --resume {outcome.run_dir}" if outcome.checkpoint is not None
             else "no checkpoint was written (no step finished)")
    return f"rlengine train: {error} after {outcome.summary.get('steps', 0)} steps; {where}"


def _run(args: argparse.Namespace, signals: Any) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.list:
        return _list()
    from rlengine.errors import ConfigurationError
    from rlengine.rl.config import parse_overrides
    from rlengine.rl.errors import RolloutDumpError, RunInterrupted
    from rlengine.rl.run import train

    recipe, pairs = _split(args.settings)
    progress = _Progress(enabled=not args.no_progress)
    try:
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
        else:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            name = recipe or ("train-from" if args.train_from is not None else "copy")
            run_dir = args.run_dir or os.path.join("runs", f"{name.rpartition(':')[2]}-{stamp}")
        outcome = train(recipe, overrides, run_dir=run_dir, resume=args.resume is not None,
                        on_step=progress.step, on_eval=progress.evaluation, on_start=progress.start,
                        signals=signals)
    except (ConfigurationError, RolloutDumpError) as exc:
        progress.close()
        print(f"rlengine train: {exc}", file=sys.stderr)
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
        code = _EXIT_FAILED
    if error is not None and outcome.left_behind:
        print(f"rlengine train: cancelled after the grace period: {', '.join(outcome.left_behind)}", file=sys.stderr)
    sys.stderr.flush()
    print(outcome.metrics_path, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlengine train", description="Run an RL recipe with a live progress bar.")
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
