"""The torch trainer: Tinker training semantics on a Hugging Face causal LM.

Same methods as ``SimTrainer``; the engine calls them on the thread that
runs training (its compute thread with the sampler drained, or its training
lane beside sampling: ``EngineConfig.train_concurrently``):

* ``forward`` / ``forward_backward(data, loss_fn, thresholds)``: a Datum's
  ``model_input`` tokens are the inputs and ``loss_fn_inputs["target_tokens"]``
  the next-token target at each position (same length). The model runs on
  right-padded micro-batches (no mask is needed: causal attention never lets
  a real position see the padding after it), through the lean forward of
  ``rlengine.trainer.lean`` where the model allows (the HF forward's bits
  without its model-level overhead; ``forward_path`` says which and why),
  else its own HF forward; ``logp``
  of each target is ``log_softmax(logits)[target]``. Each loss is the one
  ``rlengine.trainer.losses.elementwise`` defines, which also returns
  ``d loss / d logp``; that is chained into the model with
  ``torch.autograd.backward(logp, dlogp)``. So there is one definition of
  every loss, shared with the sim trainer, and the torch trainer cannot drift
  from it. Datums that share a prefix of at least ``tree_min_prefix``
  tokens (a GRPO group's prompt, earlier turns sent as datums of their own)
  run as tree batches instead (``rlengine.trainer.tree``): each shared
  prefix once, the branches after it, one forward over the packed tokens
  with their own position ids and ``tree.tree_attention`` (each token
  attends to its ancestors only), each datum's logits read back by index;
  the backward pass sums the branches' gradients into the shared tokens, so
  losses, outputs and gradients are the flat ones up to float rounding. The reference policy's
  forward takes the same tree. Gradients accumulate across calls until
  ``optim_step``. With an entropy bonus (``LossSettings.entropy_coef``, see
  ``losses``) the entropy of each position's whole next-token distribution
  is computed from the same logits and ``-coef * mask * H`` joins the
  backward pass. With a KL penalty (``LossSettings.kl_coef``) a frozen copy
  of the initial weights, loaded from the model directory on first use,
  gives the reference logprobs (no graph) and ``kl_coef * mask * dKL/dlogp``
  joins ``dlogp``.
* ``optim_step(AdamParams)``: torch AdamW with the given hyperparameters,
  after global grad-norm clipping when ``grad_clip_norm > 0``.
* ``sampler_weights``: the parameters themselves, by HF name, for the
  backend's ``load_weights`` to copy (no disk, no extra copy here).
* ``save_state`` / ``load_state``: weights (``model.safetensors`` plus the
  model's config and tokenizer files, so the directory is itself a loadable
  model directory) and optimizer state with pending gradients
  (``optimizer.safetensors``); a resumed run takes a bit-identical next step.

Master weights and optimizer state are float32 whatever ``EngineConfig.dtype``
says; a lower dtype runs the forward under autocast. This module must not
touch the backend or engine state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlengine.backends.torch.runtime import (
    configure_threads,
    engine_args,
    load_causal_lm,
    pick_device,
    threads_share,
    torch_dtype,
)
from rlengine.backends.torch.sampling import processed_log_softmax
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.trainer.lean import LeanForward, lean_forward
from rlengine.trainer.losses import (
    SEQUENCE_LOSSES,
    TRANSFORM_INPUTS,
    as_settings,
    concat_inputs,
    concat_tokens,
    correction_weights,
    elementwise,
    loss_counts,
    mismatch_metrics,
    mismatch_sums,
    reference_kl,
    validate_data,
)
from rlengine.trainer.tree import TreeBatch, pack, tree_attention, tree_groups
from rlengine.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepResponse, TensorData

__all__ = ["TorchTrainer", "build"]

_WEIGHTS_FILE = "model.safetensors"
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FORMAT = "rlengine-torch-trainer-1"
# Files copied next to the saved weights so the state directory loads as a model.
_MODEL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")
_OPT_KEYS = ("step", "exp_avg", "exp_avg_sq")
_FLAT_ATTENTION = "sdpa"
"""The attention implementation of the trainer's models (set explicitly: the tree forward restores it)."""
_TREE_ATTENTION = "rlengine_tree"
"""The name ``tree.tree_attention`` is registered under in transformers' attention interfaces."""


