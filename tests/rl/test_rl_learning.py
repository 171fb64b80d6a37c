"""The ``copy`` recipe learns: on the torch backend, mean reward rises within 30 steps.

A short, fixed budget of the real recipe (character model built locally,
GRPO, PPO clip, entropy bonus): the first five steps earn about 0.02 (a
random model), and by steps 26-30 the policy has visibly learned to copy
the first digit. Sampling seeds are derived per group, so the run is
repeatable; the thresholds leave room for float noise, not for a run that
does not learn.
"""

from __future__ import annotations

import pytest
from copy_learning import assert_learned

from rlengine.rl.run import train

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install


@pytest.mark.slow
def test_copy_recipe_reward_rises_within_30_steps(tmp_path, model_cache):
    outcome = train("copy", {"steps": "30", "eval_every": "0", "checkpoint_every": "0", "backend": "torch",
                             "cache_dir": model_cache}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    assert_learned(outcome.metrics_path)
