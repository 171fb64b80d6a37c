"""The protobuf messages of the Tinker wire, encoded and decoded by hand (no protobuf runtime).

The Tinker SDK sends ``forward_backward`` bodies as a protobuf
``ForwardBackwardRequest`` and asks for ``SampleResponse`` and
``ForwardBackwardOutput`` results as protobuf (it refuses JSON for those).
These messages are small and flat, so this module reads and writes the wire
format directly (varints, length-delimited fields, little-endian doubles)
rather than depending on the ``protobuf`` package and the SDK's generated
module at serving time. Field numbers follow the SDK's ``tinker_public.proto``
(tinker 0.38); ``tests/test_tinker_proto.py`` checks both directions against
the generated classes.

Token ids and tensors stay raw bytes end to end: a decoded request's tokens
become ``ModelInput.tokens_raw`` without a Python list in between, and
encoded results copy the engine's raw int32 / float32 buffers.

Decoding raises ``InvalidRequest`` naming the message and field for
malformed input, and ``NotSupported`` for features rlengine does not serve
(images, audio). A datum with provenance spans decodes to a
``ProvenancedDatum`` (``stability`` checks the spans against what was
sampled). It must not touch engine state.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import NotSupported
from rlengine.tinker_api.prompt_scoring import TargetLayout, alt_tensors, target_tensor
from rlengine.tinker_api.stability import Span, provenanced
from rlengine.types import Datum, ForwardBackwardOutput, ModelInput, SampleResponse, TensorData

__all__ = ["FwdBwdRequest", "call_header", "decode_forward_backward_request", "encode_forward_backward_output",
           "encode_sample_response"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_DOUBLE = struct.Struct("<d")
# tinker_public.proto enums.
_STOP_REASON = {"stop": 0, "length": 1}
_MASK_LOGPROB = -99999.0
"""An empty top-k cell (token id 0 with this logprob): ``tinker.types.topk_logprobs.MASK_LOGPROB``."""
_DTYPE_FLOAT32, _DTYPE_INT64, _DTYPE_INT32 = 1, 2, 3
_NUMPY_DTYPES = {_DTYPE_FLOAT32: np.dtype(np.float32), _DTYPE_INT64: np.dtype(np.int64), _DTYPE_INT32: np.dtype(np.int32)}


class FwdBwdRequest(NamedTuple):
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


# -- reading --------------------------------------------------------------------------


def _varint(buf: memoryview, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise InvalidRequest(where, "truncated varint", "malformed protobuf body")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidRequest(where, "varint longer than 10 bytes", "malformed protobuf body")


def _fields(buf: memoryview, where: str) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)``: an int for varints, raw bytes otherwise."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos, where)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise InvalidRequest(where, "field number 0", "malformed protobuf body")
        if wire == _VARINT:
            value, pos = _varint(buf, pos, where)
        elif wire == _LEN:
            size, pos = _varint(buf, pos, where)
            if size > n - pos:
                raise InvalidRequest(where, f"field {number} of {size} bytes", "runs past the end of the body")
            value, pos = buf[pos:pos + size], pos + size
        elif wire == _I64:
            if pos + 8 > n:
                raise InvalidRequest(where, f"field {number}", "truncated 64-bit value")
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == _I32:
            if pos + 4 > n:
                raise InvalidRequest(where, f"field {number}", "truncated 32-bit value")
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise InvalidRequest(where, f"wire type {wire} on field {number}", "malformed protobuf body")
        yield number, wire, value


def _expect(where: str, number: int, wire: int, want: int) -> None:
    if wire != want:
        raise InvalidRequest(where, f"field {number} with wire type {wire}", f"expected wire type {want}")


def _text(value: memoryview, where: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(where, "invalid UTF-8", "strings must be UTF-8") from None


def _signed(value: int) -> int:
    """A varint read as int64/int32 (two's complement over 64 bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_int64(value: memoryview, wire: int, where: str) -> list[int]:
    if wire == _VARINT:
        return [_signed(value)]
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos, where)
        out.append(_signed(v))
    return out


