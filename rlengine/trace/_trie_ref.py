"""The pure-Python reference of the token trie: the same API and behaviour as
the compiled ``rlengine.trace._trie``, written for clarity.

It exists for the differential tests (hypothesis drives both with the same
operations and compares every answer) and, only when
``RLENGINE_NO_EXTENSIONS=1``, as the run-time implementation on hosts that
cannot build the extension. It is several times slower; the benchmark
measures by how much.

What must agree with the C trie: every return value (up to the numbering of
handles), every accepted and refused input, the order of leaves and the
node structure (splits happen at the same places; shared roots, views and
their attachments are records here too, with the same reference counts).
What may differ: handle numbers and memory accounting, which here is
nominal (12 bytes per token, 48 per node, the C record sizes) because
Python objects have no useful size.

This module must not import the compiled extension, and must not take
shortcuts the C trie does not take: a test that passes here must say
something about the C code.
"""

from __future__ import annotations

from array import array
from typing import Any

from rlengine.errors import InvalidRequest
from rlengine.trace._trie_ref_share import ATTACH as _ATTACH
from rlengine.trace._trie_ref_share import KIND_ENVIRONMENT, KIND_PROMPT, KIND_SAMPLED, SharedTrees
from rlengine.trace._trie_ref_share import SHARED as _SHARED
from rlengine.trace._trie_ref_share import VIEW as _VIEW
from rlengine.trace.errors import TraceMemoryExceeded

__all__ = ["KIND_ENVIRONMENT", "KIND_PROMPT", "KIND_SAMPLED", "TokenTrie"]

_KINDS = (KIND_PROMPT, KIND_SAMPLED, KIND_ENVIRONMENT)
_FREE = 255
_GEN_MASK = 0x7FFFFFFF
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_TOKEN_BYTES = 12
_NODE_BYTES = 48


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_array(obj: Any, code: str, field: str) -> array:
    """``obj`` as an ``array(code)`` copy, refused exactly where the C binding refuses."""
    name = "int32" if code == "i" else "float32"
    if isinstance(obj, (list, tuple)):
        try:
            return array(code, obj)
        except (TypeError, OverflowError) as exc:
            raise InvalidRequest(field, obj, f"not a sequence of {name} ({exc})") from None
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidRequest(field, type(obj).__name__,
                             "must be a buffer (numpy array, array('i'/'f'), bytes) or a list") from None
    except (BufferError, ValueError) as exc:
        raise InvalidRequest(field, type(obj).__name__, f"cannot be read as a buffer ({exc})") from None
    with view:
        if view.ndim != 1:
            raise InvalidRequest(field, f"ndim={view.ndim}", "must be one-dimensional")
        if not view.c_contiguous:
            raise InvalidRequest(field, "strided buffer", "must be C-contiguous (numpy.ascontiguousarray)")
        fmt = view.format[1:] if view.format[:1] in ("@", "=", "<") else view.format
        raw = isinstance(obj, (bytes, bytearray, memoryview)) and view.itemsize == 1 and fmt in ("B", "b", "c")
        if raw:
            if view.nbytes % 4:
                raise InvalidRequest(field, view.nbytes, "raw bytes must hold whole 4-byte items")
        elif not (view.itemsize == 4 and (fmt == "f" if code == "f" else fmt in ("i", "l"))):
            raise InvalidRequest(field, f"format {view.format!r}, itemsize {view.itemsize}", f"must be {name}")
        out = array(code)
        out.frombytes(view.cast("B"))
        return out


def _check_tokens(tokens: array) -> None:
    if tokens and min(tokens) < 0:
        bad = next(i for i, t in enumerate(tokens) if t < 0)
        raise InvalidRequest(f"tokens[{bad}]", tokens[bad], "token ids must be >= 0")


