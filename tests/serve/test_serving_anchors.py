"""Serving as its anchors serve: the official ``openai`` and ``anthropic`` clients, unchanged.

* a ``max_tokens`` the context cannot hold after the prompt is a 400
  ``context_length_exceeded`` naming the field, its value and the limit (as
  OpenAI answers it), on every API, streamed or not, also when the prompt is
  tokenized off the loop; the engine's own API still ends such a completion
  at the context (stop reason ``length``);
* ``GET /health`` needs no key, ``GET /v1/models`` does;
* the trace read-back answers the documented fields, 403 for a wrong token
  and 404 for an unknown session;
* the demo script runs an agent's tool round trip (``rlengine serve --demo``: test_serve_cli.py).
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from serving import WAIT, Served, demo_tool_round_trip, sim_config

import rlengine as rle
from rlengine.serve import ServeConfig

USER = [{"role": "user", "content": "hello"}]
CONTEXT = 4096  # SimConfig's max_model_len
PROMPT = len(b"<user>\nhello\n</user>\n<assistant>\n")  # the sim's byte renderer: a token per byte


@pytest.fixture(scope="module")
def served():
    s = Served([sim_config()], ServeConfig(ipc=False))
    yield s
    s.close()


def assert_context_error(error: dict, field: str, value: int) -> None:
    """OpenAI's shape of the error: its type and code, the field, its value and the limit."""
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded", error
    assert error["param"] == field and error["value"] == repr(value), error
    assert f"maximum context length is {CONTEXT} tokens" in error["message"], error
    assert f"{PROMPT} in the prompt, {value} in the completion" in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_over_the_context_is_400(client, field, stream):
    value = CONTEXT - PROMPT + 1
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="sim", messages=USER, stream=stream, **{field: value})
    assert_context_error(info.value.body, field, value)


def test_max_tokens_that_just_fits_is_served(client):
    reply = client.chat.completions.create(model="sim", messages=USER, max_tokens=CONTEXT - PROMPT, seed=1)
    assert reply.choices[0].finish_reason == "length"


def test_a_session_turn_and_a_long_prompt_rendered_off_the_loop_are_refused_alike(served, client):
    opened = client.post("/sessions", body={}, cast_to=object)
    headers = {"X-Session-ID": opened["session_id"], "X-Session-Token": opened["token"]}
    served.sessions.offload_chars = 1  # every turn tokenized on the render thread
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="sim", messages=USER, max_tokens=CONTEXT, extra_headers=headers)
    finally:
        served.sessions.offload_chars = 8192
    assert_context_error(info.value.body, "max_tokens", CONTEXT)
    trace = client.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                       options={"headers": {"X-Session-Token": opened["token"]}})
    assert trace["turns"] == 0 and trace["trajectories"] == []


def test_anthropic_max_tokens_over_the_context_is_400(served):
    with anthropic.Anthropic(base_url=served.http_url.removesuffix("/v1"), api_key=served.api_key, max_retries=0,
                             timeout=WAIT) as claude:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model="sim", max_tokens=32_000, messages=USER)
        error = info.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens", error
        assert "context_length_exceeded" in error["message"] and "32000 in the completion" in error["message"]
        assert claude.messages.create(model="sim", max_tokens=8, messages=USER).stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_max_output_tokens_over_the_context_is_400(client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="sim", input="hello", max_output_tokens=10 * CONTEXT, stream=stream)
    assert info.value.body["param"] == "max_output_tokens" and info.value.body["code"] == "context_length_exceeded"


def test_the_engines_own_api_still_ends_at_the_context(served):
    """The engine's Python API ends a completion at the context, stop reason ``length``, as
    vLLM's engine does: the RL loop's multi-turn episodes rely on it near the context's end."""
    seq = served.engines[0].sample([1] * (CONTEXT - 3), 1, rle.SamplingParams(max_tokens=50)).result(WAIT).sequences[0]
    assert seq.stop_reason == "length" and len(seq.tokens) == 3


def test_health_is_open_and_models_need_the_key(served):
    health = httpx.get(served.http_url.removesuffix("/v1") + "/health", timeout=WAIT)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(f"{served.http_url}/models", timeout=WAIT).status_code == 401
    keyed = httpx.get(f"{served.http_url}/models", headers={"Authorization": f"Bearer {served.api_key}"}, timeout=WAIT)
    assert keyed.status_code == 200


def test_the_trace_read_back_has_its_documented_fields_and_refuses_others(served, client):
    opened = client.post("/sessions", body={}, cast_to=object)
    sid, token = opened["session_id"], opened["token"]
    client.chat.completions.create(model="sim", messages=USER, max_tokens=4, seed=1,
                                   extra_headers={"X-Session-ID": sid, "X-Session-Token": token})
    client.post(f"/sessions/{sid}/reward", body={"value": 0.5}, cast_to=object,
                options={"headers": {"X-Session-Token": token}})
    trace = client.get(f"/sessions/{sid}/trace", cast_to=object, options={"headers": {"X-Session-Token": token}})
    assert set(trace) == {"session_id", "turns", "tainted", "constrained", "trajectories", "roles"}
    assert (trace["session_id"], trace["turns"], trace["tainted"], trace["constrained"], trace["roles"]) == (
        sid, 1, False, [], {})  # no turn named a role
    [traj] = trace["trajectories"]
    assert set(traj) == {"tokens", "logprobs", "versions", "loss_mask", "shared_prefix", "reward", "segments"}
    n = len(traj["tokens"])
    assert n == PROMPT + 4 and len(traj["logprobs"]) == len(traj["versions"]) == len(traj["loss_mask"]) == n
    assert traj["loss_mask"] == [0] * PROMPT + [1] * 4 and traj["versions"][:PROMPT] == [-1] * PROMPT
    assert traj["reward"] == 0.5
    assert [(g["start"], g["end"], g["kind"]) for g in traj["segments"]] == [(0, PROMPT, "prompt"),
                                                                             (PROMPT, n, "sampled")]
    with pytest.raises(openai.PermissionDeniedError):
        client.get(f"/sessions/{sid}/trace", cast_to=object, options={"headers": {"X-Session-Token": "wrong"}})
    with pytest.raises(openai.NotFoundError):
        client.get("/sessions/nobody/trace", cast_to=object, options={"headers": {"X-Session-Token": token}})


# -- the demo script ------------------------------------------------------------------------------------------

@pytest.mark.model_plane
def test_the_demo_script_runs_a_tool_round_trip(model_cache):
    demo = Served([rle.EngineConfig(backend="scripted", model="tiny", model_name="tiny", cache_dir=model_cache,
                                    engine_args={"script": "demo"})], ServeConfig(ipc=False))
    try:
        with openai.OpenAI(base_url=demo.http_url, api_key=demo.api_key, max_retries=0, timeout=WAIT) as client:
            demo_tool_round_trip(client, "tiny")
    finally:
        demo.close()
