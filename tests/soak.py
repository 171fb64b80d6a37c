"""A soak under faults: agent sessions over IPC and HTTP for a while, weights installed every few
seconds, and a fault injector at work; then the books must balance.

The server runs in this process (``tests.serving.Served``: the sim backend, the real IPC and HTTP
servers on their own loop thread). The agents are real subprocesses: IPC sandboxes on
``rlengine.sandbox_client`` and HTTP agents on the unchanged ``openai`` SDK, streaming, each
running sessions of a few turns and logging every turn it starts and how it ended. Faults, one
at a time at random from a seeded generator:

* ``kill_ipc`` / ``kill_http``: SIGKILL an agent (often mid-turn, mid-stream), start another;
* ``crash_sandbox``: start a sandbox that dies by itself (``os._exit``) in the middle of a turn;
* ``partial_frame``: send the first part of a large IPC frame and stall: the server must drop the
  connection within its frame timeout;
* ``stalled_reader``: start a streamed HTTP turn, never read it, hang up later;

and, once the run is over, ``backend_raises``: the backend's ``step`` raises while turns are in
flight (a dead engine): every one of them must settle with a typed error at once.

What must hold afterwards (``SoakReport.problems`` lists whatever did not): no lost turn (every
turn an agent that was not killed started has ended, with a reply or a typed error); no install
refused (a turn whose client vanished is aborted at once and settles its lease, on every wire), and
an install right after the run succeeds; every session
settled (no turn in flight, no unknown lease); resident memory flat. A probe measures the latency
of a small stateless completion with and without faults.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import openai
from serving import REPO, Served, sim_config

import rlengine as rle
from rlengine.serve import ServeConfig

FAULTS = ("kill_ipc", "kill_http", "crash_sandbox", "partial_frame", "stalled_reader")

_IPC_AGENT = """
import json, os, random, sys, threading, time
from rlengine.sandbox_client import Client
from rlengine.protocol import ServeError, ConnectionLost
path, log, stop, seed, crash = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
rng, out = random.Random(seed), open(log, "a", buffering=1)
def ev(kind, **kw): out.write(json.dumps({"ev": kind, **kw}) + "\\n")
with Client(path, timeout=30) as client:
    while not os.path.exists(stop):
        session = client.open_session()
        ev("session")
        messages = [{"role": "user", "content": "play"}]
        for _ in range(rng.randint(2, 5)):
            if crash:  # a sandbox that dies by itself in the middle of a turn
                threading.Timer(rng.uniform(0.02, 0.2), lambda: os._exit(3)).start()
            ev("start")
            try:
                turn = session.chat(messages, max_tokens=rng.randint(8, 120) if not crash else 5000)
            except ServeError as exc:
                ev("error", code=exc.code)
                break
            ev("ok")
            messages += [{"role": "assistant", "content": turn.choices[0].text}, {"role": "user", "content": "go"}]
        else:
            session.reward(1.0)
            session.close()
"""

_HTTP_AGENT = """
import json, os, random, sys
import openai
base, key, log, stop, seed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rng, out = random.Random(seed), open(log, "a", buffering=1)
def ev(kind, **kw): out.write(json.dumps({"ev": kind, **kw}) + "\\n")
server = openai.OpenAI(base_url=base, api_key=key, timeout=30, max_retries=0)
while not os.path.exists(stop):
    if rng.random() < 0.3:  # a stateless streamed completion (no session), as an eval harness sends
        ev("start")
        try:
            for _ in server.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=rng.randint(8, 120), stream=True):
                pass
        except openai.APIStatusError as exc:
            ev("error", code=exc.status_code)
            continue
        ev("ok")
        continue
    opened = server.post("/sessions", body={}, cast_to=object)
    ev("session")
    agent = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], timeout=30, max_retries=0)
    messages = [{"role": "user", "content": "play"}]
    for _ in range(rng.randint(2, 5)):
        ev("start")
        try:
            text = "".join(c.choices[0].delta.content or "" for c in agent.chat.completions.create(
                model="sim", messages=messages, max_tokens=rng.randint(8, 120), stream=True) if c.choices)
        except openai.APIStatusError as exc:
            ev("error", code=exc.status_code)
            break
        ev("ok")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go"}]
    else:
        agent.post("/reward", body={"value": 1.0}, cast_to=object)
        server.delete(f"/sessions/{opened['session_id']}", cast_to=object,
                      options={"headers": {"X-Session-Token": opened["token"]}})
