"""The sampler replicas' output wire (``backends.replica_wire``): every field of an output crosses.

No Ray here: the codec alone. The replicas themselves, against the local
backend, are tests/scale/test_ray_replica_outputs.py.
"""

from __future__ import annotations

from array import array

from rlengine.backends.base import RequestOutput
from rlengine.backends.replica_wire import DRIVER_ONLY, WIRE_FIELDS, Answer, WireOutput, decode_answer, encode
from rlengine.types import PromptScores


def full_output() -> RequestOutput:
    """An output with every field set to something other than its default."""
    out = RequestOutput("r1", [5, 6], [-0.25, -1.5], True, "stop", [-2.0, -3.0, -0.125], "boom", [5, 9, 6, 1],
                        [-0.25, -2.0, -1.5, -1.75], [7, 8, 9, 10, 11, 12], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
                        cached_tokens=16)
    out.drafted_tokens, out.accepted_tokens = 7, 3
    out.prompt_scores = PromptScores(target_k=1, target_logprobs_raw=array("f", [-0.5, 0.0]).tobytes(), alt_k=2,
                                     alt_ids_raw=array("i", [1, 2, 3, 4]).tobytes(),
                                     alt_logprobs_raw=array("f", [-1.0, -2.0, -3.0, -4.0]).tobytes())
    return out


def test_the_wire_names_every_field_of_an_output_but_the_drivers_own():
    assert set(WIRE_FIELDS) | set(DRIVER_ONLY) == set(RequestOutput.__slots__)
    assert not set(WIRE_FIELDS) & set(DRIVER_ONLY)


def test_every_field_of_an_output_survives_the_wire():
    sent = full_output()
    answer = decode_answer(encode(Answer([("r0", "InvalidRequest: no")], [WireOutput.of(sent)], 3)))
    assert answer.rejected == [("r0", "InvalidRequest: no")] and answer.steps == 3
    (got,) = [w.output() for w in answer.outputs]
    for name in WIRE_FIELDS:
        want, have = getattr(sent, name), getattr(got, name)
        assert (list(have) if isinstance(have, array) else have) == want, name
    assert got.lost is False


def test_an_output_with_only_its_tokens_keeps_its_defaults():
    sent = RequestOutput("r2", [1], [-0.5])
    got = decode_answer(encode(Answer([], [WireOutput.of(sent)], 1))).outputs[0].output()
    assert list(got.token_ids) == [1] and list(got.logprobs) == [-0.5]
    assert (got.finished, got.prompt_logprobs, got.top_ids, got.cached_tokens, got.prompt_scores) == (
        False, None, None, None, None)
    assert (got.drafted_tokens, got.accepted_tokens) == (0, 0)
