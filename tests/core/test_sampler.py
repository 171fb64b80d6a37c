"""rlengine.core.sampler and .records: the per-request records, their sequences, and settlement.

References: a plain list of (token, logprob, version) per sequence for what
a sequence accumulates; the seeding module for per-sample seeds; and, for
settlement, the rule in ``rlengine.core.futures``: every request finishing
in one backend step is settled before any done-callback runs.
"""

from __future__ import annotations

import threading
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlengine as rle
from rlengine.backends.base import BackendRequest, Capabilities, RequestOutput
from rlengine.core.records import SampleSpec, Sequence, new_sample
from rlengine.seeding import derive_seed

WAIT = 30


def sim(**overrides) -> rle.EngineConfig:
    return rle.EngineConfig(backend="sim", sim=rle.SimConfig(**{"gen_len": 4, **overrides}))


# -- what a sequence accumulates ----------------------------------------------------------------

_report = st.tuples(st.lists(st.integers(0, 1000), min_size=1, max_size=5), st.integers(0, 3),
                    st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_report, min_size=1, max_size=12))
def test_a_sequence_keeps_every_token_logprob_and_version_in_order(reports):
    """Reports arrive as lists or as the backend's own arrays (taken over, not copied,
    when first); the result equals the plain concatenation, each token tagged with
    the version that produced it."""
    seq = Sequence(None, 0, "r", 0)
    expected = []
    for i, (tokens, version, as_arrays) in enumerate(reports):
        logprobs = [-(t % 7) / 8 for t in tokens]
        if as_arrays:
            ids, lps = array("i", tokens), array("f", logprobs)
        else:
            ids, lps = list(tokens), list(logprobs)
        seq.add(ids, lps, version)
        if i == 0 and as_arrays:
            assert seq.tokens is ids  # the first report's arrays are the sequence's own now
        expected += [(t, lp, version) for t, lp in zip(tokens, logprobs)]
    seq.stop_reason = "length"
    out = seq.to_sequence()
    assert out.tokens == [t for t, _, _ in expected]
    assert out.logprobs == pytest.approx([lp for _, lp, _ in expected])
    assert out.versions == [v for _, _, v in expected]
    assert out.stop_reason == "length"


def test_a_sequence_with_no_tokens_and_no_stop_reason_is_an_abort():
    assert Sequence(None, 0, "r", 0).to_sequence() == rle.SampledSequence(stop_reason="abort")


# -- the per-request path --------------------------------------------------------------------------

