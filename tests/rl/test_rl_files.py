"""What a run leaves on disk: the reward curve, checkpoints, log rewinding, settings and recipes.

The reward PNG is checked twice over: its header read here from the PNG
specification (signature, IHDR size) and the file loaded back with
matplotlib; the figure itself is checked before it is saved (title, axis
labels, legend, the plotted data against the records given).
"""

from __future__ import annotations

import logging
import os
import struct
import sys

import numpy as np
import pytest

from rlengine.errors import ConfigurationError
from rlengine.rl.checkpoint import Checkpointer, LoopState, PendingGroup, capture_rng, restore_rng, rewind_jsonl
from rlengine.rl.config import TrainConfig, parse_overrides
from rlengine.rl.errors import CheckpointError
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.plot import DEFAULT_TITLE, HEIGHT_PX, WIDTH_PX, reward_figure, write_reward_png
from rlengine.rl.recipes import load_recipe
from rlengine.rl.run import build_config, train


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header: the signature, then IHDR as the first chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (length,) = struct.unpack(">I", data[8:12])
    assert (length, data[12:16]) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])


def legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


TRAIN_LABEL, EVAL_LABEL = "train reward (mean per step)", "held-out eval reward (mean)"
BAND_LABEL = "train reward, 10th-90th percentile"


@pytest.mark.model_plane
def test_the_figure_names_its_axes_and_plots_the_records_it_is_given():
    steps = [{"step": s, "reward_mean": s / 10, "reward_p10": s / 20, "reward_p90": s / 5} for s in range(1, 8)]
    steps[3] = {"step": 4, "reward_mean": None}  # a step with no reward (logged as null) is left out
    evals = [{"step": 0, "reward_mean": 0.1}, {"step": 3, "reward_mean": 0.35}, {"step": 6, "reward_mean": 0.7}]
    ax = reward_figure(steps, evals, title="recipe copy: run-1").axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("recipe copy: run-1", "step", "reward")
    assert legend_texts(ax) == [BAND_LABEL, TRAIN_LABEL, EVAL_LABEL]
    train_line, eval_line = ax.get_lines()
    assert list(train_line.get_xdata()) == [1, 2, 3, 5, 6, 7]
    np.testing.assert_allclose(train_line.get_ydata(), [0.1, 0.2, 0.3, 0.5, 0.6, 0.7])
    assert list(eval_line.get_xdata()) == [0, 3, 6] and eval_line.get_marker() == "o"
    np.testing.assert_allclose(eval_line.get_ydata(), [0.1, 0.35, 0.7])
    (band,) = ax.collections
    assert band.get_label() == BAND_LABEL
    # The band spans p10..p90 of the steps with a reward: 1/20 at its lowest, 7/5 at its highest.
    np.testing.assert_allclose(band.get_paths()[0].get_extents().bounds, [1, 0.05, 6, 1.35])


@pytest.mark.model_plane
def test_a_run_without_evaluations_or_spread_gets_one_series_and_the_default_title():
    ax = reward_figure([{"step": 1, "reward_mean": 0.5}], []).axes[0]
    assert ax.get_title() == DEFAULT_TITLE
    assert legend_texts(ax) == [TRAIN_LABEL]
    (line,) = ax.get_lines()
    # A single point makes no line segment: it is drawn as a marker so it shows.
    assert list(line.get_xdata()) == [1] and line.get_marker() == "o"
    assert len(ax.collections) == 0
    # Nothing to draw: no legend (and no warning, which the test settings would turn into an error).
    assert reward_figure([{"step": 1, "reward_mean": None}], []).axes[0].get_legend() is None