def _map_entry(buf: Any, wire: int, where: str) -> tuple[str, int, Any]:
    """A map field's entry: ``(key, value wire type, value)``."""
    _expect(where, 0, wire, _LEN)
    key, value_wire, value = "", _LEN, None
    for number, w, v in _fields(buf, where):
        if number == 1:
            _expect(where, number, w, _LEN)
            key = _text(v, where)
        elif number == 2:
            value_wire, value = w, v
    return key, value_wire, value


def _tensor(buf: memoryview, where: str) -> TensorData:
    dense: memoryview | None = None
    sparse: memoryview | None = None
    dtype = 0
    shape: list[int] = []
    for number, wire, value in _fields(buf, where):
        if number == 1:
            _expect(where, number, wire, _LEN)
            dense = value
        elif number == 2:
            _expect(where, number, wire, _LEN)
            sparse = value
        elif number == 3:
            _expect(where, number, wire, _VARINT)
            dtype = value
        elif number == 4:
            if wire not in (_VARINT, _LEN):
                raise InvalidRequest(f"{where}.shape", f"wire type {wire}", "must be varints")
            shape.extend(_packed_int64(value, wire, where))
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{where}.shape", shape, "dimensions must be >= 0")
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise NotSupported(f"{where}.dtype", dtype, "rlengine takes float32, int64 and int32 tensors")
    raw = (dense if dense is not None else memoryview(b"")) if sparse is None else _sparse_values(sparse, where)
    if len(raw) % np_dtype.itemsize:
        raise InvalidRequest(f"{where}.data", len(raw), f"byte length is not a multiple of {np_dtype.itemsize}")
    values = np.frombuffer(raw, dtype=np_dtype)
    if dtype == _DTYPE_INT32:
        # The public wire collapses integer widths to int64.
        values = values.astype(np.int64)
    if sparse is not None:
        values = _densify(sparse, values, shape, where)
    if not shape:
        shape = [int(values.size)]
    if math.prod(shape) != values.size:
        raise InvalidRequest(f"{where}.shape", shape, f"does not match its {values.size} values")
    return TensorData.from_numpy(values.reshape(shape))


def _sparse_values(buf: memoryview, where: str) -> memoryview:
    for number, wire, value in _fields(buf, where):
        _expect(where, number, wire, _LEN)
        if number == 1:
            _expect(where, number, wire, _LEN)
            return value
    return memoryview(b"")


