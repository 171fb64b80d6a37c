"""Faults and shutdown: nothing hangs, every request settles exactly once.

Engine death (a backend crash) fails every pending and every new future at
once; a closed engine refuses work; a stuck blocking item cannot hold
``close`` beyond its timeout; a failing training call fails only itself.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import rlengine as rle
from rlengine.backends.sim import SimBackend

WAIT = 30.0


def sim_config(**sim) -> rle.EngineConfig:
    return rle.EngineConfig(backend="sim", sim=rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.002, **sim}))


class CrashingBackend(SimBackend):
    """Raises from ``step`` once armed: the engine must die, not hang."""

    armed = False

    def step(self):
        if self.armed:
            raise RuntimeError("GPU fell off the bus")
        return super().step()


def params(n: int) -> rle.SamplingParams:
    return rle.SamplingParams(max_tokens=n)


def test_backend_crash_kills_engine_and_fails_everything_fast():
    cfg = sim_config()
    backend = CrashingBackend(cfg.sim)
    with rle.Engine(cfg, backend=backend) as engine:
        s, t = engine.sampling_client(), engine.training_client()
        in_flight = [s.sample([1], 1, params(1000)) for _ in range(5)]
        queued_block = engine.submit_blocking("forward", lambda: None)
        queued = s.sample([1], 1, params(3))
        time.sleep(0.02)
        backend.armed = True
        t0 = time.monotonic()
        for f in [*in_flight, queued_block, queued]:
            with pytest.raises(rle.EngineDeadError, match="GPU fell off the bus"):
                f.result(WAIT)
        assert time.monotonic() - t0 < 20  # typically 0.01 s; a hang would be WAIT (30 s) per future
        assert engine.state == "dead"
        late = s.sample([1], 1, params(3))
        with pytest.raises(rle.EngineDeadError):
            late.result(0.5)
        with pytest.raises(rle.EngineDeadError):
            t.forward_backward([rle.Datum(model_input=rle.ModelInput.from_ints([1]),
                                          loss_fn_inputs={"target_tokens": np.array([2])})]).result(0.5)
    assert engine.state == "dead"


def test_close_settles_queued_and_in_flight_work():
    engine = rle.Engine(sim_config()).start()
    s = engine.sampling_client()
    running = s.sample([1], 1, params(1000))
    block = engine.submit_blocking("forward", lambda: time.sleep(0.1))
    queued_sample = s.sample([1], 1, params(3))
    queued_block = engine.submit_blocking("forward", lambda: "never")
    time.sleep(0.02)
    t0 = time.monotonic()
    engine.close(timeout=10)
    assert time.monotonic() - t0 < 10  # typically 0.1 s: aborted, not run to the end
    assert running.result(0).sequences[0].stop_reason == "abort"
    assert queued_sample.result(0).sequences[0].stop_reason == "abort"
    for f in (block, queued_block):  # both still queued behind the draining sample
        with pytest.raises(rle.EngineClosed):
            f.result(0)
    assert engine.state == "closed"
    with pytest.raises(rle.EngineClosed):
        s.sample([1], 1, params(3)).result(0.5)
    with pytest.raises(rle.EngineClosed):
        engine.call_on_loop(lambda: 1).result(0.5)
    engine.close()  # idempotent


def test_close_is_bounded_even_with_stuck_blocking_work():
    engine = rle.Engine(sim_config()).start()
    release = threading.Event()
    stuck = engine.submit_blocking("forward_backward", lambda: release.wait(20))
    time.sleep(0.05)
    t0 = time.monotonic()
    engine.close(timeout=0.3)
    assert time.monotonic() - t0 < 15  # typically 0.3 s (the close timeout); the stuck work waits 20 s
    with pytest.raises(rle.EngineClosed, match="did not close"):
        stuck.result(0)
    release.set()


def test_training_error_fails_only_that_call():
    with rle.Engine(sim_config()) as engine:
        t = engine.training_client()
        bad = engine.submit_blocking("forward_backward", lambda: 1 / 0)
        good = t.optim_step()
        with pytest.raises(ZeroDivisionError):
            bad.result(WAIT)
        assert good.result(WAIT).metrics is not None
        assert engine.sampling_client().sample([1], 1, params(2)).result(WAIT).sequences[0].length == 2
        assert engine.state == "running"


def test_start_failure_raises_and_leaves_nothing_running():
    class Exploding(SimBackend):
        def __init__(self, config):
            raise OSError("no such device")

    import rlengine.backends.sim as sim_module

    threads_before = {t.name for t in threading.enumerate()}
    original = sim_module.build
    sim_module.build = lambda config, model_path=None: Exploding(config.sim)
    try:
        with pytest.raises(OSError, match="no such device"):
            rle.Engine(sim_config()).start(timeout=WAIT)
    finally:
        sim_module.build = original
    time.sleep(0.2)
    leftover = {t.name for t in threading.enumerate()} - threads_before
    assert "rlengine-loop" not in leftover


def test_engine_starts_once():
    engine = rle.Engine(sim_config()).start()
    try:
        with pytest.raises(rle.RLEngineError, match="starts once"):
            engine.start()
    finally:
        engine.close()


def test_async_close_with_in_flight_requests():
    async def main() -> None:
        engine = rle.Engine(sim_config())
        await engine.start_async()
        f = engine.sampling_client().sample([1], 1, params(1000))
        await asyncio.sleep(0.02)
        await engine.aclose(timeout=5)
        assert (await f).sequences[0].stop_reason == "abort"
        with pytest.raises(rle.EngineClosed):
            await engine.sampling_client().sample([1], 1, params(2))

    asyncio.run(asyncio.wait_for(main(), WAIT))


def test_dead_engine_reports_the_cause():
    cfg = sim_config()
    backend = CrashingBackend(cfg.sim)
    with rle.Engine(cfg, backend=backend) as engine:
        backend.armed = True
        f = engine.sampling_client().sample([1], 1, params(5))
        err = f.exception(WAIT)
        assert isinstance(err, rle.EngineDeadError)
        assert isinstance(err.__cause__, RuntimeError)
