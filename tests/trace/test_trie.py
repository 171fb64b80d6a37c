"""Tests of the token trie (rlengine.trace.trie): the compiled trie and the
pure-Python reference, run through one suite, plus a hypothesis state
machine that drives both side by side against a dictionary oracle.

What this file must not do: test one implementation against itself, or
skip the compiled one when it is missing (a missing extension is a failure).
"""

from __future__ import annotations

import ctypes
import enum
import gc
import importlib.util
import os
import subprocess
import sys
import tracemalloc
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import rlengine.trace._trie as c_trie
import rlengine.trace._trie_ref as ref_trie
from rlengine.errors import InvalidRequest, RLEngineError
from rlengine.trace.errors import TraceMemoryExceeded

ROOT = Path(__file__).resolve().parents[2]

P, S, E = c_trie.KIND_PROMPT, c_trie.KIND_SAMPLED, c_trie.KIND_ENVIRONMENT
IMPLS = [pytest.param(c_trie.TokenTrie, id="c"), pytest.param(ref_trie.TokenTrie, id="reference")]


@pytest.fixture(params=IMPLS)
def Trie(request):
    return request.param


def i32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def f32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def path(trie, h) -> list[int]:
    return np.frombuffer(trie.path_tokens(h), dtype=np.int32).tolist()


def exported(trie, h):
    t, lp, v, m = trie.export_path(h)
    return (np.frombuffer(t, np.int32).tolist(), np.frombuffer(lp, np.float32).tolist(),
            np.frombuffer(v, np.int32).tolist(), np.frombuffer(m, np.uint8).tolist())


def test_kind_constants_agree():
    assert (c_trie.KIND_PROMPT, c_trie.KIND_SAMPLED, c_trie.KIND_ENVIRONMENT) == (
        ref_trie.KIND_PROMPT, ref_trie.KIND_SAMPLED, ref_trie.KIND_ENVIRONMENT) == (0, 1, 2)


# -- edge cases --------------------------------------------------------------------------------


def test_empty_input_changes_nothing(Trie):
    t = Trie()
    root = t.new_root()
    assert t.insert(root, i32()) == (root, 0)
    assert t.longest_prefix(root, b"") == 0
    assert t.seek(root, []) == (root, 0)
    assert t.live_tokens == 0 and t.node_count == 1
    assert t.leaves(root) == [] and t.path_tokens(root) == b"" and t.path_segments(root) == []


def test_one_token(Trie):
    t = Trie()
    root = t.new_root()
    h, matched = t.insert(root, i32(7), f32(-0.5), i32(3), kind=S, request_id=11)
    assert matched == 0 and t.depth(h) == 1 and t.parent(h) == root and t.root_of(h) == root
    assert exported(t, h) == ([7], [-0.5], [3], [1])
    assert t.path_segments(h) == [(0, 1, S, 11)]
    assert t.longest_prefix(root, i32(7, 8)) == 1 and t.longest_prefix(root, i32(8)) == 0
    assert t.leaves(root) == [h] and t.leaves(h) == [h]


def test_split_inside_an_edge_keeps_data_and_old_handles(Trie):
    t = Trie()
    root = t.new_root()
    a, _ = t.insert(root, i32(1, 2, 3, 4, 5), f32(-1, -2, -3, -4, -5), i32(0, 0, 1, 1, 1), kind=S, request_id=1)
    b, matched = t.insert(root, i32(1, 2, 9), kind=E)
    assert matched == 2 and t.node_count == 4  # root, [1 2], [3 4 5], [9]
    assert exported(t, a) == ([1, 2, 3, 4, 5], [-1, -2, -3, -4, -5], [0, 0, 1, 1, 1], [1] * 5)
    assert exported(t, b) == ([1, 2, 9], [-1, -2, 0], [0, 0, -1], [1, 1, 0])
    upper = t.parent(a)
    assert t.parent(b) == upper and t.depth(upper) == 2 and path(t, upper) == [1, 2]
    # A segment split over two nodes is still one run.
    assert t.path_segments(a) == [(0, 5, S, 1)]
    assert t.path_segments(b) == [(0, 2, S, 1), (2, 3, E, -1)]
    # A mark inside the lower edge splits again; a still names the same position.
    m, matched = t.seek(root, i32(1, 2, 3, 4, 7))
    assert matched == 4 and path(t, m) == [1, 2, 3, 4] and t.parent(a) == m and path(t, a) == [1, 2, 3, 4, 5]
    assert t.live_tokens == 6


