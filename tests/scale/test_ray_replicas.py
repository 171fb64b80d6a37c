"""Sampler replicas as Ray actors (``Placement(kind="ray")``), on a local Ray cluster started here.

References: the same engine with ``placement="local"`` (one backend in this
process: the replicas must give its tokens and logprobs), the trainer's own
forward pass (a weight sync must make every replica's logprobs the
trainer's), and the engine's accounting of every request (a killed replica
costs only its own requests, typed ``ReplicaLost``; every future settles).
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import rlengine as rle

ray = pytest.importorskip("ray")

WAIT = 120.0


def ray_config(replicas: int = 2, **placement) -> dict:
    return {"placement": rle.Placement(kind="ray", sampler_replicas=replicas, **placement)}


def samples(engine: rle.Engine, n: int = 12, sessions: int = 0) -> list[rle.SampleResponse]:
    futures = [engine.sample([3 + i, 5, 7], 4, rle.SamplingParams(max_tokens=12, seed=i),
                             session_id=f"s{i % sessions}" if sessions else None) for i in range(n)]
    return [f.result(WAIT) for f in futures]


def same(a: list[rle.SampleResponse], b: list[rle.SampleResponse]) -> bool:
    return all(x.tokens == y.tokens and x.logprobs == y.logprobs
               for ra, rb in zip(a, b) for x, y in zip(ra.sequences, rb.sequences))


def test_importing_rlengine_and_configuring_ray_placement_imports_no_ray():
    code = ("import sys, rlengine as rle, rlengine.core.engine, rlengine.rl.run;"
            "rle.EngineConfig(placement=rle.Placement(kind='ray', sampler_replicas=2));"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_placement_is_validated_naming_the_field():
    with pytest.raises(rle.ConfigurationError, match="placement.sampler_replicas=2"):
        rle.Placement(sampler_replicas=2)
    with pytest.raises(rle.ConfigurationError, match="placement.sampler_replicas=0"):
        rle.Placement(kind="ray", sampler_replicas=0)
    with pytest.raises(rle.ConfigurationError, match="placement.sync_timeout_s"):
        rle.Placement(kind="ray", sync_timeout_s=0)
    with pytest.raises(rle.ConfigurationError, match="placement.replica_resources"):
        rle.Placement(kind="ray", replica_resources={"CPU": -1})


def test_two_sim_replicas_give_the_local_engines_samples_and_share_the_work():
    with rle.Engine(rle.EngineConfig(backend="sim")) as local:
        expected = samples(local)
    with rle.Engine(rle.EngineConfig(backend="sim", **ray_config())) as engine:
        assert engine.backend.name == "ray[2xsim]"
        got = samples(engine)
        described = engine.backend.describe()
    assert same(got, expected)
    pids = {r["pid"] for r in described["replicas"]}
    assert len(pids) == 2 and all(r["state"] == "live" for r in described["replicas"])


def test_a_session_stays_on_one_replica_and_sessions_spread_over_both():
    cfg = rle.EngineConfig(backend="sim", sim=rle.SimConfig(step_time_s=0.002), **ray_config())
    with rle.Engine(cfg) as engine:
        backend = engine.backend
        seen: dict[str, set[int]] = {}
        for turn in range(3):
            futures = {f"s{k}": engine.sample([1, 2, 3 + turn], 2, rle.SamplingParams(max_tokens=8),
                                              session_id=f"s{k}") for k in range(4)}
            for session, future in futures.items():
                future.result(WAIT)
                seen.setdefault(session, set()).add(backend._pins[session].index)
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    assert {next(iter(r)) for r in seen.values()} == {0, 1}


def test_a_weight_sync_makes_every_replicas_logprobs_the_trainers(model_cache):
    """Train a step on the (driver's) torch trainer, install it: each replica then samples with
    logprobs equal to the trainer's forward pass on the same tokens, and both replicas were used."""
    cfg = rle.EngineConfig(model="tiny", backend="torch", cache_dir=model_cache, **ray_config())
    with rle.Engine(cfg) as engine:
        trainer = engine.training_client()
        prompt = [5, 17, 300, 42]
        datum = rle.Datum(model_input=rle.ModelInput.from_ints(prompt + [8, 9]),
                          loss_fn_inputs={"target_tokens": np.array(prompt[1:] + [8, 9, 10], dtype=np.int64)})
        trainer.forward_backward([datum], "cross_entropy").result(WAIT)
        trainer.optim_step(rle.AdamParams(learning_rate=1e-2)).result(WAIT)
        assert trainer.save_weights_for_sampler().result(WAIT) is not None
        futures = [engine.sample(prompt, 2, rle.SamplingParams(max_tokens=16, seed=k), session_id=f"r{k}")
                   for k in range(2)]
        responses = [f.result(WAIT) for f in futures]
        replicas = {engine.backend._pins[f"r{k}"].index for k in range(2)}
        data, seqs = [], []
        for response in responses:
            for seq in response.sequences:
                full = prompt + seq.tokens
                data.append(rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]),
                                      loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)}))
                seqs.append(seq)
        out = trainer.forward(data, "cross_entropy").result(WAIT)
        described = engine.backend.describe()
    assert replicas == {0, 1}
    assert described["version"] == 1 and [r["version"] for r in described["replicas"]] == [1, 1]
    for seq, record in zip(seqs, out.loss_fn_outputs):
        assert set(seq.versions) == {1}
        np.testing.assert_allclose(seq.logprobs, record["logprobs"].to_numpy()[len(prompt) - 1:], atol=1e-5, rtol=0)


