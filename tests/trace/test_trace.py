"""Tests of the trace store (rlengine.trace): sessions, turns, branches,
export, drop and the memory bound, each run over the compiled trie and the
pure-Python reference.

What this file must not do: reach into the trie below the store except to
pick its implementation; the trie has its own tests (tests/test_trie.py).
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlengine.trace._trie as c_trie
import rlengine.trace._trie_ref as ref_trie
from rlengine.errors import InvalidRequest, RequestError
from rlengine.trace import (
    PrefixMatch,
    Segment,
    TraceMemoryExceeded,
    TraceStore,
    Trajectory,
    TurnEnd,
    UnknownSession,
)

IMPLS = [pytest.param(c_trie.TokenTrie, id="c"), pytest.param(ref_trie.TokenTrie, id="reference")]


@pytest.fixture(params=IMPLS)
def trie_class(request):
    return request.param


@pytest.fixture
def store(trie_class):
    return TraceStore(trie_class=trie_class)


def i32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def f32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def test_default_store_uses_the_chosen_trie():
    import rlengine.trace.trie

    assert rlengine.trace.trie.IMPLEMENTATION == "c"
    assert TraceStore().max_bytes == 1 << 30


def test_multi_turn_session_exports_the_exact_trace(store):
    prompt, s1, env, s2 = i32(1, 2, 3, 4), i32(50, 51, 52), i32(7, 8), i32(60, 61)
    t1 = store.append_turn("s", prompt)
    assert t1 == TurnEnd(t1.handle, 4, 0)
    t2 = store.append_turn("s", s1, f32(-0.1, -0.2, -0.3), i32(1, 1, 1), kind="sampled", request_id="r1",
                           parent=t1.handle)
    t3 = store.append_turn("s", env, kind="environment", parent=t2.handle)
    # The next prompt is the stored path, not a re-rendering.
    np.testing.assert_array_equal(store.path_tokens("s", t3.handle), np.concatenate([prompt, s1, env]))
    t4 = store.append_turn("s", s2, f32(-1, -2), i32(1, 2), kind="sampled", request_id="r2", parent=t3.handle)
    assert t4.depth == 11 and store.depth("s", t4.handle) == 11

    [traj] = store.export("s")
    assert traj.session == "s" and traj.leaf == t4.handle and traj.shared_prefix == 0 and traj.length == 11
    np.testing.assert_array_equal(traj.tokens, np.concatenate([prompt, s1, env, s2]))
    np.testing.assert_array_equal(traj.logprobs, f32(0, 0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -1, -2))
    np.testing.assert_array_equal(traj.versions, i32(-1, -1, -1, -1, 1, 1, 1, -1, -1, 1, 2))
    np.testing.assert_array_equal(traj.loss_mask, np.array([0] * 4 + [1] * 3 + [0] * 2 + [1] * 2, np.uint8))
    assert traj.segments == (
        Segment(start=0, end=4, kind="prompt"),
        Segment(start=4, end=7, kind="sampled", request_id="r1"),
        Segment(start=7, end=9, kind="environment"),
        Segment(start=9, end=11, kind="sampled", request_id="r2"),
    )
    wire = msgspec.msgpack.encode(traj)
    assert msgspec.msgpack.decode(wire, type=Trajectory) == traj


def test_full_resend_reuses_what_is_stored(store, trie_class):
    rng = np.random.default_rng(0)
    conversation = rng.integers(0, 150_000, 1000, dtype=np.int32)
    stepwise = TraceStore(trie_class=trie_class)
    h = stepwise.append_turn("s", conversation).handle
    store.append_turn("s", conversation)
    for turn in range(1, 5):
        new = rng.integers(0, 150_000, 50 * turn, dtype=np.int32)
        lps = -rng.random(len(new), dtype=np.float32)
        vers = np.full(len(new), turn, np.int32)
        # The whole conversation again, with placeholders over the stored part.
        full = np.concatenate([conversation, new])
        end = store.append_turn("s", full, np.concatenate([np.zeros(len(conversation), np.float32), lps]),
                                np.concatenate([np.full(len(conversation), -1, np.int32), vers]),
                                kind="sampled", request_id=f"r{turn}")
        assert end.reused == len(conversation) and end.depth == len(full)
        h = stepwise.append_turn("s", new, lps, vers, kind="sampled", request_id=f"r{turn}", parent=h).handle
        conversation = full
    assert store.live_tokens == stepwise.live_tokens == len(conversation)
    [a], [b] = store.export("s"), stepwise.export("s")
    assert (a.tokens_raw, a.logprobs_raw, a.versions_raw, a.loss_mask_raw, a.segments) == (
        b.tokens_raw, b.logprobs_raw, b.versions_raw, b.loss_mask_raw, b.segments)


def test_divergent_history_branches_at_the_divergence_point(store):
    prompt = i32(*range(100, 120))
    t1 = store.append_turn("s", prompt)
    t2 = store.append_turn("s", i32(5, 6, 7), f32(-1, -1, -1), i32(3, 3, 3), kind="sampled", request_id="a",
                           parent=t1.handle)
    t3 = store.append_turn("s", i32(9, 9), kind="environment", parent=t2.handle)
    first = store.path_tokens("s", t3.handle).copy()
    # The client edited the tool output: its history diverges at token 24.
    resent = np.concatenate([first[:24], i32(4, 4, 4)])
    match = store.longest_prefix("s", resent)
    assert match == PrefixMatch(24, match.handle) and store.depth("s", match.handle) == 24
    b1 = store.append_turn("s", resent[match.length:], kind="environment", parent=match.handle)
    assert b1.reused == 0 and b1.depth == 27
    b2 = store.append_turn("s", i32(70), f32(-0.5), i32(4), kind="sampled", request_id="b", parent=b1.handle)
    # The old branch is intact; the new one shares the first 24 tokens, data included.
    old, new = store.export("s")
    assert old.leaf == t3.handle and new.leaf == b2.handle and new.shared_prefix == 24
    np.testing.assert_array_equal(old.tokens, first)
    for field in ("tokens", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(old, field)[:24], getattr(new, field)[:24])
    assert new.segments[-2:] == (Segment(start=23, end=27, kind="environment"),
                                 Segment(start=27, end=28, kind="sampled", request_id="b"))
    # A history that differs from the first token branches at the root.
    other = store.longest_prefix("s", i32(1, 2, 3))
    assert other.length == 0 and other.handle == store.open("s")
    store.append_turn("s", i32(1, 2, 3), parent=other.handle)
    assert [t.shared_prefix for t in store.export("s")] == [0, 24, 0]


def test_marked_positions_are_found_on_every_path_through_them_after_splits(store):
    t1 = store.append_turn("s", i32(1, 2))
    t2 = store.append_turn("s", i32(5, 6, 7), f32(-1, -1, -1), i32(0, 0, 0), kind="sampled", parent=t1.handle)
    t3 = store.append_turn("s", i32(9), kind="environment", parent=t2.handle)
    t4 = store.append_turn("s", i32(8), f32(-1), i32(0), kind="sampled", parent=t3.handle)
    # A resent history cut inside the first completion splits its edge: the marks stay where they were.
    b1 = store.append_turn("s", i32(1, 2, 5, 4))
    b2 = store.append_turn("s", i32(3), f32(-1), i32(0), kind="sampled", parent=b1.handle)
    marked = {t2.handle, t4.handle, b2.handle}
    old, new = store.export("s")
    assert store.on_path("s", old.leaf, marked) == {t2.handle: 5, t4.handle: 7}
    assert store.on_path("s", new.leaf, marked) == {b2.handle: 5}
    assert store.on_path("s", t3.handle, marked) == {t2.handle: 5}
    assert store.on_path("s", t1.handle, marked) == {}
    with pytest.raises(InvalidRequest, match="another session"):
        store.on_path("s", store.append_turn("other", i32(1)).handle, marked)


def test_longest_prefix_from_a_parent(store):
    t1 = store.append_turn("s", i32(1, 2, 3))
    t2 = store.append_turn("s", i32(4, 5, 6), parent=t1.handle)
    assert store.longest_prefix("s", i32(4, 5, 9), parent=t1.handle).length == 2
    assert store.longest_prefix("s", i32(4, 5, 6), parent=t1.handle) == PrefixMatch(3, t2.handle)
    assert store.longest_prefix("s", i32()) == PrefixMatch(0, store.open("s"))


def test_drop_frees_memory_and_forgets_the_session(store, trie_class):
    empty = TraceStore(trie_class=trie_class).memory_bytes
    rng = np.random.default_rng(1)
    handles = {}
    for i in range(50):
        end = store.append_turn(f"s{i}", rng.integers(0, 1000, 3000, dtype=np.int32))
        handles[f"s{i}"] = store.append_turn(f"s{i}", i32(1, 2), f32(-1, -1), i32(0, 0), kind="sampled",
                                             parent=end.handle).handle
    assert len(store) == 50 and store.live_tokens == 50 * 3002
    assert store.stats()["sessions"] == 50 and sorted(store.sessions()) == sorted(handles)
    assert sum(store.drop(s) for s in list(handles)) == 50 * 3002
    assert len(store) == 0 and store.live_tokens == 0 and store.memory_bytes == empty
    assert "s0" not in store
    for call in (lambda: store.export("s0"), lambda: store.drop("s0"),
                 lambda: store.longest_prefix("s0", i32(1)), lambda: store.path_tokens("s0", handles["s0"])):
        with pytest.raises(UnknownSession) as info:
            call()
        assert isinstance(info.value, LookupError) and isinstance(info.value, RequestError)
    # Same name, new session: the old handles are dead.
    store.append_turn("s0", i32(1))
    with pytest.raises(InvalidRequest):
        store.path_tokens("s0", handles["s0"])


def test_handles_do_not_cross_sessions(store):
    a = store.append_turn("a", i32(1, 2))
    store.append_turn("b", i32(1, 2))
    with pytest.raises(InvalidRequest, match="another session"):
        store.append_turn("b", i32(3), parent=a.handle)
    with pytest.raises(InvalidRequest, match="another session"):
        store.path_tokens("b", a.handle)
    with pytest.raises(UnknownSession):
        store.append_turn("c", i32(3), parent=a.handle)


def test_memory_bound_is_a_typed_error_and_stores_nothing(trie_class):
    store = TraceStore(max_bytes=300_000, trie_class=trie_class)
    rng = np.random.default_rng(2)
    with pytest.raises(TraceMemoryExceeded) as info:
        for i in range(100):
            store.append_turn(f"s{i}", rng.integers(0, 1000, 2000, dtype=np.int32))
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, RequestError) and err.max_bytes == 300_000
    assert "max_bytes=300000" in str(err)
    full = store.live_tokens
    assert full % 2000 == 0 and store.memory_bytes <= 300_000
    store.drop("s0")
    store.append_turn("again", rng.integers(0, 1000, 2000, dtype=np.int32))
    assert store.live_tokens == full and store.memory_bytes <= 300_000


@pytest.mark.parametrize("call, error", [
    pytest.param(lambda s: s.append_turn("s", i32(1), kind="bogus"), InvalidRequest, id="kind"),
    pytest.param(lambda s: s.append_turn("s", i32(1), request_id=5), InvalidRequest, id="request-id"),
    pytest.param(lambda s: s.append_turn(5, i32(1)), InvalidRequest, id="session-not-str"),
    pytest.param(lambda s: s.append_turn("s", np.arange(3)), InvalidRequest, id="tokens-int64"),
    pytest.param(lambda s: s.append_turn("s", i32(1, -1)), InvalidRequest, id="negative-token"),
    pytest.param(lambda s: s.append_turn("s", i32(1), kind="sampled"), InvalidRequest, id="sampled-no-logprobs"),
    pytest.param(lambda s: s.append_turn("s", i32(1, 2), f32(-1), i32(0, 0), kind="sampled"), InvalidRequest,
                 id="logprobs-length"),
    pytest.param(lambda s: s.append_turn("s", i32(1), parent=10**6), InvalidRequest, id="parent-unknown"),
    pytest.param(lambda s: s.longest_prefix("nobody", i32(1)), UnknownSession, id="unknown-session"),
    pytest.param(lambda s: TraceStore(max_bytes=-1), InvalidRequest, id="max-bytes"),
])
def test_bad_arguments(store, call, error):
    store.append_turn("s", i32(9))
    before = store.live_tokens
    with pytest.raises(error):
        call(store)
    assert store.live_tokens == before


CONVERSATIONS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations=CONVERSATIONS)
def test_export_is_every_conversation_not_extended_by_another(trie_class, conversations):
    """Stored by match-then-append, a session exports exactly its maximal conversations."""
    store = TraceStore(trie_class=trie_class)
    for conv in conversations:
        tokens = i32(*conv)
        match = store.longest_prefix("s", tokens) if "s" in store else PrefixMatch(0, store.open("s"))
        end = store.append_turn("s", tokens[match.length:], parent=match.handle)
        assert end.depth == len(conv)
    distinct = {tuple(c) for c in conversations}
    maximal = {c for c in distinct if not any(len(o) > len(c) and o[:len(c)] == c for o in distinct)}
    exported = store.export("s")
    assert sorted(tuple(t.tokens.tolist()) for t in exported) == sorted(maximal)
    for prev, cur in itertools.pairwise(exported):
        a, b = prev.tokens.tolist(), cur.tokens.tolist()
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert cur.shared_prefix == common
    assert store.live_tokens == len({c[:i] for c in distinct for i in range(1, len(c) + 1)})
    store.drop("s")
    assert store.live_tokens == 0


# -- sharing: sessions opened with a share key ---------------------------------------------------


def _same_export(a: Trajectory, b: Trajectory) -> bool:
    """Equal in everything but the leaf handle (which trie node ends it)."""
    return (a.session, a.shared_prefix, a.tokens_raw, a.logprobs_raw, a.versions_raw, a.loss_mask_raw,
            a.segments) == (b.session, b.shared_prefix, b.tokens_raw, b.logprobs_raw, b.versions_raw,
                            b.loss_mask_raw, b.segments)


def test_sessions_with_a_share_key_store_their_common_prompts_once(trie_class):
    rng = np.random.default_rng(5)
    shared, own = TraceStore(trie_class=trie_class), TraceStore(trie_class=trie_class)
    empty = shared.memory_bytes
    system = rng.integers(0, 150_000, 800, dtype=np.int32)
    private = 0
    for g in range(3):
        task = rng.integers(0, 150_000, 200, dtype=np.int32)
        # Every session of a group samples the same tokens, each with its own logprobs and versions.
        sample = rng.integers(0, 150_000, 30, dtype=np.int32)
        for k in range(4):
            sid = f"g{g}-{k}"
            assert shared.open(sid, share="run") == shared.open(sid)
            lps, vers = -rng.random(30, dtype=np.float32), np.full(30, k, np.int32)
            tool = rng.integers(0, 150_000, 20, dtype=np.int32)
            for store in (shared, own):
                t1 = store.append_turn(sid, np.concatenate([system, task]))
                t2 = store.append_turn(sid, sample, lps, vers, kind="sampled", request_id=f"r{k}", parent=t1.handle)
                t3 = store.append_turn(sid, tool, kind="environment", parent=t2.handle)
                store.append_turn(sid, sample[:5], lps[:5], vers[:5], kind="sampled", request_id="again",
                                  parent=t3.handle)
                assert t1 == TurnEnd(t1.handle, 1000, 0)
            private += 55
    assert shared.live_tokens == 800 + 3 * 200 + private and own.live_tokens == 12 * 1000 + private
    assert shared.stats()["share_keys"] == 1 and shared.stats()["shared_tokens"] == 1400
    for sid in own.sessions():
        [a], [b] = shared.export(sid), own.export(sid)
        assert _same_export(a, b)
    # Dropping frees what no other session holds: a group's prompt goes with its last session.
    assert [shared.drop(f"g0-{k}") for k in range(4)] == [55, 55, 55, 55 + 200]
    for sid in shared.sessions():
        [a], [b] = shared.export(sid), own.export(sid)
        assert _same_export(a, b)
    assert sum(shared.drop(sid) for sid in list(shared.sessions())) == 800 + 2 * 200 + 8 * 55
    assert shared.live_tokens == 0 and shared.memory_bytes == empty and shared.stats()["share_keys"] == 0


def test_shared_sessions_keep_their_own_handles_and_answers(store):
    prompt = i32(*range(1, 21))
    store.open("a", share="k")
    store.open("b", share="k")
    ta = store.append_turn("a", prompt)
    # b takes the stored prompt up: nothing stored again, yet nothing of it was b's before.
    live = store.live_tokens
    assert store.longest_prefix("b", prompt).length == 0
    tb = store.append_turn("b", prompt)
    assert tb == TurnEnd(ta.handle, 20, 0) and store.live_tokens == live
    assert store.append_turn("b", prompt).reused == 20
    sa = store.append_turn("a", i32(7), f32(-1), i32(0), kind="sampled", parent=ta.handle)
    np.testing.assert_array_equal(store.path_tokens("b", ta.handle), prompt)  # a shared position: b's too
    with pytest.raises(InvalidRequest, match="another session"):
        store.append_turn("b", i32(8), parent=sa.handle)
    with pytest.raises(InvalidRequest, match="another session"):
        store.path_tokens("b", sa.handle)
    # A session of its own never shares, and a shared one keeps its key.
    p = store.append_turn("p", prompt)
    assert p.handle != ta.handle and store.live_tokens == live + 1 + 20
    with pytest.raises(InvalidRequest, match="another session"):
        store.depth("a", p.handle)
    with pytest.raises(InvalidRequest, match="share"):
        store.open("a", share="other")
    with pytest.raises(InvalidRequest, match="share"):
        store.open("p", share="k")
    with pytest.raises(InvalidRequest, match="share"):
        store.open("c", share=5)
    assert "c" not in store
    # After a leaves, its shared prompt is still b's, and what was a's alone is gone.
    assert store.drop("a") == 1
    assert store.export("b")[0].tokens.tolist() == prompt.tolist() and store.depth("b", ta.handle) == 20
    with pytest.raises(UnknownSession):
        store.path_tokens("a", ta.handle)


def test_memory_bound_counts_a_shared_prompt_once(trie_class):
    rng = np.random.default_rng(6)
    store = TraceStore(max_bytes=300_000, trie_class=trie_class)
    prompt = rng.integers(0, 1000, 2000, dtype=np.int32)
    for i in range(100):  # a hundred private copies would hold 2.4 MB
        store.open(f"s{i}", share="k")
        store.append_turn(f"s{i}", prompt)
    assert store.live_tokens == 2000 and store.memory_bytes <= 300_000
    with pytest.raises(TraceMemoryExceeded):
        for i in range(100):
            store.append_turn(f"own{i}", rng.integers(0, 1000, 2000, dtype=np.int32))
    held = (store.live_tokens, len(store))
    with pytest.raises(TraceMemoryExceeded):
        store.append_turn("s0", rng.integers(0, 1000, 30_000, dtype=np.int32), kind="environment")
    assert (store.live_tokens, len(store)) == held and store.memory_bytes <= 300_000


def test_a_refused_first_session_of_a_share_key_leaves_nothing_behind():
    """No room for its view: the shared root made for it goes too. (Only the reference's nominal
    accounting, 48 bytes a record, puts the bound between the two records deterministically.)"""
    store = TraceStore(max_bytes=48, trie_class=ref_trie.TokenTrie)
    with pytest.raises(TraceMemoryExceeded):
        store.open("a", share="k")
    assert "a" not in store and store.stats()["share_keys"] == 0 and store.stats()["live_nodes"] == 0


TURNS = st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=6),
                           st.sampled_from(["prompt", "prompt", "sampled", "environment"])), max_size=14)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=TURNS)
def test_shared_sessions_export_what_sessions_of_their_own_export(trie_class, turns):
    """The same turns (whole conversations from the root, or continuations of the last turn)
    in sessions sharing a key and in sessions of their own: the same ends, the same exports."""
    shared, own = TraceStore(trie_class=trie_class), TraceStore(trie_class=trie_class)
    last: dict[tuple[int, str], int] = {}
    for k, from_last, tokens, kind in turns:
        sid = f"s{k}"
        shared.open(sid, share="k")
        n = len(tokens)
        args = (f32(*[-0.5 * (k + 1)] * n), i32(*[k] * n)) if kind == "sampled" else (None, None)
        ends = []
        for store in (shared, own):
            parent = last.get((id(store), sid)) if from_last else None
            end = store.append_turn(sid, i32(*tokens), *args, kind=kind,
                                    request_id="r" if kind == "sampled" else None, parent=parent)
            last[(id(store), sid)] = end.handle
            ends.append(end[1:])
        assert ends[0] == ends[1]
    for sid in own.sessions():
        got, want = shared.export(sid), own.export(sid)
        assert len(got) == len(want) and all(map(_same_export, got, want))
    assert shared.live_tokens <= own.live_tokens
    for sid in list(own.sessions()):
        shared.drop(sid)
    assert shared.live_tokens == 0
