"""Timeline overhead (pytest-benchmark): the core-engine workload with the timeline on vs off.

The control-plane workload of ``bench/test_core.py`` (1,000 concurrent one-sample requests of 8
tokens on the zero-cost sim backend, from a user thread) on one engine, whose timeline is switched
on and off between rounds (``Engine.timeline``): an interleaved A/B in one process, the order
alternating per pair (on-off, off-on, ...) so that drift cancels. Reported: the median wall time
and the median CPU time (all threads) per request of each, their ratios, and the medians of the
pairs' ratios. Target: on costs < 2% of the engine's CPU time per request (CPU time: on a shared
machine the wall time of a 15 ms round moves by more than that between two rounds).

    OMP_NUM_THREADS=1 python -m pytest bench/test_timeline.py --benchmark-only -s
"""

from __future__ import annotations

import statistics
import time
from array import array
from typing import Any

from rlengine.config import EngineConfig, SimConfig
from rlengine.core.engine import Engine
from rlengine.timeline import Timeline
from rlengine.types import ModelInput, SamplingParams

TARGET_OVERHEAD = 0.02
"""The timeline on costs at most this share of the engine's time per request."""
N_REQUESTS, GEN_LEN, PAIRS = 1000, 8, 15


def _round(engine: Engine, inputs: list[ModelInput], params: SamplingParams) -> tuple[float, float]:
    """One round: every request submitted, then every result awaited; (wall, CPU) seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    futures = [engine.sample(m, 1, params) for m in inputs]
    for f in futures:
        f.result(60)
    return time.perf_counter() - t0, time.process_time() - c0


def timeline_overhead(pairs: int = PAIRS) -> dict[str, Any]:
    params = SamplingParams(max_tokens=GEN_LEN)
    inputs = [ModelInput(tokens_raw=array("i", [1 + i % 100, 2, 3, 4]).tobytes()) for i in range(N_REQUESTS)]
    on_s: list[tuple[float, float]] = []
    off_s: list[tuple[float, float]] = []
    timeline = Timeline()
    with Engine(EngineConfig(backend="sim", sim=SimConfig(gen_len=GEN_LEN, max_num_seqs=N_REQUESTS))) as engine:
        for state in (timeline, None):  # warm-up, both ways
            engine.timeline = state
            _round(engine, inputs, params)
        for pair in range(pairs):
            for state in ((timeline, None) if pair % 2 == 0 else (None, timeline)):
                engine.timeline = state
                (on_s if state is not None else off_s).append(_round(engine, inputs, params))
    out: dict[str, Any] = {"n_requests": N_REQUESTS, "gen_len": GEN_LEN, "pairs": pairs}
    for i, clock in enumerate(("wall", "cpu")):
        on, off = statistics.median(r[i] for r in on_s), statistics.median(r[i] for r in off_s)
        out |= {f"on_{clock}_us_per_request": on / N_REQUESTS * 1e6, f"off_{clock}_us_per_request": off / N_REQUESTS * 1e6,
                f"overhead_{clock}": on / off - 1.0,
                f"paired_overhead_{clock}_median": statistics.median(a[i] / b[i] - 1.0 for a, b in zip(on_s, off_s))}
    return out | {"events_recorded": len(timeline), "stride": timeline.stride}


def test_timeline_overhead(record):
    r = record(lambda: {**timeline_overhead(), "target_overhead": TARGET_OVERHEAD})
    assert r["overhead_cpu"] < TARGET_OVERHEAD, r
