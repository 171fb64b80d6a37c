"""The engine's scheduling semantics: continuous sampling, drain ordering, the install gate.

Written once and parametrized over backends (``engine_config``): every backend
must give the same continuous-sampling semantics. Generation lengths are set by
``max_tokens`` (the sim is configured never to stop early, like a model that
does not emit its end token), so tests mean the same thing on every backend.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import rlengine as rle
from rlengine.core.engine import new_event_loop

WAIT = 60.0  # every wait in these tests is bounded


@pytest.fixture(scope="module")
def engine(backend, engine_config):
    # One engine per backend for the module (a vLLM engine takes seconds to
    # build): tests leave it settled and reason relative to its version.
    with rle.Engine(engine_config(backend)) as eng:
        yield eng


def prompt(*ids: int) -> rle.ModelInput:
    return rle.ModelInput.from_ints(list(ids) or [1, 2, 3])


def params(n: int, seed: int | None = None) -> rle.SamplingParams:
    # ignore_eos: lengths are set by max_tokens on every backend.
    return rle.SamplingParams(max_tokens=n, seed=seed, ignore_eos=True)


def datum(n: int = 3) -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints(list(range(1, n + 1))),
                     loss_fn_inputs={"target_tokens": np.arange(2, n + 2)})


def on_loop_order(futures: dict[str, rle.RequestFuture]) -> list[str]:
    """Settlement order, recorded by done-callbacks (they run at settlement)."""
    order: list[str] = []
    lock = threading.Lock()
    for name, f in futures.items():
        def record(_f, name=name):
            with lock:
                order.append(name)
        f.add_done_callback(record)
    return order


# -- basics -------------------------------------------------------------------------------


def loaded(engine: rle.Engine) -> int:
    return engine.call_on_loop(lambda: engine.scheduler.version).result(WAIT)


def test_the_scheduler_is_the_engines_one_name_for_it_and_gate_a_deprecated_alias(engine):
    scheduler = engine.scheduler
    assert loaded(engine) == engine.call_on_loop(lambda: scheduler.version).result(WAIT)
    with pytest.warns(DeprecationWarning, match="Engine.gate is deprecated: use Engine.scheduler"):
        assert engine.gate is scheduler


def test_sample_returns_sequences_with_versions(engine):
    v = loaded(engine)
    resp = engine.sampling_client().sample(prompt(), 3, params(5)).result(WAIT)
    assert len(resp.sequences) == 3
    for seq in resp.sequences:
        assert seq.length == 5 and seq.stop_reason == "length"
        assert len(seq.logprobs) == 5 and all(lp <= 0.0 for lp in seq.logprobs)
        assert seq.versions == [v] * 5


def test_seeds_reproduce(engine):
    s = engine.sampling_client()
    a = s.sample(prompt(), 2, params(6, seed=11)).result(WAIT)
    b = s.sample(prompt(), 2, params(6, seed=11)).result(WAIT)
    assert [q.tokens for q in a.sequences] == [q.tokens for q in b.sequences]
    assert a.sequences[0].tokens != a.sequences[1].tokens


def test_each_request_completes_when_its_own_generation_does(engine):
    s = engine.sampling_client()
    long = s.sample(prompt(), 1, params(80))
    seen_long_done = []
    short = s.sample(prompt(), 1, params(2))
    short.add_done_callback(lambda _f: seen_long_done.append(long.done()))
    assert short.result(WAIT).sequences[0].length == 2
    assert seen_long_done == [False]
    assert long.result(WAIT).sequences[0].length == 80


# -- blocking work and the drain ----------------------------------------------------------


def test_drain_ordering_samples_before_blocking_run_first(engine):
    s, t = engine.sampling_client(), engine.training_client()
    v = loaded(engine)
    state_during = []

    def run() -> str:
        state_during.append(engine.backend.has_unfinished_requests())
        return "ran"

    before = s.sample(prompt(), 1, params(40))
    block = engine.submit_blocking("forward", run)
    install = t.save_weights_for_sampler()
    after = s.sample(prompt(), 1, params(3))
    order = on_loop_order({"before": before, "block": block, "install": install, "after": after})
    assert after.result(WAIT).sequences[0].versions == [v + 1] * 3
    assert before.result(WAIT).sequences[0].versions == [v] * 40
    assert block.result(WAIT) == "ran" and state_during == [False]
    assert order == ["before", "block", "install", "after"]


def test_blocking_work_runs_in_submission_order(engine):
    t = engine.training_client()
    futures = {
        "fb1": t.forward_backward([datum()]),
        "optim1": t.optim_step(rle.AdamParams(learning_rate=0.1)),
        "fwd": t.forward([datum()]),
        "install": t.save_weights_for_sampler(),
        "fb2": t.forward_backward([datum()]),
        "optim2": t.optim_step(),
    }
    order = on_loop_order(futures)
    for f in futures.values():
        f.result(WAIT)
    assert order == list(futures)
    # The forward after optim1 sees the updated weights: a different loss than fb1's.
    assert futures["fwd"].result(0).metrics["loss:sum"] != futures["fb1"].result(0).metrics["loss:sum"]


def test_noop_blocking_item_does_not_drain(engine):
    long = engine.sampling_client().sample(prompt(), 1, params(60))
    noop = engine.submit_blocking("cleanup", lambda: "ran", noop=lambda: True)
    order = on_loop_order({"long": long, "noop": noop})
    noop.result(WAIT)
    long.result(WAIT)
    assert order == ["noop", "long"]
    assert noop.result(0) is None  # a no-op does not run its work


def test_no_starvation_either_way(engine):
    s, t = engine.sampling_client(), engine.training_client()
    stop = threading.Event()
    sample_futures: list[rle.RequestFuture] = []

    def sampler_thread() -> None:
        # Closed loop, like agents: at most 4 samples outstanding at a time.
        while not stop.is_set():
            sample_futures.append(s.sample(prompt(), 1, params(3)))
            if len(sample_futures) >= 4:
                sample_futures[-4].result(WAIT)

    v = loaded(engine)
    th = threading.Thread(target=sampler_thread)
    th.start()
    try:
        versions, probes = [], []
        for _ in range(4):
            # A sample queued before the training round runs before it, at the
            # current version, however busy the scheduler is with blocking work.
            probes.append(s.sample(prompt(), 1, params(3)))
            t.forward_backward([datum()]).result(WAIT)
            t.optim_step(rle.AdamParams(learning_rate=0.05)).result(WAIT)
            versions.append(t.save_weights_for_sampler().result(WAIT).version)
    finally:
        stop.set()
        th.join(WAIT)
    # Training was not starved by the sampler thread's closed loop of samples...
    assert versions == [v + 1, v + 2, v + 3, v + 4]
    # ... and sampling was not starved by training: every probe ran before the install after it.
    assert [p.result(WAIT).sequences[0].versions[0] for p in probes] == [v, v + 1, v + 2, v + 3]
    results = [f.result(WAIT) for f in sample_futures]
    assert all(r.sequences[0].stop_reason in ("stop", "length") for r in results)


# -- stale requests, unload ---------------------------------------------------------------


def test_stale_sampler_fails_fast_and_never_reaches_backend(engine):
    t = engine.training_client()
    v = loaded(engine)
    v1 = t.save_weights_and_get_sampling_client(timeout=WAIT)
    v2 = t.save_weights_and_get_sampling_client(timeout=WAIT)
    assert (v1.version, v2.version) == (v + 1, v + 2)
    admitted = engine.stats()["admitted"]
    with pytest.raises(rle.ModelNotLoaded, match=f"version {v + 1} is not loaded"):
        v1.sample(prompt(), 1, params(3)).result(WAIT)
    assert engine.stats()["admitted"] == admitted
    assert v2.sample(prompt(), 1, params(3)).result(WAIT).sequences[0].versions == [v + 2] * 3


def test_unload_then_requests_fail_without_bring_up(engine):
    s, t = engine.sampling_client(), engine.training_client()
    v = loaded(engine)
    assert engine.unload().result(WAIT).unloaded is True
    assert engine.unload().result(WAIT).unloaded is False  # a no-op the second time
    with pytest.raises(rle.ModelNotLoaded, match="unloaded"):
        s.sample(prompt(), 1, params(3)).result(WAIT)
    with pytest.raises(rle.ModelNotLoaded):
        engine.lease("sess").result(WAIT)
    assert engine.stats()["version"] is None
    assert t.save_weights_for_sampler().result(WAIT).version == v + 1
    assert s.sample(prompt(), 1, params(2)).result(WAIT).sequences[0].versions == [v + 1] * 2


# -- the install gate: external leases, drain deadline ------------------------------------


def test_external_lease_holds_an_install_until_settled(engine):
    v = loaded(engine)
    lease = engine.lease("agent-1").result(WAIT)
    assert isinstance(lease, rle.Lease) and lease.session_id == "agent-1"
    install = engine.training_client().save_weights_for_sampler()
    time.sleep(0.1)
    assert not install.done()
    receipt = engine.call_on_loop(lease.settle, "completed", [0]).result(WAIT)
    assert receipt.outcome == "completed" and receipt.session_id == "agent-1"
    assert install.result(WAIT).version == v + 1


def test_drain_deadline_fails_the_install_and_engine_keeps_serving(backend, engine_config):
    with rle.Engine(engine_config(backend, drain_timeout_s=0.2)) as engine:
        lease = engine.lease("slow-agent").result(WAIT)
        with pytest.raises(rle.DrainTimeout, match="drain_timeout_s=0.2"):
            engine.training_client().save_weights_for_sampler().result(WAIT)
        resp = engine.sampling_client().sample(prompt(), 1, params(2)).result(WAIT)
        assert resp.sequences[0].versions == [0, 0]
        engine.call_on_loop(lease.settle, "completed").result(WAIT)


# -- abort --------------------------------------------------------------------------------


def test_abort_queued_and_in_flight(engine):
    s = engine.sampling_client()
    running = s.sample(prompt(), 2, params(500))
    block = engine.submit_blocking("forward", lambda: time.sleep(0.05))
    queued_sample = s.sample(prompt(), 1, params(5))
    queued_block = engine.submit_blocking("forward", lambda: "never")
    time.sleep(0.05)
    running.abort()
    queued_sample.abort()
    queued_block.abort()
    r = running.result(WAIT)
    assert [q.stop_reason for q in r.sequences] == ["abort", "abort"]
    assert all(q.length < 500 for q in r.sequences)
    q = queued_sample.result(WAIT)
    assert q.sequences[0].stop_reason == "abort" and q.sequences[0].length == 0
    with pytest.raises(rle.RequestAborted):
        queued_block.result(WAIT)
    block.result(WAIT)
    assert s.sample(prompt(), 1, params(2)).result(WAIT).sequences[0].length == 2


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "field"), [
    (lambda s: s.sample([], 1, params(2)), "prompt"),
    (lambda s: s.sample([1, -1], 1, params(2)), "prompt"),
    (lambda s: s.sample([10**6], 1, params(2)), "prompt"),
    (lambda s: s.sample(list(range(1, 10)) * 2000, 1, params(2)), "prompt.length"),
    (lambda s: s.sample([1], 0, params(2)), "num_samples"),
    (lambda s: s.sample([1], True, params(2)), "num_samples"),
    (lambda s: s.sample([1], 2.0, params(2)), "num_samples"),
    (lambda s: s.sample([1], 1, {"max_tokens": 3}), "sampling_params"),
    (lambda s: s.sample([1], 1, rle.SamplingParams(max_tokens=0)), "max_tokens"),
])
def test_invalid_sample_rejected_before_queueing(engine, call, field):
    before = engine.stats()
    with pytest.raises(rle.InvalidRequest) as info:
        call(engine.sampling_client())
    assert info.value.field == field
    after = engine.stats()
    assert after["admitted"] == before["admitted"] and after["queued"] == 0
    assert engine.sampling_client().sample(prompt(), 1, params(2)).result(WAIT).sequences[0].length == 2


@pytest.mark.parametrize(("call", "field"), [
    (lambda t: t.forward_backward([datum()], loss_fn="mse"), "loss_fn"),
    (lambda t: t.forward_backward([], loss_fn="cross_entropy"), "data"),
    (lambda t: t.forward_backward([rle.Datum(model_input=rle.ModelInput.from_ints([1, 2]),
                                             loss_fn_inputs={"target_tokens": np.array([1, 2, 3])})]),
     "data[0].loss_fn_inputs['target_tokens'].shape"),
    (lambda t: t.forward_backward([datum()], loss_fn="ppo"), "data[0].loss_fn_inputs"),
    (lambda t: t.forward_backward([datum()], loss_fn_config={"clip_low_threshold": 0.5}), "loss_fn_config"),
    (lambda t: t.optim_step({"learning_rate": 1.0}), "adam_params"),
])
def test_invalid_training_rejected_before_queueing(engine, call, field):
    with pytest.raises(rle.InvalidRequest) as info:
        call(engine.training_client())
    assert info.value.field == field
    assert engine.stats()["queued"] == 0
    engine.training_client().forward_backward([datum()]).result(WAIT)


# -- modes and threads --------------------------------------------------------------------


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_async_mode_on_callers_loop(backend, engine_config, loop_kind):
    async def main() -> None:
        async with rle.Engine(engine_config(backend)) as engine:
            assert engine.loop is asyncio.get_running_loop()
            s, t = engine.sampling_client(), engine.training_client()
            results = await asyncio.gather(*(s.sample_async(prompt(), 1, params(3 + i % 4)) for i in range(20)))
            assert [r.sequences[0].length for r in results] == [3 + i % 4 for i in range(20)]
            fb = await (await t.forward_backward_async([datum()])).result_async(WAIT)
            assert fb.metrics["loss:sum"] > 0
            sampler = await t.save_weights_and_get_sampling_client_async()
            resp = await sampler.sample_async(prompt(), 1, params(2))
            assert resp.sequences[0].versions == [1, 1]
            with pytest.raises(rle.RLEngineError, match="aclose"):
                engine.close()
        assert engine.state == "closed"

    loop = new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), WAIT))
    finally:
        loop.close()


def test_submissions_from_many_threads(engine):
    s, t = engine.sampling_client(), engine.training_client()
    futures: list[list[rle.RequestFuture]] = [[] for _ in range(8)]

    def submit(k: int) -> None:
        for i in range(40):
            futures[k].append(s.sample(prompt(1 + k, 2 + i % 5), 1, params(1 + i % 3, seed=k * 100 + i)))

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    training = [t.forward_backward([datum()]) for _ in range(5)]
    for th in threads:
        th.join(WAIT)
    flat = [f for fs in futures for f in fs]
    assert len({f.request_id for f in flat}) == 320
    for k, fs in enumerate(futures):
        for i, f in enumerate(fs):
            assert f.result(WAIT).sequences[0].length == 1 + i % 3
    for f in training:
        f.result(WAIT)


def test_settled_requests_are_freed_and_a_closed_engine_too():
    # Per-request records are untracked Structs: a reference cycle among them would
    # never be collected, keeping every request (and through its future, the engine).
    import gc
    import weakref

    def live_futures() -> int:
        return sum(type(o) is rle.RequestFuture for o in gc.get_objects())

    engine = rle.Engine(rle.EngineConfig(backend="sim"))
    with engine:
        before = live_futures()
        futures = [engine.sample([1, 2, 3], 2, rle.SamplingParams(max_tokens=8)) for _ in range(500)]
        aborted = [engine.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=64)) for _ in range(20)]
        for f in aborted:
            f.abort()
        assert all(len(f.result(WAIT).sequences) == 2 for f in futures)
        assert all(len(f.result(WAIT).sequences) == 1 for f in aborted)
        del futures, aborted, f
        gc.collect()
        assert live_futures() <= before
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


def test_streamed_token_batches_are_the_consumers_to_keep():
    """``on_tokens`` gets each report once, and what it was given never changes afterwards: the
    sequence must not take over (and then extend) the array a streaming consumer holds. (Before,
    the first report's array grew with later tokens: a stream that kept it read them twice, "Leet
    me check." for "Let me check.")"""
    cfg = rle.EngineConfig(backend="sim", sim=rle.SimConfig(gen_len=10_000, step_time_s=0.001))
    kept: list[tuple[int, ...]] = []
    seen: list[object] = []

    def on_tokens(index: int, ids, _lps, _version: int) -> None:
        seen.append(ids)  # held, as a queue of a streaming server holds it
        kept.append(tuple(ids))

    with rle.Engine(cfg) as e:
        spec = e.validate_sample(prompt(1, 2, 3), 1, rle.SamplingParams(max_tokens=12))
        out = e.submit_sample(spec, on_tokens=on_tokens).result(30)
    tokens = list(out.sequences[0].tokens)
    assert len(kept) > 1 and [t for batch in kept for t in batch] == tokens
    assert [tuple(ids) for ids in seen] == kept  # nothing it was handed grew later
