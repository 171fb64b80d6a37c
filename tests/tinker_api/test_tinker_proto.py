"""The hand-written protobuf codec of ``rlengine.tinker_api.proto`` against the SDK's generated classes.

Requests are encoded by the SDK's own ``forward_backward_request_to_proto``
and decoded here; results are encoded here and decoded by the SDK's own
``deserialize_*`` functions. Arbitrary bytes (hypothesis) must only ever
raise the codec's typed errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import NotSupported
from rlengine.tinker_api.proto import (
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from rlengine.types import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

T = tinker.types


def _sdk_request(forward_only: bool = False) -> tuple[bytes, list]:
    rng = np.random.default_rng(0)
    data = []
    for n in (3, 8, 1):
        tokens = rng.integers(0, 2**31 - 1, size=n).tolist()
        chunks = [T.EncodedTextChunk(tokens=tokens[:1]), T.EncodedTextChunk(tokens=tokens[1:])]
        inputs = {"target_tokens": rng.integers(0, 1000, size=n).astype(np.int64),
                  "weights": rng.normal(size=n).astype(np.float32),
                  "advantages": torch.tensor(rng.normal(size=n), dtype=torch.float32)}
        data.append(T.Datum(model_input=T.ModelInput(chunks=chunks), loss_fn_inputs=inputs))
    sparse = torch.zeros((4, 5), dtype=torch.int64)
    sparse[1, 3], sparse[3, 0] = 7, 9
    data.append(T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3, 4]),
                        loss_fn_inputs={"target_tokens": T.TensorData.from_torch_sparse(sparse)}))
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn="ppo",
                                                      loss_fn_config={"clip_low_threshold": 0.7, "tag": "x"}),
        model_id="s:train:3", seq_id=5)
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString(), data


@pytest.mark.parametrize("forward_only", [False, True])
def test_sdk_requests_decode_to_the_same_values(forward_only):
    body, data = _sdk_request(forward_only)
    decoded = decode_forward_backward_request(body)
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn, decoded.forward_only) == (
        "s:train:3", 5, "ppo", forward_only)
    assert decoded.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "tag": "x"}
    assert len(decoded.data) == len(data)
    for got, want in zip(decoded.data, data, strict=True):
        assert got.model_input.to_ints() == want.model_input.to_ints()
        assert set(got.loss_fn_inputs) == set(want.loss_fn_inputs)
        for key, tensor in want.loss_fn_inputs.items():
            mine = got.loss_fn_inputs[key]
            assert mine.dtype == tensor.dtype and mine.shape == list(tensor.shape)
            np.testing.assert_array_equal(mine.to_numpy(), tensor.to_numpy())


def test_sample_responses_decode_in_the_sdk():
    seqs = [SampledSequence(stop_reason=reason, tokens_raw=np.array(toks, np.int32).tobytes(),
                            logprobs_raw=np.array(lps, np.float32).tobytes(),
                            versions_raw=np.zeros(len(toks), np.int32).tobytes())
            for reason, toks, lps in (("stop", [5, 2], [-0.5, -1.25]), ("length", [7, 8, 9], [-2.0, -3.0, -0.1]),
                                      ("stop", [], []))]
    prompt_lps = np.array([-1.5, -2.5, -3.5], np.float32)
    response = SampleResponse(sequences=seqs, prompt_logprobs_raw=prompt_lps.tobytes())
    sdk = deserialize_sample_response(encode_sample_response(response))
    assert [s.stop_reason for s in sdk.sequences] == ["stop", "length", "stop"]
    assert [s.tokens for s in sdk.sequences] == [[5, 2], [7, 8, 9], []]
    assert sdk.sequences[1].logprobs == pytest.approx([-2.0, -3.0, -0.1])
    assert sdk.prompt_logprobs == [None, -1.5, -2.5, -3.5]
    last = deserialize_sample_response(encode_sample_response(response, prompt_logprobs_last_n=2))
    assert last.prompt_logprobs == [None, None, -2.5, -3.5]
    assert deserialize_sample_response(encode_sample_response(SampleResponse(sequences=seqs))).prompt_logprobs is None
    with pytest.raises(InvalidRequest, match="stop_reason"):
        encode_sample_response(SampleResponse(sequences=[SampledSequence(stop_reason="abort")]))


def test_top_k_logprobs_decode_in_the_sdk_and_match_the_json_rendering():
    """Top-k matrices: per sampled token, and per prompt position with the first (and, with
    ``prompt_logprobs_last_n``, those before the last n) empty, which the SDK reads as None."""
    from rlengine.tinker_api.wire import sample_response_json

    rng = np.random.default_rng(1)
    k = 3
    top_ids = rng.integers(0, 1000, size=(2, k)).astype(np.int32)
    top_lps = -rng.uniform(0, 5, size=(2, k)).astype(np.float32)
    seqs = [SampledSequence(stop_reason="stop", tokens_raw=np.array([5, 2], np.int32).tobytes(),
                            logprobs_raw=np.array([-0.5, -1.25], np.float32).tobytes(),
                            top_ids_raw=top_ids.tobytes(), top_logprobs_raw=top_lps.tobytes()),
            SampledSequence(stop_reason="length", tokens_raw=np.array([7], np.int32).tobytes(),
                            logprobs_raw=np.array([-2.0], np.float32).tobytes())]
    prompt_ids = rng.integers(0, 1000, size=(3, k)).astype(np.int32)  # a prompt of 4 tokens
    prompt_lps = -rng.uniform(0, 5, size=(3, k)).astype(np.float32)
    response = SampleResponse(sequences=seqs, prompt_top_k=k, prompt_top_ids_raw=prompt_ids.tobytes(),
                              prompt_top_logprobs_raw=prompt_lps.tobytes())

    def rows(ids, lps):
        return [[(int(t), float(lp)) for t, lp in zip(i, lp_row)] for i, lp_row in zip(ids, lps)]

    for last_n, unscored in ((None, 1), (2, 2), (3, 1), (9, 1)):
        sdk = deserialize_sample_response(encode_sample_response(response, prompt_logprobs_last_n=last_n))
        assert sdk.sequences[0].topk_logprobs == rows(top_ids, top_lps)
        assert sdk.sequences[1].topk_logprobs is None
        want = [None] * unscored + rows(prompt_ids, prompt_lps)[unscored - 1:]
        assert sdk.topk_prompt_logprobs == want
        assert sdk.prompt_logprobs is None
        json = sample_response_json(response, last_n)
        assert json["topk_prompt_logprobs"] == [None if r is None else [list(p) for p in r] for r in want]
        assert json["sequences"][0]["topk_logprobs"] == [[list(p) for p in r] for r in rows(top_ids, top_lps)]
        assert "topk_logprobs" not in json["sequences"][1] and "prompt_logprobs" not in json
    assert response.prompt_top_logprobs == [None, *rows(prompt_ids, prompt_lps)]
    one = SampleResponse(sequences=seqs[1:], prompt_top_k=k, prompt_top_ids_raw=b"", prompt_top_logprobs_raw=b"")
    assert deserialize_sample_response(encode_sample_response(one)).topk_prompt_logprobs == [None]
    assert deserialize_sample_response(encode_sample_response(SampleResponse(sequences=seqs))
                                       ).topk_prompt_logprobs is None


def test_forward_backward_outputs_decode_in_the_sdk():
    outputs = [{"logprobs": TensorData.from_numpy(np.arange(n, dtype=np.float32) - 4.0),
                "elementwise_loss": TensorData.from_numpy(np.full(n, 0.25, np.float32))} for n in (3, 1, 6)]
    output = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                   metrics={"loss:sum": 1.5, "entropy:sum": math.pi})
    sdk = deserialize_forward_backward_output(encode_forward_backward_output(output))
    assert sdk.metrics == {"loss:sum": 1.5, "entropy:sum": math.pi}
    assert sdk.loss_fn_output_type == "ArrayRecord"
    for got, want in zip(sdk.loss_fn_outputs, outputs, strict=True):
        for key in want:
            assert got[key].shape == want[key].shape
            np.testing.assert_array_equal(got[key].to_numpy(), want[key].to_numpy())


def test_unsupported_chunks_and_spans_are_typed():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().image.data = b"\x89PNG"
    with pytest.raises(NotSupported, match="image"):
        decode_forward_backward_request(msg.SerializeToString())
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
    datum.model_input_spans.add().prompt_tokens.length = 2
    with pytest.raises(InvalidRequest, match="pair"):  # spans decode (test_tinker_stability), as a pair
        decode_forward_backward_request(msg.SerializeToString())
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.array([3, -1], np.int32).tobytes()
    with pytest.raises(InvalidRequest, match=">= 0"):
        decode_forward_backward_request(msg.SerializeToString())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_typed_errors(body):
    try:
        decode_forward_backward_request(body)
    except (InvalidRequest, NotSupported):
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.data())
def test_truncated_and_corrupted_requests_raise_only_typed_errors(cut, data):
    body = bytearray(_sdk_request()[0])
    cut = cut % len(body)
    flips = data.draw(st.lists(st.integers(min_value=0, max_value=len(body) - 1), max_size=3))
    for i in flips:
        body[i] ^= 0xFF
    try:
        decode_forward_backward_request(bytes(body[:cut] if data.draw(st.booleans()) else body))
    except (InvalidRequest, NotSupported):
        pass
