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
message and its fields, whatever its ``__init__`` takes. This module imports
nothing but the standard library so that sandboxes and the wire protocol can
share it.
"""

from __future__ import annotations


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
    """The request gate refused an operation in its current state."""


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
