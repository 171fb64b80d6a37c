"""Multi-GPU check of the scale-out placement (run by bench/gpu_check_multi.sh).

On one node with G GPUs, a local Ray cluster is given every GPU. A ~0.5B
Qwen2-shaped model is built locally (gpu_check.py's shape, bf16, random
init). Through the Engine with ``Placement(kind="ray")``, the script measures:

* the sharded trainer: seconds per ``forward_backward`` + ``optim_step`` of
  16 x 512 tokens, on ``trainer_workers`` = 1, 2, ... G/2 (NCCL, one GPU each),
  and the largest loss difference from 1 worker;
* the weight sync from the sharded trainer to ``sampler_replicas`` = G/2
  replicas (one GPU each): seconds per install and per GB, and its parts;
* the ``copy`` recipe's RL steps/s with 1 and with G/2 sampler replicas.

Writes one JSON file of figures. ``--quick`` uses the tiny model, 2 trainer
workers and 2 replicas on the CPU (gloo), to check the script's logic on a
machine with no GPU. It never reaches the network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import ray
import torch

import rlengine as rle
from rlengine.backends.torch.models import build_tiny

QWEN2_05B = {"vocab_size": 151936, "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "intermediate_size": 4864, "max_position_embeddings": 4096, "tie_word_embeddings": True,
             "dtype": "bfloat16"}
QUICK = {"vocab_size": 1024, "hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "intermediate_size": 384, "max_position_embeddings": 2048, "dtype": "float32"}


def batch(vocab: int, count: int, length: int) -> list[rle.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        tokens = rng.integers(3, vocab, length + 1)
        n = length
        out.append(rle.Datum(model_input=rle.ModelInput.from_ints(tokens[:-1].tolist()),
                             loss_fn_inputs={"target_tokens": tokens[1:].astype(np.int64),
                                             "logprobs": np.full(n, -2.0, np.float32),
                                             "advantages": rng.normal(0, 1, n).astype(np.float32)}))
    return out


def placement(workers: int, replicas: int, gpu: bool) -> rle.Placement:
    unit = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
    return rle.Placement(kind="ray", trainer_workers=workers, sampler_replicas=replicas, replica_resources=unit,
                         trainer_resources=unit)


def trainer_steps(path: str, spec: dict[str, Any], workers: list[int], gpu: bool, quick: bool) -> dict[str, Any]:
    data = batch(spec["vocab_size"], 2 if quick else 16, 32 if quick else 512)
    out: dict[str, Any] = {"datums": len(data), "tokens_each": data[0].model_input.length}
    losses = {}
    for n in workers:
        config = rle.EngineConfig(model=path, backend="torch", dtype=spec["dtype"], placement=placement(n, 1, gpu))
        with rle.Engine(config) as engine:
            client = engine.training_client()
            times = []
            for _ in range(3):
                started = time.perf_counter()
                fb = client.forward_backward(data, "importance_sampling").result(1800)
                client.optim_step(rle.AdamParams(learning_rate=1e-6)).result(1800)
                times.append(time.perf_counter() - started)
            losses[n] = fb.metrics["loss:sum"]
            out[f"workers_{n}_step_s"] = statistics.median(times[1:])
            started = time.perf_counter()
            client.save_weights_for_sampler().result(1800)
            out[f"workers_{n}_install_s"] = time.perf_counter() - started
            out[f"workers_{n}_last_sync"] = engine.backend.last_sync
        print(f"trainer {n} worker(s): {out[f'workers_{n}_step_s']:.3f} s per step", flush=True)
    out["max_loss_diff_vs_1_worker"] = max(abs(v - losses[workers[0]]) for v in losses.values())
    return out


def weight_sync(path: str, spec: dict[str, Any], workers: int, replicas: int, gpu: bool) -> dict[str, Any]:
    config = rle.EngineConfig(model=path, backend="torch", dtype=spec["dtype"],
                              placement=placement(workers, replicas, gpu))
    with rle.Engine(config) as engine:
        client = engine.training_client()
        client.save_weights_for_sampler().result(1800)
        times, syncs = [], []
        for _ in range(3):
            started = time.perf_counter()
            client.save_weights_for_sampler().result(1800)
            times.append(time.perf_counter() - started)
            syncs.append(engine.backend.last_sync)
    gb = syncs[-1]["bytes"] / 2**30
    install = statistics.median(times)
    return {"trainer_workers": workers, "replicas": replicas, "gb": gb, "install_s": install,
            "s_per_gb": install / gb, "replicas_load_s": statistics.median(s["load_s"] for s in syncs)}


def copy_steps_per_s(replicas: list[int], workers: int, gpu: bool, quick: bool, cache: str) -> dict[str, Any]:
    from rlengine.rl.run import train

    out = {}
    for n in replicas:
        stamps: list[float] = []
        with tempfile.TemporaryDirectory() as run_dir:
            outcome = train("copy", {"steps": "6" if quick else "20", "eval_every": "0", "checkpoint_every": "0",
                                     "backend": "torch", "cache_dir": cache, "placement": "ray",
                                     "sampler_replicas": str(n), "trainer_workers": str(workers)},
                            run_dir=run_dir, on_step=lambda _, at=stamps: at.append(time.perf_counter()))
        if outcome.error is not None:
            raise outcome.error
        out[f"replicas_{n}_steps_per_s"] = (len(stamps) - 2) / (stamps[-1] - stamps[1])
        print(f"copy with {n} replica(s): {out[f'replicas_{n}_steps_per_s']:.2f} steps/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON file of figures to write")
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script's logic")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    gpu = gpus >= 2 and not args.quick
    half = max(1, gpus // 2) if gpu else 2
    cpus = os.cpu_count() or 2
    ray.init(num_cpus=max(cpus, 2 * half + 2), num_gpus=gpus if gpu else 0, include_dashboard=False,
             configure_logging=False, log_to_driver=False)
    figures: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "ray": ray.__version__, "gpus": gpus, "quick": args.quick,
                               "device": torch.cuda.get_device_name(0) if gpus else "cpu"}
    with tempfile.TemporaryDirectory(prefix="rlengine-gpu-multi-") as tmp:
        spec = QWEN2_05B if gpu else QUICK
        path = os.path.join(tmp, "model")
        build_tiny(path, **spec)
        figures["model"] = spec
        workers = sorted({1, 2, half}) if gpu else [1, 2]
        for name, step in (("trainer", lambda: trainer_steps(path, spec, workers, gpu, args.quick)),
                           ("weight_sync", lambda: weight_sync(path, spec, half, half, gpu)),
                           ("copy", lambda: copy_steps_per_s(sorted({1, half}), 1, gpu, args.quick, tmp))):
            started = time.perf_counter()
            try:
                figures[name] = step()
            except Exception as exc:  # noqa: BLE001 - report it and keep the other figures
                figures[name] = {"failed": repr(exc)}
            print(f"{name}: {figures[name]} ({time.perf_counter() - started:.1f} s)", flush=True)
    ray.shutdown()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
