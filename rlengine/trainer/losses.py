"""Loss functions with Tinker semantics: validation and the numpy definition.

Every loss is a sum over target tokens of a function of the per-token
logprob ``logp`` of the target under the current weights:

* ``cross_entropy``:       ``-weights * logp``
* ``importance_sampling``: ``-ratio * advantages``, ``ratio = exp(logp - logprobs)``
* ``ppo``:                 ``-min(ratio * A, clip(ratio, lo, hi) * A)``; defaults lo 0.8, hi 1.2
* ``cispo``:               ``-stopgrad(clip(ratio, lo, hi)) * A * logp``; defaults lo 0.0, hi 4.0
* ``dro``:                 ``-(logp * A - beta / 2 * (logp - logprobs)^2)``; ``loss_fn_config["beta"]``,
  default 0.05 (d/dlogp = ``-(A - beta * (logp - logprobs))``)
* ``gspo``:                ``-min(s_t * A, clip(s_t, lo, hi) * A)``, GSPO-token: every token's ratio
  ``s_t`` has the value of the datum's sequence ratio ``s = exp(mean over M of (logp - logprobs))``, ``M``
  the tokens whose ``sequence_ratio_mask`` (a required input) is non-zero, and the gradient of its own
  ``logp`` only (``s`` is a stop-gradient): d s_t/dlogp_t = ``s``, so d/dlogp is ppo's with ``s`` for the
  ratio. ``clip_low_threshold`` and ``clip_high_threshold`` default to 1 - 3e-4 and 1 + 4e-4
* ``stable_reinforce``:    rlengine's definition (below): REINFORCE with truncated importance weights
  to the behaviour policy, far-off-policy datums masked, an optional KL term

Tinker documents ``dro`` at tinker-docs.thinkingmachines.ai/tinker/losses/dro and ``gspo`` (the
GSPO-token variant) at .../tinker/losses/gspo, with no default for ``beta`` nor for the clip
thresholds; a caller that passes none (the cookbook's ``rl_loop`` with ``loss_fn="gspo"``) gets
rlengine's, from the published sources: gspo's clip range is the GSPO paper's (Zheng et al. 2025,
arXiv:2507.18071, section 5.1: left and right clipping ranges 3e-4 and 4e-4 around a ratio of 1,
sequence ratios being length-normalised and so far closer to 1 than token ratios); dro's ``beta`` is
0.05, the value Tinker's dro page passes in its example (its papers, Richemond et al. 2024 and Kimi
k1.5, tune their tau per task and publish no general default). Either key given alone keeps the
other's default.

**stable_reinforce** (rlengine's definition). Tinker publishes what its StableReinforce is made of
(REINFORCE on the behaviour logprobs its sampler recorded, importance weights kept bounded on
off-policy data, a ``kl_coeff``) but not its formula; this is rlengine's, built from those parts.
``logprobs`` are the behaviour policy's (the sampler's) logprobs ``b`` of the targets; the Tinker
server writes in the ones it recorded for each sampled sequence (``record_stability_info``), found
through the datum's provenance spans, and sets ``mask`` to the sampled positions. With ``d = logp -
b``, ``r = exp(d)`` and ``S`` the datum's action tokens (``mask`` > 0 if given, else a non-zero
advantage):

* token weight ``w = min(r, C)``, ``C = loss_fn_config["tis_cap"]`` (default 2): a truncated
  importance weight;
* sequence mask ``keep = lo <= exp(mean over S of d) <= hi`` (``geo_mask_low`` / ``geo_mask_high``,
  defaults 0.5 / 2): a datum whose geometric-mean ratio left that range is far off policy and
  contributes nothing (loss and gradient 0);
* per action token, ``keep * (-w * A + kl_coeff * (r - 1 - d))``; other tokens 0.

Its derivative with respect to ``logp`` is ``keep * (-w * A + kl_coeff * (r - 1))``: below the cap
exactly ``importance_sampling``'s (value and gradient), above it ``-C * A`` (the weight is a constant,
as in truncated importance sampling), so a token's policy-gradient term never exceeds ``C * |A|``
however stale the sample. A trainer hands it one datum at a time (``SEQUENCE_LOSSES``), and
reports (``loss_counts``) ``is_tokens:sum`` (action tokens), ``is_truncated:sum`` (action tokens whose
``r`` exceeded ``C``, masked datums included, as the corrections below count), ``is_masked:sum`` (action
tokens of masked datums) and ``is_masked_sequences:sum`` (masked datums). ``r - 1 - d`` is the k3
estimator of KL(behaviour || policy) on tokens the behaviour policy sampled (never negative);
``kl_coeff`` (default 0) is this loss's own and differs from ``kl_coef`` (below), the KL to the initial
weights, which may be set on top. The keys ``tis_cap`` and
``geo_mask_*`` mean here what the off-policy corrections below mean, applied to ``r`` itself (the
corrections, which need ``old_logprobs``, are not taken).

``logprobs`` are the sampler's logprobs of the same tokens. Because each
loss is elementwise in ``logp``, ``elementwise`` returns both the loss and
its derivative with respect to ``logp``; a trainer chains that through its
model (the sim trainer does so by hand, and it is the reference the torch
trainer is tested against).

An **entropy bonus** is an option on top, never a change of these losses:
``loss_fn_config={"entropy_coef": c}`` (any loss, ``c >= 0``) makes the
trainer minimise ``loss - c * sum_t mask_t * H_t``, where ``H_t`` is the
entropy of the model's whole next-token distribution at position ``t`` and
``mask`` an optional per-token input (default 1; allowed only with an
entropy coefficient). RL on small vocabularies needs it: without it the
probability of rare but necessary tokens (an end token) collapses. The
trainers report the Tinker loss as ``loss:sum`` unchanged and the bonus's
``entropy:sum`` beside it. Without ``entropy_coef`` nothing differs from
Tinker, and ``mask`` is rejected as before.

A **KL penalty to a reference policy** is another option on top:
``loss_fn_config={"kl_coef": c, "kl_estimator": k}`` (``c >= 0``, ``k`` 1, 2
or 3, default 3) makes the trainer minimise ``loss + c * sum_t mask_t *
KL_t``, where, with ``x = logp_ref - logp`` at each target token (``logp_ref``
under the reference: the model's initial weights, loaded once from its
directory, never trained):

* k1 = ``-x`` (d/dlogp = 1),
* k2 = ``x^2 / 2`` (d/dlogp = ``-x``),
* k3 = ``exp(x) - 1 - x`` (d/dlogp = ``1 - exp(x)``; never negative),

the usual estimators of KL(policy || reference) over tokens the policy
sampled (``reference_kl``). ``kl_coef`` 0 measures without penalising. The
trainers report ``kl_ref:sum`` (the estimator's sum, mask-weighted) beside
``loss:sum``, which stays Tinker's; ``mask`` is then allowed as with an
entropy bonus.

**Processed logprobs.** Optional per-token inputs ``temperature`` (> 0),
``top_k`` (0 or less: no limit) and ``top_p`` (in (0, 1]), for any loss, make
``logp`` the logprob under that sampling transform instead of the raw
``log_softmax``: logits divided by ``temperature``, kept to the ``top_k``
most likely tokens and then to the nucleus of mass ``top_p``, renormalised
(``rlengine.backends.torch.sampling.processed_log_softmax``, the definition
the torch sampler uses for ``SamplingParams.logprobs_mode="processed"``); the
target token always stays in the support, so its logprob is finite. Tokens
with ``temperature`` 1, ``top_k`` <= 0 and ``top_p`` 1 are raw. On-policy,
the ratio of a processed sampler logprob to this is 1 at any temperature;
against a raw ``log_softmax`` it is biased by the temperature (verl #6240).
The sim trainer computes raw logprobs only and refuses these inputs.

**Off-policy corrections** (losses with ratios: ``importance_sampling``,
``ppo``, ``cispo``). With the optional input ``old_logprobs`` (the logprobs
of a proximal policy, usually the trainer's own before the update: the RL
loop computes them with a ``forward`` pass), the policy ratio of each loss is
``exp(logp - old_logprobs)`` instead of ``exp(logp - logprobs)`` (decoupled
PPO), and the behaviour weight ``w = exp(old_logprobs - logprobs)`` (trainer
over sampler, a constant) corrects for the sampler's mismatch. Each token's
loss (and gradient) is multiplied by a function ``c(w)`` set in
``loss_fn_config`` (at most one of the first three; all need
``old_logprobs``):

* ``tis_cap`` C: truncated importance sampling, ``c = min(w, C)``;
* ``mis_cap`` C: masked importance sampling, ``c = w`` if ``w <= C`` else 0;
* ``icepop_low`` a, ``icepop_high`` b (IcePop's two-sided mask):
  ``c = w`` if ``a <= w <= b`` else 0;
* ``geo_mask_low`` a, ``geo_mask_high`` b: a sequence-level mask: with ``g =
  exp(mean log w)`` over the datum's action tokens, every token of the datum
  gets ``c = 0`` when ``g`` is outside ``[a, b]`` (times the token-level
  ``c`` when one is set, else 1).

Action tokens are those with ``mask`` > 0 when a ``mask`` is given, else
those with a non-zero advantage. The trainers report ``is_tokens:sum``
(action tokens), ``is_truncated:sum`` (tokens whose ``w`` exceeded the TIS
cap) and ``is_masked:sum`` (tokens zeroed by MIS, IcePop or the geometric
mask). Asymmetric clipping (DAPO's clip-higher) is ``ppo`` with
``clip_high_threshold`` above ``2 - clip_low_threshold`` (e.g. 0.8 / 1.28).

**Mismatch diagnostics.** Every loss with a ``logprobs`` input also reports,
over its action tokens, ``d = logprobs - logp`` (sampler minus trainer):
``mismatch_k1:sum`` (sum of d), ``mismatch_k3:sum`` (sum of ``exp(-d) - 1 +
d``), ``mismatch_tokens:sum``, and ``mismatch_ratio:min`` / ``:max`` of
``exp(-d)``; the SDK reduces chunks by each key's suffix. Before the first
update of a batch they measure sampler-vs-trainer mismatch; after it, also
the learning.

``validate_data`` runs before anything is queued (the Tinker server runs it
in a worker thread for a large call) and raises ``InvalidRequest`` naming
the datum and field; it reads only its arguments.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.trainer.loss_settings import (
    CORRECTION_KEYS,
    KL_ESTIMATORS,
    RATIO_LOSSES,
    LossSettings,
    StableSettings,
    as_settings,
    clip_thresholds,
    loss_settings,
)
from rlengine.types import LOSS_FNS, Datum

__all__ = [
    "CORRECTION_KEYS",
    "KL_ESTIMATORS",
    "REQUIRED_INPUTS",
    "SEQUENCE_LOSSES",
    "TRANSFORM_INPUTS",
    "LossSettings",
    "StableSettings",
    "as_settings",
    "clip_thresholds",
    "concat_inputs",
    "concat_tokens",
    "correction_weights",
    "elementwise",
    "loss_counts",
    "loss_settings",
    "mismatch_metrics",
    "mismatch_sums",
    "reference_kl",
    "validate_data",
]


REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
}
_OPTIONAL_INPUTS = {"cross_entropy": ("weights",), "stable_reinforce": ("mask",)}
SEQUENCE_LOSSES = ("gspo", "stable_reinforce")
"""Losses whose value at a token depends on the datum's other tokens (a sequence ratio, a sequence
mask): a trainer hands ``elementwise`` one datum at a time for these."""
TRANSFORM_INPUTS = ("temperature", "top_k", "top_p")
"""Per-token inputs of any loss: the sampling transform its ``logp`` is under."""
def _action_tokens(inputs: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The datum's action tokens (module docstring): ``mask`` > 0 if given, else a non-zero
    advantage (every token for a loss without advantages)."""
    if "mask" in inputs:
        return inputs["mask"] > 0
    if "advantages" in inputs:
        return inputs["advantages"] != 0
    return np.ones(n, dtype=bool)


