"""Constrained decoding for the backends that sample themselves (torch, scripted), with xgrammar,
and the JSON layout every backend compiles a constraint's JSON with.

A request's ``SamplingParams.constraint`` is an xgrammar structural tag
(JSON text). ``Grammars`` compiles it against the model's tokenizer (its
compiler caches compiled grammars, so the same tools or schema compile once)
and gives each sequence its own ``GrammarMatcher``. Each step,
``mask_logits`` writes the matchers' allowed-token bitmasks over their rows
of the logits (disallowed tokens become -inf) before sampling, so the
sampled token and its logprob come from the masked distribution; the
sequence then feeds its token to its matcher (``Constrained.accept``). Once
the structure is complete the matcher allows only the model's end tokens.

**JSON layout** (``json_layout``, applied by every backend, vLLM included):
xgrammar's JSON schema grammar allows any whitespace between tokens and
numbers of any length, and a weak policy fills them until ``max_tokens``
(measured: forced tool calls of a random tiny model never closed within 64
tokens). So every plain ``json_schema`` node of a constraint compiles as
*compact* JSON by default: the one layout ``json.dumps`` writes (``", "`` and
``": "``, nothing else; what vLLM's structured outputs emit without
``any_whitespace``, and what Hermes/Qwen templates render), with at most
``MAX_DIGITS`` digits in a number's integer part, fraction and exponent
each. A structural tag whose top level says ``"json_whitespace": "any"``
allows free whitespace instead (numbers stay bounded).

**Budget** (``Grammars.matcher(..., budget=max_tokens)``, the torch backend):
a structure still open when ``max_tokens`` runs out is malformed output.
Within the last ``CLOSING_HORIZON`` tokens each step works out a short way to
complete the structure (``closing_text``: the grammar's forced text, else the
first of a few closing characters it allows) and, once only its tokens plus
``CLOSING_MARGIN`` remain, forces them one by one (a forced token has
logprob 0: it is the only one its masked distribution allows). At a branch
(a key, a call's name, going on after a complete call) the first characters
whose shortest completion would no longer fit are masked too, so one free
token cannot outgrow the margin. Strings are
therefore not length-bounded: a long argument is cut short and closed, not
refused. vLLM's structured outputs have no such step (its output can still
end open at ``max_tokens``).

Compute thread only (``json_layout`` runs wherever a backend takes a
request); xgrammar is imported on first use, so a backend that never sees a
constraint never loads it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import Any

from rlengine.errors import InvalidRequest

__all__ = ["CLOSING_HORIZON", "CLOSING_MARGIN", "MAX_DIGITS", "Constrained", "Grammars", "closing_text",
           "json_layout", "mask_logits"]

MAX_DIGITS = 16
"""Digits a constrained JSON number may have in its integer part, its fraction and its exponent
(each): float64 holds about 16 significant digits, int64 19."""
CLOSING_HORIZON = 128
"""Within this many tokens of ``max_tokens`` a constrained sequence checks how it would close."""
CLOSING_MARGIN = 4
"""Tokens kept in hand beyond the closing path: a token of several characters may lengthen the
path more than its first character says (a string closed and a key begun in one token). Small, so
a short budget that fits the structure is still sampled freely (vLLM, which does not close,
then samples the same)."""
JSON_WHITESPACE = ("compact", "any")
"""The values of a structural tag's top-level ``json_whitespace`` (absent: ``compact``)."""

# Tried in this order where the grammar forces no text: end a string, an object, an array; the
# shortest number, boolean and null; every other printable ASCII character (an enum's first
# letter); whitespace last, where free whitespace would otherwise be taken for ever.
_CLOSERS = ('"', "}", "]", "0", "f", "n", *(chr(c) for c in range(0x21, 0x7F)), " ", "\n")
_MAX_CLOSING_CHARS = 4 * CLOSING_HORIZON
_BRANCH_WIDTH = 16


def _bound_numbers(ebnf: str) -> str:
    """xgrammar's JSON grammar with every digit run bounded: ``[1-9] [0-9]*`` (an integer part)
    and ``digit_rule{1, -1}`` (a fraction, an exponent) get at most ``MAX_DIGITS`` digits."""
    ebnf = ebnf.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {MAX_DIGITS - 1}}}")
    digit_rules = re.findall(r"^(\S+) ::= \(\(\[0-9\]\)\)$", ebnf, flags=re.MULTILINE)
    for rule in digit_rules:
        ebnf = re.sub(rf"(?<![\w.]){re.escape(rule)}\{{1, -1\}}", f"{rule}{{1, {MAX_DIGITS}}}", ebnf)
    return ebnf


