"""Errors of the Tinker API server, and how every failure is reported on its wire.

Each class names the field and the value at fault (like ``InvalidRequest``)
and inherits the stdlib type a caller would catch. Its wire ``code`` and HTTP
``status`` (class attributes) come from the one table,
``rlengine.errors.WIRE``, as does the reporting of every other exception: the
serving layer's code and status, except the rows whose ``tinker`` column
says Tinker must differ, and why. Those exist for the Tinker SDK's retry
rules: it resends a 408, 409, 429 or 5xx for minutes (up to 5 in
``tinker/lib/internal_client_holder.py``, ``execute_with_retries``; a
sampling client's ``lib/retry_handler.py`` until 120 minutes pass without
progress), so only a condition
that passes by itself (a full futures table, a gate that reopens) keeps one
of those; what a retry cannot fix (an aborted call, a dead engine, a
poisoned gate) is a 4xx the SDK raises at once.

Two shapes reach the client:

* a submission (or any plain call) that fails answers with its status and a
  JSON body ``{"error": {"code", "type", "message", "field", "value"}}``;
* a request that was accepted and failed later settles its future with an
  error; retrieving it answers 200 with Tinker's ``RequestFailedResponse``
  (``{"error": message, "category": "user" | "server"}``, the row's ``fault``).

It must not hide programming errors: an exception no row covers is
``internal`` (500), logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from rlengine.errors import UNKNOWN, FieldError, own_wire, wire_of

__all__ = ["Forbidden", "Gone", "LimitExceeded", "NotSupported", "Overloaded", "PayloadTooLarge", "ProvenanceError",
           "TinkerApiError", "Unauthorized", "UnknownEndpoint", "UnknownResource", "error_response",
           "failure_category"]

log = logging.getLogger("rlengine.tinker_api")


class TinkerApiError(FieldError):
    """A request the Tinker API server refuses; ``field`` and ``value`` say what was wrong.

    ``status`` and ``code``: how the Tinker server reports the class, from its row in the table (a class
    without one fails its import)."""

    status: int
    code: str

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        row = own_wire(cls)
        cls.status, cls.code = row.tinker_status, row.code


_ROW = own_wire(TinkerApiError)
TinkerApiError.status, TinkerApiError.code = _ROW.tinker_status, _ROW.code


class NotSupported(TinkerApiError, NotImplementedError):
    """A Tinker feature or endpoint that rlengine does not serve (never a silent success)."""


class UnknownEndpoint(NotSupported):
    """A path this server does not serve (a Tinker endpoint rlengine lacks, or none at all)."""


class UnknownResource(TinkerApiError, LookupError):
    """No session, model, sampling session, checkpoint or future has that id (or path)."""


class Gone(TinkerApiError, LookupError):
    """The resource existed but is over: a finished or expired session, an expired future."""


class ProvenanceError(TinkerApiError, ValueError):
    """A datum's provenance spans do not match what the server sampled: an unknown sequence, a run outside
    it, other tokens than the recorded ones, or a sequence without the stability information its loss needs."""


class Forbidden(TinkerApiError, PermissionError):
    """The resource belongs to a session of another API key."""


class Unauthorized(TinkerApiError, PermissionError):
    """A shared secret is configured and the request does not carry it."""


class PayloadTooLarge(TinkerApiError, ValueError):
    """The body exceeds the server's ``max_body_bytes``."""


class LimitExceeded(TinkerApiError, RuntimeError):
    """A configured limit (``max_models``) is reached; it stays reached until the client frees something."""


class Overloaded(TinkerApiError, RuntimeError):
    """A bounded table is full of requests still in flight; retrying later helps (the SDK does)."""


def error_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and the JSON body reporting a failed plain call, by the row of ``exc``."""
    row = wire_of(type(exc))
    if row is UNKNOWN:
        log.error("rlengine.tinker_api: unexpected error", exc_info=exc)
    body: dict[str, Any] = {"code": row.code, "type": type(exc).__name__, "message": str(exc)}
    field = getattr(exc, "field", None)  # a FieldError's, or a ServeError's that carries one
    if field is not None:
        body["field"] = field
        value = getattr(exc, "value", None)
        body["value"] = value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)
    return row.tinker_status, {"error": body}


def failure_category(exc: BaseException) -> str:
    """Tinker's ``RequestErrorCategory`` of a request that failed after it was accepted: the row's ``fault``."""
    return wire_of(type(exc)).fault
