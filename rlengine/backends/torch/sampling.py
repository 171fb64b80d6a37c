"""Per-request sampling and stop detection for the torch backend.

``sample_tokens`` turns one step's logits [B, vocab] into one token per row,
each row with its own temperature, top-k, top-p and random stream:

* temperature 0 is greedy (``argmax`` of the raw logits, as HF ``generate``);
* otherwise logits / temperature, then top-k, then top-p (nucleus: keep the
  most likely tokens until their mass reaches ``top_p``; the top token is
  always kept), renormalised, and one token drawn by inverting the CDF with
  a uniform number. A row with neither top-k nor top-p inverts the CDF in
  vocabulary order (no sort is needed); a filtered row in descending order.

The uniform of a row is a pure function of its request's seed and the
number of tokens it has generated (``uniforms``: splitmix64, the project's
one mixer, ``rlengine.seeding``), and which of the two paths a row takes
depends on its own settings alone, so a seed reproduces its tokens whatever
shares the batch, on every device, without a generator object per request.

The logprob returned for each token is ``log_softmax`` of the *raw* logits,
not the tempered or filtered ones (what a trainer's plain forward pass
computes for the same token, and what vLLM returns by default), except on
rows marked ``processed`` (``SamplingParams.logprobs_mode``): there it is the
logprob under the distribution the token was drawn from, after temperature,
top-k and top-p. ``filter_sorted`` is the one definition of that filter; the
torch trainer applies it too (``processed_logprobs``), so both sides compute
the same transform.

``StopText`` detokenizes a sequence incrementally (decoding only a short
window per step, not the whole text) and reports when a stop string
appears in the generated text. This module holds no request state beyond
that and never touches the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlengine.seeding import mix_array

__all__ = ["StopText", "filter_sorted", "processed_log_softmax", "sample_tokens", "uniforms"]


def filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tempered logits sorted in descending order per row [N, V] with -inf beyond the
    row's ``top_k`` (vocab size: no limit) and then beyond its nucleus of mass ``top_p``
    (per-row tensors [N])."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Keep a token when the mass strictly before it is below top_p; the
    # first token has none before it, so it is always kept.
    beyond = (probs.cumsum(-1) - probs) >= top_p[:, None]
    return sorted_logits.masked_fill(beyond, float("-inf"))


def processed_log_softmax(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities [N, V] in vocabulary order under the sampling transform of each row:
    ``logits / temperature``, ``filter_sorted``'s top-k and top-p (-inf outside), renormalised.
    ``keep`` [N] (token ids) stays in its row's support even if filtered out, so a trainer's
    target token always has a finite logprob. Differentiable in ``logits``."""
    scaled = logits / temperature[:, None]
    sorted_logits, sorted_ids = scaled.detach().sort(dim=-1, descending=True)
    kept_sorted = filter_sorted(sorted_logits, top_k, top_p).isfinite()
    kept = torch.empty_like(kept_sorted).scatter_(-1, sorted_ids, kept_sorted)
    if keep is not None:
        kept[torch.arange(kept.shape[0], device=kept.device), keep] = True
    return scaled.masked_fill(~kept, float("-inf")).log_softmax(-1)


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) of draw ``counters[i]`` of the request seeded ``seeds[i]`` (float64,
    53 random bits of splitmix64)."""
    return (mix_array(seeds, counters) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose CDF reaches ``u`` times the row's mass: never a zero-probability
    token (its CDF equals its predecessor's), and within range up to rounding."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, seeds: list[int | None], counters: list[int],
                  temperature: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                  top_p: torch.Tensor | None = None,
                  processed: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob (raw, or processed where ``processed[i]``); see
    the module docstring.

    ``seeds[i]`` is None exactly for greedy rows (whose logprob is raw either way);
    ``counters[i]`` is the row's draw index (tokens it generated so far). ``temperature``,
    ``top_k`` (vocab size when disabled) and ``top_p`` are per-row tensors on ``logits``'
    device, needed only when some row samples.
    """
    logprobs_all = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    sampled_rows = [i for i, seed in enumerate(seeds) if seed is not None]
    processed_at: list[torch.Tensor] = []
    processed_lps: list[torch.Tensor] = []
    if sampled_rows:
        assert temperature is not None and top_k is not None and top_p is not None
        device = logits.device
        rows = torch.as_tensor(sampled_rows, device=device)
        draws = torch.from_numpy(uniforms(np.asarray([seeds[i] for i in sampled_rows], dtype=np.uint64),
                                          np.asarray([counters[i] for i in sampled_rows]))).to(device)
        vocab = logits.shape[-1]
        filtered = ((top_k[rows] < vocab) | (top_p[rows] < 1.0)).tolist()
        for wanted in (False, True):
            picks = [k for k, f in enumerate(filtered) if f == wanted]
            if not picks:
                continue
            at = rows[picks] if len(picks) < len(sampled_rows) else rows
            u = draws[picks] if len(picks) < len(sampled_rows) else draws
            scaled = logits[at] / temperature[at, None]
            if wanted:
                sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
                kept = filter_sorted(sorted_logits, top_k[at], top_p[at])
                picked = _invert(kept.softmax(-1), u)
                chosen = sorted_ids.gather(-1, picked).squeeze(-1)
            else:
                kept = scaled
                picked = _invert(scaled.softmax(-1), u)
                chosen = picked.squeeze(-1)
            tokens = tokens.index_copy(0, at, chosen)
            if processed is not None and any(processed[int(i)] for i in at.tolist()):
                processed_at.append(at)
                processed_lps.append(kept.log_softmax(-1).gather(-1, picked).squeeze(-1))
    logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    for at, lps in zip(processed_at, processed_lps):
        assert processed is not None
        keep = torch.as_tensor([processed[i] for i in at.tolist()], device=logits.device)
        logprobs = logprobs.index_copy(0, at, torch.where(keep, lps, logprobs[at]))
    return tokens, logprobs


class StopText:
    """Incremental detokenization of one sequence's generated tokens, for stop strings.

    Decoding the whole sequence each step would cost O(n^2); instead each
    step decodes a window starting a few tokens back (``prefix``) and keeps
    only the text beyond what that window already produced (``read``), so a
    token whose bytes complete a character (byte-level BPE) or whose leading
    space depends on its predecessor (SentencePiece) decodes correctly. Text
    ending in U+FFFD (an incomplete UTF-8 sequence) waits for more tokens.
    Special tokens are kept in the text, so a stop string can name one.
    """

    __slots__ = ("prefix", "read", "stops", "text", "tokenizer")

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = ""
        self.prefix = 0
        self.read = 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def feed(self, tokens: list[int]) -> bool:
        """``tokens`` is the whole generated sequence so far; True once a stop string appears."""
        before = self._decode(tokens[self.prefix:self.read])
        window = self._decode(tokens[self.prefix:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return False
        new = window[len(before):]
        start = len(self.text)
        self.text += new
        self.prefix, self.read = self.read, len(tokens)
        # A stop string may begin in earlier text and end in the new piece.
        return any(self.text.find(s, max(0, start - len(s) + 1)) != -1 for s in self.stops)
