"""A Qwen2 model whose weights are set by hand so that it copies: the token it predicts at
position m is the one at position m + 1 - ``period`` (mapped through ``remap``).

For the speculative decoding tests and benchmark (``backends.torch.speculative``): with
``period`` the copy recipe's digits + 1 (and "=" remapped to "$") the character model answers
"123=" with "123$" (the recipe's task, learnt in a few hundred RL steps, here exact from the
start), and with period P the tiny model continues a prompt of period P, so n-gram drafts are
accepted; ``sharpness`` (the
logit of the copied token over the others) sets how often a sample at temperature 1 deviates.

How: every embedding is a constant unit in dimension 0 plus a code of its token (one-hot when
the vocabulary fits, else random unit vectors). Layer 0's first attention head has constant
queries and keys (their biases; the weights are zero) whose rotary phases differ by
``period - 1`` positions, so their score peaks, by a wide margin, at the key that far back; its
values carry the key's token code, which ``o_proj`` writes into dimensions of their own. Every
other output (other heads, the MLPs, layer 1) is zero, and the LM head reads the copied code.
Test code only; it imports torch.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch

__all__ = ["build_copier"]

_PAIRS = 8
"""Rotary frequency pairs the head uses: enough that no other distance below 1,024 positions
scores within 0.68 of the peak (per unit of query x key)."""
_ATTENTION_GAP = 30.0
"""The peak's score over the next best key: the head attends to one position."""


def build_copier(source: str, path: str, period: int, sharpness: float = 30.0,
                 remap: dict[int, int] | None = None, seed: int = 0) -> str:
    """Write the copying version of the Qwen2 model directory ``source`` to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    cfg = model.config
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or hidden // heads
    code_dim = min(d, (hidden - 1) // 2)
    if vocab <= code_dim:
        codes = torch.eye(code_dim)[:vocab]
    else:
        codes = torch.randn(vocab, code_dim, generator=torch.Generator().manual_seed(seed))
        codes /= codes.norm(dim=1, keepdim=True)
    token, copied = slice(1, 1 + code_dim), slice(1 + code_dim, 1 + 2 * code_dim)
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[:, token] = codes
        attn = model.model.layers[0].self_attn
        amplitude = (_ATTENTION_GAP * d ** 0.5 / 0.68) ** 0.5
        half = d // 2
        phase = (period - 1) * freqs[:_PAIRS]
        attn.q_proj.bias[:_PAIRS] = amplitude  # head 0
        attn.k_proj.bias[:_PAIRS] = (amplitude * torch.cos(phase)).float()  # kv head 0
        attn.k_proj.bias[half:half + _PAIRS] = (amplitude * torch.sin(phase)).float()
        attn.v_proj.weight[:code_dim, token] = torch.eye(code_dim)
        attn.o_proj.weight[copied, :code_dim] = torch.eye(code_dim)
        # After the final norm the copied code has this length (constant, code and copy unit vectors).
        scale = (hidden / 2) ** 0.5 / ((2 + hidden / 2) / hidden) ** 0.5
        mapping = {t: t for t in range(vocab)} | dict(remap or {})
        for src, dst in mapping.items():
            model.lm_head.weight[dst, copied] = codes[src] * (sharpness / scale)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(source, name), os.path.join(path, name))
    return path


def copy_rate(path: str, prompts: list[list[int]], period: int) -> float:
    """The share of positions of ``prompts`` (of period ``period``) whose argmax is the next token:
    a check that the built model copies."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    hits = total = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.as_tensor([prompt])
            pred = model(ids).logits[0].argmax(-1).numpy()
            want = np.asarray(prompt)
            for m in range(period - 1, len(prompt) - 1):
                hits += int(pred[m] == want[m + 1 - period])
                total += 1
    return hits / max(1, total)
