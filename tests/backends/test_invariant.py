"""Batch invariance by construction (``rlengine.backends.torch.invariant``).

The claim: in batch-invariant mode a position's K/V and logits are the same
bits whatever else a pass holds and wherever its prefill resumed. Tested
three ways: the resume-offset sweep (every row of a small and of a large
block as the first uncached position, with tails of 1-3 and 33-35 new rows,
many resumes to a pass, against cold prefills batched otherwise), a shape
audit (every GEMM and attention call of the invariant path has one of the
model's fixed shapes, whatever the batch), and the canary (it passes on
these kernels, and it catches a kernel that rounds by row place). The
bitwise tests run again under adversarial kernels at every CPU capability
level (``test_invariance_matrix``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.decoder import PrefillJob
from rlengine.backends.torch.invariant import (
    Tiles,
    block_end,
    block_start,
    canary,
    decode_span,
    in_tiles,
)

SMALL_BLOCK_ROWS = range(16, 32)
LARGE_BLOCK_ROWS = range(256, 320)
TAILS = (1, 2, 3, 33, 34, 35)


@pytest.fixture(scope="module")
def runner(tiny_model):
    return TorchBackend(tiny_model, batch_invariant=True, prefix_cache_bytes=0).runner


def _kv(runner, slot: int, start: int, end: int) -> torch.Tensor:
    return runner.cache.read(slot, start, end)


@pytest.mark.bitwise
@pytest.mark.parametrize("offsets", [SMALL_BLOCK_ROWS, LARGE_BLOCK_ROWS], ids=["small_block", "large_block"])
def test_a_resumed_prefill_is_bitwise_a_cold_one_from_every_row_of_a_block(runner, offsets):
    """Resume at each row of the block (its KV before that row copied in, as the prefix cache
    does) with 1-3 and 33-35 new rows, alone or several to a pass: the new rows' K/V in every
    layer and the last position's logits equal a cold prefill's, bitwise; the cold prefills run
    in passes of other sizes and order."""
    base = np.random.default_rng(offsets.start).integers(3, 1000, offsets.stop + max(TAILS)).tolist()
    cases = [(o, t) for o in offsets for t in TAILS]
    sizes = itertools.cycle((1, 2, 3, 13, 29))
    with torch.inference_mode():
        runner.prefill([PrefillJob(base)], 0)
        source = [_kv(runner, 0, 0, len(base))]
        warm: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        at = 0
        while at < len(cases):
            part = cases[at:at + next(sizes)]
            at += len(part)
            logits = runner.prefill([PrefillJob(base[:o + t], start=o, pieces=source) for o, t in part], 1)[0]
            for i, (o, t) in enumerate(part):
                warm[o, t] = logits[i], _kv(runner, 1 + i, o, o + t)
        # The same prefixes cold, in reverse order and passes of another size.
        cold = cases[::-1]
        for at in range(0, len(cold), 37):
            part = cold[at:at + 37]
            logits = runner.prefill([PrefillJob(base[:o + t]) for o, t in part], 1)[0]
            for i, (o, t) in enumerate(part):
                assert torch.equal(warm[o, t][0], logits[i]), (o, t)
                assert torch.equal(warm[o, t][1], _kv(runner, 1 + i, o, o + t)), (o, t)


def test_every_kernel_call_of_the_invariant_path_has_one_of_the_models_fixed_shapes(runner, monkeypatch):
    """Whatever the batch (one prompt or many, cold or resumed, decode of one sequence or of
    many at different lengths), every GEMM runs on a whole row tile and every attention call on
    ``items_per_call`` items of a (rows, span) shape given by the position alone."""
    tiles = runner.tiles
    seen: list[tuple[str, tuple]] = []
    linear, matmul = F.linear, torch.matmul

    def record_linear(x, *args, **kwargs):
        seen.append(("linear", tuple(x.shape)))
        return linear(x, *args, **kwargs)

    def record_matmul(a, b, *args, **kwargs):
        seen.append(("matmul", (tuple(a.shape), tuple(b.shape))))
        return matmul(a, b, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("SDPA on the invariant path: its internal tiling follows the query length")

    monkeypatch.setattr(F, "linear", record_linear)
    monkeypatch.setattr(torch, "matmul", record_matmul)
    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for lengths in ([5], [3, 17, 40], [300], [1] * 70, [257, 20, 64, 65]):
            jobs = [PrefillJob(rng.integers(3, 1000, n).tolist()) for n in lengths]
            runner.prefill(jobs, 0)
            runner.prefill([PrefillJob(jobs[0].tokens + [7, 8], start=len(jobs[0].tokens) - 1,
                                       pieces=[_kv(runner, 0, 0, len(jobs[0].tokens))])], len(jobs))
            runner.decode(torch.ones(len(lengths), dtype=torch.long), lengths)
    hidden = runner.model.config.hidden_size
    linear_shapes = {shape for kind, shape in seen if kind == "linear"}
    allowed_rows = {tiles.rows, tiles.head_rows}
    assert {rows for rows, _ in linear_shapes} <= allowed_rows, linear_shapes
    assert {(tiles.head_rows, hidden)} <= linear_shapes
    d, kv = tiles.head_dim, tiles.kv_heads
    g = tiles.heads // kv
    for _, (a, b) in (s for s in seen if s[0] == "matmul"):
        items, _, qrows, _ = a
        span = b[-1] if b[-1] != d else b[-2]
        rows = qrows // g
        assert items == tiles.items_per_call(rows, span), (a, b)
        # A decode item (one row) or a whole canonical block.
        # One decoded position or a whole canonical block, against its block's keys.
        assert span == block_end(block_start(span - 1)) and rows in (1, span - block_start(span - 1)), (a, b)


def test_tiles_and_spans_depend_on_the_model_and_the_position_only():
    # The copy recipe's character model: 128-row tiles (a decode of 256 sequences in two calls per
    # weight), its 13-token head in one call; a 135M model (SmolLM2's shape) the smallest tiles.
    char = Tiles.of(row_flops=2 * (64 * 192 + 64 * 64 + 3 * 64 * 256), head_row_flops=2 * 64 * 13, heads=2,
                    kv_heads=2, head_dim=32)
    assert (char.rows, char.head_rows) == (128, 256)
    big = Tiles.of(row_flops=2 * (576 * 960 + 576 * 576 + 3 * 576 * 1536), head_row_flops=2 * 576 * 49152,
                   heads=9, kv_heads=3, head_dim=64)
    assert (big.rows, big.head_rows) == (16, 16)
    assert big.items_per_call(64, 4096) == 1
    assert [decode_span(p) for p in (0, 15, 16, 255, 256, 1000)] == [16, 16, 32, 256, 320, 1024]
    assert [block_end(block_start(p)) for p in (0, 15, 16, 255, 256, 319, 320)] == [16, 16, 32, 256, 320, 320, 384]
    x = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    shapes: list[tuple] = []
    out = in_tiles(lambda t: shapes.append(tuple(t.shape)) or t * 2, x, 16)
    assert torch.equal(out, x * 2) and shapes == [(16, 3)] * 3


def test_the_canary_passes_on_these_kernels_and_catches_one_that_rounds_by_row_place(runner):
    report = runner.check_kernels()
    assert report.ok, report.failed
    assert report.checked >= 8
    tiles = runner.tiles
    weight = torch.randn(48, 32)

    def by_place(x: torch.Tensor) -> torch.Tensor:
        # A kernel whose last rows take another path, as MKL's do for small M on some CPUs.
        out = x @ weight.t()
        out[-3:] = out[-3:] * (1 + 2 ** -20)
        return out

    bad = canary([("place-dependent", by_place, 32, 16), ("plain", lambda x: x @ weight.t(), 32, 16)], tiles,
                 [], torch.float32, torch.device("cpu"))
    assert not bad.ok and bad.failed == ("place-dependent [16 x 32]",)
