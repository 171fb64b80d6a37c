"""Chat rendering, in one place: messages -> template text -> token ids.

Everything that turns chat messages into tokens goes through this module:
the session layer (exact traces, below), the HTTP endpoints, and the
in-process ``SamplingClient.render_chat_completion`` (``render_chat``).

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

Two renderers: ``TemplateRenderer`` over a Hugging Face tokenizer and its
chat template, and ``ByteRenderer`` for tokenizer-less backends (the sim):
a plain-text template over UTF-8 bytes as token ids.

This module renders and (de)tokenizes; it must not store anything or touch
the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from rlengine.errors import InvalidRequest

__all__ = ["Boundary", "ByteRenderer", "ChatRenderer", "TemplateRenderer", "TextStream", "assistant_tail",
           "normalize_messages", "render_chat", "suffix_text"]


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

    def render(self, messages: list[dict[str, str]], generation: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as plain ``{"role", "content"[, "name"]}`` dicts; bad ones raise ``InvalidRequest``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages", messages, "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            role, content, name = m.get("role"), m.get("content"), m.get("name")
        else:
            role, content, name = getattr(m, "role", None), getattr(m, "content", None), getattr(m, "name", None)
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role", role, "must be a non-empty string")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content", content, "must be a string")
        message = {"role": role, "content": content}
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"messages[{i}].name", name, "must be a string")
            message["name"] = name
        out.append(message)
    return out


def suffix_text(renderer: ChatRenderer, messages: list[dict[str, str]], boundary: Boundary,
                full: str | None = None) -> str | None:
    """The text to tokenize after ``boundary`` for ``messages`` (+ generation prompt), or None
    if the template does not render ``messages`` as an extension of the boundary's text."""
    if full is None:
        full = renderer.render(messages, True)
    if boundary.count == 0 and not boundary.generation:
        return boundary.tail + full
    head = renderer.render(messages[:boundary.count], boundary.generation)
    if not full.startswith(head):
        return None
    return boundary.tail + full[len(head):]


def assistant_tail(renderer: ChatRenderer, messages: list[dict[str, str]], content: str,
                   sampled: Sequence[int], before: str | None = None) -> str | None:
    """What the template still owes after the sampled tokens of an assistant turn.

    ``content`` is the turn's text as returned to the client. None when the
    template does not render the assistant message as ``content`` plus a
    closing (then the turn's end is not a boundary, and a conversation
    continuing from it branches at the previous one). ``before`` is
    ``renderer.render(messages, True)`` if the caller has it.
    """
    if before is None:
        before = renderer.render(messages, True)
    after = renderer.render([*messages, {"role": "assistant", "content": content}], False)
    if not after.startswith(before):
        return None
    rendered = after[len(before):]
    if not rendered.startswith(content):
        return None
    closing = rendered[len(content):]
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

    def render(self, messages: list[dict[str, str]], generation: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
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

    def render(self, messages: list[dict[str, str]], generation: bool) -> str:
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
