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
pick their blocking, and with it the order of each dot product, from the
number of rows; attention's reductions depend on the padded key span), so a
multi-turn run whose batches form by timing cannot be reproduced from its
seed. In this mode every row is computed the same way whatever its
neighbours: projections and MLPs run on fixed chunks of ``_ROW_CHUNK`` rows
(the last one zero-padded), decode attends over a key span rounded up to a
multiple of ``_SPAN_BLOCK`` (masked keys add exact zeros), and prompts are
prefilled in canonical blocks: position p is computed in the block
``block_start(p)`` (16 positions below 256, 64 after), every row of a block
attending over keys ``0..block end`` under one causal mask, with blocks of one
start batched together. A position's K/V is then a function of the tokens up
to it alone, whoever computed the positions before it, which is what lets
the prefix cache reuse prefilled KV in this mode bitwise: a prefill resumes
at its first uncached position, running the rest of that block's rows against
the block's own key span and mask. A row of a block comes out the same
whether the block runs whole or from a later row (SDPA over two or more
query rows; its one-query path rounds differently, measured, so a resumed
block runs at least ``_MIN_ROWS`` rows, recomputing the one before if need
be: the same values). Decode computes its
position differently (one query against a rounded span), so in this mode the
backend caches only prefilled KV, never generated tokens'. Measured bitwise on
CPU (``tests/backends/test_torch_backend.py``,
``tests/backends/test_prefix_cache.py``); it costs speed (``bench/RESULTS.md``),
so it is an option (``engine_args["batch_invariant"]``).

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

import torch
import torch.nn.functional as F

from rlengine.errors import ConfigurationError

__all__ = ["DecoderRunner", "KVSlots", "PrefillJob", "block_start"]

_LOGIT_CHUNK = 1024
"""Positions per LM-head chunk for prompt logprobs: bounds the [n, vocab] logits held at once."""
_ROW_CHUNK = 16
"""Rows per projection call in batch-invariant mode (one GEMM shape for every row)."""
_SPAN_BLOCK = 64
"""Batch-invariant decode attends over a multiple of this many key positions."""
_SMALL_BLOCK = 16
_SMALL_SPAN = 256
_BLOCK = 64
"""Batch-invariant prefill blocks: ``_SMALL_BLOCK`` positions each below ``_SMALL_SPAN``
(short prompts pad little), ``_BLOCK`` after (long ones take fewer passes)."""
_MIN_ROWS = 2
"""Fewest rows a resumed batch-invariant block runs (SDPA's one-query path rounds differently)."""


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

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        assert self.kv is not None
        self.kv[:, dst, :, :length] = self.kv[:, src, :, :length]

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

    __slots__ = ("pieces", "prompt_top", "start", "tokens", "want_prompt_logprobs")

    def __init__(self, tokens: list[int], start: int = 0, pieces: list[torch.Tensor] | None = None,
                 want_prompt_logprobs: bool = False, prompt_top: int = 0) -> None:
        if not 0 <= start < len(tokens):
            raise ValueError(f"prefill start {start}: must leave at least one of {len(tokens)} tokens to run")
        if start and (want_prompt_logprobs or prompt_top):
            raise ValueError("prompt logprobs need the whole prompt run (start 0)")
        self.tokens = tokens
        self.start = start
        self.pieces = pieces or []
        """KV of positions ``0..start-1`` (``KVSlots.read``'s layout, in order; may cover more)."""
        self.want_prompt_logprobs = want_prompt_logprobs
        self.prompt_top = prompt_top


def block_start(position: int) -> int:
    """The start of the batch-invariant prefill block holding ``position``: blocks of
    ``_SMALL_BLOCK`` positions up to ``_SMALL_SPAN``, of ``_BLOCK`` after."""
    if position < _SMALL_SPAN:
        return position - position % _SMALL_BLOCK
    return position - (position - _SMALL_SPAN) % _BLOCK


def _block_size(start: int) -> int:
    return _SMALL_BLOCK if start < _SMALL_SPAN else _BLOCK


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _in_row_chunks(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a row-wise module: projection, MLP, LM head) over the rows of ``x`` [..., d] in
    chunks of ``_ROW_CHUNK``, the last zero-padded: every row goes through one GEMM shape."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    pad = -n % _ROW_CHUNK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, d)])
    out = torch.cat([fn(chunk) for chunk in rows.split(_ROW_CHUNK)])
    return out[:n].reshape(*lead, out.shape[-1])


