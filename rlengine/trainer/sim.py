"""The sim trainer: Tinker training semantics on the sim model, in numpy.

The sim model is one tensor ``theta`` of unigram logits (see
``rlengine.backends.sim``): ``logp(token) = log_softmax(theta)[token]``
whatever the context. That is small enough to differentiate by hand:
``d logp(t) / d theta = onehot(t) - softmax(theta)``, chained with the
per-token loss derivatives of ``rlengine.trainer.losses``. Gradients
accumulate across ``forward_backward`` calls until ``optim_step`` (AdamW,
optional global-norm clipping), exactly as the torch trainer does. The
entropy bonus (``losses``) is differentiated by hand too: the distribution
is the same at every position, ``H = -sum p log p`` and
``dH / d theta_k = -p_k (log p_k + H)``.

It lets the control plane (scheduling, gates, installs, the RL loop's
plumbing) be tested for real without torch. Compute thread only.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import load_file, save_file

from rlengine.errors import InvalidRequest
from rlengine.trainer.losses import (
    TRANSFORM_INPUTS,
    as_settings,
    correction_weights,
    elementwise,
    loss_counts,
    mismatch_metrics,
    mismatch_sums,
    reference_kl,
)
from rlengine.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepResponse, TensorData

if TYPE_CHECKING:
    from rlengine.config import SimConfig

__all__ = ["SimTrainer"]


class SimTrainer:
    """Tinker-style trainer over the sim model's ``theta``."""

    name = "sim"

    def __init__(self, config: SimConfig) -> None:
        self.config = cfg = config
        self.vocab_size = cfg.vocab_size
        self.max_len = cfg.max_model_len
        self.theta = cfg.initial_weights().astype(np.float64)
        self.reference_logp = self._log_softmax()
        """Log-softmax of the initial weights: the reference policy of a KL penalty (never trained)."""
        self.grad = np.zeros_like(self.theta)
        self.exp_avg = np.zeros_like(self.theta)
        self.exp_avg_sq = np.zeros_like(self.theta)
        self.step_count = 0

    def _log_softmax(self) -> np.ndarray:
        t = self.theta - self.theta.max()
        return t - math.log(np.exp(t).sum())

    def _run(self, data: list[Datum], loss_fn: str, thresholds: tuple[float, ...],
             backward: bool) -> ForwardBackwardOutput:
        settings = as_settings(thresholds)
        logp_all = self._log_softmax()
        probs = np.exp(logp_all)
        entropy = float(-(probs * logp_all).sum())
        total = 0.0
        entropy_total = kl_total = 0.0
        corrected: Counter[str] = Counter()
        mismatch: list[dict[str, float]] = []
        outputs = []
        grad = np.zeros_like(self.theta)
        for datum in data:
            inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
            targets = inputs["target_tokens"]
            if any(key in inputs for key in TRANSFORM_INPUTS):
                raise InvalidRequest("loss_fn_inputs", sorted(set(TRANSFORM_INPUTS) & set(inputs)),
                                     "the sim trainer computes raw logprobs only (no sampling transform)")
            logp = logp_all[targets]
            loss, dlogp = elementwise(loss_fn, logp, inputs, settings)
            corrected.update(loss_counts(loss_fn, logp, inputs, settings))
            if (sums := mismatch_sums(logp, inputs)):
                mismatch.append(sums)
            weights, counts = correction_weights(inputs, settings)
            loss, dlogp = loss * weights, dlogp * weights
            for key, value in counts.items():
                corrected[key] += value
            total += float(loss.sum())
            if settings.kl_coef is not None:
                mask = inputs["mask"] if "mask" in inputs else np.ones(len(targets))
                kl, dkl = reference_kl(logp, self.reference_logp[targets], settings.kl_estimator)
                kl_total += float((mask * kl).sum())
                dlogp = dlogp + settings.kl_coef * mask * dkl
            if backward:
                grad += np.bincount(targets, weights=dlogp, minlength=self.vocab_size) - dlogp.sum() * probs
            if settings.entropy_coef:
                weight = float(inputs["mask"].sum()) if "mask" in inputs else float(len(targets))
                entropy_total += weight * entropy
                if backward:
                    grad -= settings.entropy_coef * weight * (-probs * (logp_all + entropy))
            outputs.append({"logprobs": TensorData.from_numpy(logp.astype(np.float32)),
                            "elementwise_loss": TensorData.from_numpy(loss.astype(np.float32))})
        if backward:
            self.grad += grad
        metrics = {"loss:sum": total}
        if settings.entropy_coef:
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

    def optim_step(self, params: AdamParams) -> OptimStepResponse:
        grad = self.grad
        norm = float(np.sqrt((grad * grad).sum()))
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            grad = grad * (params.grad_clip_norm / (norm + 1e-6))
        self.step_count += 1
        b1, b2, lr = params.beta1, params.beta2, params.learning_rate
        self.theta *= 1.0 - lr * params.weight_decay
        self.exp_avg = b1 * self.exp_avg + (1 - b1) * grad
        self.exp_avg_sq = b2 * self.exp_avg_sq + (1 - b2) * grad * grad
        m_hat = self.exp_avg / (1 - b1 ** self.step_count)
        v_hat = self.exp_avg_sq / (1 - b2 ** self.step_count)
        self.theta -= lr * m_hat / (np.sqrt(v_hat) + params.eps)
        self.grad = np.zeros_like(self.theta)
        return OptimStepResponse(metrics={"grad_norm": norm, "learning_rate": lr})

    def sampler_weights(self) -> Iterable[tuple[str, Any]]:
        return [("theta", self.theta.astype(np.float32))]

    def save_state(self, path: str, include_optimizer: bool = True) -> str:
        os.makedirs(path, exist_ok=True)
        tensors = {"theta": self.theta}
        if include_optimizer:
            tensors |= {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad": self.grad,
                        "step": np.array([self.step_count], dtype=np.int64)}
        save_file(tensors, os.path.join(path, "sim_state.safetensors"))
        return path

    def load_state(self, path: str, include_optimizer: bool = True) -> str:
        file = os.path.join(path, "sim_state.safetensors")
        if not os.path.isfile(file):
            raise InvalidRequest("path", path, "holds no sim_state.safetensors (not a saved sim state)")
        tensors = load_file(file)
        if tensors["theta"].shape != self.theta.shape:
            raise InvalidRequest("path", path, f"theta shape {tensors['theta'].shape} != {self.theta.shape}")
        self.theta = tensors["theta"].copy()
        if include_optimizer:
            if "exp_avg" not in tensors:
                raise InvalidRequest("path", path, "was saved without optimizer state")
            self.exp_avg = tensors["exp_avg"].copy()
            self.exp_avg_sq = tensors["exp_avg_sq"].copy()
            self.grad = tensors["grad"].copy()
            self.step_count = int(tensors["step"][0])
        return path


def build(config: Any, model_path: str | None = None) -> SimTrainer:
    """Registry entry point (``rlengine.backends.SPECS``)."""
    return SimTrainer(config.sim)
