"""``rlengine train`` as a process: exit codes, SIGINT, the last line, resume after SIGKILL, and
what it prints (issue 32's papercuts: resume without a checkpoint, a missing extra, progress
without a terminal, ``--list``, bad choices).

The plumbing recipe ``rl_sim:RECIPE`` (tests/rl_sim.py, on the sim backend)
runs in a subprocess. The resume test kills the process with SIGKILL at
random points (seeded, printed on failure), resumes it each time with
``--resume`` (``--start-over`` where no checkpoint was written yet), and
compares the result with an uninterrupted run: in synchronous mode every
step's groups, rewards and loss are identical; in asynchronous mode every
group is consumed exactly once.
"""

from __future__ import annotations

import os
import random
import re
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
        proc = start("--resume", str(path), "--start-over")  # a kill before the first checkpoint starts over
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


# -- the command's papercuts (issue 32): each run through the real command, off a terminal ------------------

def rlengine(*args: str, extra_path: str = "", timeout: float = WAIT_S) -> tuple[int, str, str]:
    """``rlengine ARGS`` (the console script's module) to the end, without a terminal."""
    environ = env()
    if extra_path:
        environ["PYTHONPATH"] = os.pathsep.join([extra_path, environ["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", *args], env=environ, capture_output=True,
                          text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def test_resume_without_a_checkpoint_is_refused_and_keeps_the_metrics(tmp_path):
    code, _, err = rlengine("train", "rl_sim:RECIPE", "batches=2", "--run-dir", str(tmp_path))
    assert code == 0, err
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    code, _, err = rlengine("train", "--resume", str(tmp_path))
    assert code == 2, err  # it started over, writing new metrics over the old ones
    assert f"--resume {tmp_path}: holds no checkpoint" in err and "--start-over" in err, err
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    code, _, err = rlengine("train", "--resume", str(tmp_path), "--start-over")
    assert code == 0, err
    assert [s["step"] for s in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    code, _, err = rlengine("train", "--resume", str(tmp_path / "nothing"))
    assert code == 2 and f"--resume {tmp_path / 'nothing'}: not a run directory" in err, err
    assert "Traceback" not in err


def test_start_over_needs_resume(tmp_path):
    code, _, err = rlengine("train", "rl_sim:RECIPE", "--start-over", "--run-dir", str(tmp_path))
    assert code == 2 and "--start-over: only with --resume" in err, err


HIDE_HTTPX = '''
import sys

class HideHttpx:
    """An install without httpx, for this interpreter and the sandboxes it starts."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "httpx":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideHttpx())
'''


def test_a_recipe_needing_a_missing_extra_exits_2_before_anything_starts(tmp_path):
    hidden = tmp_path / "site"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(HIDE_HTTPX)
    run_dir = tmp_path / "run"
    code, out, err = rlengine("train", "tools", "steps=1", "groups_per_batch=2", "--run-dir", str(run_dir),
                              extra_path=str(hidden))
    assert code == 2, (out, err)  # it started, then failed its budget on ModuleNotFoundError in every sandbox
    assert err.strip() == ("rlengine train: recipe 'tools' needs the module 'httpx' (No module named 'httpx'): "
                           "pip install 'rlengine[agents]'"), err
    assert not run_dir.exists()


def test_a_run_stopped_by_its_failure_budget_prints_its_first_failure(tmp_path):
    code, _, err = rlengine("train", "rl_sim:RECIPE", "fail_attempts_every=1", "--run-dir", str(tmp_path))
    assert code == 1, err
    assert "FailureBudgetExceeded" in err
    assert ("rlengine train: first failure (step 1, group 0, attempt 0, in the step): ConnectionError: sandbox of "
            f"attempt 0 went away (every failure is in {tmp_path / 'groups.jsonl'})") in err, err


STEP_LINE = re.compile(r"^rlengine train: step (\d+)/(\d+), reward \S+, (\d+\.\d+) s/step")


def test_without_a_terminal_progress_is_a_plain_line_every_few_seconds_while_it_runs(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlengine.cli", "train", "cli_slow_start:RECIPE", "batches=8",
                             "env_delay_s=0.2", "--run-dir", str(tmp_path)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert first == "rlengine train: starting, 8 steps\n", first
        line = proc.stderr.readline()
        assert STEP_LINE.match(line) and line.startswith("rlengine train: step 1/8,"), line
        # Step 1 was shown while the run went on (each later step takes 0.2 s of its environments).
        assert proc.poll() is None
        _, rest = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, rest
    # Every progress line is a step line (a log line, e.g. matplotlib missing on a base install, may follow).
    steps = [STEP_LINE.match(x) for x in rest.splitlines() if x.startswith("rlengine train:")]
    assert all(steps), rest
    assert steps[-1] is not None and steps[-1].group(1, 2) == ("8", "8")
    assert len(steps) < 7, rest  # every few seconds (5 s), not every step
    # The time per step is the steps' own: the 2 s start-up (cli_slow_start) is not in step 1.
    times = [s["step_time_s"] for s in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    assert STEP_LINE.match(line).group(3) == f"{times[0]:.2f}", (line, times)
    assert steps[-1].group(3) == f"{sum(times[-5:]) / 5:.2f}", (rest, times)


def test_on_a_terminal_the_bar_shows_the_steps_own_time_not_start_up(tmp_path):
    pytest.importorskip("tqdm", reason="the bar is tqdm's; without it a terminal gets the plain lines")
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "rlengine.cli", "train", "cli_slow_start:RECIPE", "batches=3",
                             "--run-dir", str(tmp_path)], env=env(), stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, text=True)
    os.close(slave)
    shown = b""
    try:
        while True:  # the terminal's output until the process closes it
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: no writer left
                break
            if not chunk:
                break
            shown += chunk
        proc.communicate(timeout=WAIT_S)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, shown
    final = [part for part in shown.decode(errors="replace").replace("\n", "\r").split("\r") if "3/3" in part][-1]
    rate = re.search(r"(\d+\.\d+) ?s/step", final)
    times = [s["step_time_s"] for s in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    # On the old code tqdm's own clock, started before the engine, made it about (2 s + steps) / 3.
    assert rate is not None and rate.group(1) == f"{sum(times) / 3:.2f}", (final, times)
    assert "train: 3/3" in final


def test_the_summary_names_as_many_last_steps_as_there_were(tmp_path):
    code, out, err = rlengine("train", "rl_sim:RECIPE", "batches=2", "--run-dir", str(tmp_path))
    assert code == 0, err
    assert "(mean of the last 2 steps)" in out and "last 5" not in out, out


def test_list_shows_the_recipes_own_values_with_a_description_of_every_setting():
    from rlengine.rl.config import TrainConfig
    from rlengine.rl.recipes import load_recipe

    code, out, err = rlengine("train", "tools", "--list")
    assert code == 0, err
    settings = out.split("settings of recipe tools")[1].splitlines()[1:]
    assert len(settings) == len(TrainConfig.__struct_fields__)
    for line in settings:  # key=value [*]  description
        key = line.split()[0].partition("=")[0]
        assert key in TrainConfig.__struct_fields__ and len(line.split(None, 1 + ("*" in line.split()))) > 1, line
    for key, value in load_recipe("tools").defaults.items():
        if value != getattr(TrainConfig(), key):
            assert any(line.split()[:2] == [f"{key}={value}", "*"] for line in settings), (key, out)
    assert "steps=120 *" in out and "backend=torch *" in out
    assert "sandboxes=2" in out.split("options of recipe tools")[1]
    assert "``" not in out


def test_a_bad_choice_lists_the_valid_ones(tmp_path):
    code, _, err = rlengine("train", "rl_sim:RECIPE", "backend=nosuch", "--run-dir", str(tmp_path))
    assert code == 2 and "backend='nosuch': must be 'auto', 'sim', 'torch'" in err, err
    code, _, err = rlengine("train", "rl_sim:RECIPE", "loss_fn=x", "--run-dir", str(tmp_path))
    assert code == 2 and "loss_fn='x': must be 'importance_sampling', 'ppo' or 'cispo'" in err, err
    code, _, err = rlengine("train", "nosuch")
    assert code == 2 and "not a built-in recipe (copy, guess, " in err and "tools" in err and "distill" in err, err


def test_plain_progress_lines_come_at_the_first_step_every_few_seconds_and_at_the_last():
    import io

    from rlengine.rl.progress import Progress

    now = [100.0]
    stream = io.StringIO()
    progress = Progress("lines", every_s=5.0, stream=stream, clock=lambda: now[0])
    progress.start(None, 6)
    for step, at in zip(range(1, 7), (130.0, 131.0, 134.0, 136.0, 137.0, 138.0)):  # 30 s of start-up first
        now[0] = at
        progress.step({"step": step, "reward_mean": 0.5, "step_time_s": 0.25})
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["rlengine train: starting", "rlengine train: step 1/6",
                                                        "rlengine train: step 4/6", "rlengine train: step 6/6"]
    # Each step's own time, never the start-up before step 1.
    assert lines[1] == "rlengine train: step 1/6, reward 0.500, 0.25 s/step, 1 s left"
    assert lines[3] == "rlengine train: step 6/6, reward 0.500, 0.25 s/step"
