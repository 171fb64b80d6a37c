"""Exact trace capture and install-gate integration of agent sessions (rlengine.serve.sessions, render).

The capture rules do not depend on the model: the prompt of turn k is the
stored path (earlier prompts + the exact sampled tokens) plus only the newly
rendered suffix, and a diverging history branches in the trie. Those tests
run twice: on the sim backend with the byte renderer (no torch) and on the
torch backend with the tiny model's ChatML template and BPE tokenizer. What
needs a real tokenizer runs on torch only: re-tokenizing sampled text gives
other ids (BPE is not reversible), and the export keeps the sampled ones.
Gate tests run on the sim backend (versions per token, installs between and
during turns).
"""

from __future__ import annotations

import sys
import threading
import time

import msgspec
import numpy as np
import pytest
from serving import WAIT, Served, rss_mb, sim_config

import rlengine as rle
from rlengine import protocol as p
from rlengine.render import Boundary, ByteRenderer, assistant_tail, render_chat, suffix_text
from rlengine.sandbox_client import Client
from rlengine.serve import ServeConfig


@pytest.fixture(scope="module")
def tiny(engine_config):
    s = Served([engine_config("torch")], ServeConfig(http=False))
    yield s
    s.close()


@pytest.fixture(scope="module")
def renderer(tiny):
    return tiny.on_loop(lambda: tiny.sessions.renderer)


@pytest.fixture(scope="module")
def bytes_served():
    s = Served([sim_config()], ServeConfig(http=False))
    yield s
    s.close()


@pytest.fixture(scope="module", params=["bytes", "template"])
def capture(request):
    """A server for the capture tests and its renderer: the sim with the byte renderer, then
    the torch backend with the tiny model's chat template."""
    served = request.getfixturevalue("bytes_served" if request.param == "bytes" else "tiny")
    return served, served.on_loop(lambda: served.sessions.renderer)


def prompt_of(renderer, msgs) -> list[int]:
    """The tokens of ``msgs`` rendered whole, with the generation prompt (``render_chat`` for a template)."""
    return renderer.encode(renderer.render(msgs, True))


def session(served):
    with Client(served.ipc_path, timeout=WAIT) as c:
        s = c.open_session()
    return s.session_id, s.token


def export(served, sid):
    return served.on_loop(lambda: served.sessions.store.export(sid))


def chat(served, sid, token, messages, **params):
    with Client(served.ipc_path, timeout=WAIT) as c:
        return c.session(sid, token).chat(messages, **params)


def reply(text: str) -> dict:
    """An assistant message as a client sends it back."""
    return {"role": "assistant", "content": text}


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- rendering ------------------------------------------------------------------------------


@pytest.mark.model_plane
def test_assistant_tail_is_the_template_closing_after_the_sampled_tokens(renderer):
    msgs = [{"role": "user", "content": "hi"}]
    im_end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert assistant_tail(renderer, msgs, reply("hello"), renderer.encode("hello") + [im_end]) == "\n"
    assert assistant_tail(renderer, msgs, reply("hello"), renderer.encode("hello")) == "<|im_end|>\n"  # cut by length


@pytest.mark.model_plane
def test_suffix_renders_only_the_new_messages(renderer):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    sampled_end = Boundary(handle=0, count=2, generation=False, tail="\n")
    assert suffix_text(renderer, msgs, sampled_end) == "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    root = Boundary(handle=0, count=0, generation=False, tail="")
    assert suffix_text(renderer, msgs, root) == renderer.render(msgs, True)


