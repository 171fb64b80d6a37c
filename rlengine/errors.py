"""The exception hierarchy of rlengine.

One root, ``RLEngineError``. Every subclass also inherits the stdlib type a
caller would naturally catch (``InvalidRequest`` is a ``ValueError``,
``RequestTimeout`` a ``TimeoutError``), so generic handlers keep working.

The distinction that matters to callers is recoverable vs fatal:

* ``RequestError`` and its subclasses concern one request. The engine keeps
  serving everybody else; retrying or fixing the input is meaningful.
* ``EngineDeadError`` means the engine itself is gone (a backend crash, a dead
  compute thread, a closed engine). Every pending and every new future fails
  with it at once; nothing waits for an engine that will never answer.

Messages name the offending field and value. Every error survives
``pickle`` (Ray actors and multiprocessing pickle exceptions) with its
message and its fields, whatever its ``__init__`` takes.

``WIRE`` is the one table of how each error class is reported on every wire
(IPC, the HTTP APIs, the Tinker server): its code, its HTTP status, whose
fault it is, and the Tinker server's status where that must differ. The
servers derive their mapping from it and nothing else.

This module imports nothing but the standard library so that sandboxes and
the wire protocol can share it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class RLEngineError(Exception):
    """Root of every error rlengine raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Exception's own reduce calls ``cls(*self.args)``, which breaks every
        # subclass whose __init__ takes fields rather than the message. Rebuild
        # from the message and the fields instead, without calling __init__.
        return _rebuild, (type(self), self.args, self.__dict__)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _rebuild(cls: type[RLEngineError], args: tuple[object, ...], state: dict[str, object]) -> RLEngineError:
    # Allocate as ``cls(...)`` would, minus __init__: with the __new__ of the
    # builtin base that lays the instance out. With two builtin bases (an
    # InvalidRequest is a ValueError, a DrainTimeout a RuntimeError and a
    # TimeoutError) only one of them accepts the class, so try them in order.
    for base in cls.__mro__:
        if not base.__flags__ & _HEAPTYPE:
            try:
                error = base.__new__(cls, *args)
            except TypeError:
                continue
            break
    else:  # pragma: no cover - one builtin base always lays an exception out
        raise TypeError(f"cannot rebuild {cls.__qualname__}")
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigurationError(RLEngineError, ValueError):
    """An ``EngineConfig`` (or another configuration) holds an unusable value."""


class RequestError(RLEngineError):
    """Recoverable: one request failed; the engine keeps serving the others."""


