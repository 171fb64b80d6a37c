"""Test helper: N engines (async mode) and a ``Server`` on one uvloop loop in a thread.

That is how ``rlengine serve`` runs them (one loop, one compute thread per
replica). Tests drive it from the main thread through real sockets and
real subprocesses, and run code on the loop with ``on_loop`` (where the
session layer, the gate and the trace store live). Every wait is bounded.

What it must not do: fake any part of the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np

import rlengine as rle
from rlengine.pytest_plugin import LocalServer
from rlengine.serve import ServeConfig

WAIT = 60.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sim_config(**sim: Any) -> rle.EngineConfig:
    """A sim engine whose turns last until ``max_tokens`` (like a model run with ignore_eos)."""
    return rle.EngineConfig(backend="sim", model_name="sim",
                            sim=rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.001, **sim}))


class Served(LocalServer):
    """Engines + server on a private loop thread (the plugin's ``LocalServer``, which users'
    suites get too); ``close`` stops everything, bounded, giving turns in flight 0.5 s."""

    def __init__(self, configs: list[rle.EngineConfig], serve_config: ServeConfig | None = None) -> None:
        super().__init__(configs, serve_config or ServeConfig(), start_timeout_s=600)

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop thread; its result (or exception) here."""
        return self.call(fn, *args, timeout=WAIT)

    def install(self, replica: int = 0, seed: int = 1) -> int:
        """Install new sim weights (a fresh theta) through the gate; returns the version."""
        engine = self.engines[replica]
        theta = np.random.default_rng(seed).normal(0.0, 1.0, engine.backend.vocab_size).astype(np.float32)
        return engine.install_weights(lambda: [("theta", theta)]).result(WAIT)

    def close(self, grace_s: float | None = 0.5) -> None:
        super().close(grace_s)


def run_sandbox(code: str, *args: str, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process (a sandbox); ``sys.argv[1:]`` are ``args``."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
