"""The OpenAI-compatible HTTP server, on the engine's own loop (aiohttp's AppRunner).

Endpoints:

* ``GET /health`` - 200 while every engine replica lives, 503 naming the dead
  ones (``GET /v1/models`` answers 503 then too);
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
* ``POST /v1/sessions`` (open; body ``{"session_id": ...}`` optional; the
  answer holds the id, the token and the session's own ``base_url``,
  ``.../sessions/<id>/v1``, on which the token is the API key: ``POST
  chat/completions``, ``messages``, ``responses``, ``reward`` and ``GET
  models`` there are that session's),
  ``GET /v1/admin/leases`` (turns with an unknown outcome, per replica) and
  ``POST /v1/admin/leases/{replica}/{lease_id}/write_off`` for operators;
  ``DELETE /v1/sessions/{id}`` (close), ``POST /v1/sessions/{id}/reward``
  (``{"value": x}``) and ``GET /v1/sessions/{id}/trace``, each with the
  session's token.

It binds 127.0.0.1 unless told otherwise; with ``api_key`` (``Server`` passes
``ServeConfig.api_key`` or the key it drew; None only with ``no_auth``) every
request must carry ``Authorization: Bearer <api_key>`` (what the ``openai``
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

This module translates HTTP to the session layer; it never creates a loop,
and must not block the loop it runs on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from array import array
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from aiohttp import web

from rlengine.constraints import json_response, tool_choice
from rlengine.core.futures import RequestFuture
from rlengine.errors import ContextLengthExceeded, InvalidRequest
from rlengine.protocol import BadMessage, Choice, Unsupported
from rlengine.render import TextStream
from rlengine.serve import anthropic, responses
from rlengine.serve.errors import HTTP_STATUS, to_serve_error
from rlengine.serve.sessions import Session, SessionManager, ToolUse, TurnResult
from rlengine.types import SamplingParams, unpack_top

__all__ = ["ChatCompletionRequest", "HttpServer"]

log = logging.getLogger("rlengine.serve")


class _ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class _FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(msgspec.Struct, frozen=True):
    function: _FunctionCall
    id: str | None = None
    type: str = "function"


class _Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The body of ``POST /v1/chat/completions`` (the fields rlengine honours or refuses; others are ignored)."""

    messages: list[_Message]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    json_whitespace: Any = None  # rlengine's: "any" allows free whitespace in constrained JSON
    session_id: str | None = None
    session_token: str | None = None


class _SessionBody(msgspec.Struct, frozen=True):
    session_id: str | None = None


class _RewardBody(msgspec.Struct, frozen=True):
    value: float


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise Unsupported(f"messages[{i}].content: only text parts are supported")
            content = "".join(p.text or "" for p in content)
        message: dict[str, Any] = {"role": m.role, "content": content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.tool_calls is not None:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                              "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        out.append(message)
    return out


def _tool_use(req: ChatCompletionRequest) -> ToolUse:
    """``tool_choice``, ``parallel_tool_calls`` and ``response_format``, checked."""
    choice, forced = tool_choice(req.tool_choice)
    return ToolUse(choice=choice, forced=forced, parallel=req.parallel_tool_calls is not False,
                   schema=json_response("response_format", req.response_format), json_whitespace=req.json_whitespace)


def _sampling(req: ChatCompletionRequest) -> SamplingParams:
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field) not in (None, 0, 0.0):
            raise Unsupported(f"{field}={getattr(req, field)!r}: penalties are not supported")
    if req.top_logprobs not in (None, 0) and not req.logprobs:
        raise InvalidRequest("top_logprobs", req.top_logprobs, "needs logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                          seed=req.seed, stop=req.stop or None, ignore_eos=req.ignore_eos,
                          top_logprobs=req.top_logprobs or 0)


