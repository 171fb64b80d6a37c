"""GPU check of the torch backend and trainer on a ~0.5B Qwen2 model (run by bench/gpu_check.sh).

Builds a Qwen2-architecture model locally (Qwen2.5-0.5B's shape: hidden 896,
24 layers, 14 heads, 2 KV heads, vocab 151,936, tied embeddings; random init,
bf16) and measures, through the Engine:

* generation tokens/s with 64 concurrent requests;
* mean turn latency of 64 agents x 4 turns with heavy-tailed (lognormal)
  turn lengths, continuous sampling vs batch waves;
* one forward_backward (16 x 512 tokens, importance_sampling) + optim_step;
* tree training: a GRPO group of 8 x (1,024 shared prompt + 128 sampled
  tokens), seconds per forward_backward flat vs tree batches (two torch
  trainers outside the Engine), and their largest logprob difference;
* a weight install (trainer -> sampler, in-process), per MB;
* then the same through the vLLM backend, plus sleep/wake times, whenever
  vLLM is importable (the JSON says plainly when it is not).

Writes one JSON file of figures. ``--quick`` shrinks everything (tiny model,
few requests) so the script's logic can be checked on a CPU. It never
reaches the network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch

import rlengine as rle
from rlengine.backends.torch.models import build_tiny

QWEN2_05B = {"vocab_size": 2048, "model_vocab_size": 151_936, "hidden_size": 896, "num_layers": 24,
             "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864, "max_position_embeddings": 4096,
             "tie_word_embeddings": True, "init_std": 0.02, "dtype": "bfloat16"}
QUICK = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
         "intermediate_size": 128, "max_position_embeddings": 1024, "dtype": "float32"}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generation_throughput(engine: rle.Engine, n: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    sampler = engine.sampling_client()
    vocab = engine.backend.vocab_size
    prompts = rng.integers(3, vocab, (n, prompt_len)).tolist()
    params = rle.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1)
    for f in [sampler.sample(p, 1, rle.SamplingParams(max_tokens=8, seed=0)) for p in prompts]:
        f.result(600)  # warm-up: allocations, kernels
    rounds = []
    for _ in range(2):
        t0 = time.perf_counter()
        futures = [sampler.sample(p, 1, params) for p in prompts]
        tokens = sum(f.result(600).sequences[0].length for f in futures)
        rounds.append((tokens, time.perf_counter() - t0))
    tokens, wall = min(rounds, key=lambda r: r[1] / r[0])
    return {"concurrent_requests": n, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
            "generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def _agents(engine: rle.Engine, n_agents: int, n_turns: int, median: int, cap: int) -> tuple[list[float], float]:
    sampler = engine.sampling_client()
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    vocab = engine.backend.vocab_size

    async def agent(a: int) -> None:
        rng = random.Random(a)
        prompt = [rng.randrange(3, vocab) for _ in range(64)]
        for turn in range(n_turns):
            # Heavy-tailed turn lengths: a lognormal with sigma 1 (seeded, the same in both modes).
            length = max(1, min(cap, round(rng.lognormvariate(math.log(median), 1.0))))
            t0 = loop.time()
            resp = await sampler.sample_async(prompt, 1, rle.SamplingParams(max_tokens=length, seed=a * 100 + turn))
            latencies.append(loop.time() - t0)
            prompt = prompt + resp.sequences[0].tokens[:8] + [rng.randrange(3, vocab) for _ in range(8)]

    t0 = loop.time()
    await asyncio.gather(*(agent(a) for a in range(n_agents)))
    return latencies, loop.time() - t0


def continuous_vs_wave(config: rle.EngineConfig, n_agents: int, n_turns: int, median: int,
                       cap: int) -> dict[str, Any]:
    out: dict[str, Any] = {"agents": n_agents, "turns": n_turns, "turn_tokens_median": median, "turn_tokens_cap": cap}
    for mode, continuous in (("continuous", True), ("wave", False)):
        async def run(continuous: bool = continuous) -> tuple[list[float], float]:
            cfg = rle.EngineConfig(**{**_fields(config), "continuous_sampling": continuous})
            async with rle.Engine(cfg) as engine:
                await _agents(engine, 4, 1, 4, 8)  # warm-up
                return await _agents(engine, n_agents, n_turns, median, cap)

        latencies, makespan = asyncio.run(run())
        out[f"{mode}_mean_turn_s"] = statistics.fmean(latencies)
        out[f"{mode}_makespan_s"] = makespan
    out["latency_ratio_wave_over_continuous"] = out["wave_mean_turn_s"] / out["continuous_mean_turn_s"]
    return out


def _fields(config: rle.EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__struct_fields__}


def train_step(engine: rle.Engine, batch: int, seq_len: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    vocab = engine.backend.vocab_size
    data = []
    for _ in range(batch):
        seq = rng.integers(3, vocab, seq_len + 1)
        data.append(rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
            "target_tokens": seq[1:].astype(np.int64),
            "logprobs": np.full(seq_len, -math.log(vocab), dtype=np.float32),
            "advantages": rng.standard_normal(seq_len).astype(np.float32)}))
    client = engine.training_client()
    times, fb_times = [], []
    for i in range(3):
        _sync()
        t0 = time.perf_counter()
        client.forward_backward(data, "importance_sampling").result(600)
        t1 = time.perf_counter()
        client.optim_step(rle.AdamParams(learning_rate=1e-6, grad_clip_norm=1.0)).result(600)
        _sync()
        if i:  # the first step allocates optimizer state
            fb_times.append(t1 - t0)
            times.append(time.perf_counter() - t0)
    return {"batch": batch, "seq_len": seq_len, "loss_fn": "importance_sampling",
            "forward_backward_s": statistics.median(fb_times),
            "forward_backward_plus_optim_step_s": statistics.median(times),
            "train_tokens_per_s": batch * seq_len / statistics.median(times)}


def weight_install(engine: rle.Engine) -> dict[str, Any]:
    client = engine.training_client()
    client.save_weights_for_sampler().result(600)
    # What goes into the sampler: the trainer's named tensors (converted to the sampler's dtype on the way).
    mb = sum(t.numel() * t.element_size() for _, t in engine.get_trainer().sampler_weights()) / 2**20
    times = []
    for _ in range(3):
        _sync()
        t0 = time.perf_counter()
        client.save_weights_for_sampler().result(600)
        _sync()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"sampler_weights_mb": mb, "install_s": t, "install_ms_per_mb": t * 1e3 / mb}


def tree_training(path: str, spec: dict[str, Any], quick: bool) -> dict[str, Any]:
    """A GRPO group, 8 x (1,024 shared prompt + 128 sampled tokens), through two torch trainers on
    the device: seconds per forward_backward on the flat path (``tree_min_prefix=0``) and with
    tree batches, in alternating rounds, and the largest logprob difference between the two."""
    from rlengine.trainer.torch_trainer import TorchTrainer

    group, prompt_len, sampled, min_prefix = (4, 64, 16, 16) if quick else (8, 1024, 128, 64)
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, spec["vocab_size"], prompt_len)
    data = []
    for _ in range(group):
        seq = np.concatenate([prompt, rng.integers(3, spec["vocab_size"], sampled)])
        n = seq.shape[0] - 1
        data.append(rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1].tolist()), loss_fn_inputs={
            "target_tokens": seq[1:].astype(np.int64),
            "logprobs": np.full(n, -math.log(spec["vocab_size"]), dtype=np.float32),
            "advantages": ((np.arange(n) >= prompt_len - 1) * rng.standard_normal()).astype(np.float32)}))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainers = {name: TorchTrainer(path, device=device, compute_dtype=getattr(torch, spec["dtype"]),
                                   tree_min_prefix=prefix) for name, prefix in (("flat", 0), ("tree", min_prefix))}
    times: dict[str, list[float]] = {"flat": [], "tree": []}
    logprobs = {}
    for k in range(4):
        for name in (("flat", "tree") if k % 2 else ("tree", "flat")):
            trainers[name].model.zero_grad(set_to_none=True)
            _sync()
            t0 = time.perf_counter()
            out = trainers[name].forward_backward(data, "importance_sampling", (0.0, math.inf))
            _sync()
            if k:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
            logprobs[name] = np.concatenate([r["logprobs"].to_numpy() for r in out.loss_fn_outputs])
    flat_s, tree_s = statistics.median(times["flat"]), statistics.median(times["tree"])
    packed = sum(tree.tokens.shape[0] for _, tree in trainers["tree"]._plan(data))
    return {"group": group, "prompt": prompt_len, "sampled": sampled, "packed_tokens": packed,
            "dtype": spec["dtype"], "flat_forward_backward_s": flat_s, "tree_forward_backward_s": tree_s,
            "ratio_flat_over_tree": flat_s / tree_s,
            "max_abs_logprob_diff": float(np.abs(logprobs["flat"] - logprobs["tree"]).max())}


def sleep_wake(engine: rle.Engine) -> dict[str, Any]:
    """vLLM sleep mode around a (no-op) blocking item: what colocation costs per training call."""
    backend = engine.backend
    if not backend.capabilities.sleep:
        return {"supported": False, "why": backend.capabilities.why_not_sleep}
    times = []
    for _ in range(3):
        _sync()
        t0 = time.perf_counter()
        engine.submit_blocking("forward", lambda: None).result(600)
        _sync()
        times.append(time.perf_counter() - t0)
    return {"supported": True, "blocking_item_with_sleep_and_wake_s": statistics.median(times),
            **backend.describe()}


def vllm_figures(path: str, spec: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The same measurements through the vLLM backend, plus sleep and wake times."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"run": False, "why": "vLLM is not importable on this machine"}
    out: dict[str, Any] = {"run": True}
    config = rle.EngineConfig(model=path, backend="vllm", dtype=spec["dtype"], max_num_seqs=64)
    t0 = time.perf_counter()
    with rle.Engine(config) as engine:
        out["engine_start_s"] = time.perf_counter() - t0
        steps = [
            ("generation", lambda: generation_throughput(engine, 64 if not quick else 8, 128, 256 if not quick else 16)),
            ("train_step", lambda: train_step(engine, 16 if not quick else 2, 512 if not quick else 32)),
            ("weight_install", lambda: weight_install(engine)),
            ("sleep_wake", lambda: sleep_wake(engine)),
        ]
        for name, step in steps:
            t0 = time.perf_counter()
            out[name] = step()
            print(f"vllm {name}: {out[name]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    out["continuous_vs_wave"] = continuous_vs_wave(config, 64 if not quick else 8, 4 if not quick else 2,
                                                   32 if not quick else 4, 512 if not quick else 32)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON file of figures to write")
    parser.add_argument("--model-dir", default=None,
                        help="build the model here (default: a temporary directory, removed afterwards)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and small workloads: checks the script's logic on a CPU in seconds")
    args = parser.parse_args(argv)

    figures: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "quick": args.quick,
    }
    import transformers

    figures["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory(prefix="rlengine-gpu-check-") as tmp:
        path = args.model_dir or os.path.join(tmp, "qwen2-0.5b-random")
        spec = QUICK if args.quick else QWEN2_05B
        t0 = time.perf_counter()
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_tiny(path, **spec)
        figures["model"] = {**spec, "build_s": time.perf_counter() - t0}
        config = rle.EngineConfig(model=path, backend="torch", dtype=spec["dtype"], max_num_seqs=64)
        t0 = time.perf_counter()
        with rle.Engine(config) as engine:
            figures["engine_start_s"] = time.perf_counter() - t0
            figures["backend"] = engine.backend.describe()
            figures["model"]["parameters"] = sum(p.numel() for p in engine.backend.model.parameters())
            steps = [
                ("generation", lambda: generation_throughput(engine, 64 if not args.quick else 8, 128,
                                                             256 if not args.quick else 16)),
                ("train_step", lambda: train_step(engine, 16 if not args.quick else 2, 512 if not args.quick else 32)),
                ("weight_install", lambda: weight_install(engine)),
            ]
            for name, step in steps:
                t0 = time.perf_counter()
                figures[name] = step()
                print(f"{name}: {figures[name]} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if torch.cuda.is_available():
            figures["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        t0 = time.perf_counter()
        figures["tree_training"] = tree_training(path, spec, args.quick)
        print(f"tree_training: {figures['tree_training']} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        figures["continuous_vs_wave"] = continuous_vs_wave(config, 64 if not args.quick else 8, 4 if not args.quick
                                                           else 2, 32 if not args.quick else 4,
                                                           512 if not args.quick else 32)
        print(f"continuous_vs_wave: {figures['continuous_vs_wave']} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            figures["vllm"] = vllm_figures(path, spec, args.quick)
        except Exception as exc:  # noqa: BLE001 - report it and keep the torch figures
            figures["vllm"] = {"run": False, "why": f"failed: {exc!r}"}
        print(f"vllm: {'ran' if figures['vllm']['run'] else figures['vllm']['why']}", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
