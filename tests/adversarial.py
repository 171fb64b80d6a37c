"""Adversarial kernels: every GEMM and attention call perturbed by a function of its shape.

A real math library may compute one matrix product with another kernel when
a dimension changes (MKL rounds M < 4 rows differently on AMD EPYC, M < 2 on
Intel), and which shapes do so differs from machine to machine. A bitwise
claim that rests on a threshold measured here fails on the next machine. These
kernels make every shape round differently: each call's result is multiplied
by ``1 + k * 2**-20`` with ``k`` in 1..15 drawn from a hash of the call's name
and its operands' shapes (about 1e-6 relative: the size of the real
mismatches). The same shape always gets the same ``k``, so code whose calls
have fixed shapes passes its bitwise tests under them, and code whose shapes
follow the batch, the query length or the chunking fails them.

``install()`` patches ``torch.nn.functional.linear`` (``nn.Linear``),
``scaled_dot_product_attention``, ``torch.matmul`` / ``mm`` / ``bmm`` /
``addmm`` / ``baddbmm`` and the ``@`` operator for the rest of the process;
``tests/conftest.py`` calls it when ``RLENGINE_ADVERSARIAL_KERNELS=1``
(``tests/backends/test_invariance_matrix.py`` runs the bitwise tests so, in
subprocesses). Test code only: it imports torch.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["factor", "install", "installed"]

_STEP = 2.0 ** -20
_installed = False


def factor(name: str, args: tuple[Any, ...]) -> float:
    """The perturbation of a call of ``name`` on ``args``: a function of their shapes alone."""
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
    digest = hashlib.blake2b(repr((name, shapes)).encode(), digest_size=8).digest()
    return 1.0 + (1 + int.from_bytes(digest, "little") % 15) * _STEP


def _perturbed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if kwargs.get("out") is not None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        return out * factor(name, args)

    return call


def install() -> None:
    """Patch the kernels for the rest of the process (idempotent)."""
    global _installed
    if _installed:
        return
    F.linear = _perturbed("linear", F.linear)
    F.scaled_dot_product_attention = _perturbed("sdpa", F.scaled_dot_product_attention)
    for name in ("matmul", "mm", "bmm", "addmm", "baddbmm"):
        setattr(torch, name, _perturbed(name, getattr(torch, name)))
    torch.Tensor.__matmul__ = _perturbed("matmul", torch.Tensor.__matmul__)
    torch.Tensor.matmul = _perturbed("matmul", torch.Tensor.matmul)
    _installed = True


def installed() -> bool:
    return _installed
