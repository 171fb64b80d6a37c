"""Batch invariance by construction: fixed kernel shapes, whatever the batch.

CPU math libraries (MKL, oneDNN, OpenBLAS) pick a kernel by the shape of a
call, by the CPU and by the thread count, and two kernels may round the same
dot product differently (measured: MKL computes fewer than 4 rows with
another kernel on AMD EPYC, fewer than 2 on the Intel machines, about 1 ulp
apart). A threshold measured on one machine proves nothing about the next,
so in batch-invariant mode no kernel call on the sampler's path ever has a
shape that depends on the batch, the position in it, the query length, the
prefix reuse or the chunking:

* **row-wise work** (projections, MLP, LM head): a pass's rows are packed,
  padded with zero rows to a whole number of tiles of ``Tiles.rows`` rows
  (``Tiles.head_rows`` for the LM head), and every GEMM runs on exactly one
  tile. The tile sizes are a function of the model's dimensions only.
* **attention** runs on *items*: an item is one sequence's query rows of one
  canonical block (``block_start``) against that block's keys ``0..end-1``, or
  one decoded position ``p`` against the keys of its block, ``0..block_end(block_start(p))-1``.
  Its shape (query rows ``L``, key span ``S``) is a function of its position
  alone. Items of one shape run ``items_per_call(L, S)`` at a time (padded
  with copies of a real item whose output is dropped), through two batched
  matmuls and a float32 softmax; query rows of a block that are not computed
  in this pass (already cached, or past the prompt's end) are zero rows
  whose output is dropped, and masked keys add exact zeros.

So every call's shape comes from a small fixed set, and what a row's result
may still depend on is its place inside one fixed-shape call. The real
kernels must not round by place; ``canary`` checks exactly that at start-up
(each tile and item shape the model uses, a row or item at the first, middle
and last place) and the backend reports the outcome (``rlengine info``, a
run's metadata). The tests prove the rest with adversarial kernels
(``tests/adversarial.py``: every GEMM and attention call perturbed by a
function of its shape).

This module holds the tile policy, the plan of one pass (rows and items),
the attention over items and the canary; ``decoder.DecoderRunner`` runs the
layers. It runs on the compute thread and never touches engine state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["Canary", "Chunk", "Plan", "Tiles", "attend", "block_end", "block_start", "canary", "check_machine",
           "decode_span", "in_tiles", "plan_decode", "plan_prefill", "span_end"]

SMALL_BLOCK = 16
SMALL_SPAN = 256
BLOCK = 64
"""Prefill blocks: ``SMALL_BLOCK`` positions each below ``SMALL_SPAN`` (short prompts pad
little), ``BLOCK`` after (long ones make fewer items)."""
_TILE_FLOPS = 1 << 24
"""Work (multiply-adds x 2) of one row tile through a layer's projections and MLP: big enough that
the small models of RL recipes decode hundreds of sequences in one call per weight, small enough
that a few sequences pay little padding (measured: bench/RESULTS.md, issue 29)."""
_HEAD_FLOPS = 1 << 22
"""Likewise for one LM-head tile (its vocabulary makes a padded row costly)."""
_ITEM_FLOPS = 1 << 20
"""Likewise for one attention call's worth of items."""
_MIN_ROWS, _MAX_ROWS = 16, 256
_MAX_ITEMS = 256


def block_start(position: int) -> int:
    """The start of the prefill block holding ``position``."""
    if position < SMALL_SPAN:
        return position - position % SMALL_BLOCK
    return position - (position - SMALL_SPAN) % BLOCK


def block_end(start: int) -> int:
    """The end (exclusive) of the block starting at ``start``."""
    return start + (SMALL_BLOCK if start < SMALL_SPAN else BLOCK)


def decode_span(position: int) -> int:
    """The keys a decoded ``position`` attends over: those of its block."""
    return block_end(block_start(position))


def span_end(length: int) -> int:
    """The longest key span a sequence of ``length`` positions needs (the cache length for it)."""
    return decode_span(length - 1)


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


