"""The hang watch (``rlengine.core.hangs``): a stuck call is dumped once, an idle engine never.

A backend whose step blocks on an event (the injected hang) must yield,
within the timeout plus a second, a dump that names the stuck call (the
compute thread's function and its stack down to the blocking function) and
lists the requests in flight; the watch dumps once per hang and re-arms on
the next progress. Stuck blocking work and a stuck training-lane call are
named too. An engine with nothing pending is never dumped, however long it
idles. A sandbox pool's workers appear with the episode each one plays.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
import time
from pathlib import Path

import pytest

import rlengine as rle
from rlengine.backends.sim import SimBackend
from rlengine.core.hangs import HangWatch, task_stacks
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig

N = 1.0
"""The timeout of these tests (seconds)."""
WAIT = 30.0
"""The tests' own bound on any wait (a dump typically comes 1-1.5 s after the hang)."""


def config(**engine) -> rle.EngineConfig:
    return rle.EngineConfig(backend="sim", sim=rle.SimConfig(gen_len=10_000, step_time_s=0.002), **engine)


class StuckBackend(SimBackend):
    """A sim backend whose ``step`` blocks in ``hold_the_step`` while ``armed``, until released."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.armed = False
        self.release = threading.Event()
        self.stuck_at: float | None = None

    def step(self):
        if self.armed:
            self.stuck_at = time.monotonic()
            self.hold_the_step()
        return super().step()

    def hold_the_step(self) -> None:
        self.release.wait(WAIT)


def wait_for_dumps(hangs: HangWatch, n: int) -> list[dict]:
    deadline = time.monotonic() + WAIT
    while len(hangs.dumps) < n:
        assert time.monotonic() < deadline, f"no dump {n} within {WAIT} s"
        time.sleep(0.02)
    return [json.loads(Path(path).read_text(encoding="utf-8")) for path in hangs.dumps]


def stack(dump: dict, thread: dict) -> list[str]:
    """The functions on the stack of ``thread`` (a ``ComputeThread.snapshot``), outermost first."""
    (found,) = [t for t in dump["threads"] if t["ident"] == thread["ident"]]
    assert found["name"] == thread["thread"]
    return [frame["function"] for frame in found["stack"]]


def test_a_stuck_backend_step_is_dumped_within_the_timeout_and_once_per_hang(tmp_path, capfd):
    backend = StuckBackend(config().sim)
    with rle.Engine(config(), backend=backend) as engine, \
            HangWatch(str(tmp_path), prog="test", timeout_s=N) as hangs:
        hangs.watch("engine", engine)
        sampler = engine.sampling_client()
        futures = [sampler.sample([1], 1, rle.SamplingParams(max_tokens=100_000)) for _ in range(3)]
        time.sleep(0.2)  # the requests run (and progress) before the hang
        backend.armed = True
        (dump,) = wait_for_dumps(hangs, 1)
        assert backend.stuck_at is not None
        assert dump["monotonic"] - backend.stuck_at <= N + 1  # the bound; typically N + 0.3 s
        assert dump["reason"].startswith("no progress for ")
        stuck = dump["engine"]["compute"]
        assert stuck["thread"] == "rlengine-compute" and stuck["running"] == "SamplerLoop._step_job"
        assert stuck["running_s"] >= N
        assert "hold_the_step" in stack(dump, stuck)
        assert {r["request_id"] for r in dump["engine"]["requests"]} == {f.request_id for f in futures}
        assert all(r["state"] == "active" and r["age_s"] > N for r in dump["engine"]["requests"])
        assert dump["engine"]["gate"]["leases_active"] == 3
        # Once per hang: still stuck two timeouts later, still one dump.
        time.sleep(2 * N + 0.5)
        assert len(hangs.dumps) == 1
        # Progress re-arms it: released, the engine steps again; a second hang is a second dump.
        backend.armed = False
        backend.release.set()
        time.sleep(N)  # several polls see the steps
        backend.release.clear()
        backend.armed = True
        second = wait_for_dumps(hangs, 2)[1]
        assert "hold_the_step" in stack(second, second["engine"]["compute"])
        backend.armed = False
        backend.release.set()
    lines = [line for line in capfd.readouterr().err.splitlines() if "hang dump" in line]
    assert len(lines) == 2  # one line per dump, naming its file
    assert all(line.startswith("test: possible hang, no progress for ") and line.endswith(f"written to {path}")
               for line, path in zip(lines, hangs.dumps))


@pytest.mark.parametrize("lane", [False, True], ids=["blocking work", "training lane"])
def test_a_stuck_training_call_is_named(tmp_path, lane):
    release = threading.Event()

    def forward_backward_that_never_returns():
        release.wait(WAIT)

    with rle.Engine(config(train_concurrently="on" if lane else "off")) as engine, \
            HangWatch(str(tmp_path), prog="test", timeout_s=N) as hangs:
        hangs.watch("engine", engine)
        future = engine.submit_training("forward_backward", forward_backward_that_never_returns)
        (dump,) = wait_for_dumps(hangs, 1)
        release.set()
        future.result(WAIT)
    if lane:
        call = dump["engine"]["training_lane"]
        assert call["thread"] == "rlengine-trainer" and call["pending"] == 1
    else:
        call = dump["engine"]["compute"]
        assert dump["engine"]["blocking"]["kind"] == "forward_backward"
        assert dump["engine"]["gate"]["sealed"]
    assert call["running"].endswith("forward_backward_that_never_returns") and call["running_s"] >= N
    assert "forward_backward_that_never_returns" in stack(dump, call)


def test_an_idle_engine_is_never_dumped(tmp_path):
    with rle.Engine(config()) as engine, HangWatch(str(tmp_path), prog="test", timeout_s=N / 2) as hangs:
        hangs.watch("engine", engine)
        sampler = engine.sampling_client()
        sampler.sample([1], 1, rle.SamplingParams(max_tokens=4)).result(WAIT)
        time.sleep(4 * N / 2)  # idle for four timeouts
        # Idle time does not count toward a hang: new work right after it is no hang either.
        sampler.sample([1], 1, rle.SamplingParams(max_tokens=4)).result(WAIT)
        time.sleep(N / 2)
        assert engine.progress()[1] == 0
    assert hangs.dumps == [] and list(tmp_path.iterdir()) == []


def test_a_dump_on_request_and_the_timeout_settings(tmp_path):
    with pytest.raises(ConfigurationError, match="hang_timeout_s=-1"):
        HangWatch(str(tmp_path), prog="test", timeout_s=-1)
    with pytest.raises(ConfigurationError, match="hang_timeout_s=-2"):
        TrainConfig(hang_timeout_s=-2)
    auto = HangWatch(str(tmp_path), prog="test")
    assert auto.timeout_s == 120.0
    auto.longest_quiet_s = 30.0
    assert auto.timeout_s == 300.0  # 10x the longest quiet spell, once above the floor
    with HangWatch(str(tmp_path), prog="test", timeout_s=0) as off:  # 0: on request only
        off.request_dump("asked")
        (dump,) = wait_for_dumps(off, 1)
    assert dump["reason"] == "asked" and dump["timeout_s"] == 0
    assert "rlengine-hang-watch" in {t["name"] for t in dump["threads"]}


WORKER = textwrap.dedent("""
    import asyncio
    from rlengine.rl.sandbox import worker_main

    async def play(client, job):
        await asyncio.sleep(3600)

    worker_main(play)