def mismatch_sums(logp: np.ndarray, inputs: dict[str, np.ndarray]) -> dict[str, float]:
    """One datum's mismatch diagnostics (module docstring); empty without ``logprobs`` or action tokens."""
    if "logprobs" not in inputs:
        return {}
    action = _action_tokens(inputs, logp.shape[0])
    if not action.any():
        return {}
    d = inputs["logprobs"].astype(np.float64)[action] - logp.astype(np.float64)[action]
    r = np.exp(-d)
    return {"mismatch_k1": float(d.sum()), "mismatch_k3": float((r - 1.0 + d).sum()),
            "mismatch_tokens": float(d.size), "mismatch_ratio_min": float(r.min()),
            "mismatch_ratio_max": float(r.max())}


def mismatch_metrics(sums: list[dict[str, float]]) -> dict[str, float]:
    """The datums' ``mismatch_sums`` as ``ForwardBackwardOutput.metrics`` keys."""
    if not sums:
        return {}
    out = {f"{key}:sum": math.fsum(s[key] for s in sums) for key in ("mismatch_k1", "mismatch_k3", "mismatch_tokens")}
    out["mismatch_ratio:min"] = min(s["mismatch_ratio_min"] for s in sums)
    out["mismatch_ratio:max"] = max(s["mismatch_ratio_max"] for s in sums)
    return out


