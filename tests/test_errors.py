"""rlengine.errors: one root, typed subclasses, and every error survives pickling.

Ray actors and multiprocessing send exceptions between processes with
``pickle``; an exception whose ``__init__`` takes fields rather than the
message breaks Exception's default reduce. The test walks every exception
class defined anywhere in the package.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import pkgutil

import pytest

import rlengine
from rlengine._moved import MOVED
from rlengine.errors import RLEngineError

# Modules whose import needs an optional package that only their backend uses.

_SAMPLE_ARGS = {
    "field": "sampling_params.top_p", "value": 1.5, "reason": "must be in (0, 1]", "leases": [(3, "agent-1", "gone")],
    "max_bytes": 1024, "memory_bytes": 1000, "tokens": 7, "session": "s-1", "batch": 4, "steps": 9, "length": 3,
    "where": "env.step", "signum": 15, "name": "SIGTERM", "context": 2048, "what": "failed attempts", "share": 0.9,
    "bound": 0.5, "message": "sandbox 0 exited with code 3", "path": "dumps/step-000001.msgpack",
}


def _exception_classes() -> list[type[BaseException]]:
    for info in pkgutil.walk_packages(rlengine.__path__, "rlengine."):
        if info.name in MOVED:  # an old path: the module is walked under its new one
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional package (vLLM, Ray) on a light install
            if os.environ.get("RLENGINE_REQUIRE_ALL") == "1" or (exc.name or "rlengine").startswith("rlengine"):
                raise
    seen: dict[str, type[BaseException]] = {}
    stack = [BaseException]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("rlengine.") or cls.__module__ == "rlengine":
            seen[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [seen[k] for k in sorted(seen)]


def instance_of(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` built from sample values (``tests/test_error_wires.py`` uses it too)."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if not params or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return cls(f"{cls.__name__}: something went wrong")
    missing = [p.name for p in params if p.name not in _SAMPLE_ARGS]
    assert not missing, f"{cls.__qualname__}.__init__ takes {missing}: add sample values for them here"
    return cls(*[_SAMPLE_ARGS[p.name] for p in params])


CLASSES = _exception_classes()


def test_the_walk_finds_the_exceptions_of_every_layer():
    names = {c.__qualname__ for c in CLASSES}
    assert {"InvalidRequest", "GatePoisoned", "TraceMemoryExceeded", "SessionGone", "Gone", "DataExhausted",
            "SandboxError", "ConnectionLost"} <= names
    assert len(CLASSES) >= 40


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_exception_round_trips_pickle_with_its_message_and_fields(cls):
    error = instance_of(cls)
    error.add_note("raised in a test")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)  # the fields (field, value, leases, ...) and the notes
    assert isinstance(back, RLEngineError)
    for base in cls.__mro__:  # the stdlib type callers catch is kept too
        assert isinstance(back, base)


def test_a_field_error_is_rebuilt_without_calling_its_init():
    error = rlengine.InvalidRequest("num_samples", 0, "must be an integer >= 1")
    back = pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))
    assert (back.field, back.value, str(back)) == ("num_samples", 0, "num_samples=0: must be an integer >= 1")
    assert isinstance(back, ValueError)