def _densify(buf: memoryview, values: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    """A sparse CSR tensor (pad value 0, as the SDK encodes it) as a dense array."""
    crow = col = np.empty(0, dtype=np.int64)
    for number, wire, value in _fields(buf, where):
        _expect(where, number, wire, _LEN)
        if len(value) % 8:
            raise InvalidRequest(f"{where}.sparse_csr", len(value), "index byte length must be a multiple of 8")
        if number == 2:
            crow = np.frombuffer(value, dtype=np.int64)
        elif number == 3:
            col = np.frombuffer(value, dtype=np.int64)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) \
            or (len(crow) and (crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0))) \
            or (len(col) and (col.min() < 0 or col.max() >= shape[1])):
        raise InvalidRequest(f"{where}.sparse_csr", shape, "is not a valid CSR layout of a 2-D tensor")
    dense = np.zeros(shape, dtype=values.dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    dense[rows, col] = values
    return dense.ravel()


def _model_input(chunks: list[memoryview], where: str) -> ModelInput:
    parts = []
    for i, chunk in enumerate(chunks):
        kind = None
        for number, wire, value in _fields(chunk, f"{where}[{i}]"):
            if number == 1:
                _expect(f"{where}[{i}]", number, wire, _LEN)
                kind = "encoded_text"
                for n2, w2, v2 in _fields(value, f"{where}[{i}].encoded_text"):
                    if n2 == 1:
                        _expect(where, n2, w2, _LEN)
                        if len(v2) % 4:
                            raise InvalidRequest(f"{where}[{i}].tokens", len(v2), "byte length must be a multiple of 4")
                        parts.append(bytes(v2))
            elif number in (2, 3):
                raise NotSupported(f"{where}[{i}]", "image" if number == 2 else "dmel",
                                   "only encoded_text chunks are supported by rlengine")
        if kind is None:
            raise InvalidRequest(f"{where}[{i}]", "empty chunk", "a chunk must hold encoded_text")
    raw = b"".join(parts)
    if raw and int(np.frombuffer(raw, dtype=np.int32).min()) < 0:
        raise InvalidRequest(where, int(np.frombuffer(raw, dtype=np.int32).min()), "token ids must be >= 0")
    return ModelInput(tokens_raw=raw)


def _span(buf: memoryview, where: str) -> Span:
    """A ``ProvenanceSpan``: its oneof arm (1 ``prompt_tokens``, 2 ``sampled_tokens``), each a
    ``sequence_id`` (1), ``offset`` (2) and ``length`` (3)."""
    arm: tuple[int, memoryview] | None = None
    for number, wire, value in _fields(buf, where):
        if number in (1, 2):
            _expect(where, number, wire, _LEN)
            arm = (number, value)
    if arm is None:
        raise InvalidRequest(where, "empty", "a span holds prompt_tokens or sampled_tokens")
    sequence_id, offset, length = "", 0, 0
    for number, wire, value in _fields(arm[1], where):
        if number == 1:
            _expect(where, number, wire, _LEN)
            sequence_id = _text(value, f"{where}.sequence_id")
        elif number in (2, 3):
            _expect(where, number, wire, _VARINT)
            if number == 2:
                offset = _signed(value)
            else:
                length = _signed(value)
    return Span(arm[0] == 2, sequence_id, offset, length)


def _datum(buf: memoryview, where: str) -> Datum:
    chunks: list[memoryview] = []
    inputs: dict[str, TensorData] = {}
    spans: tuple[list[Span], list[Span]] = ([], [])
    for number, wire, value in _fields(buf, where):
        if number == 1:
            _expect(where, number, wire, _LEN)
            chunks.append(value)
        elif number == 2:
            key, tensor_wire, tensor = _map_entry(value, wire, f"{where}.loss_fn_inputs")
            if tensor is None or tensor_wire != _LEN:
                raise InvalidRequest(f"{where}.loss_fn_inputs[{key!r}]", None, "missing tensor")
            inputs[key] = _tensor(tensor, f"{where}.loss_fn_inputs[{key!r}]")
        elif number in (3, 4):
            _expect(where, number, wire, _LEN)
            field = "model_input_spans" if number == 3 else "loss_fn_input_spans"
            listed = spans[number - 3]
            listed.append(_span(value, f"{where}.{field}[{len(listed)}]"))
    return provenanced(_model_input(chunks, f"{where}.model_input"), inputs, tuple(spans[0]), tuple(spans[1]),
                       where)


def decode_forward_backward_request(body: bytes) -> FwdBwdRequest:
    """Decode a protobuf ``ForwardBackwardRequest`` body."""
    where = "ForwardBackwardRequest"
    buf = memoryview(body)
    model_id, seq_id, loss_fn, forward_only = "", 0, "", False
    data: list[Datum] = []
    legacy: dict[str, float] = {}
    config: dict[str, float | str] = {}
    for number, wire, value in _fields(buf, where):
        if number == 1:
            _expect(where, number, wire, _LEN)
            model_id = _text(value, f"{where}.model_id")
        elif number == 2:
            _expect(where, number, wire, _VARINT)
            seq_id = _signed(value)
        elif number == 3:
            _expect(where, number, wire, _LEN)
            data.append(_datum(value, f"{where}.data[{len(data)}]"))
        elif number == 4:
            _expect(where, number, wire, _LEN)
            loss_fn = _text(value, f"{where}.loss_fn")
        elif number == 5:
            key, w, v = _map_entry(value, wire, f"{where}.loss_fn_config")
            if v is None:
                legacy[key] = 0.0
            else:
                _expect(f"{where}.loss_fn_config[{key!r}]", 2, w, _I64)
                legacy[key] = _DOUBLE.unpack(v)[0]
        elif number == 6:
            _expect(where, number, wire, _VARINT)
            forward_only = bool(value)
        elif number == 7:
            key, w, v = _map_entry(value, wire, f"{where}.loss_fn_config_v2")
            if v is not None:
                _expect(f"{where}.loss_fn_config_v2[{key!r}]", 2, w, _LEN)
            config[key] = _config_value(v, f"{where}.loss_fn_config_v2[{key!r}]")
    # v2 carries everything v1 does (plus strings); old clients send only v1.
    merged: dict[str, float | str] = {**legacy, **config}
    return FwdBwdRequest(model_id, seq_id, data, loss_fn, merged or None, forward_only)


def call_header(body: bytes) -> tuple[str | None, int | None]:
    """The ``model_id`` and ``seq_id`` of a ``ForwardBackwardRequest`` body the full decoding refused,
    where they can be read (None where not): a refused call still consumes its ``seq_id``."""
    model_id: str | None = None
    seq_id: int | None = None
    try:
        for number, wire, value in _fields(memoryview(body), "ForwardBackwardRequest"):
            if number == 1 and wire == _LEN:
                model_id = _text(value, "ForwardBackwardRequest.model_id")
            elif number == 2 and wire == _VARINT:
                seq_id = _signed(value)
            if model_id is not None and seq_id is not None:
                break
    except InvalidRequest:
        pass
    return model_id, seq_id


def _config_value(buf: memoryview | None, where: str) -> float | str:
    if buf is None:
        raise InvalidRequest(where, None, "missing value")
    for number, wire, value in _fields(buf, where):
        if number == 1 and wire == _I64:
            return _DOUBLE.unpack(value)[0]
        if number == 2 and wire == _LEN:
            return _text(value, where)
    raise InvalidRequest(where, "empty", "needs a number or a text value")


# -- writing --------------------------------------------------------------------------


def _put_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_len(out: bytearray, number: int, payload: bytes | bytearray) -> None:
    _put_varint(out, (number << 3) | _LEN)
    _put_varint(out, len(payload))
    out += payload


def _put_int(out: bytearray, number: int, value: int) -> None:
    _put_varint(out, (number << 3) | _VARINT)
    _put_varint(out, value)


def _put_double(out: bytearray, number: int, value: float) -> None:
    _put_varint(out, (number << 3) | _I64)
    out += _DOUBLE.pack(value)


def _unscored(n: int, last_n: int | None) -> int:
    """How many of a prompt's ``n`` positions lead without a score: the first, and with ``last_n``
    every one before the last ``last_n``."""
    return 1 if last_n is None else max(1, n - last_n)


def _topk_message(ids: np.ndarray, logprobs: np.ndarray, k: int) -> bytes:
    """A ``TopkLogprobs``: ``ids`` int32 and ``logprobs`` float32, ``k`` per position, flat."""
    msg = bytearray()
    _put_len(msg, 1, ids.astype(np.int32, copy=False).tobytes())
    _put_len(msg, 2, logprobs.astype(np.float32, copy=False).tobytes())
    _put_int(msg, 3, k)
    _put_int(msg, 4, ids.size // k)
    return bytes(msg)


def _tensor_message(values: np.ndarray, dtype: int, shape: list[int], layout: TargetLayout | None = None) -> bytes:
    """A ``Tensor``: ``values`` (already of ``dtype``) dense, or the listed cells of ``layout``'s CSR."""
    msg = bytearray()
    if layout is None:
        _put_len(msg, 1, values.tobytes())
    else:
        csr = bytearray()
        _put_len(csr, 1, values.tobytes())
        _put_len(csr, 2, layout.crow.astype(np.int64, copy=False).tobytes())
        _put_len(csr, 3, layout.col.astype(np.int64, copy=False).tobytes())
        _put_len(msg, 2, csr)
    _put_int(msg, 3, dtype)
    packed = bytearray()
    for d in shape:
        _put_varint(packed, d)
    _put_len(msg, 4, packed)
    return bytes(msg)


def encode_sample_response(response: SampleResponse, prompt_logprobs_last_n: int | None = None,
                           target_layout: TargetLayout | None = None) -> bytes:
    """A ``SampleResponse`` as protobuf: tokens int32, logprobs float32, prompt logprobs with
    NaN where none was computed (the first token, and before the last ``prompt_logprobs_last_n``),
    top-k logprobs as dense matrices with empty cells there (id 0, logprob -99999),
    ``prompt_cache_hit_tokens``, and the prompt scores (``target_layout``: a sparse
    ``target_prompt_logprobs`` request's CSR indices, which its result keeps)."""
    out = bytearray()
    for seq in response.sequences:
        reason = _STOP_REASON.get(seq.stop_reason)
        if reason is None:
            raise InvalidRequest("stop_reason", seq.stop_reason, "has no Tinker wire value (stop, length)")
        msg = bytearray()
        _put_int(msg, 1, reason)
        _put_len(msg, 2, seq.tokens_raw)
        _put_len(msg, 3, seq.logprobs_raw)
        if seq.top_ids_raw and seq.length:
            top_ids = np.frombuffer(seq.top_ids_raw, dtype=np.int32)
            _put_len(msg, 4, _topk_message(top_ids, np.frombuffer(seq.top_logprobs_raw, dtype=np.float32),
                                           top_ids.size // seq.length))
        _put_len(out, 1, msg)
    raw = response.prompt_logprobs_raw
    if raw is not None:
        values = np.concatenate([np.full(1, np.nan, dtype=np.float32), np.frombuffer(raw, dtype=np.float32)])
        values[:_unscored(len(values), prompt_logprobs_last_n)] = np.nan
        _put_len(out, 2, values.tobytes())
    k = response.prompt_top_k
    if k and response.prompt_top_ids_raw is not None and response.prompt_top_logprobs_raw is not None:
        ids = np.concatenate([np.zeros(k, dtype=np.int32), np.frombuffer(response.prompt_top_ids_raw, np.int32)])
        lps = np.concatenate([np.full(k, _MASK_LOGPROB, dtype=np.float32),
                              np.frombuffer(response.prompt_top_logprobs_raw, np.float32)])
        empty = _unscored(ids.size // k, prompt_logprobs_last_n) * k
        ids[:empty], lps[:empty] = 0, _MASK_LOGPROB
        _put_len(out, 3, _topk_message(ids, lps, k))
    if response.prompt_cache_hit_tokens:
        _put_int(out, 4, response.prompt_cache_hit_tokens)
    scores = response.prompt_scores
    if scores is not None:
        target = target_tensor(scores, target_layout)
        if target is not None:
            _put_len(out, 5, _tensor_message(target[0], _DTYPE_FLOAT32, target[1], target_layout))
        alt = alt_tensors(scores)
        if alt is not None:
            msg = bytearray()
            _put_len(msg, 1, _tensor_message(alt[0], _DTYPE_INT32, alt[2]))
            _put_len(msg, 2, _tensor_message(alt[1], _DTYPE_FLOAT32, alt[2]))
            _put_len(out, 6, msg)
    return bytes(out)


def _batched(arrays: list[np.ndarray], dtype: int) -> bytes:
    msg = bytearray()
    data = b"".join(a.tobytes() for a in arrays)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    _put_len(msg, 1, data)
    _put_len(msg, 2, offsets.tobytes())
    _put_int(msg, 3, dtype)
    return bytes(msg)


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """A ``ForwardBackwardOutput`` as protobuf: one ``ArrayRecord`` batching every datum's fields."""
    out = bytearray()
    _put_len(out, 1, output.loss_fn_output_type.encode())
    outputs = output.loss_fn_outputs
    if outputs:
        record = bytearray()
        for name in outputs[0]:
            arrays = [o[name].to_numpy().ravel() for o in outputs]
            dtype = _DTYPE_FLOAT32 if outputs[0][name].dtype == "float32" else _DTYPE_INT64
            entry = bytearray()
            _put_len(entry, 1, name.encode())
            _put_len(entry, 2, _batched(arrays, dtype))
            _put_len(record, 2, entry)
        _put_int(record, 3, len(outputs))
        _put_len(out, 2, record)
    for key, value in output.metrics.items():
        entry = bytearray()
        _put_len(entry, 1, key.encode())
        _put_double(entry, 2, float(value))
        _put_len(out, 3, entry)
    return bytes(out)