def test_the_byte_renderer_owes_its_closing_tag_after_a_sampled_turn():
    renderer, msgs = ByteRenderer(), [{"role": "user", "content": "hi"}]
    assert assistant_tail(renderer, msgs, reply("yo"), renderer.encode("yo")) == "\n</assistant>\n"
    after_turn = Boundary(handle=0, count=2, generation=False, tail="\n</assistant>\n")
    msgs += [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert suffix_text(renderer, msgs, after_turn) == "\n</assistant>\n<user>\nmore\n</user>\n<assistant>\n"


def test_a_template_that_is_not_prefix_stable_gives_no_suffix():
    class Reordering(ByteRenderer):
        def render(self, messages, generation, tools=None):  # renders the last message first
            return super().render(list(reversed(messages)), generation, tools)

    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert suffix_text(Reordering(), msgs, Boundary(0, 1, False, "")) is None


# -- exact capture (torch, tiny model) ------------------------------------------------------------


@pytest.mark.model_plane
def test_the_prompt_of_turn_k_is_the_stored_path_plus_the_rendered_suffix(capture):
    tiny, renderer = capture
    sid, token = session(tiny)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    t1 = chat(tiny, sid, token, msgs, max_tokens=10, seed=1)
    prompt1 = prompt_of(renderer, msgs)
    assert t1.prompt_tokens == len(prompt1)
    sampled1 = t1.choices[0].tokens
    msgs += [{"role": "assistant", "content": t1.choices[0].text}, {"role": "user", "content": "and then?"}]
    t2 = chat(tiny, sid, token, msgs, max_tokens=6, seed=2)
    tail = assistant_tail(renderer, msgs[:2], reply(t1.choices[0].text), sampled1)
    suffix = renderer.encode(tail + renderer.render(msgs, True)[len(renderer.render(msgs[:3], False)):])
    expected_prompt2 = prompt1 + sampled1 + suffix
    assert t2.prompt_tokens == len(expected_prompt2)
    [traj] = export(tiny, sid)
    tokens = traj.tokens.tolist()
    assert tokens == expected_prompt2 + t2.choices[0].tokens
    assert traj.loss_mask.tolist() == ([0] * len(prompt1) + [1] * len(sampled1) + [0] * len(suffix)
                                       + [1] * len(t2.choices[0].tokens))
    lps = traj.logprobs.tolist()
    assert np.allclose(lps[len(prompt1):len(prompt1) + len(sampled1)], t1.choices[0].logprobs)
    receipts = tiny.on_loop(lambda: [r for r in tiny.engines[0].scheduler.receipts if r.session_id == sid])
    assert len(receipts) == 2 and all(r.outcome == "completed" for r in receipts)  # each turn held a lease


@pytest.mark.model_plane
def test_retokenizing_the_sampled_text_gives_other_ids_but_the_export_holds_the_sampled_ones(tiny, renderer):
    for seed in range(40):
        sid, token = session(tiny)
        msgs = [{"role": "user", "content": "tell me a story"}]
        t1 = chat(tiny, sid, token, msgs, max_tokens=16, seed=seed)
        sampled, text = t1.choices[0].tokens, t1.choices[0].text
        if renderer.encode(text) != sampled:
            break
    else:
        pytest.fail("no sampled completion in 40 seeds re-tokenizes differently (the test needs one)")
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    t2 = chat(tiny, sid, token, msgs, max_tokens=4, seed=0)
    prompt1 = len(render_chat(renderer.tokenizer, msgs[:1]))
    [traj] = export(tiny, sid)
    assert traj.tokens.tolist()[prompt1:prompt1 + len(sampled)] == sampled
    assert traj.loss_mask.tolist()[prompt1:prompt1 + len(sampled)] == [1] * len(sampled)
    # What a client re-rendering the whole conversation would have sent instead:
    retokenized = render_chat(renderer.tokenizer, msgs)
    assert retokenized != traj.tokens.tolist()[:t2.prompt_tokens]


@pytest.mark.model_plane
def test_an_edited_history_branches_at_the_divergence_point(capture):
    tiny, renderer = capture
    sid, token = session(tiny)
    msgs = [{"role": "user", "content": "count to three"}]
    t1 = chat(tiny, sid, token, msgs, max_tokens=8, seed=3)
    prompt1 = len(prompt_of(renderer, msgs))
    chat(tiny, sid, token, msgs + [{"role": "assistant", "content": t1.choices[0].text},
                                   {"role": "user", "content": "again"}], max_tokens=3, seed=4)
    edited = msgs + [{"role": "assistant", "content": "one two three"}, {"role": "user", "content": "again"}]
    t3 = chat(tiny, sid, token, edited, max_tokens=3, seed=5)
    first, second = export(tiny, sid)
    a, b = first.tokens.tolist(), second.tokens.tolist()
    assert second.shared_prefix == lcp(a, b) >= prompt1  # the branch starts inside the assistant turn
    assert a[:prompt1] == b[:prompt1]
    # The edited assistant text is not sampled: it is masked out, and the new
    # turn's sampled tokens are the only ones trained on in the branch.
    mask = second.loss_mask.tolist()
    assert sum(mask[second.shared_prefix:]) == len(t3.choices[0].tokens)
    assert b[-len(t3.choices[0].tokens):] == t3.choices[0].tokens


@pytest.mark.model_plane
def test_a_truncated_history_and_n_samples_branch_from_the_stored_prompt(capture):
    tiny, renderer = capture
    sid, token = session(tiny)
    msgs = [{"role": "user", "content": "pick one"}]
    t1 = chat(tiny, sid, token, msgs, max_tokens=5, seed=6)
    chat(tiny, sid, token, msgs + [{"role": "assistant", "content": t1.choices[0].text},
                                   {"role": "user", "content": "why"}], max_tokens=3, seed=7)
    retry = chat(tiny, sid, token, msgs, max_tokens=5, n=2, seed=8)  # back to the first turn, twice
    prompt1 = len(prompt_of(renderer, msgs))
    assert retry.prompt_tokens == prompt1
    trajectories = export(tiny, sid)
    assert len(trajectories) >= 2
    assert all(t.tokens.tolist()[:prompt1] == trajectories[0].tokens.tolist()[:prompt1] for t in trajectories)
    for choice in retry.choices:  # each retried completion is a sampled branch right after the prompt
        n = len(choice.tokens)
        assert any(t.tokens.tolist()[prompt1:prompt1 + n] == choice.tokens
                   and t.loss_mask.tolist()[prompt1:prompt1 + n] == [1] * n for t in trajectories)


@pytest.mark.model_plane
def test_generate_keeps_the_stored_prefix_and_stores_only_new_tokens(capture):
    tiny, _ = capture
    sid, token = session(tiny)
    with Client(tiny.ipc_path, timeout=WAIT) as c:
        s = c.session(sid, token)
        t1 = s.generate([5, 6, 7], max_tokens=4, seed=1)
        prompt = [5, 6, 7, *t1.choices[0].tokens, 9]
        t2 = s.generate(prompt, max_tokens=3, seed=2)
    [traj] = export(tiny, sid)
    assert traj.tokens.tolist() == prompt + t2.choices[0].tokens
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1]
    assert [s.kind for s in traj.segments] == ["prompt", "sampled", "environment", "sampled"]


