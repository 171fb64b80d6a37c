"""Behaviour logprobs end to end: the sampler's mode, the trainer's transform, the RL loop's recompute.

References: the torch trainer's forward on the finished sequences (itself
checked against numpy in tests/trainer/test_trainer_corrections.py). A
sampler at temperature 0.7 with top-k and top-p that records raw logprobs
gives an importance ratio far from 1 against the trainer's logprob of the
distribution actually sampled; processed logprobs give 1 to float rounding
(the sampler's KV-cache decode and the trainer's full forward round
differently); the zero-mismatch mode gives exactly 1.0.
"""

from __future__ import annotations

import numpy as np
import pytest
from serving import Served

import rlengine as rle
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.rl.advantages import trajectory_datums
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train
from rlengine.rl.sandbox import session_trajectory
from rlengine.rl.types import Observation, Trajectory, Transition
from rlengine.sandbox_client import Client
from rlengine.serve.server import ServeConfig
from rlengine.types import LogprobTransform

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

WAIT = 300.0
PROMPT = rle.ModelInput.from_ints([1, 2, 3, 4])
TRANSFORM = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}


def log_ratios(engine: rle.Engine, sequences, transform: dict | None) -> np.ndarray:
    """log(trainer / sampler) over every sampled token; ``transform``: what the trainer computes
    (None: what each sequence's datum carries)."""
    data, masks = [], []
    for seq in sequences:
        t = Trajectory(transitions=[Transition(observation=Observation(prompt=PROMPT), action=seq, reward=0.0,
                                               done=True)])
        (d, mask, _), = trajectory_datums(t, 1.0, with_mask=False)
        inputs = {"target_tokens": d.loss_fn_inputs["target_tokens"]}
        n = d.model_input.length
        if transform is None:
            inputs |= {k: v for k, v in d.loss_fn_inputs.items() if k in TRANSFORM}
        else:
            inputs |= {k: np.full(n, v, np.float32) for k, v in transform.items()}
        data.append((d, rle.Datum(model_input=d.model_input, loss_fn_inputs=inputs)))
        masks.append(mask > 0)
    out = engine.training_client().forward([f for _, f in data], "cross_entropy").result(WAIT)
    return np.concatenate([rec["logprobs"].to_numpy()[m] - d.loss_fn_inputs["logprobs"].to_numpy()[m]
                           for (d, _), rec, m in zip(data, out.loss_fn_outputs, masks)])


