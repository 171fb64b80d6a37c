"""A large ``forward_backward`` is decoded and checked off the server's loop thread, with the same answers.

Before, a Tinker call's decoding, provenance span checks, ``stable_reinforce``
resolution and loss validation all ran on the engine's loop thread: a
cookbook-sized call (2,048 datums) held it ~0.2 s while every other client
waited. Here, on the real server over real sockets (raw HTTP, JSON bodies,
so each call's ``seq_id`` is the test's to choose): a call above the
server's threshold (``_OFF_LOOP_BYTES``) is checked on another thread and a
small one on the loop; the loop answers ``/healthz`` while a large call's
validation is held; a large call refused there still takes its turn (the
call after it, already waiting, runs); a later small call checked first
still runs after the earlier large one, and a repeated ``seq_id`` gets the
first request id. ``stable_reinforce`` reports its truncation and mask
counts (exact counts: ``tests/trainer/test_stable_reinforce_metrics.py``).

The checks are made slow or observed by spies patched into the server's
modules (the server runs on the engine's loop thread of this process); a
held check waits on an event with a bound, so nothing hangs on old code.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import httpx
import msgspec
import pytest
from tinker_sdk import SDK_WARNINGS

from rlengine.tinker_api import server as server_module
from rlengine.tinker_api import stability, training_calls

pytest.importorskip("tinker")

pytestmark = [pytest.mark.model_plane, *SDK_WARNINGS]

WAIT = 120.0
HOLD_S = 10.0
"""How long a held check waits for the test to release it (released within milliseconds on the new code;
on the old one it held the loop, so the bound is what ended it)."""
PROMPT = [11, 23, 35, 47, 59, 61]
BIG = 24
"""Datums in a large call (its JSON body is several times ``_OFF_LOOP_BYTES``)."""


class Rest:
    """One training model of the served engine, driven over raw HTTP."""

    def __init__(self, engine, server) -> None:
        self.engine, self.server, self.url, self.key = engine, server, server.url, server.api_key
        sid = self.post("create_session", {"tags": []})["session_id"]
        created = self.post("create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                             "lora_config": {"rank": 4, "seed": 0}})
        self.model_id = self.result(created["request_id"])["model_id"]
        self.seq = itertools.count(1)
        saved = self.post("save_weights_for_sampler", {"model_id": self.model_id, "seq_id": next(self.seq),
                                                       "sampling_session_seq_id": 0})
        ssid = self.result(saved["request_id"])["sampling_session_id"]
        asked = self.post("asample", {"sampling_session_id": ssid, "seq_id": 1, "num_samples": 1,
                                      "record_stability_info": True,
                                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                                      "sampling_params": {"max_tokens": 8, "seed": 3, "stop": []}})
        self.tokens = self.result(asked["request_id"])["sequences"][0]["tokens"]
        self.sequence_id = asked["sample_sequence_ids"][0]

    def raw(self, path: str, body: dict, timeout: float = WAIT) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{path}", content=msgspec.json.encode(body), timeout=timeout,
                          headers={"X-API-Key": self.key, "Content-Type": "application/json"})

    def post(self, path: str, body: dict) -> dict:
        r = self.raw(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def result(self, request_id: str) -> dict:
        for _ in range(10_000):  # each retrieve waits server-side; a few normally
            out = self.post("retrieve_future", {"request_id": request_id})
            if out.get("type") != "try_again":
                return out
        raise AssertionError(f"{request_id} did not settle")

    def spanned(self) -> dict:
        """A datum as tinker-cookbook 0.6.1 sends it: the sampled sequence, spans naming it."""
        tokens, sid, ob = self.tokens, self.sequence_id, len(PROMPT) - 1
        n = ob + len(tokens)
        return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": PROMPT + tokens[:-1]}]},
                "loss_fn_inputs": {"target_tokens": {"data": [0] * ob + tokens, "dtype": "int64"},
                                   "logprobs": {"data": [0.0] * n, "dtype": "float32"},
                                   "advantages": {"data": [0.0] * ob + [1.0] * len(tokens), "dtype": "float32"}},
                "model_input_spans": [{"prompt_tokens": {"sequence_id": sid, "length": len(PROMPT)}},
                                      {"sampled_tokens": {"sequence_id": sid, "length": len(tokens) - 1}}],
                "loss_fn_input_spans": [{"prompt_tokens": {"sequence_id": sid, "offset": 1, "length": ob}},
                                        {"sampled_tokens": {"sequence_id": sid, "length": len(tokens)}}]}

    @staticmethod
    def plain(tokens: list[int], target: int | None = None) -> dict:
        n = len(tokens)
        return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "loss_fn_inputs": {"target_tokens": {"data": [target or t for t in tokens], "dtype": "int64"},
                                   "logprobs": {"data": [-1.0] * n, "dtype": "float32"},
                                   "advantages": {"data": [1.0] * n, "dtype": "float32"}}}

    def body(self, seq: int, data: list[dict], loss_fn: str = "importance_sampling", config: dict | None = None,
             size: str = "large") -> dict:
        out = {"model_id": self.model_id, "seq_id": seq,
               "forward_backward_input": {"loss_fn": loss_fn, "loss_fn_config": config, "data": data}}
        # Each call is on the side of the threshold its test means it to be.
        assert (len(msgspec.json.encode(out)) > server_module._OFF_LOOP_BYTES) == (size == "large")
        return out

    def on_loop(self, read):
        """``read()`` run on the engine's loop thread (where the server's state lives)."""
        async def run():
            return read()

        return asyncio.run_coroutine_threadsafe(run(), self.engine.loop).result(WAIT)

    def loop_thread(self) -> int:
        return self.on_loop(threading.get_ident)


@pytest.fixture(scope="module")
def rest(served):
    engine, server, _ = served
    return Rest(engine, server)


class Checks:
    """Spies on the loss validation (and the span comparison): the thread each ran on, events in order, and
    a gate that holds the validation of a large call until the test releases it."""

    def __init__(self, monkeypatch) -> None:
        self.threads: dict[str, list[int]] = {"validate": [], "spans": []}
        self.events: list[str] = []
        self.gate: threading.Event | None = None
        self.held = threading.Event()
        validate, concat = training_calls.validate_data, stability.concat_tokens

        def validate_spy(data, *args, **kwargs):
            self.threads["validate"].append(threading.get_ident())
            size = "large" if len(data) >= BIG else "small"
            if size == "large" and self.gate is not None:
                self.events.append("large held")
                self.held.set()
                self.events.append("large released" if self.gate.wait(HOLD_S) else "large held to the bound")
            try:
                return validate(data, *args, **kwargs)
            finally:
                self.events.append(f"{size} validated")

        def spans_spy(data):
            self.threads["spans"].append(threading.get_ident())
            return concat(data)

        monkeypatch.setattr(training_calls, "validate_data", validate_spy)
        monkeypatch.setattr(stability, "concat_tokens", spans_spy)

    def hold(self) -> threading.Event:
        self.gate = threading.Event()
        return self.gate


@pytest.fixture
def checks(monkeypatch):
    return Checks(monkeypatch)


def _in_background(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def test_a_large_call_is_checked_off_the_loop_and_a_small_one_on_it(rest, checks):
    """Failed before: the span comparison and the validation of a large call ran on the loop thread."""
    loop = rest.loop_thread()
    out = rest.result(rest.post("forward_backward", rest.body(next(rest.seq), [rest.spanned()] * BIG))["request_id"])
    assert out["metrics"]["loss:sum"] != 0.0
    assert checks.threads["spans"] and checks.threads["validate"]
    assert loop not in checks.threads["spans"] + checks.threads["validate"]
    # stable_reinforce's resolution too, with its counts in the metrics (on policy: nothing masked).
    checks.threads["validate"].clear()
    config = {"kl_coeff": 0.01}
    stable = rest.body(next(rest.seq), [rest.spanned()] * BIG, "stable_reinforce", config)
    metrics = rest.result(rest.post("forward_backward", stable)["request_id"])["metrics"]
    assert checks.threads["validate"] and loop not in checks.threads["validate"]
    assert metrics["is_tokens:sum"] == BIG * len(rest.tokens)
    assert metrics["is_masked:sum"] == metrics["is_masked_sequences:sum"] == 0
    assert 0 <= metrics["is_truncated:sum"] <= metrics["is_tokens:sum"]
    # A small call pays no thread hop.
    checks.threads["validate"].clear()
    small = rest.body(next(rest.seq), [rest.plain([5, 6, 7, 8])], size="small")
    assert rest.result(rest.post("forward", small)["request_id"])["metrics"]["loss:sum"] != 0.0
    assert checks.threads["validate"] == [loop]


def test_the_loop_answers_while_a_large_call_is_checked(rest, checks):
    """Failed before: a large call's validation held the loop, so ``/healthz`` waited for it."""
    gate = checks.hold()
    thread, out = _in_background(lambda: rest.raw("forward_backward",
                                                   rest.body(next(rest.seq), [rest.spanned()] * BIG)))
    assert checks.held.wait(WAIT)
    health = httpx.get(f"{rest.url}/api/v1/healthz", headers={"X-API-Key": rest.key}, timeout=WAIT)
    checks.events.append("healthz answered")
    gate.set()
    thread.join(WAIT)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert checks.events == ["large held", "healthz answered", "large released", "large validated"]
    assert out[0].status_code == 200, out[0].text
    rest.result(out[0].json()["request_id"])


