"""Batched prefill and decode over a Hugging Face causal LM, with a slot-based KV cache.

The torch backend needs what HF ``generate`` does not give: sequences that
join and leave a running batch at any step. So this module runs the
decoder itself, using the HF model's own modules and weights (embeddings,
projections, norms, MLPs, rotary embedding, LM head) but its own attention
over its own cache:

* ``KVSlots`` holds one padded buffer ``[2 * layers, slots, kv_heads,
  length, head_dim]`` (each layer's K and V). Running sequence ``i`` owns
  slot ``i``; when a sequence leaves, the last slot moves into the hole, so
  the live slots are always ``0..n-1`` and a decode step reads one
  contiguous prefix of the buffer. The buffer grows by doubling (the backend
  reserves what its sequences may reach up front) and is freed when no
  sequence runs (no sleep mode is needed to give memory back between bursts).
* ``DecoderRunner.prefill`` runs new prompts into fresh slots: cold ones
  right-padded in one batch over their own K/V; ones whose leading KV was
  copied in from the prefix cache (``PrefillJob.start``) over their slot,
  computing only the positions after it. ``decode`` runs one token for
  every live slot in one batch, each at its own position, with a padding
  mask; on the CPU its attention is two batched matmuls (SDPA's kernel
  costs more per sequence and head than one query's work).

Batch invariance (``batch_invariant=True``): by default a sequence's logits
depend, in the last bits, on what else shares its batch (CPU GEMM kernels
pick their kernel, and with it the order of each dot product, from the
number of rows; attention's reductions depend on the padded key span), so a
multi-turn run whose batches form by timing cannot be reproduced from its
seed. In this mode every kernel call has a fixed shape (``invariant``): a
pass's rows are packed and run through the layers in fixed row tiles, and
attention runs on items of one sequence's block of query rows (or one
decoded position) against a key span that depends on its position alone.
Prompts are prefilled in one pass over all their rows; position p belongs to
the block ``block_start(p)`` (16 positions below 256, 64 after), whose rows
attend over keys ``0..block end`` under one causal mask, so a position's K/V
is a function of the tokens up to it alone, whoever computed the positions
before it: that lets the prefix cache reuse prefilled KV in this mode
bitwise, a prefill resuming at its first uncached position with the block's
other rows as zero query rows. Decode computes its position differently (one
query against a span rounded up to 64), so in this mode the backend caches
only prefilled KV, never generated tokens'. Proven by the bitwise tests under
adversarial kernels (``tests/adversarial.py``) at every CPU capability level;
``DecoderRunner.canary`` checks the real kernels at start-up. It is an option
(``engine_args["batch_invariant"]``; the RL runs turn it on).

Masked cache positions must hold finite values (0 * NaN would poison the
attention output), so buffers start zeroed and only ever receive computed
K/V. The trainer does not use this module: it runs the HF model's own
forward, which is what makes "sampler logprobs == trainer logprobs" a real
cross-check of this code.

Only Llama-style decoders are run (``runtime.SUPPORTED_ARCHITECTURES``).
Every method runs on the engine's compute thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlengine.backends.torch.fused import FusedLayer
from rlengine.backends.torch.invariant import (
    SMALL_BLOCK,
    Canary,
    Plan,
    Tiles,
    attend,
    block_end,
    block_start,
    canary,
    in_tiles,
    plan_decode,
    plan_prefill,
    span_end,
)
from rlengine.backends.torch.prompt_scores import PromptScorer
from rlengine.errors import ConfigurationError

__all__ = ["DecoderRunner", "KVSlots", "PrefillJob"]

_LOGIT_CHUNK = 1024
"""Positions per LM-head chunk for prompt logprobs: bounds the [n, vocab] logits held at once."""


class KVSlots:
    """Padded K/V buffers indexed by slot, every layer in one tensor; see the module docstring."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.kv: torch.Tensor | None = None
        """``[2 * layers, slots, kv_heads, length, head_dim]``: layer l's K at ``2l``, its V at ``2l + 1``."""
        self.slot_cap = 0
        self.len_cap = 0
        self.bytes_per_token = 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        """KV bytes of one position of one slot (what the prefix cache stores per token)."""

    def reserve(self, n_slots: int, length: int) -> None:
        """Make room for ``n_slots`` slots of ``length`` positions, keeping contents."""
        if n_slots <= self.slot_cap and length <= self.len_cap:
            return
        if length > self.max_len:
            raise ValueError(f"KV cache: length {length} exceeds max_model_len {self.max_len}")
        slots = max(n_slots, 2 * self.slot_cap, 1) if n_slots > self.slot_cap else self.slot_cap
        if length > self.len_cap:
            length = min(self.max_len, max(length, 2 * self.len_cap))
        else:
            length = self.len_cap
        old = self.kv
        self.kv = torch.zeros((2 * self.n_layers, slots, self.n_kv_heads, length, self.head_dim), dtype=self.dtype,
                              device=self.device)
        if old is not None:
            self.kv[:, :self.slot_cap, :, :self.len_cap] = old
        self.slot_cap, self.len_cap = slots, length

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s K and V buffers ``[slots, kv_heads, length, head_dim]`` (views)."""
        assert self.kv is not None
        return self.kv[2 * index], self.kv[2 * index + 1]

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy slots ``src``' first ``length`` positions into slots ``dst`` (pairwise, one copy;
        no slot both read and written)."""
        assert self.kv is not None
        if len(src) == 1:
            self.kv[:, dst[0], :, :length] = self.kv[:, src[0], :, :length]
        else:
            index = torch.as_tensor(src, device=self.device)
            self.kv[:, torch.as_tensor(dst, device=self.device), :, :length] = self.kv[:, index, :, :length]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of slot ``slot``'s positions ``start..end-1``: ``[2 * layers, kv_heads, n, head_dim]``."""
        assert self.kv is not None
        return self.kv[:, slot, :, start:end].clone()

    def write(self, slot: int, pieces: list[torch.Tensor], length: int) -> None:
        """Fill slot ``slot``'s first ``length`` positions from ``pieces`` (``read``'s layout, in order)."""
        assert self.kv is not None
        at = 0
        for piece in pieces:
            if at >= length:
                break
            n = min(piece.shape[-2], length - at)
            self.kv[:, slot, :, at:at + n] = piece[..., :n, :]
            at += n
        assert at == length, (at, length)

    def release(self) -> None:
        self.kv = None
        self.slot_cap = self.len_cap = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


