"""Engine configuration: ``EngineConfig``, the sim backend's ``SimConfig`` and ``Placement``.

A leaf of the package (it imports only ``errors`` and ``validation``), so the backends and
the trainers read their settings without importing the control plane.

Plain msgspec Structs whose field types declare what they accept (``PositiveInt``,
``Literal[...]``: ``rlengine.validation``), checked on construction and on decoding; the
rules between fields are code in ``__post_init__``. A bad value raises
``ConfigurationError`` naming the field and the value. The environment variables that change
the engine's own behaviour are read here; those of one backend or extension
are read where they apply (``RLENGINE_TORCH_THREADS`` in ``backends.torch.runtime``,
``RLENGINE_CACHE`` in ``models``, ``RLENGINE_NO_EXTENSIONS`` in ``trie``,
``VLLM_*`` in ``backends.vllm_backend``); the README lists them all.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any, Literal

import msgspec
import numpy as np

from rlengine.errors import ConfigurationError
from rlengine.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, validate

__all__ = ["TINY_DEFAULTS", "EngineConfig", "Placement", "SimConfig", "continuous_sampling_from_env", "is_loopback"]


# The build parameters of ``model="tiny"`` and their defaults (``rlengine.backends.torch.models.build_tiny``):
# here, below the backends, so a config is checked without importing the model code.
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "init_std": 0.1,
    "model_vocab_size": None,
    "dtype": "float32",
    "seed": 0,
}


def is_loopback(host: str) -> bool:
    """``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``): what a server without
    an API key may bind."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def continuous_sampling_from_env() -> bool:
    """``RLENGINE_CONTINUOUS_SAMPLING=0`` restores serial batch-wave sampling."""
    raw = os.environ.get("RLENGINE_CONTINUOUS_SAMPLING", "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"RLENGINE_CONTINUOUS_SAMPLING={raw!r}: must be 0 or 1")


class SimConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The deterministic simulated backend (control-plane tests and benchmarks).

    Generation length per request is ``gen_len`` (``fixed``) or drawn from a
    lognormal with median ``gen_len`` and ``gen_len_sigma`` (``lognormal``),
    seeded by the request's seed, capped by ``max_tokens``. A step costs
    ``step_time_s + token_time_s * batch`` seconds of simulated time (slept,
    GIL released), zero by default.
    """

    vocab_size: PositiveInt = 256
    max_model_len: PositiveInt = 4096
    gen_len: PositiveInt = 16
    gen_len_dist: Literal["fixed", "lognormal"] = "fixed"
    gen_len_sigma: NonNegativeFloat = 1.0
    step_time_s: NonNegativeFloat = 0.0
    token_time_s: NonNegativeFloat = 0.0
    max_num_seqs: PositiveInt = 1024
    seed: int = 0
    sleep_supported: bool = True
    fail_at_step: NonNegativeInt = 0
    """Fault injection: the backend's ``step`` raises on its ``fail_at_step``-th call (0: never),
    as a crashed inference engine would."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError, "sim.")

    def initial_weights(self) -> np.ndarray:
        """The sim model's one weight tensor ``theta`` (unigram logits), shared by
        the sim backend and the sim trainer so that both start identical."""
        return np.random.default_rng(self.seed).normal(0.0, 1.0, self.vocab_size).astype(np.float32)


class Placement(msgspec.Struct, kw_only=True, frozen=True):
    """Where the engine's data plane runs. ``local`` (the default): the backend in this
    process, on the engine's compute thread. ``ray``: ``sampler_replicas`` Ray actors, each
    running the configured backend (torch, vLLM, sim) with the same backend protocol, behind
    this process's one scheduler and loop (``rlengine.backends.ray_replicas``), and the
    trainer in this process or sharded (``trainer_workers``). Ray is imported only by the
    engine, and only when ``kind="ray"``.

    ``address``: the Ray cluster (None: the one this process already joined, else
    ``$RAY_ADDRESS``, else a local one started for the engine). ``replica_resources``: what
    each replica actor asks of Ray (e.g. ``{"CPU": 1}``, ``{"GPU": 1}``). A replica that dies
    fails only its own requests (``ReplicaLost``) and, with ``replace_dead``, is replaced by one
    loaded with the current weights, at most ``max_replacements`` times per engine. A weight
    install reaches every replica in buckets of ``sync_bucket_bytes`` through the object
    store, within ``sync_timeout_s`` or fails (``WeightSyncError``); a replica has
    ``start_timeout_s`` to build its backend.

    ``trainer_workers`` > 1 shards the torch trainer over that many Ray actors, one
    torch.distributed group with the model under FSDP2 (``rlengine.trainer.ray_trainer``), each
    asking ``trainer_resources``; every training call waits at most ``train_timeout_s``
    (``TrainerLost`` otherwise). 1: the trainer runs in this process."""

    kind: Literal["local", "ray"] = "local"
    sampler_replicas: PositiveInt = 1
    replica_resources: dict[str, NonNegativeFloat] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    address: str | None = None
    replace_dead: bool = True
    max_replacements: NonNegativeInt = 8
    sync_bucket_bytes: PositiveInt = 64 << 20
    sync_timeout_s: PositiveFloat = 300.0
    start_timeout_s: PositiveFloat = 600.0
    trainer_workers: PositiveInt = 1
    trainer_resources: dict[str, NonNegativeFloat] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    train_timeout_s: PositiveFloat = 1800.0

    def __post_init__(self) -> None:
        validate(self, ConfigurationError, "placement.")
        if self.kind == "local" and self.trainer_workers != 1:
            raise ConfigurationError(f"placement.trainer_workers={self.trainer_workers}: trainer workers are Ray "
                                     "actors (placement.kind='ray'); a local engine trains in process")
        if self.kind == "local" and self.sampler_replicas != 1:
            raise ConfigurationError(f"placement.sampler_replicas={self.sampler_replicas}: replicas are Ray actors "
                                     "(placement.kind='ray'); a local engine has one backend")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigurationError(f"placement.address={self.address!r}: must be a Ray address or None")


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How to build an ``Engine``.

    ``backend``: ``auto`` picks the best model backend available; ``sim`` is
    the deterministic simulator; ``scripted`` returns completions given as
    text (``engine_args["script"]``), for tests of agents without trained weights. ``drain_policy``: before blocking work,
    ``wait`` lets in-flight samples finish; ``pause`` aborts them, keeps
    their tokens and continues them afterwards on the new weights.
    ``continuous_sampling`` None reads ``RLENGINE_CONTINUOUS_SAMPLING``.
    """

    model: str = "tiny"
    model_name: str | None = None
    backend: Literal["auto", "sim", "torch", "vllm", "scripted"] = "auto"
    drain_policy: Literal["wait", "pause"] = "wait"
    drain_timeout_s: PositiveFloat = 600.0
    continuous_sampling: bool | None = None
    seed: int = 0
    close_timeout_s: PositiveFloat = 30.0
    max_num_seqs: PositiveInt = 256
    """Most sequences a model backend runs in one batch."""
    max_model_len: PositiveInt | None = None
    """Context length; None takes the model's own."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    cache_dir: str | None = None
    """Where ``model="tiny"`` is built, and a ``.gguf`` model converted, once; None: ``$RLENGINE_CACHE`` or
    ``~/.cache/rlengine``."""
    model_args: dict[str, object] = msgspec.field(default_factory=dict)
    """Build parameters of ``model="tiny"`` (``TINY_DEFAULTS``), e.g.
    ``{"max_position_embeddings": 16384}`` for a context that holds an agent's prompt; each set of
    parameters is its own cached model. Only for ``model="tiny"``."""
    engine_args: dict[str, object] = msgspec.field(default_factory=dict)
    """Passed through to the model backend (e.g. vLLM's ``tensor_parallel_size``)."""
    logprobs_mode: Literal["raw", "processed"] = "raw"
    """The logprob recorded for a sampled token when the request does not say
    (``SamplingParams.logprobs_mode``): ``raw`` or ``processed`` (after temperature, top-k and
    top-p). vLLM records one mode per engine: this one, and a request asking for the other is
    refused."""
    sim: SimConfig = msgspec.field(default_factory=SimConfig)
    placement: Placement = msgspec.field(default_factory=Placement)
    """Where the backend runs: in this process (the default) or as Ray actor replicas (``Placement``)."""
    train_concurrently: Literal["off", "on", "auto"] = "off"
    """``on``: training calls (forward, forward_backward, optim_step, state save and load) run on a
    thread of their own beside sampling (``rlengine.core.training``) instead of as blocking work with
    the sampler drained; weight installs still pass the gate. For a trainer that shares no device
    memory with the sampler: the CPU (``on`` with a CUDA sampler is refused). ``auto``: on where
    the sampler is not on CUDA (an RL run with ``max_steps_off_policy`` > 0 asks for it). With it
    the two compute threads each get half the intra-op threads (``backends.torch.threads``)."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        # Below: a name's meaning and the rules between fields, which a field's type cannot say.
        if not isinstance(self.model, str) or not self.model:
            raise ConfigurationError(f"model={self.model!r}: must be 'tiny', a local model directory, a .gguf file "
                                     "or a hub id in the local Hugging Face cache")
        if self.model_args:
            if self.model != "tiny":
                raise ConfigurationError(f"model_args={self.model_args!r}: build parameters of model='tiny' only "
                                         f"(model={self.model!r} is loaded as it is; max_model_len caps its context)")
            unknown = sorted(set(self.model_args) - set(TINY_DEFAULTS))
            if unknown:
                raise ConfigurationError(f"model_args {unknown}: not build parameters of model='tiny' "
                                         f"(known: {', '.join(sorted(TINY_DEFAULTS))})")

    def resolved_continuous(self) -> bool:
        if self.continuous_sampling is None:
            return continuous_sampling_from_env()
        return self.continuous_sampling