@pytest.mark.model_plane
def test_the_png_is_written_atomically_at_its_size_and_loads_back(tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "reward.png"
    path.write_bytes(b"an older curve")
    write_reward_png(str(path), [{"step": s, "reward_mean": s / 100} for s in range(1, 101)],
                     [{"step": 50, "reward_mean": 0.9}])
    assert png_size(path.read_bytes()) == (WIDTH_PX, HEIGHT_PX)
    img = imread(str(path))
    assert img.shape[:2] == (HEIGHT_PX, WIDTH_PX)
    assert os.listdir(tmp_path) == ["reward.png"]  # the temporary file was renamed over the old one
    # Not a blank canvas: the curve's blue is there.
    blue = np.all(np.abs(img[..., :3] - np.array([31, 119, 180]) / 255) < 0.02, axis=-1)
    assert blue.sum() > 300


@pytest.mark.model_plane
def test_a_run_draws_its_curve_from_its_own_files(tmp_path):
    from matplotlib.image import imread

    outcome = train("rl_sim:RECIPE", {"batches": "4", "eval_every": "2"}, run_dir=str(tmp_path))
    assert outcome.error is None and outcome.png_path == str(tmp_path / "reward.png")
    with open(outcome.png_path, "rb") as f:
        assert png_size(f.read()) == (WIDTH_PX, HEIGHT_PX)
    assert imread(outcome.png_path).shape[:2] == (HEIGHT_PX, WIDTH_PX)
    steps, evals = read_jsonl(str(tmp_path / "metrics.jsonl")), read_jsonl(str(tmp_path / "eval.jsonl"))
    assert len(steps) == 4 and len(evals) == 3
    ax = reward_figure(steps, evals).axes[0]
    assert legend_texts(ax) == [BAND_LABEL, TRAIN_LABEL, EVAL_LABEL]
    train_line, eval_line = ax.get_lines()
    assert list(train_line.get_xdata()) == [1, 2, 3, 4]
    assert list(train_line.get_ydata()) == [s["reward_mean"] for s in steps]
    assert list(eval_line.get_xdata()) == [0, 2, 4]
    assert list(eval_line.get_ydata()) == [e["reward_mean"] for e in evals]


def test_a_run_without_matplotlib_succeeds_with_no_png_and_says_so_once(tmp_path, monkeypatch, caplog):
    # None in sys.modules makes the import fail, as if matplotlib were not installed; submodules a
    # previous test imported would otherwise still be found there.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with caplog.at_level(logging.WARNING, logger="rlengine"):
        outcome = train("rl_sim:RECIPE", {"batches": "2"}, run_dir=str(tmp_path))
    assert outcome.error is None and outcome.summary["steps"] == 2
    assert outcome.png_path is None
    assert not any(name.startswith(".reward.png") or name == "reward.png" for name in os.listdir(tmp_path))
    (record,) = [r for r in caplog.records if "reward curve" in r.getMessage()]
    assert record.levelno == logging.WARNING and "matplotlib" in record.getMessage()


def state(step: int) -> LoopState:
    return LoopState(step=step, updates=step, cursor=step * 4, pending=[PendingGroup(step * 4 + 1, 1)],
                     rng=capture_rng(), elapsed_s=1.5)


def test_checkpoints_commit_atomically_and_prune(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2)
    assert ckpt.latest() is None
    for step in (2, 4, 6):
        staging = ckpt.staging_dir(step)
        (open(os.path.join(staging, "weights"), "w")).close()
        ckpt.commit(staging, state(step))
    path, loaded = ckpt.latest()
    assert path.endswith("step-000006") and os.path.isfile(os.path.join(path, "weights"))
    assert (loaded.step, loaded.updates, loaded.cursor, loaded.pending) == (6, 6, 24, [PendingGroup(25, 1)])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-000004", "step-000006"]
    # A half-written checkpoint (killed before its rename) is never what ``latest`` names.
    ckpt.staging_dir(8)
    assert ckpt.latest()[1].step == 6


@pytest.mark.model_plane
def test_rng_states_round_trip_through_json_without_pickle():
    import json
    import random

    import torch

    saved = json.loads(json.dumps(capture_rng()))  # what loop.json holds: plain JSON, no pickle
    assert set(saved) == {"python", "numpy", "torch"} and isinstance(saved["python"][1], list)
    a = (random.random(), np.random.random(), np.random.normal(), torch.rand(3).tolist())
    restore_rng(saved)
    assert (random.random(), np.random.random(), np.random.normal(), torch.rand(3).tolist()) == a
    with pytest.raises(CheckpointError, match="RNG state"):
        restore_rng({"python": "gASV"})  # a base64 pickle, as format 1 stored it: refused, never unpickled


def test_a_checkpoint_with_pickled_rng_states_is_refused(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2)
    path = ckpt.commit(ckpt.staging_dir(2), state(2))
    loop_json = os.path.join(path, "loop.json")
    with open(loop_json) as f:
        text = f.read()
    with open(loop_json, "w") as f:
        f.write(text.replace("rlengine-rl-checkpoint-2", "rlengine-rl-checkpoint-1"))
    with pytest.raises(CheckpointError, match="pickled"):
        ckpt.latest()


def test_a_resumed_run_restores_the_rng_states_of_its_checkpoint(tmp_path, monkeypatch):
    import rlengine.rl.loop as loop_module

    assert train("rl_sim:RECIPE", {"batches": "2", "checkpoint_every": "1"}, run_dir=str(tmp_path)).error is None
    restored = []
    monkeypatch.setattr(loop_module, "restore_rng", lambda states: restored.append(states))
    train(None, {"steps": "3"}, run_dir=str(tmp_path), resume=True)
    _, state_2 = Checkpointer(str(tmp_path), keep=2).latest()
    assert restored == [state_2.rng]


def test_rewind_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step":1,"x":1}\n{"step":2}\n{"step":3}\n{"step":4,"x"')
    assert rewind_jsonl(str(path), 2) == 2
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]