class PrefillJob:
    """One prompt to prefill into a slot: its tokens, how many leading positions are already in the
    slot's KV (``start``; 0 for a cold prefill), and what the caller wants back."""

    __slots__ = ("pieces", "prompt_top", "scorer", "start", "tokens", "want_prompt_logprobs")

    def __init__(self, tokens: list[int], start: int = 0, pieces: list[torch.Tensor] | None = None,
                 want_prompt_logprobs: bool = False, prompt_top: int = 0, scorer: PromptScorer | None = None) -> None:
        if not 0 <= start < len(tokens):
            raise ValueError(f"prefill start {start}: must leave at least one of {len(tokens)} tokens to run")
        if start and (want_prompt_logprobs or prompt_top or scorer is not None):
            raise ValueError("prompt logprobs need the whole prompt run (start 0)")
        self.tokens = tokens
        self.start = start
        self.pieces = pieces or []
        """KV of positions ``0..start-1`` (``KVSlots.read``'s layout, in order; may cover more)."""
        self.want_prompt_logprobs = want_prompt_logprobs
        self.prompt_top = prompt_top
        self.scorer = scorer
        """Takes the prompt positions' logits as the prompt logprobs are computed (``prompt_scores``)."""


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _rms_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's output in one fused call (bitwise HF's own on the CPU, measured for
    float32, bfloat16 and float16: normalise in float32, cast back, then scale)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        return module(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), module.weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * module.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderRunner:
    """Prefill and decode for a Llama-style HF causal LM; see the module docstring.

    Why one class: prefill and decode share the weights it binds, the KV layout and the fixed
    tiles of the batch-invariant path; each is a method over that one state.
    """

    def __init__(self, model: Any, max_len: int, *, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        try:
            inner = model.model
            self.embed = inner.embed_tokens
            self.layers = list(inner.layers)
            self.norm = inner.norm
            self.rotary = inner.rotary_emb
            self.lm_head = model.lm_head
        except AttributeError as exc:
            raise ConfigurationError(f"model architecture {type(model).__name__}: not a Llama-style decoder "
                                     f"({exc})") from None
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        param = next(model.parameters())
        # Batch-invariant decode rounds its key span up to a whole block, past max_len if need be.
        cache_len = span_end(max_len) if batch_invariant else max_len
        self.cache = KVSlots(len(self.layers), self.n_kv_heads, self.head_dim, cache_len, param.dtype, param.device)
        self.device = param.device
        # On the CPU, decode attention runs as two batched matmuls: SDPA's kernel costs more
        # per (sequence, head) than one query's worth of work (bench/RESULTS.md, issue 19).
        self._matmul_decode = self.device.type == "cpu"
        self._fused = [FusedLayer(layer) for layer in self.layers]
        """Each layer's q/k/v and gate/up projections as one GEMM each (the modules' parameters are
        views into them)."""
        self.tiles = Tiles.of(self._fused[0].row_flops(), 2 * cfg.hidden_size * self.lm_head.out_features,
                              self.n_heads, self.n_kv_heads, self.head_dim)
        """The fixed kernel shapes of batch-invariant mode (``invariant``)."""
        self.views = True
        """Batch-invariant attention reads consecutive cache slots in place (``check_kernels`` turns
        it off where a view and a gathered copy round differently)."""
        # Rotary cos/sin of every position, computed once: a position's values never depend on
        # which other positions a pass holds.
        with torch.inference_mode():
            positions = torch.arange(cache_len, device=self.device)[None]
            cos, sin = self.rotary(torch.zeros((), dtype=param.dtype, device=self.device), positions)
        self._cos, self._sin = cos[0], sin[0]

    def _rows(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        """A row-wise module (projection, MLP) over a batch's rows: in fixed row tiles in
        batch-invariant mode, else in one call."""
        return in_tiles(fn, x, self.tiles.rows) if self.batch_invariant else fn(x)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits of ``hidden`` [n, hidden]."""
        if self.batch_invariant:
            return in_tiles(self.lm_head, hidden, self.tiles.head_rows).float()
        return self.lm_head(hidden).float()

    def check_kernels(self) -> Canary:
        """``invariant.canary`` on every fixed shape this model's batch-invariant mode calls."""
        tiles = self.tiles
        linears = [(name, fn, width, tiles.rows) for name, fn, width in self._fused[0].row_calls()]
        linears.append(("lm_head", self.lm_head, self.lm_head.in_features, tiles.head_rows))
        # The first and the last block, prefilled and decoded.
        last = self.cache.max_len
        spans = sorted({(1, SMALL_BLOCK), (SMALL_BLOCK, SMALL_BLOCK), (1, last), (last - block_start(last - 1), last)})
        with torch.inference_mode():
            report = canary(linears, tiles, spans, self.cache.dtype, self.device)
        self.views = report.views
        return report

    def reserve(self, n_slots: int, length: int) -> None:
        """Make room for ``n_slots`` sequences of up to ``length`` tokens (a caller that knows how
        long its sequences may grow spares the cache regrowing, and a fresh cache its zero-fill)."""
        if self.batch_invariant:
            length = span_end(length + 1)  # what the last decode step attends over
        self.cache.reserve(n_slots, min(length, self.cache.max_len))

    # -- the decoder layers ----------------------------------------------------------

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """Run every layer on ``x`` [B, L, hidden]; ``attend(layer, q, k, v)`` stores the new K/V
        [B, kv_heads, L, head_dim] in the cache and returns the attention output [B, heads, L, head_dim]."""
        rows = self._rows
        b, n, _ = x.shape
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        for index, (layer, fused) in enumerate(zip(self.layers, self._fused)):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, x)
            q, k, v = rows(fused.qkv, h).split([fused.q_width, fused.kv_width, fused.kv_width], -1)
            q = q.view(b, n, self.n_heads, self.head_dim)
            k = k.view(b, n, self.n_kv_heads, self.head_dim)
            v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            # Rotary on the query and key heads at once (elementwise: the same numbers, fewer calls).
            qk = torch.cat([q, k], 2).transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
            out = attend(index, q, k, v)
            x = x + rows(attn.o_proj, out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
            x = x + rows(fused.mlp, _rms_norm(layer.post_attention_layernorm, x))
        return _rms_norm(self.norm, x)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean attention mask as the additive one SDPA would build from it on every call
        (0 where visible, -inf elsewhere), built once for all layers."""
        return torch.zeros(visible.shape, dtype=self.cache.dtype, device=self.device).masked_fill_(
            ~visible, float("-inf"))

    # -- prefill ------------------------------------------------------------------------

    def prefill(self, jobs: list[PrefillJob], first_slot: int) -> tuple[torch.Tensor, list[list[float] | None],
                                                                        list[Any]]:
        """Run ``jobs`` into slots ``first_slot..``; returns the float32 logits of each prompt's last
        position [B, vocab], where asked the logprob of every prompt token after the first, and
        where ``prompt_top`` k > 0 the k most likely tokens at each of those positions
        (``(ids, logprobs)``, k per position, flat). A job with ``start`` > 0 has its first
        ``start`` positions' KV copied from its ``pieces`` and computes only the rest."""
        end = max(len(job.tokens) for job in jobs)
        if self.batch_invariant:
            end = max(block_end(block_start(len(job.tokens) - 1)) for job in jobs)
        self.cache.reserve(first_slot + len(jobs), end)
        for i, job in enumerate(jobs):
            if job.start:
                self.cache.write(first_slot + i, job.pieces, job.start)
        if self.batch_invariant:
            hidden_last, prompt_hidden = self._prefill_invariant(jobs, first_slot)
        elif any(job.start for job in jobs):
            hidden_last, prompt_hidden = self._prefill_extend(jobs, first_slot)
        else:
            hidden_last, prompt_hidden = self._prefill_cold(jobs, first_slot)
        prompt_logprobs: list[list[float] | None] = []
        prompt_tops: list[Any] = []
        for job, hidden in zip(jobs, prompt_hidden):
            if hidden is None:
                prompt_logprobs.append(None)
                prompt_tops.append(None)
                continue
            targets = torch.as_tensor(job.tokens[1:], dtype=torch.long, device=self.device)
            lps, top_lps, top_ids = self.target_logprobs(hidden, targets, job.prompt_top, job.scorer)
            prompt_logprobs.append(lps.tolist() if job.want_prompt_logprobs else None)
            prompt_tops.append(None if top_ids is None else (top_ids.flatten().tolist(), top_lps.flatten().tolist()))
        return self._head(hidden_last), prompt_logprobs, prompt_tops

    @staticmethod
    def _wants_prompt(job: PrefillJob) -> bool:
        return job.want_prompt_logprobs or job.prompt_top > 0 or job.scorer is not None

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        return ids.to(self.device)

    def _prefill_cold(self, jobs: list[PrefillJob], first_slot: int) -> tuple[torch.Tensor, list[Any]]:
        """Whole prompts, right-padded into one batch, attending over their own new K/V."""
        b = len(jobs)
        lengths = [len(job.tokens) for job in jobs]
        ids = self._padded([job.tokens for job in jobs])
        n = ids.shape[1]
        positions = torch.arange(n, device=self.device).unsqueeze(0).expand(b, n)
        if b == 1 or min(lengths) == n:
            mask = None  # no padding: plain causal attention, the fast path
        else:
            ends = torch.as_tensor(lengths, device=self.device)
            key_ok = torch.arange(n, device=self.device)[None, :] < ends[:, None]
            causal = torch.ones((n, n), dtype=torch.bool, device=self.device).tril()
            # A padded query row still sees key 0, so no row is fully masked (no NaN).
            mask = self._additive((causal[None, :, :] & key_ok[:, None, :]).unsqueeze(1))
        cache = self.cache

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Padded positions past a prompt's end are written too; they are
            # finite and masked until that sequence's own decode overwrites them.
            ck, cv = cache.layer(layer)
            ck[first_slot:first_slot + b, :, :n] = k
            cv[first_slot:first_slot + b, :, :n] = v
            return self._sdpa(q, k, v, mask)

        hidden = self._layers(self.embed(ids), positions, attend)
        last = hidden[torch.arange(b, device=self.device), torch.as_tensor(lengths, device=self.device) - 1]
        return last, [hidden[i, :lengths[i] - 1] if self._wants_prompt(job) else None
                      for i, job in enumerate(jobs)]

    def _prefill_extend(self, jobs: list[PrefillJob], first_slot: int) -> tuple[torch.Tensor, list[Any]]:
        """Each job's positions ``start..`` (right-padded into one batch), attending over its slot:
        the reused KV before ``start`` and the new K/V after it."""
        b = len(jobs)
        starts = torch.as_tensor([job.start for job in jobs], device=self.device)
        counts = [len(job.tokens) - job.start for job in jobs]
        ids = self._padded([job.tokens[job.start:] for job in jobs])
        n = ids.shape[1]
        span = max(len(job.tokens) for job in jobs)
        steps = torch.arange(n, device=self.device)
        positions = starts[:, None] + steps[None, :]
        real = steps[None, :] < torch.as_tensor(counts, device=self.device)[:, None]
        # Only real positions are written: a padded row's positions may run past the cache.
        cache = self.cache
        rows = (first_slot + torch.arange(b, device=self.device))[:, None].expand(b, n)[real]
        at = positions[real]
        visible = torch.arange(span, device=self.device)[None, None, :] <= positions[:, :, None]
        mask = self._additive(visible.unsqueeze(1))  # [b, 1, n, span]; key 0 is always visible: no empty row

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = cache.layer(layer)
            ck[rows, :, at] = k.transpose(1, 2)[real]
            cv[rows, :, at] = v.transpose(1, 2)[real]
            return self._sdpa(q, ck[first_slot:first_slot + b, :, :span], cv[first_slot:first_slot + b, :, :span],
                              mask)

        hidden = self._layers(self.embed(ids), positions, attend)
        last = hidden[torch.arange(b, device=self.device), torch.as_tensor(counts, device=self.device) - 1]
        return last, [hidden[i, :len(job.tokens) - 1] if self._wants_prompt(job) else None
                      for i, job in enumerate(jobs)]

    def _prefill_invariant(self, jobs: list[PrefillJob], first_slot: int) -> tuple[torch.Tensor, list[Any]]:
        """Batch-invariant prefill: every job's rows from its ``start`` in one pass, attention by
        canonical blocks (``invariant.plan_prefill``)."""
        plan, offsets = plan_prefill([(job.tokens, job.start, first_slot + i) for i, job in enumerate(jobs)],
                                     self.tiles, self.cache.slot_cap, self.device)
        hidden = self._run_plan(plan)
        last = hidden[torch.as_tensor([at + len(job.tokens) - 1 - job.start for at, job in zip(offsets, jobs)],
                                      device=self.device)]
        # Prompt logprobs need the whole prompt run: start 0, so a job's rows are its positions.
        return last, [hidden[at:at + len(job.tokens) - 1] if self._wants_prompt(job) else None
                      for at, job in zip(offsets, jobs)]

    def _run_plan(self, plan: Plan) -> torch.Tensor:
        """The final hidden states [n, hidden] of a batch-invariant pass's rows: the rows padded to
        whole tiles, their K/V written to their slots, attention chunk by chunk."""
        n = plan.n
        padded = _round_up(n, self.tiles.rows)
        ids = plan.tokens.new_zeros(padded)
        ids[:n] = plan.tokens
        positions = plan.positions.new_zeros(padded)
        positions[:n] = plan.positions
        cache = self.cache
        d = self.head_dim
        # Where each row's (kv head) K/V goes in a layer's buffer viewed as [positions, head_dim].
        heads = torch.arange(self.n_kv_heads, device=self.device)
        flat = ((plan.slots[:, None] * self.n_kv_heads + heads[None, :]) * cache.len_cap
                + plan.positions[:, None]).reshape(-1)
        # One query buffer (its row n stays zero: the rows a chunk does not compute) and one output
        # buffer (rows past n stay zero) for every layer: each layer overwrites the real rows.
        q_rows = torch.zeros((n + 1, self.n_heads, d), dtype=cache.dtype, device=self.device)
        out = torch.zeros((padded, self.n_heads, d), dtype=cache.dtype, device=self.device)

        def attend_plan(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = cache.layer(layer)
            ck.view(-1, d).index_copy_(0, flat, k[0, :, :n].transpose(0, 1).reshape(-1, d))
            cv.view(-1, d).index_copy_(0, flat, v[0, :, :n].transpose(0, 1).reshape(-1, d))
            q_rows[:n] = q[0, :, :n].transpose(0, 1)
            for chunk in plan.chunks:
                attend(chunk, q_rows, ck, cv, self.scale, out, self.views)
            return out.transpose(0, 1)[None]

        return self._layers(self.embed(ids)[None], positions[None], attend_plan)[0, :n]

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, top: int = 0,
                        scorer: PromptScorer | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """log_softmax(logits)[target] per position, in chunks of positions; with ``top`` k > 0 also
        the k largest log_softmax values of each position and their token ids (else None, None);
        ``scorer`` takes each chunk's logits too."""
        out, top_lps, top_ids = [], [], []
        for start in range(0, targets.shape[0], _LOGIT_CHUNK):
            logits = self._head(hidden[start:start + _LOGIT_CHUNK])
            chunk = targets[start:start + _LOGIT_CHUNK]
            norm = logits.logsumexp(-1)
            out.append(logits.gather(-1, chunk[:, None]).squeeze(-1) - norm)
            if scorer is not None:
                scorer.take(start, logits, norm)
            if top:
                values, indices = (logits - norm[:, None]).topk(top, dim=-1)
                top_lps.append(values)
                top_ids.append(indices)
        lps = torch.cat(out) if out else torch.zeros(0)
        if not top:
            return lps, None, None
        if not top_ids:
            return lps, torch.zeros((0, top)), torch.zeros((0, top), dtype=torch.long)
        return lps, torch.cat(top_lps), torch.cat(top_ids)

    # -- decode -------------------------------------------------------------------------

    def decode(self, tokens: torch.Tensor, lengths: list[int], counts: list[int] | None = None) -> torch.Tensor:
        """One token for each live slot ``0..S-1``: ``tokens[i]`` goes at position ``lengths[i]``.
        Returns float32 logits [S, vocab].

        With ``counts`` (verification of drafted tokens, ``speculative``) slot ``i`` has
        ``counts[i]`` consecutive rows of ``tokens`` (slot by slot), row j at position
        ``lengths[i] + j``, each attending to the keys up to its own position; returns one row of
        logits per token. In batch-invariant mode each row's logits are bitwise those of a
        one-token decode at its position (``invariant.plan_decode``)."""
        s = len(lengths)
        if counts is None:
            positions, slots, widest = lengths, None, 1
        else:
            slots = np.repeat(np.arange(s), counts)
            firsts = np.repeat(np.cumsum(counts) - counts, counts)
            positions = (np.repeat(lengths, counts) + np.arange(slots.shape[0]) - firsts).tolist()
            widest = max(counts)
        last = max(positions)
        if self.batch_invariant:
            # Room for a whole attention call's slots: padding items then extend the real ones' view.
            self.cache.reserve(_round_up(s, self.tiles.items_per_call(1, SMALL_BLOCK)), span_end(last + 1))
            plan = plan_decode(tokens, positions, slots, self.tiles, self.cache.slot_cap, self.device)
            return self._head(self._run_plan(plan))
        span = last + 1
        self.cache.reserve(s, span)
        cache = self.cache
        d, g = self.head_dim, self.n_heads // self.n_kv_heads
        at = torch.as_tensor(positions, device=self.device)
        # Rows as a [S, widest] grid (a slot's rows first, padding rows after): attention runs on the
        # cache's slots in place. ``grid`` holds each real row's place in it (None: every place is a row).
        if slots is None:
            owner, grid, grid_at = torch.arange(s, device=self.device), None, at[:, None]
        else:
            owner = torch.from_numpy(slots).to(self.device)
            grid = owner * widest + torch.as_tensor(np.arange(slots.shape[0]) - firsts, device=self.device)
            grid_at = torch.as_tensor(lengths, device=self.device)[:, None] + torch.arange(widest, device=self.device)
        visible = torch.arange(span, device=self.device)[None, None, :] <= grid_at[:, :, None]  # [S, widest, span]
        # Where each (row, kv head) writes its new K/V in a layer's buffer viewed as [positions, head_dim].
        heads = torch.arange(self.n_kv_heads, device=self.device)
        flat = ((owner[:, None] * self.n_kv_heads + heads[None, :]) * cache.len_cap + at[:, None]).reshape(-1)
        if self._matmul_decode:
            bias = torch.zeros((s, 1, 1, widest, span), device=self.device).masked_fill_(
                ~visible[:, None, None], float("-inf"))
        else:
            mask = visible[:, None]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [1, heads, R, D], k and v [1, kv_heads, R, D]: the pass's rows.
            ck, cv = cache.layer(layer)
            ck.view(-1, d).index_copy_(0, flat, k[0].transpose(0, 1).reshape(-1, d))
            cv.view(-1, d).index_copy_(0, flat, v[0].transpose(0, 1).reshape(-1, d))
            keys, values = ck[:s, :, :span], cv[:s, :, :span]
            rows = q[0].transpose(0, 1)  # [R, heads, D]
            if grid is not None:
                rows = rows.new_zeros((s * widest, self.n_heads, d)).index_copy_(0, grid, rows)
            q = rows.view(s, widest, self.n_heads, d).transpose(1, 2)  # [S, heads, widest, D]
            if not self._matmul_decode:
                out = self._sdpa(q, keys, values, mask)
            else:
                # [S, kv_heads, g * widest, D]: query heads kv*g .. kv*g+g-1 share kv head kv (HF's repeat_kv order).
                scores = torch.matmul(q.reshape(s, self.n_kv_heads, g * widest, d), keys.transpose(-1, -2))
                scores = scores.float().view(s, self.n_kv_heads, g, widest, span) * self.scale + bias
                probs = scores.softmax(-1).to(values.dtype).view(s, self.n_kv_heads, g * widest, span)
                out = torch.matmul(probs, values).view(s, self.n_heads, widest, d)
            out = out.transpose(1, 2).reshape(s * widest, self.n_heads, d)
            if grid is not None:
                out = out.index_select(0, grid)
            return out.transpose(0, 1)[None]

        hidden = self._layers(self.embed(tokens[None]), at[None], attend)
        return self._head(hidden[0])