class FieldError(RLEngineError):
    """An error about one field's value: ``field`` and ``value`` say what was wrong, for
    programmatic handling; the message is ``field=value: reason``."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field}={shown}: {reason}")


class InvalidRequest(FieldError, RequestError, ValueError):
    """A request carries an invalid value; it was rejected before queueing."""


class ContextLengthExceeded(InvalidRequest):
    """A prompt does not fit in the model's context. Servers report it as OpenAI does
    (``context_length_exceeded``, "maximum context length"), so clients that shorten or
    summarize their history on it recognise it."""

    def __init__(self, field: str, value: object, context: int, reason: str) -> None:
        self.context = context
        super().__init__(field, value, f"This model's maximum context length is {context} tokens; {reason}")


class ModelNotLoaded(RequestError, LookupError):
    """The sampler version or model a request addresses is not loaded.

    Raised at admission for stale requests; it never triggers a bring-up.
    """


class RequestAborted(RequestError):
    """Blocking work that was cancelled (by the caller or by shutdown) before it ran."""


class RequestTimeout(RequestError, TimeoutError):
    """A bounded wait ran out (``result(timeout)``, a drain deadline)."""


class BackendRequestError(RequestError, RuntimeError):
    """The backend failed one request mid-generation; its outcome is unknown.

    The request's gate lease stays poisoned until it is settled or written off.
    """


class ReplicaLost(RequestError, RuntimeError):
    """The sampler replica running this request died (``placement="ray"``): the request
    failed and nothing more of it will come. Its outcome is known, so its lease poisons
    nothing; the engine keeps serving on the other replicas (and a replacement)."""


class WeightSyncError(RLEngineError, RuntimeError):
    """A weight install did not reach every sampler replica in time (a replica failed, died
    or timed out): the install failed, and every replica is back on the previous version
    (or being replaced by one that is)."""


class GateError(RLEngineError, RuntimeError):
    """The scheduler refused a lease or install-gate operation in its current state."""


class GatePoisoned(GateError):
    """A weight install was refused: leases with unknown outcomes exist.

    ``leases`` lists them (lease id, session id, reason). Settle or write
    each off (``Engine.write_off``) before installing a new version.
    """

    def __init__(self, leases: list[tuple[int, str | None, str]]) -> None:
        self.leases = leases
        shown = ", ".join(f"lease {i} (session={s!r}: {r})" for i, s, r in leases[:8])
        more = f" and {len(leases) - 8} more" if len(leases) > 8 else ""
        super().__init__(f"gate poisoned by {len(leases)} unsettled lease(s): {shown}{more}")


class DrainTimeout(GateError, TimeoutError):
    """In-flight leases did not finish before the drain deadline."""


class EngineDeadError(RLEngineError, RuntimeError):
    """Fatal: the engine stopped (crash or close). Every future fails fast with it."""


class EngineClosed(EngineDeadError):
    """The engine was closed on purpose; work submitted afterwards is refused."""


class TrainerLost(RLEngineError, RuntimeError):
    """A worker of the sharded trainer (``placement.trainer_workers > 1``) died or a training
    call timed out: the FSDP group cannot continue, so that call and every later training
    call fail with this (typed, at once: nothing waits for a lost rank). Sampling goes on;
    training resumes from a checkpoint in a new engine."""


# -- the one status table ----------------------------------------------------------------------------------------

_TINKER_RETRIES = ("the Tinker SDK (0.38) resends a 408, 409, 429 or 5xx for minutes (up to 5: "
                   "lib/internal_client_holder.py execute_with_retries; a sampling client's RetryHandler until "
                   "120 minutes pass without progress: lib/retry_handler.py)")


class Wire(NamedTuple):
    """How one exception class is reported on every wire."""

    code: str
    """The wire code: IPC ``Error.code``, HTTP ``error.code``, the Tinker body's ``code``."""
    status: int
    """The HTTP status on the serving layer (Chat Completions, Responses, Messages). One code has one status
    there: the HTTP server maps a code to its status."""
    fault: Literal["user", "server"]
    """Whose fault: the Tinker ``category`` of a future that failed with it."""
    why: str
    """Why this code and status (and, where ``tinker`` is set, why Tinker differs)."""
    tinker: int | None = None
    """The Tinker server's status where it must differ from ``status``; None: the same."""

    @property
    def tinker_status(self) -> int:
        return self.status if self.tinker is None else self.tinker


UNKNOWN = Wire("internal", 500, "server", "an exception no row covers is a bug: reported as internal and logged "
               "with its traceback")
"""What the servers report for an exception whose class has no row, nor any of its bases."""

