"""Provenance spans, ``record_stability_info`` and ``stable_reinforce`` on the local Tinker server.

tinker-cookbook 0.6.1 attaches provenance spans (``Datum.with_provenance``)
to every RL datum and trains with ``stable_reinforce`` on samples taken with
``record_stability_info=True``; each failed against the server before
(``400 not_supported``). Here, with the official ``tinker`` SDK (0.38)
unchanged: spans accepted on the protobuf path and checked (an unknown,
evicted or other session's sequence, a run outside it, other tokens than
sampled), the sampler's records (tokens, behaviour logprobs, versions),
``stable_reinforce`` computing from the recorded logprobs (not the ones the
client sent), and the JSON path over raw HTTP. Below the server:
``SequenceRecords``' retention, and both decoders.
"""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import numpy as np
import pytest
from tinker_sdk import SDK_WARNINGS

import rlengine as rle
from rlengine.errors import InvalidRequest
from rlengine.tinker_api import wire
from rlengine.tinker_api.errors import Gone, ProvenanceError
from rlengine.tinker_api.proto import decode_forward_backward_request
from rlengine.tinker_api.stability import ProvenancedDatum, SequenceRecords, Span

tinker = pytest.importorskip("tinker")
types = tinker.types
httpx = pytest.importorskip("httpx")

pytestmark = [
    *SDK_WARNINGS,
]

WAIT = 120.0
PROMPT = [11, 23, 35, 47, 59, 61]
PARAMS = types.SamplingParams(max_tokens=6, seed=5, temperature=1.0, stop=[])


def rl_datum(prompt: list[int], seq, advantage: float, *, provenance: bool = True, logprobs=None):
    """A datum as tinker-cookbook 0.6.1's ``recipes/rl_loop.py`` builds it, spans by its
    ``with_sampled_provenance`` (prompt targets padded with 0)."""
    ob_len = len(prompt) - 1
    tokens = list(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array([0] * ob_len + tokens, dtype=np.int64),
                        "logprobs": np.array([0.0] * ob_len + list(seq.logprobs if logprobs is None else logprobs),
                                             dtype=np.float32),
                        "advantages": np.array([0.0] * ob_len + [advantage] * len(tokens), dtype=np.float32)})
    if not provenance:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens))])


# -- SequenceRecords, below the server -------------------------------------------------------------


def _response(*token_lists: list[int], version: int = 3) -> rle.SampleResponse:
    return rle.SampleResponse(sequences=[rle.SampledSequence(
        stop_reason="length", tokens_raw=np.array(t, np.int32).tobytes(),
        logprobs_raw=np.full(len(t), -1.5, np.float32).tobytes(),
        versions_raw=np.full(len(t), version, np.int32).tobytes()) for t in token_lists])


def _plain(prompt: list[int], tokens: list[int]) -> rle.Datum:
    full = prompt + tokens
    return rle.Datum(model_input=rle.ModelInput.from_ints(full[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)})


def _spanned(prompt: list[int], tokens: list[int], sid: str, offset: int = 0) -> ProvenancedDatum:
    plain = _plain(prompt, tokens)
    return ProvenancedDatum(model_input=plain.model_input, loss_fn_inputs=plain.loss_fn_inputs,
                            model_input_spans=(Span(False, sid, 0, len(prompt)),
                                               Span(True, sid, offset, len(tokens) - 1)),
                            loss_fn_input_spans=(Span(False, sid, 1, len(prompt) - 1),
                                                 Span(True, sid, offset, len(tokens))))


