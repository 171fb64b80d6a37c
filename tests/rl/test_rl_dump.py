"""Rollout dumps: ``dump_rollouts`` writes what was trained, ``rollout_only`` samples without
training, ``train_from`` trains on the dumps without sampling and reproduces the run.

The reproduction is checked at the level it must hold: every training call the
``train_from`` run submits is byte-identical (msgpack of its datums, loss and
config; its ``AdamParams``) to the dumping run's, and every column of
``metrics.jsonl`` but the timings is equal, loss and grad norm exactly (the same
batches on the same CPU kernels give the same floats).
"""

from __future__ import annotations

import json
import os
import shutil

import msgspec
import numpy as np
import pytest

import rlengine.rl.loop
from rlengine.core.clients import TrainingClient
from rlengine.errors import ConfigurationError
from rlengine.rl import cli
from rlengine.rl.dump import FORMAT_VERSION, ForwardBackwardCall, OptimStepCall, read_step, step_files
from rlengine.rl.errors import RolloutDumpError
from rlengine.rl.metrics import measured, read_jsonl
from rlengine.rl.run import train

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

# Small enough for seconds: 3 steps of 4 groups of 4, the recipe's 8 substeps and entropy bonus kept.
SMALL = {"steps": "3", "groups_per_batch": "4", "group_size": "4", "eval_every": "0", "checkpoint_every": "0",
         "backend": "torch"}


