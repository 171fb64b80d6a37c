"""How the servers report failures: any exception -> a wire code, a message and an HTTP status.

The error classes themselves live in ``rlengine.protocol`` (shared with the
client, which re-raises them). This module maps the engine's and the trace
store's exceptions onto that vocabulary, so IPC and HTTP report the same
failure the same way: an invalid value is ``invalid`` (HTTP 400) naming the
field, a closed engine ``unavailable`` (503), a retired session ``gone``
(410).

It must not swallow programming errors silently: an exception it does not
know becomes ``internal`` (500) and is logged with its traceback.
"""

from __future__ import annotations

import logging

from rlengine.errors import (
    ContextLengthExceeded,
    DrainTimeout,
    EngineDeadError,
    FieldError,
    GateError,
    InvalidRequest,
    ModelNotLoaded,
    RequestTimeout,
)
from rlengine.protocol import ContextTooLong, InvalidValue, ServeError, TurnAborted, Unavailable
from rlengine.trace.errors import TraceMemoryExceeded, UnknownSession

__all__ = ["HTTP_STATUS", "to_serve_error"]

_SHOWN = 80
"""A reported value's repr is cut to this many characters (as ``FieldError`` shows it)."""


def _with_field(err: ServeError, exc: FieldError) -> ServeError:
    shown = repr(exc.value)
    err.field, err.value = exc.field, shown if len(shown) <= _SHOWN else shown[:_SHOWN - 3] + "..."
    return err

log = logging.getLogger("rlengine.serve")

HTTP_STATUS: dict[str, int] = {
    "internal": 500, "bad_frame": 400, "frame_too_large": 413, "bad_message": 400, "invalid": 400,
    "unsupported": 400, "not_found": 404, "gone": 410, "forbidden": 403, "exists": 409, "aborted": 503,
    "unavailable": 503, "too_many_sessions": 429, "context_length_exceeded": 400,
}


def to_serve_error(exc: BaseException) -> ServeError:
    """The ``ServeError`` to report for ``exc``; a ``FieldError``'s field and value go with it."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return _with_field(ContextTooLong(str(exc)), exc)
    if isinstance(exc, InvalidRequest):
        return _with_field(InvalidValue(str(exc)), exc)
    if isinstance(exc, EngineDeadError):
        return Unavailable(f"the engine is not serving: {exc}")
    if isinstance(exc, TraceMemoryExceeded):
        return Unavailable(f"the trace store is full: {exc}")
    if isinstance(exc, (ModelNotLoaded, DrainTimeout, GateError, RequestTimeout)):
        return Unavailable(str(exc))
    if isinstance(exc, UnknownSession):
        return TurnAborted(f"the session's trace was dropped while the turn ran: {exc}")
    log.error("rlengine.serve: unexpected error", exc_info=exc)
    return ServeError(f"internal error: {type(exc).__name__}: {exc}")