"""


@dataclass
class SoakReport:
    """What a soak did and what it found (``problems`` empty: everything held)."""

    seconds: float = 0.0
    agents: int = 0
    sessions: int = 0
    turns_ok: int = 0
    turns_refused: int = 0
    """Turns that ended with a typed error (a session of a killed agent written off, ...)."""
    lost: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, str] = field(default_factory=dict)
    """Per fault kind, what the server did about the last one."""
    installs: int = 0
    installs_refused: int = 0
    """Installs refused by a poisoned gate (retried; any is a problem)."""
    longest_refusal_s: float = 0.0
    rss_first_mb: float = 0.0
    rss_last_mb: float = 0.0
    probe_p99_clean_ms: float = 0.0
    probe_p99_faults_ms: float = 0.0
    dead_engine_turns: int = 0
    """Turns in flight when the backend raised, each settled with a typed error."""
    problems: list[str] = field(default_factory=list)

    @property
    def rss_drift(self) -> float:
        return self.rss_last_mb / self.rss_first_mb - 1.0 if self.rss_first_mb else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rss_drift": round(self.rss_drift, 4)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))] * 1e3 if values else 0.0


class _Soak:
    def __init__(self, served: Served, workdir: str, seed: int) -> None:
        self.served, self.workdir = served, workdir
        self.rng = random.Random(seed)
        self.stop_file = os.path.join(workdir, "stop")
        self.agents: dict[subprocess.Popen[bytes], tuple[str, str]] = {}  # -> (kind, log)
        self.killed: set[str] = set()
        self.report = SoakReport()
        self.phase = "warmup"
        self.rss_from = 0.0
        self.deck: list[str] = []
        self.done = threading.Event()
        self.latencies: dict[str, list[float]] = {"clean": [], "faults": []}
        self.rss: list[float] = []
        self.env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1"}

    # -- agents ------------------------------------------------------------------------------

    def spawn(self, kind: str, crash: bool = False) -> subprocess.Popen[bytes]:
        n = self.report.agents = self.report.agents + 1
        log = os.path.join(self.workdir, f"{kind}-{n}.log")
        seed = str(self.rng.randrange(2**31))
        if kind == "ipc":
            args = [_IPC_AGENT, self.served.ipc_path, log, self.stop_file, seed, "1" if crash else "0"]
        else:
            args = [_HTTP_AGENT, self.served.http_url, self.served.api_key, log, self.stop_file, seed]
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(args[0]), *map(str, args[1:])],
                                env=self.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.agents[proc] = ("crash" if crash else kind, log)
        return proc

    def kill(self, kind: str) -> str:
        live = [p for p, (k, _) in self.agents.items() if k == kind and p.poll() is None]
        if not live:
            return "no agent to kill"
        victim = self.rng.choice(live)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        self.killed.add(self.agents[victim][1])
        self.spawn(kind)
        return "killed; another started"

    # -- faults --------------------------------------------------------------------------------

    def partial_frame(self) -> None:
        """In a thread of its own: the server takes ``frame_timeout_s`` to drop it."""
        threading.Thread(target=self._partial_frame, daemon=True).start()

    def _partial_frame(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.served.server.config.frame_timeout_s + 10)
        sock.connect(self.served.ipc_path)
        sock.sendall(struct.pack("<I", 8 << 20) + b"\x00" * (1 << 20))  # 1 MiB of a promised 8 MiB frame
        t0 = time.monotonic()
        try:
            closed = sock.recv(1 << 16) is not None  # an error frame or EOF: the server let go
        except (TimeoutError, ConnectionError):
            closed = False
        finally:
            sock.close()
        if not closed:
            self.report.problems.append("partial_frame: the server kept a stalled partial frame")
        self.report.outcomes["partial_frame"] = f"dropped after {time.monotonic() - t0:.1f} s"

    def stalled_reader(self) -> str:
        url = urlparse(self.served.http_url)
        body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2000, "stream": True}).encode()
        sock = socket.create_connection((url.hostname, url.port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {self.served.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        threading.Timer(self.rng.uniform(0.5, 3.0), sock.close).start()  # never reads; hangs up later
        return "hung up unread"

    def inject(self) -> None:
        if not self.deck:  # every kind once per round, in a seeded order
            self.deck = self.rng.sample(FAULTS, len(FAULTS))
        kind = self.deck.pop()
        self.report.faults[kind] = self.report.faults.get(kind, 0) + 1
        if kind == "kill_ipc":
            outcome = self.kill("ipc")
        elif kind == "kill_http":
            outcome = self.kill("http")
        elif kind == "crash_sandbox":
            self.spawn("ipc", crash=True)
            outcome = "sandbox started that exits mid-turn"
        elif kind == "partial_frame":
            self.partial_frame()
            return  # its outcome is written when the server has dropped it
        else:
            outcome = self.stalled_reader()
        self.report.outcomes[kind] = outcome

    # -- background: installs, probe, memory -------------------------------------------------------

    def installer(self, every_s: float) -> None:
        refused_since: float | None = None
        while not self.done.wait(every_s):
            try:
                self.served.install(seed=self.report.installs + 2)
            except rle.GatePoisoned:
                self.report.installs_refused += 1
                refused_since = refused_since or time.monotonic()
                self.report.longest_refusal_s = max(self.report.longest_refusal_s, time.monotonic() - refused_since)
                continue
            self.report.installs += 1
            refused_since = None

    def probe(self) -> None:
        client = openai.OpenAI(base_url=self.served.http_url, api_key=self.served.api_key, timeout=30, max_retries=0)
        while not self.done.wait(0.1):
            t0 = time.monotonic()
            client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "ping"}], max_tokens=2)
            if self.phase in self.latencies:
                self.latencies[self.phase].append(time.monotonic() - t0)

    def sample_memory(self) -> None:
        """RSS every 0.25 s of the faults phase, from ``rss_from_s`` into it: the bounded structures
        (receipts, retained traces, the allocator's arenas) fill in the first minute under load, and
        flat from there means nothing grows without bound."""
        while not self.done.wait(0.25):
            if self.phase == "faults" and time.monotonic() >= self.rss_from:
                self.rss.append(_rss_mb())

    # -- the run ---------------------------------------------------------------------------------------

    def run(self, *, ipc_agents: int, http_agents: int, warmup_s: float, clean_s: float, faults_s: float,
            fault_every_s: float, install_every_s: float, rss_from_s: float = 0.0) -> SoakReport:
        t_start = time.monotonic()
        for i in range(ipc_agents + http_agents):
            self.spawn("ipc" if i < ipc_agents else "http")
        threads = [threading.Thread(target=self.installer, args=(install_every_s,), daemon=True),
                   threading.Thread(target=self.probe, daemon=True),
                   threading.Thread(target=self.sample_memory, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(warmup_s)
        self.phase = "clean"
        time.sleep(clean_s)
        self.rss_from = time.monotonic() + rss_from_s
        self.phase = "faults"
        end = time.monotonic() + faults_s
        while time.monotonic() < end:
            self.inject()
            time.sleep(self.rng.uniform(0.5, 1.5) * fault_every_s)
        self.phase = "drain"
        self.finish(threads)
        self.report.seconds = round(time.monotonic() - t_start, 1)
        return self.report

    def finish(self, threads: list[threading.Thread]) -> None:
        report = self.report
        open(self.stop_file, "w").close()
        for proc, (kind, log) in self.agents.items():
            try:
                proc.wait(60)  # the longest turn is well under a second: 60 s is for a loaded machine
            except subprocess.TimeoutExpired:
                proc.kill()
                report.problems.append(f"{kind} agent {log} did not stop within 60 s")
        self.done.set()
        for t in threads:
            t.join(60)
        for proc, (kind, log) in self.agents.items():
            events = []
            if os.path.exists(log):
                with open(log) as f:
                    events = [json.loads(line)["ev"] for line in f]
            report.sessions += events.count("session")
            report.turns_ok += events.count("ok")
            report.turns_refused += events.count("error")
            if log not in self.killed and kind != "crash":
                lost = events.count("start") - events.count("ok") - events.count("error")
                report.lost += lost
                if proc.returncode != 0:
                    report.problems.append(f"{kind} agent {log} exited {proc.returncode}: "
                                           f"{proc.stderr.read().decode()[-400:] if proc.stderr else ''}")
            if proc.stderr:
                proc.stderr.close()
        if report.lost:
            report.problems.append(f"{report.lost} turn(s) lost")
        n = max(1, len(self.rss) // 10)
        report.rss_first_mb = round(sum(self.rss[:n]) / n, 1) if self.rss else 0.0
        report.rss_last_mb = round(sum(self.rss[-n:]) / n, 1) if self.rss else 0.0
        report.probe_p99_clean_ms = round(_p99(self.latencies["clean"]), 1)
        report.probe_p99_faults_ms = round(_p99(self.latencies["faults"]), 1)
        # Every turn settles: the abandoned ones at once, the last ones within the drain.
        served, deadline = self.served, time.monotonic() + 30
        while time.monotonic() < deadline and (served.on_loop(lambda: served.sessions.in_flight)
                                                or served.on_loop(served.sessions.unknown_leases)):
            time.sleep(0.05)
        if served.on_loop(lambda: served.sessions.in_flight) or served.on_loop(served.sessions.unknown_leases):
            report.problems.append("sessions unsettled 30 s after the agents stopped")
        if report.installs_refused:
            report.problems.append(f"{report.installs_refused} install(s) refused by a poisoned gate "
                                   f"(for up to {report.longest_refusal_s:.1f} s)")
        try:
            served.install(seed=10**6)
        except rle.GatePoisoned as exc:
            report.problems.append(f"the gate stayed poisoned: {exc}")
        self.backend_raises()

    def backend_raises(self) -> None:
        """The last fault: the backend raises while turns are in flight; each settles at once, typed."""
        engine, report = self.served.engines[0], self.report
        client = openai.OpenAI(base_url=self.served.http_url, api_key=self.served.api_key, timeout=30, max_retries=0)
        outcomes: list[str] = []

        def turn() -> None:
            try:
                client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4000)
                outcomes.append("completed")
            except openai.APIStatusError as exc:
                outcomes.append(str(exc.status_code))
            except openai.APIError as exc:  # a connection error: not a typed answer
                outcomes.append(type(exc).__name__)

        turns = [threading.Thread(target=turn, daemon=True) for _ in range(4)]
        for t in turns:
            t.start()
        deadline = time.monotonic() + 30
        while self.served.on_loop(lambda: self.served.sessions.in_flight) < len(turns) and time.monotonic() < deadline:
            time.sleep(0.01)
        backend = engine.backend
        step = backend.step

        def broken() -> Any:
            backend.step = step  # once
            raise RuntimeError("soak: injected backend failure")

        backend.step = broken
        for t in turns:
            t.join(30)
        report.dead_engine_turns = len(outcomes)
        report.faults["backend_raises"] = 1
        report.outcomes["backend_raises"] = ", ".join(sorted(set(outcomes)))
        if len(outcomes) != len(turns) or any(not o.isdigit() or int(o) < 500 for o in outcomes):
            report.problems.append(f"backend_raises: turns in flight ended as {outcomes} (want a 5xx for each)")
        if engine.state != "dead":
            report.problems.append(f"backend_raises: the engine is {engine.state}, not dead")


def run_soak(*, seed: int = 0, ipc_agents: int = 3, http_agents: int = 3, warmup_s: float = 3.0, clean_s: float = 5.0,
             faults_s: float = 20.0, fault_every_s: float = 1.0, install_every_s: float = 1.0,
             rss_from_s: float = 0.0) -> SoakReport:
    """Run one soak against a fresh in-process server; the report says what held."""
    served = Served([sim_config(step_time_s=0.002)],
                    # Short retention, so memory reaches its steady state within the warm-up and
                    # "flat" measures leaks, not the closed sessions' traces kept by design.
                    ServeConfig(frame_timeout_s=2.0, write_stall_timeout_s=5.0, idle_session_ttl_s=10.0,
                                closed_session_ttl_s=5.0, tombstone_ttl_s=5.0))
    try:
        with tempfile.TemporaryDirectory(prefix="rlengine-soak-") as workdir:
            return _Soak(served, workdir, seed).run(
                ipc_agents=ipc_agents, http_agents=http_agents, warmup_s=warmup_s, clean_s=clean_s,
                faults_s=faults_s, fault_every_s=fault_every_s, install_every_s=install_every_s,
                rss_from_s=rss_from_s)
    finally:
        served.close()
