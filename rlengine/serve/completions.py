"""OpenAI's legacy Completions API (``POST /v1/completions``) in terms of the session layer's token turns.

Pure translation, no I/O (``serve.http_turns`` serves it), as
``serve.chat_completions``: a request becomes a prompt (text, which the
server tokenizes, or token ids) and the sampling parameters of a token turn
(``SessionManager.generate``); a finished turn becomes a ``text_completion``,
or the stream of its chunks.

* ``prompt`` is a string, a list of token ids, or a batch of one of those
  (a list of strings, a list of lists); a batch of more than one prompt is
  refused (one prompt per request; ``n`` asks for several completions);
* ``max_tokens`` (16 when absent, as OpenAI's; ``null``: up to the context),
  ``temperature``, ``top_p``, ``n``, ``stop``, ``seed`` and rlengine's
  ``top_k`` and ``ignore_eos`` are honoured;
* ``logprobs`` k (0 to 20) returns OpenAI's ``logprobs`` object: ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (the k most likely tokens and the
  sampled one) and ``text_offset`` (into the returned text); streamed, it
  comes whole on each choice's last chunk;
* ``echo`` puts the prompt's text before the completion's, without
  logprobs (the prompt's logprobs are not computed: ``echo`` with
  ``logprobs`` is refused); ``suffix``, a ``best_of`` other than ``n``,
  ``logit_bias`` and penalties are refused.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.errors import InvalidRequest
from rlengine.protocol import Choice, Unsupported
from rlengine.serve.chat_completions import ChatChunks, StreamOptions, usage_of
from rlengine.serve.session_types import TurnResult
from rlengine.types import MAX_TOP_LOGPROBS, SamplingParams, unpack_top

__all__ = ["CompletionChunks", "CompletionRequest", "completion_body", "to_turn"]


class CompletionRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The body of ``POST /v1/completions`` (the fields rlengine honours or refuses; others are ignored)."""

    prompt: str | list[Any]
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    session_id: str | None = None
    session_token: str | None = None


def _prompt(prompt: str | list[Any]) -> str | list[int]:
    """The one prompt of a request: text, or token ids (a batch of one is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("prompt", f"a batch of {len(prompt)} prompts", "send one prompt per request "
                                 "(n asks for several completions of it)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise InvalidRequest("prompt", [], "must hold at least one token")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        raise InvalidRequest("prompt", bad, "a token-id prompt holds integers only")
    return prompt


def to_turn(req: CompletionRequest) -> tuple[str | list[int], SamplingParams]:
    """The request as a token turn: its prompt (text or ids) and sampling parameters."""
    prompt = _prompt(req.prompt)
    if req.suffix:
        raise Unsupported("suffix: insertion (text after the completion) is not supported")
    if req.best_of not in (None, req.n):
        raise Unsupported(f"best_of={req.best_of!r}: only best_of == n (every completion returned) is supported")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field) not in (None, 0, 0.0):
            raise Unsupported(f"{field}={getattr(req, field)!r}: penalties are not supported")
    if req.logit_bias:
        raise Unsupported("logit_bias: not supported")
    k = req.logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("logprobs", k, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if req.echo and k is not None:
        raise Unsupported("echo with logprobs: the prompt's logprobs are not computed here; drop one of them")
    params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                            seed=req.seed, stop=req.stop or None, ignore_eos=req.ignore_eos, top_logprobs=k or 0)
    return prompt, params


def _logprobs(choice: Choice, decode: Callable[[list[int]], str], offset: int) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object of a completion whose text starts at ``offset`` of the returned text."""
    tokens, lps = array("i", choice.tokens_raw).tolist(), array("f", choice.logprobs_raw).tolist()
    tops = unpack_top(choice.tokens_raw, choice.top_ids_raw, choice.top_logprobs_raw) or [[]] * len(tokens)
    texts, offsets = [], []
    for t in tokens:
        offsets.append(offset)
        texts.append(decode([t]))
        offset += len(texts[-1])
    # Tokens a constraint masked out have logprob -inf, which JSON cannot carry: they are left out.
    top_logprobs = [{**{decode([a]): alp for a, alp in top if alp != -math.inf}, text: lp}
                    for text, lp, top in zip(texts, lps, tops)]
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}


def completion_body(result: TurnResult, model: str, session_id: str | None, echo: str | None, logprobs: bool,
                    decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """A ``text_completion`` for a finished turn: ``echo`` is the prompt's text (None: not echoed);
    ``decode``, token ids -> text with special tokens kept, spells the logprobs' tokens."""
    head = echo or ""
    body: dict[str, Any] = {
        "id": f"cmpl-{result.request_id}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "text": head + (c.text or ""), "finish_reason": c.stop_reason,
                     "logprobs": _logprobs(c, decode, len(head)) if logprobs else None}
                    for i, c in enumerate(result.choices)],
        "usage": usage_of(result),
    }
    if session_id is not None:
        body["session_id"] = session_id
    return body


class CompletionChunks(ChatChunks):
    """Completions' stream (``data: {...}`` lines, then ``data: [DONE]``): a ``StreamDialect``.

    The echoed prompt comes first, the text as it is settled, then each choice's
    last chunk with its ``finish_reason`` and, when asked for, the ``logprobs`` of
    its whole completion. Chunks and errors are spelled as Chat Completions' are."""

    def __init__(self, encode: Callable[[Any], bytes], request_id: str, model: str, n: int, echo: str | None,
                 logprobs: bool, include_usage: bool, decode: Callable[[list[int]], str]) -> None:
        super().__init__(encode, request_id, model, n, include_usage)
        self.head = {**self.head, "id": f"cmpl-{request_id}", "object": "text_completion"}
        self.echo = echo
        self.logprobs = logprobs
        self.decode = decode

    def start(self) -> bytes:
        return b"".join(self.text(i, self.echo) for i in range(self.n)) if self.echo else b""

    def text(self, index: int, text: str) -> bytes:
        return self.chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def finish(self, result: TurnResult, rests: list[str]) -> bytes:
        out = []
        for i, (choice, rest) in enumerate(zip(result.choices, rests)):
            lps = _logprobs(choice, self.decode, len(self.echo or "")) if self.logprobs else None
            out.append(self.chunk([{"index": i, "text": rest, "logprobs": lps, "finish_reason": choice.stop_reason}]))
        if self.include_usage:
            out.append(self.chunk([], usage_of(result)))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)
