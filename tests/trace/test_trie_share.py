"""Tests of shared trees in the token trie (csrc/trie_share.c and its
reference): views share equal prompts with reference counts, keep
everything else exact and private, answer as trees of their own, and free
only what no other view holds. Each test runs over the compiled trie and
the pure-Python reference; a hypothesis state machine drives both side by
side against a dictionary oracle (sharing, dropping, pruning, compaction),
and a property test holds views to own trees fed the same calls.

What this file must not do: test one implementation against itself, or
accept a difference in what a view exports from what it stored.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import rlengine.trace._trie as c_trie
import rlengine.trace._trie_ref as ref_trie
from rlengine.errors import InvalidRequest
from rlengine.trace.errors import TraceMemoryExceeded

P, S, E = c_trie.KIND_PROMPT, c_trie.KIND_SAMPLED, c_trie.KIND_ENVIRONMENT
IMPLS = [pytest.param(c_trie.TokenTrie, id="c"), pytest.param(ref_trie.TokenTrie, id="reference")]


@pytest.fixture(params=IMPLS)
def Trie(request):
    return request.param


def i32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def f32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def exported(trie, h):
    t, lp, v, m = trie.export_path(h)
    return (np.frombuffer(t, np.int32).tolist(), np.frombuffer(lp, np.float32).tolist(),
            np.frombuffer(v, np.int32).tolist(), np.frombuffer(m, np.uint8).tolist())


SYSTEM = list(range(100, 140))


def test_views_store_an_equal_prompt_once_and_keep_samples_their_own(Trie):
    t = Trie()
    shared = t.new_shared_root()
    views = [t.new_view(shared) for _ in range(4)]
    ends, leaves = [], []
    for k, v in enumerate(views):
        group = [500 + k // 2] * 10  # two groups of two
        end, matched = t.insert(v, i32(*SYSTEM, *group))
        assert matched == 0 and t.depth(end) == 50
        ends.append(end)
        # Equal sampled tokens, different logprobs and versions: never merged.
        leaf, matched = t.insert(end, i32(7, 8, 9), f32(-0.5 * (k + 1), -1, -1), i32(k, k, k), kind=S,
                                 request_id=k, view=v)
        assert matched == 0
        leaves.append(leaf)
    assert ends[0] == ends[1] != ends[2] == ends[3] and t.refs(ends[0]) == 2
    assert t.refs(t.parent(ends[0])) == 4 and t.refs(shared) == 4  # the system prompt's end, the root
    st_ = t.stats()
    assert st_["shared_tokens"] == 40 + 2 * 10 and st_["live_tokens"] == 60 + 4 * 3 and st_["views"] == 4
    for k, (v, leaf) in enumerate(zip(views, leaves)):
        assert t.leaves(v) == [leaf] and t.refs(leaf) == 1
        assert exported(t, leaf) == (SYSTEM + [500 + k // 2] * 10 + [7, 8, 9], [0.0] * 50 + [-0.5 * (k + 1), -1, -1],
                                     [-1] * 50 + [k] * 3, [0] * 50 + [1] * 3)
        assert t.path_segments(leaf) == [(0, 50, P, -1), (50, 53, S, k)]
        assert t.root_of(leaf) == v and t.holds(v, leaf) and t.holds(v, ends[k]) and t.holds(v, v)
        assert not any(t.holds(v, other) for other in leaves if other != leaf)
    assert not t.holds(views[0], ends[2])


@pytest.mark.parametrize("kwargs", [
    pytest.param({"request_id": 3}, id="request-id"),
    pytest.param({"logprobs": f32(0, -0.5, 0)}, id="logprobs"),
    pytest.param({"logprobs": f32(0, -0.0, 0)}, id="negative-zero-logprob"),
    pytest.param({"kind": E}, id="environment"),
    pytest.param({"kind": S, "logprobs": f32(0, 0, 0), "versions": i32(1, 1, 1)}, id="sampled"),
])
def test_only_equal_for_every_holder_is_shared(Trie, kwargs):
    """A segment that carries anything but the prompt defaults stays the view's own, bit for bit."""
    t = Trie()
    shared = t.new_shared_root()
    a, b = t.new_view(shared), t.new_view(shared)
    end_a, _ = t.insert(a, i32(1, 2, 3), **kwargs)
    end_b, _ = t.insert(b, i32(1, 2, 3), **kwargs)
    assert end_a != end_b and t.stats()["shared_tokens"] == 0 and t.live_tokens == 6
    want = exported(t, end_a)
    assert exported(t, end_b) == want and t.path_segments(end_b) == t.path_segments(end_a)
    if "logprobs" in kwargs:
        assert t.export_path(end_a)[1] == kwargs["logprobs"].tobytes()
    # Explicit +0.0 logprobs are the defaults: shared.
    c, d = t.new_view(shared), t.new_view(shared)
    assert t.insert(c, i32(1, 2, 3), f32(0, 0, 0), i32(-1, -1, -1))[0] == t.insert(d, i32(1, 2, 3))[0]
    assert t.stats()["shared_tokens"] == 3


