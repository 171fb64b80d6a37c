"""A radix tree of token prefixes and their KV, under a byte budget with LRU eviction.

The torch backend keeps the KV of prompts (and, where exact enough, of what
it generated) it has computed, keyed by their tokens, so a request whose
prompt starts with a cached prefix (a group's shared prompt, the
conversation so far of a multi-turn session) copies that KV into its slot and
prefills only the rest. SGLang's radix cache is the model:

* a node holds one edge of the tree: its tokens (int32) and their KV, one
  tensor whose axis -2 is the token axis (the backend stores
  ``[2 * layers, kv_heads, tokens, head_dim]``); children are keyed by their
  first token, and edges split where two sequences diverge;
* ``match`` walks a prompt down the tree and returns how many leading tokens
  are cached and the KV pieces covering them (views, copied by the caller);
* ``insert`` adds a sequence, asking for the KV of only the part not cached;
* every node used or added is touched leaf first, root last, so a parent is
  always at least as recent as its children: the least recently used node is
  always a leaf, and eviction pops leaves from the old end of one ordered dict.
  The cache never holds more than ``budget`` bytes of KV: an insertion that
  would not fit is cut to what fits beside its own path, then old leaves go.

The payload is opaque here (any tensor with a token axis -2), so the tree is
tested without a model (``tests/backends/test_prefix_cache.py``, against a
plain list of sequences). It knows nothing of weights: the backend clears it
on every weight install, since KV computed by other weights is stale.
Compute thread only, like the backend that owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["PrefixCache", "common_prefix"]


class _Node:
    __slots__ = ("children", "kv", "nbytes", "parent", "tokens")

    def __init__(self, tokens: np.ndarray, kv: torch.Tensor | None, parent: _Node | None) -> None:
        self.tokens = tokens
        self.kv = kv
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.nbytes = 0 if kv is None else kv.numel() * kv.element_size()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Token prefixes -> KV, radix-structured, LRU-evicted within ``budget`` bytes; see the module docstring."""

    def __init__(self, budget: int, bytes_per_token: int) -> None:
        if budget < 0:
            raise ValueError(f"prefix cache budget {budget}: must be >= 0")
        self.budget = budget
        self.bytes_per_token = bytes_per_token
        """Bytes of KV per cached token (every payload has the same)."""
        self.nbytes = 0
        self.evicted = 0
        """Nodes evicted since the cache was built (not reset by ``clear``)."""
        self._root = _Node(np.zeros(0, dtype=np.int32), None, None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def _walk(self, tokens: np.ndarray) -> tuple[int, list[tuple[_Node, int]]]:
        """How far ``tokens`` runs down the tree, and the (node, tokens used of its edge) passed."""
        node, pos, path = self._root, 0, []
        while pos < tokens.shape[0]:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            used = common_prefix(child.tokens, tokens[pos:])
            path.append((child, used))
            pos += used
            if used < child.tokens.shape[0]:
                break
            node = child
        return pos, path

    def _touch(self, path: list[tuple[_Node, int]]) -> None:
        for node, _ in reversed(path):  # leaf first: a parent ends up more recent than its child
            self._lru.move_to_end(node)

    def match(self, tokens: np.ndarray, limit: int | None = None) -> tuple[int, list[torch.Tensor]]:
        """The cached length of ``tokens``' longest cached prefix (at most ``limit``) and its
        KV, in order, as views of the cached tensors (token axis -2); touches what it used."""
        if limit is not None:
            tokens = tokens[:limit]
        length, path = self._walk(tokens)
        self._touch(path)
        return length, [node.kv[..., :used, :] for node, used in path]  # type: ignore[index]

    def insert(self, tokens: np.ndarray, kv_of: Callable[[int, int], torch.Tensor]) -> int:
        """Cache ``tokens``; ``kv_of(start, end)`` gives the KV of positions ``start..end-1``
        (a tensor the cache may keep), asked once, for the part not yet cached. Returns the
        number of tokens added (cut to what the budget allows beside the sequence's own path)."""
        pos, path = self._walk(tokens)
        added = 0
        if pos < tokens.shape[0]:
            room = self.budget // self.bytes_per_token - pos  # the path holds pos tokens
            end = min(tokens.shape[0], pos + room)
            if end > pos:
                if path and path[-1][1] < path[-1][0].tokens.shape[0]:
                    node, used = path[-1]
                    path[-1] = (self._split(node, used), used)
                parent = path[-1][0] if path else self._root
                kv = kv_of(pos, end)
                assert kv.numel() * kv.element_size() == (end - pos) * self.bytes_per_token
                leaf = _Node(tokens[pos:end].copy(), kv, parent)
                parent.children[int(tokens[pos])] = leaf
                self._lru[leaf] = None
                self.nbytes += leaf.nbytes
                path.append((leaf, end - pos))
                added = end - pos
        self._touch(path)
        self._evict()
        return added

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node (the tail keeps
        ``node``'s children and its place in the LRU order, the upper part is touched by the caller)."""
        assert node.kv is not None and node.parent is not None
        upper = _Node(node.tokens[:at].copy(), node.kv[..., :at, :].clone(), node.parent)
        node.parent.children[int(node.tokens[0])] = upper
        tail_kv = node.kv[..., at:, :].clone()  # clones: the old tensor's memory goes
        node.tokens, node.kv, node.parent = node.tokens[at:].copy(), tail_kv, upper
        node.nbytes = tail_kv.numel() * tail_kv.element_size()
        upper.children[int(node.tokens[0])] = node
        self._lru[upper] = None
        return upper

    def _evict(self) -> None:
        lru = self._lru
        while self.nbytes > self.budget:
            node, _ = lru.popitem(last=False)
            assert not node.children, "the least recently used node must be a leaf"
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.tokens[0])]
            self.nbytes -= node.nbytes
            self.evicted += 1

    def clear(self) -> None:
        """Drop everything (a weight install makes every cached KV stale)."""
        self._root = _Node(np.zeros(0, dtype=np.int32), None, None)
        self._lru.clear()
        self.nbytes = 0

    def check(self) -> None:
        """Assert the tree's invariants (tests): byte total, budget, edges, LRU order."""
        seen, total = 0, 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and int(child.tokens[0]) == first and child.tokens.shape[0] > 0
                assert child.kv is not None and child.kv.shape[-2] == child.tokens.shape[0]
                assert child in self._lru
                total += child.nbytes
                seen += 1
                stack.append(child)
        assert seen == len(self._lru) and total == self.nbytes <= self.budget
        order = {node: i for i, node in enumerate(self._lru)}
        for node in self._lru:
            assert node.parent is self._root or order[node.parent] > order[node]
