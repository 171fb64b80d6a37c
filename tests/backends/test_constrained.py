"""Constrained decoding in the torch and scripted backends (``SamplingParams.constraint``).

References: the HF model's own forward pass with the grammar's mask applied by
hand (the logprob the constrained sampler used), a solo run of the same free
request (a constrained neighbour must not change what it generates), Python's
``json`` and the Hermes parser (what the forced text must be).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xgrammar as xgr

import rlengine as rle
from rlengine.backends.base import BackendRequest
from rlengine.backends.grammar import Grammars
from rlengine.backends.scripted import ScriptedBackend
from rlengine.backends.torch.backend import TorchBackend
from rlengine.backends.torch.models import load_tokenizer
from rlengine.constraints import json_response, output_constraint
from rlengine.errors import InvalidRequest
from rlengine.tool_parsers import HermesParser

PROMPT = [5, 17, 300, 42, 9, 8]
YES_NO = json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": "(yes|no|maybe)"}})
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def backend(tiny_model):
    return TorchBackend(tiny_model)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()


def request(rid: str, max_tokens: int, seed: int = 0, prompt: list[int] = PROMPT, **params) -> BackendRequest:
    return BackendRequest(request_id=rid, prompt=np.asarray(prompt, dtype=np.int32).tobytes(),
                          params=rle.SamplingParams(max_tokens=max_tokens, **params), seed=seed,
                          max_tokens=max_tokens, stream=True)


def drain(backend) -> dict[str, tuple[list[int], list[float], str | None, str | None]]:
    out: dict[str, tuple[list[int], list[float], str | None, str | None]] = {}
    while backend.has_unfinished_requests():
        for o in backend.step():
            tokens, lps, _, _ = out.get(o.request_id, ([], [], None, None))
            out[o.request_id] = (tokens + list(o.token_ids), lps + list(o.logprobs), o.stop_reason, o.error)
    return out


def masked_reference(hf_model, tokenizer, constraint: str, prompt: list[int], tokens: list[int],
                     stop_ids) -> list[float]:
    """log_softmax of the HF logits with the grammar's mask applied, at every generated token."""
    grammars = Grammars(tokenizer, hf_model.config.vocab_size, stop_ids)
    matcher = grammars.matcher(constraint).matcher
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    out = []
    for row, token in zip(logits, tokens):
        matcher.fill_next_token_bitmask(bitmask)
        row = row[None].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        out.append(float(row.log_softmax(-1)[0, token]))
        assert matcher.accept_token(token)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_regex_constraint_forces_the_output_and_its_logprobs_are_the_masked_ones(backend, hf_model, tiny_model,
                                                                                   temperature):
    tokenizer = load_tokenizer(tiny_model)
    for seed in range(3):
        backend.add_request(request(f"c{seed}", 16, seed, constraint=YES_NO, temperature=temperature))
    outs = drain(backend)
    for seed in range(3):
        tokens, lps, reason, error = outs[f"c{seed}"]
        assert error is None and reason == "stop" and tokens[-1] in backend.eos_ids
        assert tokenizer.decode(tokens[:-1]) in ("yes", "no", "maybe")
        np.testing.assert_allclose(lps, masked_reference(hf_model, tokenizer, YES_NO, PROMPT, tokens, backend.eos_ids), atol=1e-5)
        # Not the model's own logprobs: the mask renormalised them.
        with torch.no_grad():
            free = hf_model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].float().log_softmax(-1)
        raw = free.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert all(c >= r - 1e-6 for c, r in zip(lps, raw)) and any(c > r + 1e-3 for c, r in zip(lps, raw))


def test_a_constrained_neighbour_does_not_change_a_free_request(backend, tiny_model):
    backend.add_request(request("free", 20, 7, temperature=1.0))
    alone = drain(backend)["free"]
    backend.add_request(request("free", 20, 7, temperature=1.0))
    backend.add_request(request("forced", 20, 7, temperature=1.0, constraint=YES_NO))
    both = drain(backend)
    assert both["free"][0] == alone[0] and both["free"][2:] == alone[2:]
    np.testing.assert_allclose(both["free"][1], alone[1], atol=1e-5)  # batch shapes differ: fp noise only
    assert both["forced"][0] != alone[0]


def test_a_forced_tool_call_is_a_valid_call_of_the_named_function(backend, hf_model, tiny_model):
    tokenizer, parser = load_tokenizer(tiny_model), HermesParser()
    constraint = output_constraint(parser, [WEATHER, TIME], "function", "get_weather")
    assert constraint is not None
    for seed in range(3):
        backend.add_request(request(f"t{seed}", 120, seed, constraint=constraint, temperature=1.0))
    outs = drain(backend)
    for seed in range(3):
        tokens, lps, reason, error = outs[f"t{seed}"]
        assert error is None and reason == "stop"  # compact JSON: no whitespace for random weights to fill
        text = tokenizer.decode(tokens[:-1])
        assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
        [call] = parser.parse(text).tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Rome")
        np.testing.assert_allclose(lps, masked_reference(hf_model, tokenizer, constraint, PROMPT, tokens,
                                                       backend.eos_ids), atol=1e-5)


def test_a_constraint_xgrammar_cannot_compile_is_refused_naming_the_field(backend):
    bad = json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "nope"}}})
    with pytest.raises(InvalidRequest, match=r"sampling_params\.constraint.*nope"):
        backend.add_request(request("bad", 8, constraint=bad))
    assert not backend.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="constraint"):
        rle.SamplingParams(constraint="not json")
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        rle.SamplingParams(constraint=YES_NO, ignore_eos=True)


def test_the_scripted_backend_serves_only_scripts_that_match_the_constraint(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    backend = ScriptedBackend(tokenizer, 1024, 2048, ["maybe"])
    backend.add_request(request("ok", 16, constraint=YES_NO))
    tokens, lps, reason, _ = drain(backend)["ok"]
    assert tokenizer.decode(tokens[:-1]) == "maybe" and reason == "stop" and lps == [0.0] * len(tokens)
    backend.set_script(["perhaps"])
    with pytest.raises(InvalidRequest, match="does not match"):
        backend.add_request(request("no", 16, constraint=YES_NO))


def test_output_constraint_shapes():
    parser = HermesParser()
    assert output_constraint(parser, [WEATHER], "auto") is None
    assert output_constraint(parser, [WEATHER], "none") is None
    assert output_constraint(parser, None, "auto") is None
    required = json.loads(output_constraint(parser, [WEATHER, TIME], "required", parallel=False))["format"]
    assert required["type"] == "tags_with_separator" and required["at_least_one"] and required["stop_after_first"]
    assert [t["begin"] for t in required["tags"]] == [parser.call_tag("get_weather")[0], parser.call_tag("get_time")[0]]
    schema = json_response("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer"}}})
    assert json.loads(output_constraint(None, None, "auto", schema=schema))["format"] == {
        "type": "json_schema", "json_schema": {"type": "integer"}}
    either = json.loads(output_constraint(parser, [WEATHER], "auto", schema=schema))["format"]
    assert either["type"] == "or" and either["elements"][0]["json_schema"] == {"type": "integer"}
    with pytest.raises(InvalidRequest, match=r"tool_choice\.function\.name"):
        output_constraint(parser, [WEATHER], "function", "nope")
    with pytest.raises(InvalidRequest, match="tool_choice"):
        output_constraint(parser, None, "required")
    with pytest.raises(InvalidRequest, match=r"response_format\.type"):
        json_response("response_format", {"type": "yaml"})