class Tiles(NamedTuple):
    """The fixed shapes of one model's invariant calls (a function of its dimensions only)."""

    rows: int
    """Rows per GEMM of the decoder layers (projections, MLP)."""
    head_rows: int
    """Rows per LM-head GEMM."""
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, row_flops: int, head_row_flops: int, heads: int, kv_heads: int, head_dim: int) -> Tiles:
        """``row_flops``: the work of one row through a layer's projections and MLP;
        ``head_row_flops``: through the LM head."""
        def rows(budget: int, flops: int) -> int:
            return min(_MAX_ROWS, max(_MIN_ROWS, _pow2_floor(budget / flops)))
        return cls(rows(_TILE_FLOPS, row_flops), rows(_HEAD_FLOPS, head_row_flops), heads, kv_heads, head_dim)

    def items_per_call(self, rows: int, span: int) -> int:
        """Attention items of ``rows`` query rows against ``span`` keys per call."""
        flops = 4 * self.heads * rows * span * self.head_dim
        return min(_MAX_ITEMS, _pow2_floor(_ITEM_FLOPS / flops))


def in_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn`` (row-wise) over the rows of ``x`` [..., d], ``rows`` at a time; the last tile is
    zero-padded, so every call has the shape ``[rows, d]``."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    n = flat.shape[0]
    pad = -n % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, d)])
    if flat.shape[0] == rows:
        out = fn(flat)
    else:
        out = torch.cat([fn(tile) for tile in flat.split(rows)])
    return out[:n].reshape(*lead, out.shape[-1])


class Chunk:
    """One attention call: ``count`` items (padded to ``items_per_call``) of ``rows`` query rows
    against ``span`` keys. Tensors are on the pass's device."""

    __slots__ = ("bias", "dense", "dst", "gather", "rows", "slots", "span", "src", "start")

    def __init__(self, rows: int, span: int, slots: torch.Tensor, start: int | None, gather: torch.Tensor,
                 src: torch.Tensor, dst: torch.Tensor, bias: torch.Tensor) -> None:
        self.rows = rows
        self.span = span
        self.slots = slots
        """[items]: each item's cache slot."""
        self.start = start
        """When the slots are consecutive, the first: the keys are then a view of the cache."""
        self.gather = gather
        """[items * rows]: each query row's index among the pass's rows, or the pass's row count
        (a zero row) where that row is not computed."""
        self.src = src
        """Indices into the chunk's ``items * rows`` outputs that are real rows ..."""
        self.dst = dst
        """... and those rows' indices in the pass."""
        self.bias = bias
        """[items, rows, span] float32: 0 where a key is visible to the row, -inf elsewhere."""
        self.dense = src.shape[0] == gather.shape[0]
        """Every output row is a real row (``src`` is all of them)."""


class Plan:
    """One invariant pass: its real rows (token, position, slot) and its attention chunks."""

    __slots__ = ("chunks", "positions", "slots", "tokens")

    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 chunks: list[Chunk]) -> None:
        self.tokens = tokens
        self.positions = positions
        self.slots = slots
        self.chunks = chunks

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


Items = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]
"""Attention items by shape ``(rows, span)`` (a key may add a group number: groups of one shape
make calls of their own): their slots [count], the position of each one's query row 0 [count], and
each query row's index among the pass's rows or -1 (not computed) [count, rows]."""


def _chunks(items: Items, n: int, tiles: Tiles, slot_cap: int, device: torch.device) -> list[Chunk]:
    """Items grouped by shape into fixed-size calls. Padding items are computed and dropped: the
    slots after consecutive real ones where the cache has them (the keys stay one view), else
    copies of the first."""
    out: list[Chunk] = []
    for (rows, span, *_), (slots, firsts, index) in sorted(items.items()):
        per = tiles.items_per_call(rows, span)
        keys = np.arange(span)
        for at in range(0, slots.shape[0], per):
            part, first, ix = slots[at:at + per], firsts[at:at + per], index[at:at + per]
            pad = per - part.shape[0]
            consecutive = bool((np.diff(part) == 1).all()) and int(part[0]) + per <= slot_cap
            if pad:
                extra = np.arange(part[-1] + 1, part[-1] + 1 + pad) if consecutive else np.full(pad, part[0])
                part = np.concatenate([part, extra])
                first = np.concatenate([first, np.full(pad, first[0])])
                ix = np.concatenate([ix, np.full((pad, rows), -1)])
            flat = ix.reshape(-1)
            src = np.flatnonzero(flat >= 0)
            visible = keys[None, None, :] <= (first[:, None] + np.arange(rows)[None, :])[:, :, None]
            bias = np.where(visible, np.float32(0.0), np.float32(-np.inf))
            tensors = [torch.from_numpy(a) for a in (part, np.where(flat >= 0, flat, n), src, flat[src], bias)]
            if device.type != "cpu":
                tensors = [t.to(device) for t in tensors]
            out.append(Chunk(rows, span, tensors[0], int(part[0]) if consecutive else None, *tensors[1:]))
    return out


