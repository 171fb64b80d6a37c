"""The JSON bodies of the Tinker REST API (tinker 0.38) as msgspec Structs, and their conversions.

Each request body the server accepts has a Struct here, with the fields
rlengine reads; unknown fields are ignored (newer SDKs add some), and a
missing or mistyped field fails decoding with a message naming it. A body
whose fields declare limits (``NonNegativeInt``, a ``Literal``: see
``rlengine.validation``) checks them on construction and decoding, raising
``InvalidRequest`` naming the field and value. Limits that another type
already declares are left to it: ``SamplingParamsWire`` and
``AdamParamsWire`` become ``SamplingParams`` and ``AdamParams``, which check
their own fields; a tensor's ``dtype`` is checked by ``datum``, whose error
names the tensor's key in ``loss_fn_inputs`` (msgspec's path would show
``[...]`` there). The converters turn wire values into rlengine's own types
(``ModelInput``, ``SamplingParams``, ``Datum``, ``AdamParams``), raising
``InvalidRequest`` (or ``NotSupported`` for features rlengine lacks, such as
image chunks) with the field path. A datum's provenance spans (protobuf's
JSON mapping of ``ProvenanceSpan``: ``{"sampled_tokens": {"sequence_id",
"offset", "length"}}`` or ``prompt_tokens``) make it a ``ProvenancedDatum``;
``stability`` checks them against what was sampled. ``prompt_targets`` reads a
sample's ``target_prompt_logprobs`` (the cells a sparse one does not list are
-1, asking nothing); ``prompt_scoring`` checks it.

Results go out as JSON through ``sample_response_json`` and
``forward_backward_json`` when a client does not ask for protobuf (the SDK
always does; see ``proto``). This module holds no state and must not touch
the engine.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import NotSupported
from rlengine.tinker_api.prompt_scoring import TargetLayout, alt_tensors, target_tensor
from rlengine.tinker_api.stability import Span, provenanced
from rlengine.types import (
    LOSS_FNS,
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    PromptScores,
    SampleResponse,
    SamplingParams,
    TensorData,
    int32_bytes,
)
from rlengine.validation import NonNegativeInt, PositiveInt, validate

__all__ = [
    "AdamParamsWire", "CancelFutureRequest", "ClientConfigRequest", "CreateModelRequest",
    "CreateSamplingSessionRequest", "CreateSessionRequest", "ForwardBackwardJsonRequest", "FutureRetrieveRequest",
    "FuturesRetrieveRequest", "GetInfoRequest", "JoinSamplingSessionRequest", "LoadWeightsRequest", "LoraConfigWire",
    "OptimStepRequest", "SampleRequest", "SaveWeightsForSamplerRequest", "SaveWeightsRequest",
    "SessionHeartbeatRequest", "UnloadModelRequest", "adam_params", "call_header", "check_loss_fn", "check_optimizer",
    "datum", "forward_backward_json", "model_input", "prompt_targets", "sample_response_json", "sampling_params",
]


class _Body(msgspec.Struct, kw_only=True, frozen=True):
    """A request body: unknown fields are ignored, known ones are type-checked (by msgspec, while decoding)."""


class _Checked(_Body):
    """A body whose fields declare limits, checked on construction and decoding: ``InvalidRequest``
    naming the field (after ``_prefix``: where the body sits in its request) and the value."""

    _prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        validate(self, InvalidRequest, self._prefix)


class ClientConfigRequest(_Body):
    sdk_version: str | None = None


class CreateSessionRequest(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(_Body):
    session_id: str


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class JoinSamplingSessionRequest(_Body):
    sampling_session_id: str


class LoraConfigWire(_Checked):
    """``CreateModelRequest.lora_config``, its only place."""

    _prefix: ClassVar[str] = "lora_config."
    rank: NonNegativeInt
    """0: full fine-tuning."""
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigWire(_Body):
    type: str = "adamw"


class CreateModelRequest(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigWire | None = None
    optimizer_config: OptimizerConfigWire | None = None


class GetInfoRequest(_Body):
    model_id: str


class UnloadModelRequest(_Body):
    model_id: str


class AdamParamsWire(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsWire | None = None
    optim_params: AdamParamsWire | None = None
    optimizer_params: dict[str, Any] | None = None
    """Parameters of a non-Adam optimizer family (Dimuon): not supported by rlengine."""


class SaveWeightsRequest(_Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(_Checked):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsRequest(_Body):
    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfigWire | None = None
    weights_access_token: str | None = None


class CopyWeightsRequest(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class WeightsInfoRequest(_Body):
    tinker_path: str


class EncodedTextChunk(_Body, tag_field="type", tag="encoded_text"):
    tokens: list[int]


class ImageChunk(_Body, tag_field="type", tag="image"):
    pass


class ImageAssetPointerChunk(_Body, tag_field="type", tag="image_asset_pointer"):
    pass


class DmelChunk(_Body, tag_field="type", tag="dmel"):
    pass


class ModelInputWire(_Body):
    chunks: list[EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk]


class SamplingParamsWire(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleRequest(_Checked):
    prompt: ModelInputWire
    sampling_params: SamplingParamsWire
    num_samples: PositiveInt = 1
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: NonNegativeInt = 0
    """0: none; at most what the backend reports (checked against it by ``SamplingCalls``)."""
    topk_sample_logprobs: NonNegativeInt = 0
    target_prompt_logprobs: TensorDataWire | None = None
    """int64 token ids [len(prompt) - 1, K] to score (-1: none), dense or sparse (``prompt_targets``;
    checked against the prompt and backend by ``prompt_scoring``)."""
    prompt_alt_tokens_k: NonNegativeInt = 0
    """Draws at every prompt position after the first (``prompt_scoring``)."""
    prompt_logprobs_last_n: PositiveInt | None = None
    """At most the prompt's length - 1 (checked against it by ``SamplingCalls``)."""
    record_stability_info: bool | None = None