WIRE: dict[str, Wire] = {
    # rlengine.errors (the root has no row: an RLEngineError no narrower row covers is reported as UNKNOWN)
    "rlengine.errors.ConfigurationError": Wire("invalid", 400, "user", "a configured value is unusable: the caller "
                                               "fixes it (a Tinker create_model's LoRA or optimizer settings)"),
    "rlengine.errors.RequestError": Wire("internal", 500, "server", "one request failed for a reason no narrower row "
                                         "names; the engine serves on. Tinker: a retry meets the same state, and "
                                         f"{_TINKER_RETRIES}", tinker=400),
    "rlengine.errors.FieldError": Wire("invalid", 400, "user", "one field's value is wrong; field and value go with it"),
    "rlengine.errors.InvalidRequest": Wire("invalid", 400, "user", "an invalid value, rejected before queueing"),
    "rlengine.errors.ContextLengthExceeded": Wire("context_length_exceeded", 400, "user", "OpenAI's code, so clients "
                                                  "that shorten their history on it recognise it"),
    "rlengine.errors.ModelNotLoaded": Wire("unavailable", 503, "user", "a request caught between two weight versions: "
                                           "the next one addresses the loaded version. Tinker: a sampling session "
                                           "names fixed weights, and no retry loads them again", tinker=400),
    "rlengine.errors.RequestAborted": Wire("aborted", 503, "user", "work cancelled before it ran, by its caller or a "
                                           "closing engine (as a turn cut by shutdown, which another server may take). "
                                           f"Tinker: a cancelled call stays cancelled, and {_TINKER_RETRIES}",
                                           tinker=400),
    "rlengine.errors.RequestTimeout": Wire("unavailable", 503, "server", "a bounded wait ran out; the work behind it "
                                           "finishes or fails, so a later try can succeed (retries are right)"),
    "rlengine.errors.BackendRequestError": Wire("internal", 500, "server", "the backend failed one request "
                                                "mid-generation; a fresh request runs on a backend that still serves"),
    "rlengine.errors.ReplicaLost": Wire("unavailable", 503, "server", "the replica died; the others (and its "
                                        "replacement) serve a retry"),
    "rlengine.errors.WeightSyncError": Wire("unavailable", 503, "server", "an install that missed a replica; every "
                                            "replica is back on the previous version, so the install can be retried"),
    "rlengine.errors.GateError": Wire("unavailable", 503, "server", "the gate refused in its current state (sealed "
                                      "for an install, draining); it reopens by itself"),
    "rlengine.errors.GatePoisoned": Wire("unavailable", 503, "server", "installs are refused until an operator "
                                         "settles or writes off the unknown-outcome leases. Tinker: it never passes "
                                         f"by itself, and {_TINKER_RETRIES}", tinker=400),
    "rlengine.errors.DrainTimeout": Wire("unavailable", 503, "server", "in-flight leases outlived the drain deadline; "
                                         "they finish, and a later install drains"),
    "rlengine.errors.EngineDeadError": Wire("unavailable", 503, "server", "the engine is gone (crash or close): the "
                                            "server is not serving. Tinker: a dead engine never comes back in this "
                                            f"process, and {_TINKER_RETRIES}; it raises at once", tinker=400),
    "rlengine.errors.EngineClosed": Wire("unavailable", 503, "server", "closed on purpose: as EngineDeadError, "
                                         "Tinker included", tinker=400),
    "rlengine.errors.TrainerLost": Wire("unavailable", 503, "server", "a lost trainer rank: training resumes only in a "
                                        "new engine. Tinker: no retry recovers it", tinker=400),
    # rlengine.protocol: the serving layer's own classes (the IPC client re-raises them by code)
    "rlengine.protocol.ServeError": Wire("internal", 500, "server", "a server failure no narrower class names (and "
                                         "what a client makes of a code it does not know)"),
    "rlengine.protocol.BadFrame": Wire("bad_frame", 400, "user", "an unreadable frame"),
    "rlengine.protocol.FrameTooLarge": Wire("frame_too_large", 413, "user", "a frame or body over the server's limit"),
    "rlengine.protocol.BadMessage": Wire("bad_message", 400, "user", "a frame or body that is not a valid message"),
    "rlengine.protocol.InvalidValue": Wire("invalid", 400, "user", "an invalid field value"),
    "rlengine.protocol.Unsupported": Wire("unsupported", 400, "user", "the server lacks what the request needs"),
    "rlengine.protocol.SessionNotFound": Wire("not_found", 404, "user", "no such session"),
    "rlengine.protocol.SessionGone": Wire("gone", 410, "user", "closed or retired: it takes no more requests"),
    "rlengine.protocol.SessionForbidden": Wire("forbidden", 403, "user", "a missing or wrong token"),
    "rlengine.protocol.SessionExists": Wire("exists", 409, "user", "the id is taken. Tinker: a taken id stays taken, "
                                            f"and {_TINKER_RETRIES}", tinker=400),
    "rlengine.protocol.TurnAborted": Wire("aborted", 503, "server", "the turn was cut (shutdown, a retired session) "
                                          "and not recorded; another server may take it. Tinker: as RequestAborted",
                                          tinker=400),
    "rlengine.protocol.ContextTooLong": Wire("context_length_exceeded", 400, "user", "as ContextLengthExceeded"),
    "rlengine.protocol.SessionLimit": Wire("too_many_sessions", 429, "user", "the server holds as many sessions as it "
                                           "keeps; closed or expired ones free room, so a backed-off retry can pass"),
    "rlengine.protocol.Unavailable": Wire("unavailable", 503, "server", "the engine or the trace store is not serving"),
    "rlengine.protocol.ConnectionLost": Wire("unavailable", 503, "server", "client side (the connection closed before "
                                             "a reply); a server that met it reports its peer unavailable"),
    # rlengine.trace.errors
    "rlengine.trace.errors.TraceMemoryExceeded": Wire("unavailable", 503, "server", "the trace store is full; "
                                                      "retention drops finished sessions, so a later try can pass"),
    "rlengine.trace.errors.UnknownSession": Wire("aborted", 503, "server", "the session's trace was dropped while its "
                                                 "turn ran: the turn is not recorded. Tinker: as RequestAborted",
                                                 tinker=400),
    # rlengine.tinker_api.errors
    "rlengine.tinker_api.errors.TinkerApiError": Wire("invalid", 400, "user", "a request the Tinker server refuses"),
    "rlengine.tinker_api.errors.NotSupported": Wire("not_supported", 400, "user", "a Tinker feature rlengine does not "
                                                    "serve (never a silent success)"),
    "rlengine.tinker_api.errors.UnknownEndpoint": Wire("not_supported", 400, "user", "a path not served. Tinker: 404, "
                                                       "which the SDK raises at once; the code stays not_supported "
                                                       "(on the serving layer one code has one status)", tinker=404),
    "rlengine.tinker_api.errors.UnknownResource": Wire("not_found", 404, "user", "no resource has that id"),
    "rlengine.tinker_api.errors.Gone": Wire("gone", 410, "user", "over (a finished session, an expired future); on "
                                            "retrieve_future the SDK re-submits the original call on a 410, which is "
                                            "what an expired future needs (lib/api_future_impl.py)"),
    "rlengine.tinker_api.errors.ProvenanceError": Wire("invalid_provenance", 400, "user", "a datum's provenance "
                                                       "spans name what the server did not sample (or no longer "
                                                       "matches): the caller fixes the data, no retry helps"),
    "rlengine.tinker_api.errors.Forbidden": Wire("forbidden", 403, "user", "another API key's resource"),
    "rlengine.tinker_api.errors.Unauthorized": Wire("unauthorized", 401, "user", "a missing or wrong API key"),
    "rlengine.tinker_api.errors.PayloadTooLarge": Wire("too_large", 413, "user", "a body over max_body_bytes"),
    "rlengine.tinker_api.errors.LimitExceeded": Wire("limit_exceeded", 400, "user", "a configured limit that stays "
                                                     "reached until the client frees something: no retry"),
    "rlengine.tinker_api.errors.Overloaded": Wire("overloaded", 429, "server", "a bounded table full of requests in "
                                                  "flight: it drains, and the SDK backs off and retries (the one "
                                                  "Tinker refusal meant to be retried)"),
}
"""Every error class the engine, the trace store, the serving layer and the Tinker server raise, by
``module.QualName``: how each wire reports it. Keyed by name so that this leaf module need not import the
higher layers whose classes it lists; ``tests/test_error_wires.py`` checks that every name is a class and
every class has a name here, and walks each through every wire."""


def wire_of(cls: type[BaseException]) -> Wire:
    """The row of ``cls``: its own or its nearest base's (the most specific wins); ``UNKNOWN`` if none has one."""
    for base in cls.__mro__:
        row = WIRE.get(f"{base.__module__}.{base.__qualname__}")
        if row is not None:
            return row
    return UNKNOWN


def own_wire(cls: type[BaseException]) -> Wire:
    """The row naming ``cls`` itself; a class that must have one (a wire class: its code comes from here)
    and has none fails its import, loudly."""
    row = WIRE.get(f"{cls.__module__}.{cls.__qualname__}")
    if row is None:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}: no row in rlengine.errors.WIRE; add one")
    return row
