"""A local Ray cluster for the scale-out tests, started here as a user would (``ray.init``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def cluster():
    """4 logical CPUs: room for 2 sampler replicas and 2 trainer workers at once."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
