"""Errors of the Tinker API server, and how every failure is reported on its wire.

Each class names the field and the value at fault (like ``InvalidRequest``)
and carries the HTTP status and the wire ``code`` it is reported with. Each
also inherits the stdlib type a caller would catch. The statuses are chosen
for the Tinker SDK's retry rules: it retries 408, 409, 429 and 5xx (for
minutes), so only a condition that really passes (a full futures table, an
engine that is not serving) gets one of those; everything a retry cannot fix
is a 4xx the SDK raises at once.

Two shapes reach the client:

* a submission (or any plain call) that fails answers with its status and a
  JSON body ``{"error": {"code", "type", "message", "field", "value"}}``;
* a request that was accepted and failed later settles its future with an
  error; retrieving it answers 200 with Tinker's ``RequestFailedResponse``
  (``{"error": message, "category": "user" | "server"}``).

It must not hide programming errors: an exception it does not know is
``internal`` (500), logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from rlengine.errors import (
    ConfigurationError,
    EngineDeadError,
    FieldError,
    InvalidRequest,
    ModelNotLoaded,
    RequestAborted,
    RequestError,
)

__all__ = ["Forbidden", "Gone", "LimitExceeded", "NotSupported", "Overloaded", "PayloadTooLarge", "TinkerApiError",
           "Unauthorized", "UnknownEndpoint", "UnknownResource", "error_body", "failure_category", "http_status"]

log = logging.getLogger("rlengine.tinker_api")


class TinkerApiError(FieldError):
    """A request the Tinker API server refuses; ``field`` and ``value`` say what was wrong."""

    status = 400
    code = "invalid"


class NotSupported(TinkerApiError, NotImplementedError):
    """A Tinker feature or endpoint that rlengine does not serve (never a silent success)."""

    status = 400
    code = "not_supported"


class UnknownEndpoint(NotSupported):
    """A path this server does not serve (a Tinker endpoint rlengine lacks, or none at all)."""

    status = 404


class UnknownResource(TinkerApiError, LookupError):
    """No session, model, sampling session, checkpoint or future has that id (or path)."""

    status = 404
    code = "not_found"


class Gone(TinkerApiError, LookupError):
    """The resource existed but is over: a finished or expired session, an expired future."""

    status = 410
    code = "gone"


class Forbidden(TinkerApiError, PermissionError):
    """The resource belongs to a session of another API key."""

    status = 403
    code = "forbidden"


class Unauthorized(TinkerApiError, PermissionError):
    """A shared secret is configured and the request does not carry it."""

    status = 401
    code = "unauthorized"


class PayloadTooLarge(TinkerApiError, ValueError):
    """The body exceeds the server's ``max_body_bytes``."""

    status = 413
    code = "too_large"


class LimitExceeded(TinkerApiError, RuntimeError):
    """A configured limit (``max_models``) is reached; it stays reached until the client frees something."""

    status = 400
    code = "limit_exceeded"


class Overloaded(TinkerApiError, RuntimeError):
    """A bounded table is full of requests still in flight; retrying later helps (the SDK does)."""

    status = 429
    code = "overloaded"


def http_status(exc: BaseException) -> tuple[int, str]:
    """``(status, code)`` for a failure of a plain call."""
    if isinstance(exc, TinkerApiError):
        return exc.status, exc.code
    if isinstance(exc, (InvalidRequest, ConfigurationError)):
        return 400, "invalid"
    if isinstance(exc, EngineDeadError):
        return 503, "unavailable"
    if isinstance(exc, RequestError):
        # Recoverable for the engine, but a retry of the same request would meet
        # the same state: report it rather than let the SDK retry for minutes.
        return 400, "request_failed"
    log.error("rlengine.tinker_api: unexpected error", exc_info=exc)
    return 500, "internal"


def error_body(exc: BaseException) -> dict[str, Any]:
    _, code = http_status(exc)
    body: dict[str, Any] = {"code": code, "type": type(exc).__name__, "message": str(exc)}
    field = getattr(exc, "field", None)
    if field is not None:
        body["field"] = field
        value = getattr(exc, "value", None)
        body["value"] = value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)
    return {"error": body}


def failure_category(exc: BaseException) -> str:
    """Tinker's ``RequestErrorCategory`` of a request that failed after it was accepted."""
    if isinstance(exc, Overloaded):
        return "server"
    if isinstance(exc, (InvalidRequest, ConfigurationError, TinkerApiError, RequestAborted, ModelNotLoaded)):
        return "user"
    return "server"
