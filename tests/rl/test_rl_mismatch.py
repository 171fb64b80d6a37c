"""Mismatch metrics (``rlengine.rl.mismatch``) against hand-computed values, and in a run's metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlengine.rl.metrics import read_jsonl
from rlengine.rl.mismatch import mismatch_metrics, token_staleness
from rlengine.rl.run import train


def test_mismatch_figures_against_hand_computed_values():
    sampler = [np.array([-1.0, -2.0]), np.array([-0.5])]
    trainer = [np.array([-1.5, -2.0]), np.array([-0.25])]
    got = mismatch_metrics(list(zip(sampler, trainer)))
    d = [0.5, 0.0, -0.25]  # sampler - trainer, per token
    r = [math.exp(-x) for x in d]
    assert got["kl_sample_train_v1"] == pytest.approx(sum(d) / 3)
    assert got["kl_sample_train_v2"] == pytest.approx(sum(x * x for x in d) / 6)
    assert got["kl_sample_train_k3"] == pytest.approx(sum(ri - 1 - math.log(ri) for ri in r) / 3)
    assert got["mismatch_log_ppl_diff"] == pytest.approx(((0.5 + 0.0) / 2 + (-0.25)) / 2)  # per sequence
    assert (got["ratio_min"], got["ratio_max"]) == pytest.approx((math.exp(-0.5), math.exp(0.25)))
    assert got["ratio_mean"] == pytest.approx(sum(r) / 3)
    same = mismatch_metrics([(np.array([-1.0, -3.0]), np.array([-1.0, -3.0]))])
    assert same["kl_sample_train_k3"] == 0.0 and same["ratio_min"] == same["ratio_max"] == 1.0
    assert mismatch_metrics([]) == {} and mismatch_metrics([(np.zeros(0), np.zeros(0))]) == {}


def test_token_staleness_counts_sampled_tokens_only():
    got = token_staleness([np.array([-1, 3, 3, -1]), np.array([5, -1])], updates=6)
    assert got == {"staleness_token_mean": pytest.approx((3 + 3 + 1) / 3), "staleness_token_max": 3.0}
    assert token_staleness([np.array([-1])], 2) == {}


@pytest.mark.model_plane
def test_every_step_of_a_run_reports_its_mismatch(tmp_path, model_cache):
    outcome = train("copy", {"steps": 2, "eval_every": 0, "checkpoint_every": 0, "backend": "torch",
                             "cache_dir": model_cache, "groups_per_batch": 4}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    for s in read_jsonl(outcome.metrics_path):
        # The same weights sample and train (fp32, CPU): the ratios are 1 to float precision.
        assert 0 <= s["kl_sample_train_k3"] < 1e-6 and abs(s["mismatch_log_ppl_diff"]) < 1e-4, s
        assert 0.999 < s["ratio_min"] <= s["ratio_mean"] <= s["ratio_max"] < 1.001, s
        assert s["staleness_token_mean"] == s["staleness_token_max"] == 0.0, s  # synchronous copy steps
