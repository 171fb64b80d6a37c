"""``replay_suspects``: the one replay loop of ``SessionEnv`` and ``HttpAgentEnv`` (``rlengine.rl.sandbox``).

The plays here are plain coroutines (no sandbox): what is tested is the loop
itself; the sandboxed paths are tested in ``test_rl_sandbox_crash``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlengine.rl.sandbox import SandboxError, replay_suspects


def _player(failures: list[SandboxError]) -> tuple[list[dict[str, Any]], Any]:
    """A play that raises ``failures`` in turn, then returns ("done", its job); and the jobs it got."""
    jobs: list[dict[str, Any]] = []

    async def play(job: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        jobs.append(job)
        if len(jobs) <= len(failures):
            raise failures[len(jobs) - 1]
        return "done", job

    return jobs, play


def test_a_suspect_is_replayed_in_quarantine_and_the_replays_are_counted():
    jobs, play = _player([SandboxError("worker died", "crash", suspect=True)] * 2)
    (result, last), reruns = asyncio.run(replay_suspects(play, {"task": 7}, max_reruns=2))
    assert (result, reruns) == ("done", 2)
    assert jobs == [{"task": 7}, {"task": 7, "isolate": True}, {"task": 7, "isolate": True}]
    assert last is jobs[-1]


def test_a_suspect_past_max_reruns_and_any_other_failure_are_raised():
    suspect = SandboxError("worker died", "crash", suspect=True)
    jobs, play = _player([suspect] * 3)
    with pytest.raises(SandboxError) as raised:
        asyncio.run(replay_suspects(play, {"task": 1}, max_reruns=2))
    assert raised.value is suspect and len(jobs) == 3
    crash = SandboxError("the game crashed", "crash")
    jobs, play = _player([crash])
    with pytest.raises(SandboxError) as raised:
        asyncio.run(replay_suspects(play, {"task": 1}, max_reruns=2))
    assert raised.value is crash and jobs == [{"task": 1}]


def test_no_replay_without_max_reruns_and_a_clean_play_is_not_counted():
    jobs, play = _player([])
    assert asyncio.run(replay_suspects(play, {"task": 2}, max_reruns=0)) == (("done", {"task": 2}), 0)
    jobs, play = _player([SandboxError("worker died", suspect=True)])
    with pytest.raises(SandboxError):
        asyncio.run(replay_suspects(play, {"task": 2}, max_reruns=0))
    assert len(jobs) == 1
