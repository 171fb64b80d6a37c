"""Bad input against the Tinker API server, over raw HTTP: typed errors, and the server keeps serving.

Malformed JSON and protobuf bodies, unknown ids, another API key's sessions
and futures, oversized bodies, endpoints and features rlengine does not
serve, a missing shared secret, full tables and limits: each answers its
status with a body naming the field and value, and ``healthz`` still
answers afterwards. Also the server-side mechanics a well-behaved SDK never
exercises: ``seq_id`` ordering of calls that arrive out of order, replayed
calls, cancellation, try-again long polls, expiring sessions and futures.
"""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest

import rlengine as rle
from rlengine.errors import ConfigurationError
from rlengine.tinker_api import TinkerServerConfig, start
from rlengine.tinker_api.futures import CompletionLog, FuturesTable

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tml-key-a", "tml-key-b"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(engine, ckpt_dir):
    # no_auth: any key is accepted and is its caller's identity (KEY_A's sessions are not KEY_B's).
    srv = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, max_models=2, no_auth=True))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def url(server):
    return server.url


def call(base: str, path: str, body=None, *, key: str | None = KEY_A, raw: bytes | None = None,
         headers: dict[str, str] | None = None, method: str = "POST") -> httpx.Response:
    hdrs = {"X-API-Key": key} if key is not None else {}
    hdrs.update(headers or {})
    content = raw if raw is not None else (None if body is None else msgspec.json.encode(body))
    if content is not None:
        hdrs.setdefault("Content-Type", "application/json")
    return httpx.request(method, f"{base}/api/v1/{path}", content=content, headers=hdrs, timeout=TIMEOUT)


def error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code, body
    assert body["message"]
    return body


def healthy(base: str) -> None:
    assert call(base, "healthz", method="GET").json() == {"status": "ok"}


def session(base: str, key: str = KEY_A) -> str:
    return call(base, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "test"}, key=key
                ).json()["session_id"]


def result(base: str, request_id: str, key: str = KEY_A) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        r = call(base, "retrieve_future", {"request_id": request_id}, key=key)
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{request_id} did not settle")


def base_sampler(base: str, sid: str, seq: int = 0, key: str = KEY_A) -> str:
    r = call(base, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": seq,
                                               "base_model": "tiny"}, key=key)
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def sample_body(ssid: str, seq: int, max_tokens: int = 4, **extra) -> dict:
    return {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 1, **extra.pop("params", {})}, **extra}


def lora_model(base: str, sid: str, seq: int = 0) -> str:
    r = call(base, "create_model", {"session_id": sid, "model_seq_id": seq, "base_model": "tiny",
                                    "lora_config": {"rank": 4, "seed": 0}})
    assert r.status_code == 200, r.text
    assert result(base, r.json()["request_id"])["model_id"] == r.json()["model_id"]
    return r.json()["model_id"]


