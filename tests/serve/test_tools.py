"""Tool-calling turns over the OpenAI Chat Completions API, with the official ``openai`` client.

The engine runs the scripted backend on the tiny model: completions are
given as text (a real tool call, say) and tokenized by the model's own
tokenizer, so the client sees real tool calls and the session layer traces
real tokens. References: the script's own tokens (what the trace must hold,
even where the chat template writes the call's JSON differently) and the
tokenizer.
"""

from __future__ import annotations

import json

import openai
import pytest
from serving import WAIT, http_trace, open_http_session, probing, script, script_tokens, scripted

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Compact JSON, unlike the template's rendering of the same call: the trace must keep this.
CALL = 'Let me check.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache)
    yield s
    s.close()


def open_session(client) -> tuple[str, dict[str, str]]:
    opened = client.post("/sessions", body={}, cast_to=object)
    return opened["session_id"], {"X-Session-ID": opened["session_id"], "X-Session-Token": opened["token"]}


def test_a_tool_call_comes_back_as_tool_calls(served, client):
    script(served, CALL)
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_a_tool_round_trip_in_one_session_is_one_exact_trajectory(served, client):
    sid, headers = open_session(client)
    script(served, CALL, "It is sunny in Oslo.")
    first = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], extra_headers=headers)
    call = first.choices[0].message.tool_calls[0]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 12 C"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], extra_headers=headers)
    assert second.choices[0].message.content == "It is sunny in Oslo." and second.choices[0].finish_reason == "stop"
    trace = client.get(f"/sessions/{sid}/trace", cast_to=object, options={"headers": headers})
    [trajectory] = trace["trajectories"]  # the tool loop stayed one trajectory
    toks, mask = trajectory["tokens"], trajectory["loss_mask"]
    sampled_1, sampled_2 = script_tokens(served, CALL), script_tokens(served, "It is sunny in Oslo.")
    prompt_1 = first.usage.prompt_tokens
    assert toks[prompt_1:prompt_1 + len(sampled_1)] == sampled_1  # what was sampled, not the template's JSON
    assert toks[-len(sampled_2):] == sampled_2
    assert mask == [0] * prompt_1 + [1] * len(sampled_1) + [0] * (len(toks) - prompt_1 - len(sampled_1)
                                                                      - len(sampled_2)) + [1] * len(sampled_2)
    tok = served.engines[0].tokenizer
    between = tok.decode(toks[prompt_1 + len(sampled_1):-len(sampled_2)], skip_special_tokens=False)
    assert between == ("\n<|im_start|>user\n<tool_response>\nsunny, 12 C\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")  # only the tool result and the generation prompt are new


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(served, client):
    script(served, CALL)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_returns_the_text_and_no_calls(served, client):
    script(served, CALL)
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="none")
    assert resp.choices[0].message.content == CALL and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_returns_one_call(served, client):
    two = CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
    script(served, two)
    both = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Oslo", "Bergen"]
    one = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Oslo"]


def test_malformed_tool_call_text_is_content_and_counted(served, client):
    broken = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    script(served, broken)
    before = served.on_loop(lambda: served.sessions.tool_parser.malformed)
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert resp.choices[0].message.content == broken and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"
    assert served.on_loop(lambda: served.sessions.tool_parser.malformed) == before + 1


def test_stop_strings_are_not_part_of_the_reply(served, client):
    script(served, "one two three four")
    resp = client.chat.completions.create(model="tiny", messages=USER, stop=["three"])
    assert resp.choices[0].message.content == "one two " and resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=USER, stop=["three"], stream=True))
    assert streamed == "one two "


def test_models_by_id(served, client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "sampling_params.constraint"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_input_is_a_typed_400_naming_the_field_and_the_server_keeps_serving(served, client, kwargs, field):
    script(served, "fine")
    body = {"model": "tiny", "messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert field in str(info.value)
    assert client.chat.completions.create(model="tiny", messages=USER).choices[0].message.content == "fine"


# -- forced output (constrained decoding; the scripted backend serves only scripts the constraint allows) --

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_tool_choice_required_and_named_force_a_call_and_the_trace_says_so(served, client):
    sid, headers = open_session(client)
    script(served, FORCED)
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                          extra_headers=headers)
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]
    named = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    trace = client.get(f"/sessions/{sid}/trace", cast_to=object, options={"headers": headers})
    request_id = resp.id.removeprefix("chatcmpl-")
    assert trace["constrained"] == [request_id]
    sampled = [g for g in trace["trajectories"][0]["segments"] if g["kind"] == "sampled"]
    assert [g["request_id"] for g in sampled] == [request_id]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_output_the_forced_choice_does_not_allow_is_refused_not_returned(served, client, choice):
    script(served, "I would rather chat." if choice == "required" else FORCED)  # text; or the other tool
    with pytest.raises(openai.BadRequestError, match="does not match"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=choice)
    with pytest.raises(openai.BadRequestError, match="does not match"):  # streamed: still a status, before any byte
        list(client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=choice,
                                            stream=True))


def test_response_format_json_schema_forces_json(served, client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    script(served, '{"answer": 42}')
    resp = client.chat.completions.create(model="tiny", messages=USER, response_format=fmt)
    assert json.loads(resp.choices[0].message.content) == {"answer": 42}
    script(served, '{"answer": "forty-two"}')
    with pytest.raises(openai.BadRequestError, match="does not match"):
        client.chat.completions.create(model="tiny", messages=USER, response_format=fmt)
    script(served, '[1, 2]')
    with pytest.raises(openai.BadRequestError, match="does not match"):
        client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"})
    script(served, FORCED)  # with auto tools a JSON response may instead be a tool call
    either = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], response_format=fmt)
    assert either.choices[0].finish_reason == "tool_calls"


