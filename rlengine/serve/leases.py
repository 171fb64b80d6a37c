"""The session layer's turns in flight, each holding a lease of its replica's scheduler: abandoning and aborting them.

Every turn is held here from submission to settlement (request id ->
replica and session), and so is a chat turn whose prompt the render thread
is still preparing (a placeholder future, not yet submitted). A turn whose
client went away (``abandon``) is aborted at once, on every wire alike: it
records nothing, and its lease settles as aborted in the same loop callback,
so the gate is never poisoned by it and the next weight install goes ahead.
If output may have reached the client first (a streamed turn), its session
is marked ``tainted``. Operators see the leases whose outcome is unknown and
may write one off.

Loop thread only. It submits nothing (``SessionManager`` does) and records
nothing (``TraceCapture`` does).
"""

from __future__ import annotations

import logging
from typing import Any

from rlengine.core.futures import RequestFuture
from rlengine.errors import InvalidRequest
from rlengine.protocol import TurnAborted
from rlengine.serve.router import SessionRouter
from rlengine.serve.session_types import Session, TurnResult

__all__ = ["TurnLeases"]

log = logging.getLogger("rlengine.serve")


class TurnLeases:
    """The turns in flight over ``router``'s replicas, and the placeholders of turns being prepared."""

    def __init__(self, router: SessionRouter) -> None:
        self.router = router
        self._turns: dict[str, tuple[int, Session | None]] = {}
        """Every turn in flight: request id -> (replica, session or None)."""
        self._preparing: dict[str, RequestFuture[TurnResult]] = {}
        """Turns whose prompt the render thread is preparing (not yet submitted), by placeholder id."""
        self._prepared = 0

    def __len__(self) -> int:
        return len(self._turns) + len(self._preparing)

    def hold(self, request_id: str, replica: int, session: Session | None) -> None:
        """Turn ``request_id`` was submitted to ``replica``: in flight until ``release``."""
        self._turns[request_id] = (replica, session)
        if session is not None:
            session.in_flight[request_id] = replica

    def release(self, request_id: str, session: Session | None) -> None:
        """Turn ``request_id`` settled (recorded, failed or aborted)."""
        self._turns.pop(request_id, None)
        if session is not None:
            session.in_flight.pop(request_id, None)

    def placeholder(self) -> RequestFuture[TurnResult]:
        """A future for a turn whose prompt is being prepared; abandoned or aborted before
        ``claim``, it settles as aborted (``drop``)."""
        self._prepared += 1
        pending_id = f"preparing-{self._prepared}"
        out: RequestFuture[TurnResult] = RequestFuture(pending_id, self.drop)
        self._preparing[pending_id] = out
        return out

    def claim(self, pending_id: str) -> RequestFuture[TurnResult] | None:
        """The placeholder ``pending_id``, its prompt ready; None if it was dropped meanwhile."""
        return self._preparing.pop(pending_id, None)

    def drop(self, pending_id: str) -> None:
        """Abort a turn whose prompt is still being rendered: it settles now, and is never submitted."""
        out = self._preparing.pop(pending_id, None)
        if out is not None:
            out.set_exception(TurnAborted(f"turn {pending_id} was aborted before its prompt was rendered; "
                                          "nothing was recorded"))

    def abandon(self, request_id: str, reason: str, *, output_sent: bool = False) -> None:
        """The client of turn ``request_id`` went away before its reply (see the module docstring):
        the turn is aborted (nothing recorded, its lease settled, the gate clean); with
        ``output_sent`` (something streamed may have reached the client) its session is tainted."""
        if request_id in self._preparing:
            self.drop(request_id)  # not submitted yet: nothing can have reached the client
            return
        entry = self._turns.get(request_id)
        if entry is None:
            return
        replica, session = entry
        if output_sent and session is not None and not session.retired:
            session.tainted = True
        log.debug("rlengine.serve: turn %s abandoned: %s", request_id, reason)
        self.router.engines[replica].abort(request_id)

    def abort_all(self) -> None:
        """Abort every turn in flight (shutdown): each settles as aborted, nothing recorded."""
        for request_id, (replica, _session) in list(self._turns.items()):
            self.router.engines[replica].abort(request_id)
        for pending_id in list(self._preparing):
            self.drop(pending_id)

    def unknown_leases(self) -> list[dict[str, Any]]:
        """Every lease with an unknown outcome, on every replica (for operators)."""
        return [{"replica": replica, "lease_id": lease.lease_id, "session_id": lease.session_id,
                 "request_id": lease.request_id, "reason": lease.reason}
                for replica, engine in enumerate(self.router.engines) for lease in engine.scheduler.unknown_leases()]

    def write_off_lease(self, replica: int, lease_id: int) -> RequestFuture[Any]:
        """An operator gives up on one unknown outcome now (a lease marked unknown by an embedder
        or a failing replica: client disconnects never leave one)."""
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < len(self.router.engines):
            raise InvalidRequest("replica", replica, f"must be in [0, {len(self.router.engines)})")
        return self.router.engines[replica].write_off(lease_id)
