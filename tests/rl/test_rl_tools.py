"""The ``tools`` recipe: an ``openai``-client agent with ``tools=[read_meter]`` in sandboxes, over HTTP.

References: the chat template's text written out by hand, the parser's
reading of every kind of turn, and the run's own metrics (what the agents
reported and the loop counted). The learning test is the real recipe from
random init; CI runs its first steps, which show calling being learned and
the reward rising; the whole run (to a mean reward of 0.8 within 10 minutes)
is marked ``long`` (``pytest -m long tests/rl/test_rl_tools.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from rlengine.backends.torch.models import load_tokenizer, prepare_char_model
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.recipes.tools import ALPHABET, CHAT_TEMPLATE, END, MeterCalls
from rlengine.rl.recipes.tools_agent import TOOL, TOOLS, reward
from rlengine.rl.run import train


@pytest.mark.model_plane
def test_the_template_and_the_call_syntax_write_a_tool_episode_in_a_dozen_characters(model_cache):
    tok = load_tokenizer(prepare_char_model(ALPHABET, END, cache_dir=model_cache, chat_template=CHAT_TEMPLATE))
    call = {"id": "call_1", "type": "function", "function": {"name": TOOL, "arguments": {}}}
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == "U?$A@$=7$A"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [ALPHABET.index(c) + 1 for c in text] and tok.eos_token_id == ALPHABET.index("$") + 1
    parser = MeterCalls()
    (only,) = parser.parse("@").tool_calls
    assert only.name == TOOL and only.arguments == "{}" and parser.parse("@").content is None
    assert len(parser.parse("@@").tool_calls) == 2
    assert parser.parse("7") == ("7", [], False) and parser.malformed == 0
    assert parser.parse("@5") == ("@5", [], True) and parser.malformed == 1  # a malformed call is text
    assert parser.split_closing("@$") == ("@", "$")


def test_the_reward_pays_the_answer_and_calling_only_with_an_answer():
    assert reward(True, "7", "7") == 1.0 and reward(False, "7", "7") == 0.8
    assert reward(True, "3", "7") == pytest.approx(0.2) and reward(True, None, "7") == 0.0
    assert reward(False, "@5", "7") == 0.0  # a malformed call scored as the (wrong) answer it is


def _run(tmp_path, model_cache, **settings):
    outcome = train("tools", {"eval_every": 0, "checkpoint_every": 0, "cache_dir": model_cache, **settings},
                    run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    return read_jsonl(outcome.metrics_path)


@pytest.mark.model_plane
@pytest.mark.slow
def test_the_agent_learns_to_call_the_tool_and_the_reward_rises(tmp_path, model_cache):
    steps = _run(tmp_path, model_cache, steps=20)
    called = [s["env/called"] for s in steps]
    rewards = [s["reward_mean"] for s in steps]
    assert len(steps) == 20 and all(s["attempts_failed"] == 0 for s in steps)
    assert np.mean(called[:3]) < 0.25 and np.mean(called[-3:]) > 0.8, called  # from chance to always
    assert np.mean(rewards[:3]) < 0.15 and np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
    assert all(s["kl_sample_train_v1"] < 1e-4 for s in steps)  # the exact sampled tokens are trained


@pytest.mark.model_plane
def test_crashed_agents_are_masked_counted_and_the_run_goes_on(tmp_path, model_cache):
    # A crash ends its worker; the episodes it was playing are played again in quarantine, where
    # only the crash-marked one (every 16th) crashes: 64 episodes, 4 marked, 4 failures, all crashes.
    steps = _run(tmp_path, model_cache, steps=2, groups_per_batch=4, crash_every=16, max_failure_share=1.0)
    assert sum(s["attempts_failed_crash"] for s in steps) == sum(s["attempts_failed"] for s in steps) == 4
    groups = read_jsonl(str(tmp_path / "groups.jsonl"))
    failures = [f for g in groups for f in g.get("failures", [])]
    assert failures and all(f["kind"] == "crash" and f["stage"] == "agent" for f in failures)
    # A failed attempt has no reward: the group's rewards (its advantage statistics) are the survivors'.
    assert all(len(g["rewards"]) == 8 - len(g.get("failures", [])) for g in groups)


@pytest.mark.long
def test_the_tools_recipe_reaches_a_mean_reward_of_08(tmp_path, model_cache):
    steps = _run(tmp_path, model_cache)
    reached = next((s for s in steps if s["reward_mean"] >= 0.8), None)
    assert reached is not None, [round(s["reward_mean"], 2) for s in steps]
    assert reached["time_s"] < 600
