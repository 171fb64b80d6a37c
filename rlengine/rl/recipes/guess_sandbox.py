"""The guessing game's sandbox worker: the environment *and* the agent loop, in its own process.

``python -m rlengine.rl.recipes.guess_sandbox fds:N|SOCKET`` (started by the
``guess`` recipe's ``SandboxPool``): for every job (``worker_main``: many at
once in the worker's process) it attaches to the session the trainer opened,
and plays one game through the engine's IPC server with token turns. The
prompt is ``?``; each turn the model samples
one token, a guess; the game answers ``<`` (the secret is smaller) or ``>``
(larger) and the model guesses again, up to ``max_turns`` guesses. Any
token that is not a digit ends the game. The reward, sent through the
session: 1.0 when the secret was found, else 0.0.

With ``model=`` the recipe puts the model's own tokens for the game's
symbols in the task (``"symbols"``: the prompt, ``<``, ``>`` and the ten
digits, each digit one token); without, they are the character model's.

A job with ``"crash_at_turn": k`` makes the game's process exit abruptly
before turn ``k`` (fault injection: the worker dies with its games in
flight; replayed in quarantine, this game crashes again, alone, and fails as
a ``crash``, while the others finish); ``"think_s": t`` waits a random time in [0, t)
before each guess (an agent's varying latency: the engine's batches then
form differently in every run, which must not change what is trained).

It talks to the trainer only through the IPC client (``rlengine.sandbox_client``)
and its job lines, as a sandbox on another machine would; it imports no
torch and no engine.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

ALPHABET = "0123456789<>?$"
"""Token ``i + 1`` is ``ALPHABET[i]``; token 0 is padding; ``$`` is the model's end token."""
START, LOWER, HIGHER = (ALPHABET.index(c) + 1 for c in "?<>")


def digit(token: int) -> int | None:
    """The digit a token stands for, or None."""
    return token - 1 if 1 <= token <= 10 else None


def symbols(task: dict[str, Any]) -> tuple[list[int], list[int], list[int], dict[int, int]]:
    """The game's tokens: the prompt, ``<``, ``>``, and each digit's token -> the digit."""
    given = task.get("symbols")
    if given is None:
        return [START], [LOWER], [HIGHER], {t: d for t in range(1, 11) if (d := digit(t)) is not None}
    return (list(given["start"]), list(given["lower"]), list(given["higher"]),
            {int(t): d for d, t in enumerate(given["digits"])})


async def play(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    session = client.session(job["session"], job["token"])
    task = job["task"]
    secret, crash_at, think_s = int(task["secret"]), task.get("crash_at_turn"), float(task.get("think_s", 0.0))
    sampling = job["sampling"]
    start, lower, higher, digits = symbols(task)
    tokens = list(start)
    found = invalid = False
    turns = 0
    for turn in range(int(job["max_turns"])):
        if crash_at is not None and turn == crash_at:
            os._exit(3)
        if think_s:
            await asyncio.sleep(random.random() * think_s)  # timing noise, not a secret
        reply = await session.generate(tokens, max_tokens=1, temperature=sampling["temperature"],
                                       top_p=sampling["top_p"], top_k=sampling["top_k"],
                                       seed=(int(job["seed"]) * 1_000_003 + turn) % (1 << 63))
        got = reply.choices[0].tokens
        tokens.extend(got)
        turns += 1
        guess = digits.get(got[0]) if len(got) == 1 else None
        if guess is None:
            invalid = True
            break
        if guess == secret:
            found = True
            break
        tokens.extend(lower if secret < guess else higher)
    await session.reward(1.0 if found else 0.0)
    await session.close()
    return {"metrics": {"found": float(found), "turns": float(turns), "invalid": float(invalid)}}


if __name__ == "__main__":
    from rlengine.rl.sandbox_worker import worker_main

    worker_main(play)
