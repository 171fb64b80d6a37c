"""The ``openai-agents`` SDK, unchanged, against ``rlengine serve``: a function tool, multi-turn
``Runner.run``, streamed, with its default Responses model and its Chat Completions model.

The agent talks to a session's own base URL with the session token as its API
key (the way a harness that sets only those two is traced). The scripted
backend on the tiny model returns a tool call and then the answer. References:
the tool function's own record of its calls, and the script's tokens (what the
session's one trajectory must hold).
"""

from __future__ import annotations

import asyncio

import agents
import openai
import pytest
from serving import WAIT, http_trace, open_http_session, script_tokens, scripted

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."


@pytest.fixture(scope="module")
def served(model_cache):
    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    s = scripted(model_cache)
    yield s
    s.close()


async def run_agent(opened: dict, kind: str, streamed: bool, calls: list[str]) -> str:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 12 C"

    client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    model_class = agents.OpenAIResponsesModel if kind == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model_class(model="tiny", openai_client=client))
    try:
        if not streamed:
            result = await agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
            return result.final_output
        run = agents.Runner.run_streamed(agent, "What is the weather in Oslo?", max_turns=4)
        kinds = {event.type async for event in run.stream_events()}
        assert "raw_response_event" in kinds
        return run.final_output
    finally:
        await client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_a_tool_using_agent_runs_and_its_session_is_one_exact_trajectory(served, kind, streamed):
    served.engines[0].backend.set_script([CALL, ANSWER])
    opened, calls = open_http_session(served), []
    final = asyncio.run(run_agent(opened, kind, streamed, calls))
    assert final == ANSWER and calls == ["Oslo"]
    trace = http_trace(served, opened)
    [trajectory] = trace["trajectories"]  # the tool loop stayed one trajectory
    toks, mask = trajectory["tokens"], trajectory["loss_mask"]
    sampled = [(g["start"], g["end"]) for g in trajectory["segments"] if g["kind"] == "sampled"]
    assert [toks[a:b] for a, b in sampled] == [script_tokens(served, CALL), script_tokens(served, ANSWER)]
    assert sum(mask) == len(script_tokens(served, CALL)) + len(script_tokens(served, ANSWER))
