"""LangGraph, unchanged, against ``rlengine serve``: LangChain's ReAct agent (``create_agent``, a
LangGraph graph) with ``ChatOpenAI`` and one tool, a tool round trip, invoked and streamed.

``langgraph.prebuilt.create_react_agent`` is deprecated in LangGraph 1 in favour
of ``langchain.agents.create_agent``, which builds the same model/tools loop as
a LangGraph graph. The model talks to a session's own base URL with the session
token as its API key. The scripted backend on the tiny model returns a tool
call and then the answer. References: the tool function's own record of its
calls, and the script's tokens (what the session's one trajectory must hold).
"""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from serving import WAIT, http_trace, open_http_session, sampled_segments, script_tokens, scripted

CALL = 'Let me check.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache)
    yield s
    s.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streaming"])
def test_a_react_agent_tool_round_trip_is_one_exact_trajectory(served, streaming, monkeypatch):
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):  # no run export to LangSmith
        monkeypatch.delenv(var, raising=False)
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 12 C"

    served.engines[0].backend.set_script([CALL, ANSWER])
    opened = open_http_session(served)
    llm = ChatOpenAI(model="tiny", base_url=opened["base_url"], api_key=opened["token"], streaming=streaming,
                     max_retries=0, timeout=WAIT)
    agent = create_agent(llm, [get_weather], system_prompt="Answer with the weather tool.")
    state = agent.invoke({"messages": [{"role": "user", "content": "What is the weather in Oslo?"}]})
    assert [m.type for m in state["messages"]] == ["human", "ai", "tool", "ai"]
    asked, told, answered = state["messages"][1:]
    assert asked.content == "Let me check." and [(c["name"], c["args"]) for c in asked.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert told.content == "sunny, 12 C" and told.tool_call_id == asked.tool_calls[0]["id"]
    assert answered.content == ANSWER and calls == ["Oslo"]
    [trajectory] = http_trace(served, opened)["trajectories"]  # the tool loop stayed one trajectory
    assert sampled_segments(trajectory) == [script_tokens(served, CALL), script_tokens(served, ANSWER)]
