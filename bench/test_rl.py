"""RL loop benchmarks (pytest-benchmark); figures in bench/RESULTS.md.

* **copy recipe to 0.9**: ``rlengine train copy`` with its defaults, one run
  per seed (0, 1, 2, 3): the first step whose mean training reward reaches
  0.9, and the RL wall time to it (``time_s`` of that step: counted from the
  loop's start, after the model is built and the engine is up), plus the
  first step's reward (a random model: about 0.02).
* **sync vs async**: the copy recipe for 40 steps with
  ``max_steps_off_policy`` 0 and 1, rounds alternating (3 each), medians of
  steps/s over steps 2-40 (the first includes warm-up); the ratio async /
  sync is measured in one run of this file. The same runs give the share of
  each step's wall time in which the sampler ran no backend step (the
  engine's ``busy_s`` counter), median over steps.
* **cost of dumping**: the copy recipe for 40 steps without and with
  ``dump_rollouts``, rounds alternating (3 each), medians of steps/s over
  steps 2-40 and their ratio, the bytes written per step (mean step file),
  and, from each round's dumps, ``train_from`` steps/s (training alone,
  nothing sampled).
* **guess recipe**: ``rlengine train guess`` with its defaults (every game
  in a sandbox process over IPC), seed 0: mean reward over the first and
  last 10 steps, the held-out evaluations (each digit once, greedy), the
  failed attempts, seconds per step and the sampler-vs-trainer KL of the
  traced tokens.

    OMP_NUM_THREADS=1 python -m pytest bench/test_rl.py --benchmark-only -s
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest

from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train

SEEDS = (0, 1, 2, 3)
ROUNDS = 3
STEPS = 40


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rlengine-bench-cache"))


def run_copy(path, cache: str, **settings) -> list[dict]:
    outcome = train("copy", {"cache_dir": cache, "backend": "torch", "checkpoint_every": "0",
                             **{k: str(v) for k, v in settings.items()}}, run_dir=str(path))
    assert outcome.error is None, outcome.error
    return read_jsonl(outcome.metrics_path)


def to_target(steps: list[dict], target: float) -> dict:
    """A run's figures: its first reward, the first step (and RL time) with mean reward >= target,
    its last five steps' mean reward and its median seconds per step."""
    hit = next((s for s in steps if s["reward_mean"] >= target), None)
    return {"first_reward": steps[0]["reward_mean"],
            f"step_to_{target}": hit["step"] if hit else None,
            f"seconds_to_{target}": round(hit["time_s"], 1) if hit else None,
            "final_reward_last5": round(statistics.mean(s["reward_mean"] for s in steps[-5:]), 3),
            "seconds_per_step_median": round(statistics.median(s["step_time_s"] for s in steps), 3)}


def per_seed(benchmark, run) -> dict:
    """``run(seed)`` for every seed of ``SEEDS``, once, under pytest-benchmark; the figures by seed."""
    results: dict = {}
    benchmark.pedantic(lambda: results.update({seed: run(seed) for seed in SEEDS}), rounds=1, iterations=1)
    benchmark.extra_info["per_seed"] = results
    print()
    for seed, r in results.items():
        print(f"seed {seed}: {r}")
    return results


def test_copy_recipe_steps_and_time_to_target(benchmark, tmp_path, cache):
    results = per_seed(benchmark, lambda seed: to_target(run_copy(tmp_path / f"seed{seed}", cache, seed=seed), 0.9))
    assert all(r["first_reward"] < 0.2 for r in results.values())


def test_sync_vs_async_steps_per_second(benchmark, tmp_path, cache):
    rates: dict[int, list[float]] = {0: [], 1: []}
    idle: dict[int, list[float]] = {0: [], 1: []}

    def rounds() -> None:
        for r in range(ROUNDS):
            for ahead in (0, 1):
                steps = run_copy(tmp_path / f"r{r}-k{ahead}", cache, steps=STEPS, eval_every=0,
                                 max_steps_off_policy=ahead)
                span = steps[-1]["time_s"] - steps[0]["time_s"]
                rates[ahead].append((len(steps) - 1) / span)
                idle[ahead].append(statistics.median(s["sampler_idle_frac"] for s in steps[1:]))

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    sync, async_ = statistics.median(rates[0]), statistics.median(rates[1])
    info = {"sync_steps_per_s": round(sync, 3), "async_steps_per_s": round(async_, 3),
            "ratio_async_over_sync": round(async_ / sync, 3),
            "sampler_idle_sync": round(statistics.median(idle[0]), 3),
            "sampler_idle_async": round(statistics.median(idle[1]), 3),
            "rounds": {"sync": [round(x, 3) for x in rates[0]], "async": [round(x, 3) for x in rates[1]]}}
    benchmark.extra_info.update(info)
    print()
    print(info)


def steps_per_second(steps: list[dict]) -> float:
    return (len(steps) - 1) / (steps[-1]["time_s"] - steps[0]["time_s"])