# -- leases and the install gate (sim) ----------------------------------------------------------


@pytest.fixture(scope="module")
def sim():
    s = Served([sim_config()], ServeConfig(http=False))
    yield s
    s.close()


def test_a_multi_turn_agent_keeps_running_across_installs(sim):
    sid, token = session(sim)
    turns, errors = [], []

    def agent():
        try:
            with Client(sim.ipc_path, timeout=WAIT) as c:
                s = c.session(sid, token)
                prompt = [1, 2]
                for k in range(12):
                    t = s.generate(prompt, max_tokens=20, seed=k)
                    turns.append(t.choices[0])
                    prompt = prompt + t.choices[0].tokens + [3]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=agent)
    thread.start()
    versions = []
    while thread.is_alive() and len(versions) < 3:
        time.sleep(0.03)
        versions.append(sim.install(seed=len(versions) + 10))
    thread.join(WAIT)
    assert not errors and len(turns) == 12
    turn_versions = [c.versions for c in turns]
    assert all(len(set(v)) == 1 for v in turn_versions)  # drain policy "wait": one version per turn
    firsts = [v[0] for v in turn_versions]
    assert firsts == sorted(firsts) and len(set(firsts)) >= 2  # later turns ran on newer versions
    [traj] = export(sim, sid)
    mask = traj.loss_mask.tolist()
    assert [v for v, m in zip(traj.versions.tolist(), mask) if m] == [v for tv in turn_versions for v in tv]


