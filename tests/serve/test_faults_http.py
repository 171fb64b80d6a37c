"""HTTP serving faults (issue 31): killed clients and unproven sessions, on every endpoint.

A client killed mid-stream (a real subprocess, SIGKILLed after it read the
first server-sent event) or before a non-streamed reply must leave weight
installs free at once: its turn is aborted, records nothing and settles its
lease; a session that had tokens streamed to it is marked tainted. A request
that names a session without proving it (a missing or empty token) is refused
with a typed 403, never served untraced. On the sim backend, over real
sockets.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
from serving import REPO, WAIT, Served, sim_config

from rlengine.serve import ServeConfig

ENDPOINTS = {
    "chat": ("/v1/chat/completions", lambda stream: {"model": "sim", "max_tokens": 4000, "stream": stream,
                                                     "messages": [{"role": "user", "content": "hello"}]}),
    "messages": ("/v1/messages", lambda stream: {"model": "sim", "max_tokens": 4000, "stream": stream,
                                                 "messages": [{"role": "user", "content": "hello"}]}),
    "responses": ("/v1/responses", lambda stream: {"model": "sim", "max_output_tokens": 4000, "stream": stream,
                                                   "input": "hello"}),
}

# A client of one turn, in its own process: it sends the request and reports once the first
# event has reached it (streamed) or the turn runs (not streamed: the parent checks), then
# waits to be killed.
_CLIENT = r"""
import socket, sys
host, port, path, body, headers, stream = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
sock = socket.create_connection((host, port), timeout=60)
body = body.encode()
sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
if stream == "1":
    seen = b""
    while b"data:" not in seen:
        chunk = sock.recv(4096)
        if not chunk:
            sys.exit("closed before the first event: " + seen.decode(errors="replace"))
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
print("running", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.fixture(scope="module")
def served():
    # The defaults: nothing here shortens a bound that a fix could hide behind.
    s = Served([sim_config()], ServeConfig(ipc=False))
    yield s
    s.close()


def request(served, method, path, body=None, headers=None):
    """``(status, decoded body)`` of one request with the server's key."""
    url = urlparse(served.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {served.api_key}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def open_session(served):
    status, body = request(served, "POST", "/v1/sessions", {})
    assert status == 200, body
    return body["session_id"], body["token"]


def in_flight(served) -> int:
    return served.on_loop(lambda: served.sessions.in_flight)


def wait_for(predicate) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def kill_a_client_mid_turn(served, endpoint: str, sid: str, token: str, stream: bool) -> None:
    """Start a long session turn from a client process and SIGKILL it mid-generation."""
    path, body = ENDPOINTS[endpoint]
    url = urlparse(served.http_url)
    headers = f"Authorization: Bearer {served.api_key}\r\nX-Session-ID: {sid}\r\nX-Session-Token: {token}\r\n"
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, url.hostname, str(url.port), path,
                               json.dumps(body(stream)), headers, "1" if stream else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert client.stdout.readline().strip() == "running"
        wait_for(lambda: in_flight(served) == 1)  # admitted and generating (5000 tokens take ~5 s)
        assert in_flight(served) == 1
    finally:
        client.send_signal(signal.SIGKILL)
        client.communicate(timeout=WAIT)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_client_killed_mid_turn_leaves_installs_free(served, endpoint, stream):
    sid, token = open_session(served)
    kill_a_client_mid_turn(served, endpoint, sid, token, stream)
    # At once: the install drains the abandoned turn (aborted as the kill is seen) and goes on.
    # Before the fix a streamed turn's lease stayed unknown: GatePoisoned for unknown_write_off_s.
    version = served.install(seed=len(endpoint) + 10 * stream)
    assert version >= 1
    assert served.on_loop(served.engines[0].scheduler.unknown_leases) == []
    wait_for(lambda: in_flight(served) == 0)
    assert in_flight(served) == 0
    status, trace = request(served, "GET", f"/v1/sessions/{sid}/trace", headers={"X-Session-Token": token})
    assert status == 200 and trace["trajectories"] == []  # the aborted turn recorded nothing
    assert trace["tainted"] is stream  # tokens had reached the client only when streamed
    # The session goes on, on the new version.
    path, body = ENDPOINTS[endpoint]
    status, reply = request(served, "POST", path, {**body(False), "max_tokens": 2, "max_output_tokens": 2},
                            {"X-Session-ID": sid, "X-Session-Token": token})
    assert status == 200, reply
    status, trace = request(served, "GET", f"/v1/sessions/{sid}/trace", headers={"X-Session-Token": token})
    [trajectory] = trace["trajectories"]
    assert set(trajectory["versions"][-2:]) == {version}


def _admitted(served) -> int:
    return served.engines[0].stats()["admitted"]


@pytest.mark.parametrize("proof", ["no token", "empty header", "empty body field", "id in body, no token"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_named_session_without_its_token_is_refused(served, endpoint, proof):
    sid, token = open_session(served)
    path, make = ENDPOINTS[endpoint]
    body = {**make(False), "max_tokens": 2, "max_output_tokens": 2}
    headers = {"X-Session-ID": sid}
    if proof == "empty header":
        headers["X-Session-Token"] = ""
    elif proof == "empty body field":
        body["session_token"] = ""
    elif proof == "id in body, no token":
        headers, body["session_id"] = {}, sid
    field = "session_token" if proof == "empty body field" else "X-Session-Token"
    before = _admitted(served)
    status, reply = request(served, "POST", path, body, headers)
    assert status == 403, reply  # before the fix: 200, served untraced
    error = reply["error"]
    assert error.get("code", "forbidden") == "forbidden" and error["type"] in ("invalid_request_error",
                                                                              "permission_error")
    assert field in error["message"] and sid in error["message"]
    assert _admitted(served) == before  # nothing was sampled
    status, trace = request(served, "GET", f"/v1/sessions/{sid}/trace", headers={"X-Session-Token": token})
    assert status == 200 and trace["turns"] == 0
    # Proven, the same request is a session turn.
    status, reply = request(served, "POST", path, body | {"session_token": token},
                            {"X-Session-ID": sid} if headers else {})
    assert status == 200, reply


def test_a_sessions_own_base_url_refuses_an_empty_key(served):
    sid, _token = open_session(served)
    _path, make = ENDPOINTS["chat"]
    status, reply = request(served, "POST", f"/sessions/{sid}/v1/chat/completions", {**make(False), "max_tokens": 2},
                            {"Authorization": "Bearer "})
    assert status == 403 and "Authorization" in reply["error"]["message"]


def test_an_id_this_server_never_opened_is_still_only_an_affinity_hint(served):
    """Harnesses that name their own rollouts (verifiers) hold no token: served statelessly."""
    _path, make = ENDPOINTS["chat"]
    status, reply = request(served, "POST", "/v1/chat/completions", {**make(False), "max_tokens": 2},
                            {"X-Session-ID": "rollout-17"})
    assert status == 200 and "session_id" not in reply
    assert "rollout-17" not in served.on_loop(served.sessions.live)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_stalled_streaming_reader_is_cut_off_and_its_turn_abandoned(endpoint):
    """A client that keeps its connection but reads nothing must not hold a handler (and its
    queued output) forever: after ``write_stall_timeout_s`` without progress the server drops
    it and abandons the turn, as the IPC server does. (Before: the handler waited on the socket
    for as long as the client lived, and the stream completed once it read again.)"""
    # 100,000 tokens (~18 MB of events) outgrow every socket buffer on the way.
    s = Served([sim_config(step_time_s=0.00002, max_model_len=120_000, gen_len=200_000)],
               ServeConfig(ipc=False, write_stall_timeout_s=1.0))
    try:
        path, body = ENDPOINTS[endpoint]
        url = urlparse(s.http_url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up
        sock.settimeout(WAIT)
        sock.connect((url.hostname, url.port))
        data = json.dumps({**body(True), "max_tokens": 100_000, "max_output_tokens": 100_000}).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     f"Authorization: Bearer {s.api_key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: in_flight(s) == 1)
        wait_for(lambda: in_flight(s) == 0)  # abandoned ~1 s after the buffers fill
        assert in_flight(s) == 0
        received = b""
        while chunk := sock.recv(1 << 16):  # the rest of what was sent, then the server's close
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received and b"message_stop" not in received
        sock.close()
    finally:
        s.close()