def test_processed_logprobs_make_the_on_policy_ratio_one_where_raw_ones_are_biased(engine_config):
    params = rle.SamplingParams(max_tokens=64, temperature=0.7, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
    with rle.Engine(engine_config("torch")) as engine:
        sampler = engine.sampling_client()
        raw = sampler.sample(PROMPT, 16, params).result(WAIT).sequences
        processed = sampler.sample(PROMPT, 16, rle.SamplingParams(**{**_fields(params), "logprobs_mode": "processed"})
                                   ).result(WAIT).sequences
        assert raw[0].logprobs_transform is None
        assert processed[0].logprobs_transform == LogprobTransform(temperature=0.7, top_k=50, top_p=0.9)
        assert [s.tokens for s in raw] == [s.tokens for s in processed]  # the mode changes no draw
        biased = log_ratios(engine, raw, TRANSFORM)
        exact = log_ratios(engine, processed, None)  # the datums carry the transform themselves
    assert biased.size == exact.size == 1024
    assert np.exp(biased).mean() > 1.5  # raw logprobs of a tempered, filtered draw: far from 1
    assert np.abs(exact).max() < 1e-4 and abs(float(np.exp(exact).mean()) - 1.0) < 1e-6


def _fields(params: rle.SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_the_mode_is_per_request_with_the_engines_as_default_and_refused_where_unsupported(engine_config):
    params = rle.SamplingParams(max_tokens=4, temperature=0.7, seed=1)
    with rle.Engine(engine_config("torch", logprobs_mode="processed")) as engine:
        sampler = engine.sampling_client()
        default = sampler.sample(PROMPT, 1, params).result(WAIT).sequences[0]
        raw = sampler.sample(PROMPT, 1, rle.SamplingParams(**{**_fields(params), "logprobs_mode": "raw"})
                             ).result(WAIT).sequences[0]
        greedy = sampler.sample(PROMPT, 1, rle.SamplingParams(max_tokens=4, temperature=0.0)).result(WAIT)
    assert default.logprobs_transform == LogprobTransform(temperature=0.7) and raw.logprobs_transform is None
    assert default.tokens == raw.tokens and not np.allclose(default.logprobs, raw.logprobs)
    assert greedy.sequences[0].logprobs_transform is None  # a greedy draw has no distribution to process
    with pytest.raises(InvalidRequest, match="logprobs_mode"):
        rle.SamplingParams(logprobs_mode="tempered")
    with rle.Engine(engine_config("sim")) as sim, pytest.raises(InvalidRequest, match="sampling_params.logprobs_mode"):
        sim.sampling_client().sample(PROMPT, 1, rle.SamplingParams(max_tokens=2, logprobs_mode="processed"))
    with pytest.raises(ConfigurationError, match="logprobs_mode"), rle.Engine(engine_config("sim", logprobs_mode="processed")):
        pass


def run(tmp_path, model_cache, name, **overrides):
    settings = {"steps": 2, "eval_every": 0, "checkpoint_every": 0, "backend": "torch", "cache_dir": model_cache,
                "groups_per_batch": 4, "temperature": 0.7, **overrides}
    outcome = train("copy", settings, run_dir=str(tmp_path / name))
    assert outcome.error is None, outcome.error
    return read_jsonl(outcome.metrics_path)


def test_zero_mismatch_mode_gives_a_ratio_of_exactly_one(tmp_path, model_cache):
    # One forward_backward per step: every trained token is compared (with substeps, the first part's).
    steps = run(tmp_path, model_cache, "zero", logprobs_source="trainer", steps=3, groups_per_batch=16,
                skip_constant_reward=False)
    assert sum(s["sampled_tokens_trained"] for s in steps) >= 1000
    for s in steps:
        assert s["kl_sample_train_v1"] == 0.0 and s["kl_sample_train_k3"] == 0.0, s
        assert s["ratio_min"] == s["ratio_max"] == 1.0, s
        # What it replaced: the sampler's own logprobs, a float rounding away.
        assert 0.0 <= s["recomputed_k3"] < 1e-6, s
        assert s["recomputed_ratio_min"] != 1.0 or s["recomputed_ratio_max"] != 1.0, s


def test_a_run_samples_processed_logprobs_and_trains_under_the_same_transform(tmp_path, model_cache):
    steps = run(tmp_path, model_cache, "auto")  # logprobs_mode auto: processed on the torch backend
    for s in steps:
        assert 0.9999 < s["ratio_min"] <= s["ratio_max"] < 1.0001, s
    raw = run(tmp_path, model_cache, "raw", logprobs_mode="raw")  # consistent too: raw against raw
    for s in raw:
        assert 0.9999 < s["ratio_min"] <= s["ratio_max"] < 1.0001, s


def test_a_correction_runs_its_recompute_and_reports_what_it_cut(tmp_path, model_cache):
    steps = run(tmp_path, model_cache, "tis", tis_cap=2.0, num_substeps=2)
    for s in steps:
        assert s["is_truncated_frac"] == 0.0 and s["is_masked_frac"] == 0.0, s  # on-policy: w is 1 to rounding
        assert abs(s["recomputed_v1"]) < 1e-5, s
    tight = run(tmp_path, model_cache, "icepop", icepop_low=1.0, icepop_high=1.0)  # only w == 1.0 exactly survives
    assert any(s["is_masked_frac"] > 0.0 for s in tight), tight
    for bad, field in (({"tis_cap": 2.0, "mis_cap": 2.0}, "at most one"), ({"icepop_low": 0.5}, "icepop_high"),
                       ({"tis_cap": 2.0, "num_minibatches": 2}, "num_minibatches")):
        with pytest.raises(ConfigurationError, match=field):
            train("copy", {"steps": 1, **bad}, run_dir=str(tmp_path / "bad"))


def test_a_session_trace_keeps_each_completions_transform_for_training(model_cache):
    config = rle.EngineConfig(backend="torch", model="tiny", model_name="tiny", cache_dir=model_cache,
                              logprobs_mode="processed")
    served = Served([config], ServeConfig(http=False))
    try:
        with Client(served.ipc_path, timeout=WAIT) as c:
            s = c.open_session()
            hot = s.generate([5, 6], max_tokens=3, temperature=0.7, top_k=40, seed=1).choices[0]
            plain = s.generate([5, 6, *hot.tokens, 9], max_tokens=3, temperature=1.0, seed=2).choices[0]
            s.reward(1.0)
        trace = served.on_loop(served.sessions.collect, s.session_id)
    finally:
        served.close()
    actions = [t.action for t in session_trajectory(trace, 1.0).transitions]
    assert [a.tokens for a in actions] == [hot.tokens, plain.tokens]
    assert actions[0].logprobs_transform == LogprobTransform(temperature=0.7, top_k=40)
    assert actions[1].logprobs_transform is None  # temperature 1, no filter: the model's own distribution
    t = Trajectory(transitions=session_trajectory(trace, 1.0).transitions)
    (d, mask, _), = trajectory_datums(t, 1.0, with_mask=False)
    sampled = np.flatnonzero(mask)
    assert d.loss_fn_inputs["temperature"].to_numpy()[sampled].tolist() == [np.float32(0.7)] * 3 + [1.0] * 3
    assert d.loss_fn_inputs["top_k"].to_numpy()[sampled].tolist() == [40.0] * 3 + [0.0] * 3


def test_dumps_of_a_corrected_run_replay_and_a_rollout_only_dump_gets_its_recompute(tmp_path, model_cache):
    dumped = run(tmp_path, model_cache, "dumped", tis_cap=2.0, dump_rollouts=str(tmp_path / "d1"))
    replay = train(None, {"train_from": str(tmp_path / "d1")}, run_dir=str(tmp_path / "replay1"))
    assert replay.error is None, replay.error
    again = read_jsonl(replay.metrics_path)
    assert [s["loss_sum"] for s in again] == [s["loss_sum"] for s in dumped]  # the recomputed datums were dumped
    only = run(tmp_path, model_cache, "only", tis_cap=2.0, rollout_only=True, dump_rollouts=str(tmp_path / "d2"))
    assert "is_truncated_frac" not in only[0]  # nothing trained, nothing recomputed
    replay = train(None, {"train_from": str(tmp_path / "d2")}, run_dir=str(tmp_path / "replay2"))
    assert replay.error is None, replay.error
    first, second = read_jsonl(replay.metrics_path)
    assert first["is_truncated_frac"] == 0.0 and abs(first["recomputed_v1"]) < 1e-5  # sampled by these weights
    # Step 2's rollouts came from the initial policy, trained on by now: off-policy, which the pass measures.
    assert abs(second["recomputed_v1"]) > 1e-3 and second["recomputed_ratio_min"] < 0.99, second
