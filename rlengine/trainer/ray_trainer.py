"""The sharded trainer: ``placement.trainer_workers`` Ray actors, one FSDP2 group, one trainer to the engine.

``ShardedTrainer`` has the trainer methods the engine's clients call
(``forward``, ``forward_backward``, ``optim_step``, ``sampler_weights``,
``save_state``, ``load_state``), on its compute thread as always. Each
``TrainerWorker`` actor runs one rank (``rlengine.trainer.sharded``):

* ``forward`` / ``forward_backward`` split the batch into contiguous parts
  of about equal token counts, one per worker (a worker may get none), run
  them at once and put the outputs back in order; metrics are reduced by
  their suffix (``:sum`` added, ``:min`` / ``:max`` taken), as the Tinker SDK
  does across its chunks. The losses are the torch trainer's, unchanged.
* ``optim_step`` steps every worker (each its shard of the AdamW state).
* ``sampler_weights`` has rank 0 pack the gathered weights into buckets and
  put them in the object store: the engine's install hands those references
  to the sampler replicas (``ray_replicas``) without the driver touching the
  bytes (``PackedWeights``).
* ``save_state`` / ``load_state``: torch's distributed checkpoint on a path
  every worker can reach (one node here; a shared filesystem across nodes).

The rendezvous is rank 0's node address and a free port there. Every call
waits at most ``placement.train_timeout_s``; a worker that dies or a call
that times out fails that call with ``TrainerLost`` and the trainer with it
(the group cannot continue without the rank); later calls fail at once with
the same error. The engine keeps sampling; a run resumes from its last
checkpoint. Requests and outputs cross as msgpack bytes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import msgspec
import ray

from rlengine.backends.ray_replicas import PackedWeights, actor_options
from rlengine.backends.weight_buckets import pack
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError, TrainerLost
from rlengine.trainer.losses import LossSettings, as_settings
from rlengine.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepResponse

__all__ = ["ShardedTrainer", "TrainerWorker"]

_encode = msgspec.msgpack.Encoder()
_datums = msgspec.msgpack.Decoder(list[Datum])
_output = msgspec.msgpack.Decoder(ForwardBackwardOutput)
_optim = msgspec.msgpack.Decoder(OptimStepResponse)
_settings = msgspec.msgpack.Decoder(LossSettings)


class TrainerWorker:
    """The actor of one rank."""

    def __init__(self, config_blob: bytes, model_path: str, rank: int, world: int) -> None:
        self.config = msgspec.msgpack.decode(config_blob, type=EngineConfig)
        self.model_path = model_path
        self.rank, self.world = rank, world
        self.trainer: Any = None

    def rendezvous(self) -> str:
        """An init method on this node: its address and a port free now (rank 0 only)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str) -> int:
        """Load the model, join the group and shard it; returns this worker's pid."""
        from rlengine.trainer.sharded import build_shard  # torch: in the worker only

        self.trainer = build_shard(self.config, self.model_path, rank=self.rank, world=self.world,
                                   init_method=init_method)
        return os.getpid()

    def run(self, method: str, blob: bytes, loss_fn: str, settings: bytes) -> bytes:
        data = _datums.decode(blob) if blob else []
        return _encode.encode(getattr(self.trainer, method)(data, loss_fn, _settings.decode(settings)))

    def optim_step(self, blob: bytes) -> bytes:
        return _encode.encode(self.trainer.optim_step(msgspec.msgpack.decode(blob, type=AdamParams)))

    def packed(self, what: str, bucket_bytes: int) -> tuple[list[Any], int]:
        """``sampler_weights`` or ``gradients``, gathered; rank 0 puts the buckets in the object
        store and returns their references and size."""
        named = getattr(self.trainer, what)()
        if self.rank != 0:
            return [], 0
        blobs = pack(named, bucket_bytes)
        return [ray.put(blob) for blob in blobs], sum(map(len, blobs))

    def save_state(self, path: str, include_optimizer: bool) -> str:
        return self.trainer.save_state(path, include_optimizer)

    def load_state(self, path: str, include_optimizer: bool) -> str:
        return self.trainer.load_state(path, include_optimizer)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()


