"""rlengine.types: validation names the field and value; compact arrays round-trip."""

from __future__ import annotations

import math
from array import array

import msgspec
import numpy as np
import pytest

import rlengine as rle
from rlengine.errors import InvalidRequest, RequestError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [-1]}, "stop"),
        ({"stop": 5}, "stop"),
    ],
)
def test_sampling_params_rejects_with_field_and_value(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        rle.SamplingParams(**kwargs)
    err = info.value
    assert err.field == field
    assert str(err).startswith(f"{field}=")
    assert isinstance(err, ValueError) and isinstance(err, RequestError)


def test_sampling_params_valid_and_stop_kinds():
    p = rle.SamplingParams(max_tokens=4, temperature=0, top_p=0.5, top_k=3, seed=7, stop="</s>")
    assert p.stop == ["</s>"] and p.stop_strings == ("</s>",) and p.stop_token_ids == ()
    q = rle.SamplingParams(stop=[3, 5])
    assert q.stop_token_ids == (3, 5) and q.stop_strings == ()
    assert rle.SamplingParams().max_tokens is None


def test_sampling_params_validated_on_decode_too():
    raw = msgspec.msgpack.encode({"max_tokens": 0})
    with pytest.raises(msgspec.ValidationError, match="max_tokens=0"):
        msgspec.msgpack.decode(raw, type=rle.SamplingParams)


@pytest.mark.parametrize("source", [
    [5, 0, 7],
    np.array([5, 0, 7], dtype=np.int64),
    np.array([5, 0, 7], dtype=np.uint16),
    array("i", [5, 0, 7]),
    (5, 0, 7),
])
def test_model_input_from_any_int_buffer(source):
    m = rle.ModelInput.from_ints(source)
    assert m.to_ints() == [5, 0, 7]
    assert m.length == 3
    assert m.to_numpy().dtype == np.int32
    assert len(m.tokens_raw) == 12


@pytest.mark.parametrize(("source", "needle"), [
    ([1, -2], "-2"),
    ([2**31], str(2**31)),
    (np.array([1.5]), "float64"),
    (np.zeros((2, 2), dtype=np.int32), "(2, 2)"),
    (b"\x00\x00\x00\x00", "bytes"),
    (["a"], "token"),
])
def test_model_input_rejects_bad_ids(source, needle):
    with pytest.raises(InvalidRequest, match="ModelInput.tokens") as info:
        rle.ModelInput.from_ints(source)
    assert needle in str(info.value)


def test_model_input_raw_must_be_whole_int32s():
    with pytest.raises(InvalidRequest, match="tokens_raw"):
        rle.ModelInput(tokens_raw=b"\x00\x01\x02")


def test_model_input_append_and_empty():
    m = rle.ModelInput.empty().append_ints([1, 2]).append_ints(np.array([3]))
    assert m.to_ints() == [1, 2, 3]


def test_sampled_sequence_accessors_and_wire_roundtrip():
    seq = rle.SampledSequence(stop_reason="stop", tokens_raw=array("i", [4, 5]).tobytes(),
                              logprobs_raw=array("f", [-0.5, -1.25]).tobytes(),
                              versions_raw=array("i", [0, 1]).tobytes())
    resp = rle.SampleResponse(sequences=(seq,), request_id="r1", prompt_logprobs_raw=array("f", [-2.0]).tobytes())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(resp), type=rle.SampleResponse)
    assert back == resp
    s = back.sequences[0]
    assert s.tokens == [4, 5] and s.logprobs == [-0.5, -1.25] and s.versions == [0, 1]
    assert s.tokens_array().tolist() == [4, 5] and s.length == 2
    assert back.prompt_logprobs == [None, -2.0]


def test_tensor_data_roundtrip_and_checks():
    td = rle.TensorData.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert td.dtype == "int64" and td.shape == [2, 3]
    assert td.to_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert td.data == [0, 1, 2, 3, 4, 5]
    f = rle.TensorData.from_numpy([0.5, 1.5])
    assert f.dtype == "float32" and f.tolist() == [0.5, 1.5]
    with pytest.raises(InvalidRequest, match="element count"):
        rle.TensorData(data_raw=b"\x00" * 8, dtype="float32", shape=[3])
    with pytest.raises(InvalidRequest, match="TensorData.dtype"):
        rle.TensorData.from_numpy(np.array(["x"]))


def test_datum_converts_arrays_and_lists():
    d = rle.Datum(model_input=rle.ModelInput.from_ints([1, 2]),
                  loss_fn_inputs={"target_tokens": np.array([2, 3]), "weights": [1.0, 0.0]})
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].to_numpy().tolist() == [1.0, 0.0]
    with pytest.raises(InvalidRequest, match="model_input"):
        rle.Datum(model_input=[1, 2], loss_fn_inputs={})


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"beta1": 1.0}, "beta1"),
    ({"beta2": -0.1}, "beta2"),
    ({"eps": math.nan}, "eps"),
    ({"grad_clip_norm": math.inf}, "grad_clip_norm"),
])
def test_adam_params_rejects(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        rle.AdamParams(**kwargs)
    assert info.value.field == field


def test_adam_params_tinker_defaults():
    p = rle.AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (
        1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)


def test_error_hierarchy():
    assert issubclass(rle.ModelNotLoaded, rle.RequestError) and issubclass(rle.ModelNotLoaded, LookupError)
    assert issubclass(rle.EngineDeadError, rle.RLEngineError) and not issubclass(rle.EngineDeadError, rle.RequestError)
    assert issubclass(rle.EngineClosed, rle.EngineDeadError)
    assert issubclass(rle.RequestTimeout, TimeoutError) and issubclass(rle.DrainTimeout, TimeoutError)
    assert issubclass(rle.GatePoisoned, rle.GateError)
    assert issubclass(rle.ConfigurationError, ValueError)
    err = rle.GatePoisoned([(3, "sess", "backend failed")])
    assert err.leases == [(3, "sess", "backend failed")] and "lease 3" in str(err)
