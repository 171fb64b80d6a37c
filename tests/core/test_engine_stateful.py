"""Random interleavings against a live engine: every request settles exactly once.

A hypothesis state machine submits samples (following the latest version or
pinned to one), training calls, weight installs, unloads and aborts, and may
close the engine midway. At the end every future must have settled within a
bound (no wait is unbounded), every done-callback must have run exactly once,
and each outcome must be one the semantics allow: right versions, right
lengths, and only the typed errors the situation explains.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import rlengine as rle

BOUND = 20.0


def datum() -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": np.array([3, 4])})


class EngineMachine(RuleBasedStateMachine):
    drain_policy = "wait"

    def __init__(self) -> None:
        super().__init__()
        sim = rle.SimConfig(gen_len=6, gen_len_dist="lognormal", step_time_s=0.0003)
        self.engine = rle.Engine(rle.EngineConfig(backend="sim", sim=sim, drain_policy=self.drain_policy,
                                                  close_timeout_s=BOUND)).start()
        self.sampler = self.engine.sampling_client()
        self.trainer = self.engine.training_client()
        self.records: list[tuple[str, rle.RequestFuture, dict]] = []
        self.callbacks: dict[str, int] = {}
        self.installs_submitted = 0
        self.closed = False
        self.unloads = 0

    def _track(self, kind: str, future: rle.RequestFuture, **meta) -> None:
        self.callbacks[future.request_id] = 0

        def count(f: rle.RequestFuture) -> None:
            self.callbacks[f.request_id] += 1

        future.add_done_callback(count)
        self.records.append((kind, future, {"closed_before": self.closed, "unloads": self.unloads, **meta}))

    @rule(n=st.integers(1, 3), max_tokens=st.integers(1, 12), pin=st.sampled_from(["latest", "newest", "old"]))
    def sample(self, n, max_tokens, pin):
        k = self.installs_submitted
        version = {"latest": None, "newest": k, "old": max(k - 1, 0)}[pin]
        client = rle.SamplingClient(self.engine, version)
        self._track("sample", client.sample([1, 2, 3], n, rle.SamplingParams(max_tokens=max_tokens)),
                    n=n, max_tokens=max_tokens, pinned=version)

    @rule()
    def forward_backward(self):
        self._track("blocking", self.trainer.forward_backward([datum()]))

    @rule()
    def optim_step(self):
        self._track("blocking", self.trainer.optim_step(rle.AdamParams(learning_rate=0.05)))

    @rule()
    def install(self):
        self.installs_submitted += 1
        self._track("install", self.trainer.save_weights_for_sampler())

    @rule()
    def unload(self):
        self.unloads += 1
        self._track("blocking", self.engine.unload())

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def abort(self, data):
        _, future, meta = self.records[data.draw(st.integers(0, len(self.records) - 1))]
        meta["aborted"] = True
        future.abort()

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def wait_for_one(self, data):
        _, future, _ = self.records[data.draw(st.integers(0, len(self.records) - 1))]
        future.exception(BOUND)

    @rule(roll=st.integers(0, 9))
    def close(self, roll):
        if roll == 0 and not self.closed:  # rarely: most runs should get somewhere first
            self.closed = True
            self.engine.close()

    def teardown(self) -> None:
        self.engine.close()
        versions_seen = []
        for kind, future, meta in self.records:
            exc = future.exception(BOUND)  # raises RequestTimeout if it never settled
            assert future.done()
            event(f"{kind}: {type(exc).__name__ if exc else 'ok'}")
            assert self.callbacks[future.request_id] == 1, (kind, future)
            if exc is not None:
                allowed: tuple[type[BaseException], ...] = (rle.EngineClosed,)
                if meta.get("aborted"):
                    allowed += (rle.RequestAborted,)
                if kind == "sample":
                    allowed += (rle.ModelNotLoaded,)
                if kind == "install":
                    allowed += (rle.ModelNotLoaded,)
                assert isinstance(exc, allowed), (kind, meta, exc)
                if meta["closed_before"]:
                    assert isinstance(exc, rle.EngineClosed)
                continue
            assert not meta["closed_before"], "work submitted after close must fail"
            if kind != "sample":
                continue
            response = future.result(0)
            assert len(response.sequences) == meta["n"]
            for seq in response.sequences:
                assert seq.length <= meta["max_tokens"]
                assert seq.stop_reason in ("length", "stop", "abort")
                if seq.stop_reason != "abort":
                    assert seq.length >= 1
                v = seq.versions_array()
                if v.size:
                    if meta["pinned"] is not None:
                        assert (v == meta["pinned"]).all()
                    if self.drain_policy == "wait":
                        assert (v == v[0]).all(), "a trajectory mixed versions under the wait policy"
                    assert (np.diff(v) >= 0).all()
                    versions_seen.extend(v.tolist())
        if versions_seen:
            assert max(versions_seen) <= self.installs_submitted


class PauseEngineMachine(EngineMachine):
    drain_policy = "pause"


_settings = settings(max_examples=200, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = _settings
TestPauseEngineMachine = PauseEngineMachine.TestCase
TestPauseEngineMachine.settings = _settings