def test_records_check_spans_and_evict_the_least_recently_used():
    records = SequenceRecords(max_sequences=3, max_bytes=1 << 20, ttl_s=3600.0)
    prompt = [4, 5, 6]
    raw = np.array(prompt, np.int32).tobytes()
    records.record("me", "s1", "r1", raw, _response([7, 8, 9], [7, 1, 2]), stable=False)
    records.check("me", "s1", [_spanned(prompt, [7, 8, 9], "r1:0"), _plain(prompt, [1, 2])])
    with pytest.raises(ProvenanceError, match="sampled token recorded there is 1") as err:
        records.check("me", "s1", [_plain(prompt, [1]), _spanned(prompt, [7, 8, 9], "r1:1")])
    assert err.value.field == "data[1].model_input_spans[1]" and "SampledProvenanceSpan" in str(err.value.value)
    with pytest.raises(ProvenanceError, match="past the end") as err:
        records.check("me", "s1", [_spanned(prompt, [9, 5], "r1:0", offset=2)])
    assert err.value.field == "data[0].loss_fn_input_spans[1]"
    for owner, session, match in (("me", "s2", "sampled in session s1"), ("other", "s1", "no sequence")):
        with pytest.raises(ProvenanceError, match=match):
            records.check(owner, session, [_spanned(prompt, [7, 8, 9], "r1:0")])
    with pytest.raises(ProvenanceError, match="without record_stability_info"):
        records.resolve("me", "s1", [_spanned(prompt, [7, 8, 9], "r1:0")])
    records.get("me", "s1", "r1:0", "x")  # used: now the most recent
    records.record("me", "s1", "r2", raw, _response([3, 3], [4, 4]), stable=True)
    assert len(records) == 3  # r1:1, the least recently used, went first
    with pytest.raises(Gone, match="max_recorded_sequences=3") as err:
        records.check("me", "s1", [_spanned(prompt, [7, 1, 2], "r1:1")])
    assert err.value.value == "r1:1"
    resolved = records.resolve("me", "s1", [_spanned(prompt, [3, 3], "r2:0")])[0]
    np.testing.assert_array_equal(resolved.loss_fn_inputs["mask"].to_numpy(), [0, 0, 1, 1])
    np.testing.assert_array_equal(resolved.loss_fn_inputs["logprobs"].to_numpy(), [0, 0, -1.5, -1.5])


def test_records_bounded_by_bytes_and_by_idle_time():
    raw = np.array([1, 2], np.int32).tobytes()
    records = SequenceRecords(max_sequences=100, max_bytes=100, ttl_s=3600.0)
    for i in range(3):  # each: 4 prompt bytes + 4 tokens x 12 bytes = 52
        records.record("me", "s", f"r{i}", raw, _response([5, 6, 7, 8]), stable=True)
    assert len(records) == 1 and records.nbytes <= 100
    with pytest.raises(Gone, match="max_recorded_bytes=100"):
        records.get("me", "s", "r0:0", "x")
    records = SequenceRecords(max_sequences=100, max_bytes=1 << 20, ttl_s=0.05)
    records.record("me", "s", "r0", raw, _response([5]), stable=False)
    time.sleep(0.2)
    with pytest.raises(Gone, match="recorded_ttl_s=0.05"):
        records.get("me", "s", "r0:0", "x")


# -- the decoders ------------------------------------------------------------------------------


