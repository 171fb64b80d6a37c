"""Crashing sandboxes (issue 31, item 5): a game that crashes costs that game only.

Games run in their worker's process; a crash takes the worker and the games
in flight there, which are played again in quarantine (each in a process of
its own): the crasher crashes alone, the others finish.

Real parts throughout: worker processes started with ``python -m`` (the
guess game's own, or small ones written here), the engine's IPC server on a
unix socket, a real torch model where games are played, SIGKILL from
outside. Each test reproduces a failure measured on the code before the
fix: ``crash_every=5 sandboxes=2`` failed 16 of 32 attempts (every game of a
crashed worker); a killed worker failed its games in flight; a crash failed
every game beside it; a worker that cannot start was "started" anyway and
failed every episode one by one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import textwrap
from pathlib import Path

import pytest

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.core.engine import Engine
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.recipes.guess_sandbox import ALPHABET
from rlengine.rl.rollouts import run_episode
from rlengine.rl.run import train
from rlengine.rl.sandbox import SandboxError, SandboxPool, SandboxUnavailable, SessionEnv
from rlengine.rl.types import AgentEnv
from rlengine.serve.server import ServeConfig, Server
from rlengine.types import SamplingParams

HELD = textwrap.dedent("""
    import asyncio, os
    from rlengine.rl.recipes.guess_sandbox import play as guess
    from rlengine.rl.sandbox import worker_main

    class Held:
        # The game's session, whose turns after the first wait for the task's gate file, after
        # marking that the game got there: a kill then lands mid-game, by construction.
        def __init__(self, session, task):
            self.session, self.task = session, task

        async def generate(self, tokens, **params):
            if len(tokens) > 1:
                mark = os.path.join(self.task["marks"], self.session.session_id)
                if not os.path.exists(mark):
                    open(mark, "w").close()
                while not os.path.exists(self.task["gate"]):
                    await asyncio.sleep(0.01)
            return await self.session.generate(tokens, **params)

        def __getattr__(self, name):
            return getattr(self.session, name)

    class Client:
        def __init__(self, client, task):
            self.client, self.task = client, task

        def session(self, session_id, token):
            return Held(self.client.session(session_id, token), self.task)

    async def play(client, job):
        return await guess(Client(client, job["task"]), job)

    if __name__ == "__main__":
        worker_main(play)
""")


def worker_module(tmp_path, monkeypatch, name, source):
    """``source`` as the importable module ``name``, for a pool's workers."""
    (tmp_path / f"{name}.py").write_text(source)
    tmp_path.chmod(0o755)  # a root trainer's workers run under uids of their own
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return name