def test_identical_reinsert_keeps_the_first_data(Trie):
    t = Trie()
    root = t.new_root()
    h, _ = t.insert(root, i32(4, 5, 6), f32(-1, -1, -1), i32(2, 2, 2), kind=S, request_id=5)
    nodes, tokens = t.node_count, t.live_tokens
    again, matched = t.insert(root, i32(4, 5, 6), f32(-9, -9, -9), i32(8, 8, 8), kind=S, request_id=6)
    assert (again, matched) == (h, 3) and (t.node_count, t.live_tokens) == (nodes, tokens)
    assert exported(t, h)[1:3] == ([-1, -1, -1], [2, 2, 2])
    # Only the unstored suffix is validated: junk over the stored prefix is fine.
    h2, matched = t.insert(root, i32(4, 5, 6, 7), f32(5, np.nan, 3, -2), i32(-1, -1, -1, 4), kind=S)
    assert matched == 3 and exported(t, h2)[1:3] == ([-1, -1, -1, -2], [2, 2, 2, 4])


def test_handle_based_append_equals_full_resend(Trie):
    turns = [i32(*range(i * 10, i * 10 + 5)) for i in range(4)]
    by_handle, by_resend = Trie(), Trie()
    r1, r2 = by_handle.new_root(), by_resend.new_root()
    h = r1
    for k, turn in enumerate(turns):
        h, matched = by_handle.insert(h, turn)
        assert matched == 0
        h2, matched = by_resend.insert(r2, np.concatenate(turns[:k + 1]))
        assert matched == 5 * k
    assert by_handle.path_tokens(h) == by_resend.path_tokens(h2)
    assert (by_handle.node_count, by_handle.live_tokens) == (by_resend.node_count, by_resend.live_tokens)


def test_branches_diverging_at_position_zero(Trie):
    t = Trie()
    root = t.new_root()
    hs = [t.insert(root, i32(first, 1, 2))[0] for first in (5, 3, 9)]
    assert t.leaves(root) == hs  # creation order, not token order
    assert [t.longest_prefix(root, i32(x, 1, 2, 3)) for x in (3, 5, 9, 4)] == [3, 3, 3, 0]
    assert t.prune(hs[1]) == 3
    assert t.leaves(root) == [hs[0], hs[2]] and not t.is_live(hs[1])


def test_very_long_single_sequence(Trie):
    n = 1_000_000 if Trie is c_trie.TokenTrie else 200_000
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, n, dtype=np.int32)
    logprobs = -rng.random(n, dtype=np.float32)
    versions = rng.integers(0, 7, n, dtype=np.int32)
    t = Trie()
    root = t.new_root()
    h, _ = t.insert(root, tokens, logprobs, versions, kind=S)
    assert t.longest_prefix(root, tokens) == n
    probe = tokens.copy()
    probe[n - 3] += 1
    assert t.longest_prefix(root, probe) == n - 3
    tb, lb, vb, mb = t.export_path(h)
    assert tb == tokens.tobytes() and lb == logprobs.tobytes() and vb == versions.tobytes() and mb == b"\1" * n
    assert t.prune(root) == n and t.live_tokens == 0


