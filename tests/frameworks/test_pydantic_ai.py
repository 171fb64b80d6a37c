"""pydantic-ai, unchanged, against ``rlengine serve``: a function tool over a few turns, run and
streamed, and structured output (``output_type=int``), with its OpenAI Chat Completions model.

The agent talks to a session's own base URL with the session token as its API
key. The scripted backend on the tiny model returns a tool call and then the
answer. pydantic-ai asks for structured output as a forced call of its
``final_result`` tool (``tool_choice: "required"``, which the server decodes
under a constraint), so those turns are scripted in the chat template's own
layout, the only one the constraint admits. References: the tool function's
own record of its calls, and the script's tokens (what the session's one
trajectory must hold).
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from serving import WAIT, http_trace, open_http_session, sampled_segments, script_tokens, scripted

# Compact JSON after text: an unforced call as a model may write it.
CALL = 'Let me check.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."
# Forced calls (tool_choice "required"): the template's layout, nothing before the call.
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
RESULT = '<tool_call>\n{"name": "final_result", "arguments": {"response": 12}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache)
    yield s
    s.close()


async def run_agent(opened: dict, calls: list[str], *, output_type: type = str, streamed: bool = False) -> object:
    client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, output_type=output_type, instructions="Answer with the weather tool.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 12 C"

    try:
        if not streamed:
            return (await agent.run("What is the weather in Oslo?")).output
        kinds = set()

        async def on_events(_ctx, events) -> None:
            kinds.update([type(event).__name__ async for event in events])

        result = await agent.run("What is the weather in Oslo?", event_stream_handler=on_events)
        assert {"PartStartEvent", "FunctionToolCallEvent", "FunctionToolResultEvent"} <= kinds
        return result.output
    finally:
        await client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_a_tool_using_agent_runs_and_its_session_is_one_exact_trajectory(served, streamed):
    served.engines[0].backend.set_script([CALL, ANSWER])
    opened, calls = open_http_session(served), []
    assert asyncio.run(run_agent(opened, calls, streamed=streamed)) == ANSWER
    assert calls == ["Oslo"]
    [trajectory] = http_trace(served, opened)["trajectories"]  # the tool loop stayed one trajectory
    assert sampled_segments(trajectory) == [script_tokens(served, CALL), script_tokens(served, ANSWER)]


def test_structured_output_is_a_forced_final_result_call_in_the_same_trajectory(served):
    served.engines[0].backend.set_script([FORCED_CALL, RESULT])
    opened, calls = open_http_session(served), []
    assert asyncio.run(run_agent(opened, calls, output_type=int)) == 12
    assert calls == ["Oslo"]
    trace = http_trace(served, opened)
    assert len(trace["constrained"]) == 2  # both turns were forced: no text answer is allowed
    [trajectory] = trace["trajectories"]
    assert sampled_segments(trajectory) == [script_tokens(served, FORCED_CALL), script_tokens(served, RESULT)]
