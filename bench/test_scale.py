"""Scale-out (issue 20): sampler replicas as Ray actors against the one-process engine.

* weight sync: ms per MB of a weight install to 2 replica actors through the object
  store (``Placement(kind="ray")``) vs the in-process install (``placement="local"``),
  same model, alternating rounds; and the same from a trainer sharded over 2 FSDP2 workers;
* the ``copy`` recipe's RL steps/s in one process vs with 1 and 2 sampler replicas;
* control-plane overhead per request: one-token sim requests, local vs one remote
  replica (sequential round trips and a burst of 2,000).

Run: ``OMP_NUM_THREADS=1 python -m pytest bench/test_scale.py --benchmark-only -s -p no:cacheprovider``
(figures in bench/RESULTS.md, "Scale-out"). Starts a local Ray cluster of 4 CPUs.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import rlengine as rle

ray = pytest.importorskip("ray")

ROUNDS = 5
WAIT = 300.0
# A model of about 100 MB in float32 (hidden 512, 8 layers): enough bytes to read a per-MB cost.
SYNC_MODEL = {"hidden_size": 512, "intermediate_size": 1376, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rlengine-bench-cache"))


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _install_s(engine: rle.Engine) -> float:
    trainer = engine.training_client()
    started = time.perf_counter()
    trainer.save_weights_for_sampler().result(WAIT)
    return time.perf_counter() - started


def test_weight_sync_ms_per_mb_object_store_vs_in_process(record, model_cache):
    base = {"model": "tiny", "backend": "torch", "cache_dir": model_cache, "model_args": SYNC_MODEL}

    def run() -> dict:
        with rle.Engine(rle.EngineConfig(**base)) as local, \
                rle.Engine(rle.EngineConfig(**base, placement=rle.Placement(kind="ray", sampler_replicas=2))) as remote:
            mb = sum(p.numel() * p.element_size() for p in local.backend.model.parameters()) / 2**20
            times: dict[str, list[float]] = {"local": [], "ray": []}
            syncs = []
            _install_s(local), _install_s(remote)  # warm-up: builds both trainers
            for k in range(ROUNDS):
                for name, engine in ((("local", local), ("ray", remote)) if k % 2 == 0
                                     else (("ray", remote), ("local", local))):
                    times[name].append(_install_s(engine))
                    if name == "ray":
                        syncs.append(remote.backend.last_sync)
        local_s, ray_s = statistics.median(times["local"]), statistics.median(times["ray"])
        return {"weights_mb": mb, "replicas": 2, "local_install_s": local_s, "ray_install_s": ray_s,
                "local_ms_per_mb": 1e3 * local_s / mb, "ray_ms_per_mb": 1e3 * ray_s / mb,
                "ray_over_local": ray_s / local_s,
                "ray_pack_s": statistics.median(s["pack_s"] for s in syncs),
                "ray_put_s": statistics.median(s["put_s"] for s in syncs),
                "ray_load_s": statistics.median(s["load_s"] for s in syncs),
                "buckets": syncs[-1]["buckets"]}

    r = record(run)
    assert r["ray_install_s"] > 0 and r["local_install_s"] > 0


def test_weight_sync_from_two_fsdp2_trainer_workers_vs_in_process(record, model_cache):
    """The install from the sharded trainer: every rank gathers each full tensor, rank 0 packs
    the buckets and puts them in the object store, the 2 replicas load them (the driver only
    passes references); against the in-process install of the same model."""
    base = {"model": "tiny", "backend": "torch", "cache_dir": model_cache, "model_args": SYNC_MODEL}

    def run() -> dict:
        times: dict[str, list[float]] = {"local": [], "sharded": []}
        syncs = []
        with rle.Engine(rle.EngineConfig(**base)) as local:
            mb = sum(p.numel() * p.element_size() for p in local.backend.model.parameters()) / 2**20
            _install_s(local)
            times["local"] = [_install_s(local) for _ in range(ROUNDS)]
        placement = rle.Placement(kind="ray", sampler_replicas=2, trainer_workers=2)
        with rle.Engine(rle.EngineConfig(**base, placement=placement)) as sharded:
            _install_s(sharded)
            for _ in range(ROUNDS):
                times["sharded"].append(_install_s(sharded))
                syncs.append(sharded.backend.last_sync)
        local_s, sharded_s = statistics.median(times["local"]), statistics.median(times["sharded"])
        return {"weights_mb": mb, "trainer_workers": 2, "replicas": 2, "local_install_s": local_s,
                "sharded_install_s": sharded_s, "local_ms_per_mb": 1e3 * local_s / mb,
                "sharded_ms_per_mb": 1e3 * sharded_s / mb, "sharded_over_local": sharded_s / local_s,
                "replicas_load_s": statistics.median(s["load_s"] for s in syncs)}

    r = record(run)
    assert r["sharded_install_s"] > 0


def _copy_steps_per_s(tmp_path, model_cache, name: str, overrides: dict) -> float:
    from rlengine.rl.run import train

    stamps: list[float] = []
    outcome = train("copy", {"steps": "12", "eval_every": "0", "checkpoint_every": "0", "backend": "torch",
                             "cache_dir": model_cache, **overrides},
                    run_dir=str(tmp_path / name), on_step=lambda _: stamps.append(time.perf_counter()))
    assert outcome.error is None, outcome.error
    return (len(stamps) - 2) / (stamps[-1] - stamps[1])  # steps 3..12: past start-up and the first step


def test_copy_recipe_steps_per_s_local_vs_one_and_two_sampler_replicas(record, tmp_path, model_cache):
    configs = {"local": {}, "ray_1": {"placement": "ray", "sampler_replicas": "1"},
               "ray_2": {"placement": "ray", "sampler_replicas": "2"}}

    def run() -> dict:
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for k in range(3):
            order = list(configs) if k % 2 == 0 else list(reversed(configs))
            for name in order:
                rates[name].append(_copy_steps_per_s(tmp_path / f"r{k}", model_cache, name, configs[name]))
        m = {name: statistics.median(v) for name, v in rates.items()}
        return {"local_steps_per_s": m["local"], "ray_1_steps_per_s": m["ray_1"], "ray_2_steps_per_s": m["ray_2"],
                "ray_2_over_ray_1": m["ray_2"] / m["ray_1"], "ray_1_over_local": m["ray_1"] / m["local"]}

    r = record(run)
    assert r["ray_2_steps_per_s"] > 0


def test_control_plane_overhead_per_request_remote_replica_vs_in_process(record):
    params = rle.SamplingParams(max_tokens=1)

    def sequential(engine: rle.Engine, n: int) -> float:
        started = time.perf_counter()
        for i in range(n):
            engine.sample([1 + i % 100], 1, params).result(WAIT)
        return (time.perf_counter() - started) / n

    def burst(engine: rle.Engine, n: int) -> float:
        started = time.perf_counter()
        futures = [engine.sample([1 + i % 100], 1, params) for i in range(n)]
        for f in futures:
            f.result(WAIT)
        return (time.perf_counter() - started) / n

    def run() -> dict:
        sim = {"backend": "sim", "max_num_seqs": 4096}
        with rle.Engine(rle.EngineConfig(**sim)) as local, \
                rle.Engine(rle.EngineConfig(**sim, placement=rle.Placement(kind="ray"))) as remote:
            seq = {"local": [], "ray": []}
            bur = {"local": [], "ray": []}
            sequential(local, 50), sequential(remote, 50), burst(local, 500), burst(remote, 500)
            for k in range(ROUNDS):
                for name, engine in ((("local", local), ("ray", remote)) if k % 2 == 0
                                     else (("ray", remote), ("local", local))):
                    seq[name].append(sequential(engine, 200))
                    bur[name].append(burst(engine, 2000))
        s = {k: statistics.median(v) * 1e6 for k, v in seq.items()}
        b = {k: statistics.median(v) * 1e6 for k, v in bur.items()}
        return {"sequential_local_us": s["local"], "sequential_ray_us": s["ray"],
                "sequential_added_us": s["ray"] - s["local"], "burst_local_us": b["local"], "burst_ray_us": b["ray"],
                "burst_added_us": b["ray"] - b["local"], "burst_ratio": b["ray"] / b["local"]}

    r = record(run)
    assert np.isfinite(r["burst_ratio"])