def test_prune_frees_the_subtree_and_stale_handles_are_refused(Trie):
    t = Trie()
    root = t.new_root()
    a, _ = t.insert(root, i32(1, 2, 3))
    b, _ = t.insert(a, i32(4, 5))
    c, _ = t.insert(a, i32(6))
    other, _ = t.insert(root, i32(8))
    assert t.prune(a) == 6  # [1 2 3], [4 5], [6]
    for stale in (a, b, c):
        assert not t.is_live(stale)
        with pytest.raises(InvalidRequest):
            t.depth(stale)
        with pytest.raises(InvalidRequest):
            t.insert(stale, i32(1))
    assert t.leaves(root) == [other] and t.live_tokens == 1
    # Slots are reused, generations differ: the old handles stay dead.
    fresh = [t.insert(root, i32(20 + i))[0] for i in range(3)]
    assert all(not t.is_live(s) for s in (a, b, c)) and all(t.is_live(f) for f in fresh)
    assert t.prune(root) == 4 and t.root_count == 0 and not t.is_live(other)


def test_handles_of_an_emptied_trie_stay_dead(Trie):
    t = Trie()
    root = t.new_root()
    h, _ = t.insert(root, i32(1, 2))
    t.prune(root)
    root2 = t.new_root()
    h2, _ = t.insert(root2, i32(1, 2))
    assert not t.is_live(root) and not t.is_live(h) and t.is_live(h2)
    with pytest.raises(InvalidRequest):
        t.path_tokens(h)


def test_sampled_segments_need_logprobs_and_versions(Trie):
    t = Trie()
    root = t.new_root()
    with pytest.raises(InvalidRequest, match="logprobs"):
        t.insert(root, i32(1), versions=i32(0), kind=S)
    with pytest.raises(InvalidRequest, match="versions"):
        t.insert(root, i32(1), logprobs=f32(0), kind=S)
    with pytest.raises(InvalidRequest, match=r"versions\[1\]"):
        t.insert(root, i32(1, 2), f32(0, 0), i32(0, -1), kind=S)
    with pytest.raises(InvalidRequest, match=r"versions\[0\]"):
        t.insert(root, i32(1), versions=i32(0), kind=E)
    for bad in (np.nan, 0.5):
        with pytest.raises(InvalidRequest, match=r"logprobs\[0\]"):
            t.insert(root, i32(1), f32(bad), i32(0), kind=S)
    assert t.live_tokens == 0 and t.node_count == 1
    h, _ = t.insert(root, i32(1), f32(-np.inf), i32(0), kind=S)
    assert exported(t, h)[1] == [-np.inf]


def test_accepted_buffer_types(Trie):
    t = Trie()
    root = t.new_root()
    want = i32(3, 1, 4, 1, 5)
    raw = want.tobytes()
    misaligned = memoryview(b"\0" + raw)[1:]
    for tokens in (want, array("i", want.tolist()), raw, bytearray(raw), memoryview(raw), misaligned,
                   want.tolist(), tuple(want.tolist()), memoryview(want)):
        assert t.longest_prefix(root, tokens) == t.live_tokens  # 0 first, then all 5
        h, _ = t.insert(root, tokens, list(map(float, -want)), array("i", [-1] * 5))
        assert path(t, h) == want.tolist() and t.live_tokens == 5


# -- bad input ---------------------------------------------------------------------------------

BAD_TOKENS = [
    pytest.param(np.arange(4, dtype=np.int64), id="int64"),
    pytest.param(np.arange(4, dtype=np.uint32), id="uint32"),
    pytest.param(np.arange(4, dtype=np.int16), id="int16"),
    pytest.param(np.arange(4, dtype=">i4"), id="big-endian-int32"),
    pytest.param(np.arange(4, dtype=np.uint8), id="uint8-array-is-not-raw-bytes"),
    pytest.param(np.arange(4, dtype=np.float32), id="float32"),
    pytest.param(np.arange(8, dtype=np.int32)[::2], id="non-contiguous"),
    pytest.param(np.arange(8, dtype=np.int32).reshape(2, 4), id="2-d"),
    pytest.param(np.int32(5), id="0-d"),
    pytest.param(i32(1, -2, 3), id="negative-id"),
    pytest.param(b"\1\0\0", id="bytes-not-multiple-of-4"),
    pytest.param("1 2 3", id="str"),
    pytest.param(None, id="none"),
    pytest.param([1, 2**31], id="list-overflow"),
    pytest.param([1, 2.5], id="list-of-floats"),
    pytest.param(array("q", [1, 2]), id="array-q"),
]


