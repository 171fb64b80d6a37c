"""``rlengine train`` as a process: exit codes, SIGINT, the last line, and resume after SIGKILL.

The plumbing recipe ``rl_sim:RECIPE`` (tests/rl_sim.py, on the sim backend)
runs in a subprocess. The resume test kills the process with SIGKILL at
random points (seeded, printed on failure), resumes it each time with
``--resume``, and compares the result with an uninterrupted run: in
synchronous mode every step's groups, rewards and loss are identical; in
asynchronous mode every group is consumed exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from rlengine.rl.metrics import read_jsonl

TESTS = Path(__file__).resolve().parent.parent
WAIT_S = 120


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlengine.rl.cli", *args, "--no-progress"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(command(*args), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = WAIT_S) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for_steps(path: Path, n: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(read_jsonl(str(path / "metrics.jsonl"))) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"no {n} steps within {timeout} s")


def test_a_finished_run_exits_0_and_prints_the_metrics_path_last(tmp_path):
    code, out, err = finish(start("rl_sim:RECIPE", "batches=3", "eval_every=1", "--run-dir", str(tmp_path)))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1] == str(tmp_path / "metrics.jsonl")
    assert lines[0].startswith("rlengine train rl_sim:RECIPE: 3 steps")
    assert any("held-out eval" in line for line in lines)


def test_a_failing_stage_exits_1_naming_the_stage_and_a_bad_setting_exits_2(tmp_path):
    code, out, err = finish(start("rl_sim:RECIPE", "fail_worker_at=5", "--run-dir", str(tmp_path / "a")))
    assert code == 1
    assert "failed in the rollout workers: InjectedFault" in err
    assert out.strip().splitlines()[-1] == str(tmp_path / "a" / "metrics.jsonl")
    code, out, err = finish(start("rl_sim:RECIPE", "group_size=0", "--run-dir", str(tmp_path / "b")))
    assert code == 2 and "group_size=0" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run_promptly_with_exit_code_128_plus_n(tmp_path, sig):
    proc = start("rl_sim:RECIPE", "batches=100000", "env_delay_s=0.02", "checkpoint_every=5", "--run-dir",
                 str(tmp_path))
    wait_for_steps(tmp_path, 3, proc)
    sent = time.monotonic()
    proc.send_signal(sig)
    code, out, err = finish(proc, timeout=30)
    assert time.monotonic() - sent < 25  # typically 1-2 s; a run that ignored the signal goes on for hours
    assert code == 128 + sig, err
    assert f"interrupted by {sig.name}" in err
    assert out.strip().splitlines()[-1] == str(tmp_path / "metrics.jsonl")


def ledger(path: Path) -> dict[int, list[tuple[int, str]]]:
    out: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for entry in read_jsonl(str(path / "groups.jsonl")):
        if entry["disposition"] != "resampled_stale":
            out[entry["group"]].append((entry["step"], entry["disposition"]))
    return out


def step_view(path: Path) -> list[tuple]:
    """Per step: the groups it consumed with their rewards, the reward mean and the loss."""
    groups: dict[int, list] = defaultdict(list)
    for entry in read_jsonl(str(path / "groups.jsonl")):
        groups[entry["step"]].append((entry["group"], entry["disposition"], entry.get("rewards")))
    return [(s["step"], s["reward_mean"], s.get("loss_sum"), sorted(groups[s["step"]]))
            for s in read_jsonl(str(path / "metrics.jsonl"))]


def run_with_kills(path: Path, settings: list[str], kills: int, rng: random.Random) -> list[float]:
    """Run, SIGKILL at random moments ``kills`` times (resuming each time), then let it finish.

    Returns the kill points (seconds after the first step of each process) that landed."""
    points = []
    proc = start("rl_sim:RECIPE", *settings, "--run-dir", str(path))
    for _ in range(kills):
        wait_for_steps(path, 1, proc)  # past start-up, so the kill lands inside the loop
        delay = rng.uniform(0.0, 0.6)
        time.sleep(delay)
        if proc.poll() is not None:
            break
        points.append(round(delay, 3))
        proc.kill()
        proc.communicate(timeout=30)
        proc = start("--resume", str(path))
    code, _, err = finish(proc)
    assert code == 0, (points, err)
    return points


@pytest.mark.slow
def test_resume_after_sigkill_continues_with_the_identical_data_order(tmp_path):
    settings = ["batches=40", "env_delay_s=0.03", "checkpoint_every=3", "fail_attempts_every=7",
                "min_surviving_attempts=3"]
    reference = tmp_path / "reference"
    code, _, err = finish(start("rl_sim:RECIPE", *settings, "--run-dir", str(reference)))
    assert code == 0, err
    rng = random.Random(7)
    killed = tmp_path / "killed"
    points = run_with_kills(killed, settings, kills=4, rng=rng)
    assert len(points) >= 3, points
    got, want = step_view(killed), step_view(reference)
    assert [s[0] for s in got] == list(range(1, 41)), points
    for g, w in zip(got, want):
        assert (g[0], g[3]) == (w[0], w[3]), points
        assert g[1:3] == pytest.approx(w[1:3], rel=1e-9, abs=1e-12), (points, g[0])
    groups = ledger(killed)
    assert sorted(groups) == list(range(160)) and all(len(d) == 1 for d in groups.values()), points


@pytest.mark.slow
def test_async_resume_after_sigkill_trains_every_group_exactly_once(tmp_path):
    settings = ["batches=40", "env_delay_s=0.03", "checkpoint_every=2", "max_steps_off_policy=1"]
    killed = tmp_path / "killed"
    points = run_with_kills(killed, settings, kills=4, rng=random.Random(11))
    assert len(points) >= 3, points
    steps = read_jsonl(str(killed / "metrics.jsonl"))
    assert [s["step"] for s in steps] == list(range(1, 41)), points
    groups = ledger(killed)
    assert sorted(groups) == list(range(160)), points
    assert all(len(d) == 1 for d in groups.values()), (points, {g: d for g, d in groups.items() if len(d) > 1})
