"""``group_datums`` (a group's single-turn datums at once) against ``trajectory_datums``, and
``weigh_datums`` (a call's loss weights at once) against ``weigh_datum``, byte for byte.

The reference is the per-trajectory path, run on each trajectory alone; the
groups are random (hypothesis): shared or different prompts, empty and
one-token prompts and answers, raw and processed logprobs (the
temperature / top_k / top_p inputs), versions, signed zeros and NaN
logprobs, negative advantages, with and without the ``mask`` input, and
multi-turn, empty or irregular trajectories mixed in (those take the
per-trajectory path inside ``group_datums`` too).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlengine.errors import InvalidRequest
from rlengine.rl.advantages import SampledDatum, group_datums, trajectory_datums, weigh_datum, weigh_datums
from rlengine.rl.types import Observation, Trajectory, TrajectoryGroup, Transition
from rlengine.types import LogprobTransform, ModelInput, SampledSequence, TensorData

_encode = msgspec.msgpack.Encoder().encode

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=6)
transforms = st.none() | st.builds(
    LogprobTransform, temperature=st.floats(0.01, 10.0), top_k=st.integers(-1, 2**40).filter(lambda k: k != 0),
    top_p=st.floats(0.01, 1.0))


@st.composite
def actions(draw: st.DrawFn, irregular: bool = False) -> SampledSequence:
    tokens = draw(token_ids)
    n = len(tokens)
    logprobs = draw(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=n, max_size=n))
    versions = draw(st.lists(st.integers(-1, 2**31 - 1), min_size=n, max_size=n))
    if irregular and draw(st.booleans()):
        versions = []  # an action that carries no versions: the per-trajectory path's business
    return SampledSequence(stop_reason=draw(st.sampled_from(["stop", "length"])),
                           tokens_raw=np.array(tokens, np.int32).tobytes(),
                           logprobs_raw=np.array(logprobs, np.float32).tobytes(),
                           versions_raw=np.array(versions, np.int32).tobytes(),
                           logprobs_transform=draw(transforms))


def turn(prompt: list[int], action: SampledSequence) -> Transition:
    return Transition(observation=Observation(prompt=ModelInput.from_ints(prompt)), action=action, reward=0.0,
                      done=True)


@st.composite
def trajectories(draw: st.DrawFn, shared: list[int] | None) -> Trajectory:
    kind = draw(st.sampled_from(["single"] * 6 + ["multi", "empty", "irregular"]))
    if kind == "empty":
        return Trajectory(transitions=[])
    prompt = shared if shared is not None else draw(token_ids)
    if kind == "multi":
        first = draw(actions())
        # The next observation extends the context (one datum) or rewrites it (a new one).
        context = prompt + first.tokens + draw(token_ids) if draw(st.booleans()) else draw(token_ids)
        return Trajectory(transitions=[turn(prompt, first), turn(context, draw(actions()))])
    return Trajectory(transitions=[turn(prompt, draw(actions(irregular=kind == "irregular")))])


@st.composite
def groups(draw: st.DrawFn) -> tuple[list[Trajectory], list[float]]:
    shared = draw(st.none() | token_ids)
    members = draw(st.lists(trajectories(shared), min_size=1, max_size=8))
    advantages = draw(st.lists(st.floats(-1e6, 1e6) | st.sampled_from([0.0, -0.0]), min_size=len(members),
                               max_size=len(members)))
    return members, advantages


def assert_same(got: list[SampledDatum], want: list[SampledDatum]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _encode(g.datum) == _encode(w.datum)  # every field, key order, dtype and byte
        assert g.datum == w.datum
        for a, b in ((g.mask, w.mask), (g.versions, w.versions)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=groups(), with_mask=st.booleans())
def test_group_datums_equal_the_per_trajectory_datums_byte_for_byte(group, with_mask):
    members, advantages = group
    got = group_datums(members, advantages, with_mask=with_mask)
    assert len(got) == len(members)
    # The group's version span, read over all its actions at once, is its trajectories' spans joined.
    spans = [v for v in (t.versions() for t in members) if v is not None]
    assert TrajectoryGroup(trajectories=members, group_rewards=[0.0] * len(members)).versions() == (
        (min(v[0] for v in spans), max(v[1] for v in spans)) if spans else None)
    for trajectory, advantage, datums in zip(members, advantages, got):
        assert_same(datums, trajectory_datums(trajectory, advantage, with_mask=with_mask))


def test_a_copy_group_is_made_at_once_with_its_columns_where_the_answers_are():
    """The recipe's case by hand: one 4-token prompt, answers of 1 to 4 tokens, one of them processed."""
    prompt = [5, 6, 7, 8]
    answers = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]
    members = [Trajectory(transitions=[turn(prompt, SampledSequence(
        stop_reason="stop", tokens_raw=np.array(a, np.int32).tobytes(),
        logprobs_raw=np.full(len(a), -0.25, np.float32).tobytes(), versions_raw=np.full(len(a), 7, np.int32).tobytes(),
        logprobs_transform=LogprobTransform(temperature=0.5, top_k=3) if i == 3 else None))])
        for i, a in enumerate(answers)]
    got = group_datums(members, [1.0, -2.0, 0.5, 3.0], with_mask=True)
    last = got[3][0]
    inputs = {k: v.to_numpy() for k, v in last.datum.loss_fn_inputs.items()}
    assert last.datum.model_input.to_ints() == [5, 6, 7, 8, 7, 8, 9]
    assert inputs["target_tokens"].tolist() == [6, 7, 8, 7, 8, 9, 10]
    assert inputs["advantages"].tolist() == [0, 0, 0, 3, 3, 3, 3]
    assert inputs["temperature"].tolist() == [1, 1, 1, 0.5, 0.5, 0.5, 0.5]
    assert inputs["top_k"].tolist() == [0, 0, 0, 3, 3, 3, 3]
    assert last.versions.tolist() == [-1, -1, -1, 7, 7, 7, 7]
    # Before a negative advantage the unsampled positions hold -0.0, as the datum's own product does.
    assert np.signbit(got[1][0].datum.loss_fn_inputs["advantages"].to_numpy()[:3]).all()
    assert "temperature" not in got[0][0].datum.loss_fn_inputs
    for trajectory, advantage, datums in zip(members, [1.0, -2.0, 0.5, 3.0], got):
        assert_same(datums, trajectory_datums(trajectory, advantage, with_mask=True))