def test_a_large_call_refused_off_the_loop_still_takes_its_turn(rest, checks):
    """The next call, sent while the refused one was being checked (held there), runs once it is refused:
    the refusal consumed its seq_id (else the next call waits hold_timeout_s, 300 s)."""
    vocab = rest.engine.backend.vocab_size
    data = [rest.plain([5, 6, 7, 8] * 4) for _ in range(BIG)]
    data[5] = rest.plain([5, 6, 7, 8] * 4, target=vocab + 7)
    refused_seq, next_seq = next(rest.seq), next(rest.seq)
    gate = checks.hold()
    thread, out = _in_background(lambda: rest.raw("forward_backward", rest.body(refused_seq, data)))
    assert checks.held.wait(WAIT)
    waiting = rest.post("forward", rest.body(next_seq, [rest.plain([5, 6, 7, 8])], size="small"))
    gate.set()
    thread.join(WAIT)
    assert out[0].status_code == 400, out[0].text
    error = out[0].json()["error"]
    assert (error["field"], error["value"]) == ("data[5].loss_fn_inputs['target_tokens']", vocab + 7)
    assert checks.threads["validate"][0] != rest.loop_thread()  # the refused call's, checked first
    assert rest.result(waiting["request_id"])["metrics"]["loss:sum"] != 0.0  # typically < 1 s
    again = rest.raw("forward_backward", rest.body(refused_seq, data))  # a retry is refused alike
    assert again.status_code == 400 and again.json()["error"]["field"] == error["field"]


