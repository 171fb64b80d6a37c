"""The scripted backend: completions given as text, tokenized by the model's own tokenizer.

Tests of agents and API shapes need a model that calls tools, and a random
tiny model never will. This backend generates what it is told to: each new
sequence takes the next text of its script (in order, cycling), encoded by
the model directory's tokenizer and followed by the end-of-turn token, one
token per step. Everything around it is real: the model directory, chat
template and tokenizer (the tiny model's by default), stop token ids, stop
strings (found as the torch backend finds them, with its ``StopText``),
``max_tokens``, streaming, aborts, weight installs (each a new policy
version; the script does not depend on the weights) and so the engine's
per-token versions and the session layer's exact traces.

The logprob of every scripted token is 0.0: the script is certain (the
probability the sampler used is 1), and that is what the trace records.
Prompt logprobs are not computed: asking for them fails that request;
``top_logprobs`` is at most 1 (the scripted token, the only one with any
probability). A
request with a ``constraint`` gets the script only if the script's tokens
match it (checked with the same xgrammar matcher the torch backend masks
with, ``backends.grammar``); otherwise that request fails with
``InvalidRequest``, so a test cannot pass forced output the constraint
would not have allowed.

Set the script with ``engine_args={"script": [...]}`` (and ``rlengine serve
engine_args.script='[...]'``), or replace it while the engine runs with
``ScriptedBackend.set_script``. The script ``"demo"`` answers from each
prompt instead (``backends.demo_script``: a call of the first tool offered,
then a text quoting its result; ``rlengine serve --demo``). This module runs on the compute thread and
must not touch engine state; it imports transformers only to load the
tokenizer (and torch with the torch backend's stop-string detection).
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rlengine.backends.base import BackendRequest, Capabilities, RequestOutput
from rlengine.backends.demo_script import demo_reply
from rlengine.backends.grammar import Grammars
from rlengine.backends.torch.sampling import StopText
from rlengine.errors import ConfigurationError, InvalidRequest

__all__ = ["ScriptedBackend", "build"]


class _Seq:
    __slots__ = ("pos", "request", "stop_text", "stream", "tokens")

    def __init__(self, request: BackendRequest, tokens: list[int], tokenizer: Any) -> None:
        self.request = request
        self.tokens = tokens
        self.pos = 0
        self.stream = request.stream
        stops = request.params.stop_strings
        self.stop_text = StopText(tokenizer, stops) if stops else None


class ScriptedBackend:
    """Backend protocol over scripted completions; see the module docstring."""

    name = "scripted"

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, script: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capabilities = Capabilities(sleep=False, prompt_logprobs=False, stop_strings=True,
                                         constraints=True, top_logprobs=1,
                                         why_not_sleep="the scripted backend holds no accelerator memory")
        end = tokenizer.eos_token_id
        if not isinstance(end, int):
            raise ConfigurationError("backend='scripted': the tokenizer has no end-of-sequence token")
        self.end_token = end
        self.grammars = Grammars(tokenizer, vocab_size, [end])
        self._lock = threading.Lock()
        self._script: Iterator[str] | None = iter(())
        self.set_script(script)
        self._running: dict[str, _Seq] = {}
        self.version = 0

    def set_script(self, script: Sequence[str] | str) -> None:
        """Use ``script`` from the next new sequence on (thread-safe); ``"demo"``: the demo's
        replies to each prompt (``backends.demo_script``)."""
        if script == "demo":
            with self._lock:
                self._script = None
            return
        texts = list(script) if not isinstance(script, str) else []
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ConfigurationError(f"script={script!r}: must be a non-empty list of completion texts, or 'demo'")
        with self._lock:
            self._script = itertools.cycle(texts)

    def _next_tokens(self, prompt: bytes) -> list[int]:
        with self._lock:
            script = self._script
            text = next(script) if script is not None else None
        if text is None:
            text = demo_reply(self.tokenizer.decode(array("i", prompt).tolist()))
        return [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.end_token]

    # -- the protocol ---------------------------------------------------------

    def add_request(self, request: BackendRequest) -> None:
        if request.request_id in self._running:
            raise ValueError(f"request_id={request.request_id!r}: already in the scripted backend")
        if request.prompt_logprobs:
            raise ValueError("the scripted backend computes no prompt logprobs")
        tokens = self._next_tokens(request.prompt)
        if request.params.constraint is not None:
            self._check(request.params.constraint, tokens)
        self._running[request.request_id] = _Seq(request, tokens, self.tokenizer)

    def _check(self, constraint: str, tokens: list[int]) -> None:
        matcher = self.grammars.matcher(constraint)
        for i, token in enumerate(tokens):
            if not matcher.accept(token):
                text = self.tokenizer.decode(tokens[:-1])
                raise InvalidRequest("sampling_params.constraint", constraint[:60],
                                     f"the scripted completion {text[:80]!r} does not match it (token {i}, "
                                     f"{self.tokenizer.decode([token])!r}, is not allowed there)")

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        outs, done = [], []
        for rid, seq in self._running.items():
            p = seq.request.params
            token = seq.tokens[seq.pos]
            seq.pos += 1
            stop = token in p.stop_token_ids or (token == self.end_token and not p.ignore_eos)
            if not stop and seq.stop_text is not None:
                stop = seq.stop_text.feed(seq.tokens[:seq.pos])
            length = seq.pos >= seq.request.max_tokens or (seq.pos >= len(seq.tokens) and not stop)
            finished = stop or length
            if seq.stream or finished:
                first = 0 if finished and not seq.stream else seq.pos - 1
                ids = seq.tokens[first:seq.pos]
                out = RequestOutput(rid, array("i", ids), array("f", [0.0] * len(ids)), finished,
                                    "stop" if stop else "length" if finished else None)
                if p.top_logprobs:  # the only likely token is the scripted one
                    out.top_ids, out.top_logprobs = list(ids), [0.0] * len(ids)
                outs.append(out)
            if finished:
                done.append(rid)
        for rid in done:
            del self._running[rid]
        return outs

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors:  # consumed as a model would; the script does not depend on them
            pass
        self.version = version

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError("the scripted backend does not sleep (capabilities.sleep is False)")

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self._running.clear()


def build(config: Any, model_path: str | None) -> ScriptedBackend:
    """Registry entry point: the scripted backend over ``model_path``'s tokenizer."""
    import json
    import os

    from rlengine.backends.torch.models import load_tokenizer

    assert model_path is not None
    args = dict(config.engine_args or {})
    script = args.pop("script", ["ok"])
    if args:
        raise ConfigurationError(f"engine_args {sorted(args)}: not options of the scripted backend (known: script)")
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    limit = int(hf.get("max_position_embeddings") or 0)
    max_model_len = config.max_model_len or limit
    if not max_model_len or (limit and max_model_len > limit):
        raise ConfigurationError(f"max_model_len={config.max_model_len}: must be set and <= the model's "
                                 f"max_position_embeddings {limit}")
    return ScriptedBackend(load_tokenizer(model_path), int(hf["vocab_size"]), int(max_model_len), script)