def test_a_negative_token_id_is_refused_as_the_per_trajectory_path_refuses_it():
    bad = SampledSequence(stop_reason="stop", tokens_raw=np.array([3, -4, 5], np.int32).tobytes(),
                          logprobs_raw=np.zeros(3, np.float32).tobytes(), versions_raw=np.zeros(3, np.int32).tobytes())
    members = [Trajectory(transitions=[turn([1, 2], bad)])] * 2
    with pytest.raises(InvalidRequest) as want:
        trajectory_datums(members[0], 1.0, with_mask=False)
    with pytest.raises(InvalidRequest) as got:
        group_datums(members, [1.0, -1.0], with_mask=False)
    assert str(got.value) == str(want.value) and "ModelInput.tokens" in str(got.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=groups(), with_mask=st.booleans(), data=st.data())
def test_weigh_datums_equal_weigh_datum_byte_for_byte(group, with_mask, data):
    members, advantages = group
    datums = [d.datum for made in group_datums(members, advantages, with_mask=with_mask) for d in made]
    weights = data.draw(st.lists(st.floats(0.0, 1e3) | st.just(0.0), min_size=len(datums), max_size=len(datums)))
    got = weigh_datums(datums, weights)
    assert [_encode(d) for d in got] == [_encode(weigh_datum(d, w)) for d, w in zip(datums, weights)]


def test_tensor_parts_are_the_slices_and_bad_lengths_are_refused_by_name():
    parts = TensorData.from_numpy_parts(np.arange(6, dtype=np.int64), [2, 0, 4])
    assert parts == [TensorData.from_numpy(np.arange(6)[a:b]) for a, b in ((0, 2), (2, 2), (2, 6))]
    for lengths in ([2, 3], [7, -1]):
        with pytest.raises(InvalidRequest) as info:
            TensorData.from_numpy_parts(np.zeros(6, np.float32), lengths)
        assert info.value.field == "lengths" and str(lengths) in str(info.value)
