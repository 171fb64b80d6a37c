"""How the serving layer reports failures: any exception -> a ``ServeError`` (its wire code) and an HTTP status.

The error classes themselves live in ``rlengine.protocol`` (shared with the
client, which re-raises them), and how every class is reported lives in one
table, ``rlengine.errors.WIRE``, which the Tinker server reads too. This
module only applies it, so IPC and HTTP report the same failure the same
way: an invalid value is ``invalid`` (HTTP 400) naming the field and value, a
closed engine ``unavailable`` (503), a retired session ``gone`` (410).

It must not swallow programming errors silently: an exception no row covers
becomes ``internal`` (500) and is logged with its traceback.
"""

from __future__ import annotations

import logging

from rlengine.errors import UNKNOWN, WIRE, FieldError, wire_of
from rlengine.protocol import ERROR_CODES, ServeError

__all__ = ["HTTP_STATUS", "to_serve_error"]

log = logging.getLogger("rlengine.serve")

_SHOWN = 80
"""A reported value's repr is cut to this many characters (as ``FieldError`` shows it)."""

HTTP_STATUS: dict[str, int] = {row.code: row.status for row in (*WIRE.values(), UNKNOWN)}
"""The HTTP status of each wire code, from the table (where one code has one status)."""


def to_serve_error(exc: BaseException) -> ServeError:
    """The ``ServeError`` to report for ``exc``, by its row in the table; a ``FieldError``'s field and value
    go with it."""
    if isinstance(exc, ServeError):
        return exc
    row = wire_of(type(exc))
    if row is UNKNOWN:
        log.error("rlengine.serve: unexpected error", exc_info=exc)
    cls = ERROR_CODES.get(row.code, ServeError)
    err = cls(f"{type(exc).__name__}: {exc}")
    if cls is ServeError:
        err.code = row.code  # a code no protocol class has (a Tinker one): the instance carries it
    if isinstance(exc, FieldError):
        shown = repr(exc.value)
        err.field, err.value = exc.field, shown if len(shown) <= _SHOWN else shown[:_SHOWN - 3] + "..."
    return err
