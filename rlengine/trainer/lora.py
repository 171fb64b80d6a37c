"""LoRA training (peft) with the torch trainer's Tinker semantics; merged weights for the sampler.

``LoraTrainer`` is a ``TorchTrainer`` whose trainable parameters are LoRA
adapters injected by peft into the attention projections (``train_attn``),
the MLP projections (``train_mlp``) and the unembedding (``train_unembed``,
``lm_head``) of a Llama-style HF causal LM. The base weights are frozen.
Everything else is the torch trainer's: the same forward, the same loss
definitions chained through ``logp``, the same AdamW step over the trainable
parameters (the adapters), the same optimizer state format.

The sampler never sees an adapter: ``sampler_weights`` returns the full set
of weights by their HF names with each adapted weight merged,
``W + (B @ A) * alpha / rank``, so any backend installs them through the
engine's versioned gate exactly like a full fine-tuning install.
``sampler_weights(adapter)`` merges a saved adapter snapshot instead of the
live one (``adapter_state`` takes such a snapshot), which lets a server keep
old sampler versions around as a few small adapters rather than full copies.

State directories hold ``adapter.safetensors`` (the adapter tensors by
parameter name), ``lora.json`` (the LoRA settings and the base model
directory) and, with the optimizer, ``optimizer.safetensors`` in the torch
trainer's format. A state directory is not a model directory (no
``config.json``), so it can never be mistaken for one.

Adapter initialisation follows peft (A: Kaiming-uniform, B: zeros), so a new
adapter leaves the model unchanged; ``LoraSpec.seed`` makes it reproducible.
Like every trainer this runs on the engine's compute thread only and never
touches the backend or engine state.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Iterable
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file, save_file

from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.trainer.torch_trainer import TorchTrainer
from rlengine.types import AdamParams

__all__ = ["LoraSpec", "LoraTrainer", "build", "merge_adapter", "read_adapter", "read_lora_spec"]

ADAPTER_FILE = "adapter.safetensors"
SPEC_FILE = "lora.json"
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FORMAT = "rlengine-lora-1"
_ADAPTER = "default"
# Module names of Llama-style decoders (the architectures the torch backend runs).
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_UNEMBED = ("lm_head",)


class LoraSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Which LoRA adapters to train (Tinker's ``LoraConfig`` plus the scale)."""

    rank: int
    alpha: float = 32.0
    """The update is scaled by ``alpha / rank`` (Tinker's default alpha is 32)."""
    seed: int | None = None
    """Seed of the adapter initialisation; None draws one (recorded in saved state)."""
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidRequest("lora_config.rank", self.rank, "must be an integer >= 1 (0 means full fine-tuning)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise InvalidRequest("lora_config.alpha", self.alpha, "must be a number > 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest("lora_config.seed", self.seed, "must be an integer or None")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise InvalidRequest("lora_config", "train_attn=train_mlp=train_unembed=False",
                                 "at least one of them must be True")

    def target_modules(self) -> list[str]:
        return [*(_ATTN if self.train_attn else ()), *(_MLP if self.train_mlp else ()),
                *(_UNEMBED if self.train_unembed else ())]


@torch.no_grad()
def merge_adapter(base: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor],
                  lora: LoraSpec) -> list[tuple[str, torch.Tensor]]:
    """``base`` weights with the adapter merged: ``W + (B @ A) * alpha / rank`` where adapted.

    ``adapter`` maps the trainer's parameter names (``<module>.lora_A.default.weight``)
    to tensors, as ``LoraTrainer.adapter_state`` or a saved state holds them.
    Weights without an adapter are passed through as they are.
    """
    scaling = float(lora.alpha) / lora.rank
    out = []
    for name, weight in base:
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        a = adapter.get(f"{module}.lora_A.{_ADAPTER}.weight") if module is not None else None
        if a is None:
            out.append((name, weight))
            continue
        b = adapter[f"{module}.lora_B.{_ADAPTER}.weight"]
        out.append((name, weight + (b.to(weight.device) @ a.to(weight.device)) * scaling))
    return out


def read_adapter(path: str) -> tuple[LoraSpec, dict[str, torch.Tensor], str]:
    """``(spec, adapter tensors, base model directory)`` of a LoRA state directory."""
    spec = read_lora_spec(path)
    file = os.path.join(path, ADAPTER_FILE)
    if spec is None or not os.path.isfile(file):
        raise InvalidRequest("path", path, f"holds no LoRA state ({SPEC_FILE} and {ADAPTER_FILE})")
    with open(os.path.join(path, SPEC_FILE), encoding="utf-8") as f:
        base = json.load(f)["base_model"]
    return spec, load_file(file), base


def read_lora_spec(path: str) -> LoraSpec | None:
    """The ``LoraSpec`` a LoRA state directory was saved with; None if ``path`` holds no LoRA state."""
    file = os.path.join(path, SPEC_FILE)
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != _STATE_FORMAT:
        raise InvalidRequest("path", path, f"{SPEC_FILE} has format {meta.get('format')!r}, "
                             f"expected {_STATE_FORMAT!r}")
    return msgspec.convert(meta["lora"], LoraSpec)