def test_calls_run_in_seq_id_order_when_a_later_one_is_checked_first(rest, checks):
    """A small call checked while an earlier large one is still held runs after it; a repeated seq_id gets
    the first request id and runs nothing."""
    model = rest.on_loop(lambda: rest.server.service.registry.models[rest.model_id])
    ran: list[int] = []
    inner = model.trainer.forward_backward

    def spy(data, *args):
        ran.append(len(data))
        return inner(data, *args)

    model.trainer.forward_backward = spy
    try:
        first, second = next(rest.seq), next(rest.seq)
        large = rest.body(first, [rest.spanned()] * BIG)
        gate = checks.hold()
        thread, out = _in_background(lambda: rest.raw("forward_backward", large))
        assert checks.held.wait(WAIT)
        small = rest.post("forward_backward", rest.body(second, [rest.plain([5, 6, 7, 8])], size="small"))
        gate.set()
        thread.join(WAIT)
        assert out[0].status_code == 200, out[0].text
        rest.result(small["request_id"])
        rest.result(out[0].json()["request_id"])
        assert checks.events.index("small validated") < checks.events.index("large validated")
        assert ran == [BIG, 1]
        assert rest.post("forward_backward", large)["request_id"] == out[0].json()["request_id"]
        assert ran == [BIG, 1]
    finally:
        del model.trainer.forward_backward

