"""The torch trainer's lean forward: the decoder run functionally over the HF model's own modules.

On the small models an RL run trains, a training substep is mostly Python:
the HF forward spends about as long in its model-level machinery (output
capture and config-default decorators, mask construction, the attention
interface lookup and its dispatch checks, output dataclasses) as in its
kernels. ``LeanForward`` computes the same logits with the same kernel calls
and none of that: the HF modules themselves for the embedding, the norms,
the projections, the MLPs and the LM head, and between them the attention
block written out as HF's computes it (the model's own
``apply_rotary_pos_emb``, SDPA with the arguments HF's ``sdpa`` attention
passes when there is no mask). It reads the model's parameters where they
live, so the optimizer, ``sampler_weights``, saves and loads see nothing
different, and autograd accumulates gradients into the same tensors.

It is exact, not approximate: the same ops on the same operands in the same
order give the same bits, logits and every parameter's gradient alike
(``tests/trainer/test_lean_forward.py`` compares them bitwise with HF's on
Qwen2, Qwen3 and Llama shapes, ragged right-padded batches, float32 and
bfloat16 autocast). It serves only the inputs HF's path would treat that
way: a right-padded ``[batch, length]`` batch of position ids
``0..length-1`` under causal attention, with no attention mask (a real
position never sees the padding after it; ``torch_trainer``'s docstring).
Tree batches keep the HF forward.

``lean_forward(model, attention)`` decides once, at load, whether a model
qualifies, and says why not where it does not: a class outside the torch
backend's decoder family (a peft-wrapped model, or one FSDP2 has sharded, is
of another class), RoPE scaling other than the default, sliding-window
layers, GQA with heads wider than SDPA's grouped path takes, gradient
checkpointing, hub kernels, or attention dropout in training mode (the
trainer's models run in eval mode, where HF applies no dropout either), or
an attention implementation other than SDPA (the loader says which it set:
HF offers no public getter). This module must not touch training state; it
only computes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from rlengine.backends.torch.runtime import SUPPORTED_ARCHITECTURES

__all__ = ["LeanForward", "lean_forward"]

_GQA_HEAD_DIM = 256
"""The widest head HF's ``sdpa`` attention runs with SDPA's ``enable_gqa`` (wider: it repeats K/V)."""


def _unsupported(model: Any, attention: str) -> str | None:
    """Why ``LeanForward`` would not reproduce ``model``'s HF forward exactly; None if it does."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"architecture {name} (the lean forward runs {', '.join(SUPPORTED_ARCHITECTURES)})"
    if attention != "sdpa":
        return f"attention implementation {attention!r} (the lean forward is SDPA's)"
    cfg = model.config
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", None) != "default" or getattr(rotary, "attention_scaling", None) != 1.0:
        return f"RoPE type {getattr(rotary, 'rope_type', None)!r} (the lean forward runs the default RoPE)"
    if model.training and getattr(cfg, "attention_dropout", 0.0):
        return f"attention dropout {cfg.attention_dropout} in training mode (the lean forward has none)"
    # What transformers' is_gradient_checkpointing reads, without its deprecation warning (5.19).
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        return "gradient checkpointing is on"
    if getattr(model, "use_kernels", False):
        return "hub kernels are on (they may replace the modules' forward)"
    if getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None) is None:
        return f"{type(model).__module__} has no apply_rotary_pos_emb"
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            return f"layer {index} has sliding-window attention"
        if attn.num_key_value_groups > 1 and attn.head_dim > _GQA_HEAD_DIM:
            return f"GQA with head_dim {attn.head_dim} > {_GQA_HEAD_DIM} (HF repeats K/V there)"
    return None


def lean_forward(model: Any, attention: str) -> tuple[LeanForward | None, str]:
    """A ``LeanForward`` over ``model``, whose HF attention implementation is ``attention`` (as its
    loader set it), and ``"lean"``; or None and ``"hf: <why not>"``."""
    reason = _unsupported(model, attention)
    if reason is not None:
        return None, f"hf: {reason}"
    return LeanForward(model), "lean"


class LeanForward:
    """``model(input_ids=ids).logits`` of a right-padded batch, without HF's model-level machinery;
    see the module docstring."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rotary = model.model.rotary_emb
        self.apply_rope = sys.modules[type(model).__module__].apply_rotary_pos_emb
        """The model's own RoPE function: the same code HF's attention calls."""
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scale = first.scaling
        self.gqa = first.num_key_value_groups > 1
        self.qk_norm = hasattr(first, "q_norm")
        self._cos = self._sin = None
        """RoPE tables [1, positions, head_dim] of the longest batch so far: a position's values never
        depend on the others, so a shorter batch takes a slice."""

    def _rope(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[1] < n or self._cos.dtype != like.dtype:
            positions = torch.arange(n, device=like.device)[None]
            self._cos, self._sin = self.rotary(like, positions)
        return self._cos[:, :n], self._sin[:, :n]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits ``[batch, length, vocab]`` of ``ids`` ``[batch, length]``, with graph where
        grad is enabled."""
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = self._rope(ids.shape[1], x)
        for layer in inner.layers:
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x))

    def _attention(self, attn: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's attention block on ``h`` [batch, length, hidden] as its ``sdpa`` path computes it
        without a mask: causal SDPA, GQA in the kernel."""
        b, n, _ = h.shape
        shape = (b, n, -1, self.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if self.gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=self.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=self.scale)
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
