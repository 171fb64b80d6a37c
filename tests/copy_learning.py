"""What "the ``copy`` recipe learns" means in the tests that run it for 30 steps (in one
process, on sampler replicas, on sharded trainer workers): the first five steps earn about
0.02 (a random model), and by steps 26-30 the policy has visibly learned to copy the first
digit. The thresholds leave room for float noise, not for a run that does not learn."""

from __future__ import annotations

import numpy as np

from rlengine.rl.metrics import read_jsonl


def assert_learned(metrics_path: str, steps: int = 30) -> None:
    rewards = [s["reward_mean"] for s in read_jsonl(metrics_path)]
    assert len(rewards) == steps
    first, last = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
    assert first < 0.2
    assert last >= first + 0.04 and last >= 2 * first, rewards
