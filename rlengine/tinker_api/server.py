"""The Tinker REST API over HTTP, on the engine's own loop (aiohttp's AppRunner): ``start`` / ``start_async``.

The official ``tinker`` SDK (0.38) and the Tinker cookbook drive a local
rlengine through it unchanged (``base_url`` = ``TinkerServer.url``)::

    with rle.Engine(rle.EngineConfig(model="tiny")) as engine:       # engine owns its loop thread
        server = rlengine.tinker_api.start(engine)
        client = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
        ...
        server.close()

    async with rle.Engine(cfg) as engine:                            # on your loop
        server = await rlengine.tinker_api.start_async(engine)

Served under ``/api/v1``: ``client/config``, ``client/dynamic_config``,
``create_session``, ``session_heartbeat``, ``sessions/{id}/finish``,
``get_server_capabilities``, ``healthz``, ``create_model``, ``get_info``,
``unload_model``, ``forward_backward`` (protobuf or JSON), ``forward``,
``optim_step``, ``save_weights``, ``save_weights_for_sampler``,
``load_weights``, ``create_sampling_session``, ``join_sampling_session``,
``samplers/{id}``, ``asample``, ``retrieve_future``, ``retrieve_futures``,
``cancel_future``, the REST listings ``GET training_runs``,
``GET training_runs/{id}``, ``GET training_runs/{id}/checkpoints``,
``DELETE training_runs/{id}/checkpoints/{kind}/{name}``,
``GET checkpoints``, ``weights_info`` and ``copy_weights`` (``runs``),
``GET sessions`` and ``GET sessions/{id}``, and ``telemetry`` (accepted and
dropped: a local server collects no analytics). Any other path answers 404
``not_supported`` naming it (server-side custom losses, external exports,
publishing, billing and auth-token exchange are Tinker-service features
rlengine does not have); a refused call on a training model still consumes
its ``seq_id`` whatever refused it (``_take_turn``).

Auth: the SDK sends ``X-API-Key``; every request must carry the server's key
(``TinkerServer.api_key``: the configured ``api_key``, or one drawn at start
and written to the 0600 file ``TinkerServer.key_file``, removed on close).
With ``no_auth`` (loopback only, see ``TinkerServerConfig``) any key is
accepted and identifies the caller: sessions and all they own belong to the
key that created them. Errors have the JSON shape of
``errors.error_response``, their statuses from ``rlengine.errors.WIRE``; an
oversized body is a 413 naming the limit, and a body refused while decoding
a 400 naming the field (``lora_config.rank``) and the value sent.

This module translates HTTP to ``TinkerService`` calls; it never creates a
loop and never blocks the one it runs on (a large ``forward_backward`` is
decoded and checked on its own worker threads: ``_OFF_LOOP_BYTES``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from aiohttp import web

from rlengine.core.api_keys import DrawnKey
from rlengine.core.engine import Engine
from rlengine.errors import InvalidRequest, RLEngineError
from rlengine.tinker_api import wire
from rlengine.tinker_api.config import TinkerServerConfig
from rlengine.tinker_api.errors import (
    NotSupported,
    PayloadTooLarge,
    Unauthorized,
    UnknownEndpoint,
    error_response,
)
from rlengine.tinker_api.proto import FwdBwdRequest, call_header, decode_forward_backward_request
from rlengine.tinker_api.service import TinkerService

__all__ = ["TinkerServer", "start", "start_async"]

log = logging.getLogger("rlengine.tinker_api")

_PREFIX = "/api/v1"
_OFF_LOOP_BYTES = 4 << 10
"""A ``forward_backward`` / ``forward`` body larger than this is decoded and checked (spans, behaviour
logprobs, the loss's validation) on the checks threads, not on the loop. Measured (2 vCPUs, uvloop):
a thread hop costs the loop 33-46 us of CPU (~50 us of latency) and a call takes three; inline, the
same work costs the loop 65-150 us for one datum of 8-128 tokens (2-3 KiB: the break-even), 0.27 ms
for one cookbook datum of 300 tokens (6 KiB) and ~1.5 ms per 64 KiB of ``stable_reinforce`` with
spans. So a call pays the hops only where they cost the loop less than the work."""
_CHECK_THREADS = 2
"""The checks threads: the work is mostly Python under the GIL, so more would not go faster; two let
one call's checks proceed beside a larger one's. Their own pool: a burst of large calls never queues
ahead of the default executor's other users (engine shutdown among them)."""
_START_TIMEOUT_S = 60.0
_json = msgspec.json.Encoder()
_OWNER = web.RequestKey("owner", str)
"""The caller's identity (a digest of its API key), set by the guard for every handler."""


def _json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(value), status=status, content_type="application/json")


