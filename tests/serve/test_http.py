"""The OpenAI-compatible HTTP server (rlengine.serve.http), tested with the official ``openai`` client.

Mostly on the sim backend, whose byte vocabulary gets a plain-text chat
template (``ByteRenderer``): fast, and every path of the server is real.
One test runs the tiny model for streaming over a real tokenizer. Bad
requests come from ``http.client`` over raw connections; a fuzz posts
arbitrary bodies and headers (``RLENGINE_FUZZ_EXAMPLES``, 1000 by default)
and requires a well-formed answer, never a 500, and a server still serving.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from urllib.parse import urlparse

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import WAIT, Served, sim_config

import rlengine as rle
from rlengine.serve import ServeConfig

FUZZ_EXAMPLES = int(os.environ.get("RLENGINE_FUZZ_EXAMPLES", "1000"))


@pytest.fixture(scope="module")
def served():
    s = Served([sim_config()], ServeConfig())
    yield s
    s.close()


_clients: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _clients:
        _clients.pop().close()


def oai(served, api_key=None, **headers) -> openai.OpenAI:
    """An ``openai`` client of the server's base URL, with its key (or ``api_key``)."""
    client = openai.OpenAI(base_url=served.http_url, api_key=api_key or served.api_key, max_retries=0, timeout=WAIT,
                           default_headers=headers or None)
    _clients.append(client)
    return client


def key_header(served) -> dict[str, str]:
    """The server's API key as the ``openai`` client sends it (none with ``no_auth``)."""
    return {"Authorization": f"Bearer {served.api_key}"} if served.api_key else {}


def raw_request(served, method, path, body=None, headers=None, timeout=WAIT, auth=True):
    """``method path`` over a raw connection, with the server's key unless ``auth=False``."""
    url = urlparse(served.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       **(key_header(served) if auth else {}), **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def open_session(served, session_id=None):
    status, body = raw_request(served, "POST", "/v1/sessions", {"session_id": session_id} if session_id else None)
    assert status == 200, body
    return body["session_id"], body["token"]


def sid_headers(sid, token):
    return {"X-Session-ID": sid, "X-Session-Token": token}


USER = [{"role": "user", "content": "hello"}]


def test_models_lists_the_served_model(served):
    models = oai(served).models.list()
    assert [m.id for m in models.data] == ["sim"]


def test_binds_loopback_by_default(served):
    assert urlparse(served.http_url).hostname == "127.0.0.1"


def test_a_stateless_completion_is_not_traced(served):
    before = served.on_loop(lambda: len(served.sessions.store))
    r = oai(served).chat.completions.create(model="sim", messages=USER, max_tokens=5, seed=1)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(b"<user>\nhello\n</user>\n<assistant>\n")
    assert served.on_loop(lambda: len(served.sessions.store)) == before


def test_session_turns_from_header_or_body_are_traced_exactly(served):
    sid, token = open_session(served)
    client = oai(served, **sid_headers(sid, token))
    messages = list(USER)
    r1 = client.chat.completions.create(model="sim", messages=messages, max_tokens=6, seed=2, logprobs=True)
    assert r1.model_extra["session_id"] == sid
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "more"}]
    r2 = oai(served).chat.completions.create(model="sim", messages=messages, max_tokens=4, seed=3,
                                             extra_body={"session_id": sid, "session_token": token})
    status, trace = raw_request(served, "GET", f"/v1/sessions/{sid}/trace", headers={"X-Session-Token": token})
    assert status == 200
    [traj] = trace["trajectories"]
    sampled = [t for t, m in zip(traj["tokens"], traj["loss_mask"]) if m]
    assert len(sampled) == 10 and traj["tokens"][:r1.usage.prompt_tokens] == list(
        b"<user>\nhello\n</user>\n<assistant>\n")
    assert r2.usage.prompt_tokens == len(traj["tokens"]) - 4
    lps = [lp.logprob for lp in r1.choices[0].logprobs.content]
    assert lps == pytest.approx([lp for lp, m in zip(traj["logprobs"], traj["loss_mask"]) if m][:6])