def test_a_view_sees_only_what_it_holds(Trie):
    t = Trie()
    shared = t.new_shared_root()
    a, b = t.new_view(shared), t.new_view(shared)
    prompt, _ = t.insert(a, i32(*SYSTEM))
    t.insert(prompt, i32(1, 2), f32(-1, -1), i32(0, 0), kind=S, view=a)
    assert t.longest_prefix(b, i32(*SYSTEM)) == 0 and t.leaves(b) == [] and not t.holds(b, prompt)
    assert t.seek(b, i32(*SYSTEM)) == (b, 0)
    # Taking the prompt up stores nothing; it is new to b, so not "matched".
    live = t.live_tokens
    assert t.insert(b, i32(*SYSTEM)) == (prompt, 0) and t.live_tokens == live and t.refs(prompt) == 2
    assert t.insert(b, i32(*SYSTEM)) == (prompt, len(SYSTEM))
    assert t.longest_prefix(prompt, i32(1, 2), view=b) == 0 and t.leaves(b) == [prompt]
    # A shared position needs the view it is walked in, and one that holds it.
    with pytest.raises(InvalidRequest, match="view"):
        t.insert(prompt, i32(5))
    c = t.new_view(shared)
    own = t.new_root()
    for view in (c, own, shared, 2**40):
        with pytest.raises(InvalidRequest, match="view"):
            t.longest_prefix(prompt, i32(5), view=view)
    with pytest.raises(InvalidRequest, match="view"):
        t.seek(t.insert(own, i32(1))[0], i32(1), view=a)
    # A view's root walks in its own view; the shared root in a view stands for the view's root.
    assert t.seek(shared, i32(*SYSTEM[:3]), view=a)[1] == 3 and t.seek(shared, i32(9), view=a) == (a, 0)


def test_the_shared_path_grows_only_where_the_view_has_nothing_of_its_own(Trie):
    t = Trie()
    shared = t.new_shared_root()
    a, b = t.new_view(shared), t.new_view(shared)
    # Prompt turns one after another extend it (system prompt, then the task).
    system, _ = t.insert(a, i32(*SYSTEM))
    task, _ = t.insert(system, i32(1, 1, 1), view=a)
    assert t.insert(b, i32(*SYSTEM, 1, 1, 1))[0] == task and t.stats()["shared_tokens"] == 43
    # After a sample there, a prompt at the same place is the view's own.
    t.insert(task, i32(7), f32(-1), i32(0), kind=S, view=a)
    mine, _ = t.insert(task, i32(2, 2), view=a)
    theirs, _ = t.insert(task, i32(2, 2), view=b)
    assert mine != theirs and t.refs(theirs) == 1 and t.stats()["shared_tokens"] == 45
    assert t.holds(b, theirs) and not t.holds(a, theirs) and t.holds(a, mine) and not t.holds(b, mine)
    # A branch inside a view's own shared path is its own too (and splits the shared edge).
    branch, matched = t.insert(a, i32(*SYSTEM[:10], 4))
    assert matched == 10 and t.refs(branch) == 1 and t.refs(t.parent(branch)) == 2
    assert t.depth(t.parent(branch)) == 10 and t.stats()["shared_tokens"] == 45
    # Diverging inside a shared edge from a view's anchor is shared: b's anchor moves there.
    c = t.new_view(shared)
    other, _ = t.insert(c, i32(*SYSTEM[:20], 6, 6))
    assert t.refs(other) == 1 and t.refs(t.parent(other)) == 3 and t.stats()["shared_tokens"] == 47
    assert [exported(t, h)[0] for h in t.leaves(a)] == [SYSTEM + [1, 1, 1, 7], SYSTEM + [1, 1, 1, 2, 2],
                                                        SYSTEM[:10] + [4]]
    assert t.leaves(c) == [other]