def _set(a: np.ndarray, i: int, value) -> None:
    a[i] = value


@pytest.mark.parametrize("room", [False, True], ids=["trie-must-grow", "room-in-block"])
@pytest.mark.parametrize("kind, field, where, patch", [
    (S, "tokens", 0.73, lambda t, lp, v, i: _set(t, i, -5)),
    (S, "tokens", 1.0, lambda t, lp, v, i: (_set(t, i, -1), _set(lp, 3, np.nan))),  # tokens are named first
    (S, "logprobs", 0.41, lambda t, lp, v, i: _set(lp, i, np.nan)),
    (S, "logprobs", 0.0, lambda t, lp, v, i: _set(lp, i, 1e-30)),
    (S, "versions", 0.98, lambda t, lp, v, i: _set(v, i, -1)),
    (P, "versions", 0.17, lambda t, lp, v, i: _set(v, i, 0)),
    (E, "versions", 1.0, lambda t, lp, v, i: _set(v, i, -2)),
])
def test_bad_values_of_a_new_suffix_are_named_and_change_nothing(Trie, room, kind, field, where, patch):
    """Values are checked as they are copied when the trie has room (one pass),
    on their own when it must grow first: the same error, nothing stored, and
    the next valid insert stores exactly its own data."""
    t = Trie()
    root = t.new_root()
    prefix = i32(1, 2, 3)
    h0, _ = t.insert(root, prefix)
    new = 100
    if Trie is c_trie.TokenTrie:  # the C trie's data blocks (the reference has none)

        def free_slots() -> int:
            st = t.stats()
            return st["arena_capacity"] - st["live_tokens"] - st["garbage_tokens"]

        if room:
            new = min(new, free_slots())  # the sanitizer build's blocks are small
        else:  # fill the current block: the new tokens then need a new one
            t.insert(t.new_root(), np.full(free_slots(), 7, np.int32))
        assert new >= 50 and (free_slots() >= new) == room
    tokens = np.concatenate([prefix, np.arange(10, 10 + new, dtype=np.int32)])
    logprobs = np.concatenate([np.zeros(3, np.float32), -np.linspace(0, 5, new, dtype=np.float32)])
    versions = np.concatenate([np.full(3, -1, np.int32), np.full(new, 4 if kind == S else -1, np.int32)])
    bad_t, bad_lp, bad_v = tokens.copy(), logprobs.copy(), versions.copy()
    index = round(where * (new - 1))
    patch(bad_t[3:], bad_lp[3:], bad_v[3:], index)
    before = (t.stats(), exported(t, h0))
    with pytest.raises(InvalidRequest, match=rf"^{field}\[{3 + index}\]"):
        t.insert(root, bad_t, bad_lp, bad_v, kind=kind)
    assert (t.stats(), exported(t, h0)) == before
    h, reused = t.insert(root, tokens, logprobs, versions, kind=kind)
    assert reused == 3 and t.parent(h) == h0
    got = exported(t, h)
    assert got[0] == tokens.tolist() and got[1] == logprobs.tolist() and got[2] == versions.tolist()


@pytest.mark.parametrize("tokens", BAD_TOKENS)
def test_bad_tokens_raise_value_error_and_change_nothing(Trie, tokens):
    t = Trie()
    root = t.new_root()
    h, _ = t.insert(root, i32(9, 9))
    before = (t.live_tokens, t.node_count, t.path_tokens(h))
    for call in (lambda: t.insert(root, tokens), lambda: t.longest_prefix(root, tokens),
                 lambda: t.seek(root, tokens), lambda: t.insert(h, tokens, kind=E)):
        with pytest.raises(InvalidRequest) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, RLEngineError)
    assert (t.live_tokens, t.node_count, t.path_tokens(h)) == before


