"""A field error carries its field and value on every wire (issue 30): the IPC client's exception, the
OpenAI-shaped body (``param``), the Anthropic-shaped body and the Responses API, for one bad value."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest
from serving import WAIT, Served, sim_config

from rlengine import protocol as p
from rlengine.sandbox_client import Client
from rlengine.serve import ServeConfig


@pytest.fixture(scope="module")
def served():
    s = Served([sim_config()], ServeConfig())
    yield s
    s.close()


def post(served, path, body):
    url = urlparse(served.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {served.api_key}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_ipc_names_the_field_and_value(served):
    with Client(served.ipc_path, timeout=WAIT) as client:
        session = client.open_session()
        with pytest.raises(p.InvalidValue) as info:
            session.generate([1, 2], max_tokens=2, top_p=1.5)
    assert (info.value.field, info.value.value) == ("top_p", "1.5")


@pytest.mark.parametrize(("path", "body", "shape"), [
    ("/v1/chat/completions", {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "top_p": 1.5}, "openai"),
    ("/v1/responses", {"model": "sim", "input": "hi", "max_output_tokens": 2, "top_p": 1.5}, "openai"),
    ("/v1/messages", {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "top_p": 1.5}, "anthropic"),
])
def test_http_names_the_field_and_value(served, path, body, shape):
    status, reply = post(served, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert (error["param"], error["value"]) == ("top_p", "1.5"), reply
    assert shape == "openai" and error["code"] == "invalid" or reply["type"] == "error"
