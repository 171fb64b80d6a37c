"""Chat rendering, in one place: messages -> template text -> token ids.

Everything that turns chat messages into tokens goes through this module:
the session layer (exact traces, below), the HTTP endpoints, and the
in-process ``SamplingClient.render_chat_completion`` (``render_chat``). It
also checks what a request brings for the template: messages, with tool
calls and tool results (``normalize_messages``, ``check_tool_results``), and
OpenAI function tools (``normalize_tools``).

For exact traces only the new suffix of a conversation is tokenized.

A chat client resends its whole conversation each turn. Re-tokenizing it
would not give back the tokens the model sampled (BPE is not reversible), so
the session layer keeps the conversation as stored tokens and asks this
module for the *text that follows them*: the template's rendering of the new
messages (plus any template glue still owed after a sampled turn), which is
the only text that gets tokenized.

A ``Boundary`` says what a stored position means in text: the rendering of
the first ``count`` messages (with the generation prompt if ``generation``)
equals the stored tokens' text followed by ``tail``. After a sampled turn
ending in ``<|im_end|>``, ChatML still owes ``"\\n"``; after a turn cut by
``max_tokens`` it owes ``"<|im_end|>\\n"``. Then

    suffix(messages, b) = b.tail + render(messages, gen=True)[len(render(messages[:b.count], b.generation)):]

which needs the template to be *prefix-stable* (rendering more messages
only appends text). Where it is not, ``suffix_text`` returns None and the
caller falls back to an earlier boundary (ultimately the root): a branch,
never a silent re-tokenization of sampled text.

Tools are rendered before the first message, so they are part of every
position's identity. A sampled turn that made tool calls stands for the
message the client sends back (its text and calls): the template may write
the calls' JSON otherwise than the model did, and the stored tokens are the
sampled ones; ``assistant_tail`` accepts the turn when the template's
rendering of it reads back (through the model's tool parser) as the same
calls, and owes only the template's closing after them.

Two renderers: ``TemplateRenderer`` over a Hugging Face tokenizer and its
chat template, and ``ByteRenderer`` for tokenizer-less backends (the sim):
a plain-text template over UTF-8 bytes as token ids.

This module renders and (de)tokenizes; it must not store anything or touch
the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

from rlengine.errors import InvalidRequest

__all__ = [
    "Boundary",
    "ByteRenderer",
    "ChatRenderer",
    "TemplateRenderer",
    "TextStream",
    "assistant_tail",
    "check_tool_results",
    "input_chars",
    "message_key",
    "normalize_messages",
    "normalize_tools",
    "render_chat",
    "suffix_text",
]


class Boundary(NamedTuple):
    """A stored position of a session and the text it stands for (see the module docstring)."""

    handle: int
    count: int
    generation: bool
    tail: str


class ChatRenderer(Protocol):
    """What the session layer needs from a tokenizer and chat template."""

    name: str
    stop_ids: frozenset[int]
    """Tokens that end an assistant turn (their text belongs to the template's closing)."""
    max_token_chars: int
    """The most characters one token's text can hold: a text longer than ``n * max_token_chars``
    cannot fit in ``n`` tokens (``input_chars`` checks requests against it before rendering)."""

    def render(self, messages: list[dict[str, Any]], generation: bool,
               tools: list[dict[str, Any]] | None = None) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _get(m: Any, key: str) -> Any:
    return m.get(key) if isinstance(m, dict) else getattr(m, key, None)


def input_chars(messages: Any, tools: Any = None) -> int:
    """The characters of text a chat request carries (contents, tool calls, tool schemas), counted
    without rendering or parsing anything, so that one too large for the model's context is refused
    before it costs any rendering or tokenization (``ChatRenderer.max_token_chars``)."""
    total = 0 if not tools else len(msgspec.json.encode(tools))
    if not isinstance(messages, (list, tuple)):
        return total
    for m in messages:
        for key in ("content", "reasoning_content", "name", "tool_call_id"):
            value = _get(m, key)
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, (list, tuple)):  # content parts
                total += sum(len(t) for t in (_get(part, "text") for part in value) if isinstance(t, str))
        calls = _get(m, "tool_calls")
        if isinstance(calls, (list, tuple)):
            total += len(msgspec.json.encode(calls))
    return total


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts for a chat template; bad ones raise ``InvalidRequest`` naming the field.

    Each is ``{"role", "content"}`` (text), with ``name``, ``tool_call_id`` (a
    tool result) or ``reasoning_content`` when given; an assistant message may
    carry ``tool_calls`` (OpenAI's shape, its ``arguments`` a JSON object as
    text or as an object), kept as ``{"id", "type": "function", "function":
    {"name", "arguments": {...}}}`` (the shape chat templates render), and
    then its ``content`` may be None (rendered as no text).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages", messages, "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        role, content = _get(m, "role"), _get(m, "content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role", role, "must be a non-empty string")
        calls = _get(m, "tool_calls")
        if calls is not None:
            if role != "assistant":
                raise InvalidRequest(f"messages[{i}].tool_calls", role, "only assistant messages carry tool calls")
            if content is None:
                content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content", content, "must be a string")
        message: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = _get(m, key)
            if value is not None:
                if not isinstance(value, str):
                    raise InvalidRequest(f"messages[{i}].{key}", value, "must be a string")
                message[key] = value
        if role == "tool" and "tool_call_id" not in message:
            raise InvalidRequest(f"messages[{i}].tool_call_id", None, "a tool message answers a call: give its id")
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        out.append(message)
    return out


