"""The demo script: replies that read the prompt, for trying the servers with an agent (``rlengine serve --demo``).

The scripted backend with ``script="demo"`` answers each request from its
prompt, rendered in the Hermes/Qwen chat layout (the tiny model's template):

* the last user turn holds tool results (``<tool_response>``): a text answer
  quoting them;
* else, when the request offers tools (``<tools>`` in the system turn): a
  well-formed call (``<tool_call>``) of the first tool, with arguments that
  match its JSON schema (``example_of``);
* else a readable canned text, quoting the last user message.

So an agent's tool loop runs end to end (call, result, answer) without a
trained model. A prompt in another layout gets the canned text. Pure text
in, text out: it runs on the scripted backend's compute thread and touches
nothing else.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["demo_reply", "example_of"]

_USER = "<|im_start|>user\n"
_END = "<|im_end|>"
_TOOLS = ("<tools>\n", "\n</tools>")
_RESULT = ("<tool_response>\n", "\n</tool_response>")

_STRING_FORMATS = {"date": "2024-01-01", "date-time": "2024-01-01T00:00:00Z", "time": "00:00:00",
                   "email": "user@example.com", "uri": "https://example.com", "uuid": "00000000-0000-0000-0000-000000000000"}


def _number(schema: dict[str, Any], value: float) -> float:
    """``value`` moved inside the schema's bounds (integers step by one, numbers by a half)."""
    step = 1 if schema.get("type") == "integer" else 0.5
    if "minimum" in schema:
        value = max(value, schema["minimum"])
    if "exclusiveMinimum" in schema and not isinstance(schema["exclusiveMinimum"], bool):
        value = max(value, schema["exclusiveMinimum"] + step)
    if "maximum" in schema:
        value = min(value, schema["maximum"])
    if "exclusiveMaximum" in schema and not isinstance(schema["exclusiveMaximum"], bool):
        value = min(value, schema["exclusiveMaximum"] - step)
    return value


def example_of(schema: Any, depth: int = 0) -> Any:
    """A value that matches the JSON schema ``schema``: its ``const``, ``default`` or first
    ``enum`` value, else one built from its ``type`` and bounds (every declared property of an
    object, one item of an array, or ``minItems``). Patterns and ``$ref`` are not followed."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_of(schema[key][0], depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {name: example_of(sub, depth + 1) for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [example_of(schema.get("items", {}), depth + 1)] * max(1, int(schema.get("minItems", 1)))
    if kind == "integer":
        return int(_number(schema, 1))
    if kind == "number":
        return float(_number(schema, 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = _STRING_FORMATS.get(schema.get("format", ""), "example")
    text += "x" * max(0, int(schema.get("minLength", 0)) - len(text))
    return text[:schema["maxLength"]] if "maxLength" in schema else text


def _between(text: str, opening: str, closing: str) -> list[str]:
    """Every span of ``text`` between ``opening`` and the next ``closing``."""
    spans, at = [], 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        spans.append(text[start + len(opening):end])
        at = end + len(closing)
    return spans


def _first_tool(prompt: str) -> dict[str, Any] | None:
    """The first function the system turn offers (one JSON object per line in ``<tools>``)."""
    for block in _between(prompt, *_TOOLS):
        for line in block.splitlines():
            try:
                tool = json.loads(line)
            except ValueError:
                continue
            function = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                return function
    return None


def demo_reply(prompt: str) -> str:
    """The demo's reply to ``prompt`` (the rendered conversation); see the module docstring."""
    last = prompt.rpartition(_USER)[2].partition(_END)[0] if _USER in prompt else ""
    results = _between(last, *_RESULT)
    if results:
        return f"The tool returned {'; '.join(r.strip() for r in results)}. That is my answer."
    tool = _first_tool(prompt)
    if tool is not None:
        call = {"name": tool["name"], "arguments": example_of(tool.get("parameters") or {"type": "object"})}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    quoted = " ".join(last.split())[:200]
    return (f'Hello! This is rlengine\'s demo server: it answers from a script, not a model. You said: "{quoted}". '
            "Offer it tools and it calls the first one; send the result back and it answers with it.")