def test_under_the_pause_policy_a_turn_spanning_an_install_records_both_versions():
    s = Served([msgspec.structs.replace(sim_config(step_time_s=0.002), drain_policy="pause")], ServeConfig(http=False))
    try:
        sid, token = session(s)
        box = {}

        def agent():
            with Client(s.ipc_path, timeout=WAIT) as c:
                box["turn"] = c.session(sid, token).generate([1], max_tokens=150, seed=1)

        thread = threading.Thread(target=agent)
        thread.start()
        time.sleep(0.1)
        v = s.install(seed=3)
        thread.join(WAIT)
        versions = box["turn"].choices[0].versions
        assert versions[0] == v - 1 and versions[-1] == v and versions == sorted(versions)
        [traj] = export(s, sid)
        assert traj.versions.tolist()[1:] == versions
    finally:
        s.close()


def test_a_turn_waits_at_a_sealed_gate_and_runs_on_the_new_version(sim):
    sid, token = session(sim)
    gate_open = threading.Event()
    engine = sim.engines[0]
    blocker = engine.submit_blocking("forward", lambda: gate_open.wait(WAIT))  # holds the gate sealed
    theta = np.zeros(engine.backend.vocab_size, dtype=np.float32)
    install = engine.install_weights(lambda: [("theta", theta)])
    box = {}

    def agent():
        with Client(sim.ipc_path, timeout=WAIT) as c:
            box["turn"] = c.session(sid, token).generate([1], max_tokens=3)

    thread = threading.Thread(target=agent)
    thread.start()
    time.sleep(0.1)
    assert "turn" not in box  # waiting behind the sealed gate
    gate_open.set()
    blocker.result(WAIT)
    version = install.result(WAIT)
    thread.join(WAIT)
    assert box["turn"].choices[0].versions == [version] * 3


def test_trace_and_reward_are_per_session(sim):
    a, a_token = session(sim)
    b, b_token = session(sim)
    with Client(sim.ipc_path, timeout=WAIT) as c:
        sa, sb = c.session(a, a_token), c.session(b, b_token)
        with pytest.raises(p.InvalidValue, match="no turn"):
            sa.reward(1.0)
        sa.generate([1, 2], max_tokens=2)
        sb.generate([7], max_tokens=3)
        sa.reward(2.0)
        [ta], [tb] = sa.trace(), sb.trace()
    assert ta.tokens[:2] == [1, 2] and ta.reward == 2.0
    assert tb.tokens[0] == 7 and tb.reward is None
    trace = sim.on_loop(sim.sessions.collect, a)
    assert trace.rewards == [2.0] and trace.turns == 1
    assert a not in sim.on_loop(lambda: list(sim.sessions.store.sessions()))


# -- the engine hooks the servers use -------------------------------------------------------------


def test_on_tokens_streams_each_sequence_before_it_finishes(sim):
    engine = sim.engines[0]
    seen: list[tuple[int, int, bool]] = []
    box = {}

    def on_tokens(index, ids, lps, version):
        seen.append((index, len(ids), box["f"].done()))
        assert len(ids) == len(lps) and version == engine.scheduler.version  # runs on the loop thread

    def submit():
        box["f"] = engine.sample([1, 2], 2, rle.SamplingParams(max_tokens=5), on_tokens=on_tokens)

    sim.on_loop(submit)
    resp = box["f"].result(WAIT)
    assert sorted(seen) == sorted([(i, 1, False) for i in range(2) for _ in range(5)])
    assert [s.length for s in resp.sequences] == [5, 5]


