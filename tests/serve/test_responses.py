"""OpenAI's Responses API (``POST /v1/responses``) with the official ``openai`` client, unchanged.

The scripted backend on the tiny model returns the completions given as text.
References: the script's own tokens (what the trace must hold), the same turn
through Chat Completions (the same prompt tokens), and ``json``.
"""

from __future__ import annotations

import json

import openai
import pytest
from serving import WAIT, script, script_tokens, scripted

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache)
    yield s
    s.close()


def test_text_input_and_instructions(served, client):
    script(served, "Hello there.")
    resp = client.responses.create(model="tiny", instructions="Be brief.", input="Hi!")
    assert resp.status == "completed" and resp.output_text == "Hello there."
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hi!"}])
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == len(script_tokens(served, "Hello there."))


def test_function_calls_round_trip_in_one_session_as_one_exact_trajectory(served, client):
    opened = client.post("/sessions", body={}, cast_to=object)
    c = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    script(served, CALL, "It is sunny in Oslo.")
    first = c.responses.create(model="tiny", input="What is the weather in Oslo?", tools=[WEATHER])
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    history = [{"role": "user", "content": "What is the weather in Oslo?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 12 C"}]
    second = c.responses.create(model="tiny", input=history, tools=[WEATHER])
    c.close()
    assert second.output_text == "It is sunny in Oslo."
    trace = client.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                       options={"headers": {"X-Session-Token": opened["token"]}})
    [trajectory] = trace["trajectories"]
    toks, sampled_1, sampled_2 = trajectory["tokens"], script_tokens(served, CALL), script_tokens(served, "It is sunny in Oslo.")
    start = first.usage.input_tokens
    assert toks[start:start + len(sampled_1)] == sampled_1 and toks[-len(sampled_2):] == sampled_2
    between = served.engines[0].tokenizer.decode(toks[start + len(sampled_1):-len(sampled_2)],
                                                 skip_special_tokens=False)
    assert between == ("\n<|im_start|>user\n<tool_response>\nsunny, 12 C\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")


def test_streamed_events_build_the_same_response(served, client):
    script(served, CALL)
    with client.responses.stream(model="tiny", input="Weather in Oslo?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output_text == "Let me check."
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [("message", None),
                                                                          ("function_call", "get_weather")]


def test_forced_calls_json_output_and_incomplete(served, client):
    script(served, FORCED)
    forced = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required")
    assert [i.type for i in forced.output] == ["function_call"]
    named = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[0].name == "get_weather"
    script(served, '{"answer": 42}')
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
    assert json.loads(client.responses.create(model="tiny", input="?", text=fmt).output_text) == {"answer": 42}
    script(served, "not json")
    with pytest.raises(openai.BadRequestError, match="does not match"):
        client.responses.create(model="tiny", input="?", text=fmt)
    script(served, "one two three four five")
    short = client.responses.create(model="tiny", input="?", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, field", [
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "tool_call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
])
def test_bad_input_is_a_typed_400_naming_the_field(served, client, body, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": "tiny", **body}, cast_to=object)
    assert field in str(info.value)
    script(served, "fine")
    assert client.responses.create(model="tiny", input="x").output_text == "fine"
