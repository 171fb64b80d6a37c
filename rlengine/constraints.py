"""What an API request forces the output to be, as one xgrammar structural tag.

Constrained decoding takes one ``SamplingParams.constraint``: an xgrammar
structural tag as JSON text (``{"type": "structural_tag", "format": ...}``),
which the torch backend compiles with xgrammar and vLLM with its own
structured outputs. ``output_constraint`` builds it from what the APIs say:

* ``tool_choice="required"``: one or more tool calls (at most one when
  ``parallel`` is False) and nothing else; ``tool_choice={"name": ...}``: one
  call of that function. Each call is written in the model's own tool-call
  syntax (the parser's ``call_tag``: for Hermes/Qwen ``<tool_call>\\n{"name":
  "f", "arguments": `` *JSON matching the tool's parameters* ``}\\n</tool_call>``),
  so a forced call is sampled, parsed and traced exactly as a free one;
* a JSON response (``json_object``: any JSON object; ``json_schema``: that
  schema) with ``tool_choice`` ``none`` or no tools: the JSON only; with
  ``auto`` tools: either the JSON or tool calls;
* otherwise None: nothing is constrained.

JSON under a constraint is compact by default: no free whitespace (the one
layout ``json.dumps`` writes) and numbers of bounded length, so a forced call
closes within its arguments' own length (``backends.grammar.json_layout``,
which every backend compiles with). ``json_whitespace="any"`` (the request
field of the same name on every endpoint) allows free whitespace instead; it
travels as the structural tag's top-level ``json_whitespace``.

Pure data: this module compiles nothing (the backend does, on its compute
thread) and imports only the standard library and the errors.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from rlengine.errors import InvalidRequest

__all__ = ["CallSyntax", "json_response", "json_whitespace", "output_constraint", "tool_choice"]


class CallSyntax(Protocol):
    """What a tool parser (``rlengine.tool_parsers``) tells constrained decoding."""

    def call_tag(self, name: str) -> tuple[str, str, str]: ...


_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_choice(value: Any) -> tuple[str, str | None]:
    """An OpenAI ``tool_choice`` as (``auto`` | ``none`` | ``required`` | ``function``, the forced
    function's name): a string, or a named function in Chat Completions' shape (``{"type":
    "function", "function": {"name": ...}}``) or the Responses API's (``{"type": "function",
    "name": ...}``); ``InvalidRequest`` naming ``tool_choice`` for anything else."""
    if value is None:
        return "auto", None
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else value.get("name")
        if value.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest("tool_choice", value, "a named choice must be {'type': 'function', "
                                 "'function': {'name': ...}} (or, in the Responses API, {'type': 'function', "
                                 "'name': ...})")
        return "function", name
    if value not in ("auto", "none", "required"):
        raise InvalidRequest("tool_choice", value, "must be 'auto', 'none', 'required' or a named function")
    return value, None


def json_response(field: str, response_format: Any) -> Any:
    """The JSON schema an OpenAI ``response_format`` asks for (True-ish for any JSON object),
    or None for text; ``InvalidRequest`` naming ``field`` for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequest(field, response_format, "must be an object with a 'type'")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _ANY_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(spec, dict) and "schema" not in spec:
            schema = _ANY_OBJECT  # OpenAI allows a json_schema without a schema: any JSON object
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{field}.json_schema.schema", schema, "must be a JSON schema (an object)")
        return schema
    raise InvalidRequest(f"{field}.type", kind, "must be 'text', 'json_object' or 'json_schema'")


def json_whitespace(value: Any) -> str:
    """A request's ``json_whitespace``: ``compact`` (None: the default) or ``any``;
    ``InvalidRequest`` naming ``json_whitespace`` for anything else."""
    if value is None:
        return "compact"
    if value not in ("compact", "any"):
        raise InvalidRequest("json_whitespace", value, "must be 'compact' (the default: no free whitespace in "
                             "constrained JSON) or 'any'")
    return value


def _call_tags(syntax: CallSyntax, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tags = []
    for tool in tools:
        function = tool["function"]
        begin, end, _ = syntax.call_tag(function["name"])
        schema = function.get("parameters") or _ANY_OBJECT
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": schema}})
    return tags


def output_constraint(syntax: CallSyntax | None, tools: list[dict[str, Any]] | None, tool_choice: str,
                      forced: str | None = None, *, parallel: bool = True, schema: Any = None,
                      whitespace: str = "compact") -> str | None:
    """The structural tag (JSON text) for a request, or None when its output is free.

    ``tools`` are normalized OpenAI function tools (``render.normalize_tools``);
    ``tool_choice`` is ``"auto"``, ``"none"``, ``"required"`` or ``"function"``
    with ``forced`` naming it; ``schema`` is the JSON response's schema
    (``json_response``) or None; ``whitespace`` is ``json_whitespace``'s value."""
    fmt: dict[str, Any] | None = None
    if tools and tool_choice != "none":
        if syntax is None:
            raise InvalidRequest("tools", len(tools), "the model has no tool-call syntax to constrain")
        if tool_choice == "function":
            chosen = [t for t in tools if t["function"]["name"] == forced]
            if not chosen:
                raise InvalidRequest("tool_choice.function.name", forced,
                                     f"names no tool of this request (tools: {[t['function']['name'] for t in tools]})")
            fmt = _call_tags(syntax, chosen)[0]
        elif tool_choice in ("required", "auto") and (tool_choice == "required" or schema is not None):
            separator = syntax.call_tag(tools[0]["function"]["name"])[2]
            fmt = {"type": "tags_with_separator", "tags": _call_tags(syntax, tools), "separator": separator,
                   "at_least_one": True, "stop_after_first": not parallel}
            if tool_choice == "auto":  # the JSON answer, or tool calls
                fmt = {"type": "or", "elements": [{"type": "json_schema", "json_schema": schema}, fmt]}
    elif tool_choice == "function":
        raise InvalidRequest("tool_choice", forced, "forces a function, but the request has no tools")
    elif tool_choice == "required":
        raise InvalidRequest("tool_choice", "required", "needs tools")
    if fmt is None and schema is not None and (not tools or tool_choice == "none"):
        fmt = {"type": "json_schema", "json_schema": schema}
    if fmt is None:
        return None
    tag: dict[str, Any] = {"type": "structural_tag", "format": fmt}
    if json_whitespace(whitespace) == "any":
        tag["json_whitespace"] = "any"
    return json.dumps(tag, ensure_ascii=False)
