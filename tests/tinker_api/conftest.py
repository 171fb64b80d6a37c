"""Fixtures the Tinker API tests share: one torch engine, one checkpoint directory and one served Tinker
server (with an SDK client) per module, and the tinker-cookbook 0.6.1 install the version matrix runs
beside the venv's 0.5.8.

The project's cookbook tests run against both versions: 0.5.8 is installed in the venv (the RL
tests import it in-process), 0.6.1 in its own directory (``COOKBOOK_061_DIR``, default
``.cookbook-0.6.1`` in the repository, which ``make test`` fills: ``COOKBOOK_061_HINT``), and a test
that needs 0.6.1 runs its cookbook code in a subprocess with that directory first on ``PYTHONPATH``
(``cookbook061``). Without it the tests fail under RLENGINE_REQUIRE_ALL=1 (CI) and are skipped
otherwise, as a missing optional package is everywhere else.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

import rlengine as rle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COOKBOOK_061 = "0.6.1"
COOKBOOK_061_DIR = os.environ.get("RLENGINE_COOKBOOK061_DIR", os.path.join(REPO, ".cookbook-0.6.1"))
COOKBOOK_061_HINT = ("python -m pip install -q --upgrade --no-deps --target .cookbook-0.6.1 tinker-cookbook==0.6.1 "
                     "math-verify==0.9.0 pylatexenc==2.11 latex2sympy2_extended==1.11.0 "
                     "antlr4-python3-runtime==4.13.2 (in the repository root, as make test does; or point "
                     "RLENGINE_COOKBOOK061_DIR at such a directory)")


@pytest.fixture(scope="module")
def engine(engine_config):
    with rle.Engine(engine_config("torch")) as eng:
        yield eng


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tinker-ckpt"))


@pytest.fixture(scope="module")
def served(engine, ckpt_dir):
    """The module's engine with a Tinker server on its loop (real sockets), and an official SDK client of
    it: ``(engine, server, client)``."""
    tinker = pytest.importorskip("tinker")
    from rlengine.tinker_api import TinkerServerConfig, start

    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, max_models=8))
    client = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    try:
        yield engine, server, client
    finally:
        client.close("success").result(120.0)
        server.close()


def _missing(why: str) -> None:
    message = f"tinker-cookbook {COOKBOOK_061} is not usable from {COOKBOOK_061_DIR}: {why}; install it with: " \
              f"{COOKBOOK_061_HINT}"
    if os.environ.get("RLENGINE_REQUIRE_ALL") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def cookbook061() -> dict[str, str]:
    """The environment for a subprocess that runs tinker-cookbook 0.6.1: ``COOKBOOK_061_DIR`` first on
    ``PYTHONPATH``, checked to hold tinker-cookbook 0.6.1 (its installed metadata there; the recipes'
    imports are the subprocess's own first step, and their failure is its error)."""
    if not os.path.isdir(os.path.join(COOKBOOK_061_DIR, "tinker_cookbook")):
        _missing("no such install")
    found = [d.version for d in importlib.metadata.distributions(name="tinker-cookbook", path=[COOKBOOK_061_DIR])]
    if found != [COOKBOOK_061]:
        _missing(f"it holds tinker-cookbook {found or 'metadata of no version'}")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (COOKBOOK_061_DIR, os.environ.get("PYTHONPATH"))
                                                         if p)}