@pytest.mark.parametrize("logprobs, versions", [
    pytest.param(f32(0, 0), i32(1, 1, 1), id="logprobs-short"),
    pytest.param(f32(0, 0, 0, 0), i32(1, 1, 1), id="logprobs-long"),
    pytest.param(f32(0, 0, 0), i32(1, 1), id="versions-short"),
    pytest.param(np.zeros(3, np.float64), i32(1, 1, 1), id="logprobs-float64"),
    pytest.param(f32(0, 0, 0), np.ones(3, np.int64), id="versions-int64"),
    pytest.param(np.zeros(6, np.float32)[::2], i32(1, 1, 1), id="logprobs-strided"),
    pytest.param(f32(0, 0, 0), np.ones((3, 1), np.int32), id="versions-2d"),
])
def test_bad_logprobs_and_versions(Trie, logprobs, versions):
    t = Trie()
    root = t.new_root()
    with pytest.raises(InvalidRequest):
        t.insert(root, i32(1, 2, 3), logprobs, versions, kind=S)
    assert t.live_tokens == 0 and t.node_count == 1


@pytest.mark.parametrize("kwargs", [
    pytest.param({"kind": 3}, id="kind-3"), pytest.param({"kind": "sampled"}, id="kind-str"),
    pytest.param({"kind": True}, id="kind-bool"), pytest.param({"request_id": -2}, id="request-id-negative"),
    pytest.param({"request_id": "r1"}, id="request-id-str"), pytest.param({"request_id": 2**63}, id="request-id-big"),
])
def test_bad_metadata(Trie, kwargs):
    t = Trie()
    root = t.new_root()
    with pytest.raises(InvalidRequest):
        t.insert(root, i32(1), **kwargs)


def test_int_subclasses_and_bounds_are_accepted(Trie):
    """Exact ints take a fast path; int subclasses (IntEnum kinds, say) and the
    range bounds must behave the same through the general one."""

    class Handle(int):
        pass

    class Kind(enum.IntEnum):
        SAMPLED = S

    t = Trie()
    root = t.new_root()
    h, reused = t.insert(Handle(root), i32(1, 2), f32(-0.5, -0.5), i32(0, 0), Kind.SAMPLED, 2**63 - 1)
    assert reused == 0 and t.path_segments(h) == [(0, 2, S, 2**63 - 1)]
    assert t.longest_prefix(Handle(root), i32(1, 2, 3)) == 2
    h2, reused = t.insert(root, i32(1, 2, 3), kind=P, request_id=-1)
    assert reused == 2 and t.path_segments(h2)[-1] == (2, 3, P, -1)
    with pytest.raises(InvalidRequest, match="raw bytes must hold whole 4-byte items"):
        t.longest_prefix(root, b"\x01\x00\x00\x00\x02")


@pytest.mark.parametrize("handle", [-1, 2**63, 2**70, "0", 1.0, None, True, 12345])
def test_bad_handles(Trie, handle):
    t = Trie()
    t.new_root()
    assert not t.is_live(handle)
    for call in (t.depth, t.path_tokens, t.export_path, t.leaves, t.prune, t.parent, t.root_of, t.path_segments,
                 lambda h: t.insert(h, i32(1)), lambda h: t.longest_prefix(h, i32(1))):
        with pytest.raises(InvalidRequest):
            call(handle)


@pytest.mark.parametrize("max_bytes", [-1, 1.5, "1", True])
def test_bad_max_bytes(Trie, max_bytes):
    with pytest.raises(InvalidRequest):
        Trie(max_bytes)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(
    hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=2, max_side=6)),
    st.binary(max_size=13),
    st.lists(st.integers(-3, 2**32), max_size=5),
), stride=st.sampled_from([1, 2]))
def test_arbitrary_input_is_stored_or_refused_never_a_crash(data, stride):
    """Whatever arrives, both tries either accept it or raise InvalidRequest, and agree."""
    if isinstance(data, np.ndarray) and data.ndim == 1:
        data = data[::stride]
    outcomes = []
    for Trie in (c_trie.TokenTrie, ref_trie.TokenTrie):
        t = Trie()
        root = t.new_root()
        try:
            h, _ = t.insert(root, data)
            outcomes.append(t.path_tokens(h))
        except InvalidRequest:
            outcomes.append("refused")
            assert t.live_tokens == 0
    assert outcomes[0] == outcomes[1]