def _direct(fn: Any, x: torch.Tensor) -> torch.Tensor:
    return fn(x)


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
    """Prefill and decode for a Llama-style HF causal LM; see the module docstring."""

    def __init__(self, model: Any, max_len: int, *, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self._rows = _in_row_chunks if batch_invariant else _direct
        """How a row-wise module (projection, MLP, LM head) is applied to a batch's rows."""
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
        cache_len = _round_up(max_len, _SPAN_BLOCK) if batch_invariant else max_len
        self.cache = KVSlots(len(self.layers), self.n_kv_heads, self.head_dim, cache_len, param.dtype, param.device)
        self.device = param.device
        # On the CPU, decode attention runs as two batched matmuls: SDPA's kernel costs more
        # per (sequence, head) than one query's worth of work (bench/RESULTS.md, issue 19).
        self._matmul_decode = self.device.type == "cpu"

    def reserve(self, n_slots: int, length: int) -> None:
        """Make room for ``n_slots`` sequences of up to ``length`` tokens (a caller that knows how
        long its sequences may grow spares the cache regrowing, and a fresh cache its zero-fill)."""
        if self.batch_invariant:
            length = _round_up(length + 1, _SPAN_BLOCK)  # what the last decode step attends over
        self.cache.reserve(n_slots, min(length, self.cache.max_len))

    # -- the decoder layers ----------------------------------------------------------

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """Run every layer on ``x`` [B, L, hidden]; ``attend(layer, q, k, v)`` stores the new K/V
        [B, kv_heads, L, head_dim] in the cache and returns the attention output [B, heads, L, head_dim]."""
        rows = self._rows
        b, n, _ = x.shape
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, x)
            q = rows(attn.q_proj, h).view(b, n, self.n_heads, self.head_dim)
            k = rows(attn.k_proj, h).view(b, n, self.n_kv_heads, self.head_dim)
            v = rows(attn.v_proj, h).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            # Rotary on the query and key heads at once (elementwise: the same numbers, fewer calls).
            qk = torch.cat([q, k], 2).transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
            out = attend(index, q, k, v)
            x = x + rows(attn.o_proj, out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
            x = x + rows(layer.mlp, _rms_norm(layer.post_attention_layernorm, x))
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

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
            end = max(block_start(len(job.tokens) - 1) + _block_size(block_start(len(job.tokens) - 1))
                      for job in jobs)
        self.cache.reserve(first_slot + len(jobs), end)
        for i, job in enumerate(jobs):
            if job.start:
                self.cache.write(first_slot + i, job.pieces, job.start)
        if self.batch_invariant:
            hidden_last, prompt_hidden = self._prefill_blocks(jobs, first_slot)
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
            lps, top_lps, top_ids = self.target_logprobs(hidden, targets, job.prompt_top)
            prompt_logprobs.append(lps.tolist() if job.want_prompt_logprobs else None)
            prompt_tops.append(None if top_ids is None else (top_ids.flatten().tolist(), top_lps.flatten().tolist()))
        return self._rows(self.lm_head, hidden_last).float(), prompt_logprobs, prompt_tops

    @staticmethod
    def _wants_prompt(job: PrefillJob) -> bool:
        return job.want_prompt_logprobs or job.prompt_top > 0

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

    def _prefill_blocks(self, jobs: list[PrefillJob], first_slot: int) -> tuple[torch.Tensor, list[Any]]:
        """Batch-invariant prefill: every position computed in its canonical block (``block_start``),
        whatever came before it in the slot or shares the step; see the module docstring."""
        lengths = [len(job.tokens) for job in jobs]
        at = [block_start(job.start) for job in jobs]
        last: list[torch.Tensor | None] = [None] * len(jobs)
        kept: list[list[torch.Tensor] | None] = [[] if self._wants_prompt(job) else None for job in jobs]
        while True:
            pending = [i for i, a in enumerate(at) if a < lengths[i]]
            if not pending:
                break
            a = min(at[i] for i in pending)
            group = [i for i in pending if at[i] == a]
            end = a + _block_size(a)
            # Rows lo..hi-1 run: the whole block, or from the first uncached row of a resumed one
            # to the last real row (at least _MIN_ROWS; rows before a job's start recompute its reused KV).
            lo = min(max(jobs[i].start, a) for i in group)
            hi = end
            if lo > a:
                hi = max(min(lengths[i], end) for i in group)
                lo = min(lo, hi - _MIN_ROWS)
            hidden = self._prefill_block([jobs[i].tokens[lo:hi] for i in group], [first_slot + i for i in group],
                                         a, lo, hi)
            for row, i in enumerate(group):
                if end >= lengths[i]:
                    last[i] = hidden[row, lengths[i] - 1 - lo]
                rows_kept = kept[i]
                if rows_kept is not None:  # prompt logprobs: start 0, so whole blocks (lo == a)
                    rows_kept.append(hidden[row, :min(end, lengths[i]) - lo])
                at[i] = end
        return torch.stack(last), [None if rows is None else torch.cat(rows)[:lengths[i] - 1]  # type: ignore[arg-type]
                                   for i, rows in enumerate(kept)]

    def _prefill_block(self, tokens: list[list[int]], slots: list[int], a: int, lo: int, hi: int) -> torch.Tensor:
        """The hidden states [len(slots), hi - lo, hidden] of rows ``lo..hi-1`` of the block
        starting at ``a``, whose ``tokens`` (zero-padded to ``hi - lo``) go into ``slots``; the
        positions before ``lo`` are in the slots. Every row attends over the block's key span."""
        end = a + _block_size(a)
        cache = self.cache
        ids = self._padded([t + [0] * (hi - lo - len(t)) for t in tokens])
        index = torch.as_tensor(slots, device=self.device)
        positions = torch.arange(lo, hi, device=self.device).unsqueeze(0).expand(len(slots), hi - lo)
        # The block's mask, the same for every row: key j is visible to the query at p iff j <= p.
        mask = self._additive((torch.arange(end, device=self.device)[None, :]
                               <= torch.arange(lo, hi, device=self.device)[:, None])[None, None])

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = cache.layer(layer)
            ck[index, :, lo:hi] = k
            cv[index, :, lo:hi] = v
            # Gathered copies: every block of a given start attends over tensors of one layout.
            return self._sdpa(q, ck[:, :, :end].index_select(0, index), cv[:, :, :end].index_select(0, index), mask)

        return self._layers(self.embed(ids), positions, attend)

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, top: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """log_softmax(logits)[target] per position, in chunks of positions; with ``top`` k > 0 also
        the k largest log_softmax values of each position and their token ids (else None, None)."""
        out, top_lps, top_ids = [], [], []
        for start in range(0, targets.shape[0], _LOGIT_CHUNK):
            logits = self._logits(hidden[start:start + _LOGIT_CHUNK])
            chunk = targets[start:start + _LOGIT_CHUNK]
            norm = logits.logsumexp(-1)
            out.append(logits.gather(-1, chunk[:, None]).squeeze(-1) - norm)
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

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """One token for each live slot ``0..S-1``: ``tokens[i]`` goes at position
        ``lengths[i]``; ``max_length`` is ``max(lengths)``. Returns float32 logits [S, vocab]."""
        s = tokens.shape[0]
        span = _round_up(max_length + 1, _SPAN_BLOCK) if self.batch_invariant else max_length + 1
        self.cache.reserve(s, span)
        cache = self.cache
        g = self.n_heads // self.n_kv_heads
        visible = torch.arange(span, device=self.device)[None, :] <= lengths[:, None]
        # Where each (sequence, kv head) writes its new K/V in a layer's buffer viewed as [positions, head_dim].
        heads = torch.arange(self.n_kv_heads, device=self.device)
        flat = ((torch.arange(s, device=self.device)[:, None] * self.n_kv_heads + heads[None, :]) * cache.len_cap
                + lengths[:, None]).reshape(-1)
        if self._matmul_decode:
            bias = torch.zeros((s, 1, 1, span), device=self.device).masked_fill_(~visible[:, None, None, :],
                                                                               float("-inf"))
        else:
            mask = visible[:, None, None, :]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = cache.layer(layer)
            ck.view(-1, self.head_dim).index_copy_(0, flat, k.reshape(-1, self.head_dim))
            cv.view(-1, self.head_dim).index_copy_(0, flat, v.reshape(-1, self.head_dim))
            keys, values = ck[:s, :, :span], cv[:s, :, :span]
            if not self._matmul_decode:
                return self._sdpa(q, keys, values, mask)
            # [S, kv_heads, g, 1, D]: query heads kv*g .. kv*g+g-1 share kv head kv (HF's repeat_kv order).
            scores = torch.matmul(q.reshape(s, self.n_kv_heads, g, self.head_dim), keys.transpose(-1, -2))
            probs = (scores.float() * self.scale + bias).softmax(-1).to(values.dtype)  # float32 softmax
            return torch.matmul(probs, values).view(s, self.n_heads, 1, self.head_dim)

        hidden = self._layers(self.embed(tokens[:, None]), lengths[:, None], attend)
        return self._rows(self.lm_head, hidden[:, 0]).float()
