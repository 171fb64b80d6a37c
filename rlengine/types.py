"""Public value types of rlengine: msgspec Structs with Tinker-compatible names.

Every public Struct is ``kw_only=True, frozen=True``: a value a future
resolves to can be shared between threads and cached in its msgpack form.

Token ids, logprobs and versions are held compactly, as raw little-endian
int32 / float32 bytes (the ``*_raw`` fields), never as Python lists: measured
on this project's machines, lists cost about 10x in codec time, and bytes go
over the wire as they are. Tinker-style accessors (``tokens``, ``logprobs``,
``to_ints()``, ``to_numpy()``) convert on demand.

Validation happens here, at construction (and at decode, since msgspec calls
``__post_init__`` then too), so an invalid value raises ``InvalidRequest``
naming the field and value before anything is queued.

This module must not import torch: the control plane runs without it.
"""

from __future__ import annotations

import math
import sys
from array import array
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec.structs import force_setattr

from rlengine.errors import InvalidRequest
from rlengine.validation import Bound, NonNegativeFloat, NonNegativeInt, PositiveInt, validate

__all__ = [
    "LOGPROBS_MODES",
    "AdamParams",
    "Datum",
    "ForwardBackwardOutput",
    "LoadWeightsResponse",
    "LogprobTransform",
    "LogprobsMode",
    "LossFnType",
    "ModelInput",
    "OptimStepResponse",
    "PromptScores",
    "PromptScoring",
    "Receipt",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "StopReason",
    "TensorData",
    "UnloadModelResponse",
    "int32_bytes",
    "unpack_top",
]

StopReason = Literal["length", "stop", "abort"]
LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES: tuple[str, ...] = ("raw", "processed")
LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
LOSS_FNS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                             "stable_reinforce")

_INT32_MAX = 2**31 - 1
# The raw fields are little-endian on the wire; native order is used in
# memory, which is the same on every platform we run on.
if sys.byteorder != "little":  # pragma: no cover - no big-endian targets
    raise ImportError("rlengine stores raw arrays little-endian and needs a little-endian host")


