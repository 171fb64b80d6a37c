"""A sandbox worker that runs an agent program once per episode: ``rlengine.rl.agents.AgentProgram``.

``python -m rlengine.rl.agent_program SPEC`` (started by a ``SandboxPool``;
``SPEC`` is JSON ``{"argv": [...], "env": {...}}``). For every job line it
starts the program, in a fresh directory of its own, with the worker's
scrubbed environment, ``SPEC["env"]`` and:

* ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` - the session's base URL and key
  (the ``openai`` SDK reads both by itself);
* ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` - the same for the
  ``anthropic`` SDK (its base URL has no ``/v1``);
* ``RLENGINE_BASE_URL``, ``RLENGINE_API_KEY``, ``RLENGINE_SESSION_ID``,
  ``RLENGINE_TASK`` (JSON), ``RLENGINE_SAMPLING`` (JSON: temperature,
  top_p, top_k, max_tokens), ``RLENGINE_SEED``, ``RLENGINE_MAX_TURNS``,
  ``RLENGINE_DEADLINE_S``.

Its arguments are ``argv`` with ``{base_url}``, ``{session_id}``,
``{seed}``, ``{max_turns}`` and ``{task}`` filled in. The program's process
group is killed at ``deadline_s + scoring_s`` (the episode then fails as
``timeout``), and the program is killed when its worker dies. Its result is the last line of its
stdout when that is a JSON object (``{"reward": ..., "metrics": {...}}``),
else ``{}``; an exit code other than 0 fails the episode with the end of its
stderr. stdout and stderr are read as they come (at most 1 MiB of each is
kept), so a chatty program never blocks.

It imports no torch and no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from rlengine.errors import RLEngineError
from rlengine.rl.sandbox_worker import die_with_parent, not_dumpable, serve_job_lines

_KEEP = 1 << 20


class ProgramFailed(RLEngineError, RuntimeError):
    """The program exited with an error."""


async def _drain(stream: asyncio.StreamReader) -> bytes:
    """All of ``stream``, of which the last ``_KEEP`` bytes are kept."""
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-_KEEP:]
    return kept


def _result(stdout: bytes) -> dict[str, Any]:
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    if not lines:
        return {}
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def run_program(spec: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """One episode: the program with the job's session, until it exits or its bound passes."""
    fields = {"base_url": job["base_url"], "session_id": job["session"], "seed": job["seed"],
              "max_turns": job["max_turns"], "task": json.dumps(job["task"])}
    argv = [a.format(**fields) for a in spec["argv"]]
    env = dict(os.environ) | dict(spec.get("env") or {}) | {
        "OPENAI_BASE_URL": job["base_url"], "OPENAI_API_KEY": job["api_key"],
        "ANTHROPIC_BASE_URL": job["anthropic_base_url"], "ANTHROPIC_API_KEY": job["api_key"],
        "RLENGINE_BASE_URL": job["base_url"], "RLENGINE_API_KEY": job["api_key"],
        "RLENGINE_SESSION_ID": job["session"], "RLENGINE_TASK": fields["task"],
        "RLENGINE_SAMPLING": json.dumps(job["sampling"]), "RLENGINE_SEED": str(job["seed"]),
        "RLENGINE_MAX_TURNS": str(job["max_turns"]), "RLENGINE_DEADLINE_S": str(job["deadline_s"])}
    workdir = tempfile.mkdtemp(prefix="episode-")
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=workdir, env=env, start_new_session=True,
                                                preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        out, err, code = await asyncio.gather(_drain(proc.stdout), _drain(proc.stderr), proc.wait())
    finally:
        if proc.returncode is None:  # cancelled at its bound: the program and its children go
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if code != 0:
        tail = err.decode("utf-8", "replace").strip()[-400:]
        raise ProgramFailed(f"{argv[0]} exited with code {code}" + (f": {tail}" if tail else ""))
    return _result(out)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m rlengine.rl.agent_program SPEC_JSON")
    spec = json.loads(sys.argv[1])
    not_dumpable()
    asyncio.run(serve_job_lines(lambda job: run_program(spec, job)))


if __name__ == "__main__":
    main()