def test_both_wires_decode_spans():
    from tinker.proto.request_conv import forward_backward_request_to_proto

    seq = types.SampledSequence(stop_reason="length", sequence_id="r9:1", tokens_np=np.int32([7, 8, 9]),
                                logprobs_np=np.float32([-1.0] * 3))
    datum = rl_datum([4, 5, 6], seq, 1.0)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce",
                                                          loss_fn_config={"kl_coeff": 0.01}),
        model_id="m", seq_id=1)
    decoded = decode_forward_backward_request(forward_backward_request_to_proto(request).SerializeToString())
    want = ((Span(False, "r9:1", 0, 3), Span(True, "r9:1", 0, 2)),
            (Span(False, "r9:1", 1, 2), Span(True, "r9:1", 0, 3)))
    got = decoded.data[0]
    assert isinstance(got, ProvenancedDatum) and (got.model_input_spans, got.loss_fn_input_spans) == want
    assert decoded.loss_fn_config == {"kl_coeff": 0.01}

    body = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 6, 7, 8]}]},
            "loss_fn_inputs": {"target_tokens": {"data": [0, 0, 7, 8, 9], "dtype": "int64"}},
            "model_input_spans": [{"prompt_tokens": {"sequence_id": "r9:1", "length": 3}},
                                  {"sampled_tokens": {"sequence_id": "r9:1", "length": 2}}],
            "loss_fn_input_spans": [{"prompt_tokens": {"sequence_id": "r9:1", "offset": 1, "length": 2}},
                                    {"sampled_tokens": {"sequence_id": "r9:1", "length": 3}}]}
    json_datum = wire.datum(msgspec.convert(body, wire.DatumWire), "data[0]")
    assert (json_datum.model_input_spans, json_datum.loss_fn_input_spans) == want
    both = {**body, "model_input_spans": [{"prompt_tokens": {"sequence_id": "a", "length": 3},
                                           "sampled_tokens": {"sequence_id": "a", "length": 2}}]}
    with pytest.raises(InvalidRequest, match="exactly one") as err:
        wire.datum(msgspec.convert(both, wire.DatumWire), "data[0]")
    assert err.value.field == "data[0].model_input_spans[0]"
    alone = {k: v for k, v in body.items() if k != "loss_fn_input_spans"}
    with pytest.raises(InvalidRequest, match="pair") as err:
        wire.datum(msgspec.convert(alone, wire.DatumWire), "data[0]")
    assert err.value.field == "data[0].loss_fn_input_spans"
    assert type(wire.datum(msgspec.convert({k: v for k, v in alone.items() if k != "model_input_spans"},
                                           wire.DatumWire), "data[0]")) is rle.Datum


# -- through the SDK -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(served):
    return served[2].create_lora_training_client(base_model="tiny", rank=4, seed=2).result(WAIT)


def _record(engine, server, model_id: str, sequence_id: str):
    """The server's record of ``sequence_id`` for a training request of ``model_id`` (read on the loop)."""
    async def read():
        model = server.service.registry.models[model_id]
        return server.service.records.get(model.owner, model.session_id, sequence_id, "test")

    return asyncio.run_coroutine_threadsafe(read(), engine.loop).result(WAIT)


def _behaviour_reference(logp: np.ndarray, behaviour: np.ndarray, adv: np.ndarray, action: np.ndarray,
                         kl_coeff: float) -> float:
    """stable_reinforce's loss (defaults C 2, mask [0.5, 2]) written out from the returned logprobs."""
    d = logp.astype(np.float64) - behaviour.astype(np.float64)
    if not 0.5 <= math.exp(d[action].mean()) <= 2.0:
        return 0.0
    r = np.exp(d)
    return float((action * (-np.minimum(r, 2.0) * adv + kl_coeff * (r - 1.0 - d))).sum())


@pytest.mark.model_plane
def test_record_stability_info_and_stable_reinforce_through_the_sdk(served, trainer):
    """Failed before: ``record_stability_info=True`` was ``400 not_supported`` at sampling, and so was
    ``stable_reinforce``. The records hold the sampled tokens, their logprobs and the installed version; the
    loss is computed from the recorded logprobs even when the client sends others."""
    engine, server, _ = served
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result(WAIT)
    resp = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, PARAMS).result(WAIT)
    version = engine.scheduler.version
    data, raw = [], []
    for i, seq in enumerate(resp.sequences):
        record = _record(engine, server, trainer.model_id, seq.sequence_id)
        assert record.stable and record.tokens.tolist() == list(seq.tokens)
        np.testing.assert_array_equal(record.logprobs, np.float32(seq.logprobs))
        assert set(record.versions.tolist()) == {version}
        # The client's logprobs are wrong on purpose: the server must use the recorded ones.
        data.append(rl_datum(PROMPT, seq, (-1.0) ** i, logprobs=[0.0] * len(seq.tokens)))
        raw.append((np.float32([0.0] * (len(PROMPT) - 1) + list(seq.logprobs)), len(seq.tokens)))
    result = trainer.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.01}).result(WAIT)
    want = 0.0
    for datum, out, (behaviour, n) in zip(data, result.loss_fn_outputs, raw, strict=True):
        adv = datum.loss_fn_inputs["advantages"].to_numpy()
        action = np.arange(adv.size) >= adv.size - n
        want += _behaviour_reference(out["logprobs"].to_numpy(), behaviour, adv, action, 0.01)
    assert result.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert result.metrics["mismatch_tokens:sum"] == sum(n for _, n in raw)
    assert trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(WAIT).metrics["grad_norm"] > 0


