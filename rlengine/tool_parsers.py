"""Tool-call parsers: what a model generated, as text, into its content and its tool calls.

Each model family writes tool calls its own way; a parser is chosen per
model (``parser_for``, from the model's chat template, or by name from the
registry) and turns a completion's text into a ``ParsedTurn``:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks after any text (Hermes, Qwen2.5, Qwen3, and rlengine's tiny
  model, whose template renders calls the same way);
* more formats are registered with ``register(name, parser_class)``.

Malformed tool-call text (a block that is not JSON, has no string
``name`` or no object ``arguments``, or is never closed) is never an error:
the whole text comes back as content, the turn has no tool calls, and the
parser counts it (``malformed``) so servers can report it.

Pure text processing: this module tokenizes nothing, stores nothing and
imports only the standard library.
"""

from __future__ import annotations

import json
import secrets
from typing import NamedTuple, Protocol

__all__ = ["PARSERS", "HermesParser", "ParsedTurn", "ToolCall", "ToolParser", "parser_for", "register"]


class ToolCall(NamedTuple):
    """One call as OpenAI's API carries it: ``arguments`` is a JSON object as text."""

    id: str
    name: str
    arguments: str


class ParsedTurn(NamedTuple):
    content: str | None
    """The text outside tool calls (None when the turn is only tool calls)."""
    tool_calls: list[ToolCall]
    malformed: bool
    """The text held tool-call markup that did not parse (it is all in ``content``)."""


class ToolParser(Protocol):
    name: str
    start_marker: str
    """The text a tool call begins with (a stream holds back content from there)."""
    malformed: int
    """How many turns held tool-call markup that did not parse."""

    def parse(self, text: str) -> ParsedTurn: ...

    def split_closing(self, rendered: str) -> tuple[str, str]:
        """A template's rendering of an assistant turn with tool calls, as (what the model would
        have generated, the template's closing after it)."""
        ...

    def call_tag(self, name: str) -> tuple[str, str, str]:
        """For constrained decoding (``rlengine.constraints``): the text before a call of
        ``name``'s JSON arguments, the text after them, and the separator between calls."""
        ...


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's shape (``call_`` and 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class HermesParser:
    """``<tool_call>`` blocks holding ``{"name": ..., "arguments": {...}}``, after the turn's text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    start_marker = OPEN
    _decoder = json.JSONDecoder()

    def __init__(self) -> None:
        self.malformed = 0

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedTurn(text, [], False)
        calls = []
        pos, end = start, len(text)
        while pos < end:
            # Each block is read as JSON up to where the object ends, so markup
            # inside a JSON string (a "</tool_call>" in an argument) is just text.
            if not text.startswith(self.OPEN, pos):
                return self._refuse(text)  # text between or after the calls
            try:
                value, pos = self._decoder.raw_decode(text, _skip_space(text, pos + len(self.OPEN)))
            except ValueError:
                return self._refuse(text)
            pos = _skip_space(text, pos)
            call = self._call(value)
            if call is None or not text.startswith(self.CLOSE, pos):
                return self._refuse(text)  # not a call, or a block never closed
            calls.append(call)
            pos = _skip_space(text, pos + len(self.CLOSE))
        content = text[:start].rstrip("\n")
        return ParsedTurn(content or None, calls, False)

    @staticmethod
    def _call(value: object) -> ToolCall | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))

    def call_tag(self, name: str) -> tuple[str, str, str]:
        # Qwen's exact layout, which the tiny template renders too: forced calls
        # are sampled as the template would re-render them.
        return f'{self.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{self.CLOSE}", "\n"

    def split_closing(self, rendered: str) -> tuple[str, str]:
        end = rendered.rfind(self.CLOSE)
        if end < 0:
            return rendered, ""
        end += len(self.CLOSE)
        return rendered[:end], rendered[end:]

    def _refuse(self, text: str) -> ParsedTurn:
        self.malformed += 1
        return ParsedTurn(text, [], True)


PARSERS: dict[str, type] = {"hermes": HermesParser}
"""Parser classes by name; ``register`` adds one."""


def register(name: str, parser: type) -> None:
    """Make ``parser`` (a class with ``name``, ``malformed`` and ``parse``) available as ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}: must be a non-empty string")
    PARSERS[name] = parser


def parser_for(chat_template: str | None, name: str | None = None) -> ToolParser | None:
    """The parser named ``name``, else the one the chat template writes calls for; None when
    the template renders no tool calls (the model has no tool format)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool_parser={name!r}: unknown; known: {', '.join(sorted(PARSERS))}")
        return PARSERS[name]()
    if chat_template and HermesParser.OPEN in chat_template:
        return HermesParser()
    return None
