"""``Server``: the IPC and HTTP servers, the session router and the trace store, on the engines' loop.

One or more engines (data-parallel replicas) share one event loop: several
``Engine``s started in async mode on the server's loop (each with its own
compute thread), or one engine that owns its loop thread. Everything the
servers touch (sessions, router, trace store, the engines' gates) lives on
that loop, so no lock is needed anywhere; the servers are callbacks and
handlers on it, never a second loop::

    async with rle.Engine(cfg) as engine, Server(engine) as server:   # on your loop
        print(server.ipc_path, server.http_url, server.api_key)

    with rle.Engine(cfg) as engine, Server(engine) as server:         # engine owns its loop thread
        trace = server.call(server.sessions.collect, session_id).result(30)

Shutdown (``aclose``/``close``) stops listening, gives turns in flight
``grace_s`` to finish, aborts the rest (they settle as aborted and their
clients get ``aborted``), closes every connection and removes the socket
file and the key file. The engines are the caller's to close, after the server.

HTTP needs an API key unless ``ServeConfig.no_auth`` (loopback only), since
other users of a shared machine reach loopback too: the configured
``api_key``, or one drawn at start (``rlengine.core.api_keys``), which is on
``Server.api_key`` and in the 0600 file ``Server.key_file``.

This module wires parts together; it holds no request logic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from rlengine.core.api_keys import DrawnKey, check_auth
from rlengine.core.engine import Engine
from rlengine.core.futures import RequestFuture
from rlengine.errors import ConfigurationError, RLEngineError
from rlengine.protocol import DEFAULT_MAX_FRAME
from rlengine.render import ByteRenderer, ChatRenderer, TemplateRenderer
from rlengine.serve.ipc import IpcServer
from rlengine.serve.router import SessionRouter
from rlengine.serve.sessions import Retention, SessionManager
from rlengine.tool_parsers import PARSERS, parser_for
from rlengine.trace import DEFAULT_MAX_BYTES, TraceStore
from rlengine.validation import Bound, NonNegativeInt, Port, PositiveInt, validate

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ServeConfig", "Server"]

log = logging.getLogger("rlengine.serve")

_Timeout = Annotated[float, Bound(gt=0, finite=False)]
"""A wait in seconds, > 0; inf: never."""


class ServeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How to serve. Every field is also a ``key=value`` of ``rlengine serve``."""

    ipc: bool = True
    socket_path: str | None = None
    """None: ``engine.sock`` in a new private (0700) temporary directory."""
    http: bool = True
    host: str = "127.0.0.1"
    port: Port = 0
    """0: any free port (the chosen one is printed and in ``Server.http_url``)."""
    api_key: str | None = None
    """The key every HTTP request must carry (``Authorization: Bearer`` or ``x-api-key``), but for those on a
    session's own base URL, which carry its token. None: the server draws a random one when it starts
    (``Server.api_key``) and writes it to ``Server.key_file``, unless ``no_auth``."""
    no_auth: bool = False
    """Accept any HTTP request, without a key: on loopback only (every user of this machine can then connect)."""
    key_file: str | None = None
    """Where a drawn key is written (mode 0600, removed on close); None: ``http-<port>.key`` in
    ``$XDG_RUNTIME_DIR/rlengine``, else in ``~/.rlengine/run`` (mode 0700)."""
    max_frame: Annotated[int, Bound(ge=1, le=0xFFFFFFFF, note="a 4-byte frame header")] = DEFAULT_MAX_FRAME
    max_body_bytes: PositiveInt = 16 << 20
    max_in_flight: PositiveInt = 256
    """Turns in flight per IPC connection before the server stops reading it."""
    write_stall_timeout_s: _Timeout = 30.0
    """A client (IPC, or HTTP while streaming) that reads nothing of its replies for this long is
    disconnected, its turns abandoned."""
    max_connections: PositiveInt = 1024
    """IPC connections at most; one more is told ``unavailable`` and closed."""
    idle_timeout_s: _Timeout = 600.0
    """An IPC connection with no turn in flight that sends nothing for this long is closed."""
    frame_timeout_s: _Timeout = 30.0
    """An IPC frame must arrive whole within this long of its first byte."""
    max_buffered_bytes: PositiveInt = 128 << 20
    """Bytes the IPC connections' incomplete frames may hold together, one budget for all of them
    (beyond it, the connection that would exceed it is told ``unavailable`` and closed)."""
    tombstone_ttl_s: _Timeout = 3600.0
    max_tombstones: PositiveInt = 100_000
    trace_max_bytes: NonNegativeInt = DEFAULT_MAX_BYTES
    trace_share_prompts: bool = True
    """Sessions share the trace store's stored prompts: a system prompt (or a group's prompt)
    that many sessions send is stored once, with a reference count, not once per session.
    Traces are unchanged (every sampled and environment token stays the session's own);
    False gives each session a tree of its own."""
    max_open_sessions: PositiveInt = 100_000
    """Open sessions at most (one more is refused: ``too_many_sessions``, HTTP 429)."""
    idle_session_ttl_s: _Timeout = 3600.0
    """A session without a turn for this long is closed by the server."""
    closed_session_ttl_s: _Timeout = 600.0
    """A closed session's trace waits this long for ``collect``, then is freed."""
    max_closed_sessions: PositiveInt = 10_000
    """Closed sessions' traces kept at most, the oldest freed first (and, oldest first, whenever
    the trace store is 90 % full)."""
    grace_s: Annotated[float, Bound(ge=0, finite=False)] = 5.0
    """On shutdown, how long turns in flight may finish before they are aborted."""
    tool_parser: str | None = None
    """How the model writes tool calls (``rlengine.tool_parsers``: ``hermes``, ...); None picks it
    from the model's chat template (no tool format there: requests with tools are refused)."""

    @property
    def retention(self) -> Retention:
        return Retention(max_open=self.max_open_sessions, idle_ttl_s=self.idle_session_ttl_s,
                         closed_ttl_s=self.closed_session_ttl_s, max_closed=self.max_closed_sessions)

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        # Below: the rules between fields and the names only another module knows.
        if not (self.ipc or self.http):
            raise ConfigurationError("ipc=False and http=False: nothing to serve")
        check_auth(self.api_key, self.no_auth, self.key_file, self.host if self.http else None)
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ConfigurationError(f"tool_parser={self.tool_parser!r}: unknown; known: {', '.join(sorted(PARSERS))}")


