"""One request inside the torch backend: its sampling settings and what it generated so far.

``BackendSequence`` is the backend's per-request record (``backend.TorchBackend`` keeps its
waiting and running ones): the prompt, the tokens and logprobs generated, the top-k
alternatives, the prompt logprobs and scores computed at prefill, its speculative drafting
state, and its KV bookkeeping (the slot length, the prefix-cache reuse, the weight install it
was prefilled under). ``report`` hands out what was not yet reported as a ``RequestOutput``.
``eos_ids`` and ``backend_tokenizer`` read what a model directory says about stopping and
tokenizing. Compute thread only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rlengine.backends.base import BackendRequest, RequestOutput
from rlengine.backends.grammar import Constrained
from rlengine.backends.torch.prompt_scores import PromptScorer
from rlengine.backends.torch.sampling import StopText
from rlengine.backends.torch.speculative import Drafter

__all__ = ["BackendSequence", "backend_tokenizer", "eos_ids"]


class BackendSequence:
    """One request inside the backend: its sampling settings and what it generated."""

    __slots__ = (
        "accepted",
        "cached",
        "constrained",
        "drafted",
        "drafter",
        "epoch",
        "ids",
        "length",
        "logprobs",
        "max_tokens",
        "ok",
        "processed",
        "prompt",
        "prompt_logprobs",
        "prompt_top",
        "prompt_tops",
        "reported",
        "rid",
        "scorer",
        "seed",
        "stop_ids",
        "stop_text",
        "stream",
        "temperature",
        "tokens",
        "top",
        "top_ids",
        "top_k",
        "top_logprobs",
        "top_p",
        "want_prompt_logprobs",
    )

    def __init__(self, req: BackendRequest, ids: np.ndarray, prompt: list[int], vocab_size: int,
                 eos: frozenset[int], tokenizer: Any, constrained: Constrained | None,
                 drafter: Drafter | None = None) -> None:
        p = req.params
        self.rid = req.request_id
        self.ids = ids
        """The prompt as int32 (the prefix cache's key)."""
        self.prompt = prompt
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.reported = 0
        """Tokens already handed out (non-streaming requests report once, finished)."""
        self.cached = 0
        """Prompt tokens whose KV its prefill copied (prefix cache, or a sample of its group) instead of computing."""
        self.stream = req.stream
        self.max_tokens = req.max_tokens
        self.temperature = float(p.temperature)
        self.top_k = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
        self.top_p = float(p.top_p)
        self.processed = p.logprob_transform is not None
        self.seed: int | None = req.seed if self.temperature > 0.0 else None
        """The seed of this sequence's draws (``sampling.uniforms``); None: greedy."""
        self.stop_ids = (frozenset() if p.ignore_eos else eos) | frozenset(p.stop_token_ids)
        self.stop_text = StopText(tokenizer, p.stop_strings) if p.stop_strings else None
        self.constrained = constrained
        self.drafter = drafter
        """Its speculative drafting state (None: it never drafts)."""
        self.drafted = self.accepted = 0
        """Tokens drafted and accepted since its last output (``RequestOutput.drafted_tokens``)."""
        self.top = int(p.top_logprobs)
        """How many alternatives to record per token (``top_ids`` / ``top_logprobs``, k each, flat)."""
        self.top_ids: list[int] = []
        self.top_logprobs: list[float] = []
        self.want_prompt_logprobs = req.prompt_logprobs
        self.prompt_logprobs: list[float] | None = None
        """Computed at prefill; handed out with the first output."""
        self.prompt_top = int(req.prompt_top_logprobs)
        """How many alternatives to record per prompt position (``prompt_tops``)."""
        self.prompt_tops: tuple[list[int], list[float]] | None = None
        """``(ids, logprobs)``, ``prompt_top`` per prompt token after the first: computed at prefill,
        handed out with the first output."""
        self.scorer = None if req.prompt_scoring is None else PromptScorer(req.prompt_scoring, self.temperature,
                                                                           self.seed)
        self.length = 0
        """Tokens of this sequence held in its KV cache slot."""
        self.epoch = -1
        """The backend's weight install count when this sequence was prefilled: its KV is the
        prefix cache's to keep only if no install happened since."""
        self.ok = False
        """Finished normally (a stop or max_tokens): its KV may go into the prefix cache."""

    @property
    def needs_whole_prompt(self) -> bool:
        """Prompt logprobs (or their top k) come from running every prompt position."""
        return self.want_prompt_logprobs or self.prompt_top > 0 or self.scorer is not None

    def report(self) -> RequestOutput:
        """An output with the tokens not yet reported (and the prompt logprobs, once)."""
        start, self.reported = self.reported, len(self.tokens)
        out = RequestOutput(self.rid, self.tokens[start:], self.logprobs[start:], prompt_logprobs=self.prompt_logprobs,
                            cached_tokens=self.cached if start == 0 else None)
        if self.drafted:
            out.drafted_tokens, out.accepted_tokens, self.drafted, self.accepted = self.drafted, self.accepted, 0, 0
        if self.top:
            out.top_ids = self.top_ids[start * self.top:]
            out.top_logprobs = self.top_logprobs[start * self.top:]
        if self.prompt_tops is not None:
            out.prompt_top_ids, out.prompt_top_logprobs = self.prompt_tops
        if self.scorer is not None:
            out.prompt_scores, self.scorer = self.scorer.scores(), None
        self.prompt_logprobs = self.prompt_tops = None
        return out


def eos_ids(model: Any) -> frozenset[int]:
    """The model's end-of-sequence token ids (its config's and its generation config's)."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def backend_tokenizer(model_path: str) -> Any:
    """The tokenizer of the model directory, or None where it has none (stop strings and
    constraints then are not served)."""
    if not any(os.path.isfile(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from rlengine.backends.torch.models import load_tokenizer

    return load_tokenizer(model_path)
