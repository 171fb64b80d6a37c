"""SIGUSR1 writes a hang dump on demand in ``rlengine serve`` and ``rlengine train`` (real processes).

Each command runs as a subprocess with work in flight; SIGUSR1 makes it
write a dump and print one line on stderr naming the file; the test reads
that file back and finds what the process was doing (the turn in flight and
its session, the compute thread, the loop's tasks; for a run, its step and
books), then stops the command with SIGTERM: the dump stopped nothing.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlengine.rl.metrics import read_jsonl
from rlengine.sandbox_client import Client

REPO = str(Path(__file__).resolve().parents[1])
TESTS = str(Path(__file__).resolve().parent)
WAIT = 60.0
"""Bound on every wait here (start-up typically takes 2-4 s, a dump comes within a second)."""
DUMP_LINE = re.compile(r"^(rlengine \w+): dump \(SIGUSR1\): hang dump written to (\S+)$")


class Command:
    """A command in a subprocess, its stdout and stderr read line by line on threads of their own."""

    def __init__(self, *argv: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=REPO)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.readers = [threading.Thread(target=lambda s=stream, q=lines: [q.put(line.rstrip("\n")) for line in s],
                                         daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def line(self, lines: queue.Queue[str], pattern: str) -> str:
        """The next line of ``lines`` matching ``pattern`` (within ``WAIT``)."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no line matching {pattern!r} within {WAIT} s; saw {self.seen}") from None
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def dump(self) -> tuple[str, dict]:
        """Send SIGUSR1; the program named on the stderr line and the dump it names."""
        self.proc.send_signal(signal.SIGUSR1)
        match = DUMP_LINE.match(self.line(self.err, "hang dump"))
        assert match is not None, self.seen[-1]
        return match[1], json.loads(Path(match[2]).read_text(encoding="utf-8"))

    def stop(self) -> int:
        """SIGTERM; the exit status (the pipes read to their end and closed)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(WAIT)
        finally:
            self.proc.kill()
            for reader in self.readers:
                reader.join(WAIT)
            for stream in (self.proc.stdout, self.proc.stderr):
                stream.close()
            for lines in (self.out, self.err):
                while not lines.empty():
                    self.seen.append(lines.get())


def functions(dump: dict, thread: str) -> list[str]:
    (found,) = [t for t in dump["threads"] if t["name"] == thread]
    return [frame["function"] for frame in found["stack"]]


def test_sigusr1_makes_serve_dump_the_turn_in_flight_and_serve_on(tmp_path):
    socket_path = str(tmp_path / "s.sock")
    serve = Command("rlengine.cli", "serve", "backend=sim", "sim.step_time_s=0.001", "sim.gen_len=100000",
                    "http=false", "grace_s=0.2", f"socket_path={socket_path}", "--dump-dir", str(tmp_path / "d"))
    try:
        serve.line(serve.out, "^ready")
        turn = threading.Thread(target=lambda: _long_turn(socket_path), daemon=True)
        turn.start()
        time.sleep(0.3)
        deadline = time.monotonic() + WAIT
        while True:  # the turn is in flight once the engine shows it
            prog, dump = serve.dump()
            if dump["engine"]["requests"] or time.monotonic() > deadline:
                break
        assert prog == "rlengine serve" and dump["reason"] == "SIGUSR1"
        (request,) = dump["engine"]["requests"]
        assert request["session_id"] is not None and request["state"] == "active" and request["age_s"] > 0
        assert dump["engine"]["compute"]["thread"] == "rlengine-compute"
        assert dump["engine"]["gate"]["leases_active"] == 1
        assert {"rlengine-compute", "rlengine-hang-watch"} <= {t["name"] for t in dump["threads"]}
        assert "_serve" in [f["function"] for t in dump["tasks"] for f in t["stack"]]
        with Client(socket_path, timeout=WAIT) as client:  # it serves on
            assert len(client.open_session().generate([3], max_tokens=4).choices[0].tokens) == 4
    finally:
        code = serve.stop()
    assert code == 128 + signal.SIGTERM, serve.seen
    # One file per SIGUSR1 (a dump was asked for again until the turn showed), each named on stderr.
    assert sorted(os.listdir(tmp_path / "d")) == sorted(os.path.basename(path) for path in dump_paths(serve))


def dump_paths(command: Command) -> list[str]:
    """The files named by the command's dump lines so far."""
    return [match[2] for match in map(DUMP_LINE.match, command.seen) if match is not None]


def _long_turn(socket_path: str) -> None:
    try:
        with Client(socket_path, timeout=WAIT) as client:
            client.open_session().generate([1, 2], max_tokens=100_000)
    except Exception:  # noqa: BLE001 - aborted when serve stops; what matters here is the dump
        return


def test_sigusr1_makes_train_dump_its_run_and_train_on(tmp_path):
    train = Command("rlengine.rl.cli", "rl_sim:RECIPE", "batches=100000", "env_delay_s=0.02", "--run-dir",
                    str(tmp_path), "--no-progress")
    try:
        deadline = time.monotonic() + WAIT
        while len(read_jsonl(str(tmp_path / "metrics.jsonl"))) < 2:
            assert time.monotonic() < deadline and train.proc.poll() is None, "the run did not take 2 steps"
            time.sleep(0.05)
        prog, dump = train.dump()
        steps = len(read_jsonl(str(tmp_path / "metrics.jsonl")))
        deadline = time.monotonic() + WAIT
        while len(read_jsonl(str(tmp_path / "metrics.jsonl"))) < steps + 2:  # it trains on
            assert time.monotonic() < deadline and train.proc.poll() is None, "the run stopped after the dump"
            time.sleep(0.05)
    finally:
        code = train.stop()
    assert code == 128 + signal.SIGTERM, train.seen
    assert prog == "rlengine train" and dump["reason"] == "SIGUSR1"
    assert dump["run"]["step"] >= 2 and dump["run"]["total_steps"] == 100000
    assert dump["engine"]["state"] == "running" and dump["engine"]["backend"] == "sim"
    assert dump["sandboxes"] == []  # this recipe plays in-process: no pool runs
    stages = {t["name"] for t in dump["tasks"]}
    assert {"rlengine.rl: training loop", "rlengine.rl: dataloader"} <= stages, stages
    assert "_run" in functions(dump, "rlengine-hang-watch")
    (path,) = dump_paths(train)
    assert Path(path).parent == tmp_path
