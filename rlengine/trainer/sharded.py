"""One rank of the sharded torch trainer: ``TorchTrainer`` with its model under FSDP2.

``rlengine.trainer.ray_trainer`` runs N of these as Ray actors forming one
torch.distributed group (gloo on the CPU, NCCL on CUDA) and gives each a
contiguous part of every batch. Each rank holds its shard of every
parameter, gradient and optimizer moment (``fully_shard`` on every decoder
layer, then on the whole model); what it computes per datum is the
``TorchTrainer``'s own code, unchanged (losses, tree batches, corrections).

Collectives happen at fixed points only, so ranks with different numbers of
micro-batches (or none) cannot deadlock:

* a call starts by unsharding every FSDP module (one all-gather per module,
  on every rank); the parameters then stay unsharded through the call
  (``reshard_after_forward=False``, no reshard after backward), so the
  micro-batches' forwards and backwards issue no collective;
* gradient sync is off during them (they accumulate locally); a
  ``forward_backward`` ends with one zero-loss forward and backward on every
  rank with sync on, whose post-backward hooks reduce-scatter the
  accumulated gradients, summed (``set_force_sum_reduction_for_comms``,
  divide factor 1: Tinker's losses are sums over datums, so the sharded
  gradient is the single-process one);
* ``optim_step`` (the torch trainer's) reduces the gradient norm once (a DTensor norm);
  ``sampler_weights`` and ``gradients`` gather each full tensor on every rank.

State goes through torch's distributed checkpoint with the Hugging Face
storage (safetensors, no pickle): weights into ``path`` (per-rank shards and
a consolidated ``model-00001-of-00001.safetensors`` beside the model's config
and tokenizer, so the directory is a loadable model), optimizer moments and
pending gradients into ``path/optimizer``. Any world size loads them.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlengine.backends.torch.runtime import engine_args, pick_device, torch_dtype
from rlengine.errors import InvalidRequest
from rlengine.trainer.torch_trainer import TorchTrainer
from rlengine.types import AdamParams, Datum, ForwardBackwardOutput

__all__ = ["ShardTrainer", "build_shard"]

_OPTIMIZER_DIR = "optimizer"
_INDEX = "model.safetensors.index.json"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class ShardTrainer(TorchTrainer):
    """Rank ``rank`` of ``world``; see the module docstring. Every method is collective: all
    ranks call it, in the same order, each with its own part of the data."""

    name = "torch-fsdp2"

    def __init__(self, model_path: str, *, rank: int, world: int, init_method: str, timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        self.rank, self.world = rank, world
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=init_method,
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        for layer in self.model.model.layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(self.model, reshard_after_forward=False)
        self._fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in self._fsdp:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.named_params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(list(self.named_params.values()), lr=AdamParams().learning_rate)

    def _unshard(self) -> None:
        for module in self._fsdp:
            module.unshard()

    def _reshard(self) -> None:
        for module in self._fsdp:
            module.reshard()

    def _sync(self, enabled: bool) -> None:
        for module in self._fsdp:
            module.set_requires_gradient_sync(enabled, recurse=False)
            module.set_reshard_after_backward(enabled, recurse=False)

    def _run(self, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...],
             backward: bool) -> ForwardBackwardOutput:
        self._unshard()
        try:
            if backward:
                self._sync(False)
            out = super()._run(data, loss_fn, thresholds, backward) if data else ForwardBackwardOutput(
                loss_fn_output_type="ArrayRecord", loss_fn_outputs=[], metrics={})
            if backward:
                # Every rank, whatever its part: one zero-loss pass whose backward reduce-scatters.
                self._sync(True)
                ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
                (self.model(input_ids=ids).logits.sum() * 0.0).backward()
        finally:
            self._reshard()
        return out

    def _grad_norm(self) -> torch.Tensor | None:
        """The global norm over every rank's gradient shards (one all-reduce)."""
        total = super()._grad_norm()
        return None if total is None else _full(total)

    def sampler_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter in full (gathered on every rank)."""
        return [(name, _full(p.detach())) for name, p in self.named_params.items()]

    def gradients(self) -> list[tuple[str, torch.Tensor]]:
        """Every accumulated gradient in full (zeros where none), gathered on every rank."""
        return [(name, _full(p.grad) if p.grad is not None else torch.zeros(p.shape))
                for name, p in self.named_params.items()]

    # -- state -----------------------------------------------------------------------------

    def _optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's moments, step counts and pending gradients by name (DTensor shards)."""
        state: dict[str, torch.Tensor] = {}
        for name, p in self.named_params.items():
            held = self.optimizer.state.get(p)
            if held:
                state[f"step/{name}"] = held["step"].reshape(1)  # a 1-element tensor: DCP's HF storage skips scalars
                for key in _MOMENTS:
                    state[f"{key}/{name}"] = held[key]
            if p.grad is not None:
                state[f"grad/{name}"] = p.grad
        return state

    def _empty_optimizer_state(self, keys: set[str]) -> dict[str, torch.Tensor]:
        """Tensors to load the saved entries ``keys`` into, laid out like this rank's shards."""
        state: dict[str, torch.Tensor] = {}
        for name, p in self.named_params.items():
            if f"step/{name}" in keys:
                state[f"step/{name}"] = torch.zeros(1)
                for key in _MOMENTS:
                    state[f"{key}/{name}"] = torch.zeros_like(p)
            if f"grad/{name}" in keys:
                state[f"grad/{name}"] = torch.zeros_like(p)
        unknown = keys - set(state)
        if unknown:
            raise InvalidRequest("path", min(unknown), "optimizer state names a tensor this model lacks")
        return state

    def save_state(self, path: str, include_optimizer: bool = True) -> str:
        weights = {name: p.detach() for name, p in self.named_params.items()}
        dcp.save(weights, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True,
                                                                  enable_consolidation=True))
        if include_optimizer:
            dcp.save(self._optimizer_state(), storage_writer=HuggingFaceStorageWriter(
                os.path.join(path, _OPTIMIZER_DIR), save_distributed=True, enable_consolidation=True))
        if self.rank == 0:
            self._write_model_files(path)
        dist.barrier()
        return path

    def load_state(self, path: str, include_optimizer: bool = True) -> str:
        """Load what ``save_state`` wrote (at any world size); with ``include_optimizer`` the moments
        and pending gradients too, else the optimizer starts fresh."""
        if not os.path.isfile(os.path.join(path, _INDEX)):
            raise InvalidRequest("path", path, "holds no distributed checkpoint (model.safetensors.index.json)")
        optimizer_dir = os.path.join(path, _OPTIMIZER_DIR)
        if include_optimizer and not os.path.isfile(os.path.join(optimizer_dir, _INDEX)):
            raise InvalidRequest("path", path, "was saved without optimizer state (include_optimizer=False)")
        weights = {name: p.detach() for name, p in self.named_params.items()}
        dcp.load(weights, storage_reader=HuggingFaceStorageReader(path))
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        if include_optimizer:
            with open(os.path.join(optimizer_dir, _INDEX)) as f:
                keys = set(json.load(f)["weight_map"])
            state = self._empty_optimizer_state(keys)
            dcp.load(state, storage_reader=HuggingFaceStorageReader(optimizer_dir))
            for name, p in self.named_params.items():
                if f"step/{name}" in state:
                    self.optimizer.state[p] = {"step": state[f"step/{name}"].reshape(()),
                                               **{k: state[f"{k}/{name}"] for k in _MOMENTS}}
                if f"grad/{name}" in state:
                    p.grad = state[f"grad/{name}"]
        return path

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_shard(config: Any, model_path: str, *, rank: int, world: int, init_method: str) -> ShardTrainer:
    """Rank ``rank`` of the sharded trainer of ``config`` (what ``trainer.torch_trainer.build``
    builds, sharded); the group waits ``placement.train_timeout_s`` for its collectives."""
    args = engine_args(config)
    return ShardTrainer(model_path, rank=rank, world=world, init_method=init_method,
                        timeout_s=config.placement.train_timeout_s, device=pick_device(config),
                        compute_dtype=torch_dtype(config), max_len=config.max_model_len,
                        micro_batch_tokens=args["micro_batch_tokens"], tree_min_prefix=args["tree_min_prefix"])