def test_dropping_a_view_frees_only_what_no_other_view_holds(Trie):
    t = Trie()
    shared = t.new_shared_root()
    a, b = t.new_view(shared), t.new_view(shared)
    end_a, _ = t.insert(a, i32(*SYSTEM, 1, 1))
    end_b, _ = t.insert(b, i32(*SYSTEM, 2, 2))
    tail, _ = t.insert(end_a, i32(3, 3), f32(-1, -1), i32(0, 0), kind=S, view=a)
    t.insert(end_b, i32(3, 3), f32(-2, -2), i32(1, 1), kind=S, view=b)
    with pytest.raises(InvalidRequest, match="shared"):
        t.prune(end_a)
    with pytest.raises(InvalidRequest, match="shared"):
        t.prune(shared)
    with pytest.raises(InvalidRequest, match="shared"):
        t.leaves(end_a)
    before = exported(t, t.leaves(b)[0])
    assert t.prune(a) == 2 + 2 and t.live_tokens == 44 and t.stats()["views"] == 1
    assert not t.is_live(a) and not t.is_live(tail) and not t.is_live(end_a)
    assert exported(t, t.leaves(b)[0]) == before and t.refs(shared) == 1
    # Pruning a view's private subtree keeps the view; its attachment goes with its last child.
    nodes = t.node_count
    t.prune(t.leaves(b)[0])
    assert t.leaves(b) == [end_b] and t.node_count == nodes - 2
    # The shared root goes with its last view.
    assert t.prune(b) == 42 and not t.is_live(shared) and t.live_tokens == 0 and t.node_count == 0
    assert t.stats()["roots"] == t.stats()["shared_tokens"] == 0
    lone = t.new_shared_root()
    assert t.prune(lone) == 0 and t.root_count == 0
    with pytest.raises(InvalidRequest, match="shared root"):
        t.new_view(t.new_root())


def test_memory_bound_counts_a_shared_prompt_once(Trie):
    prompt = np.arange(1000, dtype=np.int32)
    t = Trie(max_bytes=40_000 if Trie is ref_trie.TokenTrie else 300_000)
    shared = t.new_shared_root()
    views = []
    for _ in range(50):  # 50 private copies of the prompt would hold 600 kB of data
        views.append(t.new_view(shared))
        t.insert(views[-1], prompt)
    assert t.live_tokens == 1000 and t.memory_bytes <= t.max_bytes
    # A refused store changes nothing, shared or private, and names the tokens it refused.
    before = (t.stats(), [t.leaves(v) for v in views])
    for at, kwargs in ((views[0], {}), (views[1], {"kind": E})):
        with pytest.raises(TraceMemoryExceeded):
            t.insert(at, np.concatenate([prompt[:500], np.arange(5000, 5000 + 40_000, dtype=np.int32)]), **kwargs)
    assert (t.stats(), [t.leaves(v) for v in views]) == before