class TensorDataWire(_Body):
    data: list[int | float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SpanRunWire(_Body):
    sequence_id: str
    length: int
    offset: int = 0


class ProvenanceSpanWire(_Body):
    """One provenance run, as protobuf's JSON mapping writes the ``ProvenanceSpan`` oneof: exactly one of
    ``prompt_tokens`` (a ``PromptProvenanceSpan``) and ``sampled_tokens`` (a ``SampledProvenanceSpan``)."""

    prompt_tokens: SpanRunWire | None = None
    sampled_tokens: SpanRunWire | None = None


class DatumWire(_Body):
    model_input: ModelInputWire
    loss_fn_inputs: dict[str, TensorDataWire]
    model_input_spans: list[ProvenanceSpanWire] | None = None
    loss_fn_input_spans: list[ProvenanceSpanWire] | None = None


class ForwardBackwardInputWire(_Body):
    data: list[DatumWire]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardJsonRequest(_Body):
    """``forward_backward`` (and ``forward``) as JSON, for clients that do not send protobuf."""

    forward_backward_input: ForwardBackwardInputWire
    model_id: str
    seq_id: int | None = None
    forward_only: bool = False


class FutureRetrieveRequest(_Body):
    request_id: str
    allow_metadata_only: bool = False


class FuturesTarget(_Body):
    sampling_session_id: str
    type: str = "sampling_session"
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(_Body):
    target: FuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(_Body):
    request_id: str


class _CallHeader(msgspec.Struct):
    """Any JSON object: what ``call_header`` reads of a body the full decoding refused."""

    model_id: Any = None
    seq_id: Any = None


_header_decoder = msgspec.json.Decoder(_CallHeader)


def call_header(body: bytes) -> tuple[str | None, int | None]:
    """The ``model_id`` and ``seq_id`` of a training call's JSON body, where they can be read (None
    where not): a refused call still consumes its ``seq_id``."""
    try:
        header = _header_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    model_id = header.model_id if isinstance(header.model_id, str) else None
    seq_id = header.seq_id if isinstance(header.seq_id, int) and not isinstance(header.seq_id, bool) else None
    return model_id, seq_id


# -- what the SDK has and rlengine does not serve ------------------------------------------------
# A name the SDK (0.38) can send that rlengine knows but does not serve answers ``not_supported``;
# a name neither knows stays ``invalid``.

_OPTIMIZERS_NOT_SERVED = ("dimuon",)


def check_loss_fn(loss_fn: str) -> None:
    """Refuse the SDK's loss rlengine lacks (``custom``) as ``NotSupported`` (unknown names are left to
    validation)."""
    if loss_fn == "custom":
        raise NotSupported("loss_fn", loss_fn, "server-side custom losses (create_custom_loss) are not served "
                           f"by rlengine (it serves {', '.join(LOSS_FNS)}); forward_backward_custom with a "
                           "Python loss function runs in the client")


def check_optimizer(field: str, family: object) -> None:
    """``family`` (an optimizer ``type``) must be AdamW: the SDK's other families are ``NotSupported``."""
    if family == "adamw":
        return
    if family in _OPTIMIZERS_NOT_SERVED:
        raise NotSupported(field, family, "rlengine trains with AdamW only")
    raise InvalidRequest(field, family, f"unknown optimizer type (the Tinker SDK has adamw, "
                         f"{', '.join(_OPTIMIZERS_NOT_SERVED)})")


# -- wire -> rlengine ----------------------------------------------------------------------


def model_input(wire: ModelInputWire, field: str) -> ModelInput:
    """Token chunks concatenated into one ``ModelInput``; other chunk kinds are not supported."""
    parts = []
    for i, chunk in enumerate(wire.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            raise NotSupported(f"{field}.chunks[{i}].type", type(chunk).__struct_config__.tag,
                               "only encoded_text chunks are supported by rlengine")
        parts.append(int32_bytes(f"{field}.chunks[{i}].tokens", chunk.tokens))
    return ModelInput(tokens_raw=b"".join(parts))


def sampling_params(wire: SamplingParamsWire, top_logprobs: int = 0) -> SamplingParams:
    """Tinker's ``stop=[]`` (no stop tokens, not even EOS) is rlengine's ``ignore_eos=True``;
    ``top_logprobs`` is the request's ``topk_sample_logprobs``."""
    stop = wire.stop
    ignore_eos = isinstance(stop, list) and not stop
    return SamplingParams(max_tokens=wire.max_tokens, seed=wire.seed, stop=None if ignore_eos else stop,
                          temperature=wire.temperature, top_k=wire.top_k, top_p=wire.top_p, ignore_eos=ignore_eos,
                          top_logprobs=top_logprobs)


def adam_params(wire: AdamParamsWire) -> AdamParams:
    return AdamParams(learning_rate=wire.learning_rate, beta1=wire.beta1, beta2=wire.beta2, eps=wire.eps,
                      weight_decay=wire.weight_decay, grad_clip_norm=wire.grad_clip_norm)


_DTYPES = {"int64": np.int64, "float32": np.float32}


def _tensor(wire: TensorDataWire, field: str, pad: int = 0) -> TensorData:
    """A dense ``TensorData``; a sparse CSR one has ``pad`` in every cell it does not list."""
    np_dtype = _DTYPES.get(wire.dtype)
    if np_dtype is None:
        raise InvalidRequest(f"{field}.dtype", wire.dtype, "must be 'int64' or 'float32'")
    try:
        values = np.asarray(wire.data, dtype=np_dtype)
    except (OverflowError, ValueError) as exc:
        raise InvalidRequest(f"{field}.data", "values", f"not representable as {wire.dtype} ({exc})") from None
    shape = wire.shape if wire.shape is not None else [values.size]
    if wire.sparse_crow_indices is not None:
        crow = np.asarray(wire.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(wire.sparse_col_indices or [], dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != values.size or (len(crow) and (
                crow[0] != 0 or crow[-1] != values.size or np.any(np.diff(crow) < 0))) \
                or (len(col) and (col.min() < 0 or col.max() >= shape[1])):
            raise InvalidRequest(f"{field}.sparse_crow_indices", shape, "is not a valid CSR layout of a 2-D tensor")
        dense = np.full(shape, pad, dtype=np_dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        values = dense
    if any(d < 0 for d in shape) or math.prod(shape) != values.size:
        raise InvalidRequest(f"{field}.shape", shape, f"does not match its {values.size} values")
    return TensorData.from_numpy(values.reshape(shape))


def prompt_targets(wire: TensorDataWire, field: str) -> tuple[np.ndarray, TargetLayout | None]:
    """``target_prompt_logprobs`` as a dense int64 array (-1 where a sparse one lists no cell) and, when
    it came sparse, its CSR indices (its response keeps them)."""
    if wire.dtype != "int64":
        raise InvalidRequest(f"{field}.dtype", wire.dtype, "must be 'int64' (token ids)")
    if wire.shape is None or len(wire.shape) != 2:
        raise InvalidRequest(f"{field}.shape", wire.shape, "must be 2-D, [len(prompt) - 1, K]")
    dense = _tensor(wire, field, pad=-1).to_numpy()
    if wire.sparse_crow_indices is None:
        return dense, None
    return dense, TargetLayout(np.asarray(wire.sparse_crow_indices, dtype=np.int64),
                               np.asarray(wire.sparse_col_indices or [], dtype=np.int64))


def datum(wire: DatumWire, field: str) -> Datum:
    """A plain ``Datum``, or a ``ProvenancedDatum`` when it carries provenance spans (both lists, as the SDK
    requires)."""
    return provenanced(model_input(wire.model_input, f"{field}.model_input"),
                       {k: _tensor(v, f"{field}.loss_fn_inputs[{k!r}]") for k, v in wire.loss_fn_inputs.items()},
                       _spans(wire.model_input_spans, f"{field}.model_input_spans"),
                       _spans(wire.loss_fn_input_spans, f"{field}.loss_fn_input_spans"), field)


def _spans(wire: list[ProvenanceSpanWire] | None, field: str) -> tuple[Span, ...]:
    out = []
    for j, span in enumerate(wire or ()):
        given = [(sampled, run) for sampled, run in ((False, span.prompt_tokens), (True, span.sampled_tokens))
                 if run is not None]
        if len(given) != 1:
            raise InvalidRequest(f"{field}[{j}]", "both" if given else "neither",
                                 "a span holds exactly one of prompt_tokens and sampled_tokens")
        sampled, run = given[0]
        out.append(Span(sampled, run.sequence_id, run.offset, run.length))
    return tuple(out)


# -- rlengine -> wire (JSON results) ----------------------------------------------------------


def sample_response_json(response: SampleResponse, prompt_logprobs_last_n: int | None = None,
                         target_layout: TargetLayout | None = None) -> dict[str, Any]:
    """A sample result as JSON; top-k lists are ``[[token_id, logprob], ...]`` per position, None where
    none was computed (a prompt's first token, and before the last ``prompt_logprobs_last_n``); prompt
    scores as the SDK's ``TensorData`` (``target_layout``: a sparse request's, which its result keeps)."""
    sequences = []
    for s in response.sequences:
        seq: dict[str, Any] = {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs}
        if s.top_ids_raw:
            seq["topk_logprobs"] = [[list(pair) for pair in row] for row in s.top_logprobs]
        sequences.append(seq)
    out: dict[str, Any] = {"type": "sample", "sequences": sequences,
                           "prompt_cache_hit_tokens": response.prompt_cache_hit_tokens}
    for key, values in (("prompt_logprobs", response.prompt_logprobs),
                        ("topk_prompt_logprobs", response.prompt_top_logprobs)):
        if values is None:
            continue
        values = list(values)
        if prompt_logprobs_last_n is not None:
            values[:max(0, len(values) - prompt_logprobs_last_n)] = [None] * max(0, len(values) - prompt_logprobs_last_n)
        if key == "topk_prompt_logprobs":
            values = [None if row is None else [list(pair) for pair in row] for row in values]
        out[key] = values
    if response.prompt_scores is not None:
        _prompt_scores_json(out, response.prompt_scores, target_layout)
    return out


def _prompt_scores_json(out: dict[str, Any], scores: PromptScores, layout: TargetLayout | None) -> None:
    target = target_tensor(scores, layout)
    if target is not None:
        tensor = {"data": target[0].tolist(), "dtype": "float32", "shape": target[1]}
        if layout is not None:
            tensor.update(sparse_crow_indices=layout.crow.tolist(), sparse_col_indices=layout.col.tolist())
        out["target_prompt_logprobs"] = tensor
    alt = alt_tensors(scores)
    if alt is not None:
        out["prompt_alt_tokens"] = {"tokens": {"data": alt[0].tolist(), "dtype": "int64", "shape": alt[2]},
                                    "logprobs": {"data": alt[1].tolist(), "dtype": "float32", "shape": alt[2]}}


def forward_backward_json(output: ForwardBackwardOutput) -> dict[str, Any]:
    return {"loss_fn_output_type": output.loss_fn_output_type, "metrics": output.metrics,
            "loss_fn_outputs": [{k: {"data": v.data, "dtype": v.dtype, "shape": v.shape} for k, v in o.items()}
                                for o in output.loss_fn_outputs]}