def _renderer_for(engine: Engine) -> ChatRenderer | None:
    tokenizer = engine.tokenizer
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return TemplateRenderer(tokenizer)
    if tokenizer is None and engine.backend.vocab_size >= 256:
        return ByteRenderer()
    return None


class Server:
    """IPC + HTTP serving of agent sessions over one or more engine replicas."""

    def __init__(self, engines: Engine | Sequence[Engine], config: ServeConfig | None = None) -> None:
        self.engines = [engines] if isinstance(engines, Engine) else list(engines)
        if not self.engines:
            raise ConfigurationError("engines=[]: serve at least one engine")
        self.config = config or ServeConfig()
        self.router = SessionRouter(self.engines, ttl_s=self.config.tombstone_ttl_s,
                                    max_tombstones=self.config.max_tombstones)
        self.store = TraceStore(self.config.trace_max_bytes)
        self.sessions: SessionManager | None = None
        self.ipc: IpcServer | None = None
        self.http: Any = None
        self.ipc_path: str | None = None
        self.http_url: str | None = None
        self.api_key: str | None = None
        """The key HTTP requests must carry: ``config.api_key``, or the one drawn at start (None with
        ``no_auth``, or without HTTP)."""
        self.key_file: str | None = None
        """The 0600 file holding a drawn key (None where none was drawn); removed on close."""
        self._drawn: DrawnKey | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "new"

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return await self.start_async()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model_name(self) -> str:
        return self.engines[0].model_name

    async def start_async(self) -> Server:
        """Start on the running loop, which must be the engines' loop."""
        if self._state != "new":
            raise RLEngineError(f"Server.start: the server is {self._state}; a Server starts once")
        loop = asyncio.get_running_loop()
        for i, engine in enumerate(self.engines):
            if engine.state != "running":
                raise ConfigurationError(f"engines[{i}] is {engine.state}: start the engines first")
            if engine.loop is not loop:
                raise ConfigurationError(f"engines[{i}] runs on another loop: every replica and the server "
                                         "share one loop (start the engines with 'async with' on it)")
        self._state = "starting"
        self._loop = loop
        # Loading a tokenizer takes a while: never on the loop.
        renderer = await asyncio.to_thread(_renderer_for, self.engines[0])
        template = getattr(getattr(renderer, "tokenizer", None), "chat_template", None)
        self.sessions = SessionManager(self.router, self.store, renderer,
                                       parser_for(template if isinstance(template, str) else None,
                                                  self.config.tool_parser),
                                       retention=self.config.retention,
                                       share="sessions" if self.config.trace_share_prompts else None)
        cfg = self.config
        try:
            if cfg.ipc:
                self.ipc = IpcServer(self.sessions, model_name=self.model_name, max_frame=cfg.max_frame,
                                     max_in_flight=cfg.max_in_flight,
                                     write_stall_timeout_s=cfg.write_stall_timeout_s,
                                     max_connections=cfg.max_connections, idle_timeout_s=cfg.idle_timeout_s,
                                     frame_timeout_s=cfg.frame_timeout_s, max_buffered_bytes=cfg.max_buffered_bytes)
                self.ipc_path = await self.ipc.start(cfg.socket_path)
            if cfg.http:
                from rlengine.serve.http import HttpServer  # aiohttp only where HTTP is served

                # Drawn before binding: the server never listens without its key.
                if cfg.api_key is None and not cfg.no_auth:
                    self._drawn = DrawnKey("http", cfg.key_file)
                self.api_key = self._drawn.key if self._drawn is not None else cfg.api_key
                self.http = HttpServer(self.sessions, model_name=self.model_name, api_key=self.api_key,
                                       max_body_bytes=cfg.max_body_bytes,
                                       write_stall_timeout_s=cfg.write_stall_timeout_s)
                self.http_url = await self.http.start(cfg.host, cfg.port)
                if self._drawn is not None:
                    self.key_file = self._drawn.write(self.http.port)
                    self.http.key_file = self.key_file
                    log.info("http: %s needs API key %s (also in %s)", self.http_url, self.api_key, self.key_file)
        except BaseException:
            await self._shut(0.0)
            self._state = "closed"
            raise
        self._state = "running"
        return self

    def start(self, timeout: float = 120.0) -> Server:
        """Start from another thread, on the loop of an engine that owns its loop thread."""
        loop = self.engines[0].loop
        asyncio.run_coroutine_threadsafe(self.start_async(), loop).result(timeout)
        return self

    async def aclose(self, grace_s: float | None = None) -> None:
        """Stop: in-flight turns get ``grace_s`` to finish, the rest are aborted; the socket file is removed."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        await self._shut(self.config.grace_s if grace_s is None else grace_s)
        self._state = "closed"

    def close(self, timeout: float = 60.0) -> None:
        """``aclose`` from another thread (the engine owns its loop thread)."""
        if self._loop is None or self._state in ("new", "closed"):
            self._state = "closed"
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout)

    async def _shut(self, grace_s: float) -> None:
        if self.ipc is not None:
            self.ipc.stop_listening()
        if self.http is not None:
            await self.http.stop_listening()
        sessions = self.sessions
        if sessions is not None:
            await self._wait_idle(grace_s)
            sessions.abort_all()
            # Aborts settle on the next sampler pass; their replies then go out.
            await self._wait_idle(5.0)
        if self.ipc is not None:
            await self._wait_flushed(2.0)
            await self.ipc.close()
        if self.http is not None:
            await self.http.close()
        if self._drawn is not None:
            self._drawn.remove()

    async def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.sessions is not None and self.sessions.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _wait_flushed(self, timeout: float) -> None:
        """Give replies already written a moment to leave (bounded)."""
        assert self.ipc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
                c.transport is not None and c.transport.get_write_buffer_size() for c in self.ipc.connections):
            await asyncio.sleep(0.01)

    @property
    def state(self) -> str:
        return self._state

    # -- calling in from other threads ------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> RequestFuture[Any]:
        """Run ``fn(*args)`` on the server's loop (e.g. ``server.sessions.collect``); thread-safe."""
        return self.engines[0].call_on_loop(fn, *args)
