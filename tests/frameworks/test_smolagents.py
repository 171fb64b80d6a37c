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

import openai
import pytest
from serving import WAIT, Served
from smolagents import OpenAIModel, ToolCallingAgent, tool

import rlengine as rle
from rlengine.serve import ServeConfig

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."
FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "It is sunny in Oslo."}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(model_cache):
    cfg = rle.EngineConfig(backend="scripted", model_name="tiny", cache_dir=model_cache,
                           model_args={"max_position_embeddings": 8192}, engine_args={"script": ["ok"]})
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
    opened = open_session(served)
    model = OpenAIModel(model_id="tiny", api_base=opened["base_url"], api_key=opened["token"],
                        client_kwargs={"max_retries": 0, "timeout": WAIT})
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0, stream_outputs=streamed)
    assert agent.run("What is the weather in Oslo?") == ANSWER
    assert calls == ["Oslo"]
    trace = session_trace(served, opened)
    assert len(trace["constrained"]) == 2
    first, second = trace["trajectories"]
    prompt = first["segments"][0]["end"]
    assert [g["kind"] for g in first["segments"]] == ["prompt", "sampled"]
    assert [g["kind"] for g in second["segments"]] == ["prompt", "environment", "sampled"]
    assert second["shared_prefix"] == prompt and second["tokens"][:prompt] == first["tokens"][:prompt]
    assert sampled(first) == [tokens(served, CALL)] and sampled(second) == [tokens(served, FINAL)]
    tok = served.engines[0].tokenizer
    replayed = tok.decode(second["tokens"][prompt:second["segments"][1]["end"]], skip_special_tokens=False)
    assert "Calling tools:" in replayed and "Observation:\nsunny, 12 C" in replayed