def test_abandoning_a_request_that_never_started_poisons_nothing(sim):
    engine = sim.engines[0]
    gate_open = threading.Event()
    blocker = engine.submit_blocking("forward", lambda: gate_open.wait(WAIT))
    queued = engine.sample([1], 1, rle.SamplingParams(max_tokens=3))
    time.sleep(0.05)
    assert engine.abandon(queued.request_id, "client gone").result(WAIT) is None
    assert queued.result(WAIT).sequences[0].stop_reason == "abort"
    gate_open.set()
    blocker.result(WAIT)
    assert sim.on_loop(engine.scheduler.unknown_leases) == []
    running = engine.sample([1], 1, rle.SamplingParams(max_tokens=100_000))
    time.sleep(0.05)
    lease_id = engine.abandon(running.request_id, "client gone").result(WAIT)
    assert isinstance(lease_id, int) and running.result(WAIT).sequences[0].stop_reason == "abort"
    [lease] = sim.on_loop(engine.scheduler.unknown_leases)
    assert lease.lease_id == lease_id and lease.reason == "client gone"
    engine.write_off(lease_id).result(WAIT)
    assert sim.on_loop(engine.scheduler.unknown_leases) == []


def test_recording_a_turn_runs_outside_the_samplers_settlement_chain(sim):
    """Rendering, tokenizing and storing a turn happen in a callback of their own
    (``then(defer=True)``), never inside the sampler's step settlement, so one turn's
    bookkeeping cannot hold up the settlement of the others (rlengine.core.futures)."""
    sessions = sim.sessions
    chain = {("sampler.py", "_apply"), ("sampler.py", "_run_step"), ("sampler.py", "_complete"),
             ("futures.py", "settle_all"), ("futures.py", "_run_callbacks"), ("futures.py", "_settle")}
    calls: list[tuple[str, bool]] = []

    def watched(name, fn):
        def call(*args, **kwargs):
            frame, inside = sys._getframe(1), False
            while frame is not None:
                code = frame.f_code
                inside |= (code.co_filename.rsplit("/", 1)[-1], code.co_name) in chain
                frame = frame.f_back
            calls.append((name, inside))
            return fn(*args, **kwargs)
        return call

    store, renderer = sessions.store, sessions.renderer
    patched = {(store, "append_turn"), (renderer, "render"), (renderer, "encode"), (renderer, "decode")}
    originals = {(obj, name): getattr(obj, name) for obj, name in patched}
    sim.on_loop(lambda: [setattr(obj, name, watched(name, fn)) for (obj, name), fn in originals.items()])
    try:
        sid, token = session(sim)
        with Client(sim.ipc_path, timeout=WAIT) as c:
            s = c.session(sid, token)
            reply = s.chat([{"role": "user", "content": "hi"}], max_tokens=3, n=2)
            s.generate([*b"hi", *reply.choices[0].tokens], max_tokens=2)
    finally:
        sim.on_loop(lambda: [setattr(obj, name, fn) for (obj, name), fn in originals.items()])
    recorded = [name for name, _ in calls]
    assert recorded.count("append_turn") == (1 + 2) + (1 + 1)  # each turn's prompt, then its samples
    assert "render" in recorded and "encode" in recorded and "decode" in recorded
    assert [c for c in calls if c[1]] == []


@pytest.mark.parametrize("bad", [".", "..", "...", "a b", "x" * 129, ""])
def test_session_ids_that_are_only_dots_or_out_of_the_alphabet_are_refused(sim, bad):
    with pytest.raises(rle.InvalidRequest, match="session_id"):
        sim.on_loop(sim.sessions.open, bad)
    good = f"a.{len(bad)}.{bad.count(' ')}"
    assert sim.on_loop(sim.sessions.open, good).session_id == good


# -- sharing: one stored copy of a common prompt ---------------------------------------------------------------


