"""Benchmark workloads shared by ``bench/`` (pytest-benchmark) and ``rlengine bench``.

Each workload measures its figure *and* its baseline in the same run and
returns both with their ratio, because absolute times on a shared machine
drift; ratios measured side by side do not. What a figure must reach (the
pass/fail targets) lives with the benchmarks in ``bench/``, not here.

* ``control_plane_overhead``: 1,000 concurrent requests through the engine
  vs driving the same zero-cost sim backend directly; the difference per
  request is what the control plane costs.
* ``continuous_vs_wave``: 64 agents x 8 turns with lognormal generation
  lengths on a sim backend whose steps take simulated time; mean turn
  latency and makespan, continuous sampling vs batch waves, over three
  draws of the requests' seeds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from array import array
from typing import Any

from rlengine.backends.base import BackendRequest
from rlengine.backends.sim import SimBackend
from rlengine.config import EngineConfig, SimConfig
from rlengine.core.engine import Engine, new_event_loop
from rlengine.seeding import mix_seed
from rlengine.types import SamplingParams

__all__ = ["continuous_vs_wave", "control_plane_overhead", "run_all"]


def _direct_sim(cfg: SimConfig, prompts: list[bytes], params: SamplingParams) -> tuple[float, float]:
    """Drive a SimBackend by hand, keeping outputs as the engine does; (wall, CPU) seconds."""
    backend = SimBackend(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    acc: dict[str, tuple[array, array]] = {}
    for i, p in enumerate(prompts):
        rid = f"d{i}"
        acc[rid] = (array("i"), array("f"))
        backend.add_request(BackendRequest(request_id=rid, prompt=p, params=params, seed=i,
                                           max_tokens=params.max_tokens or 1, stream=False))
    while backend.has_unfinished_requests():
        for out in backend.step():
            toks, lps = acc[out.request_id]
            toks.extend(out.token_ids)
            lps.extend(out.logprobs)
    return time.perf_counter() - t0, time.process_time() - c0


def _engine_sim(engine: Engine, prompts: list[bytes], params: SamplingParams) -> tuple[float, float]:
    """The same requests through the engine from a user thread; (wall, CPU of all threads) seconds."""
    from rlengine.types import ModelInput

    inputs = [ModelInput(tokens_raw=p) for p in prompts]
    t0, c0 = time.perf_counter(), time.process_time()
    futures = [engine.sample(m, 1, params) for m in inputs]
    for f in futures:
        f.result(60)
    return time.perf_counter() - t0, time.process_time() - c0


def control_plane_overhead(n_requests: int = 1000, gen_len: int = 8, rounds: int = 7) -> dict[str, Any]:
    """Per-request control-plane cost: (engine time - direct backend time) / n."""
    cfg = SimConfig(gen_len=gen_len, max_num_seqs=n_requests)
    params = SamplingParams(max_tokens=gen_len)
    prompts = [array("i", [1 + i % 100, 2, 3, 4]).tobytes() for i in range(n_requests)]
    engine_s, direct_s = [], []
    with Engine(EngineConfig(backend="sim", sim=cfg)) as engine:
        _engine_sim(engine, prompts, params)  # warm-up
        for _ in range(rounds):
            direct_s.append(_direct_sim(cfg, prompts, params))
            engine_s.append(_engine_sim(engine, prompts, params))
    e, d = statistics.median(w for w, _ in engine_s), statistics.median(w for w, _ in direct_s)
    ec, dc = statistics.median(c for _, c in engine_s), statistics.median(c for _, c in direct_s)
    return {
        "n_requests": n_requests,
        "gen_len": gen_len,
        "engine_ms": e * 1e3,
        "direct_backend_ms": d * 1e3,
        "overhead_us_per_request": (e - d) / n_requests * 1e6,
        "overhead_cpu_us_per_request": (ec - dc) / n_requests * 1e6,
        "engine_us_per_request": e / n_requests * 1e6,
    }


async def _agents(engine: Engine, n_agents: int, n_turns: int, max_tokens: int,
                  draw: int) -> tuple[list[float], float]:
    sampler = engine.sampling_client()
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def agent(a: int) -> None:
        prompt = [1 + a % 200, 7, 9]
        for t in range(n_turns):
            t0 = loop.time()
            params = SamplingParams(max_tokens=max_tokens, seed=mix_seed(draw, a, t))
            resp = await sampler.sample_async(prompt, 1, params)
            latencies.append(loop.time() - t0)
            prompt = [1 + (a + t) % 200, *resp.sequences[0].tokens[:4], 5]

    t_start = loop.time()
    await asyncio.gather(*(agent(a) for a in range(n_agents)))
    return latencies, loop.time() - t_start


def continuous_vs_wave(n_agents: int = 64, n_turns: int = 8, gen_len: int = 8, sigma: float = 1.0,
                       step_time_s: float = 0.002, token_time_s: float = 2e-5,
                       max_tokens: int = 256, draws: int = 3) -> dict[str, Any]:
    """Mean turn latency and makespan of agents, continuous vs wave sampling.

    A wave lasts as long as its longest generation, so with heavy-tailed
    lengths one draw of the requests' seeds moves the wave figures a lot
    (the same code gave 3.4x and 5.3x under two seed derivations): each of
    ``draws`` draws runs both modes on the same seeds, and the figures are
    the medians over the draws (each draw's ratios are listed too).
    """
    sim = SimConfig(gen_len=gen_len, gen_len_dist="lognormal", gen_len_sigma=sigma,
                    step_time_s=step_time_s, token_time_s=token_time_s, max_num_seqs=1024)
    per_draw: list[dict[str, float]] = []
    for draw in range(draws):
        results = {}
        for mode, continuous in (("continuous", True), ("wave", False)):
            async def run(continuous: bool = continuous, draw: int = draw) -> tuple[list[float], float]:
                async with Engine(EngineConfig(backend="sim", sim=sim, continuous_sampling=continuous)) as engine:
                    return await _agents(engine, n_agents, n_turns, max_tokens, draw)

            loop = new_event_loop()
            try:
                latencies, makespan = loop.run_until_complete(run())
            finally:
                loop.close()
            results[mode] = (statistics.fmean(latencies), makespan)
        (c_lat, c_span), (w_lat, w_span) = results["continuous"], results["wave"]
        per_draw.append({"c_lat": c_lat, "w_lat": w_lat, "c_span": c_span, "w_span": w_span,
                         "lat_ratio": w_lat / c_lat, "span_ratio": w_span / c_span})

    def median(key: str) -> float:
        return statistics.median(d[key] for d in per_draw)

    return {
        "agents": n_agents,
        "turns": n_turns,
        "gen_len_median": gen_len,
        "sigma": sigma,
        "draws": draws,
        "continuous_mean_turn_ms": median("c_lat") * 1e3,
        "wave_mean_turn_ms": median("w_lat") * 1e3,
        "latency_ratio_wave_over_continuous": median("lat_ratio"),
        "latency_ratio_per_draw": [round(d["lat_ratio"], 3) for d in per_draw],
        "continuous_makespan_s": median("c_span"),
        "wave_makespan_s": median("w_span"),
        "makespan_ratio_wave_over_continuous": median("span_ratio"),
        "makespan_ratio_per_draw": [round(d["span_ratio"], 3) for d in per_draw],
    }


def vllm_overhead(config: EngineConfig, n_prompts: int = 64, max_tokens: int = 32,
                  rounds: int = 5) -> dict[str, Any]:
    """Throughput through rlengine vs driving the same ``LLMEngine`` directly.

    Both sides run the same prompts with the same per-request seeds and
    vLLM's ``FINAL_ONLY`` outputs; the direct drive runs on the engine's
    compute thread (as a blocking item), so it uses the very same engine
    and thread. Rounds alternate; the ratio is the median of per-round ratios.
    """
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts = [[1 + (7 * i + j) % 500 for j in range(8 + i % 24)] for i in range(n_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    with Engine(config) as engine:
        llm = engine.backend.llm_engine  # the very LLMEngine the backend steps

        def direct(tag: str) -> float:
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                vp = VSamplingParams(n=1, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=i,
                                     logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
                llm.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=p), vp)
            tokens = 0
            while llm.has_unfinished_requests():
                for out in llm.step():
                    tokens += len(out.outputs[0].token_ids)
            assert tokens == n_prompts * max_tokens
            return time.perf_counter() - t0

        def through_engine() -> float:
            sampler = engine.sampling_client()
            t0 = time.perf_counter()
            futures = [sampler.sample(p, 1, params) for p in prompts]
            tokens = sum(f.result(600).sequences[0].length for f in futures)
            assert tokens == n_prompts * max_tokens
            return time.perf_counter() - t0

        through_engine()  # warm-up
        direct_s, engine_s = [], []
        for r in range(rounds):
            direct_s.append(engine.submit_blocking("bench", lambda r=r: direct(f"d{r}")).result(600))
            engine_s.append(through_engine())
    ratios = [d / e for d, e in zip(direct_s, engine_s)]
    tokens = n_prompts * max_tokens
    return {
        "prompts": n_prompts,
        "max_tokens": max_tokens,
        "direct_tokens_per_s": tokens / statistics.median(direct_s),
        "engine_tokens_per_s": tokens / statistics.median(engine_s),
        "throughput_ratio_engine_over_direct": statistics.median(ratios),
    }


def run_all() -> dict[str, dict[str, Any]]:
    return {"control_plane_overhead": control_plane_overhead(), "continuous_vs_wave": continuous_vs_wave()}