@pytest.mark.model_plane
def test_malformed_bodies_are_typed_errors(url):
    body = error(call(url, "create_session", raw=b"{not json"), 400, "invalid")
    assert body["field"] == "body" and "malformed JSON" in body["value"]
    body = error(call(url, "create_model", {"session_id": 5, "model_seq_id": 0, "base_model": "tiny"}), 400,
                 "invalid")
    assert "$.session_id" in body["message"]
    sid = session(url)
    body = error(call(url, "forward_backward", raw=b"\x0a\xff\xff\xff",
                      headers={"Content-Type": "application/x-protobuf"}), 400, "invalid")
    assert body["field"].startswith("ForwardBackwardRequest")
    ssid = base_sampler(url, sid)
    image = sample_body(ssid, 1)
    image["prompt"] = {"chunks": [{"type": "image", "data": "AAAA", "format": "png"}]}
    assert error(call(url, "asample", image), 400, "not_supported")["field"] == "prompt.chunks[0].type"
    for field, k in (("topk_sample_logprobs", 21), ("topk_prompt_logprobs", 21), ("topk_prompt_logprobs", -1)):
        body = error(call(url, "asample", sample_body(ssid, 2, **{field: k})), 400, "invalid")
        assert (body["field"], body["value"]) == (field, k)
    body = error(call(url, "asample", sample_body(ssid, 2, prompt_alt_tokens_k=-1)), 400, "invalid")
    assert body["field"] == "prompt_alt_tokens_k" and body["value"] == -1
    body = error(call(url, "asample", sample_body(ssid, 3, params={"temperature": -1.0})), 400, "invalid")
    assert body["field"] == "temperature"
    assert error(call(url, "asample", {**sample_body(ssid, 4), "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [10**6]}]}}), 400, "invalid")["field"] == "prompt"
    healthy(url)


@pytest.mark.model_plane
def test_unknown_ids_are_not_found(url):
    sid = session(url)
    assert error(call(url, "retrieve_future", {"request_id": "nope"}), 404, "not_found")["field"] == "request_id"
    assert error(call(url, "get_info", {"model_id": f"{sid}:train:9"}), 404, "not_found")["field"] == "model_id"
    assert error(call(url, "session_heartbeat", {"session_id": "nope"}), 404, "not_found")["field"] == "session_id"
    body = error(call(url, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                       "model_path": f"tinker://{sid}:train:0/sampler_weights/x"}),
                 404, "not_found")
    assert body["field"] == "path"
    assert error(call(url, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "gpt-9"}),
                 404, "not_found")["field"] == "base_model"
    healthy(url)


@pytest.mark.model_plane
def test_another_keys_sessions_models_and_futures_are_forbidden(url):
    sid = session(url, KEY_A)
    ssid = base_sampler(url, sid, key=KEY_A)
    rid = call(url, "asample", sample_body(ssid, 1)).json()["request_id"]
    assert error(call(url, "retrieve_future", {"request_id": rid}, key=KEY_B), 403, "forbidden")["value"] == rid
    assert error(call(url, "session_heartbeat", {"session_id": sid}, key=KEY_B), 403, "forbidden")
    assert error(call(url, "asample", sample_body(ssid, 2), key=KEY_B), 403, "forbidden")
    assert error(call(url, "cancel_future", {"request_id": rid}, key=KEY_B), 403, "forbidden")
    assert result(url, rid)["type"] == "sample"  # the owner still gets it (JSON: no protobuf Accept)
    healthy(url)


@pytest.mark.model_plane
def test_unserved_endpoints_answer_not_supported(url):
    for method, path in (("POST", "create_custom_loss"), ("POST", "save_weights_external"),
                         ("GET", "billing/usage/events"), ("POST", "auth/token"), ("GET", "no/such/thing")):
        body = error(call(url, path, {}, method=method), 404, "not_supported")
        assert path in body["value"]
    sid = session(url)
    body = error(call(url, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                            "optimizer_config": {"type": "dimuon"}}), 400, "not_supported")
    assert body["field"] == "optimizer_config.type"
    healthy(url)


@pytest.mark.model_plane
def test_known_unserved_features_are_not_supported_and_unknown_names_invalid(url):
    """The SDK's losses and optimizers rlengine lacks answer ``not_supported`` naming them; names the SDK
    does not have either are ``invalid``, naming the field and the value."""
    sid = session(url)
    model_id = lora_model(url, sid)
    body = error(call(url, "forward_backward", _ce_body(model_id, 1, loss_fn="custom")), 400, "not_supported")
    assert (body["field"], body["value"]) == ("loss_fn", "custom") and "custom" in body["message"]
    # stable_reinforce is served, on datums whose provenance names sequences sampled with stability info.
    body = error(call(url, "forward_backward", _ce_body(model_id, 2, loss_fn="stable_reinforce")), 400,
                 "invalid_provenance")
    assert body["field"] == "data[0].loss_fn_input_spans" and "provenance" in body["message"]
    # dro and gspo are served (with default settings); a bad setting is refused by name.
    dro = _ce_body(model_id, 3, loss_fn="dro")
    dro["forward_backward_input"]["loss_fn_config"] = {"beta": -1.0}
    body = error(call(url, "forward_backward", dro), 400, "invalid")
    assert (body["field"], body["value"]) == ("loss_fn_config['beta']", -1.0)
    gspo = _ce_body(model_id, 4, loss_fn="gspo")
    gspo["forward_backward_input"]["loss_fn_config"] = {"clip_low_threshold": 1.5}
    assert error(call(url, "forward_backward", gspo), 400, "invalid")["field"] == "loss_fn_config"
    body = error(call(url, "forward_backward", _ce_body(model_id, 5, loss_fn="ppo2")), 400, "invalid")
    assert (body["field"], body["value"]) == ("loss_fn", "ppo2") and "cross_entropy" in body["message"]
    for seq, (family, status, code) in enumerate((("dimuon", 400, "not_supported"), ("sgd", 400, "invalid")),
                                                 start=6):
        body = error(call(url, "optim_step", {"model_id": model_id, "seq_id": seq,
                                              "optimizer_params": {"type": family}}), status, code)
        assert (body["field"], body["value"]) == ("optimizer_params.type", family)
        body = error(call(url, "create_model", {"session_id": sid, "model_seq_id": seq, "base_model": "tiny",
                                                "optimizer_config": {"type": family}}), status, code)
        assert (body["field"], body["value"]) == ("optimizer_config.type", family)
    body = error(call(url, "create_model", {"session_id": sid, "model_seq_id": 9, "base_model": "tiny",
                                            "lora_config": {"rank": -1}}), 400, "invalid")
    assert (body["field"], body["value"]) == ("lora_config.rank", -1)
    call(url, f"sessions/{sid}/finish", {"reason": {"type": "success"}})
    healthy(url)


