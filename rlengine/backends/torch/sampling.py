"""Per-request sampling and stop detection for the torch backend.

``sample_tokens`` turns one step's logits [B, vocab] into one token per row,
each row with its own temperature, top-k, top-p and random stream:

* temperature 0 is greedy (``argmax`` of the raw logits, as HF ``generate``);
* otherwise logits / temperature, then top-k, then top-p (nucleus: keep the
  most likely tokens until their mass reaches ``top_p``; the top token is
  always kept), renormalised, and one token drawn by inverting the CDF with
  a uniform number from the request's own ``torch.Generator``.

Every sampled row takes exactly one uniform from its own generator per step,
and the same sort-based path whatever its neighbours need, so a seed
reproduces its tokens regardless of batch composition. The generators live
on the CPU, so a seed means the same draws on every device.

The logprob returned for each token is ``log_softmax`` of the *raw* logits,
not the tempered or filtered ones: that is what a trainer's forward pass
computes for the same token, and what vLLM returns by default.

``StopText`` detokenizes a sequence incrementally (decoding only a short
window per step, not the whole text) and reports when a stop string
appears in the generated text. This module holds no request state beyond
that and never touches the model.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StopText", "sample_tokens"]


def sample_tokens(logits: torch.Tensor, generators: list[torch.Generator | None],
                  temperature: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                  top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its raw logprob; see the module docstring.

    ``generators[i]`` is None exactly for greedy rows. ``temperature``,
    ``top_k`` (vocab size when disabled) and ``top_p`` are per-row tensors on
    ``logits``' device, needed only when some row samples.
    """
    logprobs_all = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    sampled_rows = [i for i, g in enumerate(generators) if g is not None]
    if sampled_rows:
        assert temperature is not None and top_k is not None and top_p is not None
        rows = torch.as_tensor(sampled_rows, device=logits.device)
        scaled = logits[rows] / temperature[rows, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[rows, None], float("-inf"))
        probs = sorted_logits.softmax(-1)
        # Keep a token when the mass strictly before it is below top_p; the
        # first token has none before it, so it is always kept.
        beyond = (probs.cumsum(-1) - probs) >= top_p[rows, None]
        probs = sorted_logits.masked_fill(beyond, float("-inf")).softmax(-1)
        cdf = probs.cumsum(-1)
        uniforms = torch.stack([torch.rand((), generator=generators[i], dtype=torch.float64)
                                for i in sampled_rows]).to(device=logits.device, dtype=cdf.dtype)
        # The first index whose CDF reaches u: never a zero-probability token
        # (its CDF equals its predecessor's), and within range up to rounding.
        picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[-1] - 1)
        tokens = tokens.index_copy(0, rows, sorted_ids.gather(-1, picked).squeeze(-1))
    logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
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
