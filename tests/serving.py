"""Test helper: N engines (async mode) and a ``Server`` on one uvloop loop in a thread.

That is how ``rlengine serve`` runs them (one loop, one compute thread per
replica). Tests drive it from the main thread through real sockets and
real subprocesses, and run code on the loop with ``on_loop`` (where the
session layer, the gate and the trace store live). Every wait is bounded.

What it must not do: fake any part of the server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

import rlengine as rle
from rlengine.core.engine import new_event_loop
from rlengine.serve import ServeConfig, Server

WAIT = 60.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sim_config(**sim: Any) -> rle.EngineConfig:
    """A sim engine whose turns last until ``max_tokens`` (like a model run with ignore_eos)."""
    return rle.EngineConfig(backend="sim", model_name="sim",
                            sim=rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.001, **sim}))


class Served:
    """Engines + server on a private loop thread; ``close`` stops everything (bounded)."""

    def __init__(self, configs: list[rle.EngineConfig], serve_config: ServeConfig | None = None) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="serve-test-loop", daemon=True)
        self.thread.start()
        self.engines: list[rle.Engine] = []
        self.server: Server | None = None
        try:
            self.run(self._start(configs, serve_config or ServeConfig()), 600)
        except BaseException:
            self.close()
            raise

    async def _start(self, configs: list[rle.EngineConfig], serve_config: ServeConfig) -> None:
        for cfg in configs:
            engine = rle.Engine(cfg)
            self.engines.append(engine)
            await engine.start_async()
        self.server = await Server(self.engines, serve_config).start_async()

    def run(self, coro: Any, timeout: float = WAIT) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop thread; its result (or exception) here."""
        async def call() -> Any:
            return fn(*args)

        return self.run(call())

    @property
    def sessions(self) -> Any:
        assert self.server is not None and self.server.sessions is not None
        return self.server.sessions

    @property
    def ipc_path(self) -> str:
        assert self.server is not None and self.server.ipc_path is not None
        return self.server.ipc_path

    @property
    def http_url(self) -> str:
        assert self.server is not None and self.server.http_url is not None
        return self.server.http_url

    def install(self, replica: int = 0, seed: int = 1) -> int:
        """Install new sim weights (a fresh theta) through the gate; returns the version."""
        engine = self.engines[replica]
        theta = np.random.default_rng(seed).normal(0.0, 1.0, engine.backend.vocab_size).astype(np.float32)
        return engine.install_weights(lambda: [("theta", theta)]).result(WAIT)

    def close(self) -> None:
        async def stop() -> None:
            if self.server is not None:
                await self.server.aclose(grace_s=0.5)
            for engine in self.engines:
                await engine.aclose(10.0)

        if self.loop.is_running():
            try:
                self.run(stop(), 60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def run_sandbox(code: str, *args: str, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process (a sandbox); ``sys.argv[1:]`` are ``args``."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