def test_streaming_deltas_add_up_to_the_completion(served):
    sid, token = open_session(served)
    client = oai(served, **sid_headers(sid, token))
    whole = client.chat.completions.create(model="sim", messages=USER, max_tokens=12, seed=9)
    chunks = list(client.chat.completions.create(model="sim", messages=USER, max_tokens=12, seed=9, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really incremental


@pytest.mark.model_plane
def test_streaming_over_a_real_tokenizer(engine_config):
    s = Served([engine_config("torch")], ServeConfig(ipc=False))
    try:
        sid, token = open_session(s)
        client = oai(s, **sid_headers(sid, token))
        whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=4)
        chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=4,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        trajectories = s.on_loop(lambda: s.sessions.store.export(sid))
        assert len(trajectories) == 1  # the same seed sampled the same tokens: one stored path
    finally:
        s.close()


@pytest.mark.parametrize("make_error, status, error_type", [
    (lambda c, sid, tok: c.with_options(default_headers=sid_headers("nobody", tok)), 404, openai.NotFoundError),
    (lambda c, sid, tok: c.with_options(default_headers=sid_headers(sid, "wrong")), 403, openai.PermissionDeniedError),
])
def test_session_errors_have_their_status(served, make_error, status, error_type):
    sid, token = open_session(served)
    client = make_error(oai(served), sid, token)
    _clients.append(client)
    with pytest.raises(error_type) as info:
        client.chat.completions.create(model="sim", messages=USER, max_tokens=2)
    assert info.value.status_code == status


def test_a_sessions_own_base_url_takes_its_token_as_the_api_key(served):
    """A harness that can only set base_url and api_key is traced: both come from POST /v1/sessions."""
    status, opened = raw_request(served, "POST", "/v1/sessions", None)
    assert status == 200 and opened["base_url"] == f"{served.http_url.removesuffix('/v1')}/sessions/" \
        f"{opened['session_id']}/v1"
    client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
    _clients.append(client)
    assert client.models.list().data[0].id == "sim"
    reply = client.chat.completions.create(model="sim", messages=USER, max_tokens=3)
    assert reply.session_id == opened["session_id"]
    trace = served.on_loop(lambda: served.sessions.trace(served.sessions.authorize(opened["session_id"],
                                                                                     opened["token"])))
    assert trace.turns == 1 and len(trace.trajectories) == 1
    status, _ = raw_request(served, "POST", f"/sessions/{opened['session_id']}/v1/chat/completions",
                            {"messages": USER, "max_tokens": 2}, headers={"x-api-key": opened["token"]}, auth=False)
    assert status == 200  # Anthropic-style key header too
    wrong = openai.OpenAI(base_url=opened["base_url"], api_key="not-the-token", max_retries=0, timeout=WAIT)
    _clients.append(wrong)
    with pytest.raises(openai.PermissionDeniedError):
        wrong.chat.completions.create(model="sim", messages=USER, max_tokens=2)


def test_with_a_server_key_a_sessions_base_url_still_takes_the_session_token():
    s = Served([sim_config()], ServeConfig(ipc=False, api_key="server-secret"))
    try:
        admin = openai.OpenAI(base_url=s.http_url, api_key="server-secret", max_retries=0, timeout=WAIT)
        opened = admin.post("/sessions", body={}, cast_to=object)
        agent = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
        assert agent.chat.completions.create(model="sim", messages=USER, max_tokens=2).choices[0].message.content
        stranger = openai.OpenAI(base_url=s.http_url, api_key=opened["token"], max_retries=0, timeout=WAIT)
        with pytest.raises(openai.AuthenticationError):  # the session token opens no other door
            stranger.chat.completions.create(model="sim", messages=USER, max_tokens=2)
        for c in (admin, agent, stranger):
            c.close()
    finally:
        s.close()


def test_a_retired_session_is_410_gone(served):
    sid, token = open_session(served)
    client = oai(served, **sid_headers(sid, token))
    client.chat.completions.create(model="sim", messages=USER, max_tokens=2)
    status, _ = raw_request(served, "DELETE", f"/v1/sessions/{sid}", headers={"X-Session-Token": token})
    assert status == 200
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="sim", messages=USER, max_tokens=2)
    assert info.value.status_code == 410 and info.value.body["code"] == "gone"
    assert raw_request(served, "POST", "/v1/sessions", {"session_id": sid})[0] == 410


