"""Agent episodes in sandbox processes: the pool, trace -> trajectory, and the ``guess`` recipe.

Real parts throughout: worker processes started with ``python -m``, the
engine's IPC server on a unix socket, the sandbox client. The trajectories
are checked against the game's rules and against the trainer's own
logprobs of the same tokens (an exact trace means sampler and trainer agree
to float precision).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import textwrap

import numpy as np
import pytest
from serving import WAIT, Served, sim_config

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.core.engine import Engine
from rlengine.rl.advantages import trajectory_datums
from rlengine.rl.errors import FailureBudgetExceeded
from rlengine.rl.metrics import measured, read_jsonl
from rlengine.rl.recipes.guess_sandbox import ALPHABET, HIGHER, LOWER, START, digit
from rlengine.rl.run import train
from rlengine.rl.sandbox import SandboxError, SandboxPool, SessionEnv, session_trajectory
from rlengine.sandbox_client import Client
from rlengine.serve.server import ServeConfig, Server
from rlengine.serve.sessions import SessionTrace
from rlengine.trace.trajectory import Trajectory as TracedPath
from rlengine.types import SamplingParams


def traced(tokens, logprobs, versions, mask, shared_prefix=0):
    """One traced path, as the session store exports it."""
    return TracedPath(session="s", leaf=0, shared_prefix=shared_prefix, tokens_raw=tokens.astype(np.int32).tobytes(),
                      logprobs_raw=logprobs.astype(np.float32).tobytes(),
                      versions_raw=versions.astype(np.int32).tobytes(), loss_mask_raw=mask.astype(np.uint8).tobytes())


def one_path(*arrays):
    return SessionTrace(session_id="s", trajectories=[traced(*arrays)], rewards=[None], turns=1, latest=0)


def test_trace_becomes_one_transition_per_sampled_run():
    tokens = np.array([13, 5, 12, 8, 11, 7], dtype=np.int32)
    mask = np.array([0, 1, 0, 1, 0, 1], dtype=np.uint8)
    logprobs = np.array([0, -0.5, 0, -0.25, 0, -0.125], dtype=np.float32)
    versions = np.array([-1, 3, -1, 3, -1, 4], dtype=np.int32)
    t = session_trajectory(one_path(tokens, logprobs, versions, mask), 1.0, {"found": 1.0})
    assert [tr.observation.prompt.to_ints() for tr in t.transitions] == [[13], [13, 5, 12], [13, 5, 12, 8, 11]]
    assert [tr.action.tokens for tr in t.transitions] == [[5], [8], [7]]
    assert [tr.action.logprobs for tr in t.transitions] == [[-0.5], [-0.25], [-0.125]]
    assert [tr.action.versions for tr in t.transitions] == [[3], [3], [4]]
    assert [tr.reward for tr in t.transitions] == [0.0, 0.0, 1.0]
    assert [tr.done for tr in t.transitions] == [False, False, True]
    assert t.transitions[-1].metrics == {"found": 1.0} and t.versions() == (3, 4)
    # Every turn extends the last context: one training sequence for the episode.
    (datum, sampled, sampled_versions), = trajectory_datums(t, 0.5, with_mask=False)
    assert datum.model_input.to_ints() == tokens[:-1].tolist()
    np.testing.assert_array_equal(datum.loss_fn_inputs["target_tokens"].to_numpy(), tokens[1:])
    np.testing.assert_array_equal(sampled, mask[1:])
    np.testing.assert_array_equal(sampled_versions, np.where(mask[1:] > 0, versions[1:], -1))
    np.testing.assert_allclose(datum.loss_fn_inputs["advantages"].to_numpy(), 0.5 * mask[1:])
    np.testing.assert_allclose(datum.loss_fn_inputs["logprobs"].to_numpy(), logprobs[1:])
    with pytest.raises(SandboxError, match="no sampled tokens"):
        session_trajectory(one_path(tokens[:1], logprobs[:1], versions[:1], mask[:1]), 0.0)


def test_branches_train_each_sampled_token_once_or_only_the_latest_branch():
    # Branch 0: prompt 1, sampled 2 3, env 4, sampled 5. Branch 1 shares "1 2" and samples 6 7 after env 9.
    b0 = [np.array(x) for x in ([1, 2, 3, 4, 5], [0, -1, -1, 0, -1], [-1, 0, 0, -1, 1], [0, 1, 1, 0, 1])]
    b1 = [np.array(x) for x in ([1, 2, 9, 6, 7], [0, -1, 0, -2, -2], [-1, 0, -1, 2, 2], [0, 1, 0, 1, 1])]
    trace = SessionTrace(session_id="s", trajectories=[traced(*b0), traced(*b1, shared_prefix=2)],
                         rewards=[None, 1.0], turns=3, latest=1)
    every = session_trajectory(trace, 1.0, branches="all")
    assert [tr.action.tokens for tr in every.transitions] == [[2, 3], [5], [6, 7]]
    assert [tr.observation.prompt.to_ints() for tr in every.transitions] == [[1], [1, 2, 3, 4], [1, 2, 9]]
    assert [tr.reward for tr in every.transitions] == [0.0, 0.0, 1.0] and every.versions() == (0, 2)
    datums = trajectory_datums(every, 0.5, with_mask=False)
    # Two sequences; the shared token 2 is trained once (in branch 0), branch 1 trains only 6 7.
    assert [d.mask.tolist() for d in datums] == [[1, 1, 0, 1], [0, 0, 1, 1]]
    last = session_trajectory(trace, 1.0, branches="last")
    assert [tr.action.tokens for tr in last.transitions] == [[2], [6, 7]]
    assert [d.mask.tolist() for d in trajectory_datums(last, 0.5, with_mask=False)] == [[1, 0, 1, 1]]


def test_each_traced_action_says_how_the_engine_ended_its_completion():
    # Every action of a session trace used to say "length", so overlong filtering dropped them all.
    served = Served([sim_config(gen_len=3)], ServeConfig(http=False))
    try:
        with Client(served.ipc_path, timeout=WAIT) as c:
            s = c.open_session()
            ended = s.generate([5, 6], max_tokens=8, seed=1).choices[0]  # its 3 tokens, then its end
            e = ended.tokens
            cut = s.generate([5, 6, *e, 9], max_tokens=2, seed=2).choices[0]  # cut at max_tokens
            retry = s.generate([5, 6], max_tokens=2, seed=3).choices[0]  # a branch after the first prompt
            # A history cut inside the first completion, then a turn: the latest branch.
            edited = s.generate([5, 6, e[0], 7], max_tokens=2, seed=4).choices[0]
            s.reward(1.0)
        trace = served.on_loop(served.sessions.collect, s.session_id)
    finally:
        served.close()
    assert [x.stop_reason for x in (ended, cut, retry, edited)] == ["stop", "length", "length", "length"]
    assert e[0] != retry.tokens[0]  # three branches: the seeds give the retry other tokens
    every = session_trajectory(trace, 1.0, branches="all")
    assert sorted((tr.action.tokens, tr.action.stop_reason) for tr in every.transitions) == sorted(
        [(e, "stop"), (cut.tokens, "length"), (retry.tokens, "length"), (edited.tokens, "length")])
    # The latest branch starts with the first completion's first token, where no completion ended.
    last = session_trajectory(trace, 1.0, branches="last")
    assert [(tr.action.tokens, tr.action.stop_reason) for tr in last.transitions] == [
        ([e[0]], "stop"), (edited.tokens, "length")]


WORKER = textwrap.dedent("""
    import asyncio, os, sys
    from rlengine.rl.sandbox import worker_main

    async def play(client, job):
        kind = job["task"]
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "slow":
            await asyncio.sleep(1.0)
        if kind == "crash":
            os._exit(7)
        if kind == "raise":
            raise ValueError("the environment broke")
        return {"echo": kind, "pid": os.getpid(), "worker": os.getppid()}

    worker_main(play)
