"""rlengine.backends.scripted: completions given as text, through the real engine.

References: the tiny model's own tokenizer (what the script must decode
back to), and the script itself.
"""

from __future__ import annotations

import pytest

import rlengine as rle
from rlengine.errors import ConfigurationError

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

WAIT = 120
CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.fixture(scope="module")
def engine(model_cache):
    cfg = rle.EngineConfig(backend="scripted", cache_dir=model_cache, engine_args={"script": ["Hello there.", CALL]})
    with rle.Engine(cfg) as e:
        yield e


def text(engine, seq) -> str:
    return engine.tokenizer.decode(seq.tokens, skip_special_tokens=False)


def test_each_sequence_takes_the_next_text_in_order_and_ends_its_turn(engine):
    engine.backend.set_script(["Hello there.", CALL])
    sampler = engine.sampling_client()
    got = [sampler.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=200)).result(WAIT).sequences[0]
           for _ in range(3)]
    assert [text(engine, s) for s in got] == ["Hello there.<|im_end|>", CALL + "<|im_end|>", "Hello there.<|im_end|>"]
    assert all(s.stop_reason == "stop" for s in got)
    assert all(s.logprobs == [0.0] * s.length for s in got)  # the script is certain
    assert got[1].tokens[:-1] == engine.tokenizer(CALL, add_special_tokens=False)["input_ids"]


def test_max_tokens_stop_strings_and_n_samples(engine):
    engine.backend.set_script(["one two three four"])
    sampler = engine.sampling_client()
    cut = sampler.sample([1], 1, rle.SamplingParams(max_tokens=2)).result(WAIT).sequences[0]
    assert cut.length == 2 and cut.stop_reason == "length"
    stopped = sampler.sample([1], 1, rle.SamplingParams(max_tokens=50, stop=["three"])).result(WAIT).sequences[0]
    assert text(engine, stopped).endswith("three") and stopped.stop_reason == "stop"
    both = sampler.sample([1], 2, rle.SamplingParams(max_tokens=50)).result(WAIT).sequences
    assert [text(engine, s) for s in both] == ["one two three four<|im_end|>"] * 2


def test_tokens_carry_the_version_that_was_loaded(engine):
    engine.backend.set_script(["Hello there."])
    trainer = engine.training_client()
    sampler = trainer.save_weights_and_get_sampling_client(timeout=WAIT)
    seq = sampler.sample([1, 2], 1, rle.SamplingParams(max_tokens=20)).result(WAIT).sequences[0]
    assert seq.versions == [sampler.version] * seq.length and sampler.version >= 1


def test_prompt_logprobs_are_refused_for_that_request_only(engine):
    sampler = engine.sampling_client()
    with pytest.raises(ValueError, match="no prompt logprobs"):
        sampler.sample([1, 2], 1, rle.SamplingParams(max_tokens=2), include_prompt_logprobs=True).result(WAIT)
    assert sampler.sample([1, 2], 1, rle.SamplingParams(max_tokens=2)).result(WAIT).sequences[0].length == 2


@pytest.mark.parametrize("script, match", [([], "script"), (["ok", 3], "script")])
def test_a_bad_script_is_refused(engine, script, match):
    with pytest.raises(ConfigurationError, match=match):
        engine.backend.set_script(script)


def test_unknown_engine_args_fail_the_start(model_cache):
    engine = rle.Engine(rle.EngineConfig(backend="scripted", cache_dir=model_cache, engine_args={"scrpt": ["x"]}))
    with pytest.raises(ConfigurationError, match="scrpt"):
        engine.start()
    engine.close()
