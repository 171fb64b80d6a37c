"""On-policy distillation against RL from scratch on the copy task (pytest-benchmark; figures in bench/RESULTS.md).

Per seed, in one run of this file: ``rlengine train copy`` with its defaults
from a fresh model until the first step whose mean training reward reaches
0.9 (at most ``RL_STEPS`` steps), then ``rlengine train distill
teacher=<that run>`` from a fresh student of the same seed (the same
initial weights: the model is built from the seed) with the same settings
(the batch, the optimizer, PPO; the distill recipe's own defaults differ
only in ``entropy_coef=0`` and its group baseline, ``rlengine.rl.distill``),
up to ``DISTILL_STEPS`` steps.

The teacher is the RL run's checkpoint of its first step at 0.9: "trained to
>= 0.9" by the run it is compared with, which is what the issue's "same run,
same seeds" asks (its reward at temperature 1, what the student is measured
at, is about 0.95: seed 0's, over all 1000 numbers). A teacher supervised to
saturation is the other natural choice; docs/distillation.md gives its
figures (measured outside this file, one seed).

Reported: the first step (and the loop's wall time to it, ``time_s``) at
which each reaches mean reward 0.9, the ratio of RL's steps to
distillation's (target: >= 3), the teacher's own greedy reward, and the
teacher's scoring time as a share of each distillation step
(``teacher_score_frac``, median over steps, with the medians of both runs'
step times). A run that never reaches 0.9 counts as its step budget.

    OMP_NUM_THREADS=1 python -m pytest bench/bench_distill.py --benchmark-only -s
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest

from rlengine.rl.distill import distill
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train

SEEDS = tuple(int(s) for s in os.environ.get("DISTILL_SEEDS", "0,1").split(","))
RL_STEPS = 300
DISTILL_STEPS = 60
TARGET = 0.9


def _first_at(steps: list[dict[str, Any]], budget: int) -> tuple[int, float | None]:
    for s in steps:
        if s["reward_mean"] >= TARGET:
            return s["step"], s["time_s"]
    return budget, None


@pytest.mark.parametrize("seed", SEEDS)
def test_distillation_vs_rl_to_0_9(record, tmp_path, seed):
    cache = str(tmp_path / "cache")
    common = {"seed": seed, "backend": "torch", "eval_every": 0, "cache_dir": cache}

    def run() -> dict[str, Any]:
        reached, stop_after_target = _stop_after_target()
        rl = train("copy", {**common, "steps": RL_STEPS, "checkpoint_every": 1, "keep_checkpoints": 2},
                   run_dir=str(tmp_path / "rl"), on_step=stop_after_target)
        assert rl.error is None or isinstance(rl.error, _Reached), rl.error
        rl_steps = read_jsonl(rl.metrics_path)[:reached[0] if reached else None]
        rl_at, rl_time = _first_at(rl_steps, RL_STEPS)
        out = distill(str(tmp_path / "rl"), run_dir=str(tmp_path / "distill"), steps=DISTILL_STEPS,
                      checkpoint_every=0, on_step=_stop_after_target()[1], **common)
        assert out.error is None or isinstance(out.error, _Reached), out.error
        d_steps = read_jsonl(out.metrics_path)
        d_at, d_time = _first_at(d_steps, DISTILL_STEPS)
        return {"seed": seed, "rl_steps_to_0.9": rl_at, "rl_time_to_0.9_s": rl_time,
                "teacher_reward": d_steps[0].get("teacher_reward_mean"),
                "distill_steps_to_0.9": d_at, "distill_time_to_0.9_s": d_time,
                "steps_ratio_rl_over_distill": rl_at / d_at,
                "teacher_score_frac_median": statistics.median(s["teacher_score_frac"] for s in d_steps),
                "distill_step_time_median_s": statistics.median(s["step_time_s"] for s in d_steps[1:]),
                "rl_step_time_median_s": statistics.median(s["step_time_s"] for s in rl_steps[1:])}

    record(run)


def _stop_after_target() -> tuple[list[int], Callable[[dict[str, Any]], None]]:
    """(the step that reached the target, once one has; a run's ``on_step`` that ends it on the step after
    it: that first one's checkpoint is then written)."""
    reached: list[int] = []

    def on_step(line: dict[str, Any]) -> None:
        if reached:
            raise _Reached
        if line["reward_mean"] >= TARGET:
            reached.append(line["step"])

    return reached, on_step


class _Reached(Exception):
    """Ends a run once it has reached the target (the RL run's checkpoint there is the teacher)."""
