"""What a run leaves on disk: the PNG writer, checkpoints, log rewinding, settings and recipes.

The PNG is checked with a decoder written here from the PNG specification
(chunk layout, CRC32, zlib, filter type 0), not with the writer's own code.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import zlib

import numpy as np
import pytest

from rlengine.errors import ConfigurationError
from rlengine.rl.checkpoint import Checkpointer, LoopState, PendingGroup, capture_rng, restore_rng, rewind_jsonl
from rlengine.rl.config import TrainConfig, parse_overrides
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.plot import encode_png, rasterize, write_reward_png
from rlengine.rl.recipes import load_recipe
from rlengine.rl.run import build_config, train


def decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def test_png_round_trips_through_a_spec_decoder():
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_png(encode_png(img)), img)


def test_reward_curve_is_drawn_where_the_data_is(tmp_path):
    train_pts = [(s, s / 100) for s in range(1, 101)]
    img = rasterize(train_pts, [(0, 0.8), (50, 0.9), (100, 0.95)])
    blue = np.all(img == (31, 119, 180), axis=-1)
    orange = np.all(img == (255, 127, 14), axis=-1)
    assert blue.sum() > 500 and orange.sum() > 100
    ys, xs = np.nonzero(blue)
    # A rising curve: its right end sits higher (smaller row) than its left end.
    assert ys[xs == xs.max()].min() < ys[xs == xs.min()].max()
    path = tmp_path / "r.png"
    write_reward_png(str(path), train_pts, [])
    if importlib.util.find_spec("matplotlib") is None:
        np.testing.assert_array_equal(decode_png(path.read_bytes()), rasterize(train_pts, []))
    else:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_rng_states_round_trip():
    import random

    saved = capture_rng()
    a = (random.random(), np.random.random())
    restore_rng(saved)
    assert (random.random(), np.random.random()) == a


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
