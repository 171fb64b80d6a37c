"""The sharded trainer (``placement.trainer_workers`` = 2: two Ray actors, one gloo group, FSDP2).

References: the single-process torch trainer on the same model and data
(losses, per-token logprobs and gradients within 1e-5; the weights after an
AdamW step), the trainer's own forward (what the replicas sample after a
sync), and a run that was not interrupted (a resumed checkpoint continues it).
"""

from __future__ import annotations

import numpy as np
import pytest

import rlengine as rle

ray = pytest.importorskip("ray")

from rlengine.backends.weight_buckets import unpack

WAIT = 300.0


def datum(tokens: list[int], **inputs: np.ndarray) -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64), **inputs})


def batch() -> list[rle.Datum]:
    """Ragged datums, and a group of 4 sharing a 70-token prompt (tree batches, branching once)."""
    rng = np.random.default_rng(0)
    out = [datum(rng.integers(3, 1000, n).tolist()) for n in (9, 40, 17)]
    prompt = rng.integers(3, 1000, 70).tolist()
    for k in range(4):
        out.append(datum(prompt + rng.integers(3, 1000, 5 + 3 * k).tolist()))
    return out


def with_rl_inputs(data: list[rle.Datum]) -> list[rle.Datum]:
    rng = np.random.default_rng(1)
    out = []
    for d in data:
        n = d.model_input.length
        inputs = dict(d.loss_fn_inputs)
        inputs["logprobs"] = rle.TensorData.from_numpy(rng.normal(-3, 0.5, n).astype(np.float32))
        inputs["advantages"] = rle.TensorData.from_numpy(rng.normal(0, 1, n).astype(np.float32))
        out.append(rle.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def config(model_cache: str, workers: int) -> rle.EngineConfig:
    placement = rle.Placement(kind="ray", trainer_workers=workers) if workers > 1 else rle.Placement()
    return rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache, placement=placement)