def _owner(key: str) -> str:
    """Who a key is, without keeping the key: a digest."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


_AT = re.compile(r" - at `\$((?:\.\w+|\[\d+\]|\[\.\.\.\])+)`$")
"""Where msgspec's message says a value was refused: ``$.a.b[0]``, ``[...]`` for a dict's key."""
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _refused_at(body: bytes, message: str) -> tuple[str, Any] | None:
    """The field (``a.b[0]``) and the JSON value that msgspec's ``message`` refused in ``body``
    (None for a path through a dict's key, which msgspec does not name); None when the message
    names no field (the body itself is not an object)."""
    at = _AT.search(message)
    if at is None:
        return None
    path = at.group(1)
    if "[...]" in path:
        return path.lstrip("."), None
    value: Any = msgspec.json.decode(body)  # valid JSON: the typed decoding got past the syntax
    for key, index in _STEP.findall(path):
        if not isinstance(value, dict if key else list):
            return path.lstrip("."), None
        value = value.get(key) if key else value[int(index)]
    return path.lstrip("."), value


def _decode_as(decoder: msgspec.json.Decoder[Any], body: bytes, kind: type) -> Any:
    """``body`` as a ``kind``, or ``InvalidRequest`` naming the field that refused it: the body's own
    (``__post_init__``'s declared limits) as it raised it, msgspec's (a type, a literal) at the path
    msgspec names, with the value found there. Any thread (msgspec keeps a decode's state per call)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, InvalidRequest):
            raise exc.__cause__ from None
        field, value = _refused_at(body, str(exc)) or ("body", kind.__name__)
        raise InvalidRequest(field, value, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest("body", "malformed JSON", str(exc)) from None


def _fwdbwd_request(body: bytes, json_decoder: msgspec.json.Decoder[Any] | None, forward_only: bool
                    ) -> FwdBwdRequest:
    """A ``forward_backward`` / ``forward`` body decoded: protobuf without ``json_decoder``, else JSON
    with it. Any thread: it reads only the body."""
    if json_decoder is None:
        decoded = decode_forward_backward_request(body)
        return decoded._replace(forward_only=decoded.forward_only or forward_only)
    req = _decode_as(json_decoder, body, wire.ForwardBackwardJsonRequest)
    fb = req.forward_backward_input
    data = [wire.datum(d, f"forward_backward_input.data[{i}]") for i, d in enumerate(fb.data)]
    return FwdBwdRequest(req.model_id, req.seq_id, data, fb.loss_fn, fb.loss_fn_config, req.forward_only or forward_only)


class TinkerServer:
    """The HTTP server and its ``TinkerService`` on one engine's loop.

    Why one class: most of it is the route table (``_routes``), a few lines per Tinker endpoint;
    the work behind each route is ``TinkerService``'s.
    """

    def __init__(self, engine: Engine, config: TinkerServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or TinkerServerConfig()
        self.service: TinkerService | None = None
        self.url: str | None = None
        """``http://host:port``: the SDK's ``base_url``."""
        self.api_key: str | None = None
        """The key every request must carry (the SDK's ``api_key``): ``config.api_key``, or the one drawn
        at start; None with ``no_auth``."""
        self.key_file: str | None = None
        """The 0600 file holding a drawn key (None where none was drawn); removed on close."""
        self._drawn: DrawnKey | None = None
        self._runner: web.AppRunner | None = None
        self._decoders: dict[type, msgspec.json.Decoder[Any]] = {}
        self._checks: ThreadPoolExecutor | None = None

    # -- lifecycle (engine loop) ------------------------------------------------------------

    async def start_async(self) -> TinkerServer:
        loop = asyncio.get_running_loop()
        if loop is not self.engine.loop:
            raise RLEngineError("TinkerServer.start_async: must run on the engine's loop "
                                "(use rlengine.tinker_api.start(engine) from another thread)")
        cfg = self.config
        # Drawn before binding: the server never listens without its key.
        if cfg.api_key is None and not cfg.no_auth:
            self._drawn = DrawnKey("tinker", cfg.key_file, prefix="tml-")
        self.api_key = self._drawn.key if self._drawn is not None else cfg.api_key
        self.service = TinkerService(self.engine, self.config)
        self.service.start()
        self._checks = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="rlengine-tinker-checks")
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._guard])
        app.add_routes(self._routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except BaseException:
            await self.aclose()
            raise
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if self._drawn is not None:
            try:
                self.key_file = self._drawn.write(port)
            except BaseException:
                await self.aclose()
                raise
            log.info("tinker: %s needs API key %s (also in %s)", self.url, self.api_key, self.key_file)
        return self

    async def aclose(self) -> None:
        if self.service is not None:
            self.service.stop()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._checks is not None:
            # After the runner: its handlers are cancelled, so no call awaits a check any more.
            checks, self._checks = self._checks, None
            checks.shutdown(wait=False, cancel_futures=True)
        if self._drawn is not None:
            self._drawn.remove()

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving (from any thread but the engine's loop thread)."""
        if self._runner is None:
            return
        loop = self.engine.loop
        if loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout)

    # -- middleware ---------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        try:
            given = request.headers.get("X-API-Key")
            if given is None and request.headers.get("Authorization", "").startswith("Bearer "):
                given = request.headers["Authorization"][7:]
            secret = self.api_key
            if secret is not None and not hmac.compare_digest((given or "").encode(), secret.encode()):
                raise Unauthorized("X-API-Key", "***" if given else None, "missing or wrong API key")
            request[_OWNER] = _owner(given or "")
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            exc: BaseException = PayloadTooLarge("body", request.content_length,
                                                 f"exceeds max_body_bytes={self.config.max_body_bytes}")
        except web.HTTPException as http_exc:
            if http_exc.status == 405:
                exc = UnknownEndpoint("path", f"{request.method} {request.path}", "method not served here")
            else:
                raise
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - every failure becomes a typed error body
            exc = err
        await self._take_turn(request, exc)
        status, body = error_response(exc)
        response = _json_response(body, status)
        if request.path == f"{_PREFIX}/client/config":
            response.force_close()  # as _client_config does: the SDK never closes that connection (a wrong key)
        return response

    # -- helpers --------------------------------------------------------------------------

    def _decode(self, body: bytes, kind: type) -> Any:
        """``body`` as a ``kind`` (``_decode_as``)."""
        return _decode_as(self._decoder(kind), body, kind)

    def _decoder(self, kind: type) -> msgspec.json.Decoder[Any]:
        """The JSON decoder of ``kind``, made once (loop thread: the table is the loop's)."""
        decoder = self._decoders.get(kind)
        if decoder is None:
            decoder = self._decoders[kind] = msgspec.json.Decoder(kind)
        return decoder

    async def _body(self, request: web.Request) -> bytes:
        if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
            raise NotSupported("Content-Encoding", request.headers["Content-Encoding"],
                               "request bodies must not be compressed (proto_compress_fwdbwd is off)")
        return await request.read()

    def _call(self, kind: type, method: Callable[[str, Any], Any]) -> Callable[[web.Request], Awaitable[Any]]:
        """A POST handler: decode ``kind`` from JSON, ``method(owner, body)``, answer its result as JSON."""

        async def handle(request: web.Request) -> web.Response:
            body = self._decode(await self._body(request), kind)
            return _json_response(method(request[_OWNER], body))

        return handle

    async def _take_turn(self, request: web.Request, exc: BaseException) -> None:
        """A refused call on a training model still consumes its ``seq_id``, whatever refused it and with
        whatever status (a body that does not decode, an unknown loss, an endpoint not served here such
        as ``save_weights_external``): the SDK numbers every call of a model, and the model's next call
        would otherwise wait ``hold_timeout_s`` for this one. Only the caller's own model (an
        unauthenticated request names no owner), and not for a body too large to read."""
        owner = request.get(_OWNER)
        if owner is None or request.method != "POST" or self.service is None or isinstance(exc, PayloadTooLarge):
            return
        try:
            raw = await request.read()
        except Exception:  # noqa: BLE001 - a body that cannot be read names no call
            return
        header = call_header if "application/x-protobuf" in request.headers.get("Content-Type", "") \
            else wire.call_header
        # Reading a JSON body's header scans the whole body: a large one's is read off the loop.
        if len(raw) > _OFF_LOOP_BYTES and self._checks is not None:
            model_id, seq_id = await self._off_loop(lambda: header(raw))
        else:
            model_id, seq_id = header(raw)
        self.service.training.refused(owner, model_id, seq_id, exc)

    @property
    def _svc(self) -> TinkerService:
        assert self.service is not None
        return self.service

    # -- routes ---------------------------------------------------------------------------

    def _routes(self) -> list[web.AbstractRouteDef]:
        svc = self._svc
        post, get = web.post, web.get
        p = _PREFIX
        return [
            post(f"{p}/client/config", self._client_config),
            post(f"{p}/client/dynamic_config",
                 self._call(wire.ClientConfigRequest, lambda o, b: svc.dynamic_config())),
            get(f"{p}/healthz", self._healthz),
            get(f"{p}/get_server_capabilities", self._capabilities),
            post(f"{p}/telemetry", self._telemetry),
            post(f"{p}/create_session", self._call(wire.CreateSessionRequest, svc.create_session)),
            post(f"{p}/session_heartbeat", self._call(wire.SessionHeartbeatRequest, svc.heartbeat)),
            post(f"{p}/sessions/{{session_id}}/finish", self._finish_session),
            post(f"{p}/create_model", self._call(wire.CreateModelRequest, svc.create_model)),
            post(f"{p}/get_info", self._call(wire.GetInfoRequest, svc.get_info)),
            post(f"{p}/unload_model", self._call(wire.UnloadModelRequest, svc.unload_model)),
            post(f"{p}/forward_backward", self._forward_backward),
            post(f"{p}/forward", self._forward),
            post(f"{p}/optim_step", self._call(wire.OptimStepRequest, svc.training.optim_step)),
            post(f"{p}/save_weights", self._call(wire.SaveWeightsRequest, svc.training.save_weights)),
            post(f"{p}/save_weights_for_sampler",
                 self._call(wire.SaveWeightsForSamplerRequest, svc.training.save_weights_for_sampler)),
            post(f"{p}/load_weights", self._call(wire.LoadWeightsRequest, svc.training.load_weights)),
            post(f"{p}/create_sampling_session",
                 self._call(wire.CreateSamplingSessionRequest, svc.sampling.create_sampling_session)),
            post(f"{p}/join_sampling_session",
                 self._call(wire.JoinSamplingSessionRequest, svc.sampling.join_sampling_session)),
            get(f"{p}/samplers/{{sampler_id}}", self._get_sampler),
            post(f"{p}/asample", self._call(wire.SampleRequest, svc.sampling.asample)),
            post(f"{p}/retrieve_future", self._retrieve_future),
            post(f"{p}/retrieve_futures", self._retrieve_futures),
            post(f"{p}/cancel_future", self._call(wire.CancelFutureRequest, svc.results.cancel)),
            get(f"{p}/training_runs", self._list_training_runs),
            get(f"{p}/training_runs/{{run_id}}", self._get_training_run),
            get(f"{p}/training_runs/{{run_id}}/checkpoints", self._list_checkpoints),
            web.delete(f"{p}/training_runs/{{run_id}}/checkpoints/{{segment}}/{{name}}", self._delete_checkpoint),
            get(f"{p}/checkpoints", self._list_user_checkpoints),
            post(f"{p}/weights_info", self._call(wire.WeightsInfoRequest, svc.runs.weights_info)),
            post(f"{p}/copy_weights", self._copy_weights),
            get(f"{p}/sessions", self._list_sessions),
            get(f"{p}/sessions/{{session_id}}", self._get_session),
            web.route("*", "/{tail:.*}", self._unknown),
        ]

    async def _client_config(self, request: web.Request) -> web.Response:
        self._decode(await self._body(request), wire.ClientConfigRequest)
        response = _json_response(self._svc.client_config())
        # The SDK fetches this once through a throwaway connection pool it never
        # closes: closing the connection from here frees the socket at once.
        response.force_close()
        return response

    async def _healthz(self, _request: web.Request) -> web.Response:
        died = self.engine.died
        if died is not None:  # a dead engine must not look healthy to its supervisor
            return _json_response({"status": "dead", "error": str(died)}, status=503)
        return _json_response({"status": "ok"})

    async def _capabilities(self, _request: web.Request) -> web.Response:
        return _json_response(self._svc.capabilities())

    async def _telemetry(self, request: web.Request) -> web.Response:
        await request.read()
        return _json_response({"status": "accepted"})

    async def _finish_session(self, request: web.Request) -> web.Response:
        await request.read()
        self._svc.finish_session(request[_OWNER], request.match_info["session_id"])
        return _json_response(None)

    async def _get_sampler(self, request: web.Request) -> web.Response:
        return _json_response(self._svc.sampling.get_sampler(request[_OWNER], request.match_info["sampler_id"]))

    async def _forward_backward(self, request: web.Request) -> web.Response:
        return await self._fwdbwd(request, forward_only=False)

    async def _forward(self, request: web.Request) -> web.Response:
        return await self._fwdbwd(request, forward_only=True)

    async def _fwdbwd(self, request: web.Request, forward_only: bool) -> web.Response:
        raw = await self._body(request)
        proto = "application/x-protobuf" in request.headers.get("Content-Type", "")
        decoder = None if proto else self._decoder(wire.ForwardBackwardJsonRequest)
        # A large call is decoded and checked on the checks threads; below the threshold the thread
        # hops would cost the loop more than the work (``_OFF_LOOP_BYTES``).
        off_loop = self._off_loop if len(raw) > _OFF_LOOP_BYTES else None
        if off_loop is not None:
            decoded = await off_loop(lambda: _fwdbwd_request(raw, decoder, forward_only))
        else:
            decoded = _fwdbwd_request(raw, decoder, forward_only)
        return _json_response(await self._svc.training.forward_backward(request[_OWNER], decoded, off_loop))

    async def _off_loop(self, work: Callable[[], Any]) -> Any:
        """``work()`` on the checks threads (``TrainingCalls.forward_backward``'s ``OffLoop``)."""
        assert self._checks is not None
        return await asyncio.get_running_loop().run_in_executor(self._checks, work)

    async def _retrieve_future(self, request: web.Request) -> web.Response:
        body = self._decode(await self._body(request), wire.FutureRetrieveRequest)
        want_proto = "application/x-protobuf" in request.headers.get("Accept", "")
        content_type, data = await self._svc.results.retrieve(request[_OWNER], body, want_proto)
        return web.Response(body=data, content_type=content_type)

    async def _retrieve_futures(self, request: web.Request) -> web.Response:
        body = self._decode(await self._body(request), wire.FuturesRetrieveRequest)
        return _json_response(await self._svc.results.retrieve_many(request[_OWNER], body))

    # -- training runs and checkpoints (``runs``) ---------------------------------------------

    @staticmethod
    def _query_int(request: web.Request, name: str, default: int) -> int:
        raw = request.query.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise InvalidRequest(name, raw, "must be an integer") from None

    async def _list_training_runs(self, request: web.Request) -> web.Response:
        q = request.query
        return _json_response(await self._svc.runs.list_training_runs(
            request[_OWNER], self._query_int(request, "limit", 20), self._query_int(request, "offset", 0),
            q.get("access_scope", "owned"), q.get("project_id")))

    async def _get_training_run(self, request: web.Request) -> web.Response:
        return _json_response(await self._svc.runs.get_training_run(
            request[_OWNER], request.match_info["run_id"], request.query.get("access_scope", "owned")))

    async def _list_checkpoints(self, request: web.Request) -> web.Response:
        return _json_response(await self._svc.runs.list_checkpoints(request[_OWNER], request.match_info["run_id"]))

    async def _list_user_checkpoints(self, request: web.Request) -> web.Response:
        return _json_response(await self._svc.runs.list_user_checkpoints(
            request[_OWNER], self._query_int(request, "limit", 100), self._query_int(request, "offset", 0)))

    async def _copy_weights(self, request: web.Request) -> web.Response:
        body = self._decode(await self._body(request), wire.CopyWeightsRequest)
        return _json_response(await self._svc.runs.copy_weights(request[_OWNER], body))

    async def _list_sessions(self, request: web.Request) -> web.Response:
        return _json_response(self._svc.list_sessions(
            request[_OWNER], self._query_int(request, "limit", 20), self._query_int(request, "offset", 0),
            request.query.get("access_scope", "owned")))

    async def _get_session(self, request: web.Request) -> web.Response:
        return _json_response(self._svc.get_session(request[_OWNER], request.match_info["session_id"],
                                                    request.query.get("access_scope", "owned")))

    async def _delete_checkpoint(self, request: web.Request) -> web.Response:
        info = request.match_info
        await self._svc.runs.delete_checkpoint(request[_OWNER], info["run_id"], f"{info['segment']}/{info['name']}")
        return _json_response(None)

    async def _unknown(self, request: web.Request) -> web.Response:
        raise UnknownEndpoint("path", f"{request.method} {request.path}",
                              "not supported by rlengine (this Tinker endpoint is not served by a local engine)")


async def start_async(engine: Engine, config: TinkerServerConfig | None = None) -> TinkerServer:
    """Serve the Tinker API for ``engine``; call on the engine's loop (async mode, or a coroutine on it)."""
    return await TinkerServer(engine, config).start_async()


def start(engine: Engine, config: TinkerServerConfig | None = None, timeout: float = _START_TIMEOUT_S) -> TinkerServer:
    """Serve the Tinker API for an engine that owns its loop thread; returns once listening.

    Thread-safe; never call it on the engine's loop thread (use ``start_async`` there).
    """
    loop = engine.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RLEngineError("rlengine.tinker_api.start: called on the engine's loop thread; await start_async")
    server = TinkerServer(engine, config)
    return asyncio.run_coroutine_threadsafe(server.start_async(), loop).result(timeout)
