"""Every error class through every wire (issue 30): one table, ``rlengine.errors.WIRE``, says how each is reported.

The classes are found by introspection of the modules whose errors the servers report (a new class is covered
at once, and one without a row fails here). Each is raised by a real engine call on a real server, then read
back by a real client over a real socket: the IPC client (it re-raises: class, code, field, value), the OpenAI
SDK on Chat Completions (status, ``code``, ``type``, ``param``, ``value``), the Anthropic SDK on Messages (its
error shape), and the Tinker server over HTTP (status, ``code``, ``field``, ``value`` of a refused call, and
the ``category`` of a future that failed). The injection: the backend's ``add_request`` (a sample fails with
that exception, settled by the sampler as any backend rejection) or, for a Tinker call refused before it is
queued, the engine's ``validate_sample``.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serving import WAIT, Served, sim_config
from test_errors import instance_of

from rlengine import errors
from rlengine import protocol as p
from rlengine.errors import WIRE, FieldError, RLEngineError, wire_of
from rlengine.sandbox_client import Client
from rlengine.serve import ServeConfig

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODULES = ("rlengine.errors", "rlengine.protocol", "rlengine.trace.errors", "rlengine.tinker_api.errors")
"""Where the engine, the trace store, the serving layer and the Tinker server define the errors they raise."""


def _classes() -> list[type[BaseException]]:
    found = []
    for name in MODULES:
        for obj in vars(importlib.import_module(name)).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    # The root has no row on purpose: an RLEngineError no narrower row covers is a bug, reported as internal.
    return [cls for cls in found if cls is not RLEngineError]


CLASSES = _classes()
KEY = "tml-wires"


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_class_has_its_own_row_and_every_row_names_a_class():
    assert sorted(_name(c) for c in CLASSES) == sorted(WIRE)
    assert len(CLASSES) > 40
    # On the serving layer a code has one status: the HTTP server maps codes to statuses.
    by_code: dict[str, set[int]] = {}
    for row in WIRE.values():
        by_code.setdefault(row.code, set()).add(row.status)
    assert {code: s for code, s in by_code.items() if len(s) > 1} == {}
    # The IPC client re-raises each protocol class by its code.
    assert all(p.ERROR_CODES[cls.code] is cls for cls in p.ERROR_CODES.values())
    # Tinker differs only with a reason that says why.
    assert all("Tinker" in row.why and row.tinker != row.status for row in WIRE.values() if row.tinker is not None)


def test_what_no_retry_fixes_is_not_retried_by_the_tinker_sdk():
    """The SDK's own rule (tinker 0.38, ``lib/retry_handler.py``): 408, 409, 429 and 5xx are resent for minutes."""
    is_retryable_status_code = pytest.importorskip("tinker.lib.retry_handler").is_retryable_status_code

    never_passes = (errors.RequestAborted, p.TurnAborted, errors.EngineDeadError, errors.EngineClosed,
                    errors.GatePoisoned, errors.TrainerLost, errors.ModelNotLoaded, p.SessionExists)
    assert [c.__name__ for c in never_passes if is_retryable_status_code(wire_of(c).tinker_status)] == []
    from rlengine.tinker_api.errors import Overloaded

    assert is_retryable_status_code(wire_of(Overloaded).tinker_status)  # a full table drains: retry it