def test_many_sessions_branch_at_one_shared_node(Trie):
    """A child per session under the system prompt's end (the shared children's index in C):
    every prompt is found again while some session holds it, and is gone with the last."""
    n = 3000 if Trie is c_trie.TokenTrie else 300
    rng = np.random.default_rng(4)
    t = Trie()
    shared = t.new_shared_root()
    prompts = [i32(*SYSTEM, *rng.integers(0, 50, 3).tolist(), i) for i in range(n)]  # some share a few tokens more
    views = {}
    for i, p in enumerate(prompts):
        views[i] = t.new_view(shared)
        t.insert(views[i], p)
    assert t.live_tokens == t.stats()["shared_tokens"] <= len(SYSTEM) + 4 * n
    order = rng.permutation(n)
    for i in order[: n // 2]:
        t.prune(views.pop(int(i)))
    held = t.live_tokens
    for i, p in enumerate(prompts):  # taking a prompt up stores only what no session holds
        v = t.new_view(shared)
        end, _ = t.insert(v, p)
        assert exported(t, end)[0] == p.tolist()
        assert (t.live_tokens == held) == (i in views), i
        t.prune(v)
        assert t.live_tokens == held
    for v in views.values():
        t.prune(v)
    assert t.live_tokens == 0 and t.node_count == 0


def test_c_compaction_and_drop_keep_every_view_exact():
    t = c_trie.TokenTrie()
    empty = t.memory_bytes
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 800, dtype=np.int32)
    shared = t.new_shared_root()
    views, want = [], {}
    for g in range(20):
        group = np.concatenate([system, rng.integers(0, 1000, 200, dtype=np.int32)])
        for _ in range(4):
            v = t.new_view(shared)
            end, _ = t.insert(v, group)
            n = int(rng.integers(1000, 4000))
            leaf, _ = t.insert(end, rng.integers(0, 1000, n, dtype=np.int32), -rng.random(n, dtype=np.float32),
                               rng.integers(0, 9, n, dtype=np.int32), kind=S, view=v)
            views.append(v)
            want[v] = (leaf, t.export_path(leaf))
    assert t.stats()["shared_tokens"] == 800 + 20 * 200
    for v in views[::3] + views[1:60:3]:
        t.prune(v)
        del want[v]
    after = t.stats()
    assert after["garbage_tokens"] <= after["live_tokens"]
    t.compact()
    assert t.stats()["garbage_tokens"] == 0
    for v, (leaf, data) in want.items():
        assert t.leaves(v) == [leaf] and t.export_path(leaf) == data
    for v in want:
        t.prune(v)
    assert t.live_tokens == 0 and t.memory_bytes == empty and not t.is_live(shared)


# -- property: a view answers as a tree of its own ------------------------------------------------