class Recorder:
    """A backend that records what it is asked to generate and finishes everything at once."""

    name = "recorder"
    capabilities = Capabilities(sleep=False, prompt_logprobs=True, stop_strings=True,
                                why_not_sleep="a test backend")
    vocab_size = 100
    max_model_len = 64

    def __init__(self) -> None:
        self.added: list[BackendRequest] = []
        self.running: list[BackendRequest] = []

    def add_request(self, request: BackendRequest) -> None:
        self.added.append(request)
        self.running.append(request)

    def abort_request(self, ids) -> None:
        self.running = [r for r in self.running if r.request_id not in set(ids)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        done, self.running = self.running, []
        return [RequestOutput(r.request_id, array("i", [1] * r.max_tokens), array("f", [-0.5] * r.max_tokens),
                              True, "length", [0.0] * (len(r.prompt) // 4) if r.prompt_logprobs else None)
                for r in done]

    def load_weights(self, weights, version) -> None:
        pass

    def sleep(self, level: int) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_each_sample_gets_its_backend_request_seed_and_room():
    backend = Recorder()
    with rle.Engine(rle.EngineConfig(backend="sim"), backend=backend) as engine:
        prompt = list(range(1, 61))  # 60 of the 64 positions: room for 4 tokens
        one = engine.sample(prompt, 1, rle.SamplingParams(max_tokens=2, seed=7)).result(WAIT)
        many = engine.sample(prompt, 3, rle.SamplingParams(max_tokens=10, seed=7),
                             include_prompt_logprobs=True).result(WAIT)
        free = engine.sample([1, 2], 2, rle.SamplingParams(max_tokens=3)).result(WAIT)
    first, *rest = backend.added
    assert (first.request_id, first.seed, first.max_tokens, first.prompt_logprobs) == (
        one.request_id, derive_seed(7, 0), 2, False)
    fan = rest[:3]
    assert [r.request_id for r in fan] == [f"{many.request_id}.{i}" for i in range(3)]
    assert [r.seed for r in fan] == [derive_seed(7, i) for i in range(3)]
    assert [r.max_tokens for r in fan] == [4, 4, 4]  # capped by the context, not max_tokens=10
    assert [r.prompt_logprobs for r in fan] == [True, False, False]  # computed once per call
    assert all(r.prompt == fan[0].prompt == first.prompt for r in fan)
    assert [s.length for s in many.sequences] == [4, 4, 4] and many.prompt_logprobs is not None
    unseeded = rest[3:]
    assert len({r.seed for r in unseeded}) == 2  # drawn from the engine's seeded stream
    assert [s.length for s in free.sequences] == [3, 3]


def test_a_validated_spec_is_what_the_sampler_takes():
    spec = SampleSpec(array("i", [1, 2]).tobytes(), 2, rle.SamplingParams(), False)
    request = new_sample("s9", spec, None, "sess", None, lambda rid: None)
    assert (request.request_id, request.spec, request.session_id, request.blocking) == ("s9", spec, "sess", False)
    assert not request.future.done() and request.lease is None and request.seqs is None
    with rle.Engine(sim()) as engine:
        with pytest.raises(rle.InvalidRequest, match="spec"):
            engine.submit_sample((spec.prompt, 2))  # not a spec: refused, nothing queued
        assert engine.submit_sample(spec).result(WAIT).sequences[1].length == 4


@pytest.mark.parametrize("prompt, field", [
    (rle.ModelInput(tokens_raw=array("i", [1, -3]).tobytes()), "prompt"),
    (rle.ModelInput(tokens_raw=array("i", [300]).tobytes()), "prompt"),
    (rle.ModelInput(), "prompt"),
])
def test_the_engine_refuses_a_bad_raw_prompt_before_queueing(prompt, field):
    with rle.Engine(sim()) as engine:
        with pytest.raises(rle.InvalidRequest) as info:
            engine.sample(prompt, 1)
        assert info.value.field == field
        assert engine.stats()["admitted"] == 0


# -- settlement ------------------------------------------------------------------------------------

def test_a_slow_done_callback_does_not_delay_the_others_finishing_in_the_same_step():
    """101 requests finish in one backend step; the first one's done-callback blocks
    until this thread has the 100 others' results. It can only get them if they were
    all settled before any callback ran."""
    with rle.Engine(sim(gen_len=3)) as engine:
        hold = threading.Event()
        # A blocking item parks the sampler, so all 101 samples queue behind it and are
        # admitted together: the same step adds them and the same step finishes them.
        parked = engine.submit_blocking("park", lambda: hold.wait(WAIT))
        params = rle.SamplingParams(max_tokens=3)
        futures = [engine.sample([1, 2, 3], 1, params) for _ in range(101)]
        others_received, slow_done = threading.Event(), threading.Event()
        seen: list[bool] = []

        def slow(_f):
            seen.append(others_received.wait(10))
            slow_done.set()

        futures[0].add_done_callback(slow)
        steps_before = engine.stats()["steps"]
        hold.set()
        assert parked.result(WAIT) is True
        results = [f.result(10) for f in futures[1:]]
        others_received.set()
        futures[0].result(WAIT)
        assert slow_done.wait(WAIT) and seen == [True]
        assert all(r.sequences[0].length == 3 for r in results)
        assert engine.stats()["steps"] - steps_before <= 3  # one generation's steps, not 101


def test_a_done_callback_that_raises_is_logged_and_the_others_still_run(caplog):
    with rle.Engine(sim()) as engine:
        seen = []
        future = engine.sample([1], 1)

        def broken(_f):
            raise RuntimeError("a consumer's bug")

        future.add_done_callback(broken)
        future.add_done_callback(lambda f: seen.append(f.result(0).sequences[0].length))
        assert future.result(WAIT).sequences[0].length == 4
        assert engine.sample([1], 1).result(WAIT).sequences[0].length == 4  # still serving
    assert seen == [4]
    assert "a done-callback of request" in caplog.text


class _Context:
    """A backend's context length, all ``_admit`` reads of the backend."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 4), max_tokens=st.one_of(st.none(), st.integers(1, 300)), prompt_len=st.integers(1, 199),
       seed=st.one_of(st.none(), st.integers(-2**40, 2**40)), streaming=st.booleans(), pause=st.booleans(),
       logprobs=st.booleans())
def test_admission_builds_what_the_backend_request_helper_builds(n, max_tokens, prompt_len, seed, streaming,
                                                                  pause, logprobs):
    """``_admit`` builds a fresh sequence's backend request inline (the hot path); it must be
    exactly what ``_backend_request``, the helper resumed sequences use, builds for it."""
    import asyncio

    from rlengine.core.sampler import SamplerLoop

    loop = asyncio.new_event_loop()
    try:
        sampler = SamplerLoop(_Context(200), None, continuous=True, drain_policy="pause" if pause else "wait",
                              drain_timeout_s=1.0, seed=0)
        spec = SampleSpec(array("i", range(1, prompt_len + 1)).tobytes(), n,
                          rle.SamplingParams(max_tokens=max_tokens, seed=seed), logprobs)
        request = new_sample("s1", spec, None, None, (lambda *a: None) if streaming else None, lambda rid: None)
        sampler.scheduler.submit(request)
        sampler._admit()
        assert request.lease is not None and request.remaining == n and len(request.seqs) == n
        assert [r.request_id for r in sampler._to_add] == (["s1"] if n == 1 else [f"s1.{i}" for i in range(n)])
        for seq, built in zip(request.seqs, sampler._to_add):
            assert built == sampler._backend_request(seq, spec.prompt)
            if seed is not None:
                assert built.seed == derive_seed(seed, seq.index)
    finally:
        loop.close()