@pytest.mark.parametrize("kwargs, fragment", [
    ({"messages": []}, "messages"),
    ({"messages": USER, "temperature": -1.0}, "temperature"),
    ({"messages": USER, "model": "gpt-4"}, "model"),
    ({"messages": USER, "n": 0}, "n=0"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user"}]}, "content"),
])
def test_bad_requests_are_400_naming_the_field(served, kwargs, fragment):
    kwargs = {"model": "sim", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai(served).chat.completions.create(**kwargs)
    assert fragment in info.value.body["message"]


def test_malformed_and_oversize_bodies(served):
    assert raw_request(served, "POST", "/v1/chat/completions", b"{not json")[0] == 400
    assert raw_request(served, "POST", "/v1/chat/completions", {"messages": "hi"})[0] == 400
    status, body = raw_request(served, "POST", "/v1/chat/completions", b"x" * (17 << 20))
    assert status == 413 and body["error"]["code"] == "frame_too_large"
    assert raw_request(served, "GET", "/v1/nothing-here")[0] == 404
    assert oai(served).models.list().data  # still serving


def test_bearer_token_is_required_when_configured():
    s = Served([sim_config()], ServeConfig(ipc=False, api_key="sekret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            oai(s, api_key="wrong").models.list()
        assert raw_request(s, "GET", "/v1/models", auth=False)[0] == 401
        ok = oai(s, api_key="sekret")
        assert ok.chat.completions.create(model="sim", messages=USER, max_tokens=2).choices
    finally:
        s.close()


def test_a_loopback_server_draws_a_key_refuses_requests_without_it_and_removes_its_file(tmp_path, monkeypatch):
    """Other users of a shared machine reach loopback too: no api_key means a drawn one, not open access."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = Served([sim_config()], ServeConfig(ipc=False))
    try:
        port = urlparse(s.http_url).port
        key_file = tmp_path / "rlengine" / f"http-{port}.key"
        assert s.server.key_file == str(key_file)
        assert os.stat(key_file.parent).st_mode & 0o777 == 0o700 and os.stat(key_file).st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert key == s.api_key and len(key) >= 40
        status, body = raw_request(s, "GET", "/v1/models", auth=False)
        assert status == 401 and body["error"]["code"] == "unauthorized"
        with pytest.raises(openai.AuthenticationError):
            oai(s, api_key="guess").chat.completions.create(model="sim", messages=USER, max_tokens=2)
        assert oai(s, api_key=key).chat.completions.create(model="sim", messages=USER, max_tokens=2).choices
        # A session's own base URL still takes the session's token, not the server's key.
        opened = oai(s, api_key=key).post("/sessions", body={}, cast_to=object)
        agent = openai.OpenAI(base_url=opened["base_url"], api_key=opened["token"], max_retries=0, timeout=WAIT)
        _clients.append(agent)
        assert agent.chat.completions.create(model="sim", messages=USER, max_tokens=2).choices
    finally:
        s.close()
    assert not key_file.exists()


def test_a_key_file_may_be_named_and_is_never_overwritten(tmp_path):
    named = tmp_path / "my.key"
    s = Served([sim_config()], ServeConfig(ipc=False, key_file=str(named)))
    try:
        assert s.server.key_file == str(named) and os.stat(named).st_mode & 0o777 == 0o600
        assert named.read_text().strip() == s.api_key
        with pytest.raises(rle.ConfigurationError, match="key_file=.*my.key.*exists"):
            Served([sim_config()], ServeConfig(ipc=False, key_file=str(named)))
    finally:
        s.close()
    assert not named.exists()


def test_a_private_key_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "rlengine").mkdir(mode=0o755)
    os.chmod(tmp_path / "rlengine", 0o755)
    with pytest.raises(rle.ConfigurationError, match="key directory .*rlengine.*mode 755"):
        Served([sim_config()], ServeConfig(ipc=False))


def test_no_auth_accepts_any_request_and_draws_no_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = Served([sim_config()], ServeConfig(ipc=False, no_auth=True))
    try:
        assert (s.api_key, s.server.key_file) == (None, None) and not (tmp_path / "rlengine").exists()
        assert raw_request(s, "GET", "/v1/models", auth=False)[0] == 200
        assert oai(s, api_key="anything").chat.completions.create(model="sim", messages=USER, max_tokens=2).choices
    finally:
        s.close()


def _start_and_vanish(served, sid: str, token: str, stream: bool) -> None:
    """Start a long turn over a raw socket and close it mid-generation (after the 200 when streamed)."""
    url = urlparse(served.http_url)
    body = json.dumps({"model": "sim", "messages": USER, "max_tokens": 4000, "stream": stream}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=WAIT)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {served.api_key}\r\n".encode()
                 + f"X-Session-ID: {sid}\r\nX-Session-Token: {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # tokens have reached the client
    else:
        deadline = time.monotonic() + WAIT
        while served.on_loop(lambda: served.sessions.in_flight) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # admitted and generating
    sock.close()


def _wait(predicate) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_client_gone_before_any_output_is_an_aborted_turn_and_installs_go_on(served):
    sid, token = open_session(served)
    _start_and_vanish(served, sid, token, stream=False)
    _wait(lambda: served.on_loop(lambda: served.sessions.in_flight) == 0)
    assert served.on_loop(served.engines[0].scheduler.unknown_leases) == []
    served.install(seed=21)  # the gate is not poisoned: nothing reached the client
    assert served.on_loop(lambda: served.sessions.store.export(sid)) == []  # nothing recorded
    assert served.on_loop(served.sessions.trace, served.on_loop(served.sessions.authorize, sid, token)).tainted is False


def test_a_client_gone_mid_stream_taints_its_session_and_installs_go_on(served):
    sid, token = open_session(served)
    _start_and_vanish(served, sid, token, stream=True)
    _wait(lambda: served.on_loop(lambda: served.sessions.in_flight) == 0)
    assert served.on_loop(served.engines[0].scheduler.unknown_leases) == []  # aborted and settled
    assert served.install(seed=23) >= 1
    trace = oai(served).get(f"/sessions/{sid}/trace", cast_to=object, options={"headers": {"X-Session-Token": token}})
    assert trace["tainted"] is True and trace["trajectories"] == []  # tokens reached the client, none recorded
    # The session itself goes on.
    reply = oai(served).chat.completions.create(model="sim", messages=USER, max_tokens=2,
                                                extra_headers={"X-Session-ID": sid, "X-Session-Token": token})
    assert reply.choices[0].finish_reason == "length"


def test_an_unknown_lease_is_listed_and_written_off_by_an_operator():
    # Client disconnects leave none (above); an embedder that gives up on a turn does.
    s = Served([sim_config()], ServeConfig(ipc=False))
    try:
        engine = s.engines[0]
        turn = s.on_loop(lambda: s.sessions.chat(None, USER, rle.SamplingParams(max_tokens=5000)))
        _wait(lambda: engine.stats()["admitted"] >= 1)
        lease_id = s.on_loop(lambda: engine.abandon(turn.request_id, "the embedder gave up").result(0))
        [listed] = oai(s).get("/admin/leases", cast_to=object)["unknown"]
        assert (listed["replica"], listed["lease_id"], listed["reason"]) == (0, lease_id, "the embedder gave up")
        with pytest.raises(rle.GatePoisoned):
            s.install(seed=21)
        oai(s).post(f"/admin/leases/0/{lease_id}/write_off", cast_to=object)
        assert oai(s).get("/admin/leases", cast_to=object)["unknown"] == []
        assert s.install(seed=22) >= 1
    finally:
        s.close()


# -- fuzz -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server():
    s = Served([sim_config(gen_len=3, step_time_s=0.0)], ServeConfig(ipc=False, max_body_bytes=4096))
    sid, token = open_session(s, "fuzz")
    url = urlparse(s.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT)
    yield s, sid, token, conn
    conn.close()
    s.close()


_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 5000) | st.floats(-3, 3) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3), max_leaves=8)
_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["sim", "other", 3]), "messages": st.one_of(
        _json, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", ""]),
                                               "content": st.one_of(st.text(max_size=8), _json)}), max_size=3)),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 6)), "temperature": st.one_of(_json, st.floats(-1, 3)),
    "top_p": st.floats(-1, 2), "top_k": st.integers(-3, 4), "n": st.integers(-1, 3), "stream": st.booleans(),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "seed": st.integers(-3, 3), "logprobs": st.booleans(), "session_id": st.sampled_from(["fuzz", "zz", 4]),
    "stream_options": _json,
})


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(_fields.map(lambda d: json.dumps(d).encode()), st.binary(max_size=64)),
       path=st.sampled_from(["/v1/chat/completions", "/v1/chat/completions", "/v1/sessions",
                             "/v1/sessions/fuzz/reward", "/v1/models"]),
       use_token=st.booleans(), session_header=st.sampled_from([None, "fuzz", "nobody", "x" * 300]))
def test_fuzz_the_http_handler(fuzz_server, body, path, use_token, session_header):
    served, _sid, token, conn = fuzz_server
    headers = {"Content-Type": "application/json", **key_header(served)}
    if session_header is not None:
        headers["X-Session-ID"] = session_header
    if use_token:
        headers["X-Session-Token"] = token
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
    except (http.client.HTTPException, ConnectionError):
        conn.close()  # a closed keep-alive connection is fine; the next request reconnects
        conn.request("GET", "/v1/models", headers=key_header(served))
        resp = conn.getresponse()
        payload = resp.read()
    assert resp.status in (200, 400, 403, 404, 405, 409, 410, 413), (resp.status, payload[:300])
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        assert payload.endswith(b"data: [DONE]\n\n")
    elif resp.status != 405:
        decoded = json.loads(payload)
        assert ("error" in decoded) == (resp.status >= 400)


def test_a_dead_engine_is_dead_to_health_checks():
    s = Served([sim_config(fail_at_step=3)], ServeConfig())
    try:
        assert oai(s).get("/../health", cast_to=object)["status"] == "ok"
        with pytest.raises(openai.APIStatusError):
            oai(s).chat.completions.create(model="sim", messages=USER, max_tokens=50)
        with pytest.raises(openai.InternalServerError) as info:
            oai(s).get("/../health", cast_to=object)
        assert info.value.status_code == 503 and "injected failure" in str(info.value.body)
        with pytest.raises(openai.InternalServerError):
            oai(s).models.list()
    finally:
        s.close()
