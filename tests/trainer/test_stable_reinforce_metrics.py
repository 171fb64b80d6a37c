"""``stable_reinforce`` reports what it truncated and masked, against counts worked out by hand.

Three datums whose behaviour logprobs are set off the trainer's own by chosen
log ratios ``d`` (cap C = 2: truncated where ``d > log 2``; geometric mask
``[0.5, 2]``: a datum is masked where the mean ``d`` of its action tokens
leaves ``[-log 2, log 2]``):

* A: advantages ``[1, 1, 1, 0]``, ``d = [1.0, 0.0, -0.5, 5.0]``: 3 action
  tokens, mean 1/6, kept; one truncated (the 5.0 is no action token);
* B: ``mask = [1, 1, 0]``, ``d = [-1.0, -1.0, 3.0]``: 2 action tokens, mean
  -1, masked; none truncated;
* C: ``d = [1.5, 1.2]``: 2 action tokens, mean 1.35, masked; both over the
  cap (counted as the corrections count them: masked datums included).

So ``is_tokens`` 7, ``is_truncated`` 3, ``is_masked`` 4 and
``is_masked_sequences`` 2, on the sim trainer and on the torch trainer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import rlengine as rle
from rlengine.trainer.losses import loss_counts, loss_settings

WANT = {"is_tokens:sum": 7.0, "is_truncated:sum": 3.0, "is_masked:sum": 4.0, "is_masked_sequences:sum": 2.0}
SEQS = [[3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14]]
D = [[1.0, 0.0, -0.5, 5.0], [-1.0, -1.0, 3.0], [1.5, 1.2]]
ADV = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, -1.0]]
MASK = [None, [1.0, 1.0, 0.0], None]


def _datum(seq: list[int], **inputs) -> rle.Datum:
    values = {"target_tokens": np.array(seq[1:], dtype=np.int64)}
    values |= {k: np.asarray(v, np.float32) for k, v in inputs.items() if v is not None}
    return rle.Datum(model_input=rle.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=values)


def _batch(own_logprobs: list[np.ndarray]) -> list[rle.Datum]:
    """The three datums, behaviour logprobs ``own - d`` (so ``logp - behaviour = d``)."""
    return [_datum(seq, logprobs=own - np.asarray(d), advantages=adv, mask=mask)
            for seq, own, d, adv, mask in zip(SEQS, own_logprobs, D, ADV, MASK, strict=True)]


def _counts(trainer) -> dict[str, float]:
    plain = [_datum(s) for s in SEQS]
    own = [o["logprobs"].to_numpy().astype(np.float64)
           for o in trainer.forward(plain, "cross_entropy", (0.0, math.inf)).loss_fn_outputs]
    out = trainer.forward_backward(_batch(own), "stable_reinforce", loss_settings("stable_reinforce", None))
    return {key: out.metrics[key] for key in WANT}


def test_loss_counts_per_datum():
    settings = loss_settings("stable_reinforce", None)
    logp = np.zeros(4)
    got = loss_counts("stable_reinforce", logp, {"logprobs": -np.asarray(D[0]), "advantages": np.asarray(ADV[0])},
                      settings)
    assert got == {"is_tokens": 3.0, "is_truncated": 1.0, "is_masked": 0.0, "is_masked_sequences": 0.0}
    assert loss_counts("importance_sampling", logp, {"logprobs": logp, "advantages": logp + 1}, settings) == {}


def test_the_sim_trainer_reports_the_counts():
    from rlengine.config import SimConfig
    from rlengine.trainer.sim import SimTrainer

    assert _counts(SimTrainer(SimConfig(vocab_size=16))) == WANT


@pytest.mark.model_plane
def test_the_torch_trainer_reports_the_counts(tiny_model):
    from rlengine.trainer.torch_trainer import TorchTrainer

    assert _counts(TorchTrainer(tiny_model, tree_min_prefix=0)) == WANT