def gradients(engine: rle.Engine) -> dict[str, np.ndarray]:
    trainer = engine.get_trainer()
    if hasattr(trainer, "named_params"):
        return {n: (p.grad.numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
                for n, p in trainer.named_params.items()}
    packed = engine.submit_blocking("gradients", trainer.gradients).result(WAIT)
    return {n: t.numpy() for blob in ray.get(packed.refs) for n, t in unpack(blob)}


def weights(engine: rle.Engine) -> dict[str, np.ndarray]:
    trainer = engine.get_trainer()
    named = engine.submit_blocking("weights", trainer.sampler_weights).result(WAIT)
    if hasattr(named, "refs"):
        return {n: t.numpy() for blob in ray.get(named.refs) for n, t in unpack(blob)}
    return {n: t.numpy().copy() for n, t in named}


def train_step(engine: rle.Engine, calls: list[tuple[list[rle.Datum], str, dict | None]]) -> dict:
    client = engine.training_client()
    outs = [client.forward_backward(data, loss_fn, cfg).result(WAIT) for data, loss_fn, cfg in calls]
    return {"outs": outs, "grads": gradients(engine),
            "step": client.optim_step(rle.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result(WAIT),
            "weights": weights(engine)}


@pytest.fixture(scope="module")
def reference_and_sharded(model_cache):
    """The same two accumulated calls (cross_entropy, then ppo with clip-higher) and one AdamW step,
    in one process and on two FSDP2 workers."""
    calls = [(batch(), "cross_entropy", None),
             (with_rl_inputs(batch()), "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})]
    results = {}
    for workers in (1, 2):
        with rle.Engine(config(model_cache, workers)) as engine:
            results[workers] = train_step(engine, calls)
    return results[1], results[2]


def test_two_workers_give_the_single_process_losses_logprobs_and_gradients(reference_and_sharded):
    ref, got = reference_and_sharded
    for a, b in zip(ref["outs"], got["outs"]):
        assert a.metrics.keys() == b.metrics.keys()
        for key in a.metrics:
            np.testing.assert_allclose(b.metrics[key], a.metrics[key], rtol=1e-6, atol=1e-5)
        assert len(b.loss_fn_outputs) == len(a.loss_fn_outputs)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            for key in ("logprobs", "elementwise_loss"):
                np.testing.assert_allclose(y[key].to_numpy(), x[key].to_numpy(), atol=1e-5, rtol=0)
    assert ref["grads"].keys() == got["grads"].keys()
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    for name, g in ref["grads"].items():
        np.testing.assert_allclose(got["grads"][name], g, atol=1e-5 * max(1.0, scale), rtol=0, err_msg=name)
    assert float(np.abs(ref["grads"]["lm_head.weight"]).max()) > 0  # a real gradient was compared


def test_two_workers_step_to_the_single_process_weights(reference_and_sharded):
    ref, got = reference_and_sharded
    np.testing.assert_allclose(got["step"].metrics["grad_norm"], ref["step"].metrics["grad_norm"], rtol=1e-5)
    for name, w in ref["weights"].items():
        np.testing.assert_allclose(got["weights"][name], w, atol=1e-5, rtol=0, err_msg=name)


def test_one_datum_leaves_a_worker_idle_and_still_trains(model_cache):
    """With one datum the second worker has no part; its collectives still match rank 0's."""
    data = [datum(list(range(3, 40)))]
    got = {}
    for workers in (1, 2):
        with rle.Engine(config(model_cache, workers)) as engine:
            out = engine.training_client().forward_backward(data, "cross_entropy").result(WAIT)
            got[workers] = (out.metrics["loss:sum"], gradients(engine))
    np.testing.assert_allclose(got[2][0], got[1][0], rtol=1e-6)
    for name, g in got[1][1].items():
        np.testing.assert_allclose(got[2][1][name], g, atol=1e-5, rtol=0, err_msg=name)


def test_a_sync_from_the_sharded_trainer_makes_both_replicas_sample_its_logprobs(model_cache):
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache,
                           placement=rle.Placement(kind="ray", trainer_workers=2, sampler_replicas=2))
    prompt = [5, 17, 300, 42]
    with rle.Engine(cfg) as engine:
        client = engine.training_client()
        client.forward_backward(batch(), "cross_entropy").result(WAIT)
        client.optim_step(rle.AdamParams(learning_rate=1e-2)).result(WAIT)
        assert client.save_weights_for_sampler().result(WAIT).version == 1
        futures = [engine.sample(prompt, 2, rle.SamplingParams(max_tokens=12, seed=k), session_id=f"s{k}")
                   for k in range(2)]
        seqs = [s for f in futures for s in f.result(WAIT).sequences]
        replicas = {engine.backend._pins[f"s{k}"].index for k in range(2)}
        out = client.forward([datum(prompt + s.tokens) for s in seqs], "cross_entropy").result(WAIT)
        sync = engine.backend.last_sync
    assert replicas == {0, 1} and sync["packed_here"] == 0.0 and sync["bytes"] > 0  # packed by rank 0, not here
    for seq, record in zip(seqs, out.loss_fn_outputs):
        assert set(seq.versions) == {1}
        np.testing.assert_allclose(seq.logprobs, record["logprobs"].to_numpy()[len(prompt) - 1:], atol=1e-5, rtol=0)


def test_a_distributed_checkpoint_resumes_the_run_it_saved(model_cache, tmp_path):
    """Save after one step (with gradients pending from a second call), load into a fresh sharded
    trainer and into one of another size: the next step is the uninterrupted run's."""
    calls = [(batch(), "cross_entropy", None)]
    path = str(tmp_path / "state")
    with rle.Engine(config(model_cache, 2)) as engine:
        client = engine.training_client()
        train_step(engine, calls)
        client.forward_backward(batch()[:3], "cross_entropy").result(WAIT)
        client.save_state(path).result(WAIT)
        expected = train_step(engine, calls)["weights"]
    for workers in (2, 3):
        with rle.Engine(config(model_cache, workers)) as engine:
            engine.training_client().load_state(path).result(WAIT)
            got = train_step(engine, calls)["weights"]
        for name, w in expected.items():
            np.testing.assert_allclose(got[name], w, atol=1e-5, rtol=0, err_msg=f"{workers} workers: {name}")


def test_a_killed_worker_fails_training_typed_at_once_and_sampling_goes_on(model_cache):
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache,
                           placement=rle.Placement(kind="ray", trainer_workers=2, train_timeout_s=60))
    with rle.Engine(cfg) as engine:
        client = engine.training_client()
        client.forward_backward(batch(), "cross_entropy").result(WAIT)
        engine.get_trainer().kill_worker(1)
        with pytest.raises(rle.TrainerLost, match="sharded trainer"):
            client.forward_backward(batch(), "cross_entropy").result(WAIT)
        with pytest.raises(rle.TrainerLost):
            client.optim_step().result(5)  # fails at once: nothing waits for a lost rank
        assert len(engine.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=4)).result(WAIT).sequences[0].tokens)


