"""Drain policies and sampling modes on the sim backend, whose internals can be checked.

* ``pause``: in-flight samples are aborted before blocking work, their tokens
  kept, and continued on the new weights; each token carries its version.
* ``RLENGINE_CONTINUOUS_SAMPLING=0``: serial batch waves, the benchmark baseline.
* sleep/wake around blocking work, observed in the sim backend's event log.
* the poison barrier with a backend that fails one request mid-generation.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import rlengine as rle
from rlengine.backends.base import RequestOutput
from rlengine.backends.sim import SimBackend

WAIT = 30.0


def sim_engine(**overrides) -> rle.Engine:
    sim = rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.002, **overrides.pop("sim", {})})
    return rle.Engine(rle.EngineConfig(backend="sim", sim=sim, **overrides))


def datum() -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": np.array([7, 7, 7])})


def sim_logp(theta: np.ndarray) -> np.ndarray:
    t = theta.astype(np.float64)
    return t - t.max() - np.log(np.exp(t - t.max()).sum())


def test_pause_continues_in_flight_samples_on_new_weights():
    with sim_engine(drain_policy="pause") as engine:
        s, t = engine.sampling_client(), engine.training_client()
        t.forward_backward([datum()]).result(WAIT)
        t.optim_step(rle.AdamParams(learning_rate=0.5)).result(WAIT)
        fut = s.sample([1, 2, 3], 2, rle.SamplingParams(max_tokens=120, seed=3))
        time.sleep(0.06)
        assert not fut.done()
        install = t.save_weights_for_sampler()
        resp = fut.result(WAIT)
        assert install.result(WAIT).version == 1
        new_logp = sim_logp(engine._trainer.theta)
        for seq in resp.sequences:
            v = seq.versions_array()
            assert seq.length == 120 and seq.stop_reason == "length"
            k = int((v == 0).sum())
            assert 0 < k < 120, "the install happened mid-generation"
            assert (v[:k] == 0).all() and (v[k:] == 1).all()
            # Tokens after the pause were produced by the new weights.
            np.testing.assert_allclose(seq.logprobs_array()[k:], new_logp[seq.tokens_array()[k:]], atol=1e-5)
            assert not np.allclose(seq.logprobs_array()[:k], new_logp[seq.tokens_array()[:k]], atol=1e-5)


def test_wait_policy_drains_instead():
    with sim_engine() as engine:
        s, t = engine.sampling_client(), engine.training_client()
        fut = s.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=60))
        time.sleep(0.03)
        install = t.save_weights_for_sampler()
        assert fut.result(WAIT).sequences[0].versions == [0] * 60
        assert install.result(WAIT).version == 1


def test_pause_keeps_partial_tokens_on_abort():
    with sim_engine(drain_policy="pause") as engine:
        fut = engine.sampling_client().sample([1], 1, rle.SamplingParams(max_tokens=500))
        time.sleep(0.05)
        fut.abort()
        seq = fut.result(WAIT).sequences[0]
        assert seq.stop_reason == "abort" and 0 < seq.length < 500
        assert seq.versions == [0] * seq.length


@pytest.mark.parametrize(("env", "together"), [("0", True), ("1", False)])
def test_continuous_sampling_env_opt_out(monkeypatch, env, together):
    monkeypatch.setenv("RLENGINE_CONTINUOUS_SAMPLING", env)
    with sim_engine() as engine:
        s = engine.sampling_client()
        steps_at = {}
        long = s.sample([1], 1, rle.SamplingParams(max_tokens=40))
        short = s.sample([1], 1, rle.SamplingParams(max_tokens=2))
        for name, f in (("long", long), ("short", short)):
            f.add_done_callback(lambda _f, name=name: steps_at.__setitem__(name, engine.stats()["steps"]))
        assert long.result(WAIT).sequences[0].length == 40
        assert short.result(WAIT).sequences[0].length == 2
        if together:  # the wave completes together
            assert steps_at["short"] == steps_at["long"]
        else:
            assert steps_at["short"] < steps_at["long"] - 30


def test_bad_env_value_is_a_configuration_error(monkeypatch):
    monkeypatch.setenv("RLENGINE_CONTINUOUS_SAMPLING", "maybe")
    with pytest.raises(rle.ConfigurationError, match="RLENGINE_CONTINUOUS_SAMPLING"):
        sim_engine().start()


def test_sampler_sleeps_around_blocking_work_and_wakes_once():
    with sim_engine() as engine:
        s, t = engine.sampling_client(), engine.training_client()
        s.sample([1], 1, rle.SamplingParams(max_tokens=5)).result(WAIT)
        engine.backend.events.clear()
        futures = [t.forward_backward([datum()]), t.optim_step(), t.save_weights_for_sampler()]
        for f in futures:
            f.result(WAIT)
        s.sample([1], 1, rle.SamplingParams(max_tokens=3)).result(WAIT)
        kinds = [e[0] for e in engine.backend.events]
        first_step = kinds.index("step")
        # Queued back to back, the three items share one sleep and one wake.
        assert kinds[:first_step] == ["sleep", "load_weights", "wake_up"]


def test_sleep_not_supported_is_reported_not_faked():
    with sim_engine(sim={"sleep_supported": False}) as engine:
        assert engine.backend.capabilities.sleep is False
        assert "sleep_supported" in engine.backend.capabilities.why_not_sleep
        engine.training_client().save_weights_for_sampler().result(WAIT)
        assert [e[0] for e in engine.backend.events if e[0] in ("sleep", "wake_up")] == []


class FailingBackend(SimBackend):
    """Fails any request whose prompt contains token 13, after its first token."""

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        for out in outs:
            seq_prompt = self._prompts.get(out.request_id)
            if seq_prompt is not None and 13 in seq_prompt:
                out.error = "injected fault"
                out.finished = True
        return outs

    def add_request(self, request) -> None:
        super().add_request(request)
        self._prompts[request.request_id] = np.frombuffer(request.prompt, dtype=np.int32).tolist()

    def __init__(self, config) -> None:
        super().__init__(config)
        self._prompts: dict[str, list[int]] = {}


def test_unknown_outcome_poisons_installs_until_written_off():
    cfg = rle.EngineConfig(backend="sim", sim=rle.SimConfig(gen_len=10_000, step_time_s=0.001))
    with rle.Engine(cfg, backend=FailingBackend(cfg.sim)) as engine:
        s, t = engine.sampling_client(), engine.training_client()
        ok = s.sample([1, 2], 1, rle.SamplingParams(max_tokens=20), session_id="fine")
        bad = s.sample([1, 13], 1, rle.SamplingParams(max_tokens=20), session_id="agent-13")
        with pytest.raises(rle.BackendRequestError, match="injected fault"):
            bad.result(WAIT)
        assert ok.result(WAIT).sequences[0].length == 20
        with pytest.raises(rle.GatePoisoned) as info:
            t.save_weights_for_sampler().result(WAIT)
        ((lease_id, session, reason),) = info.value.leases
        assert session == "agent-13" and "injected fault" in reason
        # The engine keeps serving while poisoned, on the old version.
        assert s.sample([1], 1, rle.SamplingParams(max_tokens=2)).result(WAIT).sequences[0].versions == [0, 0]
        receipt = engine.write_off(lease_id).result(WAIT)
        assert receipt.outcome == "written_off" and receipt.session_id == "agent-13"
        assert t.save_weights_for_sampler().result(WAIT).version == 1
        completed = [r for r in engine.scheduler.receipts if r.session_id == "fine"]
        assert completed[0].outcome == "completed" and completed[0].versions == [0]
