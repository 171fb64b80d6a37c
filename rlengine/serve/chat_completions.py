"""OpenAI's Chat Completions API (``POST /v1/chat/completions``) in terms of the session layer's chat turns.

Pure translation, no I/O (``serve.http_turns`` serves it), as ``serve.anthropic``
and ``serve.responses``: a request becomes the chat messages, tools,
``ToolUse`` and sampling parameters of a session turn; a finished turn
becomes a ``chat.completion``, or the ``chat.completion.chunk`` stream of it.

* ``messages`` hold string content or text parts (other parts are refused
  with a typed error), assistant ``tool_calls`` and ``role: "tool"`` results;
* ``tool_choice`` (``auto``, ``none``, ``required``, a named function),
  ``parallel_tool_calls`` and ``response_format`` (``json_object``,
  ``json_schema``) go through ``rlengine.constraints``;
* penalties are refused; ``top_logprobs`` needs ``logprobs: true``;
  ``max_completion_tokens`` wins over ``max_tokens``.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.constraints import json_response, tool_choice
from rlengine.errors import InvalidRequest
from rlengine.protocol import Choice, Unsupported
from rlengine.serve.session_types import ToolUse, TurnResult
from rlengine.types import SamplingParams, unpack_top

__all__ = ["ChatChunks", "ChatCompletionRequest", "StreamOptions", "completion_body", "to_chat", "usage_of"]


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


class StreamOptions(msgspec.Struct, frozen=True):
    """``stream_options`` (Chat Completions' and Completions')."""

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
    stream_options: StreamOptions | None = None
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


def to_chat(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolUse,
                                                  SamplingParams]:
    """The request as a chat turn: messages, tools, tool use and sampling parameters."""
    messages, params, tool_use = _messages(req), _sampling(req), _tool_use(req)  # checked in this order
    return messages, req.tools, tool_use, params


def _finish_reason(choice: Choice) -> str:
    return "tool_calls" if choice.tool_calls else choice.stop_reason


def _tool_call_list(choice: Choice) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls or ()]


def usage_of(result: TurnResult) -> dict[str, int]:
    """OpenAI's ``usage`` of a finished turn (Chat Completions' and Completions')."""
    completion_tokens = sum(len(c.tokens_raw) // 4 for c in result.choices)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": result.prompt_tokens + completion_tokens}


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        message["tool_calls"] = _tool_call_list(choice)
    return message


def _logprobs(choice: Choice, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    tokens, lps = array("i", choice.tokens_raw).tolist(), array("f", choice.logprobs_raw).tolist()
    tops = unpack_top(choice.tokens_raw, choice.top_ids_raw, choice.top_logprobs_raw) or [[]] * len(tokens)

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    # Tokens a constraint masked out have logprob -inf, which JSON cannot carry: they are left out.
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top if alp != -math.inf]}
                        for t, lp, top in zip(tokens, lps, tops)]}


def completion_body(result: TurnResult, model: str, session_id: str | None, logprobs: bool,
                    decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """A ``chat.completion`` for a finished turn (``decode``: token ids -> text, special tokens kept,
    for the logprobs' tokens)."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{result.request_id}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "message": _message(c), "finish_reason": _finish_reason(c),
                     "logprobs": _logprobs(c, decode) if logprobs else None}
                    for i, c in enumerate(result.choices)],
        "usage": usage_of(result),
    }
    if session_id is not None:
        body["session_id"] = session_id
    return body


class ChatChunks:
    """Chat Completions' chunks (``data: {...}`` lines, then ``data: [DONE]``): a ``StreamDialect``."""

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
            out.append(self.chunk([], usage_of(result)))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)