def test_a_killed_replica_costs_only_its_requests_and_is_replaced_with_the_current_weights():
    cfg = rle.EngineConfig(backend="sim", sim=rle.SimConfig(step_time_s=0.01, gen_len=400), **ray_config())
    with rle.Engine(cfg) as engine:
        trainer = engine.training_client()
        trainer.save_weights_for_sampler().result(WAIT)  # version 1 everywhere
        backend = engine.backend
        futures = {f"s{k}": engine.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=400), session_id=f"s{k}")
                   for k in range(6)}
        deadline = time.monotonic() + WAIT
        while not all(backend._pins.get(s) is not None and backend._pins[s].inflight for s in ("s0", "s1")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        victim = backend._pins["s0"].index
        doomed = {s for s, r in backend._pins.items() if r.index == victim}
        backend.kill_replica(victim)
        outcomes = {}
        for session, future in futures.items():
            try:
                outcomes[session] = ("ok", future.result(WAIT))
            except rle.RequestError as exc:
                outcomes[session] = ("failed", exc)
        assert {s for s, (kind, _) in outcomes.items() if kind == "failed"} == doomed
        assert all(isinstance(exc, rle.ReplicaLost) for kind, exc in outcomes.values() if kind == "failed")
        assert all(len(r.sequences[0].tokens) == 400 for kind, r in outcomes.values() if kind == "ok")
        # The replacement comes up with version 1, joins, and the next install reaches it (no poisoned gate).
        deadline = time.monotonic() + WAIT
        while sum(r["state"] == "live" for r in backend.describe()["replicas"]) < 2:
            engine.sample([1], 1, rle.SamplingParams(max_tokens=1)).result(WAIT)
            assert time.monotonic() < deadline
        trainer.save_weights_for_sampler().result(WAIT)
        described = backend.describe()
        after = [engine.sample([4, 5], 1, rle.SamplingParams(max_tokens=4), session_id=f"t{k}") for k in range(4)]
        assert all(f.result(WAIT).sequences[0].versions == [2] * 4 for f in after)
    states = [r["state"] for r in described["replicas"]]
    assert states.count("dead") == 1 and states.count("live") == 2 and described["replacements"] == 1
    assert all(r["version"] == 2 for r in described["replicas"] if r["state"] == "live")


@pytest.mark.parametrize("fault", ["exit", "raise", "hang"])
def test_a_failed_weight_sync_fails_the_install_typed_and_leaves_one_version_everywhere(fault):
    """A replica dies, fails or hangs during an install: WeightSyncError (within sync_timeout_s
    for the hang); the engine stays on version 1, the other replica is rolled back to it, the
    failed one replaced by one with version 1, and every replica samples version 1's tokens."""
    cfg = rle.EngineConfig(backend="sim", **ray_config(sync_timeout_s=5.0))
    with rle.Engine(rle.EngineConfig(backend="sim")) as local:
        trainer = local.training_client()
        trainer.save_weights_for_sampler().result(WAIT)
        expected = samples(local, sessions=4)
    with rle.Engine(cfg) as engine:
        trainer = engine.training_client()
        trainer.save_weights_for_sampler().result(WAIT)
        trainer.forward_backward([rle.Datum(model_input=rle.ModelInput.from_ints([1, 2, 3]),
                                            loss_fn_inputs={"target_tokens": np.array([2, 3, 4])})],
                                 "cross_entropy").result(WAIT)
        trainer.optim_step(rle.AdamParams(learning_rate=0.5)).result(WAIT)  # version 2 would differ
        backend = engine.backend
        backend.inject_fault(1, "load_weights", fault)
        started = time.monotonic()
        with pytest.raises(rle.WeightSyncError, match=r"replica\(s\) \[1\]"):
            trainer.save_weights_for_sampler().result(WAIT)
        assert time.monotonic() - started < 5.0 + 30.0
        deadline = time.monotonic() + WAIT
        while sum(r["state"] == "live" for r in backend.describe()["replicas"]) < 2:
            engine.sample([1], 1, rle.SamplingParams(max_tokens=1)).result(WAIT)
            assert time.monotonic() < deadline
        got = samples(engine, sessions=4)
        described = backend.describe()
        assert {backend._pins[f"s{k}"].index for k in range(4)} == {0, 2}  # the survivor and the replacement
    assert same(got, expected)
    assert described["version"] == 1 and described["replacements"] == 1
    assert [r["version"] for r in described["replicas"] if r["state"] == "live"] == [1, 1]


@pytest.mark.slow
def test_the_copy_recipe_learns_with_two_sampler_replicas(tmp_path, model_cache):
    """The RL loop unchanged, its sampling on two replica actors: the reward rises as it does in
    one process (tests/rl/test_rl_learning.py)."""
    from copy_learning import assert_learned

    from rlengine.rl.run import train

    outcome = train("copy", {"steps": "30", "eval_every": "0", "checkpoint_every": "0", "backend": "torch",
                             "cache_dir": model_cache, "placement": "ray", "sampler_replicas": "2"},
                    run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    assert_learned(outcome.metrics_path)


def test_replicas_that_cannot_be_placed_fail_the_start_within_its_bound():
    """Resources no node has (a GPU here): the engine does not wait forever for its replicas."""
    cfg = rle.EngineConfig(backend="sim", **ray_config(replica_resources={"GPU": 1}, start_timeout_s=2.0))
    started = time.monotonic()
    with pytest.raises(rle.EngineDeadError, match="start_timeout_s=2.0"):
        rle.Engine(cfg).start()
    assert time.monotonic() - started < 60


def test_ray_placement_without_ray_installed_is_a_configuration_error_naming_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import rlengine as rle\n"
            "try:\n"
            "    rle.Engine(rle.EngineConfig(backend='sim', placement=rle.Placement(kind='ray'))).start()\n"
            "except rle.ConfigurationError as exc:\n"
            "    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert "refused: placement.kind='ray' needs Ray" in out.stdout and "rlengine[ray]" in out.stdout
