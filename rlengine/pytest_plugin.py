"""A pytest plugin: fixtures that start rlengine engines and servers for a user's own test and latency suites.

pytest loads it (the ``pytest11`` entry point ``rlengine``; ``-p rlengine`` under
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``) in every test run of an environment where
rlengine is installed, so importing it must stay light: this module imports
pytest and the standard library only, and every fixture imports the engine,
the servers and the sandbox client when it runs.
Nothing here imports torch, numpy or the engine at plugin import time.

Fixtures (all function-scoped unless noted; every start and close is bounded)::

    rlengine_engine          factory: rlengine_engine(backend="sim", **EngineConfig overrides) -> Engine
    rlengine_sim_engine      a started sim engine (fast, no model)
    rlengine_torch_engine    a started torch engine on the tiny model
    rlengine_model_cache     (session) the cache directory the tiny model is built into, once
    rlengine_serve           factory: rlengine_serve(backend="sim", serve=..., **overrides) -> LocalServer
    rlengine_server          a LocalServer: a sim engine with IPC and HTTP (127.0.0.1, a free port, its
                             drawn API key on ``api_key``)
    rlengine_sandbox_client  a rlengine.sandbox_client.Client connected to rlengine_server

A latency test in a user's suite, with pytest-benchmark::

    def test_sample_latency(benchmark, rlengine_sim_engine):
        sampler = rlengine_sim_engine.sampling_client()
        benchmark(lambda: sampler.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=8)).result(10))

The tiny model is built locally (``EngineConfig(model="tiny")``); nothing is
ever downloaded. What this module must not do: fake any part of the engine or
the servers, or leave a thread, socket or engine running after a test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import asyncio

    from rlengine.config import EngineConfig
    from rlengine.core.engine import Engine
    from rlengine.sandbox_client import Client, Session
    from rlengine.serve import ServeConfig, Server, SessionManager

__all__ = ["CLOSE_TIMEOUT_S", "START_TIMEOUT_S", "WAIT_S", "LocalServer"]

START_TIMEOUT_S = 300.0
"""The default bound on starting an engine (with a server): the first torch
engine of a session also builds the tiny model, a vLLM one imports vLLM."""
CLOSE_TIMEOUT_S = 30.0
"""The bound on closing one engine; a server's in-flight turns get its ``grace_s`` on top."""
WAIT_S = 60.0
"""The bound on a call run on a server's loop."""


def _engine_config(backend: str, model_cache: str, **overrides: Any) -> EngineConfig:
    """``EngineConfig(backend=backend, **overrides)``; ``sim`` may be a mapping of ``SimConfig`` fields.

    A model backend (anything but ``sim``) builds and loads ``model="tiny"``
    (the default) from ``model_cache`` unless ``cache_dir`` is given.
    """
    from rlengine.config import EngineConfig, SimConfig

    sim = overrides.get("sim")
    if isinstance(sim, Mapping):
        overrides["sim"] = SimConfig(**sim)
    if backend != "sim":
        overrides.setdefault("cache_dir", model_cache)
    return EngineConfig(backend=backend, **overrides)


