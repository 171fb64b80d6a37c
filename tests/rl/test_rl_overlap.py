"""Sampling ahead while training (``max_steps_off_policy`` > 0), reproducibly.

A reproducible run samples batch b with policy ``max(0, b - k)`` whatever the
timing (``rlengine.rl.loop``) while the engine trains on its own thread
(``EngineConfig.train_concurrently``), and its checkpoints keep the groups
sampled ahead. So two runs of one seed, or a run and its resumed copy, agree
in every column but the timings: on the sim backend with environments that
finish in another order in each run, and on the copy recipe (torch backend,
batch-invariant sampling).
"""

from __future__ import annotations

import pytest
import rl_sim

from rlengine.rl.metrics import measured, read_jsonl
from rlengine.rl.run import train


def _untimed(path) -> list[dict]:
    """The run's metrics rows without the columns that measure the machine (``rl.metrics.MEASURED``)."""
    return [measured(row) for row in read_jsonl(str(path))]


class Killed(Exception):
    """Ends a run as a kill would, one step after a checkpoint."""


def _three_runs(tmp_path, recipe: str, settings: dict, steps: int, jitters: tuple[int, int, int]) -> dict:
    """Runs a and b of ``settings`` (jitter apart), and c: killed one step after its checkpoint
    half-way (groups of later batches sampled ahead, in flight), then resumed to the end."""
    runs = {}
    for name, jitter in zip("ab", jitters):
        rl_sim.reset()
        outcome = train(recipe, settings | jitter_setting(recipe, jitter), run_dir=str(tmp_path / name))
        assert outcome.error is None, outcome.error
        runs[name] = tmp_path / name
    rl_sim.reset()
    half = steps // 2

    def kill(record: dict) -> None:
        if record["step"] == half + 1:
            raise Killed

    killed = train(recipe, settings | jitter_setting(recipe, jitters[2]) | {"checkpoint_every": str(half)},
                   run_dir=str(tmp_path / "c"), on_step=kill)
    assert isinstance(killed.error, Killed), killed.error
    resumed = train(None, {}, run_dir=str(tmp_path / "c"), resume=True)
    assert resumed.error is None and resumed.resumed_from == half, resumed.error
    runs["c"] = tmp_path / "c"
    return runs


def jitter_setting(recipe: str, jitter: int) -> dict:
    return {"delay_jitter": str(jitter)} if recipe.startswith("rl_sim") else {}


@pytest.mark.parametrize("k", [1, 2])
def test_sim_runs_that_sample_ahead_are_identical_whatever_the_timing_and_across_a_resume(tmp_path, k):
    settings = {"batches": "8", "steps": "8", "max_steps_off_policy": str(k), "env_delay_s": "0.003",
                "step_time_s": "0.001", "eval_every": "0"}
    runs = _three_runs(tmp_path, "rl_sim:RECIPE", settings, 8, (3, 7, 5))
    want = _untimed(runs["a"] / "metrics.jsonl")
    assert [r["step"] for r in want] == list(range(1, 9))
    for name in "bc":
        assert _untimed(runs[name] / "metrics.jsonl") == want, name
    ledger = read_jsonl(str(runs["c"] / "groups.jsonl"))
    assert all(e["versions"] == [max(0, e["step"] - 1 - k)] * 2 for e in ledger if e["disposition"] == "trained")


@pytest.mark.model_plane
@pytest.mark.bitwise
def test_copy_runs_that_sample_ahead_are_identical_across_timing_and_a_resume(tmp_path, model_cache):
    """The copy recipe (its default samples one batch ahead) on the torch backend, three ways."""
    settings = {"steps": "4", "groups_per_batch": "8", "max_steps_off_policy": "1", "eval_every": "2",
                "backend": "torch", "cache_dir": model_cache, "seed": "3"}
    runs = _three_runs(tmp_path, "copy", settings, 4, (0, 0, 0))
    want = _untimed(runs["a"] / "metrics.jsonl")
    assert [r["step"] for r in want] == [1, 2, 3, 4]
    for name in "bc":
        assert _untimed(runs[name] / "metrics.jsonl") == want, name  # every float, bitwise
        assert _untimed(runs[name] / "eval.jsonl") == _untimed(runs["a"] / "eval.jsonl"), name