class Calls:
    """Every training call the engine's training client receives, as bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, bytes]] = []
        fb, optim, install = (TrainingClient.forward_backward, TrainingClient.optim_step,
                              TrainingClient.save_weights_for_sampler)

        def forward_backward(client, data, loss_fn="cross_entropy", loss_fn_config=None):
            self.log.append(("forward_backward", msgspec.msgpack.encode([data, loss_fn, loss_fn_config])))
            return fb(client, data, loss_fn, loss_fn_config)

        def optim_step(client, adam_params=None):
            self.log.append(("optim_step", msgspec.msgpack.encode(adam_params)))
            return optim(client, adam_params)

        def save_weights_for_sampler(client, name=None):
            self.log.append(("install", b""))
            return install(client, name)

        monkeypatch.setattr(TrainingClient, "forward_backward", forward_backward)
        monkeypatch.setattr(TrainingClient, "optim_step", optim_step)
        monkeypatch.setattr(TrainingClient, "save_weights_for_sampler", save_weights_for_sampler)

    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.log}

    def training(self) -> list[tuple[str, bytes]]:
        return [c for c in self.log if c[0] != "install"]


def no_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a train_from run sampled a rollout")

    monkeypatch.setattr(rlengine.rl.loop, "rollout_group", refuse)


def columns(record: dict) -> dict:
    """The record without the columns that measure the machine (``rl.metrics.MEASURED``)."""
    return measured(record)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, model_cache):
    """A ``copy`` run with ``dump_rollouts``, and every training call it made."""
    base = tmp_path_factory.mktemp("dumped")
    with pytest.MonkeyPatch.context() as mp:
        calls = Calls(mp)
        outcome = train("copy", {**SMALL, "cache_dir": model_cache, "dump_rollouts": str(base / "dumps")},
                        run_dir=str(base / "run"))
    assert outcome.error is None, outcome.error
    return base, calls


def test_train_from_submits_byte_identical_calls_and_reproduces_every_column(dumped, tmp_path, monkeypatch):
    base, original = dumped
    replay = Calls(monkeypatch)
    no_sampling(monkeypatch)
    outcome = train(None, {"train_from": str(base / "dumps")}, run_dir=str(tmp_path / "replay"))
    assert outcome.error is None, outcome.error
    assert replay.training() == original.training() and len(original.training()) == 3 * 16
    assert "install" not in replay.kinds()  # nothing samples, so no weight is installed
    first, second = read_jsonl(str(base / "run" / "metrics.jsonl")), read_jsonl(outcome.metrics_path)
    assert len(first) == len(second) == 3
    for a, b in zip(first, second):
        assert (a["loss_sum"], a["grad_norm"], a["entropy_mean"]) == (b["loss_sum"], b["grad_norm"], b["entropy_mean"])
        assert columns(a) == columns(b)
    stored = json.loads((tmp_path / "replay" / "config.json").read_text())["train"]
    assert stored["train_from"] == str(base / "dumps") and stored["eval_every"] == 0 and stored["steps"] == 3


def test_a_step_dump_holds_the_calls_as_submitted_with_masks_versions_and_groups(dumped):
    base, _ = dumped
    meta = json.loads((base / "dumps" / "meta.json").read_text())
    assert (meta["format"], meta["recipe"], meta["seed"]) == (FORMAT_VERSION, "copy", 0)
    assert meta["train"]["groups_per_batch"] == 4
    files = step_files(str(base / "dumps"))
    assert [os.path.basename(f) for f in files] == [f"step-{s:06d}.msgpack" for s in (1, 2, 3)]
    metrics = read_jsonl(str(base / "run" / "metrics.jsonl"))
    for step, (path, record) in enumerate(zip(files, metrics), start=1):
        dump = read_step(path, step)
        # num_substeps=8: a forward_backward on one part of the batch, then an optimizer step, eight times.
        assert [type(c) for c in dump.calls] == [ForwardBackwardCall, OptimStepCall] * 8
        parts = sorted(i for c in dump.calls if isinstance(c, ForwardBackwardCall) for i in c.datums)
        assert parts == list(range(len(dump.datums))) == list(range(record["datums"]))
        assert {c.adam.learning_rate for c in dump.calls if isinstance(c, OptimStepCall)} == {record["learning_rate"]}
        assert dump.updates == step - 1 and dump.learning_rate == record["learning_rate"]
        assert [g.group for g in dump.groups] == list(range(4 * (step - 1), 4 * step))
        assert all(len(g.advantages) == len(g.trajectories) == 4 for g in dump.groups)
        assert sorted(dump.rewards) == sorted(r for g in dump.groups for r in g.rewards)
        for d in dump.datums:
            mask, versions = d.mask.to_numpy(), d.versions.to_numpy()
            np.testing.assert_array_equal(mask, d.datum.loss_fn_inputs["mask"].to_numpy())
            # Synchronous: every sampled token comes from the policy the step trains from.
            assert set(versions[mask > 0].tolist()) == {step - 1} and set(versions[mask == 0].tolist()) <= {-1}
            group = dump.groups[d.group - 4 * (step - 1)]
            advantage = group.advantages[group.trajectories.index(d.trajectory)]
            np.testing.assert_allclose(d.datum.loss_fn_inputs["advantages"].to_numpy(), np.float32(advantage) * mask)
        assert sum(int(d.mask.to_numpy().sum()) for d in dump.datums) == record["sampled_tokens_trained"]


def test_rollout_only_samples_and_dumps_without_training(tmp_path, model_cache, monkeypatch):
    calls = Calls(monkeypatch)
    dumps = tmp_path / "dumps"
    outcome = train("copy", {**SMALL, "steps": "2", "cache_dir": model_cache, "dump_rollouts": str(dumps),
                             "rollout_only": "true"}, run_dir=str(tmp_path / "run"))
    assert outcome.error is None, outcome.error
    assert calls.log == []  # no forward_backward, optimizer step or install, not even of the starting weights
    records = read_jsonl(outcome.metrics_path)
    assert [r["version"] for r in records] == [0, 0] and all("loss_sum" not in r and "grad_norm" not in r
                                                             for r in records)
    assert all(r["groups_trained"] == 4 and r["reward_mean"] is not None for r in records)
    for step, path in enumerate(step_files(str(dumps)), start=1):
        dump = read_step(path, step)
        assert dump.updates == 0 and len(dump.calls) == 16
        assert {v for d in dump.datums for v in d.versions.to_numpy().tolist()} == {-1, 0}
    # What it sampled trains later, off the sampler.
    no_sampling(monkeypatch)
    later = train(None, {"train_from": str(dumps)}, run_dir=str(tmp_path / "later"))
    assert later.error is None, later.error
    assert [r["version"] for r in read_jsonl(later.metrics_path)] == [1, 2]
    assert all(np.isfinite(r["grad_norm"]) for r in read_jsonl(later.metrics_path))


def test_a_corrupt_or_foreign_step_file_is_refused_naming_it(dumped, tmp_path):
    base, _ = dumped
    dumps = tmp_path / "dumps"
    shutil.copytree(base / "dumps", dumps)
    bad = dumps / "step-000002.msgpack"
    bad.write_bytes(b"\x00not msgpack")
    with pytest.raises(RolloutDumpError, match="step-000002.msgpack: not a step dump") as info:
        read_step(str(bad), 2)
    assert info.value.path == str(bad) and isinstance(info.value, ValueError)
    # The run stops at that step with the typed error, after training the steps before it.
    outcome = train(None, {"train_from": str(dumps)}, run_dir=str(tmp_path / "replay"))
    assert isinstance(outcome.error, RolloutDumpError) and outcome.error.path == str(bad)
    assert [r["step"] for r in read_jsonl(outcome.metrics_path)] == [1]
    future = msgspec.msgpack.encode({**msgspec.msgpack.decode(bad.with_name("step-000001.msgpack").read_bytes()),
                                     "format": FORMAT_VERSION + 1})
    bad.write_bytes(future)
    with pytest.raises(RolloutDumpError, match=f"step-000002.msgpack: format={FORMAT_VERSION + 1}"):
        read_step(str(bad), 2)
    with pytest.raises(RolloutDumpError, match="holds step 1, expected step 2"):
        read_step(str(dumps / "step-000001.msgpack"), 2)
    meta = dumps / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 0}))
    with pytest.raises(RolloutDumpError, match="meta.json: format=0"):
        train(None, {"train_from": str(dumps)}, run_dir=str(tmp_path / "again"))


def test_modes_that_contradict_each_other_or_find_no_dumps_are_refused(dumped, tmp_path, capsys, monkeypatch):
    base, _ = dumped
    with pytest.raises(ConfigurationError, match="rollout_only=True: train_from="):
        train("copy", {"rollout_only": "true", "train_from": str(base / "dumps")}, run_dir=str(tmp_path / "a"))
    with pytest.raises(ConfigurationError, match="rollout_only=True: needs dump_rollouts"):
        train("copy", {"rollout_only": "true"}, run_dir=str(tmp_path / "b"))
    with pytest.raises(ConfigurationError, match="dump_rollouts=.*holds rollout dumps already"):
        train("copy", {"dump_rollouts": str(base / "dumps")}, run_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigurationError, match="steps=4: .* holds 3 step dumps"):
        train(None, {"train_from": str(base / "dumps"), "steps": "4"}, run_dir=str(tmp_path / "d"))
    with pytest.raises(ConfigurationError, match="recipe='guess': the dumps .* recipe 'copy'"):
        train("guess", {"train_from": str(base / "dumps")}, run_dir=str(tmp_path / "e"))
    with pytest.raises(ConfigurationError, match="eval_every=5: a train_from run samples nothing"):
        train(None, {"train_from": str(base / "dumps"), "eval_every": "5"}, run_dir=str(tmp_path / "f"))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(base / "dumps" / "meta.json", empty)
    with pytest.raises(ConfigurationError, match="train_from=.*empty'?: holds no step dumps"):
        train(None, {"train_from": str(empty)}, run_dir=str(tmp_path / "g"))
    gap = tmp_path / "gap"
    shutil.copytree(base / "dumps", gap)
    os.remove(gap / "step-000002.msgpack")
    with pytest.raises(ConfigurationError, match="step-000002.msgpack is missing"):
        train(None, {"train_from": str(gap), "steps": "2"}, run_dir=str(tmp_path / "h"))
    with pytest.raises(RolloutDumpError, match="meta.json: missing"):
        train(None, {"train_from": str(tmp_path)}, run_dir=str(tmp_path / "i"))
    # The command line's flags are the same settings, refused the same way (exit 2, nothing started).
    # The command sets its process's third-party log levels (rlengine.console): keep them out of this one's.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    assert cli.main(["--rollout-only", "--train-from", str(base / "dumps"), "--run-dir", str(tmp_path / "j")]) == 2
    assert "rollout_only=True: train_from=" in capsys.readouterr().err
    assert cli.main(["dump_rollouts=x", "--dump-rollouts", "y", "--run-dir", str(tmp_path / "k")]) == 2
    assert "dump_rollouts='x': given twice (also as --dump-rollouts)" in capsys.readouterr().err