def correction_weights(inputs: dict[str, np.ndarray], settings: LossSettings) -> tuple[np.ndarray, dict[str, float]]:
    """Per token, the correction factor ``c(w)`` of the module docstring for one datum (float64;
    all ones without corrections), and its counts (``is_tokens``, ``is_truncated``, ``is_masked``)."""
    n = inputs["target_tokens"].shape[0]
    if not settings.corrections:
        return np.ones(n), {}
    log_w = inputs["old_logprobs"].astype(np.float64) - inputs["logprobs"].astype(np.float64)
    w = np.exp(log_w)
    action = _action_tokens(inputs, n)
    c = np.ones(n)
    truncated = masked = np.zeros(n, dtype=bool)
    cap = settings.correction("tis_cap")
    if cap is not None:
        c, truncated = np.minimum(w, cap), w > cap
    cap = settings.correction("mis_cap")
    if cap is not None:
        masked = w > cap
        c = np.where(masked, 0.0, w)
    low, high = settings.correction("icepop_low"), settings.correction("icepop_high")
    if low is not None and high is not None:
        masked = (w < low) | (w > high)
        c = np.where(masked, 0.0, w)
    low, high = settings.correction("geo_mask_low"), settings.correction("geo_mask_high")
    if low is not None and high is not None and action.any():
        g = math.exp(float(log_w[action].mean()))
        if not low <= g <= high:
            c, masked = np.zeros(n), np.ones(n, dtype=bool)
    return c, {"is_tokens": float(action.sum()), "is_truncated": float((truncated & action).sum()),
               "is_masked": float((masked & action).sum())}


