"""Prompt scores for the torch backend: chosen tokens' logprobs and draws at prompt positions.

A request's ``PromptScoring`` (the Tinker API's ``target_prompt_logprobs`` and
``prompt_alt_tokens_k``) is served from the logits of the prefill that serves
the request, chunk by chunk, as ``DecoderRunner.target_logprobs`` computes the
prompt logprobs from them: no extra forward pass. Row i covers prompt position
i + 1 (position 0 has no context). Every logprob here is
``logits[token] - logsumexp(logits)`` of that same chunk of logits, the
arithmetic of the prompt logprobs, so a target or a draw that is the prompt's
own token at a position has bitwise its prompt logprob (in batch-invariant
mode too: the logits are those of the invariant prefill).

Draws: at temperature T > 0, ``alt_k`` independent draws per position, with
replacement, from softmax(logits / T), each by inverting the CDF with a
uniform that is a pure function of the request's seed and the draw's index
(``sampling.uniforms``, on a stream of its own: ``mix_seed(seed,
_DRAW_STREAM)``), so a seed reproduces them whatever shares the batch and
however the positions are chunked. At temperature 0 (greedy) every draw is
the most likely token. top-k and top-p do not apply: the SDK defines the
draws by the temperature alone.

Compute thread only; a ``PromptScorer`` holds one request's partial results
and nothing else.
"""

from __future__ import annotations

import numpy as np
import torch

from rlengine.backends.torch.sampling import uniforms
from rlengine.seeding import mix_seed
from rlengine.types import PromptScores, PromptScoring

__all__ = ["PromptScorer"]

_DRAW_STREAM = 0x70A1
"""Folded into a request's seed for its prompt draws, apart from the stream of its sampled tokens."""


class PromptScorer:
    """One request's ``PromptScoring``, taken chunk by chunk from its prefill's logits (``take``)."""

    __slots__ = ("alt_k", "draw_seed", "drawn", "drawn_lps", "target_ids", "target_k", "target_lps", "temperature")

    def __init__(self, scoring: PromptScoring, temperature: float, seed: int | None) -> None:
        self.target_k = scoring.target_k
        self.target_ids = None
        if self.target_k:
            assert scoring.target_ids_raw is not None
            # A copy (int64, what gather takes): torch refuses to wrap the read-only view of the bytes.
            self.target_ids = np.frombuffer(scoring.target_ids_raw, dtype=np.int32).astype(np.int64).reshape(
                -1, self.target_k)
        self.alt_k = scoring.alt_k
        self.temperature = temperature
        self.draw_seed = None if seed is None or temperature <= 0.0 else mix_seed(seed, _DRAW_STREAM)
        """None: greedy draws."""
        self.target_lps: list[torch.Tensor] = []
        self.drawn: list[torch.Tensor] = []
        self.drawn_lps: list[torch.Tensor] = []

    def take(self, start: int, logits: torch.Tensor, norm: torch.Tensor) -> None:
        """Score prompt rows ``start..start + n - 1`` from their float32 logits [n, vocab] and their
        ``logsumexp`` [n] (the ones the prompt logprobs are computed from)."""
        n = logits.shape[0]
        if self.target_k:
            assert self.target_ids is not None
            ids = torch.from_numpy(self.target_ids[start:start + n]).to(logits.device)
            wanted = ids >= 0
            lps = logits.gather(-1, ids.clamp(min=0)) - norm[:, None]
            self.target_lps.append(lps.masked_fill(~wanted, 0.0))
        k = self.alt_k
        if k:
            if self.draw_seed is None:
                drawn = logits.argmax(-1, keepdim=True).expand(n, k)
            else:
                counters = np.arange(start * k, (start + n) * k)
                u = torch.from_numpy(uniforms(np.full(n * k, self.draw_seed, dtype=np.uint64), counters))
                cdf = (logits / self.temperature).softmax(-1).cumsum(-1)
                # The first index whose CDF reaches u times the row's mass (never a zero-probability token).
                drawn = torch.searchsorted(cdf, u.to(device=logits.device, dtype=cdf.dtype).view(n, k)
                                           * cdf[:, -1:]).clamp_(max=cdf.shape[-1] - 1)
            self.drawn.append(drawn)
            self.drawn_lps.append(logits.gather(-1, drawn) - norm[:, None])

    def scores(self) -> PromptScores:
        """What was taken, as raw bytes (row-major; empty for a one-token prompt)."""
        target = _raw(self.target_lps, np.float32) if self.target_k else None
        drawn = (_raw(self.drawn, np.int32), _raw(self.drawn_lps, np.float32)) if self.alt_k else (None, None)
        return PromptScores(target_k=self.target_k, target_logprobs_raw=target, alt_k=self.alt_k,
                            alt_ids_raw=drawn[0], alt_logprobs_raw=drawn[1])


def _raw(parts: list[torch.Tensor], dtype: type) -> bytes:
    if not parts:
        return b""
    return torch.cat(parts).cpu().numpy().astype(dtype, copy=False).tobytes()
