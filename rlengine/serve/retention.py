"""Which sessions exist and for how long: opening, authorizing, retiring and expiring them (``Retention``).

``SessionTable`` keeps the live sessions (least recently active first) and
the retired ones whose traces await ``collect``. Every bound resolves without
an operator (``sweep``, run as sessions open and turns start): an idle
session is retired, a retired session's trace freed once old, beyond the
newest ``max_closed``, or while the trace store runs out of room. A retired
session's id is never reused, and its later requests get ``gone``.

Loop thread only. It neither renders nor records (``TraceCapture`` does);
retiring a session aborts its turns in flight on their replicas.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict
from typing import Any

import msgspec

from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.protocol import SessionExists, SessionForbidden, SessionGone, SessionLimit, SessionNotFound
from rlengine.serve.router import SessionRouter
from rlengine.serve.session_types import Session
from rlengine.trace import TraceStore

__all__ = ["Retention", "SessionTable"]

_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
log = logging.getLogger("rlengine.serve")


class Retention(msgspec.Struct, kw_only=True, frozen=True):
    """How long sessions and their traces are kept (``SessionManager.sweep``); every bound resolves
    without an operator, so a long-running server's memory stays bounded."""

    max_open: int = 100_000
    """Open sessions at most; one more is refused (``SessionLimit``)."""
    idle_ttl_s: float = 3600.0
    """A live session with no turn for this long is retired (later requests: ``gone``)."""
    closed_ttl_s: float = 600.0
    """A retired session's trace is kept this long for ``collect``, then freed."""
    max_closed: int = 10_000
    """Retired sessions' traces kept at most (the oldest are freed first)."""
    store_high_water: float = 0.9
    """While the trace store holds more than this share of its bound, retired traces are freed,
    oldest first, before a new session or turn is refused for lack of room."""

    def __post_init__(self) -> None:
        for name in ("max_open", "max_closed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigurationError(f"{name}={v!r}: must be an integer >= 1")
        for name in ("idle_ttl_s", "closed_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name}={getattr(self, name)!r}: must be > 0")
        if not 0 < self.store_high_water <= 1:
            raise ConfigurationError(f"store_high_water={self.store_high_water!r}: must be in (0, 1]")


class SessionTable:
    """The live and retired sessions over ``router``'s replicas, their traces in ``store``."""

    def __init__(self, router: SessionRouter, store: TraceStore, retention: Retention, share: str | None) -> None:
        self.router = router
        self.store = store
        self.retention = retention
        self.share = share
        """The trace store's share key of every session opened here (None: each a tree of its own)."""
        self._live: OrderedDict[str, Session] = OrderedDict()
        """Least recently active first (idle expiry takes from the front)."""
        self._retired: dict[str, Session] = {}
        """Retired sessions whose traces await ``collect``, in retirement order."""

    def open(self, session_id: str | None = None) -> Session:
        """A new session with a fresh token; ``session_id`` None picks an unguessable id."""
        if session_id is None:
            session_id = f"s-{secrets.token_hex(12)}"
        elif not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id) or not session_id.strip("."):
            # Only dots ("." and "..") would name path segments in URLs and run directories.
            raise InvalidRequest("session_id", session_id, "must be 1-128 characters of [A-Za-z0-9._:@-], "
                                 "not only dots")
        if session_id in self._retired or self.router.is_gone(session_id):
            raise SessionGone(f"session_id={session_id!r}: a session with this id was retired; ids are not reused")
        if session_id in self._live or session_id in self.store:
            raise SessionExists(f"session_id={session_id!r}: a session with this id exists")
        self.sweep()
        if len(self._live) >= self.retention.max_open:
            raise SessionLimit(f"{len(self._live)} sessions are open, the most this server keeps (max_open_sessions); "
                               "close some")
        session = Session(session_id, secrets.token_urlsafe(24), self.store.open(session_id, share=self.share))
        self._live[session_id] = session
        return session

    def authorize(self, session_id: Any, token: Any, field: str = "token") -> Session:
        """The live session ``session_id`` if ``token`` is its token; raises otherwise
        (``field``: what the wire calls the token, for the message)."""
        session = self._live.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            if isinstance(session_id, str) and (session_id in self._retired or self.router.is_gone(session_id)):
                raise SessionGone(f"session_id={session_id!r}: the session was closed or retired")
            raise SessionNotFound(f"session_id={session_id!r}: no such session")
        if not isinstance(token, str) or not token:
            raise SessionForbidden(f"{field}={token!r}: session_id={session_id!r} names a session, and a session's "
                                   "requests must carry its token")
        if not hmac.compare_digest(token.encode(), session.token.encode()):
            raise SessionForbidden(f"{field}: not the token of session_id={session_id!r}")
        return session

    def known(self, session_id: str) -> bool:
        """``session_id`` names a session opened here (live, or retired and still remembered)."""
        return session_id in self._live or session_id in self._retired or self.router.is_gone(session_id)

    def touch(self, session: Session) -> None:
        """``session`` starts a turn: it is the most recently active (the last idle expiry reaches)."""
        session.active_at = time.monotonic()
        self._live.move_to_end(session.session_id)

    def retire(self, session_id: str) -> None:
        """End a session: turns in flight are aborted (not recorded), later requests
        get ``gone``; its trace waits for ``collect``."""
        session = self._live.pop(session_id, None)
        if session is None:
            if session_id in self._retired:
                return
            raise SessionNotFound(f"session_id={session_id!r}: no such live session")
        session.retired = True
        session.active_at = time.monotonic()
        self._retired[session_id] = session
        for request_id, replica in list(session.in_flight.items()):
            self.router.engines[replica].abort(request_id)
        self.router.retire(session_id)

    def take(self, session_id: str) -> Session:
        """A session handed over for collection (a live one is retired first), no longer kept
        here; the caller exports its trace, then drops it from the store."""
        if session_id in self._live:
            self.retire(session_id)
        session = self._retired.pop(session_id, None)
        if session is None:
            raise SessionNotFound(f"session_id={session_id!r}: no such session to collect")
        return session

    def sweep(self, now: float | None = None) -> int:
        """Apply the retention policy (``Retention``); returns how many sessions it ended or freed.

        Live sessions idle (no turn started or finished, none in flight) for
        ``idle_ttl_s`` are retired; retired sessions' traces are freed once
        older than ``closed_ttl_s``, beyond the newest ``max_closed``, or,
        oldest first, while the trace store is over ``store_high_water`` of
        its bound. Runs when a session opens and a turn starts (O(what it frees))."""
        now = time.monotonic() if now is None else now
        policy, done = self.retention, 0
        live = self._live
        while live:
            session = next(iter(live.values()))
            if now - session.active_at < policy.idle_ttl_s:
                break
            if session.in_flight:
                live.move_to_end(session.session_id)  # busy, not idle: look again later
                session.active_at = now
                continue
            log.info("rlengine.serve: session %s idle for %.0f s; retired", session.session_id, policy.idle_ttl_s)
            self.retire(session.session_id)
            done += 1
        retired = self._retired
        limit = self.store.max_bytes * policy.store_high_water if self.store.max_bytes else None
        while retired:
            session = next(iter(retired.values()))
            if (now - session.active_at < policy.closed_ttl_s and len(retired) <= policy.max_closed
                    and (limit is None or self.store.memory_bytes <= limit)):
                break
            del retired[session.session_id]
            self.store.drop(session.session_id)
            done += 1
        return done

    def retired(self) -> list[str]:
        """Retired sessions whose traces await ``collect``."""
        return list(self._retired)

    def live(self) -> list[str]:
        return list(self._live)
