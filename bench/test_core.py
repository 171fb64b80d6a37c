"""Control-plane benchmarks (pytest-benchmark); figures in bench/RESULTS.md.

Each benchmark measures its figure and its baseline in the same run (see
``rlengine.workloads``) and puts both, with the ratio, in
``benchmark.extra_info``; the assertion is on that same-run figure.

    OMP_NUM_THREADS=1 python -m pytest bench/test_core.py --benchmark-only -s
"""

from __future__ import annotations

from rlengine.workloads import continuous_vs_wave, control_plane_overhead

TARGET_US_PER_REQUEST = 15.0
"""Control-plane overhead per request on the zero-cost sim backend, at most."""
TARGET_LATENCY_RATIO = 3.0
"""Mean turn latency of batch waves over continuous sampling, at least."""


def test_control_plane_overhead_per_request(record):
    r = record(lambda: {**control_plane_overhead(n_requests=1000, gen_len=8, rounds=15),
                        "target_us_per_request": TARGET_US_PER_REQUEST})
    assert r["overhead_us_per_request"] <= TARGET_US_PER_REQUEST, r


def test_continuous_vs_wave_agents(record):
    r = record(lambda: {**continuous_vs_wave(), "target_latency_ratio": TARGET_LATENCY_RATIO})
    assert r["latency_ratio_wave_over_continuous"] >= TARGET_LATENCY_RATIO, r
    assert r["makespan_ratio_wave_over_continuous"] >= 1.0, r
