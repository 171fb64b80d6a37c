"""DAPO's dynamic sampling (``dynamic_sampling_attempts``): constant-reward groups are sampled again.

On the sim backend with one-token answers and groups of 2, a group's two
rewards (0 or 1 each) are equal about half the time. References: the same
run without the option, and the ledger's record of every attempt.
"""

from __future__ import annotations

from collections import Counter

from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train


def run(tmp_path, name, **settings):
    outcome = train("rl_sim:RECIPE", {"batches": 6, "gen_len": 1, "group_size": 2, "max_tokens": 1, "eval_every": 0,
                                      "checkpoint_every": 0, "skip_constant_reward": True, **settings},
                    run_dir=str(tmp_path / name))
    assert outcome.error is None, outcome.error
    return read_jsonl(outcome.metrics_path), read_jsonl(str(tmp_path / name / "groups.jsonl"))


def test_constant_groups_are_resampled_up_to_the_bound_and_the_batch_fills_with_informative_ones(tmp_path):
    plain_steps, plain_groups = run(tmp_path, "plain")
    steps, groups = run(tmp_path, "dynamic", dynamic_sampling_attempts=3)
    plain_dropped = sum(s["groups_dropped_constant_reward"] for s in plain_steps)
    assert plain_dropped > 0  # without the option, constant groups go untrained
    resampled = [g for g in groups if g["disposition"] == "resampled_constant"]
    assert len(resampled) == sum(s["groups_resampled_constant"] for s in steps) > 0
    assert all(len(set(g["rewards"])) == 1 and g["attempt"] < 3 for g in resampled)
    # A group is re-sampled with new seeds (its attempt), never trained or counted twice.
    final = [g for g in groups if g["disposition"] != "resampled_constant"]
    assert Counter((g["step"], g["group"]) for g in final) == Counter((g["step"], g["group"]) for g in plain_groups)
    # Every group that is still constant after the bound is dropped as before; the others are trained.
    assert all(g["attempt"] == 3 for g in final if g["disposition"] == "dropped_constant_reward")
    trained = sum(s["groups_trained"] for s in steps)
    assert trained > sum(s["groups_trained"] for s in plain_steps)
    assert all(s["groups_trained"] + s["groups_dropped_constant_reward"] == 4 for s in steps)


def test_sequence_aggregation_divides_each_trajectorys_advantage_by_its_sampled_tokens(tmp_path):
    from collections import defaultdict

    import numpy as np

    from rlengine.rl.dump import read_step, step_path

    def datums(name, aggregation):
        outcome = train("rl_sim:RECIPE", {"batches": 1, "gen_len": 3, "turns": 2, "eval_every": 0,
                                          "checkpoint_every": 0, "loss_aggregation": aggregation,
                                          "dump_rollouts": str(tmp_path / name)}, run_dir=str(tmp_path / f"run-{name}"))
        assert outcome.error is None, outcome.error
        dump = read_step(step_path(str(tmp_path / name), 1), 1)
        return {(d.group, d.trajectory, d.segment): d for d in dump.datums}

    token, sequence = datums("token", "token"), datums("sequence", "sequence")
    assert token.keys() == sequence.keys() and token
    sampled = defaultdict(float)
    for (g, t, _), d in token.items():
        sampled[g, t] += float(d.mask.to_numpy().sum())
    for key, d in token.items():
        a_tok = d.datum.loss_fn_inputs["advantages"].to_numpy()
        a_seq = sequence[key].datum.loss_fn_inputs["advantages"].to_numpy()
        np.testing.assert_allclose(a_seq, a_tok / sampled[key[:2]], rtol=1e-6)
