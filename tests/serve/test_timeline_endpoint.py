"""``rlengine serve --timeline``: ``GET /v1/admin/timeline`` returns the engines' trace-event JSON
with the server's API key, 401 without it, and 404 from a server that records none.

A real server subprocess, reached over its socket (a session turn) and HTTP.
"""

from __future__ import annotations

import json
import signal
import urllib.request

from serving import WAIT
from test_serve_cli import start, status, stop

from rlengine.sandbox_client import Client


def test_the_timeline_endpoint_serves_the_trace_with_the_key_only():
    proc, addresses = start("backend=sim", "sim.gen_len=4", "replicas=2", "--timeline")
    try:
        with Client(addresses["ipc"], timeout=WAIT) as client:
            session = client.open_session()
            for _ in range(3):
                assert len(session.generate([3, 4], max_tokens=4).choices[0].tokens) == 4
        url, key = addresses["http"] + "/admin/timeline", addresses["http key"]
        assert status(url) == 401
        assert status(url, Authorization="Bearer wrong") == 401
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=WAIT) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/json")
            document = json.loads(resp.read())
    finally:
        rc, output = stop(proc, signal.SIGINT)
    assert rc == 128 + signal.SIGINT, output
    events = document["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine compute", "engine 2 compute"} <= tracks  # one timeline, a track set per replica
    turns = [e["args"] for e in events if e["ph"] == "b" and e["cat"] == "request" and "duration_s" in e.get("args", {})]
    assert len(turns) == 3 and {t["session_id"] for t in turns} == {session.session_id}
    assert all(t["tokens"] == 4 and t["outcome"] == "completed" for t in turns)


def test_a_server_without_a_timeline_answers_404_naming_the_option():
    proc, addresses = start("backend=sim", "http=true")
    try:
        url = addresses["http"] + "/admin/timeline"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {addresses['http key']}"})
        try:
            urllib.request.urlopen(request, timeout=WAIT)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
            exc.close()
            assert exc.code == 404 and "--timeline" in body["error"]["message"]
    finally:
        stop(proc, signal.SIGINT)
