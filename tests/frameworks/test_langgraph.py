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

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from serving import WAIT, Served

import rlengine as rle
from rlengine.serve import ServeConfig

CALL = 'Let me check.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."


@pytest.fixture(scope="module")
def served(model_cache):
    cfg = rle.EngineConfig(backend="scripted", model_name="tiny", cache_dir=model_cache,
                           engine_args={"script": ["ok"]})
    s = Served([cfg], ServeConfig(ipc=False))
    yield s
    s.close()


def tokens(served, text: str) -> list[int]:
    tok = served.engines[0].tokenizer
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def open_session(served) -> dict:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=WAIT) as c:
        return c.post("/sessions", body={}, cast_to=object)


def session_trace(served, opened: dict) -> dict:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=WAIT) as c:
        return c.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                     options={"headers": {"X-Session-Token": opened["token"]}})


def sampled(trajectory: dict) -> list[list[int]]:
    """The trajectory's sampled segments; the loss mask must cover exactly them."""
    toks, mask = trajectory["tokens"], trajectory["loss_mask"]
    spans = [(g["start"], g["end"]) for g in trajectory["segments"] if g["kind"] == "sampled"]
    assert mask == [int(any(a <= i < b for a, b in spans)) for i in range(len(toks))]
    return [toks[a:b] for a, b in spans]


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
    opened = open_session(served)
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
    [trajectory] = session_trace(served, opened)["trajectories"]  # the tool loop stayed one trajectory
    assert sampled(trajectory) == [tokens(served, CALL), tokens(served, ANSWER)]