def test_dump_rollouts_cost(record, tmp_path, cache):
    def rounds() -> dict:
        rates: dict[str, list[float]] = {"plain": [], "dump": [], "train_from": []}
        sizes: list[int] = []
        for r in range(ROUNDS):
            rates["plain"].append(steps_per_second(run_copy(tmp_path / f"r{r}-plain", cache, steps=STEPS,
                                                            eval_every=0)))
            dumps = tmp_path / f"r{r}-dumps"
            rates["dump"].append(steps_per_second(run_copy(tmp_path / f"r{r}-dump", cache, steps=STEPS,
                                                           eval_every=0, dump_rollouts=dumps)))
            sizes += [p.stat().st_size for p in Path(dumps).glob("step-*.msgpack")]
            outcome = train(None, {"train_from": str(dumps)}, run_dir=str(tmp_path / f"r{r}-replay"))
            assert outcome.error is None, outcome.error
            rates["train_from"].append(steps_per_second(read_jsonl(outcome.metrics_path)))
        plain, dump = statistics.median(rates["plain"]), statistics.median(rates["dump"])
        return {"plain_steps_per_s": plain, "dump_steps_per_s": dump, "ratio_dump_over_plain": dump / plain,
                "train_from_steps_per_s": statistics.median(rates["train_from"]),
                "bytes_per_step": statistics.mean(sizes),
                "rounds": {k: [round(x, 3) for x in v] for k, v in rates.items()}}

    record(rounds)


def test_guess_recipe_through_sandboxes(benchmark, tmp_path, cache):
    result = {}

    def run() -> None:
        outcome = train("guess", {"cache_dir": cache, "backend": "torch", "checkpoint_every": "0"},
                        run_dir=str(tmp_path / "guess"))
        assert outcome.error is None, outcome.error
        steps = read_jsonl(outcome.metrics_path)
        evals = read_jsonl(str(tmp_path / "guess" / "eval.jsonl"))
        result.update({
            "steps": len(steps),
            "reward_first10": round(statistics.mean(s["reward_mean"] for s in steps[:10]), 3),
            "reward_last10": round(statistics.mean(s["reward_mean"] for s in steps[-10:]), 3),
            "eval": [(e["step"], round(e["reward_mean"], 2)) for e in evals],
            "turns_first10": round(statistics.mean(s["env/turns"] for s in steps[:10]), 2),
            "turns_last10": round(statistics.mean(s["env/turns"] for s in steps[-10:]), 2),
            "invalid_first10": round(statistics.mean(s["env/invalid"] for s in steps[:10]), 3),
            "invalid_last10": round(statistics.mean(s["env/invalid"] for s in steps[-10:]), 3),
            "attempts_failed": sum(s["attempts_failed"] for s in steps),
            "kl_sample_train_max": max(s.get("kl_sample_train_v1", 0.0) for s in steps),
            "seconds_per_step_median": round(statistics.median(s["step_time_s"] for s in steps), 3),
            "rl_seconds": round(steps[-1]["time_s"], 1)})

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print()
    print(result)
    assert result["attempts_failed"] == 0
    assert result["kl_sample_train_max"] < 1e-4


def test_tools_recipe_steps_and_time_to_target(benchmark, tmp_path, cache):
    def run(seed: int) -> dict:
        outcome = train("tools", {"cache_dir": cache, "checkpoint_every": "0", "eval_every": "0",
                                  "seed": str(seed)}, run_dir=str(tmp_path / f"tools{seed}"))
        assert outcome.error is None, outcome.error
        steps = read_jsonl(outcome.metrics_path)
        return {**to_target(steps, 0.8), "called_step10": round(steps[9]["env/called"], 2), "run_dir": outcome.run_dir}

    results = per_seed(benchmark, run)
    assert all(r["first_reward"] < 0.2 for r in results.values())


EPISODES = 256