# -- memory ------------------------------------------------------------------------------------


def test_memory_bound_refuses_and_changes_nothing(Trie):
    t = Trie(max_bytes=64_000)
    root = t.new_root()
    handles = []
    with pytest.raises(TraceMemoryExceeded) as info:
        for i in range(1000):
            handles.append(t.insert(root, np.full(100, i, np.int32))[0])
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, RLEngineError) and err.max_bytes == 64_000
    assert 2 <= len(handles) < 1000 and t.memory_bytes <= 64_000
    stored = t.live_tokens
    assert stored == 100 * len(handles) and t.leaves(root) == handles
    t.prune(handles[0])
    more, _ = t.insert(root, np.full(100, 5000, np.int32))
    assert t.live_tokens == stored and t.memory_bytes <= 64_000 and path(t, more) == [5000] * 100


def test_c_accounting_returns_after_prune_and_compaction_keeps_data():
    t = c_trie.TokenTrie()
    empty = t.memory_bytes
    rng = np.random.default_rng(1)
    roots, convs = [], []
    for _ in range(40):
        root = t.new_root()
        conv = rng.integers(0, 1000, 5000, dtype=np.int32)
        h = root
        for chunk in np.array_split(conv, 5):
            h, _ = t.insert(h, chunk, -rng.random(len(chunk), dtype=np.float32),
                            rng.integers(0, 9, len(chunk), dtype=np.int32), kind=S)
        roots.append(root)
        convs.append((h, conv, t.export_path(h)))
    full = t.stats()
    assert full["live_tokens"] == 200_000 and full["memory_bytes"] <= 16 * 200_000
    for root in roots[::2] + roots[1:30:2]:  # 35 of 40: garbage outweighs live data
        t.prune(root)
    after = t.stats()
    # Garbage never outlives a prune that leaves it outweighing live data.
    assert after["live_tokens"] == 25_000 and after["garbage_tokens"] <= after["live_tokens"]
    assert after["memory_bytes"] < full["memory_bytes"] / 4
    for root, (h, conv, exp) in zip(roots, convs):
        if t.is_live(root):
            assert t.export_path(h) == exp and t.longest_prefix(root, conv) == 5000
    t.compact()
    # Packed, except where a block's tail was too short for the next edge (of 1,000 tokens).
    packed = t.stats()
    assert packed["garbage_tokens"] == 0
    assert 25_000 <= packed["arena_capacity"] < 25_000 + 1000 * packed["blocks"]
    for root, (h, conv, exp) in zip(roots, convs):
        if t.is_live(root):
            assert t.export_path(h) == exp
    for root in roots[31::2]:
        t.prune(root)
    assert t.stats()["live_tokens"] == 0 and t.memory_bytes == empty


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim_heap() -> None:
    """Give free heap memory back to the system (glibc's malloc_trim), if we can.

    Arrays above glibc's mmap threshold (32 MB at most) are usually mapped
    afresh and unmapped on free, but malloc serves them from a free heap
    chunk when one is large enough, and earlier tests in the same process can
    leave one behind, resident (the full suite once saw RSS grow 80 MB, not
    120, as if one of the three 40 MB arrays below had landed there).
    Trimming first makes such chunks non-resident, and trimming after the
    prune releases whatever the trie freed into the heap, so RSS then
    measures what the trie still holds.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: its allocator unmaps large blocks itself
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc")
def test_c_rss_returns_after_prune():
    tokens = np.arange(10_000_000, dtype=np.int32)  # 120 MB stored: ids, logprobs, versions
    t = c_trie.TokenTrie()
    root = t.new_root()
    _trim_heap()
    base = _rss_bytes()
    t.insert(root, tokens)
    grown = _rss_bytes()
    assert grown - base > 100e6
    t.prune(root)
    _trim_heap()
    assert _rss_bytes() - base < 8e6


def test_reference_memory_returns_after_prune():
    t = ref_trie.TokenTrie()
    root = t.new_root()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t.insert(root, np.arange(1_000_000, dtype=np.int32))
        grown = tracemalloc.get_traced_memory()[0]
        t.prune(root)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert grown - base > 10e6 and after - base < 1e6


def test_missing_extension_is_a_clear_import_error():
    code = ("import sys; sys.modules['rlengine.trace._trie'] = None\n"
            "try:\n import rlengine.trace.trie\nexcept ImportError as e:\n print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RLENGINE_NO_EXTENSIONS": "0"}).stdout
    assert "pip install -e ." in out and "RLENGINE_NO_EXTENSIONS=1" in out


@pytest.mark.parametrize("env, expected", [("1", "python-reference"), ("0", "c")])
def test_implementation_is_chosen_by_environment(env, expected):
    out = subprocess.run([sys.executable, "-c", "import rlengine.trace.trie as t; print(t.IMPLEMENTATION, t.TokenTrie)"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "RLENGINE_NO_EXTENSIONS": env}).stdout
    assert out.split()[0] == expected and ("_trie_ref" in out) == (expected == "python-reference")


def test_floor_driver_runs_the_workload_and_checks_itself(tmp_path):
    """csrc/trie_floor.c (the benchmark's memory floor) builds, and its own checks pass.

    The driver exits non-zero if any walk misses a token, a compare of the
    floor store fails, or the trie ends up holding other than every
    conversation's tokens; ``run`` then raises.
    """
    spec = importlib.util.spec_from_file_location("trie_floor", ROOT / "bench" / "trie_floor.py")
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    exe = floor.build(tmp_path)
    out = floor.run(exe, sessions=40, turns=3, system=50, task=20, new_min=5, new_max=30, vocab=1000, query=100,
                    rounds=1)
    assert out["calls"] == 40 * 3 and 0 < out["queries"] <= 40
    assert 70 + 5 <= out["tokens_per_call"] <= 70 + 3 * 30
    assert 40 * (70 + 3 * 5) <= out["stored_tokens"] <= 40 * (70 + 3 * 30)
    assert all(out[k] > 0 for k in ("insert_trie_us", "insert_floor_us", "match_trie_us", "match_floor_us",
                                    "match_query_us"))


# -- differential: C vs reference vs a dictionary oracle ---------------------------------------

TOKENS = st.lists(st.integers(0, 3), max_size=30)  # a tiny alphabet, so paths share and split often
LOGPROBS = st.sampled_from([0.0, -0.25, -1.5, -7.0])


class Oracle:
    """Every stored token keyed by its full path (root id, t0, ..., ti)."""

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

    def leaves(self, root_id) -> set[tuple]:
        keys = {k for k in self.data if k[0] == root_id}
        return {k[1:] for k in keys - {k[:-1] for k in keys}}

    def prune(self, prefix: tuple, start: int) -> None:
        """Drop the keys at or below prefix[:start + 2] (the pruned edge's first token)."""
        head = prefix[:start + 2]
        for k in [k for k in self.data if k[:len(head)] == head and len(k) >= len(head)]:
            del self.data[k]


class TrieMachine(RuleBasedStateMachine):
    """Random insert / match / seek / export / prune / compact on both tries."""

    def __init__(self):
        super().__init__()
        self.c, self.r, self.oracle = c_trie.TokenTrie(), ref_trie.TokenTrie(), Oracle()
        self.positions: list[tuple[int, int, tuple]] = []  # (c handle, ref handle, (root id, *path))
        self.roots = 0

    @rule()
    def new_root(self):
        self.positions.append((self.c.new_root(), self.r.new_root(), (self.roots,)))
        self.roots += 1

    def _pick(self, i):
        if not self.positions:
            self.new_root()
        return self.positions[i % len(self.positions)]

    @rule(i=st.integers(0, 10**6), tokens=TOKENS, kind=st.sampled_from([P, S, E]), rid=st.integers(-1, 3),
          data=st.data())
    def insert(self, i, tokens, kind, rid, data):
        ch, rh, prefix = self._pick(i)
        n = len(tokens)
        lps = data.draw(st.lists(LOGPROBS, min_size=n, max_size=n))
        vers = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) if kind == S else [-1] * n
        lp_arg, ver_arg = (f32(*lps), i32(*vers)) if kind == S or data.draw(st.booleans()) else (None, None)
        if not self.r.is_live(rh):
            for t, h in ((self.c, ch), (self.r, rh)):
                with pytest.raises(InvalidRequest):
                    t.insert(h, i32(*tokens), lp_arg, ver_arg, kind=kind, request_id=rid)
            return
        c_out = self.c.insert(ch, i32(*tokens), lp_arg, ver_arg, kind=kind, request_id=rid)
        r_out = self.r.insert(rh, i32(*tokens), lp_arg, ver_arg, kind=kind, request_id=rid)
        if lp_arg is None:
            lps = [0.0] * n
        expected = self.oracle.insert(prefix, tokens, lps, vers, kind, rid)
        assert c_out[1] == r_out[1] == expected
        self.positions.append((c_out[0], r_out[0], prefix + tuple(tokens)))

    @rule(i=st.integers(0, 10**6), tokens=TOKENS)
    def match_and_seek(self, i, tokens):
        ch, rh, prefix = self._pick(i)
        if not self.r.is_live(rh):
            return
        expected = self.oracle.matched(prefix, tokens)
        assert self.c.longest_prefix(ch, i32(*tokens)) == self.r.longest_prefix(rh, i32(*tokens)) == expected
        (c_h, c_m), (r_h, r_m) = self.c.seek(ch, i32(*tokens)), self.r.seek(rh, i32(*tokens))
        assert c_m == r_m == expected
        self.positions.append((c_h, r_h, prefix + tuple(tokens[:expected])))

    @rule(i=st.integers(0, 10**6))
    def export(self, i):
        ch, rh, prefix = self._pick(i)
        if not self.r.is_live(rh):
            for t, h in ((self.c, ch), (self.r, rh)):
                with pytest.raises(InvalidRequest):
                    t.export_path(h)
            return
        assert self.c.export_path(ch) == self.r.export_path(rh)
        assert exported(self.c, ch) == self.oracle.export(prefix)
        assert self.c.path_segments(ch) == self.r.path_segments(rh)
        assert self.c.depth(ch) == self.r.depth(rh) == len(prefix) - 1

    @rule(i=st.integers(0, 10**6))
    def leaves(self, i):
        ch, rh, prefix = self._pick(i)
        if not self.r.is_live(rh):
            return
        root_c, root_r = self.c.root_of(ch), self.r.root_of(rh)
        c_paths = [self.c.path_tokens(h) for h in self.c.leaves(root_c)]
        assert c_paths == [self.r.path_tokens(h) for h in self.r.leaves(root_r)]
        assert {tuple(np.frombuffer(p, np.int32).tolist()) for p in c_paths} == self.oracle.leaves(prefix[0])

    @rule(i=st.integers(0, 10**6))
    def prune(self, i):
        ch, rh, prefix = self._pick(i)
        if not self.r.is_live(rh):
            return
        parent = self.r.parent(rh)
        start = -1 if parent is None else self.r.depth(parent)
        assert (self.c.parent(ch) is None) == (parent is None)
        if parent is not None:
            assert self.c.depth(self.c.parent(ch)) == start
        before = self.r.live_tokens
        assert self.c.prune(ch) == self.r.prune(rh)
        if start < 0:
            head = prefix[:1]
            for k in [k for k in self.oracle.data if k[:1] == head]:
                del self.oracle.data[k]
        else:
            self.oracle.prune(prefix, start)
        assert self.r.live_tokens < before or start < 0

    @rule()
    def compact(self):
        self.c.compact()

    @invariant()
    def agree(self):
        for name in ("live_tokens", "node_count", "root_count"):
            assert getattr(self.c, name) == getattr(self.r, name), name
        assert self.c.live_tokens == len(self.oracle.data)
        for ch, rh, _ in self.positions:
            assert self.c.is_live(ch) == self.r.is_live(rh)


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=500, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