def plan_prefill(jobs: Sequence[tuple[Sequence[int], int, int]], tiles: Tiles, slot_cap: int,
                 device: torch.device) -> tuple[Plan, list[int]]:
    """The pass that prefills ``jobs`` (``(tokens, start, slot)``: positions ``start..`` of ``tokens``
    into ``slot``, whose positions before ``start`` are in the cache); returns it and each job's
    first row among the pass's rows (its rows are positions ``start..len(tokens)-1``, in order)."""
    tokens, positions, slots, offsets = [], [], [], []
    by_shape: dict[tuple[int, int], tuple[list[int], list[int], list[np.ndarray]]] = {}
    n = 0
    for job_tokens, start, slot in jobs:
        length = len(job_tokens)
        offsets.append(n)
        tokens.append(np.asarray(job_tokens[start:], dtype=np.int64))
        positions.append(np.arange(start, length))
        slots.append(np.full(length - start, slot))
        a = block_start(start)
        while a < length:
            end = block_end(a)
            pos = np.arange(a, end)
            group = by_shape.setdefault((end - a, end), ([], [], []))
            group[0].append(slot)
            group[1].append(a)
            group[2].append(np.where((pos >= start) & (pos < length), n + pos - start, -1))
            a = end
        n += length - start
    items = {shape: (np.asarray(s), np.asarray(f), np.stack(r)) for shape, (s, f, r) in by_shape.items()}
    plan = Plan(torch.from_numpy(np.concatenate(tokens)).to(device),
                torch.from_numpy(np.concatenate(positions)).to(device),
                torch.from_numpy(np.concatenate(slots)).to(device), _chunks(items, n, tiles, slot_cap, device))
    return plan, offsets


