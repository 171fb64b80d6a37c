"""Test helper: N engines (async mode) and a ``Server`` on one uvloop loop in a thread.

That is how ``rlengine serve`` runs them (one loop, one compute thread per
replica). Tests drive it from the main thread through real sockets and
real subprocesses, and run code on the loop with ``on_loop`` (where the
session layer, the scheduler and the trace store live). Every wait is bounded.

What it must not do: fake any part of the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import rlengine as rle
from rlengine.pytest_plugin import LocalServer
from rlengine.serve import ServeConfig

WAIT = 60.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sim_config(**sim: Any) -> rle.EngineConfig:
    """A sim engine whose turns last until ``max_tokens`` (like a model run with ignore_eos)."""
    return rle.EngineConfig(backend="sim", model_name="sim",
                            sim=rle.SimConfig(**{"gen_len": 10_000, "step_time_s": 0.001, **sim}))


class Served(LocalServer):
    """Engines + server on a private loop thread (the plugin's ``LocalServer``, which users'
    suites get too); ``close`` stops everything, bounded, giving turns in flight 0.5 s."""

    def __init__(self, configs: list[rle.EngineConfig], serve_config: ServeConfig | None = None) -> None:
        super().__init__(configs, serve_config or ServeConfig(), start_timeout_s=600)

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop thread; its result (or exception) here."""
        return self.call(fn, *args, timeout=WAIT)

    def install(self, replica: int = 0, seed: int = 1) -> int:
        """Install new sim weights (a fresh theta) through the gate; returns the version."""
        engine = self.engines[replica]
        theta = np.random.default_rng(seed).normal(0.0, 1.0, engine.backend.vocab_size).astype(np.float32)
        return engine.install_weights(lambda: [("theta", theta)]).result(WAIT)

    def close(self, grace_s: float | None = 0.5) -> None:
        super().close(grace_s)


def run_sandbox(code: str, *args: str, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process (a sandbox); ``sys.argv[1:]`` are ``args``."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


# -- the scripted backend over HTTP: what the tool and framework tests share ------------------------------------


def scripted(model_cache: str, **overrides: Any) -> Served:
    """The scripted backend on the tiny model, served over HTTP only; set its completions with
    ``script``. ``overrides`` are ``EngineConfig`` fields (``model_args``, ...)."""
    cfg = rle.EngineConfig(backend="scripted", model_name="tiny", cache_dir=model_cache,
                           engine_args={"script": ["ok"]}, **overrides)
    return Served([cfg], ServeConfig(ipc=False))


def script(served: Served, *texts: str) -> None:
    """The completions the scripted backend returns, in order, cycling."""
    served.engines[0].backend.set_script(list(texts))


def script_tokens(served: Served, text: str) -> list[int]:
    """What sampling ``text`` stores: the tokenizer's ids, then the end of the turn."""
    tok = served.engines[0].tokenizer
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def openai_client(served: Served) -> Any:
    """The official OpenAI client on ``served``'s HTTP server, with its key, no retries, bounded waits."""
    import openai

    return openai.OpenAI(base_url=served.http_url, api_key=served.api_key, max_retries=0, timeout=WAIT)


def open_http_session(served: Served, **body: Any) -> dict[str, Any]:
    """``POST /v1/sessions`` (with ``body``, e.g. ``roles=``): the session's id, token and own ``base_url``."""
    with openai_client(served) as c:
        return c.post("/sessions", body=body, cast_to=object)


def http_trace(served: Served, opened: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/sessions/<id>/trace`` of a session ``open_http_session`` opened."""
    with openai_client(served) as c:
        return c.get(f"/sessions/{opened['session_id']}/trace", cast_to=object,
                     options={"headers": {"X-Session-Token": opened["token"]}})


def sampled_segments(trajectory: dict[str, Any]) -> list[list[int]]:
    """A traced trajectory's sampled segments; its loss mask must cover exactly them."""
    toks, mask = trajectory["tokens"], trajectory["loss_mask"]
    spans = [(g["start"], g["end"]) for g in trajectory["segments"] if g["kind"] == "sampled"]
    assert mask == [int(any(a <= i < b for a, b in spans)) for i in range(len(toks))]
    return [toks[a:b] for a, b in spans]


DEMO_SCHEMA = {"type": "object", "required": ["city", "days", "units", "when", "tags", "where"], "properties": {
    "city": {"type": "string", "minLength": 10},
    "days": {"type": "integer", "minimum": 3, "maximum": 7},
    "units": {"type": "string", "enum": ["metric", "imperial"]},
    "when": {"type": "string", "format": "date"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "where": {"type": "object", "properties": {"lat": {"type": "number", "exclusiveMinimum": 2}}},
}, "additionalProperties": False}
DEMO_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": DEMO_SCHEMA}},
              {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]


def demo_tool_round_trip(client: Any, model: str) -> None:
    """An agent's loop against the demo script (``rlengine serve --demo``), with an ``openai``
    client: it calls the first tool with arguments valid under its schema, then answers with the
    tool's result; without tools it answers a readable text."""
    import jsonschema

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=DEMO_TOOLS)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), DEMO_SCHEMA)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=DEMO_TOOLS).choices[0]
    assert answer.finish_reason == "stop" and "sunny, 21 C" in answer.message.content
    hello = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}])
    assert "demo" in hello.choices[0].message.content and '"Hi there"' in hello.choices[0].message.content


def rss_mb() -> float:
    """This process's resident memory, in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def probing(served: Served) -> Iterator[list[float]]:
    """Within the block, a client thread asks ``GET /v1/models`` every 2 ms over one keep-alive
    connection; yields the list of its latencies (seconds), complete after the block."""
    import http.client
    from urllib.parse import urlparse

    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        url = urlparse(served.http_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT)
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {served.api_key}"})
            conn.getresponse().read()
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.002)
        conn.close()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.05)
        yield latencies
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join(WAIT)
