"""OpenAI's legacy Completions API (``POST /v1/completions``), with the official ``openai`` client unchanged.

On the torch backend's tiny model, so tokens are the model's and logprobs
real: a completion's tokens and logprobs (and its ``top_logprobs``) equal
what the engine's own API samples for the same prompt and seed, streamed
or not, from a text or a token-id prompt; in a session the turn is traced
like ``generate``. Batches of more than one prompt and ``echo`` with
``logprobs`` are refused with a 400 naming the field.
"""

from __future__ import annotations

import math

import openai
import pytest
from serving import WAIT, Served

import rlengine as rle
from rlengine.serve import ServeConfig

pytestmark = pytest.mark.model_plane  # the tiny model: left out of a light install


@pytest.fixture(scope="module")
def served(model_cache):
    s = Served([rle.EngineConfig(backend="torch", model="tiny", model_name="tiny", cache_dir=model_cache)],
               ServeConfig(ipc=False))
    yield s
    s.close()


def engine_sample(served, ids, **params):
    """The engine's own sample of ``ids`` (its Python API, not the server)."""
    resp = served.engines[0].sample(ids, 1, rle.SamplingParams(**params)).result(WAIT)
    return resp.sequences[0]


def decode(served, ids):
    return served.engines[0].tokenizer.decode(ids)


def expected_logprobs(served, seq, k):
    """OpenAI's ``logprobs`` object for the engine's sequence ``seq`` (top ``k`` plus the sampled token)."""
    texts = [decode(served, [t]) for t in seq.tokens]
    tops = rle.types.unpack_top(seq.tokens_raw, seq.top_ids_raw, seq.top_logprobs_raw)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    top = [{**{decode(served, [a]): lp for a, lp in alts if lp != -math.inf}, text: lp}
           for text, lp, alts in zip(texts, seq.logprobs, tops)]
    return texts, list(seq.logprobs), top, offsets


def test_a_text_prompt_with_logprobs_matches_the_engines_own_sample(served, client):
    prompt = "The quick brown fox"
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, seed=11, logprobs=3,
                                     temperature=1.0)
    ids = served.engines[0].tokenizer(prompt, add_special_tokens=False)["input_ids"]
    seq = engine_sample(served, ids, max_tokens=8, seed=11, top_logprobs=3)
    [choice] = done.choices
    tokens, lps, top, offsets = expected_logprobs(served, seq, 3)
    assert done.object == "text_completion" and choice.finish_reason == seq.stop_reason
    assert choice.logprobs.tokens == tokens and choice.logprobs.text_offset == offsets
    assert choice.logprobs.token_logprobs == pytest.approx(lps, rel=1e-6, abs=1e-6)
    assert [set(d) for d in choice.logprobs.top_logprobs] == [set(d) for d in top]
    assert all(len(d) <= 4 for d in choice.logprobs.top_logprobs)
    assert [v for d in choice.logprobs.top_logprobs for v in sorted(d.values())] == pytest.approx(
        [v for d in top for v in sorted(d.values())], rel=1e-6, abs=1e-6)
    assert choice.text == served.engines[0].tokenizer.decode(
        seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens, skip_special_tokens=True)
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == len(seq.tokens)


def test_a_token_id_prompt_streamed_adds_up_to_the_engines_sample(served, client):
    ids = [5, 17, 42, 99, 7]
    seq = engine_sample(served, ids, max_tokens=12, seed=3, top_logprobs=2)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=12, seed=3, logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].finish_reason == seq.stop_reason
    tokens, lps, _top, _offsets = expected_logprobs(served, seq, 2)
    assert finals[0].logprobs.tokens == tokens
    assert finals[0].logprobs.token_logprobs == pytest.approx(lps, rel=1e-6, abs=1e-6)
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=12, seed=3)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(seq.tokens) and chunks[-1].usage.prompt_tokens == len(ids)


def test_a_session_completion_is_traced_like_generate(served, client):
    opened = client.post("/sessions", body={}, cast_to=object)
    ids = [3, 1, 4, 1, 5, 9]
    done = client.completions.create(model="tiny", prompt=ids, max_tokens=6, seed=2, logprobs=0,
                                     extra_headers={"X-Session-ID": opened["session_id"],
                                                    "X-Session-Token": opened["token"]})
    trace = client.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                       options={"headers": {"X-Session-Token": opened["token"]}})
    [traj] = trace["trajectories"]
    sampled = [t for t, m in zip(traj["tokens"], traj["loss_mask"]) if m]
    assert trace["turns"] == 1 and traj["tokens"][:len(ids)] == ids
    assert [decode(served, [t]) for t in sampled] == done.choices[0].logprobs.tokens
    assert [lp for lp, m in zip(traj["logprobs"], traj["loss_mask"]) if m] == pytest.approx(
        done.choices[0].logprobs.token_logprobs, rel=1e-6, abs=1e-6)
    # On the session's own base URL too, with its token as the key.
    with openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT) as own:
        own.completions.create(model="tiny", prompt="more", max_tokens=3, seed=1)
    trace = client.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                       options={"headers": {"X-Session-Token": opened["token"]}})
    assert trace["turns"] == 2


def test_n_stop_echo_and_a_batch_of_one(served, client):
    done = client.completions.create(model="tiny", prompt=["Once upon"], max_tokens=10, n=3, seed=4, echo=True)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.text.startswith("Once upon") for c in done.choices)
    streamed = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, seed=4, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text  # n's first sample: the same seed
    plain = client.completions.create(model="tiny", prompt=[[5, 6, 7]], max_tokens=10, seed=4)
    stop = plain.choices[0].text[2:4]
    cut = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=10, seed=4, stop=[stop])
    assert stop and cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert plain.choices[0].text.startswith(cut.choices[0].text)


@pytest.mark.parametrize(("kwargs", "param", "fragment"), [
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "one prompt per request"),
    ({"prompt": [1, "x"]}, "prompt", "integers only"),
    ({"prompt": []}, "prompt", "at least one token"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, None, "echo with logprobs"),
    ({"prompt": "hi", "suffix": "end"}, None, "suffix"),
    ({"prompt": "hi", "best_of": 3}, None, "best_of"),
    ({"prompt": "hi", "max_tokens": 5000}, "max_tokens", "maximum context length is 2048"),
])
def test_bad_completions_are_400_naming_the_field(client, kwargs, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **{"max_tokens": 4, **kwargs})
    error = info.value.body
    assert fragment in error["message"] and error["param"] == param, error
