"""Session affinity over data-parallel engine replicas, and tombstones of retired sessions.

``SessionRouter`` pins each session to one replica (an ``Engine``) on the
session's first turn, choosing the least loaded one then: fewest requests in
flight, then fewest pinned sessions, then the lowest index. A session stays
on its replica for life, so its turns reuse that replica's prefix cache and
run under that replica's scheduler.

Retiring a session leaves a *tombstone*: for ``ttl_s`` seconds any request
naming it is refused as ``gone`` (HTTP 410), not ``not_found``, so a late
client learns its session ended rather than that it never existed.
Tombstones are bounded twice: they expire after ``ttl_s``, and at most
``max_tombstones`` are kept (the oldest go first; a request for an evicted
one is then ``not_found``, still refused). Expiry is amortized: every
``retire`` and every lookup first pops the expired ones from the front of an
insertion-ordered map (tombstones are created in time order, so the front
is always the oldest).

Loop thread only, like all engine state; this module never talks to a
backend or a client.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rlengine.errors import ConfigurationError

if TYPE_CHECKING:
    from rlengine.core.engine import Engine

__all__ = ["SessionRouter"]


class SessionRouter:
    """Pins sessions to replicas (least loaded first) and remembers retired ones."""

    def __init__(self, engines: Sequence[Engine], *, ttl_s: float = 3600.0, max_tombstones: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not engines:
            raise ConfigurationError("engines=[]: a router needs at least one replica")
        if not ttl_s > 0:
            raise ConfigurationError(f"tombstone_ttl_s={ttl_s!r}: must be > 0")
        if isinstance(max_tombstones, bool) or not isinstance(max_tombstones, int) or max_tombstones < 1:
            raise ConfigurationError(f"max_tombstones={max_tombstones!r}: must be an integer >= 1")
        self.engines = list(engines)
        self.ttl_s = ttl_s
        self.max_tombstones = max_tombstones
        self._clock = clock
        self._pins: dict[str, int] = {}
        self._in_flight = [0] * len(self.engines)
        self._sessions = [0] * len(self.engines)
        self._tombstones: OrderedDict[str, float] = OrderedDict()

    # -- affinity ---------------------------------------------------------------------

    def least_loaded(self) -> int:
        """The replica a new session (or a sessionless request) should use now."""
        return min(range(len(self.engines)), key=lambda r: (self._in_flight[r], self._sessions[r], r))

    def affine(self, hint: str) -> int:
        """The replica for a stateless request that names a session it holds no token for (an
        affinity hint): the same hint, the same replica, and nothing remembered for it."""
        return zlib.crc32(hint.encode("utf-8", "surrogatepass")) % len(self.engines)

    def pin(self, session_id: str) -> int:
        """The replica of ``session_id``, chosen (least loaded) on its first call."""
        replica = self._pins.get(session_id)
        if replica is None:
            replica = self._pins[session_id] = self.least_loaded()
            self._sessions[replica] += 1
        return replica

    def replica_of(self, session_id: str) -> int | None:
        return self._pins.get(session_id)

    def started(self, replica: int) -> None:
        """A request began on ``replica`` (the load ``least_loaded`` compares)."""
        self._in_flight[replica] += 1

    def finished(self, replica: int) -> None:
        self._in_flight[replica] -= 1

    def load(self) -> list[tuple[int, int]]:
        """Per replica: (requests in flight, sessions pinned)."""
        return list(zip(self._in_flight, self._sessions))

    # -- tombstones -------------------------------------------------------------------

    def retire(self, session_id: str) -> None:
        """Unpin ``session_id`` and leave its tombstone (refreshed if it had one)."""
        replica = self._pins.pop(session_id, None)
        if replica is not None:
            self._sessions[replica] -= 1
        now = self._clock()
        self._expire(now)
        self._tombstones[session_id] = now + self.ttl_s
        self._tombstones.move_to_end(session_id)
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    def is_gone(self, session_id: str) -> bool:
        """Whether ``session_id`` has a live tombstone."""
        expires = self._tombstones.get(session_id)
        if expires is None:
            return False
        now = self._clock()
        if expires <= now:
            self._expire(now)
            return False
        return True

    def _expire(self, now: float) -> None:
        tombs = self._tombstones
        while tombs:
            session_id, expires = next(iter(tombs.items()))
            if expires > now:
                return
            del tombs[session_id]

    @property
    def tombstones(self) -> int:
        """Tombstones held now (expired ones may linger until the next retire or lookup)."""
        return len(self._tombstones)