def _register_tree_attention() -> None:
    """Register ``tree_attention`` with transformers (idempotent): as the attention function, and
    a mask function that builds nothing, since the tree batch is the mask."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(_TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(_TREE_ATTENTION, lambda *args, **kwargs: None)


def _load_model(model_path: str, device: torch.device) -> Any:
    model = load_causal_lm(model_path, device, torch.float32)
    model.set_attn_implementation(_FLAT_ATTENTION)
    # Eval mode: no dropout, so a forward is a deterministic function of the
    # weights (autograd does not care about the mode).
    model.eval()
    return model


@contextlib.contextmanager
def _tree_attention_in(model: Any) -> Iterator[None]:
    """Run ``model``'s forward passes with ``tree_attention``, then restore ``_FLAT_ATTENTION``
    (the backward pass does not look the implementation up again)."""
    model.set_attn_implementation(_TREE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(_FLAT_ATTENTION)


class TorchTrainer:
    """Tinker-style trainer over an HF causal LM; see the module docstring.

    Why one class: the forward passes, the losses chained into them, the optimizer step and
    the state files all work on one model, its parameters by name and the optimizer over
    them; the LoRA and FSDP2 trainers subclass it and override parts of that one state.
    """

    name = "torch"

    def __init__(self, model_path: str, *, device: torch.device | None = None,
                 compute_dtype: torch.dtype = torch.float32, max_len: int | None = None,
                 micro_batch_tokens: int = 8192, tree_min_prefix: int = 64, threads_share: int = 1) -> None:
        self.threads = configure_threads(threads_share)
        self.device = device or torch.device("cpu")
        self.model_path = model_path
        self.compute_dtype = compute_dtype
        self.model = _load_model(model_path, self.device)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.max_len = int(max_len or limit or 0)
        if self.max_len <= 0:
            raise ConfigurationError(f"model={model_path!r}: no max_position_embeddings; set max_model_len")
        self.micro_batch_tokens = micro_batch_tokens
        self.tree_min_prefix = tree_min_prefix
        if tree_min_prefix:
            _register_tree_attention()
        self.named_params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(list(self.named_params.values()), lr=AdamParams().learning_rate,
                                           fused=True)
        self._reference: Any = None
        """The reference policy of a KL penalty (``losses``), loaded on first use."""
        self._lean: LeanForward | None = None
        self._forward_path: str | None = None

    @property
    def forward_path(self) -> str:
        """How the flat forward runs: ``"lean"`` (``rlengine.trainer.lean``, exactly HF's numbers) or
        ``"hf: <why not lean>"``. Decided once, on first use: a subclass that wraps or shards the
        model (LoRA, FSDP2) has done so by then, and the checks see it."""
        if self._forward_path is None:
            self._lean, self._forward_path = lean_forward(self.model, _FLAT_ATTENTION)
        return self._forward_path

    # -- forward passes ---------------------------------------------------------------

    def _micro_batches(self, data: list[Datum]) -> list[list[int]]:
        """Datum indices in order, grouped so that padded tokens stay within budget (the flat path)."""
        groups: list[list[int]] = []
        longest = 0
        for i, datum in enumerate(data):
            n = datum.model_input.length
            if groups and max(longest, n) * (len(groups[-1]) + 1) <= self.micro_batch_tokens:
                groups[-1].append(i)
                longest = max(longest, n)
            else:
                groups.append([i])
                longest = n
        return groups

    def _plan(self, data: list[Datum]) -> list[tuple[list[int], TreeBatch | None]]:
        """Micro-batches: datum indices and their tree batch (``tree``), or None for the flat
        padded forward. Tree batches when some datums share at least ``tree_min_prefix``
        leading tokens (0: never), each within ``micro_batch_tokens`` packed tokens;
        otherwise ``_micro_batches``, all flat."""
        # A shared prefix of ``tree_min_prefix`` tokens needs two datums at least that long (the
        # search for one cost a flat batch of short datums a third of a millisecond).
        if self.tree_min_prefix and sum(d.model_input.length >= self.tree_min_prefix for d in data) > 1:
            seqs = [d.model_input.to_numpy() for d in data]
            groups = tree_groups(seqs, self.tree_min_prefix, self.micro_batch_tokens)
            if groups is not None:
                return [(g, pack([seqs[i] for i in g], self.tree_min_prefix)) for g in groups]
        return [(group, None) for group in self._micro_batches(data)]

    def _reference_logprobs(self, data: list[Datum], tree: TreeBatch | None) -> np.ndarray:
        """``logp`` of every target under the reference policy: the model's initial weights,
        loaded from its directory on first use and never trained (float32, no graph)."""
        if self._reference is None:
            self._reference = _load_model(self.model_path, self.device)
            self._reference.requires_grad_(False)
        with torch.no_grad():
            logp, _ = self._target_logprobs(data, entropy=False, model=self._reference, tree=tree)
        return logp.cpu().numpy()

    def _target_logprobs(self, data: list[Datum], entropy: bool, model: Any = None,
                         tree: TreeBatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logp`` of every target, datums concatenated in order (float32, with graph),
        and with ``entropy`` the entropy of the next-token distribution at each position;
        ``model`` None: the trained one; ``tree``: the datums' tree batch, one packed forward."""
        model = model or self.model
        targets = torch.from_numpy(concat_inputs(data, "target_tokens")).to(self.device)
        autocast = self.compute_dtype != torch.float32
        if tree is None:
            lengths = np.array([d.model_input.length for d in data])
            # Where the datums' tokens go in the right-padded [len(data), n] batch: a boolean mask
            # fills in row-major order, which is the datums' concatenated order.
            real = np.arange(lengths.max()) < lengths[:, None]
            ids_np = np.zeros(real.shape, dtype=np.int64)
            ids_np[real] = concat_tokens(data)
            ids = torch.from_numpy(ids_np).to(self.device)
            lean = self._lean if model is self.model and self.forward_path == "lean" else None
            with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
                logits = lean(ids) if lean is not None else model(input_ids=ids).logits
            # The logits row of each datum token, row-major over the padded batch.
            rows = torch.from_numpy(np.flatnonzero(real))
        else:
            ids = torch.from_numpy(tree.tokens)[None].to(self.device)
            positions = torch.from_numpy(tree.positions)[None].to(self.device)
            with _tree_attention_in(model), \
                    torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
                logits = model(input_ids=ids, position_ids=positions, use_cache=False,
                               rlengine_tree=tree.attention(self.device)).logits
            rows = torch.from_numpy(tree.index)
        logits = logits.float().reshape(-1, logits.shape[-1])
        rows = rows.to(self.device)
        norm = logits.logsumexp(-1)
        logp = logits[rows, targets] - norm[rows]
        transform = self._transform(data)
        if transform is not None:
            # Tokens with a sampling transform: the logprob under it (``losses``), target kept.
            where, temperature, top_k, top_p = transform
            lp = processed_log_softmax(logits[rows[where]], temperature, top_k, top_p, keep=targets[where])
            logp = logp.index_put((where,), lp.gather(-1, targets[where][:, None]).squeeze(-1))
        ent = None
        if entropy:
            # H = logsumexp(z) - sum softmax(z) * z, without materialising log_softmax.
            ent = (norm - (logits.softmax(-1) * logits).sum(-1))[rows]
        return logp, ent

    def _transform(self, data: list[Datum]) -> tuple[torch.Tensor, ...] | None:
        """The token positions (datums concatenated) whose ``temperature`` / ``top_k`` /
        ``top_p`` inputs ask for a transform, and those values there; None if none do."""
        if not any(key in d.loss_fn_inputs for d in data for key in TRANSFORM_INPUTS):
            return None
        values = {}
        for key, default in (("temperature", 1.0), ("top_k", 0.0), ("top_p", 1.0)):
            values[key] = np.concatenate([
                d.loss_fn_inputs[key].to_numpy().astype(np.float32) if key in d.loss_fn_inputs
                else np.full(d.model_input.length, default, dtype=np.float32) for d in data])
        top_k = values["top_k"]
        top_k = np.where(top_k <= 0, self.vocab_size, np.minimum(top_k, self.vocab_size))
        active = (values["temperature"] != 1.0) | (top_k < self.vocab_size) | (values["top_p"] < 1.0)
        where = np.flatnonzero(active)
        if not where.size:
            return None
        return (torch.from_numpy(where).to(self.device),
                torch.from_numpy(values["temperature"][where]).to(self.device),
                torch.from_numpy(top_k[where].astype(np.int64)).to(self.device),
                torch.from_numpy(values["top_p"][where]).to(self.device))

    def _run(self, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...],
             backward: bool) -> ForwardBackwardOutput:
        settings = as_settings(thresholds)
        validate_data(data, loss_fn, settings.config(loss_fn), self.vocab_size, self.max_len)
        coef = settings.entropy_coef
        outputs: list[dict[str, TensorData]] = [{} for _ in data]
        total = 0.0
        entropy_total = kl_total = 0.0
        corrected: Counter[str] = Counter()
        mismatch: list[dict[str, float]] = []
        for group, tree in self._plan(data):
            batch = [data[i] for i in group]
            with torch.set_grad_enabled(backward):
                logp, ent = self._target_logprobs(batch, entropy=coef > 0, tree=tree)
            logp_np = logp.detach().cpu().numpy()
            ref_np = self._reference_logprobs(batch, tree) if settings.kl_coef is not None else None
            offsets = np.cumsum([0, *(d.model_input.length for d in batch)]).tolist()
            # Elementwise losses and token-level corrections take the micro-batch's tokens at once;
            # gspo, stable_reinforce and the geometric mask are per sequence, and datums with other
            # inputs than their neighbours' cannot be stacked: those go datum by datum.
            whole = (loss_fn not in SEQUENCE_LOSSES and settings.correction("geo_mask_low") is None
                     and len({frozenset(d.loss_fn_inputs) for d in batch}) == 1)
            parts = [list(range(len(batch)))] if whole else [[j] for j in range(len(batch))]
            grads, masks = [], []
            for part in parts:
                start, end = offsets[part[0]], offsets[part[-1] + 1]
                datums = [batch[j] for j in part]
                inputs = {key: concat_inputs(datums, key) for key in datums[0].loss_fn_inputs}
                lp = logp_np[start:end]
                loss, dlogp = elementwise(loss_fn, lp, inputs, settings)
                corrected.update(loss_counts(loss_fn, lp, inputs, settings))
                if (sums := mismatch_sums(lp, inputs)):
                    mismatch.append(sums)
                if settings.corrections:  # without, every weight is 1: nothing to multiply
                    weights, counts = correction_weights(inputs, settings)
                    loss, dlogp = loss * weights, dlogp * weights
                    for key, value in counts.items():
                        corrected[key] += value
                total += float(loss.sum())
                mask = inputs["mask"] if "mask" in inputs else np.ones(end - start)
                if ref_np is not None:
                    kl, dkl = reference_kl(lp, ref_np[start:end], settings.kl_estimator)
                    kl_total += float((mask * kl).sum())
                    dlogp = dlogp + settings.kl_coef * mask * dkl
                grads.append(dlogp)
                masks.append(mask)
                # Each datum's outputs are slices of the part's float32 bytes (what
                # ``TensorData.from_numpy`` of its own slice would hold, without a conversion each).
                lp_raw, loss_raw = lp.tobytes(), loss.astype(np.float32).tobytes()
                for j in part:
                    a, b = offsets[j] - start, offsets[j + 1] - start
                    outputs[group[j]] = {
                        "logprobs": TensorData(data_raw=lp_raw[4 * a:4 * b], dtype="float32", shape=[b - a]),
                        "elementwise_loss": TensorData(data_raw=loss_raw[4 * a:4 * b], dtype="float32",
                                                       shape=[b - a])}
            weights = None
            if ent is not None:
                weights = torch.from_numpy(np.concatenate(masks).astype(np.float32)).to(self.device)
                entropy_total += float((ent.detach() * weights).sum())
            if backward:
                grad = torch.from_numpy(np.concatenate(grads).astype(np.float32)).to(self.device)
                if ent is None:
                    torch.autograd.backward(logp, grad)
                else:
                    torch.autograd.backward([logp, ent], [grad, -coef * weights])
        metrics = {"loss:sum": total}
        if coef:
            metrics["entropy:sum"] = entropy_total
        if settings.kl_coef is not None:
            metrics["kl_ref:sum"] = kl_total
        metrics |= {f"{key}:sum": value for key, value in corrected.items()}
        metrics |= mismatch_metrics(mismatch)
        return ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics)

    def forward(self, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...]) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, thresholds, backward=False)

    def forward_backward(self, data: list[Datum], loss_fn: str,
                         thresholds: tuple[float, ...]) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, thresholds, backward=True)

    # -- optimizer -------------------------------------------------------------------------

    def optim_step(self, params: AdamParams) -> OptimStepResponse:
        for group in self.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        total = self._grad_norm()
        norm = float(total) if total is not None else 0.0
        if params.grad_clip_norm > 0 and total is not None:
            torch.nn.utils.clip_grads_with_norm_(self.named_params.values(), params.grad_clip_norm, total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return OptimStepResponse(metrics={"grad_norm": norm, "learning_rate": params.learning_rate})

    def _grad_norm(self) -> torch.Tensor | None:
        """The global L2 norm of the accumulated gradients (None: none)."""
        grads = [p.grad for p in self.named_params.values() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    def sampler_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self.named_params.items()]

    # -- state -----------------------------------------------------------------------------

    def save_state(self, path: str, include_optimizer: bool = True) -> str:
        os.makedirs(path, exist_ok=True)
        weights = {name: p.detach().contiguous().cpu() for name, p in self.named_params.items()}
        save_file(weights, os.path.join(path, _WEIGHTS_FILE), metadata={"format": "pt"})
        self._write_model_files(path)
        if include_optimizer:
            self._save_optimizer(path)
        return path

    def _write_model_files(self, path: str) -> None:
        """The model's config and tokenizer files into ``path``, beside its saved weights (so the
        directory is itself a loadable model directory)."""
        self.model.config.save_pretrained(path)
        for name in _MODEL_FILES:
            src = os.path.join(self.model_path, name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, name)):
                shutil.copyfile(src, os.path.join(path, name))

    def _save_optimizer(self, path: str) -> None:
        """The optimizer's state and the accumulated gradients, per parameter, into ``path``."""
        tensors = {}
        for name, p in self.named_params.items():
            for key, value in self.optimizer.state.get(p, {}).items():
                tensors[f"{key}/{name}"] = value.detach().contiguous().cpu()
            if p.grad is not None:
                tensors[f"grad/{name}"] = p.grad.detach().contiguous().cpu()
        save_file(tensors, os.path.join(path, _OPTIMIZER_FILE), metadata={"format": _STATE_FORMAT})

    def _read_weights(self, path: str) -> dict[str, torch.Tensor]:
        file = os.path.join(path, _WEIGHTS_FILE)
        if not os.path.isfile(file):
            raise InvalidRequest("path", path, f"holds no {_WEIGHTS_FILE} (not a saved torch trainer state)")
        return self._matching(path, load_file(file), "weights", "differing names")

    def _matching(self, path: str, weights: dict[str, torch.Tensor], what: str,
                  differing: str) -> dict[str, torch.Tensor]:
        """``weights`` if they hold exactly this trainer's parameters, shape for shape; ``what``
        and ``differing`` word the error otherwise."""
        if set(weights) != set(self.named_params):
            diff = sorted(set(weights) ^ set(self.named_params))
            raise InvalidRequest("path", path, f"{what} do not match this model ({differing}: {diff[:5]})")
        for name, tensor in weights.items():
            if tensor.shape != self.named_params[name].shape:
                raise InvalidRequest("path", path, f"{name} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(self.named_params[name].shape)}")
        return weights

    def _read_optimizer(self, path: str) -> dict[str, torch.Tensor]:
        file = os.path.join(path, _OPTIMIZER_FILE)
        if not os.path.isfile(file):
            raise InvalidRequest("path", path, "was saved without optimizer state (include_optimizer=False)")
        tensors = load_file(file)
        for key, tensor in tensors.items():
            kind, _, name = key.partition("/")
            param = self.named_params.get(name)
            if kind not in (*_OPT_KEYS, "grad") or param is None:
                raise InvalidRequest("path", path, f"optimizer state has unknown entry {key!r}")
            if kind != "step" and tensor.shape != param.shape:
                raise InvalidRequest("path", path, f"optimizer entry {key!r} has shape {tuple(tensor.shape)}")
        return tensors

    def load_state(self, path: str, include_optimizer: bool = True) -> str:
        """Load weights, and with ``include_optimizer`` the optimizer state and pending
        gradients; without it the optimizer starts fresh. Everything is checked
        before anything changes."""
        weights = self._read_weights(path)
        opt = self._read_optimizer(path) if include_optimizer else {}
        with torch.no_grad():
            for name, tensor in weights.items():
                self.named_params[name].copy_(tensor)
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        for name, p in self.named_params.items():
            state = {}
            for key in _OPT_KEYS:
                tensor = opt.get(f"{key}/{name}")
                if tensor is not None:
                    # AdamW keeps ``step`` as a CPU float tensor; the moments live with the parameter.
                    state[key] = tensor if key == "step" else tensor.to(p.device)
            if state:
                self.optimizer.state[p] = state
            grad = opt.get(f"grad/{name}")
            if grad is not None:
                p.grad = grad.to(p.device)
        return path


def build(config: Any, model_path: str | None) -> TorchTrainer:
    """Registry entry point (``rlengine.backends.SPECS``); runs on the compute thread."""
    if model_path is None:
        raise ConfigurationError("backend='torch' needs a model directory (model='tiny' or a local path)")
    args = engine_args(config)
    trainer = TorchTrainer(model_path, device=pick_device(config), compute_dtype=torch_dtype(config),
                           max_len=config.max_model_len, micro_batch_tokens=args["micro_batch_tokens"],
                           tree_min_prefix=args["tree_min_prefix"], threads_share=threads_share(config))
    trainer.forward_path  # noqa: B018 - decided here, at load, on the thread that trains
    return trainer


def build_beside_scripted(config: Any, model_path: str | None) -> TorchTrainer:
    """Registry entry point of the trainer beside the scripted backend: the torch trainer on the
    same model directory (``engine_args["script"]`` is the backend's, not the trainer's)."""
    given = dict(config.engine_args or {})
    given.pop("script", None)
    return build(msgspec.structs.replace(config, engine_args=given), model_path)
