"""Anthropic's Messages API (``POST /v1/messages``) in terms of the session layer's chat turns.

Pure translation, no I/O (``serve.http_turns`` serves it): a Messages request
becomes the chat messages, tools, ``ToolUse`` and sampling parameters a
Chat Completions request would give, so both APIs share one session layer
and their turns are traced alike; a finished turn becomes a Messages
response, or the stream of its events.

* ``system`` (a string or text blocks) is the system message; user content
  is text and ``tool_result`` blocks (each becomes a ``role: "tool"`` message
  answering its ``tool_use_id``); assistant content is text, ``tool_use`` and
  ``thinking`` blocks (the thinking is the message's ``reasoning_content``).
  Other block types (images, documents) are refused with a typed error.
* ``tools`` are ``{name, description, input_schema}``; ``tool_choice``
  ``auto``, ``any`` (a call is required), ``tool`` (that one) and ``none``,
  with ``disable_parallel_tool_use``; forced choices are constrained
  decoding, as in Chat Completions.
* ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
  (required, as in Anthropic's API); ``stop_reason`` is ``end_turn``,
  ``max_tokens``, ``stop_sequence`` (with the one that matched) or
  ``tool_use``; usage counts tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.errors import InvalidRequest
from rlengine.protocol import Choice, Unsupported
from rlengine.serve.session_types import ToolUse
from rlengine.types import SamplingParams

__all__ = ["MessageEvents", "MessagesRequest", "content_blocks", "message_body", "sse", "stop_details", "to_chat"]


class _Block(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[_Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class _Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[_Block]


class _Tool(msgspec.Struct, frozen=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


class _ToolChoice(msgspec.Struct, frozen=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The body of ``POST /v1/messages`` (the fields rlengine honours or refuses; others are ignored)."""

    model: str | None = None
    messages: list[_Message]
    max_tokens: int
    system: str | list[_Block] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    json_whitespace: Any = None  # rlengine's: "any" allows free whitespace in constrained JSON
    session_id: str | None = None
    session_token: str | None = None


def _text(field: str, content: str | list[_Block] | None) -> str:
    """Text content (a string or text blocks) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise Unsupported(f"{field}[{i}].type={block.type!r}: only text blocks are supported here")
        parts.append(block.text)
    return "".join(parts)


def _user(i: int, content: list[_Block]) -> list[dict[str, Any]]:
    """A user turn's blocks: tool results (each its own tool message), then the text."""
    out, text = [], []
    for k, block in enumerate(content):
        field = f"messages[{i}].content[{k}]"
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise InvalidRequest(f"{field}.tool_use_id", block.tool_use_id, "a tool_result must name its tool_use")
            result = _text(f"{field}.content", block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})
        elif block.type == "text" and block.text is not None:
            text.append(block.text)
        else:
            raise Unsupported(f"{field}.type={block.type!r}: user content may hold text and tool_result blocks")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(i: int, content: list[_Block]) -> dict[str, Any]:
    text, calls, thinking = [], [], []
    for k, block in enumerate(content):
        field = f"messages[{i}].content[{k}]"
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "tool_use":
            if not block.name:
                raise InvalidRequest(f"{field}.name", block.name, "a tool_use must name its tool")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        else:
            raise Unsupported(f"{field}.type={block.type!r}: assistant content may hold text, tool_use and "
                              "thinking blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text("system", req.system)})
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}].role", m.role, "must be 'user' or 'assistant' (the system "
                                 "prompt is the top-level 'system')")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_user(i, m.content))
        else:
            out.append(_assistant(i, m.content))
    return out


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise Unsupported(f"tools[{i}].type={tool.type!r}: only custom tools (name, input_schema) are supported")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _tool_use(req: MessagesRequest) -> ToolUse:
    choice = req.tool_choice
    if choice is None:
        return ToolUse()
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice.name", choice.name, "tool_choice 'tool' must name the tool")
        return ToolUse(choice="function", forced=choice.name, parallel=parallel)
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type not in kinds:
        raise InvalidRequest("tool_choice.type", choice.type, "must be 'auto', 'any', 'tool' or 'none'")
    return ToolUse(choice=kinds[choice.type], parallel=parallel)


def to_chat(req: MessagesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolUse,
                                            SamplingParams]:
    """The request as a chat turn: messages, tools, tool use and sampling parameters."""
    if req.max_tokens < 1:
        raise InvalidRequest("max_tokens", req.max_tokens, "must be >= 1")
    params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                            stop=list(req.stop_sequences) if req.stop_sequences else None)
    tool_use = msgspec.structs.replace(_tool_use(req), json_whitespace=req.json_whitespace)
    return _messages(req), _tools(req), tool_use, params


def stop_details(choice: Choice, params: SamplingParams, decode: Callable[[list[int]], str]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a finished completion."""
    if choice.tool_calls:
        return "tool_use", None
    if choice.stop_reason == "length":
        return "max_tokens", None
    if params.stop_strings:
        text = decode(choice.tokens)
        found = [(text.find(s), s) for s in params.stop_strings if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def content_blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.text:
        blocks.append({"type": "text", "text": choice.text})
    for call in choice.tool_calls or ():
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks


def message_body(message_id: str, model: str, choice: Choice, prompt_tokens: int, stop: tuple[str, str | None],
                 ) -> dict[str, Any]:
    """A Messages response for one completion."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice), "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(choice.tokens_raw) // 4}}


def sse(encode: Callable[[Any], bytes], event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic streams them (``event:`` then ``data:``)."""
    return b"event: " + event.encode() + b"\ndata: " + encode({"type": event, **data}) + b"\n\n"


class MessageEvents:
    """The events of one streamed message (``serve.http_stream``'s ``StreamDialect``): ``message_start``,
    a text block as its text settles, a ``tool_use`` block per call, ``message_delta``, ``message_stop``."""

    def __init__(self, encode: Callable[[Any], bytes], message_id: str, model: str,
                 stop: Callable[[Choice], tuple[str, str | None]]) -> None:
        self.encode = encode
        self.message_id = message_id
        self.model = model
        self.stop = stop
        self.text_open = False

    def event(self, kind: str, **data: Any) -> bytes:
        return sse(self.encode, kind, data)

    def start(self) -> bytes:
        return self.event("message_start", message={
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})

    def text(self, index: int, text: str) -> bytes:
        out = b""
        if not self.text_open:
            self.text_open = True
            out = self.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        return out + self.event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    def error(self, err: Any) -> bytes:
        return self.event("error", error={"type": "api_error", "message": f"{err.code}: {err}"})

    def finish(self, result: Any, rests: list[str]) -> bytes:
        choice = result.choices[0]
        out = self.text(0, rests[0]) if rests[0] else b""
        if self.text_open:
            out += self.event("content_block_stop", index=0)
        for k, call in enumerate(choice.tool_calls or (), start=int(self.text_open)):
            out += self.event("content_block_start", index=k, content_block={
                "type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            out += self.event("content_block_delta", index=k,
                              delta={"type": "input_json_delta", "partial_json": call.arguments})
            out += self.event("content_block_stop", index=k)
        reason, sequence = self.stop(choice)
        out += self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                          usage={"input_tokens": result.prompt_tokens, "output_tokens": len(choice.tokens_raw) // 4})
        return out + self.event("message_stop")