OPS = st.lists(st.tuples(
    st.integers(0, 3),  # which session
    st.integers(0, 10**6),  # which of its positions
    st.lists(st.integers(0, 2), max_size=8),  # tokens
    st.sampled_from(["prompt", "prompt", "sampled", "environment", "drop"]),
), max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_views_answer_exactly_as_own_trees(Trie, ops):
    """The same calls on views of one shared tree and on own trees (the C trie) give the
    same matches, exports, segments and leaves in the same order; the views hold no more."""
    t, own = Trie(), c_trie.TokenTrie()
    shared = t.new_shared_root()
    sessions: dict[int, tuple[int, int, list[tuple[int, int]]]] = {}
    for k, i, tokens, kind in ops:
        if kind == "drop":
            if k in sessions:
                v, root, _ = sessions.pop(k)
                t.prune(v)
                own.prune(root)
            continue
        if k not in sessions:
            if not t.is_live(shared):
                shared = t.new_shared_root()
            v, root = t.new_view(shared), own.new_root()
            sessions[k] = (v, root, [(v, root)])
        v, root, positions = sessions[k]
        at, at_own = positions[i % len(positions)]
        n = len(tokens)
        args = (f32(*[-0.5] * n), i32(*[k] * n)) if kind == "sampled" else (None, None)
        code = {"prompt": P, "sampled": S, "environment": E}[kind]
        h, matched = t.insert(at, i32(*tokens), *args, kind=code, request_id=-1 if kind != "sampled" else k, view=v)
        h_own, matched_own = own.insert(at_own, i32(*tokens), *args, kind=code,
                                        request_id=-1 if kind != "sampled" else k)
        assert matched == matched_own and exported(t, h) == exported(own, h_own)
        assert t.path_segments(h) == own.path_segments(h_own) and t.depth(h) == own.depth(h_own)
        positions.append((h, h_own))
        probe = i32(*tokens, *tokens)
        assert t.longest_prefix(v, probe) == own.longest_prefix(root, probe)
        for v2, root2, _ in sessions.values():
            assert [exported(t, x) for x in t.leaves(v2)] == [exported(own, x) for x in own.leaves(root2)]
    assert t.live_tokens <= own.live_tokens
    for v, root, _ in sessions.values():
        t.prune(v)
    assert t.live_tokens == 0 and t.stats()["shared_tokens"] == 0


# -- differential: C vs reference vs a dictionary oracle, with sharing ----------------------------

TOKENS = st.lists(st.integers(0, 3), max_size=12)
PROMPTS = ([0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 3, 3, 2, 2, 1, 0])


class Oracle:
    """Every stored token of every view keyed by its path (view id, t0, ..., ti)."""

    def __init__(self) -> None:
        self.data: dict[tuple, tuple[float, int, int, int]] = {}

    def matched(self, prefix: tuple, tokens: list[int]) -> int:
        k = 0
        while k < len(tokens) and prefix + tuple(tokens[:k + 1]) in self.data:
            k += 1
        return k

    def insert(self, prefix, tokens, logprobs, versions, kind, rid) -> int:
        k = self.matched(prefix, tokens)
        for i in range(k, len(tokens)):
            self.data[prefix + tuple(tokens[:i + 1])] = (logprobs[i], versions[i], kind, rid)
        return k

    def export(self, prefix):
        rows = [self.data[prefix[:i + 1]] for i in range(1, len(prefix))]
        return (list(prefix[1:]), [r[0] for r in rows], [r[1] for r in rows], [int(r[2] == S) for r in rows])

    def leaves(self, view_id) -> set[tuple]:
        keys = {k for k in self.data if k[0] == view_id}
        return {k[1:] for k in keys - {k[:-1] for k in keys}}

    def drop(self, head: tuple) -> None:
        for k in [k for k in self.data if k[:len(head)] == head]:
            del self.data[k]


class SharedTrieMachine(RuleBasedStateMachine):
    """Views of two shared trees: insert / seek / export / leaves / drop a view / prune a
    private subtree / compact, on both tries, each view held to the oracle."""

    def __init__(self):
        super().__init__()
        self.c, self.r, self.oracle = c_trie.TokenTrie(), ref_trie.TokenTrie(), Oracle()
        self.shared = [(self.c.new_shared_root(), self.r.new_shared_root()) for _ in range(2)]
        self.views: list[tuple[int, int]] = []
        self.positions: list[tuple[int, int, int, tuple]] = []  # (c, ref, view index, (view index, *path))

    @rule(which=st.sampled_from([0, 0, 0, 1]))
    def new_view(self, which):
        c_root, r_root = self.shared[which]
        if not self.c.is_live(c_root):
            assert not self.r.is_live(r_root)
            c_root, r_root = self.shared[which] = (self.c.new_shared_root(), self.r.new_shared_root())
        self.views.append((self.c.new_view(c_root), self.r.new_view(r_root)))
        v = len(self.views) - 1
        self.positions.append((*self.views[v], v, (v,)))

    def _pick(self, i):
        if not self.positions:
            self.new_view(0)
        return self.positions[i % len(self.positions)]

    def _live(self, position) -> bool:
        """A position is one while its view lives and its node does (a shared node outlives a view)."""
        ch, rh, v, _ = position
        live = self.r.is_live(self.views[v][1]) and self.r.is_live(rh)
        assert live == (self.c.is_live(self.views[v][0]) and self.c.is_live(ch))
        return live

    @rule(i=st.integers(0, 10**6), tokens=TOKENS, kind=st.sampled_from([P, S, E]), rid=st.sampled_from([-1, 2]),
          lp=st.sampled_from([None, 0.0, -0.0, -1.5]))
    def insert(self, i, tokens, kind, rid, lp):
        self._insert(self._pick(i), tokens, kind, rid, lp)

    @rule(i=st.integers(0, 10**6), at_root=st.booleans(), which=st.integers(0, 1), cut=st.integers(0, 8),
          tail=st.lists(st.integers(0, 3), max_size=3))
    def insert_prompt(self, i, at_root, which, cut, tail):
        """A shareable prompt, often from a view's root, drawn from two common ones: views share and split them."""
        position = self._pick(i)
        if at_root:
            v = i % len(self.views)
            position = (*self.views[v], v, (v,))
        self._insert(position, PROMPTS[which][:cut] + tail, P, -1, None)

    def _insert(self, position, tokens, kind, rid, lp):
        ch, rh, v, prefix = position
        n = len(tokens)
        if kind == S:
            lps, args = [-1.5] * n, (f32(*[-1.5] * n), i32(*[v] * n))
        elif lp is None:
            lps, args = [0.0] * n, (None, None)
        else:  # -0.0 is not the default: stored as given, never shared
            lps, args = [lp] * n, (f32(*[lp] * n), None)
        vers = [v] * n if kind == S else [-1] * n
        cv, rv = self.views[v]
        if not self._live(position):
            for t, h, view in ((self.c, ch, cv), (self.r, rh, rv)):
                with pytest.raises(InvalidRequest):
                    t.insert(h, i32(*tokens), *args, kind=kind, request_id=rid, view=view)
            return
        c_out = self.c.insert(ch, i32(*tokens), *args, kind=kind, request_id=rid, view=cv)
        r_out = self.r.insert(rh, i32(*tokens), *args, kind=kind, request_id=rid, view=rv)
        expected = self.oracle.insert(prefix, tokens, lps, vers, kind, rid)
        assert c_out[1] == r_out[1] == expected
        assert self.c.refs(c_out[0]) == self.r.refs(r_out[0])
        assert self.c.export_path(c_out[0]) == self.r.export_path(r_out[0])
        self.positions.append((c_out[0], r_out[0], v, prefix + tuple(tokens)))

    @rule(i=st.integers(0, 10**6), tokens=TOKENS)
    def seek(self, i, tokens):
        ch, rh, v, prefix = position = self._pick(i)
        if not self._live(position):
            return
        cv, rv = self.views[v]
        expected = self.oracle.matched(prefix, tokens)
        assert self.c.longest_prefix(ch, i32(*tokens), view=cv) == expected
        (c_h, c_m), (r_h, r_m) = self.c.seek(ch, i32(*tokens), view=cv), self.r.seek(rh, i32(*tokens), view=rv)
        assert c_m == r_m == expected
        self.positions.append((c_h, r_h, v, prefix + tuple(tokens[:expected])))

    @rule(i=st.integers(0, 10**6))
    def export(self, i):
        ch, rh, _, prefix = position = self._pick(i)
        if not self._live(position):
            return
        assert self.c.export_path(ch) == self.r.export_path(rh)
        assert exported(self.c, ch) == self.oracle.export(prefix)
        assert self.c.path_segments(ch) == self.r.path_segments(rh)
        assert self.c.depth(ch) == self.r.depth(rh) == len(prefix) - 1

    @rule(i=st.integers(0, 10**6))
    def leaves(self, i):
        if not self.views:
            return
        v = i % len(self.views)
        cv, rv = self.views[v]
        if not self.r.is_live(rv):
            return
        c_paths = [self.c.export_path(h) for h in self.c.leaves(cv)]
        assert c_paths == [self.r.export_path(h) for h in self.r.leaves(rv)]
        assert {tuple(np.frombuffer(p[0], np.int32).tolist()) for p in c_paths} == self.oracle.leaves(v)

    @rule(i=st.integers(0, 10**6))
    def drop_view(self, i):
        if not self.views:
            return
        v = i % len(self.views)
        cv, rv = self.views[v]
        if not self.r.is_live(rv):
            return
        before = self.r.live_tokens
        own = sum(1 for k in self.oracle.data if k[0] == v)
        freed = self.c.prune(cv)
        assert freed == self.r.prune(rv) <= own and self.r.live_tokens == before - freed
        self.oracle.drop((v,))

    @rule(i=st.integers(0, 10**6))
    def prune(self, i):
        ch, rh, _, prefix = position = self._pick(i)
        if not self._live(position) or len(prefix) == 1:  # a view's root: drop_view's
            return
        start = self.r.depth(self.r.parent(rh))  # the pruned edge starts there
        assert self.c.depth(self.c.parent(ch)) == start
        try:
            freed = self.r.prune(rh)
        except InvalidRequest:
            with pytest.raises(InvalidRequest, match="shared"):
                self.c.prune(ch)
            return
        assert self.c.prune(ch) == freed
        head = prefix[:start + 2]
        gone = [k for k in self.oracle.data if k[:len(head)] == head]
        assert len(gone) == freed  # a private subtree: held by this view alone
        for k in gone:
            del self.oracle.data[k]

    @rule()
    def compact(self):
        self.c.compact()

    @invariant()
    def agree(self):
        for key in ("live_tokens", "live_nodes", "roots", "views", "shared_tokens"):
            assert self.c.stats()[key] == self.r.stats()[key], key
        for ch, rh, _, _ in self.positions:
            assert self.c.is_live(ch) == self.r.is_live(rh)
        assert self.c.live_tokens <= len(self.oracle.data)


TestSharedTrieMachine = SharedTrieMachine.TestCase
TestSharedTrieMachine.settings = settings(max_examples=400, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
