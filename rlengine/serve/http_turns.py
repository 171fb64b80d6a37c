"""The turn endpoints of every API: Chat Completions, Anthropic's Messages, OpenAI's Responses, Completions.

Each endpoint reads its body (refused unread when it could not fit in the
model's context, whatever it holds), checks the model, resolves the
request's session (``serve.http`` authenticates), translates the request
with its API's module (``serve.chat_completions``, ``serve.anthropic``,
``serve.responses``) into one session-layer chat turn, or (legacy
Completions, ``serve.completions``) into a token turn, then streams it
(``serve.http_stream``) or answers it whole. A ``max_tokens`` (by each API's
name for it) that the context cannot hold after the prompt is refused, 400
``context_length_exceeded`` naming the field, as OpenAI and Anthropic refuse
it. A turn in a session may name its agent role in the ``X-RLEngine-Role``
header (``SessionManager.role_of`` checks it; a bad one is 400 naming the
header); its completions are recorded under that role. A client that
disconnects mid-generation cancels its handler, which
abandons the turn (``SessionManager.abandon``): it is aborted and its lease
settled.

Runs on the engine's loop and must not block it.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from rlengine.core.futures import RequestFuture
from rlengine.errors import ContextLengthExceeded, InvalidRequest
from rlengine.protocol import Choice, Unsupported
from rlengine.serve import anthropic, chat_completions, completions, responses
from rlengine.serve.http_stream import TurnStreamer
from rlengine.serve.http_wire import json_response, read_body
from rlengine.serve.session_types import Session, ToolUse, TurnResult
from rlengine.serve.sessions import ROLE_HEADER, OnTokens, SessionManager
from rlengine.types import SamplingParams

__all__ = ["SessionOf", "TurnEndpoints"]

SessionOf = Callable[[web.Request, str | None, str | None], tuple[Session | None, str | None]]
"""A request's session (traced) or, for a stateless turn, its affinity hint, from the request and
its body's ``session_id`` and ``session_token`` (``HttpServer``'s, which authenticates it)."""


class TurnEndpoints:
    """The handlers of ``POST .../chat/completions``, ``.../messages`` and ``.../responses``."""

    def __init__(self, sessions: SessionManager, session_of: SessionOf, *, model_name: str, max_body_bytes: int,
                 encode: Callable[[Any], bytes], write_stall_timeout_s: float) -> None:
        self.sessions = sessions
        self.session_of = session_of
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.encode = encode
        self.streamer = TurnStreamer(sessions, write_stall_timeout_s)
        self._chat_decoder = msgspec.json.Decoder(chat_completions.ChatCompletionRequest)
        self._messages_decoder = msgspec.json.Decoder(anthropic.MessagesRequest)
        self._responses_decoder = msgspec.json.Decoder(responses.ResponsesRequest)
        self._completions_decoder = msgspec.json.Decoder(completions.CompletionRequest)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req, session, affinity, role = await self._begin(request, self._chat_decoder)
        messages, tools, tool_use, params = chat_completions.to_chat(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return await self.streamer.stream(request, session, affinity, messages, params, req.n, tools, tool_use,
                                              lambda rid: chat_completions.ChatChunks(
                                                  self.encode, rid, self.model_name, req.n, include_usage), field,
                                              role)
        result = await self._turn(session, affinity, messages, params, req.n, tools, tool_use, field, role)
        return json_response(self.encode, chat_completions.completion_body(
            result, self.model_name, None if session is None else session.session_id, req.logprobs, self._decode))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        req, session, affinity, role = await self._begin(request, self._messages_decoder)
        messages, tools, tool_use, params = anthropic.to_chat(req)
        if req.stream:
            return await self.streamer.stream(request, session, affinity, messages, params, 1, tools, tool_use,
                                              lambda rid: anthropic.MessageEvents(
                                                  self.encode, f"msg_{rid}", self.model_name,
                                                  lambda choice: self._stop_details(choice, params)), "max_tokens",
                                              role)
        result = await self._turn(session, affinity, messages, params, 1, tools, tool_use, "max_tokens", role)
        choice = result.choices[0]
        return json_response(self.encode, anthropic.message_body(
            f"msg_{result.request_id}", self.model_name, choice, result.prompt_tokens,
            self._stop_details(choice, params)))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        req, session, affinity, role = await self._begin(request, self._responses_decoder)
        messages, tools, tool_use, params = responses.to_chat(req)
        if req.stream:
            return await self.streamer.stream(request, session, affinity, messages, params, 1, tools, tool_use,
                                              lambda rid: responses.ResponseEvents(self.encode, rid,
                                                                                   self.model_name, req),
                                              "max_output_tokens", role)
        result = await self._turn(session, affinity, messages, params, 1, tools, tool_use, "max_output_tokens",
                                  role)
        return json_response(self.encode, responses.response_body(result.request_id, self.model_name, req,
                                                                  result.choices[0], result.prompt_tokens))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Legacy Completions: a token turn (traced like ``generate`` in a session), its prompt
        tokenized off the loop when long, as a chat turn's is rendered."""
        req, session, affinity, role = await self._begin(request, self._completions_decoder)
        prompt, params = completions.to_turn(req)
        renderer = self.sessions.renderer
        if renderer is None:
            raise Unsupported("completions: this backend has no tokenizer")
        if isinstance(prompt, str):
            context = self.sessions.router.engines[0].backend.max_model_len
            if len(prompt) > context * renderer.max_token_chars:  # refused before any tokenization
                raise ContextLengthExceeded("prompt", f"{len(prompt)} characters", context,
                                            f"{len(prompt)} characters cannot fit in it (a token holds at most "
                                            f"{renderer.max_token_chars} characters)")
            text = prompt
            if len(prompt) < self.sessions.offload_chars:
                ids = renderer.encode(prompt)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(None, renderer.encode, prompt)
        else:
            ids, text = prompt, None
        raw = array("i", ids).tobytes()
        echo = (text if text is not None else self._decode(ids)) if req.echo else None
        logprobs = req.logprobs is not None

        def start(on_tokens: OnTokens | None = None) -> RequestFuture[TurnResult]:
            return self.sessions.generate(session, raw, params, req.n, on_tokens, text=True, affinity=affinity,
                                          max_tokens_field="max_tokens", role=role)

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return await self.streamer.stream_turn(request, start, req.n, tuple(params.stop_strings),
                                                   lambda rid: completions.CompletionChunks(
                                                       self.encode, rid, self.model_name, req.n, echo, logprobs,
                                                       include_usage, self._decode))
        result = await self._settle(start())
        return json_response(self.encode, completions.completion_body(
            result, self.model_name, None if session is None else session.session_id, echo, logprobs, self._decode))

    async def _begin(self, request: web.Request,
                     decoder: msgspec.json.Decoder) -> tuple[Any, Session | None, str | None, str | None]:
        """The request's body (any API), its model checked, its session or affinity hint, and the
        agent role it names (``ROLE_HEADER``), checked against the session."""
        req = await self._decode_turn(request, decoder)
        self._check_model(req.model)
        session, affinity = self.session_of(request, req.session_id, req.session_token)
        return req, session, affinity, self.sessions.role_of(session, request.headers.get(ROLE_HEADER))

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
        return await read_body(request, decoder)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise InvalidRequest("model", model, f"this server serves {self.model_name!r} (see /v1/models)")

    async def _turn(self, session: Session | None, affinity: str | None, messages: list[dict[str, Any]],
                    params: SamplingParams, n: int, tools: Any, tool_use: ToolUse, max_tokens_field: str,
                    role: str | None) -> TurnResult:
        """A chat turn answered whole."""
        return await self._settle(self.sessions.chat(session, messages, params, n, tools=tools, tool_use=tool_use,
                                                     affinity=affinity, max_tokens_field=max_tokens_field, role=role))

    async def _settle(self, fut: RequestFuture[TurnResult]) -> TurnResult:
        """A turn's result; a client that goes away abandons it (see the module docstring)."""
        try:
            return await fut
        except asyncio.CancelledError:
            if not fut.done():
                self.sessions.abandon(fut.request_id, "the HTTP client disconnected mid-generation")
            raise

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept (logprobs' tokens, stop sequences)."""
        renderer = self.sessions.renderer
        assert renderer is not None
        return renderer.decode(ids, skip_special=False)

    def _stop_details(self, choice: Choice, params: SamplingParams) -> tuple[str, str | None]:
        return anthropic.stop_details(choice, params, self._decode)
