"""Tinker's prompt scoring options: ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``.

What the SDK (tinker 0.38) defines, and rlengine serves:

* ``target_prompt_logprobs``: an int64 tensor ``[len(prompt) - 1, K]`` of
  token ids; cell ``[i, j]`` is scored at prompt position ``i + 1``, and a
  cell of -1 asks nothing and gets 0.0. Dense, or sparse CSR (only the
  listed cells ask; the others are -1). The response
  (``SampleResponse.target_prompt_logprobs``) is a float32 tensor of the same
  shape and layout: the same CSR indices when the request was sparse.
* ``prompt_alt_tokens_k``: k draws at every prompt position after the first,
  independently and at the request's temperature, from the model's
  next-token distribution, in the prefill that serves the request; the
  response's ``prompt_alt_tokens`` holds their ids (int64) and logprobs
  (float32) as two ``[len(prompt) - 1, k]`` tensors.

``prompt_scoring`` checks a request's options against its prompt and the
backend (``InvalidRequest`` naming the field and value; ``NotSupported``
naming the backend that lacks ``Capabilities.prompt_scores``) and makes the
engine's ``PromptScoring``. The SDK says the server "bounds the cost,
``len(prompt) * distinct ids``" (and ``len(prompt) * k``) "the way it bounds
a top-k width": rlengine's bound is the cost of the widest top-k prompt
logprobs it serves over its whole context, ``Capabilities.prompt_top_logprobs
* max_model_len`` (so a short prompt may name more ids than a top-k width;
the decisions recipe names up to 26). ``target_tensor`` and
``alt_tensors`` lay the engine's ``PromptScores`` out for the two wire
encoders (``wire`` for JSON, ``proto``). The logprobs are raw
(``log_softmax`` of the logits), as prompt logprobs are; see
``backends.torch.prompt_scores`` for how the torch backend draws.

Pure functions of their arguments; no engine state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import NotSupported
from rlengine.types import PromptScores, PromptScoring

__all__ = ["TargetLayout", "alt_tensors", "prompt_scoring", "target_tensor"]


class TargetLayout(NamedTuple):
    """A sparse ``target_prompt_logprobs`` request's CSR indices (int64), which its response keeps."""

    crow: np.ndarray
    col: np.ndarray


def prompt_scoring(targets: np.ndarray | None, alt_k: int, prompt_len: int, backend: Any) -> PromptScoring | None:
    """The ``PromptScoring`` of a request's ``target_prompt_logprobs`` (densified, -1 where no id is
    asked: ``wire.prompt_targets``) and ``prompt_alt_tokens_k``; None when it asks neither."""
    if targets is None and not alt_k:
        return None
    caps = backend.capabilities
    budget = caps.prompt_top_logprobs * backend.max_model_len
    for field, value, asked in (("target_prompt_logprobs", None if targets is None else list(targets.shape),
                                 targets is not None), ("prompt_alt_tokens_k", alt_k, alt_k > 0)):
        if asked and not caps.prompt_scores:
            raise NotSupported(field, value, f"the {backend.name} backend does not score prompt positions "
                               "(chosen tokens' logprobs and draws); the torch backend does")
    target_raw, target_k = None, 0
    if targets is not None:
        rows = prompt_len - 1
        if targets.ndim != 2 or targets.shape[0] != rows:
            raise InvalidRequest("target_prompt_logprobs.shape", list(targets.shape),
                                 f"must be [len(prompt) - 1, K] = [{rows}, K] for this {prompt_len}-token prompt")
        low, high = int(targets.min(initial=-1)), int(targets.max(initial=-1))
        if low < -1 or high >= backend.vocab_size:
            raise InvalidRequest("target_prompt_logprobs", low if low < -1 else high,
                                 f"token ids must be in [0, {backend.vocab_size}) or -1 (none asked)")
        distinct = int(np.unique(targets[targets >= 0]).size)
        if not distinct:
            raise InvalidRequest("target_prompt_logprobs", list(targets.shape), "names no token id (every cell "
                                 "is -1); ask at least one")
        if prompt_len * distinct > budget:
            raise InvalidRequest("target_prompt_logprobs", distinct, f"distinct ids over a {prompt_len}-token "
                                 f"prompt: len(prompt) * distinct ids must be at most {budget} "
                                 f"({caps.prompt_top_logprobs} per position over {backend.max_model_len} tokens)")
        target_raw, target_k = targets.astype(np.int32).tobytes(), int(targets.shape[1])
    if alt_k and prompt_len * alt_k > budget:
        raise InvalidRequest("prompt_alt_tokens_k", alt_k, f"over a {prompt_len}-token prompt: len(prompt) * k "
                             f"must be at most {budget} ({caps.prompt_top_logprobs} per position over "
                             f"{backend.max_model_len} tokens)")
    return PromptScoring(target_ids_raw=target_raw, target_k=target_k, alt_k=alt_k)


def target_tensor(scores: PromptScores, layout: TargetLayout | None) -> tuple[np.ndarray, list[int]] | None:
    """The response's ``target_prompt_logprobs``: float32 values (every cell row-major, or the listed
    cells of a sparse request, in its CSR order) and the dense shape; None when none was asked."""
    if scores.target_logprobs_raw is None:
        return None
    k = scores.target_k
    dense = np.frombuffer(scores.target_logprobs_raw, dtype=np.float32).reshape(-1, k)
    if layout is None:
        return dense.ravel(), list(dense.shape)
    rows = np.repeat(np.arange(dense.shape[0]), np.diff(layout.crow))
    return dense[rows, layout.col], list(dense.shape)


def alt_tensors(scores: PromptScores) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """The response's ``prompt_alt_tokens``: int32 ids and float32 logprobs (row-major) and their shape
    ``[len(prompt) - 1, k]``; None when none was asked."""
    if scores.alt_ids_raw is None or scores.alt_logprobs_raw is None:
        return None
    ids = np.frombuffer(scores.alt_ids_raw, dtype=np.int32)
    return ids, np.frombuffer(scores.alt_logprobs_raw, dtype=np.float32), [ids.size // scores.alt_k, scores.alt_k]