def test_http_vs_ipc_agent_episode_overhead(record, cache):
    """The tools game, untrained model, 256 episodes 64 at a time on two sandbox workers: the openai
    client over HTTP (``HttpAgentEnv``), the same requests with a bare aiohttp client, and token
    turns over IPC (``SessionEnv``); the same tokens every way. Rounds alternate (3 each)."""
    import asyncio
    import time

    from rlengine.core.engine import Engine
    from rlengine.rl.agents import HttpAgentEnv
    from rlengine.rl.config import TrainConfig
    from rlengine.rl.recipes.tools import AGENT_MODULE, RECIPE, MeterCalls, ToolsOptions
    from rlengine.rl.sandbox import SandboxPool, SessionEnv
    from rlengine.serve import ServeConfig, Server
    from rlengine.types import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0)

    async def episodes(make) -> float:
        gate = asyncio.Semaphore(64)

        async def one(i: int):
            async with gate:
                t = await make(i).run(params, i, 2)
                assert t.transitions

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(EPISODES)))
        return (time.perf_counter() - t0) / EPISODES

    async def main() -> dict:
        config = TrainConfig(cache_dir=cache, max_tokens=1, max_turns=2, backend="torch")
        times: dict[str, list[float]] = {"http": [], "aiohttp": [], "ipc": []}
        async with Engine(RECIPE.engine_config(config, ToolsOptions())) as engine, \
                Server(engine, ServeConfig(tool_parser=MeterCalls.name, max_in_flight=4096)) as server, \
                SandboxPool(AGENT_MODULE, 2, job_timeout_s=60) as http_pool, \
                SandboxPool(AGENT_MODULE, 2, job_timeout_s=60) as ipc_pool:
            await http_pool.start(None)
            await ipc_pool.start(server.ipc_path)
            make = {"http": lambda i: HttpAgentEnv(http_pool, server, {"reading": i % 10}),
                    "aiohttp": lambda i: HttpAgentEnv(http_pool, server, {"reading": i % 10, "client": "aiohttp"}),
                    "ipc": lambda i: SessionEnv(ipc_pool, server.sessions, {"reading": i % 10})}
            for kind in times:  # warm-up: imports, first connections
                await episodes(make[kind])
            for _ in range(ROUNDS):
                for kind, got in times.items():
                    got.append(await episodes(make[kind]))
        http, bare, ipc = (statistics.median(times[k]) for k in ("http", "aiohttp", "ipc"))
        return {"http_ms_per_episode": 1000 * http, "aiohttp_ms_per_episode": 1000 * bare,
                "ipc_ms_per_episode": 1000 * ipc, "ratio_http_over_ipc": http / ipc,
                "ratio_aiohttp_over_ipc": bare / ipc,
                "rounds_ms": {k: [round(1000 * x, 2) for x in v] for k, v in times.items()}}

    record(lambda: asyncio.run(main()))


CORRECTIONS = {"none": {}, "tis": {"tis_cap": 2.0}, "mis": {"mis_cap": 2.0},
               "icepop": {"icepop_low": 0.5, "icepop_high": 2.0}, "geo_mask": {"geo_mask_low": 0.5, "geo_mask_high": 2.0},
               "zero_mismatch": {"logprobs_source": "trainer"}}


def test_offpolicy_correction_cost_per_step(record, tmp_path, cache):
    """The copy recipe for 40 steps with each correction and with the zero-mismatch mode, rounds
    alternating (3 each): medians over steps 2-40 of seconds per step and of training seconds per
    step (the recompute forward pass is training time), and each against ``none`` in the same run."""
    def rounds() -> dict:
        step_s: dict[str, list[float]] = {k: [] for k in CORRECTIONS}
        train_s: dict[str, list[float]] = {k: [] for k in CORRECTIONS}
        for r in range(ROUNDS):
            for name, settings in CORRECTIONS.items():
                steps = run_copy(tmp_path / f"r{r}-{name}", cache, steps=STEPS, eval_every=0, **settings)[1:]
                step_s[name].append(statistics.median(s["step_time_s"] for s in steps))
                train_s[name].append(statistics.median(s["train_time_s"] for s in steps))
        out: dict = {}
        base_step, base_train = statistics.median(step_s["none"]), statistics.median(train_s["none"])
        for name in CORRECTIONS:
            step, train_ = statistics.median(step_s[name]), statistics.median(train_s[name])
            out[name] = {"step_s": round(step, 4), "train_s": round(train_, 4),
                         "step_ratio_vs_none": round(step / base_step, 3),
                         "train_ratio_vs_none": round(train_ / base_train, 3),
                         "rounds_step_s": [round(x, 4) for x in step_s[name]]}
        return out

    record(rounds)


def test_mismatch_metrics_cost_per_step(record):
    """The mismatch metrics of one copy step (256 sequences of 6 sampled tokens: KL k1/k2/k3,
    log-ppl difference, ratios, per-token staleness), timed in process: median of 200 calls."""
    import time

    import numpy as np

    from rlengine.rl.mismatch import mismatch_metrics, token_staleness

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(-1, 0.5, 6), rng.normal(-1, 0.5, 6)) for _ in range(256)]
    versions = [np.r_[np.full(4, -1), np.full(6, 3)] for _ in range(256)]

    def rounds() -> dict:
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            mismatch_metrics(pairs)
            token_staleness(versions, 4)
            times.append(time.perf_counter() - t0)
        return {"metrics_ms_per_step": round(1e3 * statistics.median(times), 3)}

    record(rounds)


def test_copy_time_to_target_with_tis_on_and_off(benchmark, tmp_path, cache):
    """The copy recipe's defaults per seed for 150 steps (every seed reached 0.9 by step 110 before),
    TIS off (as shipped) and on (``tis_cap=2``): step and RL time to a mean reward of 0.9, the
    share of tokens TIS truncated and the recomputed sampler-vs-trainer KL; off and on alternate."""
    def run(seed: int) -> dict:
        out = {}
        for name, settings in (("off", {}), ("tis", {"tis_cap": 2.0})):
            steps = run_copy(tmp_path / f"seed{seed}-{name}", cache, seed=seed, steps=150, eval_every=0, **settings)
            out[name] = to_target(steps, 0.9)
            if name == "tis":
                out[name] |= {"is_truncated_frac_max": max(s["is_truncated_frac"] for s in steps),
                              "recomputed_k3_max": max(s["recomputed_k3"] for s in steps)}
        return out

    per_seed(benchmark, run)
