"""Constrained decoding for the backends that sample themselves (torch, scripted), with xgrammar.

A request's ``SamplingParams.constraint`` is an xgrammar structural tag
(JSON text). ``Grammars`` compiles it against the model's tokenizer (its
compiler caches compiled grammars, so the same tools or schema compile once)
and gives each sequence its own ``GrammarMatcher``. Each step,
``mask_logits`` writes the matchers' allowed-token bitmasks over their rows
of the logits (disallowed tokens become -inf) before sampling, so the
sampled token and its logprob come from the masked distribution; the
sequence then feeds its token to its matcher (``Constrained.accept``). Once
the structure is complete the matcher allows only the model's end tokens.

vLLM needs none of this: it takes the same structural tag through its own
structured outputs (``vllm_backend``). Compute thread only; xgrammar is
imported on first use, so a backend that never sees a constraint never
loads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlengine.errors import InvalidRequest

__all__ = ["Constrained", "Grammars", "mask_logits"]


class Constrained:
    """One sequence's matcher: which tokens may come next, and what it has accepted."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Feed the sampled token; False when the constraint does not allow it."""
        return bool(self.matcher.accept_token(token))

    def fill(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints for one tokenizer (lazily: xgrammar loads at the first constraint)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self._compiler: Any = None

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, constraint: str) -> Constrained:
        """A fresh matcher for ``constraint``; ``InvalidRequest`` when xgrammar cannot compile it."""
        if self.tokenizer is None:
            raise InvalidRequest("sampling_params.constraint", constraint[:60], "the model directory has no tokenizer")
        import xgrammar as xgr

        try:
            compiled = self._xgr_compiler().compile_structural_tag(constraint)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/pydantic errors
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequest("sampling_params.constraint", constraint[:60],
                                 f"xgrammar cannot compile it: {reason[:300]}") from None
        return Constrained(xgr.GrammarMatcher(compiled))


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