def reference_kl(logp: np.ndarray, ref_logp: np.ndarray, estimator: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token, the ``estimator`` (1, 2, 3) of KL(policy || reference) and its derivative with
    respect to ``logp`` (float64); see the module docstring."""
    x = ref_logp.astype(np.float64) - logp.astype(np.float64)
    if estimator == 1:
        return -x, np.ones_like(x)
    if estimator == 2:
        return 0.5 * x * x, -x
    e = np.exp(x)
    return e - 1.0 - x, 1.0 - e


def validate_data(data: list[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None,
                  vocab_size: int, max_len: int) -> LossSettings:
    """Check a batch before it is queued; returns the resolved settings (a
    ``(clip_low, clip_high, entropy_coef)`` tuple)."""
    if loss_fn not in LOSS_FNS:
        raise InvalidRequest("loss_fn", loss_fn, f"must be one of {', '.join(LOSS_FNS)}")
    thresholds = loss_settings(loss_fn, loss_fn_config)
    if not isinstance(data, (list, tuple)) or not data:
        raise InvalidRequest("data", data if not isinstance(data, (list, tuple)) else "[]",
                             "must be a non-empty list of Datum")
    required = REQUIRED_INPUTS[loss_fn]
    allowed = set(required) | set(_OPTIONAL_INPUTS.get(loss_fn, ())) | set(TRANSFORM_INPUTS)
    if loss_fn in RATIO_LOSSES:
        allowed.add("old_logprobs")
    if thresholds.corrections:
        required = (*required, "old_logprobs")
    if thresholds.masked or thresholds.corrections:
        allowed.add("mask")
    needed = set(required)
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise InvalidRequest(f"data[{i}]", type(datum).__name__, "must be a Datum")
        n = datum.model_input.length
        if n == 0:
            raise InvalidRequest(f"data[{i}].model_input", "empty", "must hold at least one token")
        if n > max_len:
            raise InvalidRequest(f"data[{i}].model_input.length", n, f"exceeds the model's context {max_len}")
        inputs = datum.loss_fn_inputs
        shape = [n]
        # The common case in set operations; a datum that fails them is checked key by key below
        # for the error that names the first bad key.
        if (inputs.keys() >= needed and inputs.keys() <= allowed and inputs["target_tokens"].dtype == "int64"
                and all(td.shape == shape for td in inputs.values())):
            continue
        for key in required:
            if key not in inputs:
                raise InvalidRequest(f"data[{i}].loss_fn_inputs", sorted(inputs),
                                     f"loss_fn={loss_fn!r} needs {key!r}")
        for key, td in inputs.items():
            if key not in allowed:
                raise InvalidRequest(f"data[{i}].loss_fn_inputs[{key!r}]", key,
                                     f"not an input of loss_fn={loss_fn!r} (takes {', '.join(sorted(allowed))})")
            if td.shape != [n]:
                raise InvalidRequest(f"data[{i}].loss_fn_inputs[{key!r}].shape", td.shape,
                                     f"must be [{n}], one value per model_input token")
        targets = inputs["target_tokens"]
        if targets.dtype != "int64":
            raise InvalidRequest(f"data[{i}].loss_fn_inputs['target_tokens'].dtype", targets.dtype, "must be int64")
    # The values, over the whole batch at once (a per-datum pass cost a training step several
    # milliseconds); where one is bad, the per-datum checks find and name it.
    if not _values_ok(data, loss_fn, vocab_size):
        for i, datum in enumerate(data):
            _check_values(i, datum, loss_fn, vocab_size)
    return thresholds


def concat_tokens(data: list[Datum]) -> np.ndarray:
    """Every datum's ``model_input`` token ids, in order, as one int32 array."""
    # One join of the raw bytes: a numpy view per datum cost more than the data (32 datums: 26 us
    # against 1.4 us).
    return np.frombuffer(bytearray(b"".join([d.model_input.tokens_raw for d in data])), dtype=np.int32)


def concat_inputs(data: list[Datum], key: str) -> np.ndarray:
    """The ``key`` input of every datum that has it, in order, as one (writable) array; float64
    and empty if none has it. Values of differing dtypes are promoted as ``np.concatenate`` does."""
    values = [d.loss_fn_inputs[key] for d in data if key in d.loss_fn_inputs]
    if not values:
        return np.zeros(0)
    dtype = values[0].dtype
    if any(td.dtype != dtype for td in values):
        return np.concatenate([td.to_numpy() for td in values])
    return np.frombuffer(bytearray(b"".join([td.data_raw for td in values])), dtype=np.dtype(dtype))


def _values_ok(data: list[Datum], loss_fn: str, vocab_size: int) -> bool:
    """Every datum's token ids, targets and inputs in range (the checks of ``_check_values``)."""
    tokens = concat_tokens(data)
    targets = concat_inputs(data, "target_tokens")
    if int(tokens.max()) >= vocab_size or int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
        return False
    keys = {key for d in data for key in d.loss_fn_inputs} - {"target_tokens"}
    values = {key: concat_inputs(data, key) for key in keys}
    if not all(np.isfinite(v).all() for v in values.values()):
        return False
    for key, ok, _ in _TRANSFORM_RULES:
        if key in values and not ok(values[key]).all():
            return False
    return loss_fn != "gspo" or all(d.loss_fn_inputs["sequence_ratio_mask"].to_numpy().any() for d in data)


def _check_values(i: int, datum: Datum, loss_fn: str, vocab_size: int) -> None:
    """Datum ``i``'s token ids, targets and inputs in range; ``InvalidRequest`` naming the first bad one."""
    tokens = datum.model_input.to_numpy()
    if int(tokens.max()) >= vocab_size:
        raise InvalidRequest(f"data[{i}].model_input", int(tokens.max()), f"token id >= vocab size {vocab_size}")
    inputs = datum.loss_fn_inputs
    t = inputs["target_tokens"].to_numpy()
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
        raise InvalidRequest(f"data[{i}].loss_fn_inputs['target_tokens']", bad,
                             f"token ids must be in [0, {vocab_size})")
    for key in inputs:
        if key != "target_tokens" and not np.isfinite(inputs[key].to_numpy()).all():
            raise InvalidRequest(f"data[{i}].loss_fn_inputs[{key!r}]", "non-finite", "must be finite")
    if loss_fn == "gspo" and not inputs["sequence_ratio_mask"].to_numpy().any():
        raise InvalidRequest(f"data[{i}].loss_fn_inputs['sequence_ratio_mask']", "all zero",
                             "must mark at least one token (the sequence ratio is their mean)")
    _check_transform(i, inputs)


_TRANSFORM_RULES = (("temperature", lambda v: v > 0, "must be > 0"),
                    ("top_k", lambda v: v == np.round(v), "must be whole numbers (<= 0: no limit)"),
                    ("top_p", lambda v: (v > 0) & (v <= 1), "must be in (0, 1]"))


def _check_transform(i: int, inputs: dict[str, Any]) -> None:
    """The ``temperature`` / ``top_k`` / ``top_p`` inputs of datum ``i``, if any, in range."""
    for key, ok, rule in _TRANSFORM_RULES:
        if key in inputs:
            values = inputs[key].to_numpy()
            bad = ~ok(values)
            if bad.any():
                raise InvalidRequest(f"data[{i}].loss_fn_inputs[{key!r}]", float(values[bad][0]), rule)


def elementwise(loss_fn: str, logp: np.ndarray, inputs: dict[str, np.ndarray],
                thresholds: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loss and its derivative with respect to ``logp`` (float64).

    ``thresholds`` is ``(clip_low, clip_high)`` or ``LossSettings``; the
    entropy bonus is not elementwise in ``logp`` and is the trainer's part."""
    logp = logp.astype(np.float64)
    if loss_fn == "cross_entropy":
        w = inputs.get("weights")
        w = np.ones_like(logp) if w is None else w.astype(np.float64)
        return -w * logp, -w
    adv = inputs["advantages"].astype(np.float64)
    # With a proximal policy (``old_logprobs``), the ratio is to it (decoupled PPO).
    ratio = np.exp(logp - inputs.get("old_logprobs", inputs["logprobs"]).astype(np.float64))
    if loss_fn == "importance_sampling":
        return -ratio * adv, -ratio * adv
    lo, hi = thresholds[0], thresholds[1]
    clipped = np.clip(ratio, lo, hi)
    if loss_fn == "ppo":
        unclipped_obj, clipped_obj = ratio * adv, clipped * adv
        loss = -np.minimum(unclipped_obj, clipped_obj)
        # The gradient flows through whichever branch the min takes; the
        # clipped branch is constant outside [lo, hi].
        inside = (ratio >= lo) & (ratio <= hi)
        takes_unclipped = (unclipped_obj <= clipped_obj) | inside
        return loss, np.where(takes_unclipped, -ratio * adv, 0.0)
    if loss_fn == "cispo":
        return -clipped * adv * logp, -clipped * adv
    if loss_fn == "dro":
        return _dro(logp, inputs["logprobs"].astype(np.float64), adv, as_settings(thresholds).beta)
    if loss_fn == "gspo":
        return _gspo(logp, inputs["logprobs"].astype(np.float64), adv, inputs["sequence_ratio_mask"] != 0, lo, hi)
    if loss_fn == "stable_reinforce":
        stable = as_settings(thresholds).stable or StableSettings()
        return _stable_reinforce(logp, inputs["logprobs"].astype(np.float64), adv,
                                 _action_tokens(inputs, logp.shape[0]), stable)
    raise InvalidRequest("loss_fn", loss_fn, f"must be one of {', '.join(LOSS_FNS)}")


def _dro(logp: np.ndarray, sampled: np.ndarray, adv: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """DRO per token: ``-(logp * A - beta / 2 * (logp - logprobs)^2)`` and its derivative."""
    diff = logp - sampled
    return -(logp * adv - 0.5 * beta * diff * diff), -(adv - beta * diff)


def _gspo(logp: np.ndarray, sampled: np.ndarray, adv: np.ndarray, in_ratio: np.ndarray, lo: float,
          hi: float) -> tuple[np.ndarray, np.ndarray]:
    """GSPO-token over one datum (the sequence): ppo's clipped objective with every token's ratio the
    sequence ratio ``s``, each token's gradient through its own ``logp`` only (``d s_t / d logp_t = s``)."""
    s = np.full_like(logp, math.exp(float((logp - sampled)[in_ratio].mean())))
    unclipped_obj, clipped_obj = s * adv, np.clip(s, lo, hi) * adv
    loss = -np.minimum(unclipped_obj, clipped_obj)
    takes_unclipped = (unclipped_obj <= clipped_obj) | ((s >= lo) & (s <= hi))
    return loss, np.where(takes_unclipped, -s * adv, 0.0)


def _stable_kept(d: np.ndarray, action: np.ndarray, stable: StableSettings) -> bool:
    """Whether stable_reinforce's geometric mask keeps a datum with action tokens (``d = logp - b``)."""
    # Compared in log space: the mean of a far-off datum may overflow exp().
    return math.log(stable.geo_mask_low) <= float(d[action].mean()) <= math.log(stable.geo_mask_high)


def _stable_ratio(d: np.ndarray) -> np.ndarray:
    """``r = exp(d)``: exponents over 700 overflow float64; such a token is far over the cap anyway,
    and its KL term's gradient is what the caller asked for (kl_coeff 0 leaves it out)."""
    return np.exp(np.minimum(d, 700.0))


def loss_counts(loss_fn: str, logp: np.ndarray, inputs: dict[str, np.ndarray],
                thresholds: tuple[float, ...]) -> dict[str, float]:
    """One datum's counts of what ``stable_reinforce`` truncated and masked (module docstring:
    ``is_tokens``, ``is_truncated``, ``is_masked``, ``is_masked_sequences``); empty for other losses."""
    if loss_fn != "stable_reinforce":
        return {}
    stable = as_settings(thresholds).stable or StableSettings()
    action = _action_tokens(inputs, logp.shape[0])
    tokens = int(action.sum())
    if not tokens:
        return {"is_tokens": 0.0, "is_truncated": 0.0, "is_masked": 0.0, "is_masked_sequences": 0.0}
    d = logp.astype(np.float64) - inputs["logprobs"].astype(np.float64)
    masked = not _stable_kept(d, action, stable)
    truncated = int((action & (_stable_ratio(d) > stable.tis_cap)).sum())
    return {"is_tokens": float(tokens), "is_truncated": float(truncated), "is_masked": float(tokens * masked),
            "is_masked_sequences": float(masked)}


def _stable_reinforce(logp: np.ndarray, behaviour: np.ndarray, adv: np.ndarray, action: np.ndarray,
                      stable: StableSettings) -> tuple[np.ndarray, np.ndarray]:
    """stable_reinforce over one datum (module docstring): ``-min(r, C) * A + kl_coeff * (r - 1 - d)``
    on action tokens, all zero when the datum's geometric-mean ratio is outside the mask range."""
    d = logp - behaviour
    zero = np.zeros_like(logp)
    if not action.any() or not _stable_kept(d, action, stable):
        return zero, zero
    r = _stable_ratio(d)
    w = np.minimum(r, stable.tis_cap)
    loss = np.where(action, -w * adv + stable.kl_coeff * (r - 1.0 - d), 0.0)
    return loss, np.where(action, -w * adv + stable.kl_coeff * (r - 1.0), 0.0)