# -- the wires ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wires(tmp_path_factory):
    """One sim engine behind IPC, HTTP and the Tinker server, all on its loop (as ``rlengine serve --tinker``)."""
    import asyncio

    from rlengine.tinker_api import TinkerServerConfig
    from rlengine.tinker_api.server import start_async

    served = Served([sim_config(gen_len=4)], ServeConfig())
    engine = served.engines[0]
    tinker = asyncio.run_coroutine_threadsafe(start_async(engine, TinkerServerConfig(
        checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")), api_key=KEY)), served.loop).result(WAIT)
    try:
        sid = tinker_call(tinker.url, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "test"}
                          ).json()["session_id"]
        ssid = tinker_call(tinker.url, "create_sampling_session", {
            "session_id": sid, "sampling_session_seq_id": 0, "base_model": engine.model_name}
        ).json()["sampling_session_id"]
        yield served, tinker.url, ssid
    finally:
        asyncio.run_coroutine_threadsafe(tinker.aclose(), served.loop).result(WAIT)
        served.close()


def tinker_call(base: str, path: str, body: dict[str, Any]) -> Any:
    return httpx.post(f"{base}/api/v1/{path}", json=body, headers={"X-API-Key": KEY}, timeout=WAIT)


_seq = itertools.count(1)


def asample(base: str, ssid: str) -> Any:
    return tinker_call(base, "asample", {"sampling_session_id": ssid, "seq_id": next(_seq), "num_samples": 1,
                                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                                         "sampling_params": {"max_tokens": 2, "seed": 1}})


@contextlib.contextmanager
def raising(obj: object, method: str, cls: type[BaseException]) -> Iterator[None]:
    """``obj.method`` raises a fresh ``cls`` (sample values) until the block ends."""

    def fail(*args: object, **kwargs: object) -> None:
        raise instance_of(cls)

    setattr(obj, method, fail)
    try:
        yield
    finally:
        delattr(obj, method)


def expected_field(exc: BaseException) -> tuple[str | None, str | None]:
    """The field and value (its repr, cut to 80 characters) the serving layer reports."""
    if not isinstance(exc, FieldError):
        return None, None
    shown = repr(exc.value)
    return exc.field, shown if len(shown) <= 80 else shown[:77] + "..."


def ipc(served: Served, cls: type[BaseException]) -> BaseException:
    with Client(served.ipc_path, timeout=WAIT) as client:
        session = client.open_session()
        with raising(served.engines[0].backend, "add_request", cls), pytest.raises(p.ServeError) as info:
            session.generate([1, 2], max_tokens=2)
    return info.value


def chat(served: Served, cls: type[BaseException]) -> Any:
    with openai.OpenAI(base_url=served.http_url, api_key=served.api_key, max_retries=0, timeout=WAIT) as client, \
            raising(served.engines[0].backend, "add_request", cls), pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return info.value


def messages(served: Served, cls: type[BaseException]) -> Any:
    base = served.http_url.removesuffix("/v1")
    with anthropic.Anthropic(base_url=base, api_key=served.api_key, max_retries=0, timeout=WAIT) as client, \
            raising(served.engines[0].backend, "add_request", cls), pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return info.value


def tinker_failed_future(served: Served, base: str, ssid: str, cls: type[BaseException]) -> dict[str, Any]:
    with raising(served.engines[0].backend, "add_request", cls):
        submitted = asample(base, ssid)
        assert submitted.status_code == 200, submitted.text
        deadline = time.monotonic() + WAIT  # settles in milliseconds; the bound only keeps a hang from hiding
        while time.monotonic() < deadline:
            reply = tinker_call(base, "retrieve_future", {"request_id": submitted.json()["request_id"]}).json()
            if reply.get("type") != "try_again":
                return reply
    raise AssertionError(f"{cls.__name__}: the future never settled")


@pytest.mark.parametrize("cls", CLASSES, ids=_name)
def test_ipc_reports_the_row(wires, cls: type[BaseException]):
    served, _, _ = wires
    row, (field, value) = wire_of(cls), expected_field(instance_of(cls))
    got = ipc(served, cls)
    assert (type(got), got.code, got.field, got.value) == (p.ERROR_CODES.get(row.code, p.ServeError), row.code,
                                                            field, value), str(got)


@pytest.mark.parametrize("cls", CLASSES, ids=_name)
def test_chat_completions_report_the_row(wires, cls: type[BaseException]):
    served, _, _ = wires
    row, (field, value) = wire_of(cls), expected_field(instance_of(cls))
    got = chat(served, cls)
    assert (got.status_code, got.code, got.param, got.body["value"]) == (row.status, row.code, field, value), got.body
    assert got.type == ("invalid_request_error" if row.status < 500 else "server_error")


@pytest.mark.parametrize("cls", CLASSES, ids=_name)
def test_messages_report_the_row(wires, cls: type[BaseException]):
    served, _, _ = wires
    row, (field, value) = wire_of(cls), expected_field(instance_of(cls))
    got = messages(served, cls)
    body = got.response.json()
    assert (got.status_code, body["type"], body["error"]["param"], body["error"]["value"]) == (
        row.status, "error", field, value), body
    assert body["error"]["message"].startswith(f"{row.code}: ")


@pytest.mark.parametrize("cls", CLASSES, ids=_name)
def test_tinker_reports_the_row(wires, cls: type[BaseException]):
    served, base, ssid = wires
    row, sample = wire_of(cls), instance_of(cls)
    with raising(served.engines[0], "validate_sample", cls):
        refused = asample(base, ssid)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["type"]) == (row.tinker_status, row.code, cls.__name__), error
    if isinstance(sample, FieldError):
        assert (error["field"], error["value"]) == (sample.field, sample.value), error
    else:
        assert "field" not in error, error
    failed = tinker_failed_future(served, base, ssid, cls)
    assert failed["category"] == row.fault and failed["error"].startswith(cls.__name__), failed