def split(data: list[Datum], parts: int) -> list[list[Datum]]:
    """``data`` in ``parts`` contiguous runs of about equal token counts (some may be empty)."""
    total = sum(d.model_input.length for d in data)
    out: list[list[Datum]] = [[] for _ in range(parts)]
    seen = 0
    for datum in data:
        n = datum.model_input.length
        # The part whose share of the tokens this datum's midpoint falls in.
        index = min(parts - 1, int((seen + n / 2) * parts / total)) if total else 0
        out[index].append(datum)
        seen += n
    return out


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-part metrics reduced by suffix: ``:sum`` added, ``:min`` / ``:max`` taken."""
    merged: dict[str, float] = {}
    for metrics in parts:
        for key, value in metrics.items():
            if key not in merged:
                merged[key] = value
            elif key.endswith(":sum"):
                merged[key] += value
            elif key.endswith(":min"):
                merged[key] = min(merged[key], value)
            elif key.endswith(":max"):
                merged[key] = max(merged[key], value)
            else:
                raise ConfigurationError(f"sharded trainer: metric {key!r} has no reduction (:sum, :min, :max)")
    return merged


class ShardedTrainer:
    """The engine's trainer for ``placement.trainer_workers > 1``; see the module docstring."""

    name = "torch-fsdp2"

    def __init__(self, config: EngineConfig, model_path: str | None) -> None:
        placement = config.placement
        if model_path is None:
            raise ConfigurationError("placement.trainer_workers > 1: the sharded trainer is the torch trainer "
                                     "(backend torch or vllm), which needs a model directory")
        self.placement = placement
        self.world = placement.trainer_workers
        self._dead: TrainerLost | None = None
        actor = ray.remote(TrainerWorker).options(**actor_options(placement.trainer_resources))
        blob = msgspec.msgpack.encode(config)
        self._workers = [actor.remote(blob, model_path, rank, self.world) for rank in range(self.world)]
        start = placement.start_timeout_s
        init_method = self._get(self._workers[0].rendezvous.remote(), "rendezvous", start, "start_timeout_s")
        self.pids = self._get([w.join.remote(init_method) for w in self._workers], "start", start, "start_timeout_s")

    def _get(self, refs: Any, what: str, timeout: float | None = None, setting: str = "train_timeout_s") -> Any:
        if self._dead is not None:
            raise self._dead
        timeout = self.placement.train_timeout_s if timeout is None else timeout
        try:
            return ray.get(refs, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - any failure of a rank ends the group
            why = (f"did not answer within {setting}={timeout} (a worker still waiting for its resources "
                   f"{dict(self.placement.trainer_resources)} counts too)"
                   if isinstance(exc, ray.exceptions.GetTimeoutError) else f"failed: {type(exc).__name__}: {exc}")
            self._dead = TrainerLost(f"sharded trainer ({self.world} workers): {what} {why}; the trainer is "
                                     "gone (resume from a checkpoint)")
            self.close()
            raise self._dead from None

    def _run(self, method: str, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...]
             ) -> ForwardBackwardOutput:
        parts = split(data, self.world)
        settings = _encode.encode(as_settings(thresholds))
        refs = [w.run.remote(method, _encode.encode(part) if part else b"", loss_fn, settings)
                for w, part in zip(self._workers, parts)]
        outs = [_output.decode(blob) for blob in self._get(refs, method)]
        return ForwardBackwardOutput(loss_fn_output_type=next((o.loss_fn_output_type for o in outs if o.loss_fn_outputs),
                                                               "ArrayRecord"),
                                     loss_fn_outputs=[r for o in outs for r in o.loss_fn_outputs],
                                     metrics=merge_metrics([o.metrics for o in outs if o.loss_fn_outputs]))

    def forward(self, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...]) -> ForwardBackwardOutput:
        return self._run("forward", data, loss_fn, thresholds)

    def forward_backward(self, data: list[Datum], loss_fn: str,
                         thresholds: tuple[float, ...]) -> ForwardBackwardOutput:
        return self._run("forward_backward", data, loss_fn, thresholds)

    def optim_step(self, params: AdamParams) -> OptimStepResponse:
        blob = msgspec.msgpack.encode(params)
        return _optim.decode(self._get([w.optim_step.remote(blob) for w in self._workers], "optim_step")[0])

    def _packed(self, what: str) -> PackedWeights:
        answers = self._get([w.packed.remote(what, self.placement.sync_bucket_bytes) for w in self._workers], what)
        return PackedWeights(*answers[0])

    def sampler_weights(self) -> PackedWeights:
        """The full weights as buckets in the object store (rank 0 packed them)."""
        return self._packed("sampler_weights")

    def gradients(self) -> PackedWeights:
        """The accumulated gradients in full, as buckets (tests and diagnostics)."""
        return self._packed("gradients")

    def save_state(self, path: str, include_optimizer: bool = True) -> str:
        self._get([w.save_state.remote(path, include_optimizer) for w in self._workers], "save_state")
        return path

    def load_state(self, path: str, include_optimizer: bool = True) -> str:
        self._get([w.load_state.remote(path, include_optimizer) for w in self._workers], "load_state")
        return path

    def kill_worker(self, rank: int) -> None:
        """Kill worker ``rank``'s actor, as a crash would (fault injection for tests and drills)."""
        ray.kill(self._workers[rank], no_restart=True)

    def close(self) -> None:
        """End every worker's process (the engine calls it when it closes)."""
        for worker in self._workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)


def build(config: EngineConfig, model_path: str | None) -> ShardedTrainer:
    """The engine's trainer entry point for ``placement.trainer_workers > 1``."""
    return ShardedTrainer(config, model_path)
