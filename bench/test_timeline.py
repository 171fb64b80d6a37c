"""Timeline overhead (pytest-benchmark): the core-engine workload with the timeline on vs off.

The control-plane workload of ``bench/test_core.py`` (1,000 concurrent one-sample requests of 8
tokens on the zero-cost sim backend, from a user thread) on one engine, whose timeline is switched
on and off between rounds (``Engine.timeline``): an interleaved A/B in one process.

**The statistic.** A round's CPU time (all threads) moves by +-10% between two rounds on a shared
machine, five times the 2% target, so no single round, and no ratio of two arms' medians over a
run, decides it (one run's ratio of medians ranged from -1.1% to +5.8%). The rounds come in
pairs of blocks, ABBA (on, off, off, on; the next pair off, on, on, off): a drift inside the pair
cancels, and each arm's figure in the pair is the lower of its two rounds, so that a round a
neighbour's burst slowed (which only ever adds time) is left out. A pair's figure is the ratio of
its arms; the figure asserted is the **median of the pairs' ratios** (``PAIRS`` of them, at least
10): a burst, or a slow stretch, moves a few pairs, not the median. ``extra_info`` carries it
with its 90% bootstrap interval, the ratio of the arms' medians for comparison, and every pair's
(on, off) CPU microseconds per request.

Each round starts after a full garbage collection (the previous round's garbage is not charged to
the next, whichever arm it is), and each "on" round records into a fresh timeline, so that every
request of it is recorded: a timeline kept across rounds would reach its cap and then record one
request in 2, 4, ... (its stride), cheaper than what a run pays before the cap.

    OMP_NUM_THREADS=1 python -m pytest bench/test_timeline.py --benchmark-only -s

``RLENGINE_BENCH_TIMELINE_PAIRS=N`` runs N pairs instead (a short try: 20; at least 10).
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from array import array
from typing import Any

from rlengine.config import EngineConfig, SimConfig
from rlengine.core.engine import Engine
from rlengine.timeline import Timeline
from rlengine.types import ModelInput, SamplingParams

TARGET_OVERHEAD = 0.02
"""The timeline on costs at most this share of the engine's CPU time per request."""
N_REQUESTS, GEN_LEN = 1000, 8
PAIRS = 100
"""ABBA pairs by default, four rounds each (20 pairs took 15 s on 2 vCPUs, one of them busy with
another process: 100, about 75 s)."""
MIN_PAIRS = 10
PAIRS_ENV = "RLENGINE_BENCH_TIMELINE_PAIRS"


def _round(engine: Engine, inputs: list[ModelInput], params: SamplingParams) -> tuple[float, float]:
    """One round: every request submitted, then every result awaited; (wall, CPU) seconds."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    futures = [engine.sample(m, 1, params) for m in inputs]
    for f in futures:
        f.result(60)
    return time.perf_counter() - t0, time.process_time() - c0


def _pairs_setting() -> int:
    raw = os.environ.get(PAIRS_ENV, str(PAIRS))
    try:
        pairs = int(raw)
    except ValueError:
        pairs = 0
    if pairs < MIN_PAIRS:
        raise ValueError(f"{PAIRS_ENV}={raw!r}: must be an integer >= {MIN_PAIRS}")
    return pairs


def _interval(ratios: list[float], level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """The ``level`` bootstrap interval of the median of ``ratios`` (a fixed seed: the same data, the
    same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return medians[int(tail * resamples)], medians[int((1.0 - tail) * resamples) - 1]


def timeline_overhead(pairs: int = PAIRS) -> dict[str, Any]:
    params = SamplingParams(max_tokens=GEN_LEN)
    inputs = [ModelInput(tokens_raw=array("i", [1 + i % 100, 2, 3, 4]).tobytes()) for i in range(N_REQUESTS)]
    # Per pair and arm, its two rounds' (wall, CPU) seconds.
    on_s: list[list[tuple[float, float]]] = [[] for _ in range(pairs)]
    off_s: list[list[tuple[float, float]]] = [[] for _ in range(pairs)]
    events = 0
    with Engine(EngineConfig(backend="sim", sim=SimConfig(gen_len=GEN_LEN, max_num_seqs=N_REQUESTS))) as engine:
        for state in (Timeline(), None):  # warm-up, both ways
            engine.timeline = state
            _round(engine, inputs, params)
        for pair in range(pairs):
            for on in ((True, False, False, True) if pair % 2 == 0 else (False, True, True, False)):
                engine.timeline = Timeline() if on else None
                (on_s if on else off_s)[pair].append(_round(engine, inputs, params))
                if on:
                    events = len(engine.timeline)
        engine.timeline = None
    out: dict[str, Any] = {"n_requests": N_REQUESTS, "gen_len": GEN_LEN, "pairs": pairs,
                           "events_per_on_round": events}
    for i, clock in enumerate(("wall", "cpu")):
        on = [min(r[i] for r in rounds) for rounds in on_s]
        off = [min(r[i] for r in rounds) for rounds in off_s]
        ratios = [a / b - 1.0 for a, b in zip(on, off)]
        low, high = _interval(ratios)
        every_on = statistics.median(r[i] for rounds in on_s for r in rounds)
        every_off = statistics.median(r[i] for rounds in off_s for r in rounds)
        out |= {f"paired_overhead_{clock}_median": statistics.median(ratios),
                f"paired_overhead_{clock}_interval_90": [low, high],
                f"overhead_{clock}_ratio_of_medians": every_on / every_off - 1.0,
                f"on_{clock}_us_per_request": every_on / N_REQUESTS * 1e6,
                f"off_{clock}_us_per_request": every_off / N_REQUESTS * 1e6}
        if clock == "cpu":
            out["pairs_cpu_us_per_request_on_off"] = [[round(a / N_REQUESTS * 1e6, 3), round(b / N_REQUESTS * 1e6, 3)]
                                                      for a, b in zip(on, off)]
    return out


def test_timeline_overhead(record):
    r = record(lambda: {**timeline_overhead(_pairs_setting()), "target_overhead": TARGET_OVERHEAD})
    assert r["paired_overhead_cpu_median"] < TARGET_OVERHEAD, r
