"""Exact traces under chat templates that are not prefix-stable: the session branches.

Two templates the tiny model can carry, each rendering an earlier turn
differently once the conversation goes on: a Qwen3-style template that
drops a past assistant turn's ``<think>`` block, and a tool template that
drops the newline after an assistant turn when a tool result follows it.
Neither continuation can extend the stored tokens, so the session branches
at the last position that still matches (the end of the previous prompt)
and the new branch holds the template's rendering: every trajectory is
exactly what the model saw and produced. References: the tokenizer applied
to the template's own rendering, and the script's tokens.
"""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from serving import WAIT, Served

import rlengine as rle
from rlengine.backends.torch import models
from rlengine.serve import ServeConfig

QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CLOSE = "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
assert models.CHAT_TEMPLATE.count(_CLOSE) == 1
SEPARATOR_DROPPING = models.CHAT_TEMPLATE.replace(_CLOSE, (
    "{%- endfor %}{{- '<|im_end|>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"))

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def model_with_template(tiny_model: str, directory, template: str) -> str:
    path = str(directory)
    shutil.copytree(tiny_model, path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


@pytest.fixture
def serve(tiny_model, tmp_path):
    started = []

    def start(template: str, script: list[str]) -> tuple[Served, openai.OpenAI]:
        path = model_with_template(tiny_model, tmp_path / f"model{len(started)}", template)
        served = Served([rle.EngineConfig(backend="scripted", model=path, model_name="m",
                                          engine_args={"script": script})], ServeConfig(ipc=False))
        started.append(served)
        client = openai.OpenAI(base_url=served.http_url, api_key=served.api_key, max_retries=0, timeout=WAIT)
        started.append(client)
        return served, client

    yield start
    for thing in reversed(started):
        thing.close()


def session_client(served: Served, client: openai.OpenAI) -> tuple[str, openai.OpenAI]:
    opened = client.post("/sessions", body={}, cast_to=object)
    own = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    return opened["session_id"], own


def check_branches(served, sid, first, second, history, tools=None):
    """Two trajectories: turn 1 as sampled, and turn 2 on the template's rendering of the history."""
    tok = served.engines[0].tokenizer
    [t1, t2] = served.on_loop(lambda: served.sessions.store.export(sid))
    sampled_1 = [*tok(first, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    sampled_2 = [*tok(second, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    a, b = t1.tokens.tolist(), t2.tokens.tolist()
    assert a[-len(sampled_1):] == sampled_1 and t1.loss_mask.tolist()[-len(sampled_1):] == [1] * len(sampled_1)
    rendered = tok.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    assert b == tok(rendered, add_special_tokens=False)["input_ids"] + sampled_2  # what the model saw, exactly
    # The branch starts after turn 1's prompt; where the re-rendering begins with the same
    # tokens the model sampled, the trie shares those (sampled, as they were).
    shared = t2.shared_prefix
    assert len(a) - len(sampled_1) <= shared < len(a)
    assert t2.loss_mask.tolist()[:shared] == t1.loss_mask.tolist()[:shared]
    assert sum(t2.loss_mask.tolist()[shared:]) == len(sampled_2)  # the re-rendered rest of turn 1 is not trained on


def test_a_template_that_drops_past_thinking_branches_after_the_first_prompt(serve):
    first = "<think>\nThe user wants a greeting.\n</think>\n\nHello!"
    served, client = serve(QWEN3_LIKE, [first, "Fine, thanks."])
    sid, own = session_client(served, client)
    history = [{"role": "user", "content": "Hi"}]
    reply = own.chat.completions.create(model="m", messages=history)
    assert reply.choices[0].message.content == first
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "How are you?"}]
    assert own.chat.completions.create(model="m", messages=history).choices[0].message.content == "Fine, thanks."
    check_branches(served, sid, first, "Fine, thanks.", history)
    own.close()


# The model writes the call's JSON compactly, the template with spaces: a re-rendering of the
# call is other tokens than the sampled ones.
COMPACT_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'


def test_a_template_that_drops_a_separator_before_a_tool_result_branches(serve):
    call = COMPACT_CALL
    served, client = serve(SEPARATOR_DROPPING, [call, "Sunny."])
    sid, own = session_client(served, client)
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = own.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    [tool_call] = reply.choices[0].message.tool_calls
    history += [reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"}]
    again = own.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert again.choices[0].message.content == "Sunny."
    as_template_sees_it = [history[0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"}]
    check_branches(served, sid, call, "Sunny.", as_template_sees_it, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}])
    own.close()


def test_the_tiny_template_keeps_the_same_tool_loop_in_one_trajectory(serve):
    """The control: the tiny model's own template extends the same loop, so nothing branches
    (the resent call is matched back to the sampled tokens)."""
    call = COMPACT_CALL
    served, client = serve(models.CHAT_TEMPLATE, [call, "Sunny."])
    sid, own = session_client(served, client)
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = own.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    history += [reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "sunny"}]
    own.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert len(served.on_loop(lambda: served.sessions.store.export(sid))) == 1
    own.close()
