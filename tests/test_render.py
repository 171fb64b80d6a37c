"""``rlengine.render``: the one chat-rendering module.

References: the tokenizer's own ``apply_chat_template`` and the ChatML
text written out by hand. The suffix rendering behind exact traces is tested
through the session layer (``tests/serve/test_sessions.py``).
"""

from __future__ import annotations

import json
import os

import pytest

from rlengine.errors import InvalidRequest
from rlengine.render import ByteRenderer, normalize_messages, render_chat


def load_tokenizer(path: str):
    from rlengine.backends.torch.models import load_tokenizer

    return load_tokenizer(path)


def test_chat_template_is_chatml_and_render_chat_equals_apply_chat_template(tiny_model):
    tok = load_tokenizer(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Kalo 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\nThanks."}]
    for add in (True, False):
        ids = render_chat(tok, messages, add_generation_prompt=add)
        assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                   add_generation_prompt=add))
        by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        by_hand += "<|im_start|>assistant\n" if add else ""
        assert ids == tok(by_hand, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == by_hand
    from rlengine.backends.torch import models

    with open(os.path.join(tiny_model, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == models.CHAT_TEMPLATE  # readable by older transformers too


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"content": "no role"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_render_chat_rejects_bad_messages(tiny_model, messages, field):
    tok = load_tokenizer(tiny_model)
    with pytest.raises(InvalidRequest) as info:
        render_chat(tok, messages, True)
    assert info.value.field == field




def test_messages_are_normalized_from_dicts_and_objects():
    class Message:
        def __init__(self, role, content, name=None):
            self.role, self.content, self.name = role, content, name

    given = [{"role": "user", "content": "hi", "name": "ann"}, Message("assistant", "yo")]
    assert normalize_messages(given) == [{"role": "user", "content": "hi", "name": "ann"},
                                         {"role": "assistant", "content": "yo"}]
    with pytest.raises(InvalidRequest) as info:
        normalize_messages([{"role": "user", "content": "x", "name": 3}])
    assert info.value.field == "messages[0].name"


def test_byte_renderer_round_trips_text_as_byte_tokens():
    renderer = ByteRenderer()
    text = renderer.render([{"role": "user", "content": "h\u00e9"}], True)
    assert text == "<user>\nh\u00e9\n</user>\n<assistant>\n"
    ids = renderer.encode(text)
    assert ids == list(text.encode("utf-8")) and renderer.decode(ids) == text
    assert renderer.decode([104, 300, 105]) == "h\ufffdi"  # ids past the byte range decode to U+FFFD


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}


def _render(tok, messages, generation, tools=None):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def test_the_tiny_template_renders_tools_tool_calls_and_tool_results(tiny_model):
    tok = load_tokenizer(tiny_model)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"}]
    text = _render(tok, messages, True, tools=[WEATHER])
    import json as _json

    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + _json.dumps(WEATHER)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 12 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # Text before the calls, and the reasoning kept in <think>:
    thought = {"role": "assistant", "content": "Checking.", "reasoning_content": "need the tool", "tool_calls": [call]}
    assert _render(tok, [messages[1], thought], False) == (
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<think>\nneed the tool\n</think>\n"
        "\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
        "<|im_end|>\n")


def test_the_tiny_template_extends_a_tool_loop_and_branches_at_grouped_tool_results(tiny_model):
    """Exact traces need rendering more messages to only append text. A tool loop does; the
    second of two consecutive tool results does not (both sit in one user turn, whose close
    moves), so a session branches there instead of re-tokenizing (rlengine.render)."""
    tok = load_tokenizer(tiny_model)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    loop_ = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "Thanks"}]
    for k in range(1, len(loop_)):
        head = _render(tok, loop_[:k], loop_[k]["role"] == "assistant", tools=[WEATHER])
        assert _render(tok, loop_[:k + 1], False, tools=[WEATHER]).startswith(head), k
    grouped = loop_[:3] + [{"role": "tool", "content": "windy"}]
    assert not _render(tok, grouped, False).startswith(_render(tok, grouped[:3], False))
