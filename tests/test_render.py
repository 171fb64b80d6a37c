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