def test_sharding_needs_ray_placement_and_the_torch_trainer():
    with pytest.raises(rle.ConfigurationError, match="placement.trainer_workers=2"):
        rle.Placement(trainer_workers=2)
    cfg = rle.EngineConfig(backend="sim", placement=rle.Placement(kind="ray", trainer_workers=2))
    with rle.Engine(cfg) as e, pytest.raises(rle.ConfigurationError, match="torch trainer"):
        e.training_client().forward_backward([datum([1, 2, 3])], "cross_entropy").result(WAIT)


def _copy(run_dir: str, model_cache: str, resume: bool = False, **settings: str):
    from rlengine.rl.run import train

    base = {"eval_every": "0", "backend": "torch", "cache_dir": model_cache, "placement": "ray",
            "trainer_workers": "2", "sampler_replicas": "2", "groups_per_batch": "8"}
    return train(None if resume else "copy", {**({} if resume else base), **settings}, run_dir=run_dir,
                 resume=resume)


def test_an_rl_run_on_two_workers_resumes_from_its_distributed_checkpoint_as_if_uninterrupted(tmp_path, model_cache):
    from rlengine.rl.metrics import read_jsonl

    whole = _copy(str(tmp_path / "whole"), model_cache, steps="4", checkpoint_every="0")
    assert whole.error is None, whole.error
    part = _copy(str(tmp_path / "part"), model_cache, steps="2", checkpoint_every="2")
    assert part.error is None, part.error
    resumed = _copy(str(tmp_path / "part"), model_cache, resume=True, steps="4")
    assert resumed.error is None and resumed.resumed_from == 2, resumed.error
    a, b = read_jsonl(whole.metrics_path), read_jsonl(resumed.metrics_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        assert x["reward_mean"] == y["reward_mean"]
        np.testing.assert_allclose(y["loss_sum"], x["loss_sum"], rtol=1e-5)


@pytest.mark.slow
def test_the_copy_recipe_learns_on_two_trainer_workers_and_two_sampler_replicas(tmp_path, model_cache):
    from copy_learning import assert_learned

    outcome = _copy(str(tmp_path), model_cache, steps="30", checkpoint_every="0", groups_per_batch="32")
    assert outcome.error is None, outcome.error
    assert_learned(outcome.metrics_path)


def test_trainer_workers_that_cannot_be_placed_fail_training_within_its_bound(model_cache):
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache,
                           placement=rle.Placement(kind="ray", trainer_workers=2, trainer_resources={"GPU": 1},
                                                   start_timeout_s=40.0))
    with rle.Engine(cfg) as engine:
        with pytest.raises(rle.TrainerLost, match="start_timeout_s=40.0"):
            engine.training_client().forward_backward([datum([1, 2, 3])], "cross_entropy").result(WAIT)
        assert engine.sample([1, 2], 1, rle.SamplingParams(max_tokens=2)).result(WAIT).sequences[0].tokens