@pytest.mark.model_plane
def test_provenance_spans_are_accepted_and_checked(served, trainer):
    """Failed before: any datum with spans was ``400 not_supported`` (protobuf). Spans that name what was
    sampled change nothing in the result; the others are a 400 naming the datum, the span and the value; the
    model's next call still runs (the refused ones took their turn)."""
    _, server, _ = served
    sampler = trainer.save_weights_and_get_sampling_client().result(WAIT)
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(WAIT).sequences
    with_spans = [rl_datum(PROMPT, s, a) for s, a in zip(seqs, (1.0, -1.0))]
    plain = [rl_datum(PROMPT, s, a, provenance=False) for s, a in zip(seqs, (1.0, -1.0))]
    got = trainer.forward(with_spans, "importance_sampling").result(WAIT).metrics["loss:sum"]
    assert got == trainer.forward(plain, "importance_sampling").result(WAIT).metrics["loss:sum"] != 0.0

    seq, tokens = seqs[0], list(seqs[0].tokens)
    other = (tokens[0] + 1) % 500 + 3
    wrong_token = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + [other] + tokens[1:-1]),
                              loss_fn_inputs=with_spans[0].loss_fn_inputs,
                              model_input_spans=with_spans[0].model_input_spans,
                              loss_fn_input_spans=with_spans[0].loss_fn_input_spans)
    past_end = types.Datum(model_input=with_spans[0].model_input, loss_fn_inputs=with_spans[0].loss_fn_inputs,
                           model_input_spans=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id,
                                                                         length=len(PROMPT)),
                                              types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=2,
                                                                          length=len(tokens) - 1)],
                           loss_fn_input_spans=with_spans[0].loss_fn_input_spans)
    unknown = rl_datum(PROMPT, types.SampledSequence(stop_reason="length", sequence_id="req-nope:0",
                                                     tokens_np=np.int32(tokens), logprobs_np=seq.logprobs_np), 1.0)
    short = types.Datum(model_input=with_spans[0].model_input, loss_fn_inputs=with_spans[0].loss_fn_inputs,
                        model_input_spans=with_spans[0].model_input_spans[:1],
                        loss_fn_input_spans=with_spans[0].loss_fn_input_spans)
    for data, loss_fn, match in (
            ([plain[1], wrong_token], "importance_sampling",
             rf"data\[1\]\.model_input_spans\[1\].*position {len(PROMPT)} .* is token {other}"),
            ([past_end], "importance_sampling", r"data\[0\]\.model_input_spans\[1\].*past the end"),
            ([unknown], "importance_sampling", r"data\[0\]\.model_input_spans\[0\]\.sequence_id.*req-nope:0"),
            ([short], "importance_sampling", r"data\[0\]\.model_input_spans.*tile"),
            (with_spans, "stable_reinforce", "without record_stability_info"),
            (plain, "stable_reinforce", r"data\[0\]\.loss_fn_input_spans.*needs provenance")):
        with pytest.raises(tinker.BadRequestError, match=match) as err:
            trainer.forward_backward(data, loss_fn).result(WAIT)
        assert "invalid_provenance" in str(err.value)
    # Another session's model may not name this session's sequences (Tinker's rule).
    other_client = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    try:
        stranger = other_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(WAIT)
        with pytest.raises(tinker.BadRequestError, match="own session"):
            stranger.forward(with_spans, "importance_sampling").result(WAIT)
    finally:
        other_client.close("success").result(WAIT)
    started = time.monotonic()
    assert trainer.forward(with_spans, "importance_sampling").result(WAIT).metrics["loss:sum"] == got
    assert time.monotonic() - started < 60.0  # typically < 1 s; a call waiting on a lost seq_id took 300 s


