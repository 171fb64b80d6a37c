"""Forced output closes within a small budget (issue 31, item 7): compact JSON, bounded numbers,
and a structure closed before ``max_tokens`` runs out.

A random tiny model is the adversary: under xgrammar's default JSON grammar it
filled free whitespace and endless strings until ``max_tokens`` (every forced
call of 64 tokens ended as ``length`` with malformed arguments). Here the torch
backend serves it over real HTTP to the official ``openai`` and ``anthropic``
clients, on every endpoint that can force output. References: ``json.loads``,
``jsonschema`` (the arguments must match the tool's schema) and xgrammar's own
matcher (what the laid-out grammar accepts).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr
from serving import WAIT, Served

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.grammar import MAX_DIGITS, Grammars, json_layout
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.models import load_tokenizer
from rlengine.constraints import output_constraint
from rlengine.errors import InvalidRequest
from rlengine.serve import ServeConfig
from rlengine.tool_parsers import HermesParser

WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["C", "F"]},
    "lat": {"type": "number"}}, "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_ARGS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
BUDGET = 64
SEEDS = range(6)


def _accepts(grammars: Grammars, constraint: str, text: str) -> bool:
    return grammars.matcher(constraint).matcher.accept_string(text)


# -- the grammar: compact by default, free whitespace on request, numbers bounded ----------------------------


@pytest.fixture(scope="module")
def grammars(tiny_model):
    return Grammars(load_tokenizer(tiny_model), 1024, [0])


def test_compact_json_rejects_free_whitespace_and_the_opt_in_accepts_it(grammars):
    compact = output_constraint(None, None, "auto", schema=WEATHER_ARGS)
    free = output_constraint(None, None, "auto", schema=WEATHER_ARGS, whitespace="any")
    assert json.loads(free)["json_whitespace"] == "any" and "json_whitespace" not in json.loads(compact)
    canonical = json.dumps({"city": "Oslo", "days": 3})  # json.dumps' own layout: ", " and ": "
    for text in ('{"city": "Oslo", "days": 3}', '{ "city": "Oslo", "days": 3}', '{"city":  "Oslo", "days": 3}',
                 '{"city": "Oslo" , "days": 3}', '{"city": "Oslo",\n"days": 3}', '{"city":"Oslo","days":3}'):
        assert _accepts(grammars, compact, text) == (text == canonical), text
        assert _accepts(grammars, free, text), text
    with pytest.raises(InvalidRequest, match="json_whitespace.*'tabs'"):
        output_constraint(None, None, "auto", schema=WEATHER_ARGS, whitespace="tabs")
    with pytest.raises(InvalidRequest, match=r"sampling_params\.constraint\.json_whitespace"):
        json_layout(json.dumps({"type": "structural_tag", "json_whitespace": 1, "format": {"type": "json_schema",
                                                                                            "json_schema": True}}))


@pytest.mark.parametrize("whitespace", ["compact", "any"])
def test_numbers_are_bounded_in_their_integer_part_fraction_and_exponent(grammars, whitespace):
    constraint = output_constraint(None, None, "auto", schema=WEATHER_ARGS, whitespace=whitespace)
    nines = "9" * MAX_DIGITS

    def days(value: str) -> bool:
        return _accepts(grammars, constraint, f'{{"city": "Oslo", "days": {value}}}')

    def lat(value: str) -> bool:
        return _accepts(grammars, constraint, f'{{"city": "Oslo", "days": 1, "lat": {value}}}')

    assert days(nines) and days("-" + nines) and not days(nines + "9") and not days("-" + nines + "9")
    assert lat(f"{nines}.{nines}e-{nines}") and not lat(nines + "9") and not lat(f"1.{nines}9")
    assert not lat(f"1e{nines}9")


def test_a_users_own_xgrammar_layout_options_are_kept():
    styled = {"type": "json_schema", "json_schema": WEATHER_ARGS, "max_whitespace_cnt": 2}
    laid = json.loads(json_layout(json.dumps({"type": "structural_tag", "format": styled})))
    assert laid["format"] == styled
    plain = json.loads(json_layout(json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": WEATHER_ARGS}})))
    assert plain["format"]["type"] == "grammar"
    xgr.Grammar.from_structural_tag(json.dumps(plain))  # what vLLM is handed compiles


# -- the torch backend: every forced call closes within the budget -------------------------------------------


def _drain(backend) -> dict[str, tuple[list[int], str | None, str | None]]:
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    while backend.has_unfinished_requests():
        for o in backend.step():
            tokens, _, _ = out.get(o.request_id, ([], None, None))
            out[o.request_id] = (tokens + list(o.token_ids), o.stop_reason, o.error)
    return out


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("budget", [BUDGET, 96, 160])
@pytest.mark.parametrize("choice", ["function", "required"])
def test_a_forced_call_of_a_random_model_closes_within_its_budget(tiny_model, choice, budget):
    backend, tokenizer, parser = TorchBackend(tiny_model), load_tokenizer(tiny_model), HermesParser()
    constraint = output_constraint(parser, [WEATHER, TIME], choice, "get_weather")
    prompt = np.asarray(tokenizer("What is the weather?", add_special_tokens=False)["input_ids"], dtype=np.int32)
    for seed in SEEDS:
        backend.add_request(BackendRequest(
            request_id=f"r{seed}", prompt=prompt.tobytes(), seed=seed, max_tokens=budget, stream=False,
            params=rle.SamplingParams(max_tokens=budget, temperature=1.0, constraint=constraint)))
    outs = _drain(backend)
    for seed in SEEDS:
        tokens, reason, error = outs[f"r{seed}"]
        assert error is None and reason == "stop" and len(tokens) <= budget, (seed, tokenizer.decode(tokens))
        calls = parser.parse(tokenizer.decode(tokens[:-1])).tool_calls
        assert calls and (choice == "required" or [c.name for c in calls] == ["get_weather"])
        for call in calls:
            _check_call(call.name, call.arguments)


# -- every endpoint, with the official clients ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served(engine_config):
    s = Served([engine_config("torch")], ServeConfig(ipc=False))
    yield s
    s.close()


@pytest.fixture(scope="module")
def openai_client(served):
    import openai

    with openai.OpenAI(base_url=served.http_url, api_key=served.api_key, max_retries=0, timeout=WAIT) as c:
        yield c


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_chat_completions_forced_calls_finish_as_tool_calls(openai_client, choice):
    for seed in SEEDS:
        resp = openai_client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                     tool_choice=choice, max_tokens=BUDGET, temperature=1.0,
                                                     seed=seed)
        out = resp.choices[0]
        assert out.finish_reason == "tool_calls", (seed, out)
        assert out.message.tool_calls and resp.usage.completion_tokens <= BUDGET
        for call in out.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)


def test_chat_completions_json_schema_response_finishes_and_parses(openai_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_ARGS}}
    for seed in SEEDS:
        resp = openai_client.chat.completions.create(model="tiny", messages=USER, response_format=fmt,
                                                     max_tokens=BUDGET, temperature=1.0, seed=seed)
        assert resp.choices[0].finish_reason == "stop", (seed, resp.choices[0])
        jsonschema.validate(json.loads(resp.choices[0].message.content), WEATHER_ARGS)


def test_chat_completions_free_whitespace_on_request(openai_client):
    import openai

    # Free whitespace is honoured: the sampled text is still a call that parses.
    resp = openai_client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=BUDGET, temperature=1.0,
        seed=0, extra_body={"json_whitespace": "any"})
    assert resp.choices[0].finish_reason == "tool_calls"
    _check_call("get_weather", resp.choices[0].message.tool_calls[0].function.arguments)
    with pytest.raises(openai.BadRequestError, match="json_whitespace"):
        openai_client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required",
                                              max_tokens=BUDGET, extra_body={"json_whitespace": "lots"})


def test_responses_forced_function_call_finishes(openai_client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER_ARGS}
    for _ in SEEDS:
        resp = openai_client.responses.create(model="tiny", input="What is the weather in Oslo?", tools=[tool],
                                              tool_choice={"type": "function", "name": "get_weather"},
                                              max_output_tokens=BUDGET, temperature=1.0)
        calls = [item for item in resp.output if item.type == "function_call"]
        assert resp.status == "completed" and [c.name for c in calls] == ["get_weather"], resp
        _check_call("get_weather", calls[0].arguments)


def test_anthropic_forced_tool_use_finishes(served):
    import anthropic

    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_ARGS}
    with anthropic.Anthropic(base_url=served.http_url.removesuffix("/v1"), api_key=served.api_key, max_retries=0,
                             timeout=WAIT) as client:
        for _ in SEEDS:
            msg = client.messages.create(model="tiny", max_tokens=BUDGET, messages=USER, tools=[tool],
                                         tool_choice={"type": "tool", "name": "get_weather"})
            assert msg.stop_reason == "tool_use", msg
            [use] = [b for b in msg.content if b.type == "tool_use"]
            jsonschema.validate(use.input, WEATHER_ARGS)
