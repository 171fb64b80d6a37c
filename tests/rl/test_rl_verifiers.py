"""A verifiers environment trained as an rlengine recipe (``tests/verifiers_recipe.py``): verifiers' own
``vf-eval``, unchanged, in its own venv, plays every episode against the episode's session base URL, and
the run trains on the sessions' exact traces.

Two steps of one group of two episodes, on the task ``alpha`` then ``beta``,
with the scripted backend: a lookup of ``alpha``, the answer 42, the same
lookup, the answer 7, dealt out to the episodes as their requests come.
References: ``lookup_env``'s values (``VALUES``: the rubric must give an
episode 1 exactly when the answer it ended with is its task's value), the
script's tokens (every trained segment must be one of its texts, a
trajectory's last one an answer), the tool's value as it must come back into
the trained context, and the script's arithmetic: each episode ends with
the one answer it gets, so a group gets both answers and makes both lookups
(two in all, however they fall). Each episode is three venv processes
(``vf-eval``, its tool server and verifiers' harness) that spend most of
~17 s on imports; the test takes 1-2 minutes.
"""

from __future__ import annotations

import numpy as np
import pytest
from verifiers_recipe import ANSWERS, CALL, venv_python

from rlengine.errors import ConfigurationError
from rlengine.rl.dump import read_step, step_path
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train

pytestmark = pytest.mark.slow

VALUES = {"alpha": "42", "beta": "7"}
"""What ``lookup_env`` stores (its own copy, not imported: that module runs in the venv)."""


@pytest.fixture(scope="module")
def venv():
    try:
        return venv_python()
    except ConfigurationError as exc:
        pytest.fail(str(exc), pytrace=False)


def sampled_runs(targets: list[int], mask: np.ndarray) -> list[list[int]]:
    """The runs of target tokens a loss mask trains: a datum's sampled segments."""
    runs: list[list[int]] = []
    for i, m in enumerate(mask.tolist()):
        if m > 0:
            if i == 0 or mask[i - 1] == 0:
                runs.append([])
            runs[-1].append(targets[i])
    return runs


def test_a_verifiers_environment_trains_as_a_recipe_on_its_rubrics_rewards(venv, tmp_path, tiny_model, model_cache):
    from rlengine.backends.torch.models import load_tokenizer

    dumps = tmp_path / "dumps"
    outcome = train("verifiers_recipe:RECIPE", {"cache_dir": model_cache, "dump_rollouts": str(dumps)},
                    run_dir=str(tmp_path / "run"))
    assert outcome.error is None, outcome.error
    tok = load_tokenizer(tiny_model)

    def tokens(text):
        return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]

    call, answers = tokens(CALL), {value: tokens(text) for value, text in ANSWERS.items()}

    steps = read_jsonl(outcome.metrics_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["attempts_failed"] == 0 and s["groups_trained"] == 1 and s["reward_mean"] == 0.5, s
        # verifiers' own counts, per episode: two lookups and four model calls over the step's two episodes.
        assert (s["env/tool_calls"], s["env/turns"]) == (1.0, 2.0), s
        assert s["tokens_sampled"] == 2 * len(call) + sum(map(len, answers.values())), s
    groups = read_jsonl(str(tmp_path / "run" / "groups.jsonl"))
    assert [(g["step"], g["metadata"]["key"], g["disposition"], sorted(g["rewards"])) for g in groups] == [
        (1, "alpha", "trained", [0.0, 1.0]), (2, "beta", "trained", [0.0, 1.0])]

    # What was trained: each episode's trace as the engine sampled it, its lookups, then its one answer,
    # with the rubric's reward for that answer.
    for step, key in ((1, "alpha"), (2, "beta")):
        dump = read_step(step_path(str(dumps), step), step)
        [group] = dump.groups
        assert sorted(d.trajectory for d in dump.datums) == sorted(group.trajectories) == [0, 1]
        assert sorted(group.advantages) == pytest.approx([-1.0, 1.0], abs=1e-5)  # from a 1 and a 0: a real update
        ended, lookups = [], 0
        for d in dump.datums:
            targets = d.datum.loss_fn_inputs["target_tokens"].to_numpy().tolist()
            runs = sampled_runs(targets, d.mask.to_numpy())
            assert all(r == call for r in runs[:-1]), (step, runs)
            [value] = [v for v, answer in answers.items() if runs[-1] == answer]
            ended.append(value)
            lookups += len(runs) - 1
            reward = group.rewards[group.trajectories.index(d.trajectory)]
            assert reward == float(value == VALUES[key]), (step, key, value, reward)
            context = tok.decode([*d.datum.model_input.to_ints(), targets[-1]], skip_special_tokens=False)
            assert context.count("<tool_response>\n42\n</tool_response>") == len(runs) - 1
        assert sorted(ended) == ["42", "7"] and lookups == 2
