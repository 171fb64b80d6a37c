"""rlengine.tool_parsers: a completion's text into its content and its tool calls.

References: the JSON the text holds, parsed by ``json`` on its own, and
OpenAI's shape of a call (an id, a name, the arguments as a JSON text).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlengine.tool_parsers import PARSERS, HermesParser, parser_for, register


def block(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_plain_text_has_no_calls():
    parser = HermesParser()
    turn = parser.parse("Hello there.")
    assert turn == ("Hello there.", [], False) and parser.malformed == 0


def test_calls_after_text_and_several_calls():
    parser = HermesParser()
    turn = parser.parse("Let me check.\n" + block("get_weather", {"city": "Oslo"}) + "\n"
                        + block("get_time", {"zone": "CET"}))
    assert turn.content == "Let me check." and not turn.malformed
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in turn.tool_calls)
    assert len({c.id for c in turn.tool_calls}) == 2
    only = parser.parse(block("f", {}))
    assert only.content is None and [c.name for c in only.tool_calls] == ["f"]


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    turn = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(turn.tool_calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    "<tool_call>{\"arguments\": {}}</tool_call>",  # no name
    "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",  # arguments not an object
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}",  # never closed
    "<tool_call>{\"name\": \"f\", \"arguments\": {}} </tool_cal>",
    block("f", {}) + " and then some text",
    block("f", {}) + " between " + block("g", {}),
])
def test_malformed_markup_comes_back_as_content_and_is_counted(text):
    parser = HermesParser()
    turn = parser.parse(text)
    assert turn == (text, [], True)
    assert parser.malformed == 1


_names = st.text(min_size=1, max_size=12) | st.just("a</tool_call>b")


@given(st.text(max_size=40), st.lists(st.tuples(_names,
                                                st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5),
                                                                max_size=3)), min_size=1, max_size=3))
def test_what_a_template_writes_parses_back(prefix, calls):
    text = (prefix.strip() + "\n" if prefix.strip() and "<tool_call>" not in prefix else "") + "\n".join(
        block(name, arguments) for name, arguments in calls)
    turn = HermesParser().parse(text)
    assert not turn.malformed
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == calls


def test_the_registry_chooses_by_template_or_name():
    assert isinstance(parser_for("...<tool_call>..."), HermesParser)
    assert parser_for("{{ messages }}") is None  # a template without a tool format
    assert isinstance(parser_for(None, "hermes"), HermesParser)
    with pytest.raises(ValueError, match="tool_parser='nope'"):
        parser_for(None, "nope")

    class Mine(HermesParser):
        name = "mine"

    register("mine", Mine)
    try:
        assert isinstance(parser_for(None, "mine"), Mine)
    finally:
        del PARSERS["mine"]


def test_the_tiny_models_template_writes_what_the_parser_reads(tiny_model):
    from rlengine.backends.torch.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "Checking.", "tool_calls": [call]}],
                                       tokenize=False)
    generated = rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parser = parser_for(tok.chat_template)
    turn = parser.parse(generated)
    assert turn.content == "Checking." and [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
