"""The ``tools`` recipe's agent: the official ``openai`` client, ``tools=[...]``, in a sandbox worker.

``python -m rlengine.rl.recipes.tools_agent`` (started by the recipe's
``SandboxPool``; ``rlengine.rl.agents.agent_main``). For every job it plays
one episode against the session's own base URL with the session's key, the
way any OpenAI-speaking agent would:

1. ``chat.completions.create(messages=[user "?"], tools=[read_meter])`` (the task's
   ``question`` instead of ``?`` where the recipe trains a given model);
2. for every tool call in the reply it runs the tool (the meter's reading is
   the job's ``task["reading"]``, which only the tool reveals) and sends the
   result back as a ``tool`` message, then asks again;
3. a reply without tool calls is the answer; at most ``max_turns`` requests.

Its reward: 0.8 for an answer equal to the reading, plus 0.2 when it called
the tool and then answered (calling again and again earns nothing). A malformed call comes back from the server as plain text
(the parser counts it) and is scored as the answer it is, never an error.

A task with ``"client": "aiohttp"`` sends the same requests with a bare
``aiohttp`` client instead (the benchmarks' split of the HTTP path's cost
between the server and the SDK). ``play_ipc`` plays the same game over the IPC server with token turns (the
benchmarks' baseline for the HTTP path's cost); a pool started on the IPC
socket runs it.

One ``httpx`` client is shared by all the worker's episodes (one connection
pool to the server; an ``openai`` client per episode, with that episode's
base URL and key). It imports no torch and no engine.
"""

from __future__ import annotations

import os
from typing import Any

ALPHABET = "0123456789?@=UA$"
"""The model's characters: token ``i + 1`` is ``ALPHABET[i]`` (token 0 is padding)."""
TOOL = "read_meter"
QUESTION = "What does the meter read? Call read_meter, then answer with the digit alone."
"""The user's question to a model given with ``model=`` (the recipe's own model is asked ``?``)."""
TOOLS = [{"type": "function", "function": {
    "name": TOOL, "description": "The meter's reading now: one digit.",
    "parameters": {"type": "object", "properties": {}}}}]

_http: Any = None


def reward(called: bool, answer: str | None, reading: str) -> float:
    """0.8 for the right answer, 0.2 more for having called the tool and then answered (an agent
    that only ever calls earns nothing)."""
    return 0.8 * (answer == reading) + 0.2 * (called and answer is not None)


def _seed(job: dict[str, Any], turn: int) -> int:
    """The sampling seed of a turn, derived from the episode's."""
    return (int(job["seed"]) * 1_000_003 + turn) % (1 << 63)


def _metrics(calls: int, answer: str | None, reading: str) -> dict[str, float]:
    return {"called": float(calls > 0), "correct": float(answer == reading), "tool_calls": float(calls)}


async def play(job: dict[str, Any]) -> dict[str, Any]:
    global _http
    if job["task"].get("client") == "aiohttp":
        return await _play_bare(job)
    import httpx
    import openai

    if _http is None:
        _http = httpx.AsyncClient(timeout=float(job["deadline_s"]), limits=httpx.Limits(max_connections=64))
    reading = str(job["task"]["reading"])
    sampling = job["sampling"]
    client = openai.AsyncOpenAI(base_url=job["base_url"], api_key=job["api_key"], max_retries=0, http_client=_http)
    messages: list[dict[str, Any]] = [{"role": "user", "content": job["task"].get("question", "?")}]
    calls = 0
    answer: str | None = None
    for turn in range(int(job["max_turns"])):
        reply = await client.chat.completions.create(
            model=job["model"], messages=messages, tools=TOOLS, max_tokens=sampling["max_tokens"],  # type: ignore[arg-type]
            temperature=sampling["temperature"], top_p=sampling["top_p"], seed=_seed(job, turn))
        message = reply.choices[0].message
        if job["task"].get("crash"):
            os._exit(3)  # fault injection (the recipe's crash_every): the sandbox dies mid-episode
        if not message.tool_calls:
            answer = message.content
            break
        calls += len(message.tool_calls)
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": reading} for c in message.tool_calls]
    return {"reward": reward(calls > 0, answer, reading), "metrics": _metrics(calls, answer, reading)}


_session: Any = None


async def _play_bare(job: dict[str, Any]) -> dict[str, Any]:
    """The same requests with a bare ``aiohttp`` client (JSON in, JSON out): what the HTTP path
    costs without the ``openai`` SDK (the benchmarks' split of the cost)."""
    global _session
    import aiohttp

    if _session is None:
        _session = aiohttp.ClientSession()
    reading = str(job["task"]["reading"])
    sampling = job["sampling"]
    headers = {"Authorization": f"Bearer {job['api_key']}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": job["task"].get("question", "?")}]
    calls = 0
    answer: str | None = None
    for turn in range(int(job["max_turns"])):
        body = {"model": job["model"], "messages": messages, "tools": TOOLS, "max_tokens": sampling["max_tokens"],
                "temperature": sampling["temperature"], "top_p": sampling["top_p"],
                "seed": _seed(job, turn)}
        async with _session.post(f"{job['base_url']}/chat/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            message = (await response.json())["choices"][0]["message"]
        if not message.get("tool_calls"):
            answer = message["content"]
            break
        calls += len(message["tool_calls"])
        messages.append({"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": reading} for c in message["tool_calls"]]
    return {"reward": reward(calls > 0, answer, reading), "metrics": _metrics(calls, answer, reading)}


def _ids(text: str) -> list[int]:
    return [ALPHABET.index(c) + 1 for c in text]


_END = ALPHABET.index("$") + 1


async def play_ipc(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The same game over the engine's IPC server with token turns (``rlengine.sandbox_client``):
    the tokens the chat template writes for it, built by hand; the benchmarks' baseline for the
    cost of the HTTP path. The reward is posted to the session."""
    session = client.session(job["session"], job["token"])
    reading = str(job["task"]["reading"])
    sampling = job["sampling"]
    tokens = _ids("U?$A")
    calls = 0
    answer: str | None = None
    for turn in range(int(job["max_turns"])):
        reply = await session.generate(tokens, max_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
                                       top_p=sampling["top_p"], top_k=sampling["top_k"],
                                       seed=_seed(job, turn))
        got = reply.choices[0].tokens
        tokens.extend(got)
        text = "".join(ALPHABET[t - 1] for t in got if t != _END)
        if text != "@":
            answer = text
            break
        calls += 1
        tokens.extend(_ids(f"$={reading}$A"))
    await session.reward(reward(calls > 0, answer, reading))
    await session.close()
    return {"metrics": _metrics(calls, answer, reading)}


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1].startswith("fd:"):  # a pool started on the IPC server's socket
        from rlengine.rl.sandbox import worker_main

        worker_main(play_ipc)
    else:
        from rlengine.rl.agents import agent_main

        agent_main(play)