""")


@pytest.fixture
def worker_module(tmp_path, monkeypatch):
    (tmp_path / "fake_sandbox.py").write_text(WORKER)
    tmp_path.chmod(0o755)  # a root trainer's workers run under uids of their own
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "fake_sandbox"


def test_pool_answers_contains_failures_and_replaces_crashed_workers(worker_module, tmp_path):
    async def main():
        pool = SandboxPool(worker_module, 2, job_timeout_s=5.0, grace_s=2.0)
        # The fake worker connects to this socket: a real (idle) IPC server.
        async with Engine(EngineConfig(backend="sim")) as engine, \
                Server(engine, ServeConfig(http=False)) as server:
            await pool.start(server.ipc_path)
            try:
                ok = await asyncio.gather(*(pool.run({"task": f"t{i}"}) for i in range(32)))
                assert [r["echo"] for r in ok] == [f"t{i}" for i in range(32)]
                workers = {w.proc.pid for w in pool._workers if w is not None}
                # Nothing crashed, so nothing is isolated: every game ran in one of the two workers.
                assert {r["pid"] for r in ok} == workers and len(workers) == 2
                with pytest.raises(SandboxError, match="ValueError: the environment broke"):
                    await pool.run({"task": "raise"})
                # A crash takes its worker and every game in flight there (jobs alternate between
                # the workers: the crash and two slow games on one, two slow games on the other).
                tasks = ["slow", "slow", "slow", "slow", "crash"]
                outcomes = await asyncio.gather(*(pool.run({"task": t}) for t in tasks), return_exceptions=True)
                lost = [t for t, o in zip(tasks, outcomes) if isinstance(o, SandboxError)]
                assert sorted(lost) == ["crash", "slow", "slow"], outcomes
                assert all(o.kind == "crash" and o.suspect and "exited with code 7" in str(o)
                           for o in outcomes if isinstance(o, SandboxError)), outcomes
                # In quarantine, each suspect in a process of its own: the crasher crashes alone.
                replays = await asyncio.gather(*(pool.run({"task": t, "isolate": True}) for t in lost),
                                               return_exceptions=True)
                crashed, *innocent = (r for _, r in sorted(zip(lost, replays), key=lambda p: p[0]))
                assert isinstance(crashed, SandboxError) and crashed.kind == "crash" and not crashed.suspect
                assert "exited with code 7 before it answered" in str(crashed)
                assert [r["echo"] for r in innocent] == ["slow", "slow"]
                workers = {w.proc.pid for w in pool._workers if w is not None}
                assert all(r["pid"] not in workers and r["worker"] in workers for r in innocent)
                assert pool.crashed == 1 and pool.spawned == 3  # the crashed worker, replaced once
                again = await asyncio.gather(*(pool.run({"task": f"u{i}"}) for i in range(4)))
                assert [r["echo"] for r in again] == [f"u{i}" for i in range(4)]
                assert {r["pid"] for r in again} == workers  # back in process: quarantine is per job
                short = SandboxPool(worker_module, 1, job_timeout_s=0.5, grace_s=0.5)
                await short.start(server.ipc_path)
                with pytest.raises(SandboxError, match="no answer within job_timeout_s=0.5"):
                    await short.run({"task": "slow"})
                await asyncio.sleep(1.0)  # its answer arrives late: dropped, and the worker lives on
                assert (await short.run({"task": "v"}))["echo"] == "v" and short.crashed == 0
                with pytest.raises(SandboxError, match="no answer within job_timeout_s=0.5"):
                    await short.run({"task": "hang"})
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await short.aclose()  # the hung game is still running: killed after grace_s
                assert loop.time() - t0 < 5
                assert all(w.proc.returncode is not None for w in short._workers if w is not None)
            finally:
                await pool.aclose()
            assert all(w.proc.returncode == 0 for w in pool._workers if w is not None)
            with pytest.raises(SandboxError, match="not running"):
                await pool.run({"task": "late"})

    asyncio.run(main())


@pytest.mark.model_plane
def test_session_env_trajectory_is_the_exact_game_and_matches_trainer_logprobs(model_cache):
    model = prepare_char_model(ALPHABET, "$", cache_dir=model_cache, seed=0)

    async def main():
        async with Engine(EngineConfig(model=model, backend="torch")) as engine, \
                Server(engine, ServeConfig(http=False)) as server:
            pool = SandboxPool("rlengine.rl.recipes.guess_sandbox", 2, job_timeout_s=60)
            await pool.start(server.ipc_path)
            try:
                params = SamplingParams(max_tokens=1, temperature=1.0)
                runs = await asyncio.gather(*(
                    SessionEnv(pool, server.sessions, {"secret": s % 10}).run(params, 1000 + s, 4)
                    for s in range(24)))
                assert server.sessions.live() == [] and server.sessions.retired() == []
                return [(s % 10, t) for s, t in enumerate(runs)]
            finally:
                await pool.aclose()

    runs = asyncio.run(main())
    found = 0
    for secret, t in runs:
        context = t.transitions[-1].observation.prompt.to_ints() + t.transitions[-1].action.tokens
        assert context[0] == START and 1 <= len(t.transitions) <= 4
        guesses = [tr.action.tokens[0] for tr in t.transitions]
        # The environment tokens between guesses are the game's answers, exactly.
        want = [START]
        for g in guesses[:-1]:
            want += [g, LOWER if secret < digit(g) else HIGHER]
        assert context == want + [guesses[-1]], (secret, context)
        last = digit(guesses[-1])
        assert t.transitions[-1].reward == float(last == secret)
        found += last == secret
        assert all(tr.action.versions == [0] for tr in t.transitions)
        assert t.metadata["session"].startswith("s-")
    assert 0 < found < len(runs)

    # The trace's logprobs are the sampler's: the model's own logprobs of the same tokens agree.
    async def check():
        async with Engine(EngineConfig(model=model, backend="torch")) as engine:
            sampler = engine.sampling_client()
            for _, t in runs[:8]:
                last = t.transitions[-1]
                context = last.observation.prompt.to_ints() + last.action.tokens
                lps = await sampler.compute_logprobs_async(context)
                for tr in t.transitions:
                    pos = tr.observation.prompt.length
                    assert lps[pos] == pytest.approx(tr.action.logprobs[0], abs=1e-4)

    asyncio.run(check())


@pytest.mark.model_plane
@pytest.mark.slow
def test_guess_recipe_trains_through_sandboxes_and_survives_crashes(tmp_path, model_cache):
    outcome = train("guess", {"steps": 6, "groups_per_batch": 6, "group_size": 4, "eval_every": 3,
                              "checkpoint_every": 3, "backend": "torch", "cache_dir": model_cache,
                              "crash_every": 7, "sandboxes": 8}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    assert outcome.left_behind == []
    steps = read_jsonl(outcome.metrics_path)
    assert [s["step"] for s in steps] == list(range(1, 7))
    # Every 7th attempt's game exits mid-game (before its second guess), failing that game
    # alone: counted and filtered, the other games of its worker go on. (A crash used to take
    # the whole worker and every game on it; before that, episodes sent to a worker between its
    # crash and its reaping failed too: 934 of 960 attempts in a run like this.)
    failed = sum(s["attempts_failed"] for s in steps)
    assert 0 < failed <= (6 * 24 + 3 * 10) // 7  # 1 in 7 of the training and evaluation games
    assert failed == sum(s["attempts_failed_crash"] for s in steps)
    assert sum(s["groups_trained"] for s in steps) > 0
    for s in steps:
        assert s["groups_trained"] + s["groups_dropped_constant_reward"] + \
            s["groups_dropped_too_few_survivors"] == 6, s
        if s["groups_trained"]:
            assert s["kl_sample_train_v1"] < 1e-4, s  # exact traces: sampler and trainer agree
    groups = read_jsonl(str(tmp_path / "groups.jsonl"))
    failures = [f for g in groups for f in g.get("failures", [])]
    assert len(failures) == failed
    assert all(f["stage"] == "agent" and f["error"] == "SandboxError" and "exited with code 3" in f["message"]
               for f in failures), failures[:2]
    evals = read_jsonl(str(tmp_path / "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 3, 6]


@pytest.mark.model_plane
@pytest.mark.slow
def test_a_run_whose_attempts_mostly_fail_stops_loudly(tmp_path, model_cache):
    # Every game that gets past its first guess crashes (most of them, for a random policy).
    outcome = train("guess", {"steps": 6, "groups_per_batch": 6, "group_size": 4, "eval_every": 0,
                              "backend": "torch", "cache_dir": model_cache, "crash_every": 1, "sandboxes": 2},
                    run_dir=str(tmp_path))
    assert isinstance(outcome.error, FailureBudgetExceeded), outcome.error
    assert "failed attempts" in str(outcome.error) and "max_failure_share=0.5" in str(outcome.error)
    steps = read_jsonl(outcome.metrics_path)
    assert len(steps) < 6  # it stopped early instead of "succeeding" on nothing
    assert outcome.summary.get("eval_reward_best") != float("-inf")


@pytest.mark.model_plane
@pytest.mark.slow
def test_guess_recipe_learns_the_rules_within_20_steps(tmp_path, model_cache):
    """A random model ends most games with a token that is not a digit and finds the
    secret in about one game in six; within 20 steps it learns to guess digits and
    finds the secret more often (the full run's curve is in bench/RESULTS.md)."""
    outcome = train("guess", {"steps": 20, "eval_every": 0, "checkpoint_every": 0, "backend": "torch",
                              "cache_dir": model_cache}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    steps = read_jsonl(outcome.metrics_path)
    first = float(np.mean([s["reward_mean"] for s in steps[:3]]))
    last = float(np.mean([s["reward_mean"] for s in steps[-5:]]))
    invalid_first = float(np.mean([s["env/invalid"] for s in steps[:3]]))
    invalid_last = float(np.mean([s["env/invalid"] for s in steps[-5:]]))
    assert first < 0.25 and invalid_first > 0.4, steps[:3]
    assert last >= first + 0.08, [s["reward_mean"] for s in steps]
    assert invalid_last <= invalid_first / 2, [s["env/invalid"] for s in steps]


def _untimed(path) -> list[dict]:
    """The run's metrics rows without the columns that measure the machine (``rl.metrics.MEASURED``)."""
    return [measured(row) for row in read_jsonl(str(path))]


class _Killed(Exception):
    """Ends a run as a kill would, one step after its checkpoint."""


@pytest.mark.model_plane
@pytest.mark.bitwise
@pytest.mark.parametrize("ahead", [0, 1])
def test_guess_runs_of_one_seed_are_identical_whatever_the_timing_and_across_a_resume(tmp_path, model_cache, ahead):
    """Sandboxes that wait a random time before each guess reorder the engine's batches in
    every run; the sampler (batch-invariant) and the trainer must not notice, nor a run that
    samples a step ahead while it trains (``max_steps_off_policy=1``). Without
    ``reproducible`` (the torch backend's default batching) two such runs differ from the
    first step on (loss_sum -0.24224756 vs -0.24224665)."""
    settings = {"steps": 4, "groups_per_batch": 4, "group_size": 4, "eval_every": 2, "think_s": 0.02,
                "backend": "torch", "cache_dir": model_cache, "seed": 7, "max_steps_off_policy": ahead}
    runs = {}
    for name in ("a", "b"):
        outcome = train("guess", settings, run_dir=str(tmp_path / name))
        assert outcome.error is None, outcome.error
        runs[name] = tmp_path / name

    def kill(record: dict) -> None:
        if record["step"] == 3:
            raise _Killed

    # Killed one step after a checkpoint at step 2 (with a batch sampled ahead in it), resumed.
    killed = train("guess", settings | {"checkpoint_every": 2}, run_dir=str(tmp_path / "c"), on_step=kill)
    assert isinstance(killed.error, _Killed), killed.error
    resumed = train(None, {}, run_dir=str(tmp_path / "c"), resume=True)
    assert resumed.error is None and resumed.resumed_from == 2, resumed.error
    runs["c"] = tmp_path / "c"
    want = _untimed(runs["a"] / "metrics.jsonl")
    assert [r["step"] for r in want] == [1, 2, 3, 4] and sum(r["groups_trained"] for r in want) > 0
    # The run says what sampled it: batch-invariant, with this machine's kernels checked.
    capabilities = json.loads((runs["a"] / "engine.json").read_text())["capabilities"]
    assert capabilities["batch_invariant"] and capabilities["kernel_check"]["ok"], capabilities
    evals = read_jsonl(str(runs["a"] / "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 2, 4]
    # Evaluation k samples the policy of step k alone (a step that trained no group made none).
    policy = {0: 0} | {r["step"]: r["version"] for r in want}
    assert all(e["version_min"] == e["version_max"] == policy[e["step"]] for e in evals), evals
    for name in ("b", "c"):
        assert _untimed(runs[name] / "metrics.jsonl") == want, name  # every float, bitwise
        assert _untimed(runs[name] / "eval.jsonl") == _untimed(runs["a"] / "eval.jsonl"), name


PROBE = """
import ctypes, os, sys
from rlengine.rl.sandbox import worker_main

async def play(client, job):
    libc = ctypes.CDLL(None)
    return {"secret": os.environ.get("RLENGINE_TEST_SECRET"), "env": sorted(os.environ), "cwd": os.getcwd(),
            "cwd_mode": oct(os.stat(".").st_mode & 0o777), "dumpable": libc.prctl(3, 0, 0, 0, 0),
            "cmdline": open("/proc/self/cmdline").read().split("\\0"), "limits": open("/proc/self/limits").read(),
            "token_in_env": any(job["token"] in v for v in os.environ.values()), "uid": os.getuid(),
            "caps": open("/proc/self/status").read().split("CapEff:")[1].split()[0],
            "pong": (await client.ping(b"x")).decode()}

if __name__ == "__main__":
    worker_main(play)
"""


def test_sandbox_workers_are_confined(tmp_path, monkeypatch):
    (tmp_path / "probe_sandbox.py").write_text(PROBE)
    tmp_path.chmod(0o755)  # a worker under a uid of its own imports its module from here
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("RLENGINE_TEST_SECRET", "hunter2")  # the trainer's environment holds a secret

    async def main():
        pool = SandboxPool("probe_sandbox", 2, job_timeout_s=30.0, env={"EXTRA": "1"}, open_files=256,
                           address_space_bytes=4 << 30)
        async with Engine(EngineConfig(backend="sim")) as engine, \
                Server(engine, ServeConfig(http=False)) as server:
            await pool.start(server.ipc_path)
            try:
                facts = await asyncio.gather(*(pool.run({"token": f"tok-{i}-secret"}) for i in range(2)))
                workdirs = [w.workdir for w in pool._workers if w is not None]
                assert all(os.path.isdir(d) for d in workdirs)
            finally:
                await pool.aclose()
            assert not any(os.path.exists(d) for d in workdirs)  # private directories removed
            return facts, server.ipc_path

    facts, ipc_path = asyncio.run(main())
    for f in facts:
        assert f["pong"] == "x"  # it reached the server through the socket it was handed
        assert f["secret"] is None and "EXTRA" in f["env"]
        assert set(f["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE",
                                 "OMP_NUM_THREADS", "MKL_NUM_THREADS", "EXTRA", "LC_CTYPE"}
        assert f["cwd"].startswith(os.path.join(os.path.realpath(tempfile.gettempdir()),
                                                "rlengine-sandbox-")) and f["cwd_mode"] == "0o700"
        assert f["dumpable"] == 0  # same-user processes cannot read its memory or environment
        assert ipc_path not in f["cmdline"] and f["cmdline"][-2].startswith("fds:")  # no path, no token in argv
        assert not f["token_in_env"]
        limits = {line[:26].strip(): line[26:].split()[0] for line in f["limits"].splitlines()[1:]}
        assert limits["Max open files"] == "256" and limits["Max core file size"] == "0"
        assert limits["Max address space"] == str(4 << 30)
    assert len({f["cwd"] for f in facts}) == 2
    # A root trainer runs each worker slot under a uid of its own (mounting back what it needs of
    # directories closed to others, such as Python under a 0700 /root); where the kernel refuses
    # the mount namespace, as uid 0 without any capability.
    if os.geteuid() == 0:
        uids = {f["uid"] for f in facts}
        assert (len(uids) == 2 and 0 not in uids) or (uids == {0} and {f["caps"] for f in facts} == {"0" * 16})
    else:
        assert {f["uid"] for f in facts} == {os.geteuid()}


HOSTILE = """
import asyncio, os
from rlengine.rl.sandbox import worker_main

def attempt(path):
    try:
        with open(path, "rb") as f:
            return "read: " + f.read(64).decode(errors="replace")
    except OSError as exc:
        return type(exc).__name__

async def play(client, job):
    task = job["task"]
    if task["role"] == "victim":  # holds its session token in memory meanwhile
        await asyncio.sleep(task["hold_s"])
        return {"pid": os.getpid()}
    siblings = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"hostile_sandbox" in f.read():
                        siblings.append(int(name))
            except OSError:
                pass
    tried = {f"{pid}/{what}": attempt(f"/proc/{pid}/{what}") for pid in [*siblings, task["trainer"]]
             for what in ("environ", "mem", "maps")}
    tried["secret_file"] = attempt(task["secret_file"])
    return {"siblings": siblings, "tried": tried, "uid": os.getuid()}

if __name__ == "__main__":
    worker_main(play)
"""


def test_a_hostile_sandbox_reads_neither_a_siblings_memory_nor_the_trainers_environment(tmp_path, monkeypatch):
    """The issue's attack: a worker that looks for its sibling in /proc and reads its memory
    (the sibling's session token is there) and the trainer's environment and files."""
    (tmp_path / "hostile_sandbox.py").write_text(HOSTILE)
    tmp_path.chmod(0o755)
    secret = tmp_path / "secret.txt"
    secret.write_text("trainer-secret")
    secret.chmod(0o600)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("RLENGINE_TEST_SECRET", "hunter2")

    async def main():
        pool = SandboxPool("hostile_sandbox", 2, job_timeout_s=30.0)
        async with Engine(EngineConfig(backend="sim")) as engine, \
                Server(engine, ServeConfig(http=False)) as server:
            await pool.start(server.ipc_path)
            try:
                victim = asyncio.ensure_future(pool.run({"token": "tok-victim-secret",
                                                         "task": {"role": "victim", "hold_s": 3.0}}))
                await asyncio.sleep(0.5)  # the victim holds its job
                attacker = await pool.run({"token": "tok-attacker", "task": {
                    "role": "attacker", "trainer": os.getpid(), "secret_file": str(secret)}})
                return attacker, await victim
            finally:
                await pool.aclose()

    attacker, victim = asyncio.run(main())
    assert victim["pid"] in attacker["siblings"], attacker  # it found its sibling
    tried = attacker["tried"]
    for pid in (victim["pid"], os.getpid()):
        for what in ("environ", "mem", "maps"):
            assert tried[f"{pid}/{what}"] == "PermissionError", (pid, what, tried)
    assert not any("hunter2" in v or "tok-victim" in v for v in tried.values())
    if attacker["uid"] != os.geteuid():  # under a uid of its own: the trainer's files are closed too
        assert tried["secret_file"] == "PermissionError", tried


@pytest.mark.skipif(os.geteuid() != 0, reason="_confine is how a root trainer starts its workers")
def test_confine_gives_up_root_or_else_every_capability(tmp_path):
    """``_confine`` with a plan the kernel accepts: the uid of the slot; with one whose mount
    fails: uid 0 without any capability, and it says so."""
    import json
    import subprocess
    import sys

    probe = ("import os; s = open('/proc/self/status').read(); "
             "print(os.getuid(), s.split('CapEff:')[1].split()[0], os.getcwd())")
    results = []
    for broken in (False, True):
        work = tmp_path / f"work-{broken}"
        work.mkdir()
        os.chown(work, 200_777, 200_777)  # as the pool does for the slot's uid
        args = list(SandboxPool("unused", 1)._confinement(200_777, str(work)))
        if broken:  # a directory to hide that is not there: the mount fails
            plan = json.loads(args[-1])
            plan["hide"][str(tmp_path / "absent")] = []
            args[-1] = json.dumps(plan)
        done = subprocess.run([sys.executable, *args, "-c", probe], check=False, cwd=work, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        results.append((done.stdout.split(), done.stderr))
    (uid, caps, cwd), err = results[0]
    assert uid == "200777" and caps == "0" * 16 and err == "" and cwd == str(tmp_path / "work-False")
    (uid, caps, cwd), err = results[1]
    assert uid == "0" and caps == "0" * 16 and "without capabilities" in err and cwd == str(tmp_path / "work-True")
    assert os.stat(tmp_path / "work-True").st_uid == 0  # its directory given back to uid 0, which can enter it