""")


def test_a_dump_lists_the_sandbox_workers_and_the_episodes_they_play(tmp_path, monkeypatch):
    from rlengine.rl.sandbox_pool import SandboxPool, running_snapshots
    from rlengine.serve import ServeConfig, Server

    (tmp_path / "stuck_sandbox.py").write_text(WORKER)
    tmp_path.chmod(0o755)  # a root trainer's workers run under uids of their own
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    async def main() -> dict:
        async with rle.Engine(config()) as engine, Server(engine, ServeConfig(http=False)) as server:
            pool = SandboxPool("stuck_sandbox", 1, job_timeout_s=WAIT, grace_s=0.5)
            await pool.start(server.ipc_path)
            try:
                loop = asyncio.get_running_loop()
                with HangWatch(str(tmp_path / "dumps"), prog="test", timeout_s=0) as hangs:
                    hangs.add_source("sandboxes", running_snapshots)
                    hangs.add_source("tasks", lambda: task_stacks(loop))
                    episode = asyncio.create_task(pool.run({"task": "t", "session": "s-7"}), name="episode")
                    await asyncio.sleep(0.2)
                    hangs.request_dump("asked")
                    while not hangs.dumps:
                        await asyncio.sleep(0.02)
                    episode.cancel()
                    return json.loads(Path(hangs.dumps[0]).read_text(encoding="utf-8"))
            finally:
                await pool.aclose()
                assert running_snapshots() == []

    dump = asyncio.run(asyncio.wait_for(main(), WAIT))
    (pool,) = dump["sandboxes"]
    (worker,) = pool["workers"]
    assert worker["alive"] and worker["pid"] > 0
    (job,) = worker["jobs"]
    assert job["session"] == "s-7" and job["age_s"] > 0
    (task,) = [t for t in dump["tasks"] if t["name"] == "episode"]
    assert [f["function"] for f in task["stack"]] == ["run"] and "Future pending" in task["awaiting"]