class TokenTrie(SharedTrees):
    """A forest of radix tries over int32 token ids (pure Python).

    Nodes are indices into parallel lists; a node's children are a dict from
    first token to child, whose insertion order is the creation order the C
    trie keeps in its sibling lists. A view keeps its attachments in a dict
    from the shared node they hang off (the C trie: a list through
    ``sibling``; the order is never observed).

    Why one class: it mirrors the compiled trie's one class, method for method, so the
    differential tests drive both alike (shared trees are in ``SharedTrees``, as trie_share.c).
    """

    def __init__(self, max_bytes: int = 0) -> None:
        if not _is_int(max_bytes) or not 0 <= max_bytes <= _INT64_MAX:
            raise InvalidRequest("max_bytes", max_bytes, "must be an int >= 0 (0: unbounded)")
        self._max_bytes = max_bytes
        self._tok: list[array] = []
        self._lp: list[array] = []
        self._ver: list[array] = []
        self._parent: list[int] = []
        self._children: list[dict[int, int]] = []
        self._kind: list[int] = []
        self._req: list[int] = []
        self._flags: list[int] = []
        self._refs: list[int] = []
        self._view: list[int] = []  # an attachment's view root
        self._anchor: list[int] = []  # a view root's end of its shared path
        self._attach: list[dict[int, int] | None] = []  # a view root's attachments by shared node
        self._gen: list[int] = []
        self._free: list[int] = []
        self._live_tokens = 0
        self._live_nodes = 0
        self._roots = 0
        self._views = 0
        self._shared_tokens = 0

    # -- nodes and handles ---------------------------------------------------

    def _node(self, handle: Any) -> int:
        if not _is_int(handle):
            raise InvalidRequest("handle", handle, "must be an int handle returned by this trie")
        if not 0 <= handle <= _INT64_MAX:
            raise InvalidRequest("handle", handle, "not a handle of this trie")
        idx, gen = handle & 0xFFFFFFFF, handle >> 32
        if (idx >= len(self._kind) or self._kind[idx] == _FREE or self._gen[idx] != gen
                or self._flags[idx] & (_ATTACH | _VIEW) == _ATTACH):
            raise InvalidRequest("handle", handle, "not a live node of this trie (never made here, or pruned)")
        return idx

    def _is_node(self, handle: int) -> bool:
        try:
            self._node(handle)
        except InvalidRequest:
            return False
        return True

    def _handle(self, idx: int) -> int:
        return (self._gen[idx] << 32) | idx

    def _alloc(self) -> int:
        fresh = (array("i"), array("f"), array("i"), -1, {}, KIND_PROMPT, -1, 0, 0, -1, -1, None)
        columns = (self._tok, self._lp, self._ver, self._parent, self._children, self._kind, self._req,
                   self._flags, self._refs, self._view, self._anchor, self._attach)
        if self._free:
            idx = self._free.pop()
            for column, value in zip(columns, fresh):
                column[idx] = value
        else:
            idx = len(self._kind)
            for column, value in zip(columns, fresh):
                column.append(value)
            self._gen.append(0)
        self._live_nodes += 1
        return idx

    def _release(self, idx: int) -> None:
        self._kind[idx] = _FREE
        self._gen[idx] = (self._gen[idx] + 1) & _GEN_MASK
        self._tok[idx], self._lp[idx], self._ver[idx] = array("i"), array("f"), array("i")
        self._children[idx] = {}
        self._attach[idx] = None
        self._free.append(idx)
        self._live_nodes -= 1

    def _nominal_bytes(self, tokens: int, nodes: int) -> int:
        return tokens * _TOKEN_BYTES + nodes * _NODE_BYTES

    def _reserve(self, tokens: int, nodes: int) -> None:
        if self._max_bytes and self._nominal_bytes(self._live_tokens + tokens,
                                                   self._live_nodes + nodes) > self._max_bytes:
            raise TraceMemoryExceeded(self._max_bytes, self.memory_bytes, tokens)

    # -- walking and storing -------------------------------------------------

    def _walk(self, node: int, tokens: array, view: int = -1) -> tuple[int, int, int]:
        """(node, offset on its edge, tokens matched), like rle_tree_walk_from."""
        n = len(tokens)
        offset = len(self._tok[node])
        i = 0
        while i < n:
            c = self._child(view, node, tokens[i])
            if c is None:
                break
            edge = self._tok[c]
            m = min(len(edge), n - i)
            if tokens[i:i + m] == edge[:m]:
                k = m
            else:
                # Longest equal prefix by bisection over slice comparisons:
                # the first token is known equal, the whole m is known not.
                lo, hi = 1, m
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if tokens[i:i + mid] == edge[:mid]:
                        lo = mid
                    else:
                        hi = mid
                k = lo
            node, offset, i = c, k, i + k
            if k < len(edge):
                break
        return node, offset, i

    def _split(self, c: int, k: int) -> int:
        p = self._alloc()
        parent = self._parent[c]
        first = self._tok[c][0]
        self._tok[p], self._tok[c] = self._tok[c][:k], self._tok[c][k:]
        self._lp[p], self._lp[c] = self._lp[c][:k], self._lp[c][k:]
        self._ver[p], self._ver[c] = self._ver[c][:k], self._ver[c][k:]
        self._parent[p], self._kind[p], self._req[p] = parent, self._kind[c], self._req[c]
        self._flags[p], self._refs[p] = self._flags[c] & _SHARED, self._refs[c]
        self._children[parent][first] = p  # same key: p takes c's place in the order
        self._children[p] = {self._tok[c][0]: c}
        self._parent[c] = p
        return p

    def _append(self, parent: int, tokens: array, logprobs: array | None, versions: array | None, matched: int,
                kind: int, request_id: int) -> int:
        extra = len(tokens) - matched
        c = self._alloc()
        self._tok[c] = tokens[matched:]
        self._lp[c] = logprobs[matched:] if logprobs is not None else array("f", bytes(4 * extra))
        self._ver[c] = versions[matched:] if versions is not None else array("i", [-1]) * extra
        self._parent[c], self._kind[c], self._req[c] = parent, kind, request_id
        self._children[parent][self._tok[c][0]] = c
        self._live_tokens += extra
        return c

    @staticmethod
    def _check_extra(extra: int) -> None:
        if extra > _INT32_MAX:
            raise InvalidRequest("tokens", extra, "beyond the trie's limits (2**31 - 1 new tokens in one call, "
                                 "2**31 - 1 nodes)")

    def _insert_at(self, node: int, offset: int, matched: int, tokens: array, logprobs: array | None,
                   versions: array | None, kind: int, request_id: int, view: int = -1) -> int:
        if view >= 0 and self._shared_region(node):
            return self._view_insert(view, node, offset, matched, tokens, logprobs, versions, kind, request_id)
        extra = len(tokens) - matched
        self._check_extra(extra)
        need_split = offset < len(self._tok[node])
        self._reserve(extra, need_split + (extra > 0))
        if need_split:
            node = self._split(node, offset)
        if extra > 0:
            node = self._append(node, tokens, logprobs, versions, matched, kind, request_id)
        return self._handle(node)

    def _leaves_below(self, top: int) -> list[int]:
        out = []
        stack = [top]
        while stack:
            n = stack.pop()
            children = self._children[n]
            if children:
                stack.extend(reversed(children.values()))
            else:
                out.append(self._handle(n))
        return out

    def _free_below(self, top: int) -> int:
        """Free an unlinked ``top`` and everything below it; the tokens freed."""
        freed = 0
        stack = [top]
        while stack:
            n = stack.pop()
            stack.extend(self._children[n].values())
            freed += len(self._tok[n])
            self._release(n)
        self._live_tokens -= freed
        return freed

    @staticmethod
    def _check_view(view: Any) -> None:
        """The binding's type check of ``view`` (liveness is the walk's)."""
        if view is not None and (not _is_int(view) or not 0 <= view <= _INT64_MAX):
            raise InvalidRequest("handle", view, "must be an int handle returned by this trie"
                                 if not _is_int(view) else "not a handle of this trie")

    # -- the public API (documented in rlengine.trace.trie) ------------------------

    def new_root(self) -> int:
        self._reserve(0, 1)
        idx = self._alloc()
        self._roots += 1
        return self._handle(idx)

    def insert(self, at: int, tokens: Any, logprobs: Any = None, versions: Any = None, kind: int = KIND_PROMPT,
               request_id: int = -1, view: int | None = None) -> tuple[int, int]:
        if not _is_int(at) or not 0 <= at <= _INT64_MAX:
            self._node(at)
        self._check_view(view)
        if not _is_int(kind) or kind not in _KINDS:
            raise InvalidRequest("kind", kind, "must be KIND_PROMPT, KIND_SAMPLED or KIND_ENVIRONMENT")
        if not _is_int(request_id) or not -1 <= request_id <= _INT64_MAX:
            raise InvalidRequest("request_id", request_id, "must be an int in [-1, 2**63) (-1: none)")
        if kind == KIND_SAMPLED and (logprobs is None or versions is None):
            raise InvalidRequest("logprobs" if logprobs is None else "versions", None,
                                 "sampled tokens need their logprobs and versions")
        toks = _as_array(tokens, "i", "tokens")
        _check_tokens(toks)
        n = len(toks)
        lps = vers = None
        if logprobs is not None:
            lps = _as_array(logprobs, "f", "logprobs")
            if len(lps) != n:
                raise InvalidRequest("logprobs", f"length {len(lps)}", f"must match the {n} tokens")
        if versions is not None:
            vers = _as_array(versions, "i", "versions")
            if len(vers) != n:
                raise InvalidRequest("versions", f"length {len(vers)}", f"must match the {n} tokens")
        start, v = self._resolve(at, view)
        node, offset, matched = self._walk(start, toks, v)
        if lps is not None:
            for i in range(matched, n):
                if not lps[i] <= 0.0:
                    raise InvalidRequest(f"logprobs[{i}]", lps[i], "logprobs must be <= 0 and not NaN")
        if vers is not None:
            for i in range(matched, n):
                if (vers[i] < 0) if kind == KIND_SAMPLED else (vers[i] != -1):
                    raise InvalidRequest(f"versions[{i}]", vers[i],
                                         "sampled tokens need a version >= 0" if kind == KIND_SAMPLED
                                         else "prompt and environment tokens carry version -1")
        return self._insert_at(node, offset, matched, toks, lps, vers, kind, request_id, v), matched

    def longest_prefix(self, at: int, tokens: Any, view: int | None = None) -> int:
        self._node(at)
        self._check_view(view)
        toks = _as_array(tokens, "i", "tokens")
        start, v = self._resolve(at, view)
        _check_tokens(toks)
        return self._walk(start, toks, v)[2]

    def seek(self, at: int, tokens: Any, view: int | None = None) -> tuple[int, int]:
        self._node(at)
        self._check_view(view)
        toks = _as_array(tokens, "i", "tokens")
        start, v = self._resolve(at, view)
        _check_tokens(toks)
        node, offset, matched = self._walk(start, toks, v)
        return self._insert_at(node, offset, matched, toks[:matched], None, None, KIND_PROMPT, -1, v), matched

    def depth(self, handle: int) -> int:
        n = self._node(handle)
        d = 0
        while n >= 0:
            d += len(self._tok[n])
            n = self._parent[n]
        return d

    def _root_index(self, n: int) -> int:
        while True:
            if self._flags[n] & _ATTACH:
                return self._view[n]
            if self._parent[n] < 0:
                return n
            n = self._parent[n]

    def root_of(self, handle: int) -> int:
        return self._handle(self._root_index(self._node(handle)))

    def parent(self, handle: int) -> int | None:
        n = self._node(handle)
        p = -1 if self._flags[n] & _VIEW else self._parent[n]
        if p >= 0 and self._flags[p] & (_ATTACH | _VIEW) == _ATTACH:
            p = self._parent[p]  # an attachment stands at the end of its shared node
        return None if p < 0 else self._handle(p)

    def is_live(self, handle: Any) -> bool:
        return self._is_node(handle)

    def holds(self, root: int, handle: int) -> bool:
        r, n = self._node(root), self._node(handle)
        if self._flags[r] & _VIEW:
            return self._view_holds(r, n)
        return self._root_index(n) == r

    def refs(self, handle: int) -> int:
        n = self._node(handle)
        return self._refs[n] if self._flags[n] & _SHARED else 1

    def _path(self, handle: int) -> list[int]:
        n = self._node(handle)
        path = []
        while n >= 0:
            path.append(n)
            n = self._parent[n]
        path.reverse()
        return path

    def path_tokens(self, handle: int) -> bytes:
        out = array("i")
        for n in self._path(handle):
            out.extend(self._tok[n])
        return out.tobytes()

    def export_path(self, handle: int) -> tuple[bytes, bytes, bytes, bytes]:
        toks, lps, vers, mask = array("i"), array("f"), array("i"), bytearray()
        for n in self._path(handle):
            toks.extend(self._tok[n])
            lps.extend(self._lp[n])
            vers.extend(self._ver[n])
            mask += bytes([self._kind[n] == KIND_SAMPLED]) * len(self._tok[n])
        return toks.tobytes(), lps.tobytes(), vers.tobytes(), bytes(mask)

    def path_segments(self, handle: int) -> list[tuple[int, int, int, int]]:
        segments: list[tuple[int, int, int, int]] = []
        pos = 0
        for n in self._path(handle):
            length = len(self._tok[n])
            if length == 0:
                continue
            if segments and segments[-1][2:] == (self._kind[n], self._req[n]):
                segments[-1] = (segments[-1][0], pos + length, self._kind[n], self._req[n])
            else:
                segments.append((pos, pos + length, self._kind[n], self._req[n]))
            pos += length
        return segments

    def leaves(self, handle: int) -> list[int]:
        top = self._node(handle)
        if self._flags[top] & _VIEW:
            return self._view_leaves(top)
        if self._flags[top] & _SHARED:
            raise InvalidRequest("handle", handle, "a shared node, held by views: list a view's leaves from its "
                                 "view root")
        if not self._children[top]:
            return [] if self._parent[top] < 0 else [handle]
        return self._leaves_below(top)

    def prune(self, handle: int) -> int:
        top = self._node(handle)
        if self._flags[top] & _VIEW:
            return self._drop_view(top)
        if self._flags[top] & _SHARED:
            if self._parent[top] >= 0 or self._refs[top] > 0:
                raise InvalidRequest("handle", handle, "a shared node, held by views: it goes when the last view "
                                     "holding it is dropped (prune the view roots)")
            self._release(top)
            self._roots -= 1
            return 0
        parent = self._parent[top]
        if parent >= 0:
            del self._children[parent][self._tok[top][0]]
        else:
            self._roots -= 1
        freed = self._free_below(top)
        if (parent >= 0 and self._flags[parent] & (_ATTACH | _VIEW) == _ATTACH
                and not self._children[parent]):
            del self._attach[self._view[parent]][self._parent[parent]]
            self._release(parent)
        return freed

    def compact(self) -> None:
        """Nothing to do: Python frees a pruned edge's arrays at once."""

    def stats(self) -> dict[str, int]:
        return {
            "memory_bytes": self.memory_bytes,
            "max_bytes": self._max_bytes,
            "live_tokens": self._live_tokens,
            "garbage_tokens": 0,
            "arena_capacity": self._live_tokens,
            "blocks": 0,
            "live_nodes": self._live_nodes,
            "node_capacity": len(self._kind),
            "roots": self._roots,
            "views": self._views,
            "shared_tokens": self._shared_tokens,
        }

    @property
    def memory_bytes(self) -> int:
        return self._nominal_bytes(self._live_tokens, self._live_nodes)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def live_tokens(self) -> int:
        return self._live_tokens

    @property
    def node_count(self) -> int:
        return self._live_nodes

    @property
    def root_count(self) -> int:
        return self._roots
