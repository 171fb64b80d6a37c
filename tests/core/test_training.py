"""Training beside sampling (``EngineConfig.train_concurrently``, ``rlengine.core.training``).

On the sim backend and trainer, whose internals can be read: with the lane a
training call runs while a long generation is in flight (without it, the call
waits for the sampler to drain); the calls keep their order; a weight install
takes the trainer's weights after the calls queued before it, and a later
update does not reach the installed copy; closing fails the queued calls at
once; the lane is refused beside a CUDA sampler and absent by default.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import rlengine as rle
from rlengine.backends.sim import SimBackend
from rlengine.config import SimConfig
from rlengine.errors import ConfigurationError, EngineClosed

WAIT = 30.0


def sim_engine(mode: str, **overrides) -> rle.Engine:
    sim = rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.002, **overrides.pop("sim", {})})
    return rle.Engine(rle.EngineConfig(backend="sim", sim=sim, train_concurrently=mode, **overrides))


def datum(target: int = 7) -> rle.Datum:
    return rle.Datum(model_input=rle.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": np.array([target] * 3)})


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_training_call_runs_while_a_generation_is_in_flight_only_on_the_lane(mode):
    with sim_engine(mode) as engine:
        sampler, trainer = engine.sampling_client(), engine.training_client()
        generation = sampler.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=400, seed=1))
        assert "loss:sum" in trainer.forward_backward([datum()]).result(WAIT).metrics
        # On the lane the call finished with the generation still running (400 steps of 2 ms);
        # as blocking work it waited for the sampler to drain.
        assert generation.done() is (mode == "off")
        assert generation.result(WAIT).sequences[0].length == 400
        assert ("train_busy_s" in engine.stats()) is (mode == "on")


def test_training_calls_keep_their_order_and_an_install_takes_the_weights_after_them():
    with sim_engine("on") as engine:
        trainer = engine.training_client()
        trainer.forward_backward([datum(5)])
        trainer.optim_step(rle.AdamParams(learning_rate=0.5))
        seen = engine.submit_training("peek", lambda: engine.get_trainer().theta.copy())
        install = trainer.save_weights_for_sampler()
        # Queued behind the install: it must not change what the install copies.
        trainer.forward_backward([datum(9)])
        later = trainer.optim_step(rle.AdamParams(learning_rate=0.5))
        assert install.result(WAIT).version == 1
        later.result(WAIT)
        installed = engine.backend._theta.copy()
        np.testing.assert_array_equal(installed, seen.result(WAIT).astype(np.float32))
        trained = engine.get_trainer().theta
        assert not np.allclose(installed, trained)  # the later update stays the trainer's
        assert trainer.save_weights_for_sampler().result(WAIT).version == 2
        np.testing.assert_array_equal(engine.backend._theta, trained.astype(np.float32))


def test_closing_fails_queued_training_calls_at_once_and_leaves_no_thread():
    before = {t.name for t in threading.enumerate()}
    engine = sim_engine("on").start()
    trainer = engine.training_client()
    gate, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(WAIT)

    first = engine.submit_training("hold", hold)
    queued = [trainer.forward_backward([datum()]) for _ in range(3)]
    assert started.wait(WAIT)
    closer = threading.Thread(target=engine.close, args=(WAIT,))
    closer.start()
    for f in queued:
        with pytest.raises(EngineClosed):
            f.result(WAIT)
    gate.set()
    closer.join(WAIT)
    assert first.result(WAIT) is True
    with pytest.raises(EngineClosed):
        trainer.forward_backward([datum()]).result(WAIT)
    assert {t.name for t in threading.enumerate()} - before == set()


class CudaSim(SimBackend):
    """The sim backend claiming a CUDA device (the lane must not run beside it)."""

    def describe(self) -> dict:
        return {"device": "cuda:0"}


def test_the_lane_is_refused_beside_a_cuda_sampler_and_skipped_by_auto():
    with pytest.raises(ConfigurationError, match="train_concurrently='on'"):
        rle.Engine(rle.EngineConfig(backend="sim", train_concurrently="on"),
                   backend=CudaSim(SimConfig())).start()
    with rle.Engine(rle.EngineConfig(backend="sim", train_concurrently="auto"), backend=CudaSim(SimConfig())) as eng:
        assert "train_busy_s" not in eng.stats()
        eng.training_client().forward_backward([datum()]).result(WAIT)
    with pytest.raises(ConfigurationError, match="train_concurrently"):
        rle.EngineConfig(train_concurrently="yes")