def plan_decode(tokens: torch.Tensor, positions: Sequence[int], slots: Sequence[int] | None, tiles: Tiles,
                slot_cap: int, device: torch.device) -> Plan:
    """The pass that decodes one row per position: ``tokens[i]`` at position ``positions[i]`` of slot
    ``slots[i]`` (None: slot ``i``). Each row is its own attention item (its position against its
    block's keys), so it computes what a pass decoding that one position would, whichever rows
    (of its own slot too: verified drafts) share the pass."""
    at = np.asarray(positions)
    owner = np.arange(at.shape[0]) if slots is None else np.asarray(slots)
    spans = np.where(at < SMALL_SPAN, (at // SMALL_BLOCK + 1) * SMALL_BLOCK,
                     SMALL_SPAN + ((at - SMALL_SPAN) // BLOCK + 1) * BLOCK)  # decode_span, vectorised
    # A slot's first row and its further ones (verified drafts) are items of separate calls: the
    # first rows keep the consecutive slots of a plain decode, whose keys are views of the cache.
    first = np.ones(at.shape[0], dtype=bool)
    first[1:] = owner[1:] != owner[:-1]
    items: Items = {}
    for span in np.unique(spans):
        for lane in (True, False):
            rows = np.flatnonzero((spans == span) & (first == lane))
            if rows.shape[0]:
                items[1, int(span), int(not lane)] = (owner[rows], at[rows], rows[:, None])
    n = at.shape[0]
    return Plan(tokens.to(device=device, dtype=torch.long), torch.from_numpy(at).to(device),
                torch.from_numpy(owner).to(device), _chunks(items, n, tiles, slot_cap, device))


def attend(chunk: Chunk, q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           out: torch.Tensor, views: bool = True) -> None:
    """One chunk's attention: ``q_rows`` [n + 1, heads, D] (row n zero), ``keys`` / ``values`` the
    layer's cache [slots, kv_heads, length, D]; writes the real rows' outputs into ``out`` [n, heads, D].
    With ``views`` a chunk of consecutive slots reads the cache in place (the canary checks that a
    view and a gathered copy give the same bits), else its keys and values are gathered."""
    items, rows, span = chunk.slots.shape[0], chunk.rows, chunk.span
    heads, d = q_rows.shape[1], q_rows.shape[2]
    kv = keys.shape[1]
    g = heads // kv
    # [items, rows, kv, g, D] -> [items, kv, g * rows, D]: query heads kv*g..kv*g+g-1 share kv head kv.
    q = q_rows.index_select(0, chunk.gather).view(items, rows, kv, g, d).permute(0, 2, 3, 1, 4)
    q = q.reshape(items, kv, g * rows, d)
    if views and chunk.start is not None:
        k = keys[chunk.start:chunk.start + items, :, :span]
        v = values[chunk.start:chunk.start + items, :, :span]
    else:
        k = keys[:, :, :span].index_select(0, chunk.slots)
        v = values[:, :, :span].index_select(0, chunk.slots)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).view(items, kv, g, rows, span)
    probs = scores.add_(chunk.bias[:, None, None]).softmax(-1).to(v.dtype).view(items, kv, g * rows, span)
    o = torch.matmul(probs, v).view(items, kv, g, rows, d).permute(0, 3, 1, 2, 4).reshape(items * rows, heads, d)
    out.index_copy_(0, chunk.dst, o if chunk.dense else o.index_select(0, chunk.src))


class Canary(NamedTuple):
    """Whether the real kernels round a row (an item) the same at every place of a fixed-shape
    call, and attention the same over a view of the cache as over a gathered copy."""

    ok: bool
    checked: int
    """Checks made (shapes and the view check)."""
    failed: tuple[str, ...]
    """The checks where a place (or reading a view) changed the bits."""
    views: bool
    """Attention may read consecutive slots in place (else it always gathers)."""

    def describe(self) -> dict[str, Any]:
        return {"ok": self.ok, "shapes_checked": self.checked, "failed": list(self.failed),
                "attention_reads_views": self.views}


_VIEW_CHECK = "attention over a view of the cache"


def canary(linears: Sequence[tuple[str, Callable[[torch.Tensor], torch.Tensor], int, int]], tiles: Tiles,
           spans: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device,
           seed: int = 0) -> Canary:
    """Place one random row at the first, middle and last row of each fixed-shape GEMM
    (``linears``: ``(name, fn, in_width, rows)``) among random neighbours, and one random
    attention item at the first, middle and last item of each ``spans`` shape ``(rows, span)``;
    the result must not change by a bit. Then attention over consecutive slots of a larger cache,
    read in place and gathered, must agree. Fast (one call per place and shape)."""
    probe = _Probe(torch.Generator().manual_seed(seed), dtype, device)
    failed = [f"{name} [{rows} x {width}]" for name, fn, width, rows in linears
              if not probe.same_everywhere(rows, probe.linear_at(fn, width, rows))]
    for rows, span in spans:
        per = tiles.items_per_call(rows, span)
        if not probe.same_everywhere(per, probe.item_at(tiles, rows, span)):
            failed.append(f"attention [{per} items x {rows} rows x {span} keys]")
    views = all(probe.view_matches_copy(tiles, rows, span) for rows, span in spans)
    if not views:
        failed.append(_VIEW_CHECK)
    return Canary(not failed, len(linears) + len(spans) + 1, tuple(failed), views)


def check_machine() -> dict[str, Any]:
    """The canary on the shapes of the built-in tiny model (random weights), with this process's
    CPU capability level and thread count: what ``rlengine info`` reports without a model."""
    hidden, inner, vocab, heads, kv, d = 128, 384, 1024, 4, 2, 32
    qkv = (heads + 2 * kv) * d
    tiles = Tiles.of(2 * (hidden * qkv + heads * d * hidden + 3 * hidden * inner), 2 * hidden * vocab, heads, kv, d)
    gen = torch.Generator().manual_seed(1)

    def weight(out: int, width: int) -> torch.Tensor:
        return torch.randn(out, width, generator=gen) * width ** -0.5

    w_qkv, w_o, w_gate_up, w_down, w_head = (weight(qkv, hidden), weight(hidden, heads * d),
                                              weight(2 * inner, hidden), weight(hidden, inner), weight(vocab, hidden))

    def mlp(x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.nn.functional.linear(x, w_gate_up)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:], w_down)

    linears = [("qkv", lambda x: torch.nn.functional.linear(x, w_qkv), hidden, tiles.rows),
               ("o_proj", lambda x: torch.nn.functional.linear(x, w_o), heads * d, tiles.rows),
               ("mlp", mlp, hidden, tiles.rows),
               ("lm_head", lambda x: torch.nn.functional.linear(x, w_head), hidden, tiles.head_rows)]
    spans = [(1, SMALL_BLOCK), (SMALL_BLOCK, SMALL_BLOCK), (1, 1024), (BLOCK, SMALL_SPAN + BLOCK)]
    with torch.inference_mode():
        report = canary(linears, tiles, spans, torch.float32, torch.device("cpu"))
    return {**report.describe(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


class _Probe:
    """The canary's random inputs and placements."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> None:
        self.gen = gen
        self.dtype = dtype
        self.device = device

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def same_everywhere(count: int, run: Callable[[int], torch.Tensor]) -> bool:
        results = [run(place) for place in sorted({0, count // 2, count - 1})]
        return all(torch.equal(results[0], r) for r in results[1:])

    def linear_at(self, fn: Callable[[torch.Tensor], torch.Tensor], width: int,
                  rows: int) -> Callable[[int], torch.Tensor]:
        row = self.rand(width)

        def run(place: int) -> torch.Tensor:
            x = self.rand(rows, width)
            x[place] = row
            return fn(x)[place]

        return run

    def _chunk(self, tiles: Tiles, rows: int, span: int, first_slot: int, slot_cap: int) -> tuple[Chunk, int]:
        per = tiles.items_per_call(rows, span)
        slots = np.arange(first_slot, first_slot + per)
        # Row 0 at position span - rows: the item's last row sees every key.
        items: Items = {(rows, span): (slots, np.full(per, span - rows), np.arange(per * rows).reshape(per, rows))}
        (chunk,) = _chunks(items, per * rows, tiles, slot_cap, self.device)
        return chunk, per

    def item_at(self, tiles: Tiles, rows: int, span: int) -> Callable[[int], torch.Tensor]:
        chunk, per = self._chunk(tiles, rows, span, 0, 0)  # no room past the items: gathered
        heads, kv, d = tiles.heads, tiles.kv_heads, tiles.head_dim
        item_q, item_k, item_v = self.rand(rows, heads, d), self.rand(kv, span, d), self.rand(kv, span, d)

        def run(place: int) -> torch.Tensor:
            q_rows = torch.cat([self.rand(per * rows, heads, d), self.rand(1, heads, d).zero_()])
            q_rows[place * rows:(place + 1) * rows] = item_q
            keys, values = self.rand(per, kv, span, d), self.rand(per, kv, span, d)
            keys[place], values[place] = item_k, item_v
            out = q_rows.new_zeros(per * rows, heads, d)
            attend(chunk, q_rows, keys, values, d ** -0.5, out)
            return out[place * rows:(place + 1) * rows]

        return run

    def view_matches_copy(self, tiles: Tiles, rows: int, span: int) -> bool:
        cap = tiles.items_per_call(rows, span) + 3  # the items at slots 2.., in a longer cache
        chunk, per = self._chunk(tiles, rows, span, 2, cap)
        heads, kv, d = tiles.heads, tiles.kv_heads, tiles.head_dim
        q_rows = torch.cat([self.rand(per * rows, heads, d), self.rand(1, heads, d).zero_()])
        keys, values = self.rand(cap, kv, span + BLOCK, d), self.rand(cap, kv, span + BLOCK, d)
        outs = []
        for views in (True, False):
            out = q_rows.new_zeros(per * rows, heads, d)
            attend(chunk, q_rows, keys, values, d ** -0.5, out, views=views)
            outs.append(out)
        return torch.equal(outs[0], outs[1])
