"""Agent roles over HTTP: the ``X-RLEngine-Role`` header names each call's role in a session.

Two agents (a hint-giver that does not train, a guesser that does) talk
through one session with the official ``openai`` client, unchanged: the
session's trace comes back split per role, the untrainable role's tokens
out of the loss mask, and the per-role trajectories (``role_trajectories``)
put none of the hint-giver's tokens into the training datums. Bad role
values are 400s naming the header and the value.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from serving import http_trace, open_http_session, openai_client, script, script_tokens, scripted

from rlengine.errors import InvalidRequest
from rlengine.rl.batch import prepare_group
from rlengine.rl.config import TrainConfig
from rlengine.rl.multi_agent import role_trajectories
from rlengine.rl.types import Agent, TrajectoryGroup
from rlengine.validation import MAX_ROLE_CHARS

pytestmark = pytest.mark.model_plane  # the scripted backend serves the tiny model's tokenizer

ROLE = "X-RLEngine-Role"
AGENTS = [Agent(role="hinter", trainable=False), Agent(role="guesser")]


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache)
    yield s
    s.close()


def _open(served, roles=None) -> dict[str, str]:
    """A session opened by the trainer (declaring ``roles``): its HTTP headers."""
    session = served.call(served.sessions.open, None, roles)
    return {"X-Session-ID": session.session_id, "X-Session-Token": session.token}


def _say(client, headers, role, text, stream=False) -> str:
    extra = {**headers, ROLE: role} if role is not None else headers
    messages = [{"role": "user", "content": f"{role}: your turn"}]
    if stream:
        chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True,
                                                extra_headers=extra)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, extra_headers=extra)
    return reply.choices[0].message.content


def _masked(trajectory) -> list[int]:
    mask = np.frombuffer(trajectory.loss_mask_raw, dtype=np.uint8).astype(bool)
    return trajectory.tokens[mask].tolist()


def test_a_session_is_split_per_role_and_the_untrainable_role_never_trains(served, client):
    script(served, "hint five", "guess five")
    hint, guess = script_tokens(served, "hint five"), script_tokens(served, "guess five")
    episodes = []
    for reward in (1.0, 0.0):
        headers = _open(served, {"guesser": True, "hinter": False})
        assert _say(client, headers, "hinter", "") == "hint five"
        assert _say(client, headers, "guesser", "", stream=True) == "guess five"  # the streamed path records it too
        trace = served.call(served.sessions.collect, headers["X-Session-ID"])
        assert set(trace.by_role) == {"hinter", "guesser"} and trace.untrainable == {"hinter"}
        # Two conversations in one session: two branches; each role's view masks its own tokens only.
        assert sorted(t for view in trace.by_role["hinter"].trajectories for t in _masked(view)) == sorted(hint)
        assert sorted(t for view in trace.by_role["guesser"].trajectories for t in _masked(view)) == sorted(guess)
        # The whole trace's loss mask leaves the untrainable role out.
        assert sorted(t for view in trace.trajectories for t in _masked(view)) == sorted(guess)
        episodes.append(role_trajectories(trace, AGENTS, {"guesser": reward, "hinter": 1.0}))
    group = TrajectoryGroup(trajectories=[t for e in episodes for t in e], group_rewards=[0.0] * 4)
    assert [(t.role, t.trainable, t.step_reward) for t in group.trajectories] == [
        ("hinter", False, 1.0), ("guesser", True, 1.0), ("hinter", False, 1.0), ("guesser", True, 0.0)]
    prepared = prepare_group(TrainConfig(), group)
    assert prepared.verdict.kept == [1, 3]
    trained = [d.datum.loss_fn_inputs["target_tokens"].to_numpy()[d.mask > 0].tolist() for _, _, d in prepared.datums]
    assert trained == [guess, guess]


def test_roles_without_a_declaration_are_free_and_all_train(served, client):
    script(served, "a", "b")
    headers = _open(served)
    _say(client, headers, "planner", "")
    _say(client, headers, "coder", "")
    trace = served.call(served.sessions.collect, headers["X-Session-ID"])
    assert set(trace.by_role) == {"planner", "coder"} and trace.untrainable == frozenset()
    assert sorted(t for view in trace.trajectories for t in _masked(view)) == sorted(
        script_tokens(served, "a") + script_tokens(served, "b"))


def test_a_session_without_roles_exports_as_before(served, client):
    script(served, "plain")
    headers = _open(served)
    _say(client, headers, None, "")
    trace = served.call(served.sessions.collect, headers["X-Session-ID"])
    assert trace.by_role == {} and trace.untrainable == frozenset()


@pytest.mark.parametrize(("roles", "value", "fragment"), [
    (None, "", "non-empty"),
    (None, "x" * (MAX_ROLE_CHARS + 1), f"at most {MAX_ROLE_CHARS}"),
    ({"guesser": True}, "referee", "not a declared role (declared: guesser)"),
    ({"guesser": True}, None, "required"),
    ("stateless", "guesser", "has none"),
])
def test_a_bad_role_is_a_400_naming_the_header_and_the_value(served, client, roles, value, fragment):
    headers = {} if roles == "stateless" else _open(served, roles)
    extra = headers if value is None else {**headers, ROLE: value}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_headers=extra)
    error = info.value.body
    assert error["param"] == ROLE and fragment in error["message"], error
    assert repr(value)[:40] in error["message"]


def test_a_bad_declaration_is_refused_naming_roles(served):
    with pytest.raises(InvalidRequest, match=r"^roles='': must be a non-empty"):
        served.call(served.sessions.open, None, {"": True})
    with pytest.raises(InvalidRequest, match=r"^roles=.*a bool"):
        served.call(served.sessions.open, None, {"guesser": "yes"})


def test_a_framework_agent_declares_its_roles_over_http_and_reads_the_trace_per_role(served):
    """All over HTTP, as an agent framework outside the trainer's process does it: ``POST /v1/sessions``
    with ``roles``, each turn on the session's own base_url naming its role, ``GET .../trace``."""
    import openai

    said = {"hinter": "hint seven", "guesser": "guess seven"}
    script(served, *said.values())
    opened = open_http_session(served, roles={"hinter": False, "guesser": True})
    with openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=60) as agent:
        for role in ("hinter", "guesser"):
            reply = agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": role}],
                                                  max_tokens=16, extra_headers={ROLE: role})
            assert reply.choices[0].message.content == said[role]
        with pytest.raises(openai.BadRequestError, match="referee"):  # the declaration holds on this path too
            agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          extra_headers={ROLE: "referee"})
    trace = http_trace(served, opened)

    def masked(views):
        return sorted(t for v in views for t, m in zip(v["tokens"], v["loss_mask"]) if m)

    assert set(trace["roles"]) == {"hinter", "guesser"}
    assert masked(trace["roles"]["hinter"]) == sorted(script_tokens(served, "hint seven"))
    assert masked(trace["roles"]["guesser"]) == sorted(script_tokens(served, "guess seven"))
    assert masked(trace["trajectories"]) == sorted(script_tokens(served, "guess seven"))  # the hinter never trains


def test_a_bad_roles_declaration_over_http_is_a_400_naming_roles(served):
    with openai_client(served) as c, pytest.raises(openai.BadRequestError) as info:
        c.post("/sessions", body={"roles": {"": True}}, cast_to=object)
    assert info.value.body["param"] == "roles", info.value.body
