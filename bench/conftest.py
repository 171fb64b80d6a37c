"""Shared benchmark helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def record(benchmark) -> Callable[[Callable[[], dict[str, Any]]], dict[str, Any]]:
    """``record(fn)``: run the workload ``fn`` once under pytest-benchmark, keep the figures it
    returns (figure and same-run baseline) in ``extra_info``, print and return them."""

    def run(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        benchmark.pedantic(lambda: result.update(fn()), rounds=1, iterations=1)
        benchmark.extra_info.update(result)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})
        return result

    return run
