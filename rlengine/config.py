"""Engine configuration: ``EngineConfig``, the sim backend's ``SimConfig`` and ``Placement``.

A leaf of the package (it imports only ``errors``), so the backends and the
trainers read their settings without importing the control plane.

Plain msgspec Structs, validated on construction; a bad value raises
``ConfigurationError`` naming the field. The environment variables that change
the engine's own behaviour are read here; those of one backend or extension
are read where they apply (``RLENGINE_TORCH_THREADS`` in ``backends.torch.runtime``,
``RLENGINE_CACHE`` in ``models``, ``RLENGINE_NO_EXTENSIONS`` in ``trie``,
``VLLM_*`` in ``backends.vllm_backend``); the README lists them all.
"""

from __future__ import annotations

import ipaddress
import math
import os
from typing import Any, Literal

import msgspec
import numpy as np

from rlengine.errors import ConfigurationError

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


def _positive(name: str, value: object, *, integer: bool = False, zero_ok: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or math.isnan(value) or math.isinf(value) \
            or value < 0 or (value == 0 and not zero_ok):
        kind = "an integer" if integer else "a finite number"
        raise ConfigurationError(f"{name}={value!r}: must be {kind} {'>= 0' if zero_ok else '> 0'}")


class SimConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The deterministic simulated backend (control-plane tests and benchmarks).

    Generation length per request is ``gen_len`` (``fixed``) or drawn from a
    lognormal with median ``gen_len`` and ``gen_len_sigma`` (``lognormal``),
    seeded by the request's seed, capped by ``max_tokens``. A step costs
    ``step_time_s + token_time_s * batch`` seconds of simulated time (slept,
    GIL released), zero by default.
    """

    vocab_size: int = 256
    max_model_len: int = 4096
    gen_len: int = 16
    gen_len_dist: Literal["fixed", "lognormal"] = "fixed"
    gen_len_sigma: float = 1.0
    step_time_s: float = 0.0
    token_time_s: float = 0.0
    max_num_seqs: int = 1024
    seed: int = 0
    sleep_supported: bool = True
    fail_at_step: int = 0
    """Fault injection: the backend's ``step`` raises on its ``fail_at_step``-th call (0: never),
    as a crashed inference engine would."""

    def __post_init__(self) -> None:
        _positive("sim.fail_at_step", self.fail_at_step, integer=True, zero_ok=True)
        _positive("sim.vocab_size", self.vocab_size, integer=True)
        _positive("sim.max_model_len", self.max_model_len, integer=True)
        _positive("sim.gen_len", self.gen_len, integer=True)
        _positive("sim.gen_len_sigma", self.gen_len_sigma, zero_ok=True)
        _positive("sim.step_time_s", self.step_time_s, zero_ok=True)
        _positive("sim.token_time_s", self.token_time_s, zero_ok=True)
        _positive("sim.max_num_seqs", self.max_num_seqs, integer=True)
        if self.gen_len_dist not in ("fixed", "lognormal"):
            raise ConfigurationError(f"sim.gen_len_dist={self.gen_len_dist!r}: must be 'fixed' or 'lognormal'")

    def initial_weights(self) -> np.ndarray:
        """The sim model's one weight tensor ``theta`` (unigram logits), shared by
        the sim backend and the sim trainer so that both start identical."""
        return np.random.default_rng(self.seed).normal(0.0, 1.0, self.vocab_size).astype(np.float32)


class Placement(msgspec.Struct, kw_only=True, frozen=True):
    """Where the engine's data plane runs. ``local`` (the default): the backend in this
    process, on the engine's compute thread. ``ray``: ``sampler_replicas`` Ray actors, each
    running the configured backend (torch, vLLM, sim) with the same backend protocol, behind
    this process's one gate, scheduler and loop (``rlengine.backends.ray_replicas``), and the
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
    sampler_replicas: int = 1
    replica_resources: dict[str, float] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    address: str | None = None
    replace_dead: bool = True
    max_replacements: int = 8
    sync_bucket_bytes: int = 64 << 20
    sync_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    trainer_workers: int = 1
    trainer_resources: dict[str, float] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    train_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.kind not in ("local", "ray"):
            raise ConfigurationError(f"placement.kind={self.kind!r}: must be 'local' or 'ray'")
        _positive("placement.trainer_workers", self.trainer_workers, integer=True)
        if self.kind == "local" and self.trainer_workers != 1:
            raise ConfigurationError(f"placement.trainer_workers={self.trainer_workers}: trainer workers are Ray "
                                     "actors (placement.kind='ray'); a local engine trains in process")
        _positive("placement.train_timeout_s", self.train_timeout_s)
        _positive("placement.sampler_replicas", self.sampler_replicas, integer=True)
        if self.kind == "local" and self.sampler_replicas != 1:
            raise ConfigurationError(f"placement.sampler_replicas={self.sampler_replicas}: replicas are Ray actors "
                                     "(placement.kind='ray'); a local engine has one backend")
        for name in ("replica_resources", "trainer_resources"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and v >= 0
                    for k, v in value.items()):
                raise ConfigurationError(f"placement.{name}={value!r}: must map resource names to amounts >= 0")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigurationError(f"placement.address={self.address!r}: must be a Ray address or None")
        _positive("placement.max_replacements", self.max_replacements, integer=True, zero_ok=True)
        _positive("placement.sync_bucket_bytes", self.sync_bucket_bytes, integer=True)
        _positive("placement.sync_timeout_s", self.sync_timeout_s)
        _positive("placement.start_timeout_s", self.start_timeout_s)


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
    drain_timeout_s: float = 600.0
    continuous_sampling: bool | None = None
    seed: int = 0
    close_timeout_s: float = 30.0
    max_num_seqs: int = 256
    """Most sequences a model backend runs in one batch."""
    max_model_len: int | None = None
    """Context length; None takes the model's own."""
    dtype: str = "float32"
    cache_dir: str | None = None
    """Where ``model="tiny"`` is built once; None: ``$RLENGINE_CACHE`` or ``~/.cache/rlengine``."""
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
        if not isinstance(self.placement, Placement):
            raise ConfigurationError(f"placement={self.placement!r}: must be a Placement")
        if self.backend not in ("auto", "sim", "torch", "vllm", "scripted"):
            raise ConfigurationError(f"backend={self.backend!r}: must be auto, sim, torch, vllm or scripted")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ConfigurationError(f"logprobs_mode={self.logprobs_mode!r}: must be 'raw' or 'processed'")
        if self.drain_policy not in ("wait", "pause"):
            raise ConfigurationError(f"drain_policy={self.drain_policy!r}: must be 'wait' or 'pause'")
        if self.train_concurrently not in ("off", "on", "auto"):
            raise ConfigurationError(f"train_concurrently={self.train_concurrently!r}: must be 'off', 'on' or 'auto'")
        _positive("drain_timeout_s", self.drain_timeout_s)
        _positive("close_timeout_s", self.close_timeout_s)
        _positive("max_num_seqs", self.max_num_seqs, integer=True)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len, integer=True)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigurationError(f"dtype={self.dtype!r}: must be float32, bfloat16 or float16")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigurationError(f"seed={self.seed!r}: must be an integer")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigurationError(f"model={self.model!r}: must be 'tiny' or a local model directory")
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
