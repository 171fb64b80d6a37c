"""A decoder layer's projections as fewer GEMMs: q, k and v in one weight, gate and up in another.

The torch backend runs the HF model's layers itself (``decoder``). Calling
seven projections per layer costs seven kernel launches and, in
batch-invariant mode, seven per row tile; on the small models an RL run
trains, those calls are most of a decode step. ``FusedLayer`` concatenates
the q, k and v weights (and biases) into one tensor and the MLP's gate and
up weights into another, and makes the HF modules' parameters views into
them: the model still owns every parameter by its HF name, so a weight
install (``param.copy_``) writes into the fused tensors and nothing is
stored twice. The numbers are the modules' own up to the rounding of a
wider GEMM.

A layer whose q/k/v biases are neither all present nor all absent, or whose
MLP has biases or is not gate/up/down, keeps its modules as they are
(``FusedLayer.qkv`` / ``mlp`` then call them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FusedLayer"]


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``modules``' stacked by output row; their parameters become views."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    at = 0
    for m in modules:
        n = m.out_features
        m.weight.data = weight[at:at + n]
        if bias is not None:
            m.bias.data = bias[at:at + n]
        at += n
    return weight, bias


class FusedLayer:
    """One decoder layer's q/k/v and gate/up projections, each one GEMM where the layer allows."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.q_width, self.kv_width = attn.q_proj.out_features, attn.k_proj.out_features
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self._attn = attn
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if len({p.bias is None for p in projections}) == 1:
            self._qkv = _fuse(projections)
        self._mlp = mlp
        self._gate_up: torch.Tensor | None = None
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts) and hasattr(mlp, "act_fn"):
            self._gate_up = _fuse(parts[:2])[0]
            self._down = mlp.down_proj
            self._act = mlp.act_fn
            self._inner = mlp.gate_proj.out_features

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., q | k | v]``: the three projections of ``x`` side by side."""
        if self._qkv is not None:
            return F.linear(x, *self._qkv)
        a = self._attn
        return torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self._mlp(x)
        gate_up = F.linear(x, self._gate_up)
        return self._down(self._act(gate_up[..., :self._inner]) * gate_up[..., self._inner:])

    def row_flops(self) -> int:
        """Multiply-adds x 2 of one row through the layer's projections and MLP."""
        a, m = self._attn, self._mlp
        hidden = a.q_proj.in_features
        inner = m.gate_proj.out_features if hasattr(m, "gate_proj") else 4 * hidden
        return 2 * (hidden * (self.q_width + 2 * self.kv_width) + a.o_proj.in_features * hidden + 3 * hidden * inner)

    def row_calls(self) -> list[tuple[str, Any, int]]:
        """The row-wise calls a pass makes, ``(name, fn, input width)`` (the canary checks them)."""
        hidden = self._attn.q_proj.in_features
        return [("qkv", self.qkv, hidden), ("o_proj", self._attn.o_proj, self._attn.o_proj.in_features),
                ("mlp", self.mlp, hidden)]