@pytest.mark.model_plane
def test_oversized_bodies_and_shared_secret(engine, ckpt_dir):
    small = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, max_body_bytes=4096, api_key="tml-secret"))
    try:
        assert error(call(small.url, "healthz", key=None, method="GET"), 401, "unauthorized")
        assert error(call(small.url, "create_session", {}, key="tml-wrong"), 401, "unauthorized")
        body = error(call(small.url, "create_session", raw=b"[" + b"1," * 4000 + b"1]", key="tml-secret"), 413,
                     "too_large")
        assert body["field"] == "body" and "4096" in body["message"]
        assert call(small.url, "healthz", key="tml-secret", method="GET").status_code == 200
    finally:
        small.close()
    with pytest.raises(ConfigurationError, match="host="):
        TinkerServerConfig(host="0.0.0.0")
    with pytest.raises(ConfigurationError, match="host='0.0.0.0'.*no_auth=True is for loopback only"):
        TinkerServerConfig(host="0.0.0.0", no_auth=True)
    with pytest.raises(ConfigurationError, match="no_auth=True with api_key set"):
        TinkerServerConfig(no_auth=True, api_key="tml-secret")
    with pytest.raises(ConfigurationError, match="key_file='k': only a drawn key is written, and no_auth"):
        TinkerServerConfig(no_auth=True, key_file="k")
    with pytest.raises(ConfigurationError, match="max_futures"):
        TinkerServerConfig(max_futures=0)