@pytest.mark.parametrize("share", [True, False], ids=["shared", "own-trees"])
def test_sessions_sending_one_system_prompt_store_it_once(share):
    """With ``trace_share_prompts`` (the default) a prompt several sessions send is stored once;
    every session's trace is still exactly its prompt and its own sampled tokens."""
    s = Served([sim_config(gen_len=6)], ServeConfig(http=False, trace_share_prompts=share))
    try:
        msgs = [{"role": "system", "content": "You are a careful agent. " * 40}, {"role": "user", "content": "go"}]
        renderer = s.on_loop(lambda: s.sessions.renderer)
        prompt = prompt_of(renderer, msgs)
        sessions = [session(s) for _ in range(4)]
        replies = [chat(s, sid, token, msgs, max_tokens=6).choices[0] for sid, token in sessions]
        sampled = sum(len(c.tokens) for c in replies)
        stored = s.on_loop(lambda: s.sessions.store.live_tokens)
        assert stored == (1 if share else 4) * len(prompt) + sampled
        for (sid, _), choice in zip(sessions, replies):
            [t] = export(s, sid)
            n = len(choice.tokens)
            assert t.tokens.tolist() == prompt + choice.tokens and t.loss_mask.tolist() == [0] * len(prompt) + [1] * n
            assert t.logprobs[len(prompt):].tobytes() == choice.logprobs_raw and not t.logprobs[:len(prompt)].any()
            assert t.versions[len(prompt):].tobytes() == choice.versions_raw
            assert [(g.start, g.end, g.kind) for g in t.segments] == [(0, len(prompt), "prompt"),
                                                                     (len(prompt), len(prompt) + n, "sampled")]
        # Collecting a session frees what no other session holds: the prompt goes with the last one.
        for k, (sid, _) in enumerate(sessions):
            s.on_loop(s.sessions.collect, sid)
            left = s.on_loop(lambda: s.sessions.store.live_tokens)
            assert left == sum(len(c.tokens) for c in replies[k + 1:]) + (
                len(prompt) * (k < 3) if share else len(prompt) * (3 - k))
    finally:
        s.close()


# -- retention: bounded memory without an operator --------------------------------------------------------------


def test_ten_thousand_session_cycles_keep_memory_and_never_fill_the_store():
    s = Served([sim_config(gen_len=8, step_time_s=0.0)], ServeConfig(http=False, trace_max_bytes=4 << 20))
    sessions = s.sessions
    params = rle.SamplingParams(max_tokens=8)
    prompt = np.arange(1, 200, dtype=np.int32).tobytes()

    async def cycles(n: int) -> None:
        for _ in range(n):
            session = sessions.open()
            await sessions.generate(session, prompt, params)
            sessions.close(session)

    try:
        s._run(cycles(1_000), 300)
        after_1k, store_1k = rss_mb(), s.on_loop(lambda: sessions.store.memory_bytes)
        s._run(cycles(9_000), 600)  # before retention: "trace store is full" at the 1,572nd
        after_10k = rss_mb()
        assert s.on_loop(lambda: len(sessions.retired())) <= sessions.retention.max_closed
        assert s.on_loop(lambda: sessions.store.memory_bytes) <= 4 << 20
        assert after_10k - after_1k < 32, (after_1k, after_10k, store_1k)  # MB: tombstones and the retired kept
    finally:
        s.close()


def test_idle_and_closed_sessions_expire_and_open_sessions_are_capped():
    s = Served([sim_config(gen_len=2)], ServeConfig(http=False, idle_session_ttl_s=0.2, closed_session_ttl_s=0.2,
                                                    max_open_sessions=3))
    sessions = s.sessions
    try:
        idle = s.on_loop(sessions.open)
        done = s.on_loop(sessions.open)
        s.on_loop(sessions.close, done)
        busy = s.on_loop(sessions.open)
        s.on_loop(sessions.open)
        with pytest.raises(p.SessionLimit, match="max_open_sessions"):
            s.on_loop(sessions.open)
        turn = s.on_loop(lambda: sessions.generate(busy, np.arange(1, 5, dtype=np.int32).tobytes(),
                                                   rle.SamplingParams(max_tokens=2)))
        turn.result(WAIT)
        time.sleep(0.3)
        assert s.on_loop(sessions.sweep) >= 3  # the idle ones retired, the closed one's trace freed
        assert done.session_id not in s.on_loop(sessions.retired)
        assert done.session_id not in s.on_loop(lambda: list(sessions.store.sessions()))
        with pytest.raises(p.SessionGone):
            s.on_loop(sessions.authorize, idle.session_id, idle.token)
        assert s.on_loop(sessions.open).session_id  # room again
    finally:
        s.close()