@pytest.mark.model_plane
def test_an_evicted_sequence_is_gone(engine, ckpt_dir):
    from rlengine.tinker_api import TinkerServerConfig, start

    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, max_recorded_sequences=2))
    client = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    try:
        training = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result(WAIT)
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result(WAIT)
        first = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(WAIT).sequences
        second = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(WAIT).sequences
        with pytest.raises(tinker.APIStatusError, match="max_recorded_sequences=2") as err:
            training.forward_backward([rl_datum(PROMPT, first[0], 1.0)], "stable_reinforce").result(WAIT)
        assert err.value.status_code == 410
        out = training.forward_backward([rl_datum(PROMPT, s, 1.0) for s in second], "stable_reinforce").result(WAIT)
        assert out.metrics["loss:sum"] != 0.0
    finally:
        client.close("success").result(WAIT)
        server.close()


# -- the JSON path, over raw HTTP -----------------------------------------------------------------


def _call(url: str, path: str, body: dict, key: str) -> dict:
    r = httpx.post(f"{url}/api/v1/{path}", json=body, headers={"X-API-Key": key}, timeout=WAIT)
    assert r.status_code == 200, r.text
    return r.json()


def _result(url: str, request_id: str, key: str) -> dict:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        out = _call(url, "retrieve_future", {"request_id": request_id}, key)
        if out.get("type") != "try_again":
            return out
    raise AssertionError(f"{request_id} did not settle within {WAIT} s")


@pytest.mark.model_plane
def test_the_json_path_takes_and_checks_spans(served):
    _, server, _ = served
    url, key = server.url, server.api_key
    sid = _call(url, "create_session", {"tags": []}, key)["session_id"]
    created = _call(url, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                          "lora_config": {"rank": 4, "seed": 0}}, key)
    model_id = _result(url, created["request_id"], key)["model_id"]
    saved = _call(url, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 1,
                                                     "sampling_session_seq_id": 0}, key)
    ssid = _result(url, saved["request_id"], key)["sampling_session_id"]
    asked = _call(url, "asample", {"sampling_session_id": ssid, "seq_id": 1, "num_samples": 1,
                                   "record_stability_info": True,
                                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                                   "sampling_params": {"max_tokens": 5, "seed": 3, "stop": []}}, key)
    tokens = _result(url, asked["request_id"], key)["sequences"][0]["tokens"]
    seq_id = asked["sample_sequence_ids"][0]
    n, ob = len(PROMPT) + len(tokens) - 1, len(PROMPT) - 1

    def body(seq: int, sampled: str) -> dict:
        return {"model_id": model_id, "seq_id": seq, "forward_backward_input": {
            "loss_fn": "stable_reinforce", "loss_fn_config": {"kl_coeff": 0.01}, "data": [{
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": PROMPT + tokens[:-1]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": [0] * ob + tokens, "dtype": "int64"},
                    "logprobs": {"data": [0.0] * n, "dtype": "float32"},
                    "advantages": {"data": [0.0] * ob + [1.0] * len(tokens), "dtype": "float32"}},
                "model_input_spans": [{"prompt_tokens": {"sequence_id": seq_id, "length": len(PROMPT)}},
                                      {"sampled_tokens": {"sequence_id": sampled, "length": len(tokens) - 1}}],
                "loss_fn_input_spans": [{"prompt_tokens": {"sequence_id": seq_id, "offset": 1, "length": ob}},
                                        {"sampled_tokens": {"sequence_id": sampled, "length": len(tokens)}}]}]}}

    r = httpx.post(f"{url}/api/v1/forward_backward", json=body(2, "req-nope:0"), headers={"X-API-Key": key},
                   timeout=WAIT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["field"], error["value"]) == (
        "invalid_provenance", "data[0].model_input_spans[1].sequence_id", "req-nope:0")
    out = _result(url, _call(url, "forward_backward", body(3, seq_id), key)["request_id"], key)
    assert out["metrics"]["loss:sum"] != 0.0 and out["metrics"]["mismatch_tokens:sum"] == len(tokens)