@pytest.mark.model_plane
@pytest.mark.slow
def test_crash_every_5_fails_the_crashing_games_only(tmp_path, model_cache):
    """The issue's reproduction, small: ``rlengine train guess crash_every=5 sandboxes=2``.
    Before the fix a crash took its worker and every game on it: 16 of 32 attempts failed."""
    outcome = train("guess", {"steps": 2, "groups_per_batch": 4, "group_size": 4, "eval_every": 0,
                              "checkpoint_every": 0, "backend": "torch", "cache_dir": model_cache,
                              "crash_every": 5, "sandboxes": 2}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    steps = read_jsonl(outcome.metrics_path)
    attempts = 2 * 4 * 4
    failed = sum(s["attempts_failed"] for s in steps)
    # Every 5th game exits before its second guess (one that ended at its first guess never
    # gets there); every other game succeeds.
    assert 0 < failed <= attempts // 5, [s["attempts_failed"] for s in steps]
    assert failed == sum(s["attempts_failed_crash"] for s in steps)
    failures = [f for g in read_jsonl(str(tmp_path / "groups.jsonl")) for f in g.get("failures", [])]
    assert len(failures) == failed
    assert all(f["kind"] == "crash" and f["stage"] == "agent" and "exited with code 3" in f["message"]
               for f in failures), failures


@pytest.mark.model_plane
def test_a_killed_worker_is_replaced_and_its_games_finish_as_if_undisturbed(tmp_path, monkeypatch, model_cache):
    """SIGKILL of a worker mid-game: the pool replaces it, and its games are played again from
    the start in fresh sessions, with the same result, bit for bit, as a run nobody disturbed."""
    held_module = worker_module(tmp_path, monkeypatch, "held_guess", HELD)
    model = prepare_char_model(ALPHABET, "$", cache_dir=model_cache, seed=0)
    # Where games and the test meet: outside the (read-only) import paths, open to workers
    # under uids of their own.
    shared = Path(tempfile.mkdtemp(prefix="rlengine-test-gates-"))
    shared.chmod(0o777)
    marks = shared / "marks"
    marks.mkdir()
    marks.chmod(0o777)

    async def play(pool, server, gate, kill):
        params = SamplingParams(max_tokens=1, temperature=1.0)
        task = {"marks": str(marks), "gate": str(gate)}
        runs = [asyncio.ensure_future(SessionEnv(pool, server.sessions, {"secret": s % 10} | task)
                                      .run(params, 1000 + s, 4)) for s in range(8)]
        if kill:
            victim = pool._workers[0]
            # Each game is done or at the gate (it played its first turn), typically within 1 s.
            async with asyncio.timeout(60):
                while sum(r.done() for r in runs) + len(os.listdir(marks)) < len(runs):
                    await asyncio.sleep(0.01)
            held = len(os.listdir(marks))
            os.kill(victim.proc.pid, signal.SIGKILL)
            while victim.alive:  # its games are failed before the gate opens
                await asyncio.sleep(0.01)
            gate.touch()
            assert held > 0
        async with asyncio.timeout(120):
            return await asyncio.gather(*runs)

    async def main():
        engine_config = EngineConfig(model=model, backend="torch", engine_args={"batch_invariant": True})
        async with Engine(engine_config) as engine, Server(engine, ServeConfig(http=False)) as server:
            pool = SandboxPool(held_module, 2, job_timeout_s=60)
            await pool.start(server.ipc_path)
            try:
                gate = shared / "open"
                gate.touch()
                calm = await play(pool, server, gate, kill=False)
                killed = await play(pool, server, shared / "closed", kill=True)
                assert server.sessions.live() == [] and server.sessions.retired() == []
                return calm, killed, pool.crashed, pool.spawned
            finally:
                await pool.aclose()

    try:
        calm, killed, crashed, spawned = asyncio.run(main())
    finally:
        shutil.rmtree(shared)
    assert crashed == 1 and spawned == 3  # the killed worker, replaced once
    reruns = [t.metadata.get("reruns", 0) for t in killed]
    # Jobs alternate between the two workers: worker 0 had the even games; those it held were
    # played again once, the others never.
    assert set(reruns[1::2]) == {0} and set(reruns[0::2]) <= {0, 1} and sum(reruns) > 0, reruns

    def game(t):
        return [(tr.observation.prompt.to_ints(), tr.action.tokens, tr.action.logprobs, tr.reward)
                for tr in t.transitions]

    assert [game(t) for t in killed] == [game(t) for t in calm]


QUARANTINE = textwrap.dedent("""
    import asyncio, os
    from rlengine.rl.sandbox import worker_main

    async def play(client, job):
        task = job["task"]
        session = client.session(job["session"], job["token"])
        await session.generate([1, 2, 3], max_tokens=1, seed=job["seed"])
        if task["crash"]:
            # Once every innocent game is in flight beside it (typically within 1 s); in
            # quarantine at once.
            while len(os.listdir(task["marks"])) < task["innocents"]:
                await asyncio.sleep(0.01)
            os._exit(5)
        if not job.get("isolate"):
            open(os.path.join(task["marks"], job["session"]), "w").close()
            await asyncio.sleep(3600)  # in flight until the crash ends the worker
        await session.reward(1.0)
        await session.close()
        return {"metrics": {"pid": os.getpid(), "worker": os.getppid()}}

    if __name__ == "__main__":
        worker_main(play)
""")


def test_a_suspect_replayed_in_quarantine_crashes_alone_and_the_others_finish(tmp_path, monkeypatch):
    """A game crashes its worker with four innocent games in flight beside it: all five are
    suspects, each played again in a process of its own; the crasher crashes again, alone, and
    is recorded as a ``crash``; the four finish (one re-run each) in processes of their own."""
    module = worker_module(tmp_path, monkeypatch, "quarantine_sandbox", QUARANTINE)
    marks = Path(tempfile.mkdtemp(prefix="rlengine-test-marks-"))
    marks.chmod(0o777)  # open to workers under uids of their own

    async def main():
        async with Engine(EngineConfig(backend="sim")) as engine, Server(engine, ServeConfig(http=False)) as server:
            pool = SandboxPool(module, 1, job_timeout_s=60)
            await pool.start(server.ipc_path)
            try:
                first = pool._workers[0].proc.pid
                envs = [SessionEnv(pool, server.sessions, {"crash": i == 2, "innocents": 4, "marks": str(marks)})
                        for i in range(5)]
                params = SamplingParams(max_tokens=1)
                async with asyncio.timeout(120):  # typically 1-3 s
                    done = await asyncio.gather(*(run_episode(env, None, params, 100 + i, max_turns=1)
                                                  for i, env in enumerate(envs)))
                assert server.sessions.live() == []
                return done, first, pool._workers[0].proc.pid, pool.crashed, pool.spawned
            finally:
                await pool.aclose()

    try:
        done, first, second, crashed, spawned = asyncio.run(main())
    finally:
        shutil.rmtree(marks)
    crasher = done.pop(2)
    # Before quarantine the crash failed all five: "sandbox 0 (pid N) exited with code 5".
    assert all(t.failure is None and t.metadata["reruns"] == 1 for t in done), [t.failure for t in done]
    assert crasher.failure is not None and crasher.failure.kind == "crash", crasher.failure
    assert "exited with code 5 before it answered" in crasher.failure.message, crasher.failure
    ran = [t.transitions[-1].metrics for t in done]
    # Each in a process of its own, forked by the worker that replaced the crashed one.
    assert {m["worker"] for m in ran} == {second} and len({m["pid"] for m in ran} | {second}) == 5
    assert first != second and crashed == 1 and spawned == 2


BROKEN = "import no_such_module_here\n"
MUTE = "import time\ntime.sleep(3600)\n"


@pytest.mark.parametrize("kind", ["exits", "hangs"])
def test_a_worker_that_cannot_start_is_a_clear_error_within_a_bound(tmp_path, monkeypatch, kind):
    """A worker that dies (or says nothing) at start-up is restarted with a backoff, then the pool
    gives up with ``SandboxUnavailable`` saying why. Before the fix ``start`` returned as if it had
    started, and every episode failed on its own."""
    worker_module(tmp_path, monkeypatch, "broken_sandbox", BROKEN if kind == "exits" else MUTE)

    async def main():
        pool = SandboxPool("broken_sandbox", 2, job_timeout_s=5.0, grace_s=0.5, start_timeout_s=1.0,
                           max_failed_starts=3, restart_backoff_s=0.05)
        async with Engine(EngineConfig(backend="sim")) as engine, Server(engine, ServeConfig(http=False)) as server:
            try:
                # 3 starts of each slot, a second each at most, and 0.15 s of backoff: typically 1-7 s.
                async with asyncio.timeout(60):
                    with pytest.raises(SandboxUnavailable) as failed:
                        await pool.start(server.ipc_path)
                    with pytest.raises(SandboxUnavailable):  # and stays so: no episode waits on it
                        await pool.run({"task": "x"})
            finally:
                await pool.aclose()
            return failed.value, pool.spawned

    error, spawned = asyncio.run(main())
    message = str(error)
    assert "python -m broken_sandbox" in message and "failed 3 times in a row" in message
    if kind == "exits":
        assert "exited with code 1 before it was ready: ModuleNotFoundError: No module named " \
               "'no_such_module_here'" in message, message
    else:
        assert "not ready within start_timeout_s=1.0" in message, message
    assert error.kind == "crash" and isinstance(error, SandboxError)
    assert 3 <= spawned <= 6  # both slots start at once; the first to give up ends the start


class _Unavailable(AgentEnv):
    async def run(self, params, seed, max_turns):
        raise SandboxUnavailable("sandbox 0 (python -m x) failed 5 times in a row")


def test_an_unavailable_sandbox_pool_fails_the_run_not_an_attempt():
    """A pool that gave up would fail every later episode: the rollout propagates it (the run
    stops with it) instead of recording one failed attempt after another."""
    with pytest.raises(SandboxUnavailable, match="failed 5 times in a row"):
        asyncio.run(run_episode(_Unavailable(), None, SamplingParams(max_tokens=1), 0, max_turns=1))
