"""The OpenAI-compatible HTTP server, on the engine's own loop (aiohttp's AppRunner).

Endpoints:

* ``GET /health`` - 200 while every engine replica lives, 503 naming the dead
  ones (``GET /v1/models`` answers 503 then too); it needs no API key;
* ``GET /v1/models``, ``GET /v1/models/{id}`` - the served model;
* ``POST /v1/chat/completions`` - non-streaming and streaming (SSE) chat
  completions. With a session id (``X-Session-ID`` header or ``session_id``
  body field) and its token (``X-Session-Token`` header or ``session_token``
  field), the turn is a session turn: traced exactly, pinned to the
  session's replica. Without one it is a stateless completion (not traced).
  ``tools`` are rendered by the model's chat template and each completion's
  tool calls parsed from its text (``rlengine.tool_parsers``): they come back
  as ``message.tool_calls`` with ``finish_reason: "tool_calls"``, streamed as
  ``tool_calls`` deltas after the text; the history may hold assistant
  messages with ``tool_calls`` (content null or text) and ``role: "tool"``
  results. ``tool_choice`` ``auto``, ``none``, ``required`` and a named
  function, ``parallel_tool_calls`` and ``response_format`` (``json_object``,
  ``json_schema``) are honoured; the last three kinds force the output by
  constrained decoding (``rlengine.constraints``), and such turns are listed
  in the trace's ``constrained``. Stop strings are not part of the returned text;
* ``POST /v1/messages`` - Anthropic's Messages API and ``POST /v1/responses``
  - OpenAI's Responses API, each translated to the same chat turns
  (``serve.anthropic``, ``serve.responses``), streamed as those APIs stream;
* ``POST /v1/completions`` - OpenAI's legacy Completions API: a text or
  token-id prompt as a token turn (``serve.completions``), traced in a
  session like ``generate``, streamed or not, with OpenAI's ``logprobs``;
* a ``max_tokens`` (``max_completion_tokens``, ``max_output_tokens``) that the
  context cannot hold after the prompt is a 400 ``context_length_exceeded``
  naming the field, as OpenAI answers it;
* ``POST /v1/sessions`` (open; body ``{"session_id": ..., "roles": {role: trainable}}``
  optional, ``roles`` declaring the agent roles its turns name in ``X-RLEngine-Role``; the
  answer holds the id, the token and the session's own ``base_url``,
  ``.../sessions/<id>/v1``, on which the token is the API key: ``POST
  chat/completions``, ``completions``, ``messages``, ``responses``, ``reward`` and ``GET
  models`` there are that session's),
  ``GET /v1/admin/leases`` (turns with an unknown outcome, per replica) and
  ``POST /v1/admin/leases/{replica}/{lease_id}/write_off`` for operators, and ``GET
  /v1/admin/timeline``: the engines' timeline as Chrome trace-event JSON (``rlengine.timeline``;
  404 unless the engines record one: ``rlengine serve --timeline``);
  ``DELETE /v1/sessions/{id}`` (close), ``POST /v1/sessions/{id}/reward``
  (``{"value": x}``) and ``GET /v1/sessions/{id}/trace``, each with the
  session's token.

It binds 127.0.0.1 unless told otherwise; with ``api_key`` (``Server`` passes
``ServeConfig.api_key`` or the key it drew; None only with ``no_auth``) every
request but ``GET /health`` must carry ``Authorization: Bearer <api_key>`` (what the ``openai``
client sends) or ``x-api-key: <api_key>`` (the ``anthropic`` client), but for
those on a session's own base URL, which carry its token.
Errors have OpenAI's shape (``{"error": {"message", "type", "code", "param"}}``,
``param`` naming the field at fault, and ``value`` its value) with
the status of their code (``rlengine.serve.errors.HTTP_STATUS``): a retired
session is 410 Gone.

Handler cancellation is on: a client that disconnects mid-generation
cancels its handler, which abandons the turn (``SessionManager.abandon``):
it is aborted and its lease settled, streamed or not, on every endpoint, so
no install waits for it; a session whose stream had sent tokens is marked
tainted. A streaming client that keeps its connection but reads nothing for
``write_stall_timeout_s`` is cut off and its turn abandoned alike. A named session must be proven: ``X-Session-ID`` (or the body's
``session_id``) naming a session this server knows, with a missing or empty
token, is refused (403 ``forbidden``, naming the token field). Bodies are
decoded by one typed msgspec JSON decoder; anything it rejects is a 400
naming the field.

This module is the application: its routes, the API key, the session a
request names and proves, and the endpoints of sessions, models, health and
operators. The chat-turn endpoints are ``serve.http_turns`` (each API's
translation in ``serve.chat_completions``, ``serve.anthropic``,
``serve.responses``), streaming is ``serve.http_stream``, bodies and error
responses ``serve.http_wire``. It translates HTTP to the session layer;
it never creates a loop, and must not block the loop it runs on.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from array import array
from typing import Any

import msgspec
from aiohttp import web

from rlengine.errors import InvalidRequest, RLEngineError
from rlengine.serve.chat_completions import ChatCompletionRequest
from rlengine.serve.http_stream import StreamDialect
from rlengine.serve.http_turns import TurnEndpoints
from rlengine.serve.http_wire import (
    RewardBody,
    SessionBody,
    error_response,
    http_error_response,
    json_response,
    read_body,
    unauthorized_response,
)
from rlengine.serve.session_types import Session
from rlengine.serve.sessions import SessionManager

__all__ = ["ChatCompletionRequest", "HttpServer", "StreamDialect"]


class HttpServer:
    """The aiohttp application and its runner on the running loop."""

    def __init__(self, sessions: SessionManager, *, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 16 << 20, write_stall_timeout_s: float = 30.0) -> None:
        self.sessions = sessions
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.url: str | None = None
        self.port: int | None = None
        """The port it listens on (once started)."""
        self.key_file: str | None = None
        """Where the drawn API key was written (``Server`` sets it); a 401 names it."""
        self._session_decoder = msgspec.json.Decoder(SessionBody)
        self._reward_decoder = msgspec.json.Decoder(RewardBody)
        self._encoder = msgspec.json.Encoder()
        self.max_body_bytes = max_body_bytes
        self.turns = TurnEndpoints(sessions, self._session_from, model_name=model_name, max_body_bytes=max_body_bytes,
                                   encode=self._encoder.encode, write_stall_timeout_s=write_stall_timeout_s)
        """The chat-turn endpoints of every API."""
        turns = self.turns
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._guard])
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id}", self.model),
            # A session's own base URL: its token is the API key (for harnesses that set only those two).
            web.post("/sessions/{session_id}/v1/chat/completions", turns.chat_completions),
            web.post("/sessions/{session_id}/v1/messages", turns.messages),
            web.post("/sessions/{session_id}/v1/responses", turns.responses),
            web.post("/sessions/{session_id}/v1/completions", turns.completions),
            web.get("/sessions/{session_id}/v1/models", self.models),
            web.get("/sessions/{session_id}/v1/models/{model_id}", self.model),
            web.post("/sessions/{session_id}/v1/reward", self.reward),
            web.post("/v1/chat/completions", turns.chat_completions),
            web.post("/v1/messages", turns.messages),
            web.post("/v1/responses", turns.responses),
            web.post("/v1/completions", turns.completions),
            web.post("/v1/sessions", self.open_session),
            web.delete("/v1/sessions/{session_id}", self.close_session),
            web.post("/v1/sessions/{session_id}/reward", self.reward),
            web.get("/v1/sessions/{session_id}/trace", self.trace),
            # Operators (behind the server's API key): unknown outcomes, and writing one off now.
            web.get("/v1/admin/leases", self.leases),
            web.post("/v1/admin/leases/{replica}/{lease_id}/write_off", self.write_off_lease),
            web.get("/v1/admin/timeline", self.timeline),
        ])
        self._runner: web.AppRunner | None = None

    @property
    def write_stall_timeout_s(self) -> float:
        """A streaming client whose socket takes nothing for this long is cut off (its turn abandoned)."""
        return self.turns.streamer.write_stall_timeout_s

    @write_stall_timeout_s.setter
    def write_stall_timeout_s(self, seconds: float) -> None:
        self.turns.streamer.write_stall_timeout_s = seconds

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: any free port); returns the base URL (``.../v1``)."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url, self.port = f"http://{shown}:{bound_port}/v1", bound_port
        return self.url

    async def stop_listening(self) -> None:
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bearer check, and OpenAI-shaped errors for everything that fails."""
        # A session's own base URL is authorized by the session's token, checked by the handler;
        # /health is open: it tells nothing but liveness, and probes (a load balancer's) carry no key.
        if self.api_key is not None and "session_id" not in request.match_info and request.path != "/health":
            auth = request.headers.get("Authorization", "")
            # OpenAI's clients send a bearer token, Anthropic's an x-api-key header.
            given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return unauthorized_response(self.key_file)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            answer = http_error_response(exc)
            if answer is None:
                raise
            return answer
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure becomes an API-shaped error
            if isinstance(exc, ConnectionError) and not isinstance(exc, RLEngineError):
                raise  # the client went away: nobody to answer (the engine's own, Unavailable..., are answered)
            return error_response(exc, anthropic=request.path.endswith("/v1/messages"))

    # -- authentication: the session a request names and proves ----------------------------

    def _session_from(self, request: web.Request, session_id: str | None,
                      token: str | None) -> tuple[Session | None, str | None]:
        """The turn's session (traced) or, for a stateless turn, its affinity hint.

        On a session's own base URL (``/sessions/<id>/v1``) the API key is the
        session's token (``Authorization: Bearer`` or ``x-api-key``). Elsewhere
        a session id (``X-Session-ID`` or the body's ``session_id``) with its
        token (``X-Session-Token`` or ``session_token``) is a session turn. A
        named session must be proven: a token field sent empty, or an id that
        names a session of this server without its token, is refused
        (``forbidden``), never served untraced. Only an id this server never
        opened, sent without a token (harnesses that name their own rollouts
        do), is an affinity hint: a stateless turn, kept on one replica."""
        path_id = request.match_info.get("session_id")
        if path_id is not None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
            return self.sessions.authorize(path_id, key, "Authorization"), None
        session_id = request.headers.get("X-Session-ID") or session_id
        header_token = request.headers.get("X-Session-Token")
        field = "X-Session-Token" if header_token is not None or token is None else "session_token"
        sent = header_token is not None or token is not None
        token = header_token or token
        if session_id is None:
            return None, None
        if not token and not sent and not self.sessions.known(session_id):
            return None, session_id
        return self.sessions.authorize(session_id, token, field), None

    def _path_session(self, request: web.Request) -> Session:
        token = request.headers.get("X-Session-Token")
        field = "X-Session-Token"
        if token is None and request.path.startswith("/sessions/"):  # the session's own base URL
            auth = request.headers.get("Authorization", "")
            token = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
            field = "Authorization"
        return self.sessions.authorize(request.match_info["session_id"], token, field)

    def _json(self, body: Any, status: int = 200) -> web.Response:
        return json_response(self._encoder.encode, body, status)

    # -- endpoints of models, health, sessions and operators -------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rlengine"}

    def _dead(self) -> web.Response | None:
        """A 503 naming the replicas that died, or None while all live (a dead engine must not look healthy)."""
        dead = {i: str(e.died) for i, e in enumerate(self.sessions.router.engines) if e.died is not None}
        if not dead:
            return None
        body = {"status": "dead", "dead_replicas": dead,
                "error": {"message": f"engine replica(s) {sorted(dead)} died: {next(iter(dead.values()))}",
                          "type": "server_error", "code": "engine_dead", "param": None}}
        return web.json_response(body, status=503)

    async def health(self, request: web.Request) -> web.Response:
        return self._dead() or self._json({"status": "ok", "replicas": len(self.sessions.router.engines)})

    async def models(self, request: web.Request) -> web.Response:
        return self._dead() or self._json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.model_name:
            body = {"error": {"message": f"model {model_id!r}: this server serves {self.model_name!r}",
                              "type": "invalid_request_error", "code": "not_found", "param": "model"}}
            return web.json_response(body, status=404)
        return self._json(self._model_card())

    async def open_session(self, request: web.Request) -> web.Response:
        body = await read_body(request, self._session_decoder) if request.can_read_body else SessionBody()
        session = self.sessions.open(body.session_id, roles=body.roles)
        root = (self.url or "").removesuffix("/v1")
        return self._json({"session_id": session.session_id, "token": session.token, "model": self.model_name,
                           "base_url": f"{root}/sessions/{session.session_id}/v1"})

    async def close_session(self, request: web.Request) -> web.Response:
        self.sessions.close(self._path_session(request))
        return self._json({"session_id": request.match_info["session_id"], "closed": True})

    async def reward(self, request: web.Request) -> web.Response:
        session = self._path_session(request)
        body = await read_body(request, self._reward_decoder)
        self.sessions.reward(session, body.value)
        return self._json({"session_id": session.session_id, "ok": True})

    async def leases(self, request: web.Request) -> web.Response:
        return self._json({"unknown": self.sessions.unknown_leases()})

    async def write_off_lease(self, request: web.Request) -> web.Response:
        try:
            replica, lease_id = int(request.match_info["replica"]), int(request.match_info["lease_id"])
        except ValueError:
            raise InvalidRequest("lease", request.match_info["lease_id"], "replica and lease id are integers") from None
        await self.sessions.write_off_lease(replica, lease_id)
        return self._json({"replica": replica, "lease_id": lease_id, "written_off": True})

    async def timeline(self, request: web.Request) -> web.Response:
        """The engines' timeline (one, shared by the replicas), rendered off the loop: a large one
        takes a while to encode, and the loop must keep serving meanwhile."""
        timeline = self.sessions.router.engines[0].timeline
        if timeline is None:
            body = {"error": {"message": "no timeline is recorded: start rlengine serve with --timeline",
                              "type": "invalid_request_error", "code": "not_found", "param": "timeline"}}
            return web.json_response(body, status=404)
        return web.Response(body=await asyncio.to_thread(timeline.to_json), content_type="application/json")

    async def trace(self, request: web.Request) -> web.Response:
        trace = self.sessions.trace(self._path_session(request))

        def ints(raw: bytes, code: str) -> list[Any]:
            return array(code, raw).tolist()

        def trajectories(trace: Any) -> list[dict[str, Any]]:
            return [{"tokens": ints(t.tokens_raw, "i"), "logprobs": ints(t.logprobs_raw, "f"),
                     "versions": ints(t.versions_raw, "i"), "loss_mask": list(t.loss_mask_raw),
                     "shared_prefix": t.shared_prefix, "reward": r,
                     "segments": [{"start": g.start, "end": g.end, "kind": g.kind, "request_id": g.request_id}
                                  for g in t.segments]}
                    for t, r in zip(trace.trajectories, trace.rewards)]

        return self._json({"session_id": trace.session_id, "turns": trace.turns, "tainted": trace.tainted,
                           "constrained": sorted(trace.constrained), "trajectories": trajectories(trace),
                           "roles": {role: trajectories(part) for role, part in trace.by_role.items()}})