class LocalServer:
    """An engine and its ``Server`` (IPC and HTTP) on one private loop thread, as ``rlengine serve`` runs them.

    The engine runs in async mode on that loop, with the server's sessions,
    router and trace store; the test drives it from its own thread through
    real sockets. ``close`` stops the clients, the server, the engine and the
    loop thread, each bounded.
    """

    def __init__(self, config: EngineConfig | Sequence[EngineConfig], serve_config: ServeConfig | None = None, *,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        from rlengine.core.engine import new_event_loop

        self.loop: asyncio.AbstractEventLoop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlengine-serve-fixture", daemon=True)
        self._thread.start()
        self.engines: list[Engine] = []
        """The replicas (one per config given), all on this server's loop."""
        self.server: Server | None = None
        self._clients: list[Client] = []
        try:
            self._run(self._start([config] if not isinstance(config, Sequence) else list(config), serve_config),
                      start_timeout_s)
        except BaseException:
            self.close()
            raise

    async def _start(self, configs: list[EngineConfig], serve_config: ServeConfig | None) -> None:
        from rlengine.core.engine import Engine
        from rlengine.serve import Server

        for config in configs:
            engine = Engine(config)
            self.engines.append(engine)
            await engine.start_async()
        self.server = await Server(self.engines, serve_config).start_async()

    @property
    def engine(self) -> Engine:
        """The (first) replica."""
        if not self.engines:
            raise RuntimeError("the engine is not started")
        return self.engines[0]

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        import asyncio

        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # a start or stop that ran out of time must not go on behind the next one
            raise

    @property
    def ipc_path(self) -> str | None:
        """The IPC server's unix socket (None with ``ServeConfig(ipc=False)``)."""
        return self._server().ipc_path

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible HTTP server's base URL, ``http://127.0.0.1:<port>/v1`` by default
        (None with ``ServeConfig(http=False)``)."""
        return self._server().http_url

    @property
    def api_key(self) -> str | None:
        """The key HTTP requests must carry (the ``openai`` client's ``api_key``): ``ServeConfig.api_key``,
        or the one the server drew; None with ``ServeConfig(no_auth=True)`` or without HTTP."""
        return self._server().api_key

    @property
    def sessions(self) -> SessionManager:
        """The server's session manager: use it on the loop thread only (through ``call``)."""
        sessions = self._server().sessions
        assert sessions is not None, "a started server has its sessions"
        return sessions

    def _server(self) -> Server:
        if self.server is None:
            raise RuntimeError("the server is not started")
        return self.server

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = WAIT_S) -> Any:
        """``fn(*args)`` on the server's loop thread; its result (or exception) here, within ``timeout`` s."""
        async def on_loop() -> Any:
            return fn(*args)

        return self._run(on_loop(), timeout)

    def open_session(self, session_id: str | None = None) -> tuple[str, str]:
        """Open a session on the server, as an orchestrator does; returns its ``(session_id, token)``."""
        session = self.call(self.sessions.open, session_id)
        return session.session_id, session.token

    def connect(self, timeout: float = WAIT_S) -> Client:
        """A sandbox ``Client`` connected to the IPC socket (each request bounded by ``timeout``);
        closed with the server."""
        from rlengine.sandbox_client import Client

        path = self.ipc_path
        if path is None:
            raise RuntimeError("this server does not serve IPC (ServeConfig(ipc=False))")
        client = Client(path, timeout=timeout)
        self._clients.append(client)
        return client

    def session(self, session_id: str | None = None, client: Client | None = None) -> Session:
        """Open a session (``open_session``) and attach to it over ``client`` (None: a new ``connect()``)."""
        session_id, token = self.open_session(session_id)
        return (client or self.connect()).session(session_id, token)

    def close(self, grace_s: float | None = None) -> None:
        """Close the clients, then the server (turns in flight get ``grace_s``, None: the
        server's own), then the engines."""
        for client in self._clients:
            client.close()
        if self.loop.is_running():
            if grace_s is None:
                grace_s = self.server.config.grace_s if self.server is not None else 0.0
            try:
                self._run(self._stop(grace_s), grace_s + (1 + len(self.engines)) * CLOSE_TIMEOUT_S)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(CLOSE_TIMEOUT_S)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()

    async def _stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.aclose(grace_s=grace_s)
        for engine in self.engines:
            await engine.aclose(CLOSE_TIMEOUT_S)


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def rlengine_model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ``EngineConfig.cache_dir`` of this test session's model engines: the tiny model is built
    into it by the first one that starts, and loaded from it by the rest."""
    return str(tmp_path_factory.mktemp("rlengine-cache"))


@pytest.fixture
def rlengine_engine(rlengine_model_cache: str) -> Iterator[Callable[..., Engine]]:
    """``rlengine_engine(backend="sim", *, start_timeout_s=300, **overrides)``: a started ``Engine``
    (it owns its loop thread) on ``EngineConfig(backend=backend, **overrides)``; every engine it
    started is closed at teardown. ``sim`` may be a mapping of ``SimConfig`` fields."""
    from rlengine.core.engine import Engine

    engines: list[Engine] = []

    def start(backend: str = "sim", *, start_timeout_s: float = START_TIMEOUT_S, **overrides: Any) -> Engine:
        engine = Engine(_engine_config(backend, rlengine_model_cache, **overrides))
        # Listed before it starts: an engine that fails or times out starting is closed too.
        engines.append(engine)
        return engine.start(start_timeout_s)

    yield start
    for engine in reversed(engines):
        engine.close(CLOSE_TIMEOUT_S)


@pytest.fixture
def rlengine_sim_engine(rlengine_engine: Callable[..., Engine]) -> Engine:
    """A started engine on the sim backend (``EngineConfig(backend="sim")``): the control plane, no model."""
    return rlengine_engine("sim")


@pytest.fixture
def rlengine_torch_engine(rlengine_engine: Callable[..., Engine]) -> Engine:
    """A started engine on the torch backend with the tiny model, built once per session into
    ``rlengine_model_cache``."""
    return rlengine_engine("torch")


@pytest.fixture
def rlengine_serve(rlengine_model_cache: str) -> Iterator[Callable[..., LocalServer]]:
    """``rlengine_serve(backend="sim", *, serve=None, start_timeout_s=300, **overrides)``: a started
    ``LocalServer`` on ``EngineConfig(backend=backend, **overrides)``; ``serve`` is a ``ServeConfig``
    or a mapping of its fields (default: IPC on a private socket, HTTP on 127.0.0.1 at a free
    port). Every server it started is closed at teardown."""
    servers: list[LocalServer] = []

    def start(backend: str = "sim", *, serve: ServeConfig | Mapping[str, Any] | None = None,
              start_timeout_s: float = START_TIMEOUT_S, **overrides: Any) -> LocalServer:
        from rlengine.serve import ServeConfig

        serve_config = ServeConfig(**serve) if isinstance(serve, Mapping) else serve
        server = LocalServer(_engine_config(backend, rlengine_model_cache, **overrides), serve_config,
                             start_timeout_s=start_timeout_s)
        servers.append(server)
        return server

    yield start
    for server in reversed(servers):
        server.close()


@pytest.fixture
def rlengine_server(rlengine_serve: Callable[..., LocalServer]) -> LocalServer:
    """A sim engine served over IPC and HTTP (``ServeConfig()``): ``ipc_path``, ``http_url``, ``api_key``,
    ``open_session()``, ``session()``, ``connect()``."""
    return rlengine_serve("sim")


@pytest.fixture
def rlengine_sandbox_client(rlengine_server: LocalServer) -> Client:
    """A ``rlengine.sandbox_client.Client`` connected to ``rlengine_server``; closed at teardown, with the server."""
    return rlengine_server.connect()