def test_top_logprobs_within_the_backends_limit(served, client):
    script(served, "fine")
    resp = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=1)
    entries = resp.choices[0].logprobs.content
    assert [e.token for e in entries][:-1] == [e.top_logprobs[0].token for e in entries][:-1]
    assert all(len(e.top_logprobs) == 1 and e.top_logprobs[0].logprob == 0.0 for e in entries)
    for kwargs, field in [({"logprobs": True, "top_logprobs": 2}, "sampling_params.top_logprobs"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"top_logprobs": 1}, "top_logprobs")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model="tiny", messages=USER, **kwargs)


def test_a_request_too_large_for_the_context_is_refused_before_rendering_and_others_stay_served(served, client):
    # 10 M characters (under the 16 MiB body limit): before the check, rendering and tokenizing it
    # on the loop stalled every client for seconds. A probe asks for the models meanwhile.
    script(served, "fine")
    with probing(served) as latencies:
        big = [{"role": "user", "content": "lorem ipsum " * 833_334}]
        with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens") as info:
            client.chat.completions.create(model="tiny", messages=big)
        assert info.value.code == "context_length_exceeded"  # OpenAI's code: clients shorten their history on it
        assert "bytes is larger than any request that fits" in str(info.value)  # refused before it was read
        medium = [{"role": "user", "content": "lorem ipsum " * 10_000}]  # read, but refused before rendering
        with pytest.raises(openai.BadRequestError, match="120000 characters cannot fit"):
            client.chat.completions.create(model="tiny", messages=medium)
    # Typically 0.01-0.05 s; on the loop the render stalled every client for seconds.
    assert len(latencies) > 10 and max(latencies) < 1.0, max(latencies)
    assert client.chat.completions.create(model="tiny", messages=USER).choices[0].message.content == "fine"


class _SlowEncode:
    """A renderer whose tokenizer takes ``delay_s`` (sleeping, as the tokenizer releases the GIL)
    for every text of more than ``above`` characters: what a prompt near a large context costs."""

    def __init__(self, renderer, delay_s: float, above: int) -> None:
        self._renderer, self.delay_s, self.above = renderer, delay_s, above
        self.slow_calls = 0

    def encode(self, text: str) -> list[int]:
        import time

        if len(text) > self.above:
            self.slow_calls += 1
            time.sleep(self.delay_s)
        return self._renderer.encode(text)

    def __getattr__(self, name: str):
        return getattr(self._renderer, name)


@pytest.fixture
def slow_render(served):
    """Chat turns of 500 characters or more rendered off the loop, by a tokenizer that takes 2 s."""
    sessions = served.server.sessions
    renderer, offload = sessions.renderer, sessions.offload_chars
    slow = _SlowEncode(renderer, 2.0, 400)
    sessions.renderer, sessions.offload_chars = slow, 500
    yield slow
    sessions.renderer, sessions.offload_chars = renderer, offload


def test_a_long_prompt_is_tokenized_off_the_loop_while_others_stay_served(served, client, slow_render):
    """A prompt that takes 2 s to tokenize: a probe's requests meanwhile are answered at once
    (on the loop, every one of them waited for it), and the turn's trace is exactly the one an
    on-loop turn stores."""
    script(served, "fine")
    long = [{"role": "user", "content": "lorem ipsum " * 60}]  # 720 characters
    with probing(served) as latencies:
        off_loop = open_http_session(served)
        with openai.OpenAI(base_url=off_loop["base_url"], api_key=off_loop["token"], max_retries=0,
                           timeout=WAIT) as c:
            assert c.chat.completions.create(model="tiny", messages=long).choices[0].message.content == "fine"
    assert slow_render.slow_calls == 1
    # Typically 0.01-0.05 s; on the loop every probe meanwhile waited for the 2 s encode.
    assert len(latencies) > 10 and max(latencies) < 1.0, max(latencies)
    # The same turn rendered on the loop: the same stored tokens.
    served.server.sessions.offload_chars = 10**9
    on_loop = open_http_session(served)
    with openai.OpenAI(base_url=on_loop["base_url"], api_key=on_loop["token"], max_retries=0, timeout=WAIT) as c:
        c.chat.completions.create(model="tiny", messages=long)
    assert slow_render.slow_calls == 2
    (a,), (b,) = (http_trace(served, s)["trajectories"] for s in (off_loop, on_loop))
    assert a["tokens"] == b["tokens"] and a["loss_mask"] == b["loss_mask"] and len(a["tokens"]) > 100


def test_a_turn_abandoned_while_its_prompt_renders_is_aborted_and_never_submitted(served, client, slow_render):
    from rlengine.protocol import TurnAborted
    from rlengine.types import SamplingParams

    script(served, "first", "second")
    sessions = served.server.sessions
    long = [{"role": "user", "content": "lorem ipsum " * 60}]

    def start():
        fut = sessions.chat(None, long, SamplingParams(max_tokens=8))
        assert sessions.in_flight == 1 and fut.request_id.startswith("preparing-")
        sessions.abandon(fut.request_id, "the client went away")
        return fut

    fut = served.on_loop(start)
    assert isinstance(fut.exception(WAIT), TurnAborted)
    import time

    time.sleep(0.8)  # the render thread finishes it meanwhile: it is dropped, not submitted
    assert served.on_loop(lambda: sessions.in_flight) == 0
    reply = client.chat.completions.create(model="tiny", messages=USER)
    assert reply.choices[0].message.content == "first"  # the backend never saw the abandoned turn