def _json_grammar(schema: Any, any_whitespace: bool) -> dict[str, Any]:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True)
    return {"type": "grammar", "grammar": _bound_numbers(str(grammar))}


def _lay_out(node: Any, any_whitespace: bool) -> Any:
    if isinstance(node, list):
        return [_lay_out(item, any_whitespace) for item in node]
    if not isinstance(node, dict):
        return node
    # A plain JSON node only: one that sets xgrammar's own layout options (an XML style,
    # max_whitespace_cnt, any_order, excludes) keeps them.
    if node.get("type") == "json_schema" and set(node) <= {"type", "json_schema", "style"} \
            and node.get("style", "json") == "json":
        return _json_grammar(node["json_schema"], any_whitespace)
    return {key: _lay_out(value, any_whitespace) for key, value in node.items()}


@functools.lru_cache(maxsize=256)
def json_layout(constraint: str) -> str:
    """``constraint`` (a structural tag) with each plain ``json_schema`` node replaced by the
    EBNF of compact JSON (or, with a top-level ``"json_whitespace": "any"``, free whitespace),
    numbers bounded; what a backend compiles. ``InvalidRequest`` naming
    ``sampling_params.constraint`` for a tag that is not a JSON object or a schema xgrammar
    cannot convert. Cached: the same tools come with every turn of an agent."""
    try:
        tag = json.loads(constraint)
    except ValueError as exc:
        raise InvalidRequest("sampling_params.constraint", constraint[:60], f"is not JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise InvalidRequest("sampling_params.constraint", constraint[:60], "must be a structural tag (an object)")
    whitespace = tag.pop("json_whitespace", "compact")
    if whitespace not in JSON_WHITESPACE:
        raise InvalidRequest("sampling_params.constraint.json_whitespace", whitespace,
                             f"must be one of {list(JSON_WHITESPACE)}")
    try:
        laid_out = _lay_out(tag, whitespace == "any")
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on a bad schema
        raise InvalidRequest("sampling_params.constraint", constraint[:60],
                             f"xgrammar cannot convert its JSON schema: {_reason(exc)}") from None
    return json.dumps(laid_out, ensure_ascii=False)


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[-1] if text else type(exc).__name__)[:300]


def closing_text(matcher: Any) -> str | None:
    """A short text that completes what ``matcher`` has accepted (without moving it), or None
    when none is found within ``_MAX_CLOSING_CHARS``. Greedy, not the shortest: the grammar's
    forced text where it has one, else the first of ``_CLOSERS`` it allows."""
    probe = matcher.fork()
    parts: list[str] = []
    size = 0
    while not probe.is_completed():
        text = probe.find_jump_forward_string()
        if text:
            probe.accept_string(text)
        else:  # a refused character leaves the matcher as it was
            text = next((c for c in _CLOSERS if probe.accept_string(c)), None)
            if text is None:
                return None
        parts.append(text)
        size += len(text)
        if size > _MAX_CLOSING_CHARS:
            return None
    return "".join(parts)


class Constrained:
    """One sequence's matcher: which tokens may come next, and what it has accepted; with a
    budget, it closes its structure before the budget runs out (the module's **Budget**)."""

    __slots__ = ("_closing", "_grammars", "budget", "matcher", "taken")

    def __init__(self, matcher: Any, grammars: Grammars | None = None, budget: int | None = None) -> None:
        self.matcher = matcher
        self._grammars = grammars
        self.budget = budget if grammars is not None else None
        """The sequence's ``max_tokens`` (None: no closing)."""
        self.taken = 0
        """Tokens accepted so far."""
        self._closing: list[int] = []
        """Once closing: the tokens still to force, the end token last."""

    def accept(self, token: int) -> bool:
        """Feed the sampled token; False when the constraint does not allow it."""
        if not self.matcher.accept_token(token):
            return False
        self.taken += 1
        if self._closing:
            self._closing.pop(0)
        return True

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]``: the grammar's, less the first
        characters whose shortest completion no longer fits the budget, or the one token the
        closing path forces."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.budget is None or self._grammars is None:
            return
        left = self.budget - self.taken
        if not self._closing and left <= CLOSING_HORIZON:
            path = self._grammars.closing_tokens(self.matcher)
            if path is not None and len(path) + CLOSING_MARGIN >= left:
                self._closing = path
            elif path is not None:
                unsafe = self._grammars.too_long(self.matcher, left - CLOSING_MARGIN)
                if unsafe is not None:
                    bitmask[row] &= ~unsafe
                return
        if self._closing:
            token = self._closing[0]
            word, bit = divmod(token, 32)
            if not (int(bitmask[row, word]) >> bit) & 1:  # the tokenizer's path is not the grammar's
                self._closing, self.budget = [], None
                return
            bitmask[row].zero_()
            bitmask[row, word] = (1 << bit) - (1 << 32) if bit == 31 else 1 << bit  # int32 words


