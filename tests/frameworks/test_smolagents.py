"""smolagents, unchanged, against ``rlengine serve``: a ``ToolCallingAgent`` with ``OpenAIModel`` and
one ``@tool``, a tool call and then its ``final_answer`` tool, run and streamed.

The model talks to a session's own base URL with the session token as its API
key. smolagents asks for every step with ``tool_choice: "required"`` (the
server decodes those under a constraint), so the script writes each call in
the chat template's own layout, the only one the constraint admits; its
default system prompt is about 2,900 tokens of the tiny tokenizer, so the
tiny model is built with a longer context than its default 2,048.

smolagents does not send its history back as ``tool_calls`` and ``tool``
messages: it replays each step as text (an assistant "Calling tools: ..."
message, a user "Observation: ..." one). The session layer cannot extend the
first step's trajectory with that, so each step is its own trajectory, the
second branching from the first at the end of their common prompt, with the
replayed text as environment tokens. References: the tool function's own
record of its calls, and the script's tokens.
"""

from __future__ import annotations

import pytest
from serving import WAIT, http_trace, open_http_session, sampled_segments, script_tokens, scripted
from smolagents import OpenAIModel, ToolCallingAgent, tool

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."
FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "It is sunny in Oslo."}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache, model_args={"max_position_embeddings": 8192})
    yield s
    s.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_a_tool_calling_agent_ends_with_final_answer_and_each_step_is_traced_exactly(served, streamed):
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        calls.append(city)
        return "sunny, 12 C"

    served.engines[0].backend.set_script([CALL, FINAL])
    opened = open_http_session(served)
    model = OpenAIModel(model_id="tiny", api_base=opened["base_url"], api_key=opened["token"],
                        client_kwargs={"max_retries": 0, "timeout": WAIT})
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0, stream_outputs=streamed)
    assert agent.run("What is the weather in Oslo?") == ANSWER
    assert calls == ["Oslo"]
    trace = http_trace(served, opened)
    assert len(trace["constrained"]) == 2
    first, second = trace["trajectories"]
    prompt = first["segments"][0]["end"]
    assert [g["kind"] for g in first["segments"]] == ["prompt", "sampled"]
    assert [g["kind"] for g in second["segments"]] == ["prompt", "environment", "sampled"]
    assert second["shared_prefix"] == prompt and second["tokens"][:prompt] == first["tokens"][:prompt]
    assert sampled_segments(first) == [script_tokens(served, CALL)] and sampled_segments(second) == [script_tokens(served, FINAL)]
    tok = served.engines[0].tokenizer
    replayed = tok.decode(second["tokens"][prompt:second["segments"][1]["end"]], skip_special_tokens=False)
    assert "Calling tools:" in replayed and "Observation:\nsunny, 12 C" in replayed