def test_a_loopback_server_draws_a_key_and_refuses_every_other(engine_config, ckpt_dir, tmp_path, monkeypatch):
    """Other users of a shared machine reach loopback too: no api_key means a drawn one in a 0600
    file (removed on close), not any key; no_auth is the explicit opt-out."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with rle.Engine(engine_config("sim")) as sim:
        server = start(sim, TinkerServerConfig(checkpoint_dir=ckpt_dir))
        key_file = tmp_path / "rlengine" / f"tinker-{server.url.rsplit(':', 1)[1]}.key"
        try:
            assert server.key_file == str(key_file) and oct(os.stat(key_file).st_mode & 0o777) == "0o600"
            assert oct(os.stat(key_file.parent).st_mode & 0o777) == "0o700"
            key = key_file.read_text().strip()
            assert key == server.api_key and key.startswith("tml-")
            assert error(call(server.url, "create_session", {}, key=None), 401, "unauthorized")
            assert error(call(server.url, "create_session", {}, key=KEY_A), 401, "unauthorized")
            assert session(server.url, key=key)
        finally:
            server.close()
        assert not key_file.exists()
        open_server = start(sim, TinkerServerConfig(checkpoint_dir=ckpt_dir, no_auth=True))
        try:
            assert (open_server.api_key, open_server.key_file) == (None, None)
            assert session(open_server.url, key=KEY_B) and session(open_server.url, key="anything")
        finally:
            open_server.close()


@pytest.mark.model_plane
def test_calls_run_in_seq_id_order_and_replays_get_the_same_id(server, url):
    sid = session(url)
    model_id = lora_model(url, sid)
    fb = {"forward_backward_input": {"loss_fn": "cross_entropy", "data": [
        {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 14, 20]}]},
         "loss_fn_inputs": {"target_tokens": {"data": [9, 14, 20, 33], "dtype": "int64", "shape": [4]}}}]},
          "model_id": model_id, "seq_id": 1}
    # The optimizer step (seq 2) arrives first: it must wait for the gradients of seq 1.
    step = call(url, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}})
    first = call(url, "forward_backward", fb)
    assert step.status_code == first.status_code == 200
    assert call(url, "forward_backward", fb).json()["request_id"] == first.json()["request_id"]
    grads = result(url, first.json()["request_id"])
    assert grads["metrics"]["loss:sum"] > 0 and len(grads["loss_fn_outputs"][0]["logprobs"]["data"]) == 4
    assert result(url, step.json()["request_id"])["metrics"]["grad_norm"] > 0
    stale = call(url, "optim_step", {"model_id": model_id, "seq_id": 0, "adam_params": {}})
    assert error(stale, 400, "invalid")["field"] == "seq_id"
    bad = {**fb, "seq_id": 3}
    bad["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["shape"] = [3]
    assert error(call(url, "forward_backward", bad), 400, "invalid")["field"].endswith(".shape")
    # At this server's limit (max_models=2, both sessions active) a new model waits for a slot; finishing
    # a session frees one.
    other = session(url)
    lora_model(url, other)
    third = call(url, "create_model", {"session_id": other, "model_seq_id": 1, "base_model": "tiny"})
    assert third.status_code == 200 and server.service.registry.waiting == 1
    assert third.json()["model_id"] not in server.service.registry.models
    call(url, f"sessions/{sid}/finish", {"reason": {"type": "success"}})
    assert result(url, third.json()["request_id"])["model_id"] == third.json()["model_id"]
    call(url, f"sessions/{other}/finish", {"reason": {"type": "success"}})
    assert "finished by its client" in error(call(url, "get_info", {"model_id": model_id}), 410, "gone")["message"]
    healthy(url)


@pytest.mark.model_plane
def test_a_full_server_evicts_only_models_of_silent_sessions(engine, ckpt_dir):
    """With every slot taken, a new model waits; while the holder's session heartbeats it keeps its model
    and the new one fails ``limit_exceeded`` once the wait is over; once it falls silent for
    ``evict_after_s`` its model is evicted for the next."""
    import threading

    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, api_key=KEY_A, max_models=1,
                                              evict_after_s=3.0, sweep_interval_s=0.05))
    try:
        base = server.url
        holder, newcomer = session(base), session(base)
        held = lora_model(base, holder)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(0.1):
                call(base, "session_heartbeat", {"session_id": holder})

        beating = threading.Thread(target=beat)
        beating.start()
        try:
            refused = call(base, "create_model", {"session_id": newcomer, "model_seq_id": 0, "base_model": "tiny"})
            failed = result(base, refused.json()["request_id"])
            assert failed["category"] == "user" and failed["error"].startswith("LimitExceeded")
            assert "max_models=1" in failed["error"] and "evict_after_s=3.0" in failed["error"]
            assert call(base, "get_info", {"model_id": held}).status_code == 200
        finally:
            stop.set()
            beating.join()
        evicting = call(base, "create_model", {"session_id": newcomer, "model_seq_id": 1, "base_model": "tiny"})
        assert result(base, evicting.json()["request_id"])["model_id"] == evicting.json()["model_id"]
        body = error(call(base, "get_info", {"model_id": held}), 410, "gone")
        assert body["message"].startswith(f"model_id={held!r}: evicted: max_models=1")
        # A creation still waiting when its session ends fails with the session.
        late = session(base)
        call(base, "session_heartbeat", {"session_id": newcomer})
        waiting = call(base, "create_model", {"session_id": late, "model_seq_id": 0, "base_model": "tiny"})
        call(base, f"sessions/{late}/finish", {"reason": {"type": "success"}})
        assert result(base, waiting.json()["request_id"])["error"].startswith("Gone")
        assert server.service.registry.waiting == 0
    finally:
        server.close()


def _ce_body(model_id: str, seq_id: int, tokens: list[int] | None = None, loss_fn: str = "cross_entropy") -> dict:
    tokens = tokens or [5, 9, 14, 20]
    return {"forward_backward_input": {"loss_fn": loss_fn, "data": [
        {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
         "loss_fn_inputs": {"target_tokens": {"data": [9] * len(tokens), "dtype": "int64", "shape": [len(tokens)]}}}]},
        "model_id": model_id, "seq_id": seq_id}


def _image_proto(model_id: str, seq_id: int) -> bytes:
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto

    T = tinker.types
    chunks = [T.EncodedTextChunk(tokens=[5]), T.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)]
    datum = T.Datum(model_input=T.ModelInput(chunks=chunks),
                    loss_fn_inputs={"target_tokens": np.array([9, 9, 9], dtype=np.int64)})
    request = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(data=[datum],
                                                                                     loss_fn="cross_entropy"),
                                       model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


@pytest.mark.model_plane
def test_a_refused_call_still_takes_its_turn(server, url, engine):
    """Each call refused at submission consumes its ``seq_id``: the model's next call runs at once instead
    of waiting ``hold_timeout_s`` for it, and a retry of the refused call gets its refusal again."""
    sid = session(url)
    model_id = lora_model(url, sid)
    model = server.service.registry.models[model_id]
    context = engine.backend.max_model_len
    saved = call(url, "save_weights_for_sampler", {"model_id": model_id, "path": "dup", "seq_id": 1})
    assert result(url, saved.json()["request_id"])["path"].endswith("/sampler_weights/dup")
    bad_dtype = _ce_body(model_id, 8)
    bad_dtype["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["dtype"] = "int8"
    refusals = [
        ("forward_backward", _ce_body(model_id, 2, loss_fn="no_such_loss"), 400, "invalid", "loss_fn"),
        ("forward_backward", _ce_body(model_id, 3, tokens=[5, 10**6]), 400, "invalid", "data[0].model_input"),
        ("forward_backward", _ce_body(model_id, 4, tokens=[5] * (context + 1)), 400, "invalid",
         "data[0].model_input.length"),
        ("save_weights_for_sampler", {"model_id": model_id, "path": "dup", "seq_id": 5}, 400, "invalid", "path"),
        ("optim_step", {"model_id": model_id, "seq_id": 6, "optimizer_params": {"type": "dimuon"}}, 400,
         "not_supported", "optimizer_params.type"),
        ("forward", _ce_body(model_id, 7, loss_fn="no_such_loss"), 400, "invalid", "loss_fn"),
        ("forward_backward", bad_dtype, 400, "invalid",
         "forward_backward_input.data[0].loss_fn_inputs['target_tokens'].dtype"),
    ]
    for path, body, status, code, field in refusals:
        assert error(call(url, path, body), status, code)["field"] == field
        assert model.next_seq == body["seq_id"] + 1, (path, field)
    # The SDK's protobuf body, refused while decoding (an image chunk).
    body = error(call(url, "forward_backward", raw=_image_proto(model_id, 9),
                      headers={"Content-Type": "application/x-protobuf"}), 400, "not_supported")
    assert body["field"] == "ForwardBackwardRequest.data[0].model_input[1]" and model.next_seq == 10
    # A retry of a refused call (its answer lost) is refused again, not taken for a stale seq_id.
    assert error(call(url, "forward_backward", _ce_body(model_id, 3, tokens=[5, 10**6])), 400,
                 "invalid")["field"] == "data[0].model_input"
    ok = call(url, "forward_backward", _ce_body(model_id, 10))
    assert ok.status_code == 200 and model.next_seq == 11  # started, not held
    assert result(url, ok.json()["request_id"])["metrics"]["loss:sum"] > 0
    call(url, f"sessions/{sid}/finish", {"reason": {"type": "success"}})


@pytest.mark.model_plane
def test_cancel_and_try_again(engine, ckpt_dir):
    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, api_key=KEY_A, poll_timeout_s=0.2,
                                              max_futures=2))
    try:
        base = server.url
        sid = session(base)
        ssid = base_sampler(base, sid)
        long = sample_body(ssid, 1, max_tokens=1500, params={"stop": []})
        rid = call(base, "asample", long).json()["request_id"]
        assert call(base, "retrieve_future", {"request_id": rid}).json() == {
            "type": "try_again", "request_id": rid, "queue_state": "active"}
        rid2 = call(base, "asample", {**long, "seq_id": 2}).json()["request_id"]
        body = error(call(base, "asample", {**long, "seq_id": 3}), 429, "overloaded")
        assert "max_futures=2" in body["message"]
        for r in (rid, rid2):
            assert call(base, "cancel_future", {"request_id": r}).status_code == 200
            failed = result(base, r)
            assert failed["category"] == "user" and failed["error"].startswith("RequestAborted")
        healthy(base)
    finally:
        server.close()


@pytest.mark.model_plane
def test_sessions_without_heartbeat_expire(engine, ckpt_dir):
    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, api_key=KEY_A, session_ttl_s=0.3,
                                              sweep_interval_s=0.05))
    try:
        sid = session(server.url)
        ssid = base_sampler(server.url, sid)
        time.sleep(1.0)
        assert "heartbeat" in error(call(server.url, "session_heartbeat", {"session_id": sid}), 410, "gone")["message"]
        assert error(call(server.url, "asample", sample_body(ssid, 1)), 410, "gone")["field"] == "sampling_session_id"
    finally:
        server.close()


def test_futures_table_expires_and_bounds_entries():
    table = FuturesTable(max_entries=2, ttl_s=0.05)
    render = lambda value, proto: ("application/json", b"null")
    done = table.add("t", "me", render)
    done.future.set_result(None)
    table.add("t", "me", render)
    time.sleep(0.1)
    # Full of one pending and one expired entry: the expired one makes room.
    third = table.add("t", "me", render)
    with pytest.raises(LookupError, match="expired"):
        table.get(done.request_id, "me")
    with pytest.raises(PermissionError):
        table.get(third.request_id, "someone else")
    with pytest.raises(RuntimeError, match="max_futures=2"):
        table.add("t", "me", render)

    log = CompletionLog()
    log.record("a", "finished")
    log.record("b", "failed")
    events, cursor = log.after(0)
    assert events == [("a", "finished"), ("b", "failed")] and cursor == 2
    log.acknowledge(1)
    assert log.after(1) == ([("b", "failed")], 2)


def test_the_sim_backend_samples_but_does_not_train(engine_config, ckpt_dir):
    """The control plane runs on the sim backend (no torch); training needs a model backend, and says so."""
    with rle.Engine(engine_config("sim")) as sim:
        server = start(sim, TinkerServerConfig(checkpoint_dir=ckpt_dir, api_key=KEY_A))
        try:
            caps = call(server.url, "get_server_capabilities", method="GET").json()["supported_models"]
            assert caps and not any(m["trainable"] for m in caps)
            sid = session(server.url)
            body = error(call(server.url, "create_model", {"session_id": sid, "model_seq_id": 0,
                                                           "base_model": sim.model_name}), 400, "not_supported")
            assert body["field"] == "backend" and body["value"] == "sim"
            ssid = call(server.url, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                                "base_model": sim.model_name}).json()["sampling_session_id"]
            rid = call(server.url, "asample", sample_body(ssid, 1, max_tokens=5)).json()["request_id"]
            assert [len(s["tokens"]) for s in result(server.url, rid)["sequences"]] == [5]
            # The sim reports no top-k logprobs: the fields asking for them are not supported, by name.
            for seq, field in enumerate(("topk_sample_logprobs", "topk_prompt_logprobs"), start=2):
                body = error(call(server.url, "asample", sample_body(ssid, seq, **{field: 2})), 400, "not_supported")
                assert (body["field"], body["value"]) == (field, 2) and "sim" in body["message"]
        finally:
            server.close()


@pytest.mark.parametrize("name", ["step-1\n", "ok\n", "..", "a/b", "-x"])
def test_checkpoint_names_with_a_trailing_newline_or_a_path_are_refused(name):
    from rlengine.tinker_api.checkpoints import check_name, parse_path

    with pytest.raises(rle.InvalidRequest):
        check_name("path", name)
    with pytest.raises(rle.InvalidRequest):
        parse_path("path", "tinker://model-1\n/weights/ok")
    assert check_name("path", "step-1") == "step-1"


def test_healthz_reports_a_dead_engine(engine_config, ckpt_dir):
    # As ``rlengine serve --tinker`` runs it: the engine in async mode on a loop it does not own,
    # which outlives the engine's death (an engine owning its loop thread takes it down with it).
    import asyncio

    from rlengine.pytest_plugin import LocalServer
    from rlengine.serve import ServeConfig
    from rlengine.tinker_api.server import start_async

    served = LocalServer(engine_config("sim", sim={"fail_at_step": 2}), ServeConfig(http=False))
    server = asyncio.run_coroutine_threadsafe(start_async(served.engine, TinkerServerConfig(
        checkpoint_dir=ckpt_dir, api_key=KEY_A)), served.loop).result(30)
    try:
        assert call(server.url, "healthz", method="GET").status_code == 200
        with pytest.raises(rle.EngineDeadError):
            served.engine.sample([1, 2], 1, rle.SamplingParams(max_tokens=5)).result(30)
        health = call(server.url, "healthz", method="GET")
        assert health.status_code == 503 and "injected failure" in health.json()["error"]
    finally:
        asyncio.run_coroutine_threadsafe(server.aclose(), served.loop).result(30)
        served.close()