def _error(exc: BaseException, anthropic: bool = False) -> web.Response:
    """The error response for ``exc``: OpenAI's shape, or Anthropic's on its Messages API."""
    err = to_serve_error(exc)
    status = HTTP_STATUS.get(err.code, 500)
    if anthropic:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            status, "invalid_request_error" if status < 500 else "api_error")
        return web.json_response({"type": "error", "error": {"type": kind, "message": f"{err.code}: {err}",
                                                              "param": err.field, "value": err.value}},
                                 status=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    # OpenAI's ``param`` names the field at fault; ``value`` (its repr) is ours.
    body = {"error": {"message": str(err), "type": kind, "code": err.code, "param": err.field, "value": err.value}}
    return web.json_response(body, status=status)


class HttpServer:
    """The aiohttp application and its runner on the running loop."""

    def __init__(self, sessions: SessionManager, *, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 16 << 20, write_stall_timeout_s: float = 30.0) -> None:
        self.sessions = sessions
        self.write_stall_timeout_s = write_stall_timeout_s
        """A streaming client whose socket takes nothing for this long is cut off (its turn abandoned)."""
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.url: str | None = None
        self.port: int | None = None
        """The port it listens on (once started)."""
        self._decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self._messages_decoder = msgspec.json.Decoder(anthropic.MessagesRequest)
        self._responses_decoder = msgspec.json.Decoder(responses.ResponsesRequest)
        self._session_decoder = msgspec.json.Decoder(_SessionBody)
        self._reward_decoder = msgspec.json.Decoder(_RewardBody)
        self._encoder = msgspec.json.Encoder()
        self.max_body_bytes = max_body_bytes
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._guard])
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id}", self.model),
            # A session's own base URL: its token is the API key (for harnesses that set only those two).
            web.post("/sessions/{session_id}/v1/chat/completions", self.chat_completions),
            web.post("/sessions/{session_id}/v1/messages", self.messages),
            web.post("/sessions/{session_id}/v1/responses", self.responses),
            web.get("/sessions/{session_id}/v1/models", self.models),
            web.get("/sessions/{session_id}/v1/models/{model_id}", self.model),
            web.post("/sessions/{session_id}/v1/reward", self.reward),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/messages", self.messages),
            web.post("/v1/responses", self.responses),
            web.post("/v1/sessions", self.open_session),
            web.delete("/v1/sessions/{session_id}", self.close_session),
            web.post("/v1/sessions/{session_id}/reward", self.reward),
            web.get("/v1/sessions/{session_id}/trace", self.trace),
            # Operators (behind the server's API key): unknown outcomes, and writing one off now.
            web.get("/v1/admin/leases", self.leases),
            web.post("/v1/admin/leases/{replica}/{lease_id}/write_off", self.write_off_lease),
        ])
        self._runner: web.AppRunner | None = None

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

    # -- middleware ---------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bearer check, and OpenAI-shaped errors for everything that fails."""
        # A session's own base URL is authorized by the session's token, checked by the handler.
        if self.api_key is not None and "session_id" not in request.match_info:
            auth = request.headers.get("Authorization", "")
            # OpenAI's clients send a bearer token, Anthropic's an x-api-key header.
            given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                body = {"error": {"message": "missing or wrong API key (Authorization: Bearer <api_key>, or x-api-key)",
                                  "type": "invalid_request_error", "code": "unauthorized", "param": None}}
                return web.json_response(body, status=401)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 413:
                body = {"error": {"message": f"request body too large: {exc.text}", "type": "invalid_request_error",
                                  "code": "frame_too_large", "param": None}}
                return web.json_response(body, status=413)
            if exc.status >= 400:
                body = {"error": {"message": exc.reason, "type": "invalid_request_error",
                                  "code": "not_found" if exc.status == 404 else "bad_message", "param": None}}
                return web.json_response(body, status=exc.status)
            raise
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes an API-shaped error
            return _error(exc, anthropic=request.path.endswith("/v1/messages"))

    # -- helpers ------------------------------------------------------------------------

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

    async def _decode(self, request: web.Request, decoder: msgspec.json.Decoder) -> Any:
        body = await request.read()
        try:
            return decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadMessage(f"bad request body: {exc}") from None

    async def _decode_turn(self, request: web.Request, decoder: msgspec.json.Decoder) -> Any:
        """A chat turn's body (any API), refused before it is read when it is too large to fit in
        the model's context whatever it holds, so a huge body costs the loop nothing."""
        renderer = self.sessions.renderer
        size = request.content_length
        if renderer is not None and size is not None and size <= self.max_body_bytes:  # larger: 413, as any
            context = self.sessions.router.engines[0].backend.max_model_len
            # JSON spells a character in at most 12 bytes (a surrogate pair as two \u escapes);
            # 1 MiB leaves room for everything around the text.
            bound = 12 * context * renderer.max_token_chars + (1 << 20)
            if size > bound:
                raise ContextLengthExceeded("body", f"{size} bytes", context, f"a body of {size} bytes is larger "
                                            f"than any request that fits in it ({bound} bytes)")
        return await self._decode(request, decoder)

    def _json(self, body: Any, status: int = 200) -> web.Response:
        return web.Response(body=self._encoder.encode(body), status=status, content_type="application/json")

    # -- handlers -----------------------------------------------------------------------

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
        body = await self._decode(request, self._session_decoder) if request.can_read_body else _SessionBody()
        session = self.sessions.open(body.session_id)
        root = (self.url or "").removesuffix("/v1")
        return self._json({"session_id": session.session_id, "token": session.token, "model": self.model_name,
                           "base_url": f"{root}/sessions/{session.session_id}/v1"})

    async def close_session(self, request: web.Request) -> web.Response:
        self.sessions.close(self._path_session(request))
        return self._json({"session_id": request.match_info["session_id"], "closed": True})

    async def reward(self, request: web.Request) -> web.Response:
        session = self._path_session(request)
        body = await self._decode(request, self._reward_decoder)
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

    async def trace(self, request: web.Request) -> web.Response:
        trace = self.sessions.trace(self._path_session(request))

        def ints(raw: bytes, code: str) -> list[Any]:
            return array(code, raw).tolist()

        return self._json({"session_id": trace.session_id, "turns": trace.turns, "tainted": trace.tainted,
                           "constrained": sorted(trace.constrained), "trajectories": [
            {"tokens": ints(t.tokens_raw, "i"), "logprobs": ints(t.logprobs_raw, "f"),
             "versions": ints(t.versions_raw, "i"), "loss_mask": list(t.loss_mask_raw),
             "shared_prefix": t.shared_prefix, "reward": r,
             "segments": [{"start": g.start, "end": g.end, "kind": g.kind, "request_id": g.request_id}
                          for g in t.segments]}
            for t, r in zip(trace.trajectories, trace.rewards)]})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise InvalidRequest("model", model, f"this server serves {self.model_name!r} (see /v1/models)")

    async def _turn(self, fut: Any) -> TurnResult:
        """The turn's result; a client that goes away abandons it (see the module docstring)."""
        try:
            return await fut
        except asyncio.CancelledError:
            if not fut.done():
                self.sessions.abandon(fut.request_id, "the HTTP client disconnected mid-generation")
            raise

    def _streamed_turn(self, session: Session | None, messages: list[dict[str, Any]], params: SamplingParams,
                       n: int, tools: Any, tool_use: ToolUse, affinity: str | None) -> tuple[Any, asyncio.Queue]:
        """Start a turn whose tokens arrive on a queue as ``(choice index, ids)``; None once it settled."""
        if self.sessions.renderer is None:
            raise Unsupported("chat: this backend has no tokenizer and chat template")
        queue: asyncio.Queue[tuple[int, list[int]] | None] = asyncio.Queue()

        def on_tokens(index: int, ids: list[int], _lps: list[float], _version: int) -> None:
            queue.put_nowait((index, ids))

        # Validation errors raise here, before any byte of the response is sent.
        fut = self.sessions.chat(session, messages, params, n, on_tokens=on_tokens, tools=tools, tool_use=tool_use,
                                 affinity=affinity)
        fut.add_done_callback(lambda _f: queue.put_nowait(None))
        return fut, queue

    @staticmethod
    async def _first_tokens(fut: Any, queue: asyncio.Queue) -> Any:
        """The first item of a streamed turn. The headers wait for it: a request the backend
        refuses (a constraint it cannot compile) still gets its error status."""
        item = await queue.get()
        if item is None and fut.exception(0) is not None:
            raise fut.exception(0)
        return item

    def _held(self, params: SamplingParams, tools: Any, tool_use: ToolUse) -> tuple[str, ...]:
        """What a stream holds back until the turn ends: the stop strings, and where a tool call may start."""
        held = tuple(params.stop_strings)
        if tools and tool_use.choice != "none" and self.sessions.tool_parser is not None:
            held += (self.sessions.tool_parser.start_marker,)
        return held

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode_turn(request, self._decoder)
        self._check_model(req.model)
        session, affinity = self._session_from(request, req.session_id, req.session_token)
        messages, params, tool_use = _messages(req), _sampling(req), _tool_use(req)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, session, affinity, messages, params, req.n, req.tools, tool_use,
                                      lambda rid: _ChatChunks(self._encoder.encode, rid, self.model_name, req.n,
                                                              include_usage))
        fut = self.sessions.chat(session, messages, params, req.n, tools=req.tools, tool_use=tool_use,
                                 affinity=affinity)
        return self._json(self._completion(await self._turn(fut), session, req.logprobs))

    def _completion(self, result: TurnResult, session: Session | None, logprobs: bool) -> dict[str, Any]:
        completion_tokens = sum(len(c.tokens_raw) // 4 for c in result.choices)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{result.request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": i, "message": self._message(c), "finish_reason": _finish_reason(c),
                         "logprobs": self._logprobs(c) if logprobs else None}
                        for i, c in enumerate(result.choices)],
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": result.prompt_tokens + completion_tokens},
        }
        if session is not None:
            body["session_id"] = session.session_id
        return body

    @staticmethod
    def _message(choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message["tool_calls"] = _tool_call_list(choice)
        return message

    def _logprobs(self, choice: Choice) -> dict[str, Any]:
        renderer = self.sessions.renderer
        assert renderer is not None
        tokens, lps = array("i", choice.tokens_raw).tolist(), array("f", choice.logprobs_raw).tolist()
        tops = unpack_top(choice.tokens_raw, choice.top_ids_raw, choice.top_logprobs_raw) or [[]] * len(tokens)

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = renderer.decode([token], skip_special=False)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        # Tokens a constraint masked out have logprob -inf, which JSON cannot carry: they are left out.
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top if alp != -math.inf]}
                            for t, lp, top in zip(tokens, lps, tops)]}

    async def _stream(self, request: web.Request, session: Session | None, affinity: str | None,
                      messages: list[dict[str, Any]], params: SamplingParams, n: int, tools: Any,
                      tool_use: ToolUse, dialect: Callable[[str], StreamDialect]) -> web.StreamResponse:
        """Stream a turn as server-sent events in ``dialect(request_id)``'s shape (every API's one loop).

        Text that may turn out to be a tool call's markup, or the stop string the
        reply ends before, is held back until the turn's end settles it. A client
        that goes away abandons the turn, with or without output sent."""
        fut, queue = self._streamed_turn(session, messages, params, n, tools, tool_use, affinity)
        events = dialect(fut.request_id)
        held = self._held(params, tools, tool_use)
        streams = [_ContentStream(self.sessions.renderer, held) for _ in range(n)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            item = await self._first_tokens(fut, queue)
            await response.prepare(request)
            await self._write(request, response, events.start())
            while item is not None:
                index, ids = item
                text = streams[index].push(ids)
                if text:
                    await self._write(request, response, events.text(index, text))
                item = await queue.get()
            exc = fut.exception(0)
            if exc is not None:
                await self._write(request, response, events.error(to_serve_error(exc)))
            else:
                result = fut.result(0)
                rests = [s.finish(c.text or "") for s, c in zip(streams, result.choices)]
                await self._write(request, response, events.finish(result, rests))
            await response.write_eof()
        except asyncio.CancelledError:
            self._abandon(fut, response)
            raise
        except ConnectionError:  # the client is gone (or was cut off): nothing to answer, nothing to log
            self._abandon(fut, response)
        return response

    def _abandon(self, fut: RequestFuture[Any], response: web.StreamResponse) -> None:
        if not fut.done():
            self.sessions.abandon(fut.request_id, "the HTTP client disconnected mid-stream",
                                  output_sent=response.prepared)

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """One event to a streaming client, bounded: a write waits only while the client's socket
        takes nothing, at most ``write_stall_timeout_s``; then the connection is dropped and the
        turn abandoned (``ConnectionResetError``), so a reader that stalls cannot hold its
        handler, or the output queued for it, for as long as it keeps the connection."""
        try:
            await asyncio.wait_for(response.write(data), self.write_stall_timeout_s)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(f"the HTTP client read nothing for write_stall_timeout_s="
                                       f"{self.write_stall_timeout_s} s") from None

    # -- Anthropic's Messages API -----------------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode_turn(request, self._messages_decoder)
        self._check_model(req.model)
        session, affinity = self._session_from(request, req.session_id, req.session_token)
        messages, tools, tool_use, params = anthropic.to_chat(req)
        if req.stream:
            return await self._stream(request, session, affinity, messages, params, 1, tools, tool_use,
                                      lambda rid: anthropic.MessageEvents(
                                          self._encoder.encode, f"msg_{rid}", self.model_name,
                                          lambda choice: self._stop_details(choice, params)))
        fut = self.sessions.chat(session, messages, params, 1, tools=tools, tool_use=tool_use, affinity=affinity)
        result = await self._turn(fut)
        choice = result.choices[0]
        return self._json(anthropic.message_body(f"msg_{result.request_id}", self.model_name, choice,
                                                 result.prompt_tokens, self._stop_details(choice, params)))

    def _stop_details(self, choice: Choice, params: SamplingParams) -> tuple[str, str | None]:
        renderer = self.sessions.renderer
        assert renderer is not None
        return anthropic.stop_details(choice, params, lambda ids: renderer.decode(ids, skip_special=False))

    # -- OpenAI's Responses API -------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode_turn(request, self._responses_decoder)
        self._check_model(req.model)
        session, affinity = self._session_from(request, req.session_id, req.session_token)
        messages, tools, tool_use, params = responses.to_chat(req)
        if req.stream:
            return await self._stream(request, session, affinity, messages, params, 1, tools, tool_use,
                                      lambda rid: responses.ResponseEvents(self._encoder.encode, rid,
                                                                           self.model_name, req))
        fut = self.sessions.chat(session, messages, params, 1, tools=tools, tool_use=tool_use, affinity=affinity)
        result = await self._turn(fut)
        return self._json(responses.response_body(result.request_id, self.model_name, req, result.choices[0],
                                                  result.prompt_tokens))


class StreamDialect(Protocol):
    """How one API spells a streamed turn (``HttpServer._stream`` runs the turn)."""

    def start(self) -> bytes: ...

    def text(self, index: int, text: str) -> bytes:
        """Content text of choice ``index``, as it is settled."""
        ...

    def error(self, err: Any) -> bytes:
        """The turn failed after the stream began (a ``ServeError``)."""
        ...

    def finish(self, result: TurnResult, rests: list[str]) -> bytes:
        """The end: ``rests[i]`` is the content choice ``i`` still owes, then its tool calls."""
        ...


class _ChatChunks:
    """Chat Completions' chunks (``data: {...}`` lines, then ``data: [DONE]``)."""

    def __init__(self, encode: Callable[[Any], bytes], request_id: str, model: str, n: int,
                 include_usage: bool) -> None:
        self.encode = encode
        self.head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}
        self.n = n
        self.include_usage = include_usage

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {**self.head, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + self.encode(body) + b"\n\n"

    def start(self) -> bytes:
        return b"".join(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]) for i in range(self.n))

    def text(self, index: int, text: str) -> bytes:
        return self.chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])

    def error(self, err: Any) -> bytes:
        body = {"error": {"message": str(err), "type": "server_error", "code": err.code}}
        return b"data: " + self.encode(body) + b"\n\n" + b"data: [DONE]\n\n"

    def finish(self, result: TurnResult, rests: list[str]) -> bytes:
        out = []
        for i, (choice, rest) in enumerate(zip(result.choices, rests)):
            if rest:
                out.append(self.text(i, rest))
            for k, call in enumerate(_tool_call_list(choice)):
                out.append(self.chunk([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]},
                                        "finish_reason": None}]))
            out.append(self.chunk([{"index": i, "delta": {}, "finish_reason": _finish_reason(choice)}]))
        if self.include_usage:
            completion_tokens = sum(len(c.tokens_raw) // 4 for c in result.choices)
            out.append(self.chunk([], {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": result.prompt_tokens + completion_tokens}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)


def _finish_reason(choice: Choice) -> str:
    return "tool_calls" if choice.tool_calls else choice.stop_reason


def _tool_call_list(choice: Choice) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls or ()]


class _ContentStream:
    """The text deltas of one streamed choice, holding back what may not be content.

    Text from where a held string (a stop string, the start of a tool call)
    begins, or could begin, is not sent while the turn runs; ``finish``
    sends what of the final content is still owed (the content the reply
    has, without stop strings and tool-call markup).
    """

    def __init__(self, renderer: Any, held: tuple[str, ...]) -> None:
        self._text = TextStream(renderer)
        self._held = held
        self._seen = ""
        self._sent = ""
        self._stopped = False

    def push(self, ids: list[int]) -> str:
        self._seen += self._text.push(ids)
        if self._stopped:
            return ""
        safe = len(self._seen)
        for marker in self._held:
            found = self._seen.find(marker, max(0, len(self._sent) - len(marker)))
            if found >= 0:
                self._stopped = True
                safe = min(safe, found)
                continue
            for k in range(min(len(marker) - 1, len(self._seen)), 0, -1):
                if marker.startswith(self._seen[-k:]):
                    safe = min(safe, len(self._seen) - k)
                    break
        if self._held:  # a newline may be the separator before a tool call, which the content drops
            safe = len(self._seen[:safe].rstrip("\n"))
        delta = self._seen[len(self._sent):safe] if safe > len(self._sent) else ""
        self._sent += delta
        return delta

    def finish(self, content: str) -> str:
        rest = content[len(self._sent):] if content.startswith(self._sent) else ""
        self._sent = content
        return rest
