"""Sampler-vs-trainer mismatch, measured every step over the sampled tokens.

A sampled token has two logprobs: the sampler's (recorded when it was drawn)
and the trainer's (its forward pass on the same sequence, before the step's
first update, so any difference is mismatch, not learning). With
``d = logp_sampler - logp_trainer`` per token and ``r = exp(-d)`` (the
importance ratio ``p_trainer / p_sampler``):

* ``kl_sample_train_v1`` = mean(d): the k1 estimator of KL(sampler || trainer)
  (the Tinker cookbook's name and formula);
* ``kl_sample_train_v2`` = mean(d^2) / 2: k2;
* ``kl_sample_train_k3`` = mean(r - 1 - log r) = mean(r - 1 + d): k3,
  unbiased and never negative per token;
* ``mismatch_log_ppl_diff`` = mean over sequences of mean(d) over the
  sequence's tokens: the trainer's log-perplexity of each sampled sequence
  minus the sampler's, averaged per sequence (long sequences do not dominate);
* ``ratio_min`` / ``ratio_max`` / ``ratio_mean``: of r over the tokens;
* ``staleness_token_mean`` / ``staleness_token_max``: per trained token, the
  updates applied since the policy version that sampled it.

Pure functions over arrays; nothing here waits or trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["mismatch_metrics", "token_staleness"]


def mismatch_metrics(sequences: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """The module docstring's figures from (sampler logprobs, trainer logprobs) per sequence
    (sampled tokens only); an empty dict without tokens."""
    per_seq = [np.asarray(s, np.float64) - np.asarray(t, np.float64) for s, t in sequences if len(s)]
    if not per_seq:
        return {}
    d = np.concatenate(per_seq)
    r = np.exp(-d)
    return {"kl_sample_train_v1": float(d.mean()), "kl_sample_train_v2": float(0.5 * (d * d).mean()),
            "kl_sample_train_k3": float((r - 1.0 + d).mean()),
            "mismatch_log_ppl_diff": float(np.mean([x.mean() for x in per_seq])),
            "ratio_min": float(r.min()), "ratio_max": float(r.max()), "ratio_mean": float(r.mean())}


def token_staleness(versions: Sequence[np.ndarray], updates: int) -> dict[str, float]:
    """Per sampled token (version >= 0), ``updates`` minus the policy version that sampled it."""
    got = [np.asarray(v)[np.asarray(v) >= 0] for v in versions]
    v = np.concatenate(got) if got else np.zeros(0)
    if not v.size:
        return {}
    lag = updates - v.astype(np.int64)
    return {"staleness_token_mean": float(lag.mean()), "staleness_token_max": float(lag.max())}
