"""Anthropic's Messages API (``POST /v1/messages``) with the official ``anthropic`` SDK, unchanged.

The scripted backend on the tiny model returns the completions given as text,
so the SDK sees real text and real ``tool_use`` blocks. References: the
script's own tokens (what the trace must hold), the same turn through Chat
Completions (the same prompt tokens), and the tokenizer.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from serving import WAIT, Served, script, script_tokens

import rlengine as rle
from rlengine.serve import ServeConfig

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def served(model_cache):
    cfg = rle.EngineConfig(backend="scripted", model_name="tiny", cache_dir=model_cache,
                           engine_args={"script": ["ok"]})
    s = Served([cfg], ServeConfig(ipc=False, api_key=KEY))
    yield s
    s.close()


@pytest.fixture
def client(served):
    c = anthropic.Anthropic(base_url=served.http_url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=WAIT)
    yield c
    c.close()


def open_session(served) -> dict:
    oa = openai.OpenAI(base_url=served.http_url, api_key=KEY, max_retries=0, timeout=WAIT)
    try:
        return oa.post("/sessions", body={}, cast_to=object)
    finally:
        oa.close()


def test_text_with_a_system_prompt_and_usage(served, client):
    script(served, "Hello there.")
    msg = client.messages.create(model="tiny", max_tokens=32, system="Be brief.", messages=USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there."
    assert msg.usage.output_tokens == len(script_tokens(served, "Hello there."))
    # The same prompt through Chat Completions: the same rendered tokens.
    oa = openai.OpenAI(base_url=served.http_url, api_key=KEY, max_retries=0, timeout=WAIT)
    chat = oa.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."}, *USER])
    oa.close()
    assert msg.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_text_and_tool_use_events(served, client):
    script(served, CALL)
    with client.messages.stream(model="tiny", max_tokens=256, messages=USER, tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert final.content[1].name == "get_weather" and final.content[1].input == {"city": "Oslo"}
    assert final.usage.output_tokens == len(script_tokens(served, CALL))


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(served, client, choice):
    script(served, FORCED)
    msg = client.messages.create(model="tiny", max_tokens=256, messages=USER, tools=[WEATHER], tool_choice=choice)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    script(served, "No tool for me.")
    with pytest.raises(anthropic.BadRequestError, match="does not match"):
        client.messages.create(model="tiny", max_tokens=256, messages=USER, tools=[WEATHER], tool_choice=choice)


def test_a_tool_result_round_trip_is_one_exact_trajectory_on_the_session_base_url(served):
    opened = open_session(served)
    # A harness that sets only base_url and api_key: the session's own URL, its token as the key.
    c = anthropic.Anthropic(base_url=opened["base_url"].removesuffix("/v1"), api_key=opened["token"], max_retries=0,
                            timeout=WAIT)
    script(served, CALL, "It is sunny in Oslo.")
    first = c.messages.create(model="tiny", max_tokens=256, messages=USER, tools=[WEATHER])
    use = first.content[1]
    history = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 12 C"}]}]
    second = c.messages.create(model="tiny", max_tokens=256, messages=history, tools=[WEATHER])
    c.close()
    assert second.content[0].text == "It is sunny in Oslo." and second.stop_reason == "end_turn"
    oa = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    trace = oa.get(f"{served.http_url}/sessions/{opened['session_id']}/trace", cast_to=object,
                   options={"headers": {"X-Session-Token": opened["token"]}})
    oa.close()
    [trajectory] = trace["trajectories"]
    toks, sampled_1, sampled_2 = trajectory["tokens"], script_tokens(served, CALL), script_tokens(served, "It is sunny in Oslo.")
    start = first.usage.input_tokens
    assert toks[start:start + len(sampled_1)] == sampled_1 and toks[-len(sampled_2):] == sampled_2
    tok = served.engines[0].tokenizer
    between = tok.decode(toks[start + len(sampled_1):-len(sampled_2)], skip_special_tokens=False)
    assert between == ("\n<|im_start|>user\n<tool_response>\nsunny, 12 C\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")


def test_stop_sequences_end_the_reply_and_are_named(served, client):
    script(served, "one two three four")
    msg = client.messages.create(model="tiny", max_tokens=32, messages=USER, stop_sequences=["three", "two"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "two"
    assert msg.content[0].text == "one "
    script(served, "one two three four")
    short = client.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert short.stop_reason == "max_tokens"


def test_keys_and_bad_input_get_anthropic_shaped_errors_and_the_server_keeps_serving(served, client):
    bad = anthropic.Anthropic(base_url=served.http_url.removesuffix("/v1"), api_key="wrong", max_retries=0,
                              timeout=WAIT)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny", max_tokens=8, messages=USER)
    bad.close()
    cases = [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                                 "input": {}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
         "tool_call_id"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.function.name"),
        ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools[0].function.name"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ]
    for extra, field in cases:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**{"model": "tiny", "max_tokens": 8, "messages": USER, **extra})
        assert field in str(info.value) and info.value.body["type"] == "error", (field, info.value.body)
    script(served, "still here")
    assert client.messages.create(model="tiny", max_tokens=8, messages=USER).content[0].text == "still here"