class _Public(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Base of the public value types.

    ``gc=False``: these values hold only bytes, numbers, strings and
    containers of them, never a reference back to engine objects, so they
    cannot form cycles; untracked, thousands in flight cost the cyclic
    collector nothing."""


def int32_bytes(field: str, tokens: Any) -> bytes:
    """Token ids from a sequence of ints, a numpy array or an int32 buffer, as raw int32 bytes.

    Raises ``InvalidRequest`` naming ``field`` for a negative id, an id above
    int32, a non-integer dtype or a non-1-D input.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise InvalidRequest(
            field, type(tokens).__name__,
            "raw bytes are ambiguous; pass a list of ints, a numpy int array or array('i')",
        )
    if isinstance(tokens, array):
        if tokens.typecode not in "bBhHiIlLqQ":
            raise InvalidRequest(field, tokens.typecode, "array typecode must be an integer type")
        arr = np.frombuffer(tokens, dtype=tokens.typecode) if tokens.itemsize in (1, 2, 4, 8) else None
        if arr is None:  # pragma: no cover - every integer typecode has one of these sizes
            raise InvalidRequest(field, tokens.typecode, "unsupported array item size")
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(field, tokens, f"not a sequence of token ids ({exc})") from None
        if arr.size == 0:
            return b""
    if arr.ndim != 1:
        raise InvalidRequest(field, f"shape {arr.shape}", "token ids must be one-dimensional")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidRequest(field, f"dtype {arr.dtype}", "token ids must be integers")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise InvalidRequest(field, lo, "token ids must be >= 0")
    if hi > _INT32_MAX:
        raise InvalidRequest(field, hi, "token ids must fit in int32")
    return arr.astype(np.int32, copy=False).tobytes()


def _check_raw(field: str, raw: bytes, itemsize: int) -> int:
    if not isinstance(raw, bytes):
        raise InvalidRequest(field, type(raw).__name__, "must be bytes")
    if len(raw) % itemsize:
        raise InvalidRequest(field, len(raw), f"byte length must be a multiple of {itemsize}")
    return len(raw) // itemsize


class ModelInput(_Public):
    """A prompt: token ids as raw int32 bytes (Tinker: ``ModelInput``)."""

    tokens_raw: bytes = b""

    def __post_init__(self) -> None:
        _check_raw("ModelInput.tokens_raw", self.tokens_raw, 4)

    @classmethod
    def from_ints(cls, tokens: Any) -> ModelInput:
        """From a list of ints, a numpy integer array or ``array('i')``."""
        return cls(tokens_raw=int32_bytes("ModelInput.tokens", tokens))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls()

    def to_ints(self) -> list[int]:
        a = array("i")
        a.frombytes(self.tokens_raw)
        return a.tolist()

    def to_numpy(self) -> np.ndarray:
        """A read-only int32 view of the token ids (no copy)."""
        return np.frombuffer(self.tokens_raw, dtype=np.int32)

    @property
    def length(self) -> int:
        return len(self.tokens_raw) // 4

    def append_ints(self, tokens: Any) -> ModelInput:
        """A new ModelInput with ``tokens`` appended."""
        return ModelInput(tokens_raw=self.tokens_raw + int32_bytes("ModelInput.tokens", tokens))


MAX_TOP_LOGPROBS = 20
"""The most ``SamplingParams.top_logprobs`` may ask for (OpenAI's limit)."""


class SamplingParams(_Public):
    """How to sample (Tinker: ``SamplingParams``).

    ``temperature`` 0 means greedy. ``top_k`` -1 and ``top_p`` 1 disable
    those filters. ``stop`` is a string, a list of strings, or a list of
    token ids. ``max_tokens`` None means up to the model's context length.
    """

    max_tokens: PositiveInt | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: Annotated[float, Bound(ge=0, note="0 is greedy")] = 1.0
    top_k: Annotated[int, Bound(ge=1, also=(-1,), note="-1: no limit")] = -1
    top_p: Annotated[float, Bound(gt=0, le=1)] = 1.0
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token (benchmarks,
    tests); explicit ``stop`` ids and strings still apply. Not in Tinker."""
    top_logprobs: Annotated[int, Bound(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    """Also record, for every sampled token, the ``top_logprobs`` most likely tokens
    and their logprobs (0 to 20, OpenAI's limit; not in Tinker), from the same
    distribution as the sampled token's logprob. Backends cap it
    (``Capabilities.top_logprobs``)."""
    constraint: str | None = None
    """Constrained decoding (not in Tinker): an xgrammar structural tag as JSON
    text (``{"type": "structural_tag", "format": {...}}``, built by
    ``rlengine.constraints``) that the completion must match. Tokens it does
    not allow are masked before sampling (the torch backend with xgrammar,
    vLLM with its structured outputs), and each token's logprob is that of
    the masked distribution, the one the constrained sampler drew from. The
    backend compiles it; one it cannot compile fails that request with
    ``InvalidRequest`` naming ``sampling_params.constraint``."""
    logprobs_mode: LogprobsMode | None = None
    """Which logprob is recorded for each sampled token (not in Tinker): ``raw``, the
    ``log_softmax`` of the model's logits (what a trainer's plain forward computes), or
    ``processed``, the logprob under the distribution actually sampled: logits divided by
    ``temperature``, then ``top_k``, then ``top_p``, renormalised (vLLM's
    ``processed_logprobs``). None: the engine's own (``EngineConfig.logprobs_mode``). A greedy
    request (temperature 0), or one at temperature 1 without top-k or top-p, records raw
    logprobs in either mode (``logprob_transform`` None). A trainer computes the same
    transform from a datum's ``temperature`` / ``top_k`` / ``top_p`` inputs
    (``rlengine.trainer.losses``), so the importance ratio is 1 on-policy at any temperature."""

    def __post_init__(self) -> None:
        validate(self, InvalidRequest)
        # Below: what one field's type cannot say (a format, a rule between fields, the stop list).
        c = self.constraint
        if c is not None:
            if not isinstance(c, str) or not c.startswith("{"):
                raise InvalidRequest("constraint", c if not isinstance(c, str) else c[:40],
                                     "must be a structural tag as JSON text, or None")
            if self.ignore_eos:
                raise InvalidRequest("ignore_eos", True, "cannot be combined with a constraint (a finished "
                                     "constraint allows only the end of sequence)")
        stop = self.stop
        if stop is None:
            return
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise InvalidRequest("stop", stop, "must be a string, a list of strings or a list of token ids")
        kinds = {type(x) for x in stop}
        if kinds - {str, int} or len(kinds) > 1:
            raise InvalidRequest("stop", stop, "must be all strings or all token ids, not a mix")
        for x in stop:
            if isinstance(x, str) and not x:
                raise InvalidRequest("stop", stop, "stop strings must be non-empty")
            if isinstance(x, int) and not 0 <= x <= _INT32_MAX:
                raise InvalidRequest("stop", x, "stop token ids must be in [0, 2**31)")
        force_setattr(self, "stop", list(stop))

    @property
    def logprob_transform(self) -> LogprobTransform | None:
        """The transform its processed logprobs are under; None when they are raw (mode
        ``raw``, unset, a greedy request, or temperature 1 with no top-k or top-p: the
        model's own distribution)."""
        if self.logprobs_mode != "processed" or self.temperature == 0.0 or (
                self.temperature == 1.0 and self.top_k == -1 and self.top_p == 1.0):
            return None
        return LogprobTransform(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(x for x in self.stop if isinstance(x, str))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        if self.stop is None:
            return ()
        return tuple(x for x in self.stop if isinstance(x, int))


class LogprobTransform(_Public):
    """The sampling transform a processed logprob is under: ``log_softmax`` of the logits
    divided by ``temperature``, kept to the ``top_k`` most likely tokens (-1: all) and then to
    the nucleus of mass ``top_p``, renormalised."""

    temperature: float
    top_k: int = -1
    top_p: float = 1.0


class SampledSequence(_Public):
    """One completion (Tinker: ``SampledSequence``) plus per-token policy versions.

    ``versions[i]`` is the policy version whose weights sampled ``tokens[i]``;
    a request paused across a weight install carries two or more versions.
    """

    stop_reason: StopReason
    tokens_raw: bytes = b""
    logprobs_raw: bytes = b""
    versions_raw: bytes = b""
    top_ids_raw: bytes = b""
    """With ``SamplingParams.top_logprobs`` k > 0: k token ids per token (int32), most likely first."""
    top_logprobs_raw: bytes = b""
    """Their logprobs (float32), aligned with ``top_ids_raw``."""
    logprobs_transform: LogprobTransform | None = None
    """Which logprobs ``logprobs_raw`` holds: None, raw ones (``log_softmax`` of the logits);
    otherwise processed ones, under this transform (``SamplingParams.logprobs_mode``)."""

    # No __post_init__ check: the engine builds these (one per finished
    # sequence, on the hot path) with equal lengths by construction, and
    # nobody sends them *to* the engine.

    @property
    def tokens(self) -> list[int]:
        a = array("i")
        a.frombytes(self.tokens_raw)
        return a.tolist()

    @property
    def logprobs(self) -> list[float]:
        a = array("f")
        a.frombytes(self.logprobs_raw)
        return a.tolist()

    @property
    def versions(self) -> list[int]:
        a = array("i")
        a.frombytes(self.versions_raw)
        return a.tolist()

    def tokens_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens_raw, dtype=np.int32)

    def logprobs_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs_raw, dtype=np.float32)

    def versions_array(self) -> np.ndarray:
        return np.frombuffer(self.versions_raw, dtype=np.int32)

    @property
    def length(self) -> int:
        return len(self.tokens_raw) // 4

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        """Per token, its most likely alternatives as (token id, logprob); [] when not asked for."""
        return unpack_top(self.tokens_raw, self.top_ids_raw, self.top_logprobs_raw)


def unpack_top(tokens_raw: bytes, top_ids_raw: bytes, top_logprobs_raw: bytes) -> list[list[tuple[int, float]]]:
    """The per-token alternatives that ``top_ids_raw`` / ``top_logprobs_raw`` hold, k per token."""
    n = len(tokens_raw) // 4
    if not n or not top_ids_raw:
        return []
    ids, lps = array("i"), array("f")
    ids.frombytes(top_ids_raw)
    lps.frombytes(top_logprobs_raw)
    k = len(ids) // n
    return [list(zip(ids[i * k:(i + 1) * k], lps[i * k:(i + 1) * k])) for i in range(n)]


class PromptScoring(_Public):
    """What a sample call asks of its prompt's positions beyond their own tokens' logprobs, computed from
    the logits of the prefill that serves it (Tinker's ``target_prompt_logprobs`` and
    ``prompt_alt_tokens_k``). Row i covers prompt position i + 1 (position 0 has no context), as for
    prompt logprobs. The Tinker server checks it against the prompt and the backend (``SamplingCalls``)."""

    target_ids_raw: bytes | None = None
    """int32 token ids, ``target_k`` per prompt token after the first (row-major); -1: none wanted."""
    target_k: NonNegativeInt = 0
    alt_k: NonNegativeInt = 0
    """Tokens to draw at every prompt position after the first: independently, with replacement, at
    the sample's temperature (temperature 0: the most likely, ``alt_k`` times), from its seed."""


class PromptScores(_Public):
    """What a ``PromptScoring`` got (``SampleResponse.prompt_scores``). Every logprob is raw, the
    ``log_softmax`` of the model's logits, as prompt logprobs are."""

    target_k: int = 0
    target_logprobs_raw: bytes | None = None
    """float32, aligned with ``PromptScoring.target_ids_raw``; 0.0 where it held -1."""
    alt_k: int = 0
    alt_ids_raw: bytes | None = None
    """int32, ``alt_k`` draws per prompt token after the first (row-major)."""
    alt_logprobs_raw: bytes | None = None
    """float32, the logprob of each draw."""


class SampleResponse(_Public):
    """The result of one ``sample`` call: ``num_samples`` sequences."""

    sequences: tuple[SampledSequence, ...]
    """A tuple (of untracked Structs, so the collector drops it at once)."""
    request_id: str = ""
    prompt_logprobs_raw: bytes | None = None
    prompt_top_k: int = 0
    """With prompt top-k logprobs asked for (``Engine.sample(prompt_top_logprobs=k)``; Tinker's
    ``topk_prompt_logprobs``): k; 0 otherwise."""
    prompt_top_ids_raw: bytes | None = None
    """k token ids (int32) per prompt token after the first, most likely first."""
    prompt_top_logprobs_raw: bytes | None = None
    """Their logprobs (float32), aligned with ``prompt_top_ids_raw``."""
    prompt_cache_hit_tokens: int = 0
    """Prompt tokens whose prefill the backend's prefix cache spared (Tinker's ``prompt_cache_hit_tokens``):
    counted once for the prompt, as its first sample found them (the fewest over its samples); 0 where the
    backend reports none (sim, vLLM)."""
    prompt_scores: PromptScores | None = None
    """With a ``PromptScoring`` asked for (the Tinker API's ``target_prompt_logprobs`` and
    ``prompt_alt_tokens_k``): what it got; None otherwise."""
    drafted_tokens: int = 0
    """Tokens its sequences drafted under speculative decoding (the torch backend's
    ``engine_args["speculative"]``); ``accepted_tokens``: those kept. 0 without drafting."""
    accepted_tokens: int = 0

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        """Per prompt token; the first is None (nothing precedes it), as in Tinker."""
        if self.prompt_logprobs_raw is None:
            return None
        a = array("f")
        a.frombytes(self.prompt_logprobs_raw)
        return [None, *a.tolist()]

    @property
    def prompt_top_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        """Per prompt token, the most likely tokens at its position as (token id, logprob); the first
        is None, as in Tinker. None when not asked for."""
        k = self.prompt_top_k
        if not k or self.prompt_top_ids_raw is None or self.prompt_top_logprobs_raw is None:
            return None
        ids, lps = array("i"), array("f")
        ids.frombytes(self.prompt_top_ids_raw)
        lps.frombytes(self.prompt_top_logprobs_raw)
        return [None, *(list(zip(ids[i:i + k], lps[i:i + k])) for i in range(0, len(ids), k))]


_TENSOR_DTYPES = {"int64": np.int64, "float32": np.float32}


class TensorData(_Public):
    """A dense tensor as raw bytes (Tinker: ``TensorData``); dtype int64 or float32."""

    data_raw: bytes
    dtype: Literal["int64", "float32"]
    shape: list[NonNegativeInt]

    def __post_init__(self) -> None:
        validate(self, InvalidRequest, "TensorData.")
        n = math.prod(self.shape)
        itemsize = 8 if self.dtype == "int64" else 4
        if _check_raw("TensorData.data_raw", self.data_raw, itemsize) != n:
            raise InvalidRequest("TensorData.data_raw", len(self.data_raw) // itemsize,
                                 f"element count must match shape {self.shape} ({n})")

    @classmethod
    def from_numpy(cls, arr: Any) -> TensorData:
        a = np.asarray(arr)
        if a.dtype.kind in "iub":
            dtype = "int64"
        elif a.dtype.kind == "f":
            dtype = "float32"
        else:
            raise InvalidRequest("TensorData.dtype", str(a.dtype), "must be an integer or float array")
        a = np.ascontiguousarray(a, dtype=_TENSOR_DTYPES[dtype])
        return cls(data_raw=a.tobytes(), dtype=dtype, shape=list(a.shape))

    @classmethod
    def from_numpy_parts(cls, arr: Any, lengths: list[int]) -> list[TensorData]:
        """``from_numpy`` of each consecutive part of the 1-D ``arr``, ``lengths[i]`` items each.

        The whole is converted and checked once; each part is a copy of it with its slice of the
        bytes and its length, so it needs no check of its own (a batch of datums' columns costs
        one check, not one per datum)."""
        whole = cls.from_numpy(arr)
        if len(whole.shape) != 1 or sum(lengths) != whole.shape[0] or min(lengths, default=0) < 0:
            raise InvalidRequest("lengths", lengths, f"must be item counts that sum to the array's {whole.shape}")
        raw, size = whole.data_raw, 8 if whole.dtype == "int64" else 4
        duplicate = whole.__copy__  # a Struct's own copy: no __post_init__, no copy-module dispatch
        parts = []
        at = 0
        for n in lengths:
            part = duplicate()
            force_setattr(part, "data_raw", raw[at * size:(at + n) * size])
            force_setattr(part, "shape", [n])
            parts.append(part)
            at += n
        return parts

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the data in its dtype and shape (no copy)."""
        return np.frombuffer(self.data_raw, dtype=_TENSOR_DTYPES[self.dtype]).reshape(self.shape)

    def to_torch(self) -> Any:
        import torch  # lazily: the control plane never needs it

        return torch.from_numpy(self.to_numpy().copy())

    def tolist(self) -> list[Any]:
        return self.to_numpy().tolist()

    @property
    def data(self) -> list[Any]:
        return self.to_numpy().ravel().tolist()


def _as_tensor_data(field: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        return TensorData.from_torch(value)
    try:
        return TensorData.from_numpy(value)
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - any conversion failure is the caller's input
        raise InvalidRequest(field, type(value).__name__, f"cannot convert to TensorData ({exc})") from None


class Datum(_Public):
    """One training example (Tinker: ``Datum``).

    ``loss_fn_inputs`` maps names (``target_tokens``, ``weights``,
    ``logprobs``, ``advantages``) to tensors; numpy arrays, torch tensors and
    lists are converted to ``TensorData`` on construction.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise InvalidRequest("Datum.model_input", type(self.model_input).__name__, "must be a ModelInput")
        converted = {}
        for k, v in self.loss_fn_inputs.items():
            converted[k] = _as_tensor_data(f"Datum.loss_fn_inputs[{k!r}]", v)
        force_setattr(self, "loss_fn_inputs", converted)


class ForwardBackwardOutput(_Public):
    """Per-datum outputs (``logprobs`` of each target token) and metrics."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


class AdamParams(_Public):
    """AdamW hyperparameters with Tinker's defaults; ``grad_clip_norm`` 0 disables clipping."""

    learning_rate: NonNegativeFloat = 1e-4
    beta1: Annotated[float, Bound(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Bound(ge=0, lt=1)] = 0.95
    eps: NonNegativeFloat = 1e-12
    weight_decay: NonNegativeFloat = 0.0
    grad_clip_norm: NonNegativeFloat = 0.0

    def __post_init__(self) -> None:
        validate(self, InvalidRequest)


class OptimStepResponse(_Public):
    metrics: dict[str, float] | None = None


class SaveWeightsForSamplerResponse(_Public):
    """The trainer's weights were installed into the sampler as ``version``."""

    version: int
    path: str | None = None


class SaveWeightsResponse(_Public):
    path: str


class LoadWeightsResponse(_Public):
    path: str


class UnloadModelResponse(_Public):
    """``unloaded`` is False when nothing was loaded (a no-op that did not drain)."""

    unloaded: bool


class Receipt(_Public):
    """What a settled lease leaves behind (``rlengine.core.scheduler``)."""

    lease_id: int
    request_id: str
    session_id: str | None
    versions: list[int]
    outcome: Literal["completed", "aborted", "failed", "written_off"]
