"""Batched prefill and decode over a Hugging Face causal LM, with a slot-based KV cache.

The torch backend needs what HF ``generate`` does not give: sequences that
join and leave a running batch at any step. So this module runs the
decoder itself, using the HF model's own modules and weights (embeddings,
projections, norms, MLPs, rotary embedding, LM head) but its own attention
over its own cache:

* ``KVSlots`` holds, per layer, one padded K and one V buffer
  ``[slots, kv_heads, length, head_dim]``. Running sequence ``i`` owns slot
  ``i``; when a sequence leaves, the last slot moves into the hole, so the
  live slots are always ``0..n-1`` and a decode step reads one contiguous
  prefix of the buffers. Buffers grow by doubling and are freed when no
  sequence runs (no sleep mode is needed to give memory back between bursts).
* ``DecoderRunner.prefill`` runs new prompts (right-padded, one batch) and
  writes their K/V into fresh slots; ``decode`` runs one token for every
  live slot in one batch, each at its own position, with a padding mask.

Batch invariance (``batch_invariant=True``): by default a sequence's logits
depend, in the last bits, on what else shares its batch (CPU GEMM kernels
pick their blocking, and with it the order of each dot product, from the
number of rows; attention's reductions depend on the padded key span), so a
multi-turn run whose batches form by timing cannot be reproduced from its
seed. In this mode every row is computed the same way whatever its
neighbours: projections and MLPs run on fixed chunks of ``_ROW_CHUNK`` rows
(the last one zero-padded), decode attends over a key span rounded up to a
multiple of ``_SPAN_BLOCK`` (masked keys add exact zeros), and prompts are
prefilled in runs of one length (no padding; the backend admits them sorted by
length). Measured bitwise on CPU
(``tests/backends/test_torch_backend.py``); it costs speed
(``bench/RESULTS.md``), so it is an option (``engine_args["batch_invariant"]``).

Masked cache positions must hold finite values (0 * NaN would poison the
attention output), so buffers start zeroed and only ever receive computed
K/V. The trainer does not use this module: it runs the HF model's own
forward, which is what makes "sampler logprobs == trainer logprobs" a real
cross-check of this code.

Only Llama-style decoders are run (``runtime.SUPPORTED_ARCHITECTURES``).
Every method runs on the engine's compute thread.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from rlengine.errors import ConfigurationError

__all__ = ["DecoderRunner", "KVSlots"]

_MIN_LEN_CAP = 256
_LOGIT_CHUNK = 1024
"""Positions per LM-head chunk for prompt logprobs: bounds the [n, vocab] logits held at once."""
_ROW_CHUNK = 16
"""Rows per projection call in batch-invariant mode (one GEMM shape for every row)."""
_SPAN_BLOCK = 64
"""Batch-invariant decode attends over a multiple of this many key positions."""


class KVSlots:
    """Per-layer padded K/V buffers indexed by slot; see the module docstring."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slot_cap = 0
        self.len_cap = 0

    def reserve(self, n_slots: int, length: int) -> None:
        """Make room for ``n_slots`` slots of ``length`` positions, keeping contents."""
        if n_slots <= self.slot_cap and length <= self.len_cap:
            return
        if length > self.max_len:
            raise ValueError(f"KV cache: length {length} exceeds max_model_len {self.max_len}")
        slots = max(n_slots, 2 * self.slot_cap, 1) if n_slots > self.slot_cap else self.slot_cap
        if length > self.len_cap:
            length = min(self.max_len, max(length, 2 * self.len_cap, _MIN_LEN_CAP))
        else:
            length = self.len_cap
        shape = (slots, self.n_kv_heads, length, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        if old_k:
            s, n = self.slot_cap, self.len_cap
            for layer in range(self.n_layers):
                self.k[layer][:s, :, :n] = old_k[layer]
                self.v[layer][:s, :, :n] = old_v[layer]
        self.slot_cap, self.len_cap = slots, length

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        for layer in range(self.n_layers):
            self.k[layer][dst, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][dst, :, :length] = self.v[layer][src, :, :length]

    def release(self) -> None:
        self.k, self.v = [], []
        self.slot_cap = self.len_cap = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


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

    # -- the decoder layers ----------------------------------------------------------

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                store: Any) -> torch.Tensor:
        """Run every layer on ``x`` [B, L, hidden]; ``store(layer, k, v)`` writes the new K/V
        into the cache and returns the keys/values to attend over."""
        rows = self._rows
        b, n, _ = x.shape
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = rows(attn.q_proj, h).view(b, n, self.n_heads, self.head_dim)
            k = rows(attn.k_proj, h).view(b, n, self.n_kv_heads, self.head_dim)
            v = rows(attn.v_proj, h).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = store(index, k, v)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)
            x = x + rows(attn.o_proj, out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
            x = x + rows(layer.mlp, layer.post_attention_layernorm(x))
        return self.norm(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- prefill and decode -------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], first_slot: int, want_prompt_logprobs: list[bool],
                prompt_top: list[int] | None = None) -> tuple[torch.Tensor, list[list[float] | None], list[Any]]:
        """Run new prompts into slots ``first_slot..``; returns the float32 logits of
        each prompt's last position [B, vocab], where asked the logprob of every prompt
        token after the first, and where ``prompt_top[i]`` k > 0 the k most likely tokens
        at each of those positions (``(ids, logprobs)``, k per position, flat)."""
        prompt_top = prompt_top or [0] * len(prompts)
        if not self.batch_invariant:
            return self._prefill(prompts, first_slot, want_prompt_logprobs, prompt_top)
        # Each run of equal-length prompts on its own, rows in fixed chunks: no padding, so a
        # prompt's numbers are its own whatever is prefilled with it.
        logits: list[torch.Tensor] = []
        prompt_logprobs: list[list[float] | None] = []
        prompt_tops: list[Any] = []
        start = 0
        for _, run in itertools.groupby(prompts, key=len):
            n = len(list(run))
            part, lps, tops = self._prefill(prompts[start:start + n], first_slot + start,
                                            want_prompt_logprobs[start:start + n], prompt_top[start:start + n])
            logits.append(part)
            prompt_logprobs += lps
            prompt_tops += tops
            start += n
        return torch.cat(logits), prompt_logprobs, prompt_tops

    def _prefill(self, prompts: list[list[int]], first_slot: int, want_prompt_logprobs: list[bool],
                 prompt_top: list[int]) -> tuple[torch.Tensor, list[list[float] | None], list[Any]]:
        b = len(prompts)
        lengths = [len(p) for p in prompts]
        n = max(lengths)
        ids = torch.zeros((b, n), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(n, device=self.device).unsqueeze(0).expand(b, n)
        if b == 1 or min(lengths) == n:
            mask = None  # no padding: plain causal attention, the fast path
        else:
            ends = torch.as_tensor(lengths, device=self.device)
            key_ok = torch.arange(n, device=self.device)[None, :] < ends[:, None]
            causal = torch.ones((n, n), dtype=torch.bool, device=self.device).tril()
            # A padded query row still sees key 0, so no row is fully masked (no NaN).
            mask = (causal[None, :, :] & key_ok[:, None, :]).unsqueeze(1)
        self.cache.reserve(first_slot + b, n)
        cache = self.cache

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Padded positions past a prompt's end are written too; they are
            # finite and masked until that sequence's own decode overwrites them.
            cache.k[layer][first_slot:first_slot + b, :, :n] = k
            cache.v[layer][first_slot:first_slot + b, :, :n] = v
            return k, v

        hidden = self._layers(self.embed(ids), positions, mask, store)
        last = hidden[torch.arange(b, device=self.device), torch.as_tensor(lengths, device=self.device) - 1]
        prompt_logprobs: list[list[float] | None] = []
        prompt_tops: list[Any] = []
        for i, (want, k) in enumerate(zip(want_prompt_logprobs, prompt_top)):
            if not want and not k:
                prompt_logprobs.append(None)
                prompt_tops.append(None)
                continue
            targets = ids[i, 1:lengths[i]]
            lps, top_lps, top_ids = self.target_logprobs(hidden[i, :lengths[i] - 1], targets, k)
            prompt_logprobs.append(lps.tolist() if want else None)
            prompt_tops.append(None if top_ids is None else (top_ids.flatten().tolist(), top_lps.flatten().tolist()))
        return self._rows(self.lm_head, last).float(), prompt_logprobs, prompt_tops

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

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """One token for each live slot ``0..S-1``: ``tokens[i]`` goes at position
        ``lengths[i]``; ``max_length`` is ``max(lengths)``. Returns float32 logits [S, vocab]."""
        s = tokens.shape[0]
        span = _round_up(max_length + 1, _SPAN_BLOCK) if self.batch_invariant else max_length + 1
        self.cache.reserve(s, span)
        cache = self.cache
        rows = torch.arange(s, device=self.device)
        mask = (torch.arange(span, device=self.device)[None, :] <= lengths[:, None])[:, None, None, :]

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ck, cv = cache.k[layer], cache.v[layer]
            ck[rows, :, lengths] = k[:, :, 0]
            cv[rows, :, lengths] = v[:, :, 0]
            return ck[:s, :, :span], cv[:s, :, :span]

        hidden = self._layers(self.embed(tokens[:, None]), lengths[:, None], mask, store)
        return self._rows(self.lm_head, hidden[:, 0]).float()
