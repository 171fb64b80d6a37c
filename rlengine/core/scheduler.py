"""The scheduler: admission control, the lease ledger and the install gate, over one FIFO.

Everything that wants the sampler waits in a single FIFO of queued work.
The scheduler does not know what the work is; it sees each entry through
four attributes (``Queued``): its ``request_id``, the ``version`` it
addresses, its ``session_id``, and whether it is ``blocking`` work (forward,
forward_backward, optim_step, weight install, state save/load, unload) that
must run with the sampler quiesced. The entries themselves are the sampler
loop's (``rlengine.core.records``, ``rlengine.core.sampler``).

The admission rule: a blocking entry at the head of the FIFO seals
admission, so nothing behind it is admitted until it has run; it runs once
every lease is drained (or, under the ``pause`` policy, paused). Samples
queued before it finish first and samples queued after it start after it:
no starvation of either kind. Admitted entries each get a *lease*.

Around blocking work, and a weight install above all, the scheduler is
the install gate: ``seal``, the drain (``quiesced``; ``on_drained`` tells
the sampler loop when the last running lease settles), ``install_version``,
``reopen``, and ``assert_healthy`` before it. A lease
whose outcome is unknown (the backend failed mid-generation, a client went
away before settlement) poisons the gate: ``install_version`` raises
``GatePoisoned`` until the lease is settled or written off
(``Scheduler.write_off``), so a weight install can never silently straddle a
request nobody can account for.

This module owns every ``Lease``: it creates them (``admit``), changes their
state and settles them (``settle``, one path for every outcome). Loop thread
only: nothing here locks, blocks or touches the backend.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import msgspec

from rlengine.errors import GateError, GatePoisoned, ModelNotLoaded
from rlengine.types import Receipt

__all__ = ["Admission", "Lease", "LeaseState", "Queued", "Scheduler"]

class LeaseState(str, enum.Enum):
    """Where a lease is: running (``active``), held by the pause policy (``paused``), its outcome
    lost (``unknown``: it poisons the gate), or ended (``settled``)."""

    ACTIVE = "active"
    PAUSED = "paused"
    UNKNOWN = "unknown"
    SETTLED = "settled"


_ACTIVE, _PAUSED, _UNKNOWN, _SETTLED = LeaseState.ACTIVE, LeaseState.PAUSED, LeaseState.UNKNOWN, LeaseState.SETTLED
_OUTCOMES = ("completed", "aborted", "failed", "written_off")


class Queued(Protocol):
    """What the scheduler reads of a queued entry (the sampler's records provide it)."""

    blocking: ClassVar[bool]
    """Work that runs with the sampler quiesced; it seals admission at the head of the FIFO."""
    request_id: str
    version: int | None
    """The sampler version a non-blocking entry addresses; None follows the latest."""
    session_id: str | None


class Lease(msgspec.Struct, gc=False):
    """A claim on the sampler by one request or session turn.

    ``versions`` collects every policy version that produced a token under
    this lease, starting with the one loaded at admission; settling it
    leaves a ``Receipt``. (A ``gc=False`` Struct,
    like the other per-request records: thousands are in flight, none is
    part of a reference cycle once it leaves the ledger, and untracked they
    cost the cyclic collector nothing.)
    """

    scheduler: Scheduler
    lease_id: int
    session_id: str | None
    request_id: str
    versions: set[int] | None
    state: LeaseState = LeaseState.ACTIVE
    reason: str = ""

    def __repr__(self) -> str:
        return f"<Lease {self.lease_id} {self.request_id} {self.state.value}>"

    def add_version(self, version: int) -> None:
        """A token under this lease was (or will be) produced by ``version``."""
        if self.versions is None:
            self.versions = {version}
        else:
            self.versions.add(version)

    def settle(self, outcome: str, versions: Iterable[int] = ()) -> Receipt:
        """Settle with ``completed``, ``aborted`` or ``failed``; returns the receipt
        (for holders of an external lease: ``Engine.lease``)."""
        self.scheduler.settle(self, outcome, versions)
        return self.scheduler.receipt_of(self.lease_id)

    def mark_unknown(self, reason: str) -> None:
        """The outcome cannot be known: keep the lease, poisoning the gate."""
        self.scheduler.mark_unknown(self, reason)


_Settled = tuple[int, str, "str | None", "set[int] | None", str]
"""What a settled lease leaves: (lease id, request id, session id, versions, outcome). Not the
Lease itself, which holds its scheduler: the receipts need none of that."""


def _receipt(settled: _Settled) -> Receipt:
    lease_id, request_id, session_id, known, outcome = settled
    return Receipt(lease_id=lease_id, request_id=request_id, session_id=session_id,
                   versions=sorted(known) if known else [], outcome=outcome)  # type: ignore[arg-type]


class Admission(NamedTuple):
    """What one ``admit`` let through: ``admitted[i]`` holds ``leases[i]``; ``stale``
    entries address a version that is not loaded (fail them with ``stale_error``)."""

    admitted: Sequence[Queued]
    leases: Sequence[Lease]
    stale: Sequence[Queued]


_NOTHING = Admission((), (), ())


class Scheduler:
    """The FIFO, the admission rule, the lease ledger and the install gate (see the module docstring)."""

    def __init__(self, *, continuous: bool = True, version: int | None = 0, receipts_kept: int = 4096) -> None:
        self.continuous = continuous
        self.version = version
        """The policy version loaded in the sampler; None when unloaded."""
        self._pending: deque[Queued] = deque()
        self._seals = 0
        self._ids = itertools.count(1)
        self._active: dict[int, Lease] = {}
        self._paused: dict[int, Lease] = {}
        self._unknown: dict[int, Lease] = {}
        self._head: tuple[Queued, float] | None = None
        """The blocking entry at the head of the FIFO, and since when it has been there."""
        self.on_drained: Callable[[], None] | None = None
        """Called whenever the last running lease ends (the sampler loop wakes on it)."""
        self._settled: deque[_Settled] = deque(maxlen=receipts_kept)
        """The latest settled leases; their receipts are built when asked for (``receipts``)."""

    # -- the FIFO -------------------------------------------------------------

    def submit(self, entry: Queued) -> None:
        self._pending.append(entry)

    def __len__(self) -> int:
        return len(self._pending)

    def remove(self, request_id: str) -> Queued | None:
        """Take a not-yet-admitted entry out of the FIFO (abort before start)."""
        for entry in self._pending:
            if entry.request_id == request_id:
                self._pending.remove(entry)
                return entry
        return None

    def queued(self) -> list[Queued]:
        """A copy of the FIFO, head first. Safe from any thread: ``list`` copies the deque in one
        C-level step, which no loop callback can interleave with (the hang watch reads it)."""
        return list(self._pending)

    def drain_pending(self) -> list[Queued]:
        entries = list(self._pending)
        self._pending.clear()
        return entries

    def is_stale(self, version: int | None) -> bool:
        """Whether work addressed to ``version`` cannot run on what is loaded."""
        return self.version is None or (version is not None and version != self.version)

    def admit(self) -> Admission:
        """Admit what the rule allows: every non-blocking entry up to the first blocking one.

        Stale entries are filtered first and returned for failing with
        ``ModelNotLoaded``: they never reach the backend and never trigger a
        bring-up. In wave mode (``continuous=False``) a new wave starts only
        when the previous one has fully finished.
        """
        pending = self._pending
        if self._seals or not pending or pending[0].blocking:
            return _NOTHING
        if not self.continuous and (self._active or self._paused):
            return _NOTHING
        admitted: list[Queued] = []
        leases: list[Lease] = []
        stale: list[Queued] = []
        while pending and not pending[0].blocking:
            entry = pending.popleft()
            if self.is_stale(entry.version):
                stale.append(entry)
            else:
                admitted.append(entry)
                leases.append(self._lease(entry))
        return Admission(admitted, leases, stale)

    def _lease(self, entry: Queued) -> Lease:
        lease_id = next(self._ids)
        versions = None if self.version is None else {self.version}
        self._active[lease_id] = lease = Lease(self, lease_id, entry.session_id, entry.request_id, versions)
        return lease

    def stale_error(self, entry: Queued) -> ModelNotLoaded:
        if self.version is None:
            return ModelNotLoaded(f"request {entry.request_id}: no model is loaded (it was unloaded)")
        return ModelNotLoaded(
            f"request {entry.request_id}: sampler version {entry.version} is not loaded "
            f"(loaded: {self.version}); get a new sampling client")

    def head_blocking(self) -> Queued | None:
        """The blocking entry at the head of the FIFO, if one is there."""
        if self._pending and self._pending[0].blocking:
            head = self._pending[0]
            if self._head is None or self._head[0] is not head:
                self._head = (head, time.monotonic())
            return head
        return None

    def head_waited(self) -> float:
        """Seconds the current blocking head has waited there (0 if there is none)."""
        if self.head_blocking() is None:
            return 0.0
        assert self._head is not None
        return time.monotonic() - self._head[1]

    def pop_head(self) -> Queued:
        self._head = None
        return self._pending.popleft()

    # -- leases ---------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Leases that are running (not paused, not unknown)."""
        return len(self._active)

    @property
    def quiesced(self) -> bool:
        return not self._active

    def _forget(self, lease: Lease) -> None:
        """Take ``lease`` out of the ledger of its state."""
        state = lease.state
        if state is _ACTIVE:
            del self._active[lease.lease_id]
            if not self._active:
                self._notify_drained()
        elif state is _PAUSED:
            del self._paused[lease.lease_id]
        elif state is _UNKNOWN:
            del self._unknown[lease.lease_id]
        else:
            raise GateError(f"lease {lease.lease_id} ({lease.request_id}) is already settled")

    def _notify_drained(self) -> None:
        if self._active:
            return
        if self.on_drained is not None:
            self.on_drained()

    def settle(self, lease: Lease, outcome: str, versions: Iterable[int] = ()) -> None:
        """Settle ``lease`` with ``outcome`` (completed, aborted, failed or written_off).

        The one way a lease ends; its receipt is built when asked for
        (``receipt_of``, ``receipts``)."""
        if outcome not in _OUTCOMES:
            raise GateError(f"outcome={outcome!r}: must be completed, aborted, failed or written_off")
        self._forget(lease)
        if versions:
            lease.versions = set(versions) if lease.versions is None else lease.versions | set(versions)
        lease.state = _SETTLED
        self._settled.append((lease.lease_id, lease.request_id, lease.session_id, lease.versions, outcome))

    def receipt_of(self, lease_id: int) -> Receipt:
        """The receipt of a settled lease still among the latest ``receipts_kept``."""
        for settled in reversed(self._settled):
            if settled[0] == lease_id:
                return _receipt(settled)
        raise GateError(f"lease_id={lease_id}: no receipt kept for it (not settled, or too old)")

    @property
    def receipts(self) -> list[Receipt]:
        """Receipts of the latest settled leases (at most ``receipts_kept``), oldest first."""
        return [_receipt(settled) for settled in self._settled]

    def mark_unknown(self, lease: Lease, reason: str) -> None:
        self._forget(lease)
        lease.reason = reason
        lease.state = _UNKNOWN
        self._unknown[lease.lease_id] = lease

    def write_off(self, lease_id: int) -> Receipt:
        """Give up on a lease with an unknown outcome; un-poisons the gate for it."""
        lease = self._unknown.get(lease_id)
        if lease is None:
            raise GateError(f"lease_id={lease_id}: no lease with an unknown outcome has that id")
        self.settle(lease, "written_off")
        return self.receipt_of(lease_id)

    def unknown_leases(self) -> list[Lease]:
        return list(self._unknown.values())

    def pause_active(self, leases: Iterable[Lease]) -> None:
        """Pause policy: these running leases become paused (they count as drained).

        External leases are never paused by the engine: they must drain.
        """
        for lease in leases:
            if self._active.pop(lease.lease_id, None) is not None:
                lease.state = _PAUSED
                self._paused[lease.lease_id] = lease
        self._notify_drained()

    def resume_paused(self) -> list[Lease]:
        leases = list(self._paused.values())
        for lease in leases:
            lease.state = _ACTIVE
            self._active[lease.lease_id] = lease
        self._paused.clear()
        return leases

    # -- the install gate: seal, drain, install, reopen ------------------------

    @property
    def sealed(self) -> bool:
        return self._seals > 0

    def seal(self) -> None:
        """Stop admitting; nesting is counted, each ``seal`` needs a ``reopen``."""
        self._seals += 1

    def reopen(self) -> None:
        if self._seals == 0:
            raise GateError("reopen() without a matching seal()")
        self._seals -= 1

    def snapshot(self) -> dict[str, Any]:
        """The install gate for a hang dump: sealed (and how many seals), the loaded version, the
        FIFO's length, the blocking work at its head and how long it has waited there, the leases
        by state and the unknown ones with their reasons. Safe from any thread: each table is copied
        in one C-level step (no Python code runs inside, so the loop cannot interleave) and only
        plain attributes are read; figures may be a moment apart."""
        head, fifo, unknown = self._head, list(self._pending), list(self._unknown.values())
        if head is not None and not (fifo and fifo[0] is head[0]):
            head = None  # that entry has left the head (removed, drained) since it was looked at
        return {"sealed": self._seals > 0, "seals": self._seals, "version": self.version, "queued": len(fifo),
                "head_blocking": None if head is None else {"request_id": head[0].request_id,
                                                            "waited_s": time.monotonic() - head[1]},
                "leases_active": len(self._active), "leases_paused": len(self._paused),
                "leases_unknown": [{"lease_id": x.lease_id, "request_id": x.request_id, "session_id": x.session_id,
                                    "reason": x.reason} for x in unknown]}

    def assert_healthy(self) -> None:
        if self._unknown:
            raise GatePoisoned([(x.lease_id, x.session_id, x.reason) for x in self._unknown.values()])

    def install_version(self, version: int | None) -> None:
        """Record that ``version`` is now loaded (None: unloaded).

        Only while sealed and drained, and never while poisoned.
        """
        if not self._seals:
            raise GateError("install_version() needs a sealed gate: call seal() first")
        if self._active:
            raise GateError(f"install_version() needs a drained gate: {len(self._active)} lease(s) running")
        if version is not None:
            self.assert_healthy()
            if self.version is not None and version <= self.version:
                raise GateError(f"version={version}: must be greater than the loaded version {self.version}")
        self.version = version