class Grammars:
    """Compiles constraints for one tokenizer (lazily: xgrammar loads at the first constraint)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self._compiler: Any = None
        self._by_first: Any = None

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, constraint: str, budget: int | None = None) -> Constrained:
        """A fresh matcher for ``constraint`` (laid out by ``json_layout``), closing within
        ``budget`` tokens when one is given; ``InvalidRequest`` when xgrammar cannot compile it."""
        if self.tokenizer is None:
            raise InvalidRequest("sampling_params.constraint", constraint[:60], "the model directory has no tokenizer")
        import xgrammar as xgr

        laid_out = json_layout(constraint)
        try:
            compiled = self._xgr_compiler().compile_structural_tag(laid_out)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/pydantic errors
            raise InvalidRequest("sampling_params.constraint", constraint[:60],
                                 f"xgrammar cannot compile it: {_reason(exc)}") from None
        return Constrained(xgr.GrammarMatcher(compiled), self if budget is not None and self.stop_ids else None,
                           budget)

    def closing_tokens(self, matcher: Any) -> list[int] | None:
        """The tokens that complete what ``matcher`` has accepted, then an end token; None when
        ``closing_text`` finds no path or the tokenizer's ids for it are not what the grammar
        accepts (a tokenizer that rewrites text: a prefix space, normalization)."""
        text = closing_text(matcher)
        if text is None:
            return None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        probe = matcher.fork()
        if not all(probe.accept_token(t) for t in ids) or not probe.is_completed():
            return None
        return [*ids, self.stop_ids[0]]

    def too_long(self, matcher: Any, limit: int) -> Any:
        """At a branch (at most ``_BRANCH_WIDTH`` next characters allowed: a key, a call's name,
        an enum, going on after a complete call), the bitmask words of the tokens whose first
        character leads to a completion (with its end token) of more than ``limit`` tokens; None
        when there are none or this is no branch (free text: every character costs alike)."""
        probe, allowed = matcher.fork(), []
        for c in _CLOSERS:
            if probe.accept_string(c):
                allowed.append(c)
                probe.rollback(1)
                if len(allowed) > _BRANCH_WIDTH:
                    return None
        unsafe = []
        for c in allowed:
            probe = matcher.fork()
            probe.accept_string(c)
            text = closing_text(probe)
            if text is None or len(self.tokenizer.encode(c + text, add_special_tokens=False)) + 1 > limit:
                unsafe.append(ord(c))
        if not unsafe:
            return None
        table = self._first_character_table()
        out = table[unsafe[0]].clone()
        for c in unsafe[1:]:
            out |= table[c]
        return out

    def _first_character_table(self) -> Any:
        """int32 bitmask words per ASCII character: the tokens whose text starts with it."""
        if self._by_first is None:
            import numpy as np
            import torch
            import xgrammar as xgr

            words = (self.vocab_size + 31) // 32
            table = np.zeros((128, words), dtype=np.uint32)
            vocab = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size).decoded_vocab
            for token, text in enumerate(vocab[:self.vocab_size]):
                if text and text[0] < 128:
                    table[text[0], token // 32] |= np.uint32(1 << (token % 32))
            self._by_first = torch.from_numpy(table.view(np.int32))
        return self._by_first


def mask_logits(logits: Any, rows: list[int], constrained: list[Constrained]) -> None:
    """Mask ``logits`` [B, vocab] in place: row ``rows[i]`` keeps only what ``constrained[i]`` allows."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for i, c in enumerate(constrained):
        c.fill(bitmask, i)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return
    # The bitmask's row i is for logits row rows[i]: gather, mask, scatter back.
    index = torch.as_tensor(rows, device=logits.device)
    part = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(part, bitmask.to(logits.device))
    logits.index_copy_(0, index, part)