def _tool_calls(calls: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(calls, (list, tuple)):
        raise InvalidRequest(field, calls, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        where = f"{field}[{j}]"
        function = _get(call, "function")
        name, arguments = _get(function, "name"), _get(function, "arguments")
        if function is None or not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.function.name", name, "must be a function name (1-64 of A-Za-z0-9_.-)")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise InvalidRequest(f"{where}.function.arguments", arguments, f"not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{where}.function.arguments", arguments, "must be a JSON object")
        call_id = _get(call, "id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest(f"{where}.id", call_id, "must be a string")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI function tools, checked (``InvalidRequest`` naming the field); None or [] is no tools."""
    if not tools:
        return None
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequest("tools", tools, "must be a list of tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        if _get(tool, "type") != "function":
            raise InvalidRequest(f"tools[{i}].type", _get(tool, "type"), "must be 'function'")
        function = _get(tool, "function")
        name = _get(function, "name")
        if function is None or not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].function.name", name, "must be a function name (1-64 of A-Za-z0-9_.-)")
        if name in names:
            raise InvalidRequest(f"tools[{i}].function.name", name, "is given twice")
        names.add(name)
        entry: dict[str, Any] = {"name": name}
        description = _get(function, "description")
        if description is not None:
            if not isinstance(description, str):
                raise InvalidRequest(f"tools[{i}].function.description", description, "must be a string")
            entry["description"] = description
        parameters = _get(function, "parameters")
        if parameters is not None:
            if not isinstance(parameters, dict) or not isinstance(parameters.get("type", "object"), str):
                raise InvalidRequest(f"tools[{i}].function.parameters", parameters, "must be a JSON schema object")
            entry["parameters"] = parameters
        out.append({"type": "function", "function": entry})
    return out


def check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call an earlier assistant message made."""
    called: set[str | None] = set()
    for i, m in enumerate(messages):
        called.update(call["id"] for call in m.get("tool_calls", ()))
        # Calls without ids (written in a framework's own shape) can be answered by any id.
        if m["role"] == "tool" and m["tool_call_id"] not in called and None not in called:
            raise InvalidRequest(f"messages[{i}].tool_call_id", m["tool_call_id"],
                                 "answers no tool call of an earlier assistant message")


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message for matching a resent history: its role, text, name, the
    calls it makes (names and arguments, not the ids a framework may rewrite) and what it answers."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls", ()))
    return (message["role"], message["content"], message.get("name"), calls, message.get("tool_call_id"),
            message.get("reasoning_content"))


def suffix_text(renderer: ChatRenderer, messages: list[dict[str, Any]], boundary: Boundary,
                full: str | None = None, tools: list[dict[str, Any]] | None = None) -> str | None:
    """The text to tokenize after ``boundary`` for ``messages`` (+ generation prompt), or None
    if the template does not render ``messages`` as an extension of the boundary's text."""
    if full is None:
        full = renderer.render(messages, True, tools)
    if boundary.count == 0 and not boundary.generation:
        return boundary.tail + full
    head = renderer.render(messages[:boundary.count], boundary.generation, tools)
    if not full.startswith(head):
        return None
    return boundary.tail + full[len(head):]


def assistant_tail(renderer: ChatRenderer, messages: list[dict[str, Any]], reply: dict[str, Any],
                   sampled: Sequence[int], before: str | None = None, tools: list[dict[str, Any]] | None = None,
                   parser: Any = None) -> str | None:
    """What the template still owes after the sampled tokens of an assistant turn.

    ``reply`` is the assistant message as returned to the client (its text,
    and its tool calls if it made any). The template's rendering of it must
    be the model's own output plus a closing: the text verbatim, and tool
    calls that ``parser`` reads back as the same calls (the template may
    write their JSON differently than the model did: the trace keeps what was
    sampled). None otherwise (then the turn's end is not a boundary, and a
    conversation continuing from it branches at the previous one).
    ``before`` is ``renderer.render(messages, True, tools)`` if the caller has it.
    """
    if before is None:
        before = renderer.render(messages, True, tools)
    after = renderer.render([*messages, reply], False, tools)
    if not after.startswith(before):
        return None
    rendered = after[len(before):]
    content = reply["content"]
    if reply.get("tool_calls"):
        if parser is None:
            return None
        body, closing = parser.split_closing(rendered)
        again = parser.parse(body)
        if (again.content or "") != content or [(c.name, json.loads(c.arguments)) for c in again.tool_calls] != [
                (c["function"]["name"], c["function"]["arguments"]) for c in reply["tool_calls"]]:
            return None
    elif rendered.startswith(content):
        closing = rendered[len(content):]
    else:
        return None
    if sampled and sampled[-1] in renderer.stop_ids:
        stop_text = renderer.decode([sampled[-1]], skip_special=False)
        if closing.startswith(stop_text):
            return closing[len(stop_text):]
    return closing


class TemplateRenderer:
    """A Hugging Face tokenizer and its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("tokenizer", type(tokenizer).__name__, "has no chat template")
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        stop = set()
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stop.add(eos)
        # Every special token can end a turn in a chat model's output (ChatML
        # models emit <|im_end|>, sometimes <|endoftext|>).
        stop.update(int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ())
        self.stop_ids = frozenset(stop)
        # Vocabulary strings are at least as long as their text (byte-level BPE
        # spells each byte as one character; SentencePiece's "▁" is one space).
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)

    def render(self, messages: list[dict[str, Any]], generation: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation)
        except TemplateError as exc:
            raise InvalidRequest("messages", "chat", f"the chat template rejected them: {exc}") from None

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def render_chat(tokenizer: Any, messages: Any, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` under ``tokenizer``'s chat template.

    Equal to ``tokenizer.apply_chat_template(messages, tokenize=True,
    add_generation_prompt=...)`` (which also renders, then tokenizes the text
    without special tokens); bad messages raise ``InvalidRequest``.
    """
    renderer = TemplateRenderer(tokenizer)
    return renderer.encode(renderer.render(normalize_messages(messages), bool(add_generation_prompt)))


class ByteRenderer:
    """UTF-8 bytes as token ids under a plain-text template, for backends without a tokenizer.

    The sim backend's vocabulary (256 by default) is exactly the byte range,
    so chat, traces and the HTTP endpoint run on it without a model. Ids
    above 255 decode to U+FFFD. It has no stop tokens: turns end by length
    or stop strings.
    """

    name = "bytes"
    stop_ids: frozenset[int] = frozenset()
    max_token_chars = 1

    def render(self, messages: list[dict[str, Any]], generation: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
            raise InvalidRequest("tools", "bytes", "the byte renderer (a backend without a tokenizer) has no tool "
                                 "format; serve a model with a chat template that renders tools")
        text = "".join(f"<{m['role']}>\n{m['content']}\n</{m['role']}>\n" for m in messages)
        return text + "<assistant>\n" if generation else text

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        if max(ids, default=0) < 256:
            return bytes(ids).decode("utf-8", "replace")
        out = bytearray()
        for t in ids:
            out += bytes((t,)) if t < 256 else "\ufffd".encode()
        return out.decode("utf-8", "replace")


class TextStream:
    """Incremental detokenization of one sequence: text deltas as tokens arrive.

    Decodes a short window (from the last emitted boundary) instead of the
    whole sequence each time, and holds text back while it ends in an
    incomplete UTF-8 character (U+FFFD), so the concatenated deltas equal
    the decode of all tokens for byte-level BPE.
    """

    __slots__ = ("_prefix", "_read", "_renderer", "_tokens", "sent")

    def __init__(self, renderer: ChatRenderer) -> None:
        self._renderer = renderer
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0
        self.sent = ""

    def push(self, ids: Sequence[int]) -> str:
        self._tokens.extend(ids)
        decode = self._renderer.decode
        before = decode(self._tokens[self._prefix:self._read])
        now = decode(self._tokens[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self._tokens)
        self.sent += delta
        return delta

    def finish(self, content: str) -> str:
        """The rest of ``content`` (the turn's final text) not yet emitted."""
        if content.startswith(self.sent):
            rest = content[len(self.sent):]
            self.sent = content
            return rest
        return ""