class LoraTrainer(TorchTrainer):
    """Trains LoRA adapters of a frozen base model; see the module docstring."""

    name = "lora"

    def __init__(self, model_path: str, lora: LoraSpec, *, device: torch.device | None = None,
                 compute_dtype: torch.dtype = torch.float32, max_len: int | None = None,
                 micro_batch_tokens: int = 8192, tree_min_prefix: int = 64) -> None:
        super().__init__(model_path, device=device, compute_dtype=compute_dtype, max_len=max_len,
                         micro_batch_tokens=micro_batch_tokens, tree_min_prefix=tree_min_prefix)
        from peft import LoraConfig, get_peft_model

        base = self.model
        if lora.train_unembed and getattr(base.config, "tie_word_embeddings", False):
            # The sampler holds one tensor for the embedding and the unembedding:
            # merging an lm_head update would change the input embeddings too.
            raise ConfigurationError(f"model={model_path!r} ties its input and output embeddings: "
                                     "train_unembed=True is not supported by rlengine for it")
        seed = lora.seed if lora.seed is not None else random.SystemRandom().getrandbits(63)
        self.lora = msgspec.structs.replace(lora, seed=seed)
        base.requires_grad_(False)
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules(),
                            lora_dropout=0.0, bias="none")
        # A private RNG stream seeded by the spec: the same spec gives the same
        # adapters, and building one never moves the caller's RNG.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft reads a property transformers 5 deprecated; nothing to act on here.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(seed)
            try:
                self.model = get_peft_model(base, config, adapter_name=_ADAPTER)
            except ValueError as exc:
                raise ConfigurationError(f"model={model_path!r}: cannot add LoRA adapters to "
                                         f"{lora.target_modules()}: {exc}") from None
        self.model.eval()
        # peft injects the adapters into ``base`` itself, so names stay relative
        # to the HF model (``model.layers.0.self_attn.q_proj.lora_A.default.weight``).
        self.named_params = {n: p for n, p in base.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(list(self.named_params.values()), lr=AdamParams().learning_rate)
        self._base_weights = self._frozen(base)

    def _frozen(self, base: Any) -> list[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` of every frozen base weight (peft's ``.base_layer`` renamed away)."""
        return [(name.replace(".base_layer.", "."), param) for name, param in base.named_parameters()
                if ".lora_" not in name]

    # -- the sampler's view ------------------------------------------------------------

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter tensors (CPU), for ``sampler_weights(adapter)`` later."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.named_params.items()}

    def sampler_weights(self, adapter: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Every base weight by its HF name, with the adapter (live, or ``adapter``) merged in."""
        live = {n: p.detach() for n, p in self.named_params.items()} if adapter is None else adapter
        return merge_adapter(((n, p.detach()) for n, p in self._base_weights), live, self.lora)

    # -- state ---------------------------------------------------------------------------

    def save_state(self, path: str, include_optimizer: bool = True) -> str:
        os.makedirs(path, exist_ok=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in self.named_params.items()},
                  os.path.join(path, ADAPTER_FILE), metadata={"format": _STATE_FORMAT})
        with open(os.path.join(path, SPEC_FILE), "w", encoding="utf-8") as f:
            json.dump({"format": _STATE_FORMAT, "base_model": self.model_path,
                       "lora": msgspec.to_builtins(self.lora)}, f, indent=2, sort_keys=True)
        if include_optimizer:
            self._save_optimizer(path)
        return path

    def _read_weights(self, path: str) -> dict[str, torch.Tensor]:
        """The adapter tensors of a LoRA state directory, checked against this trainer's adapters."""
        spec = read_lora_spec(path)
        if spec is None or not os.path.isfile(os.path.join(path, ADAPTER_FILE)):
            raise InvalidRequest("path", path, f"holds no LoRA state ({SPEC_FILE} and {ADAPTER_FILE})")
        if (spec.rank, spec.target_modules()) != (self.lora.rank, self.lora.target_modules()):
            raise InvalidRequest("path", path, f"was saved with LoRA rank {spec.rank} on {spec.target_modules()}; "
                                 f"this model has rank {self.lora.rank} on {self.lora.target_modules()}")
        return self._matching(path, load_file(os.path.join(path, ADAPTER_FILE)), "adapter tensors", "differing")



def build(config: Any, model_path: str | None, lora: LoraSpec) -> LoraTrainer:
    """A ``LoraTrainer`` for an engine's model, with the engine's device, dtype and batch settings."""
    from rlengine.backends.torch.runtime import engine_args, pick_device, torch_dtype

    if model_path is None:
        raise ConfigurationError("LoRA training needs a model directory (model='tiny' or a local path)")
    args = engine_args(config)
    return LoraTrainer(model_path, lora, device=pick_device(config), compute_dtype=torch_dtype(config),
                       max_len=config.max_model_len, micro_batch_tokens=args["micro_batch_tokens"],
                       tree_min_prefix=args["tree_min_prefix"])
