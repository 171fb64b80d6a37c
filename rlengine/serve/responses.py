"""OpenAI's Responses API (``POST /v1/responses``) in terms of the session layer's chat turns.

Pure translation, no I/O (``serve.http_turns`` serves it), as ``serve.anthropic``:

* ``input`` is a string or a list of items: messages (``user``, ``system``,
  ``developer``, ``assistant``; string content or ``input_text`` /
  ``output_text`` parts), ``function_call`` items (folded into the
  assistant message before them, so a resent tool-call turn is the message
  the session recorded), ``function_call_output`` items (tool messages
  answering their ``call_id``) and ``reasoning`` items (the next assistant
  message's ``reasoning_content``); ``instructions`` is the system message.
* function ``tools`` (``{type, name, description, parameters}``),
  ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``,
  ``json_object``, ``json_schema``: constrained decoding, as in Chat
  Completions), ``max_output_tokens``, ``temperature``, ``top_p``.
* The response holds a ``message`` item with the text and one
  ``function_call`` item per call; streamed, the events of Responses
  streaming (``response.created`` ... ``response.completed``).

Responses are not stored: ``previous_response_id`` is refused (send the whole
input; a session keeps the exact trace either way).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.constraints import json_response, tool_choice
from rlengine.errors import InvalidRequest
from rlengine.protocol import Choice, Unsupported
from rlengine.serve.session_types import ToolUse
from rlengine.types import SamplingParams

__all__ = ["ResponseEvents", "ResponsesRequest", "response_body", "to_chat"]


class _Part(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class _Item(msgspec.Struct, frozen=True):
    type: str | None = None
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None
    summary: list[_Part] | None = None
    id: str | None = None


class _Text(msgspec.Struct, frozen=True):
    format: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The body of ``POST /v1/responses`` (the fields rlengine honours or refuses; others are ignored)."""

    model: str | None = None
    input: str | list[_Item]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: _Text | None = None
    stream: bool = False
    previous_response_id: str | None = None
    json_whitespace: Any = None  # rlengine's: "any" allows free whitespace in constrained JSON
    session_id: str | None = None
    session_token: str | None = None


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _text(field: str, content: str | list[_Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text", "summary_text") or part.text is None:
            raise Unsupported(f"{field}[{i}].type={part.type!r}: only text parts are supported")
        parts.append(part.text)
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    reasoning: list[str] = []
    for i, item in enumerate(req.input):
        field = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise InvalidRequest(f"{field}.role", item.role, f"must be one of {sorted(_ROLES)}")
            message: dict[str, Any] = {"role": role, "content": _text(f"{field}.content", item.content)}
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            out.append(message)
        elif kind == "function_call":
            if not item.name or not item.call_id:
                raise InvalidRequest(f"{field}.name" if not item.name else f"{field}.call_id",
                                     item.name if not item.name else item.call_id, "a function_call needs both")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning:
                    last["reasoning_content"] = "".join(reasoning)
                    reasoning = []
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not item.call_id:
                raise InvalidRequest(f"{field}.call_id", item.call_id, "a function_call_output must name its call")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(f"{field}.output", item.output)})
        elif kind == "reasoning":
            reasoning.append(_text(f"{field}.summary", item.summary))
        else:
            raise Unsupported(f"{field}.type={kind!r}: input items may be messages, function_call, "
                              "function_call_output and reasoning")
    return out


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise Unsupported(f"tools[{i}].type={kind!r}: only function tools are supported")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_use(req: ResponsesRequest) -> ToolUse:
    choice, forced = tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # the Responses layout: schema at the top
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {"type": "object"})}}
    return ToolUse(choice=choice, forced=forced, parallel=req.parallel_tool_calls is not False,
                   schema=json_response("text.format", fmt), json_whitespace=req.json_whitespace)


def to_chat(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolUse,
                                             SamplingParams]:
    """The request as a chat turn: messages, tools, tool use and sampling parameters."""
    if req.previous_response_id is not None:
        raise Unsupported("previous_response_id: responses are not stored here; send the whole input "
                          "(a session traces the conversation exactly either way)")
    params = SamplingParams(max_tokens=req.max_output_tokens,
                            temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p)
    return _messages(req), _tools(req), _tool_use(req), params


def _items(response_id: str, choice: Choice) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if choice.text:
        items.append({"type": "message", "id": f"msg_{response_id}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": choice.text, "annotations": [], "logprobs": []}]})
    for k, call in enumerate(choice.tool_calls or ()):
        items.append({"type": "function_call", "id": f"fc_{response_id}_{k}", "call_id": call.id,
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def response_body(response_id: str, model: str, req: ResponsesRequest, choice: Choice | None, prompt_tokens: int,
                  created: int | None = None) -> dict[str, Any]:
    """A Responses object: in progress (``choice`` None) or finished."""
    body: dict[str, Any] = {
        "id": f"resp_{response_id}", "object": "response", "created_at": created or int(time.time()),
        "model": model, "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "temperature": req.temperature, "top_p": req.top_p, "text": {"format": {"type": "text"}}
        if req.text is None or req.text.format is None else {"format": req.text.format},
        "truncation": "disabled", "metadata": {}, "usage": None,
    }
    if choice is not None:
        output_tokens = len(choice.tokens_raw) // 4
        length = choice.stop_reason == "length"
        body.update(status="incomplete" if length else "completed", output=_items(response_id, choice),
                    incomplete_details={"reason": "max_output_tokens"} if length else None,
                    usage={"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                           "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": prompt_tokens + output_tokens})
    return body


class ResponseEvents:
    """The server-sent events of one streamed response, numbered in order (``serve.http_stream``'s
    ``StreamDialect``)."""

    def __init__(self, encode: Callable[[Any], bytes], response_id: str, model: str, req: ResponsesRequest) -> None:
        self.encode = encode
        self.response_id = response_id
        self.model = model
        self.req = req
        self.created = int(time.time())
        self.started = response_body(response_id, model, req, None, 0, self.created)
        self.sequence = 0
        self.text_open = False

    def start(self) -> bytes:
        return (self.event("response.created", response=self.started)
                + self.event("response.in_progress", response=self.started))

    def error(self, err: Any) -> bytes:
        failed = {**self.started, "status": "failed", "error": {"code": err.code, "message": str(err)}}
        return self.event("response.failed", response=failed)

    def event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + self.encode(body) + b"\n\n"

    @property
    def _message_id(self) -> str:
        return f"msg_{self.response_id}"

    def text(self, index: int, delta: str) -> bytes:
        """A text delta (opening the message item and its text part first)."""
        out = b""
        if not self.text_open:
            self.text_open = True
            out += self.event("response.output_item.added", output_index=0, item={
                "type": "message", "id": self._message_id, "status": "in_progress", "role": "assistant",
                "content": []})
            out += self.event("response.content_part.added", item_id=self._message_id, output_index=0,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        return out + self.event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                content_index=0, delta=delta, logprobs=[])

    def finish(self, result: Any, rests: list[str]) -> bytes:
        """The text still owed, then close it, send every function call, and complete the response."""
        out = self.text(0, rests[0]) if rests[0] else b""
        final = response_body(result.request_id, self.model, self.req, result.choices[0], result.prompt_tokens,
                              self.created)
        items = final["output"]
        for index, item in enumerate(items):
            if item["type"] == "message":
                part = item["content"][0]
                out += self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[])
                out += self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)
            else:
                out += self.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"})
                out += self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"])
                out += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"], name=item["name"])
            out += self.event("response.output_item.done", output_index=index, item=item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self.event(kind, response=final)