def test_settings_parse_and_name_the_bad_key_and_value():
    assert parse_overrides(["steps=3", "loss_fn=cispo"]) == {"steps": "3", "loss_fn": "cispo"}
    with pytest.raises(ConfigurationError, match="key=value"):
        parse_overrides(["steps"])
    with pytest.raises(ConfigurationError, match="given twice"):
        parse_overrides(["steps=1", "steps=2"])
    recipe = load_recipe("copy")
    config, options = build_config(recipe, {"steps": "7", "digits": "2", "entropy_coef": "0"})
    assert config.steps == 7 and options.digits == 2 and config.entropy_coef == 0.0
    assert config.num_substeps == 8  # the recipe's default, not TrainConfig's
    with pytest.raises(ConfigurationError, match="digits=9"):
        build_config(recipe, {"digits": "9"})
    with pytest.raises(ConfigurationError, match="min_surviving_attempts=9"):
        TrainConfig(group_size=8, min_surviving_attempts=9)
    with pytest.raises(ConfigurationError, match="recipe='nope'"):
        load_recipe("nope")


def test_a_resumed_run_keeps_the_settings_that_change_what_is_trained(tmp_path):
    outcome = train("rl_sim:RECIPE", {"batches": "2", "checkpoint_every": "1"}, run_dir=str(tmp_path))
    assert outcome.error is None
    with pytest.raises(ConfigurationError, match="learning_rate"):
        train(None, {"learning_rate": "1"}, run_dir=str(tmp_path), resume=True)
    with pytest.raises(ConfigurationError, match="holds a run already"):
        train("rl_sim:RECIPE", {}, run_dir=str(tmp_path))
    # Extending a finished run is allowed: ``steps`` does not change what was trained.
    extended = train(None, {"steps": "3"}, run_dir=str(tmp_path), resume=True)
    assert isinstance(extended.error, Exception) and "dataset ran out" in str(extended.error)
    assert extended.resumed_from == 2


def _eval_steps(run_dir) -> list[int]:
    return [e["step"] for e in read_jsonl(os.path.join(run_dir, "eval.jsonl"))]


def test_a_resumed_run_evaluates_each_step_once(tmp_path):
    # Killed between the checkpoint at step 2 and its evaluation: the resumed run evaluates step 2
    # (it used to skip it for good).
    first = train("rl_sim:RECIPE", {"batches": "4", "steps": "2", "checkpoint_every": "2", "eval_every": "2"},
                  run_dir=str(tmp_path / "a"))
    assert first.error is None and _eval_steps(tmp_path / "a") == [0, 2]
    rewind_jsonl(str(tmp_path / "a" / "eval.jsonl"), 0)  # as if killed before eval 2 was written
    resumed = train(None, {"steps": "4"}, run_dir=str(tmp_path / "a"), resume=True)
    assert resumed.error is None and resumed.resumed_from == 2
    assert _eval_steps(tmp_path / "a") == [0, 2, 4]
    # Killed before the first checkpoint: the run starts over, and step 0 is evaluated once (not twice).
    train("rl_sim:RECIPE", {"batches": "4", "steps": "2", "checkpoint_every": "3", "eval_every": "2"},
          run_dir=str(tmp_path / "b"))
    os.remove(tmp_path / "b" / "checkpoints" / "latest")  # as if killed before the first checkpoint
    again = train(None, {}, run_dir=str(tmp_path / "b"), resume=True)
    assert again.error is None and again.resumed_from is None
    assert _eval_steps(tmp_path / "b") == [0, 2]
