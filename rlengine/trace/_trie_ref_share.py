"""The pure-Python reference trie's shared trees and views, as ``csrc/trie_share.c``.

``SharedTrees`` holds what a shared root and its views need: finding the
child a view sees, whether a view holds a node, extending the shared path
after a view's anchor, inserting through a view (its attachments), a view's
leaves, dropping a view. ``rlengine.trace._trie_ref.TokenTrie`` inherits it
and owns the node columns, walking and storing; the two files mirror the C
trie's ``trie.c`` and ``trie_share.c``, so a reader of one finds the same
split in the other. Written for clarity; see ``_trie_ref``'s docstring for
what must agree with the C trie.
"""

from __future__ import annotations

from array import array
from typing import Any

from rlengine.errors import InvalidRequest

__all__ = ["ATTACH", "KIND_ENVIRONMENT", "KIND_PROMPT", "KIND_SAMPLED", "SHARED", "VIEW", "SharedTrees"]

KIND_PROMPT = 0
KIND_SAMPLED = 1
KIND_ENVIRONMENT = 2
# Node flags, as csrc/trie_arena.h: in a shared tree; a view's attachment; a view's root.
SHARED, ATTACH, VIEW = 1, 2, 4


class SharedTrees:
    """Shared roots and their views (module docstring); a base of ``TokenTrie``, which owns the
    node columns (``_tok``, ``_parent``, ``_children``, ``_flags``, ``_anchor``, ``_attach``...)
    and the walking and storing these methods call (``_walk``, ``_split``, ``_append``...)."""

    _tok: list[array]
    _parent: list[int]
    _children: list[dict[int, int]]
    _flags: list[int]
    _refs: list[int]
    _view: list[int]
    _anchor: list[int]
    _attach: list[dict[int, int] | None]
    _roots: int
    _views: int
    _shared_tokens: int
    _live_tokens: int

    def _shared_region(self, n: int) -> bool:
        return bool(self._flags[n] & (SHARED | ATTACH))

    def _base(self, n: int) -> int:
        """The shared node a shared-region position stands at (a view root: its shared root)."""
        return self._parent[n] if self._flags[n] & ATTACH else n

    def _path_child(self, anchor: int, x: int) -> int:
        c = anchor
        while c >= 0 and self._parent[c] != x:
            c = self._parent[c]
        return c

    def _child(self, view: int, node: int, first: int) -> int | None:
        """The child of ``node`` starting with ``first`` that ``view`` sees (-1: every child)."""
        if view < 0 or not self._shared_region(node):
            return self._children[node].get(first)
        x = self._base(node)
        c = self._path_child(self._anchor[view], x)
        if c >= 0 and self._tok[c][0] == first:
            return c
        a = self._attach[view].get(x)
        return None if a is None else self._children[a].get(first)

    def _view_holds(self, view: int, n: int) -> bool:
        if n == view:
            return True
        while not self._shared_region(n):
            n = self._parent[n]
            if n < 0:
                return False
        if self._flags[n] & ATTACH:
            return self._view[n] == view
        x = self._anchor[view]
        while x >= 0:
            if x == n:
                return True
            x = self._parent[x]
        return False

    def _resolve(self, at: Any, view: Any) -> tuple[int, int]:
        """(node to walk from, view or -1), refused as rle_trie_walk_view refuses."""
        node = self._node(at)
        if view is not None:
            v = self._node(view) if self._is_node(view) else -1
            if v < 0 or not self._flags[v] & VIEW or not self._view_holds(v, node):
                raise InvalidRequest("view", view, f"not a view of this trie that holds at={at}")
            return (v if node == self._parent[v] else node), v
        if self._flags[node] & VIEW:
            return node, node
        if self._flags[node] & SHARED:
            raise InvalidRequest("view", None, f"at={at} is a shared node: pass the view to walk it in")
        return node, -1

    def _attachment_new(self, view: int, x: int) -> int:
        a = self._alloc()
        self._flags[a], self._parent[a], self._view[a] = ATTACH, x, view
        self._attach[view][x] = a
        return a

    def _extend(self, view: int, tokens: array) -> int:
        """Store shareable ``tokens`` after the view's anchor in the shared tree (see csrc/trie_share.c)."""
        anchor = self._anchor[view]
        node, offset, matched = self._walk(anchor, tokens)
        need_split = offset < len(self._tok[node])
        rest = len(tokens) - matched
        self._reserve(rest, need_split + (rest > 0))
        end = self._split(node, offset) if need_split else node
        if rest > 0:
            end = self._append(end, tokens, None, None, matched, KIND_PROMPT, -1)
            self._flags[end] = SHARED
            self._shared_tokens += rest
        x = end
        while x != anchor:
            self._refs[x] += 1
            x = self._parent[x]
        self._anchor[view] = end
        return self._handle(end)

    def _view_insert(self, view: int, node: int, offset: int, matched: int, tokens: array,
                     logprobs: array | None, versions: array | None, kind: int, request_id: int) -> int:
        extra = len(tokens) - matched
        self._check_extra(extra)
        need_split = offset < len(self._tok[node])
        base = self._base(node)
        a = self._attach[view].get(base)
        shareable = kind == KIND_PROMPT and request_id == -1 and (
            logprobs is None or logprobs[matched:].tobytes() == bytes(4 * extra))  # +0.0 only, bit for bit
        if (extra > 0 and not need_split and base == self._anchor[view] and (a is None or not self._children[a])
                and shareable):
            return self._extend(view, tokens[matched:])
        if need_split:
            a = None
        need_attach = extra > 0 and a is None
        self._reserve(extra, need_split + need_attach + (extra > 0))
        if need_split:
            node = base = self._split(node, offset)
        if extra == 0:
            return self._handle(node)
        if a is None:
            a = self._attachment_new(view, base)
        return self._handle(self._append(a, tokens, logprobs, versions, matched, kind, request_id))

    def _view_leaves(self, view: int) -> list[int]:
        out: list[int] = []
        anchor = x = self._anchor[view]
        while x >= 0:
            a = self._attach[view].get(x)
            if a is not None and self._children[a]:
                out.extend(self._leaves_below(a))
            elif x == anchor and self._parent[x] >= 0:
                out.append(self._handle(x))
            x = self._parent[x]
        return out

    def _drop_view(self, view: int) -> int:
        freed = 0
        for a in list(self._attach[view].values()):
            for c in list(self._children[a].values()):
                freed += self._free_below(c)
            self._children[a] = {}
            if a != view:
                self._release(a)
        x = self._anchor[view]
        while x >= 0:
            p = self._parent[x]
            self._refs[x] -= 1
            if self._refs[x] == 0:
                if p >= 0:
                    del self._children[p][self._tok[x][0]]
                else:
                    self._roots -= 1
                length = len(self._tok[x])
                freed += length
                self._live_tokens -= length
                self._shared_tokens -= length
                self._release(x)
            x = p
        self._release(view)
        self._views -= 1
        return freed


    def new_shared_root(self) -> int:
        self._reserve(0, 1)
        idx = self._alloc()
        self._flags[idx] = SHARED
        self._roots += 1
        return self._handle(idx)

    def new_view(self, shared_root: int) -> int:
        root = self._node(shared_root)
        if not self._flags[root] & SHARED or self._parent[root] >= 0:
            raise InvalidRequest("shared_root", shared_root, "not a shared root (new_shared_root)")
        self._reserve(0, 1)
        v = self._alloc()
        self._flags[v], self._parent[v], self._view[v], self._anchor[v] = ATTACH | VIEW, root, v, root
        self._attach[v] = {root: v}
        self._refs[root] += 1
        self._views += 1
        return self._handle(v)
