"""Admission control and the request gate: one mechanism, one FIFO.

Everything that wants the sampler goes through a single FIFO of work items:

* ``SampleItem``  - a sample request; admitted into the backend whenever no
  blocking work is ahead of it, and holding a *lease* while it runs;
* ``LeaseItem``   - an external lease (a session turn driven from outside);
  admitted by the same rule, it resolves to the ``Lease`` itself;
* ``BlockingItem`` - work that must run with the sampler quiesced (forward,
  forward_backward, optim_step, weight install, state save/load, unload).

A blocking item at the head of the FIFO seals admission: nothing behind it
is admitted until it has run. It runs once every lease is drained (or, under
the ``pause`` policy, paused), so samples queued before it finish first and
samples queued after it start after it: no starvation of either kind.

The request gate is the lease ledger of the same object: ``seal``,
``drain``, ``install_version``, ``reopen`` and ``assert_healthy``. A lease
whose outcome is unknown (the backend failed mid-generation, a client went
away before settlement) poisons the gate: ``install_version`` raises
``GatePoisoned`` until the lease is settled or written off, so a weight
install can never silently straddle a request nobody can account for.

Loop thread only: nothing here locks, blocks or touches the backend.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from rlengine.core.futures import RequestFuture
from rlengine.errors import DrainTimeout, GateError, GatePoisoned, ModelNotLoaded
from rlengine.types import Receipt, SamplingParams

__all__ = ["BlockingItem", "Lease", "LeaseItem", "SampleItem", "Scheduler"]

_ACTIVE, _PAUSED, _UNKNOWN, _SETTLED = "active", "paused", "unknown", "settled"


class Lease(msgspec.Struct, gc=False):
    """A claim on the sampler by one request or session turn.

    ``versions`` collects every policy version that produced a token under
    this lease; ``settle`` turns it into a ``Receipt``. (A ``gc=False``
    Struct, like the other per-request records here: thousands are in
    flight, none is part of a reference cycle once it leaves the ledger, and
    untracked they cost the cyclic collector nothing.)
    """

    gate: Scheduler
    lease_id: int
    session_id: str | None
    request_id: str
    state: str = _ACTIVE
    versions: set[int] | None = None
    reason: str = ""

    def __repr__(self) -> str:
        return f"<Lease {self.lease_id} {self.request_id} {self.state}>"

    def add_version(self, version: int) -> None:
        if self.versions is None:
            self.versions = {version}
        else:
            self.versions.add(version)

    def settle(self, outcome: str, versions: Iterable[int] = ()) -> Receipt:
        """Settle with ``completed``, ``aborted`` or ``failed``; returns the receipt."""
        return self.gate.settle(self, outcome, versions)

    def mark_unknown(self, reason: str) -> None:
        """The outcome cannot be known: keep the lease, poisoning the gate."""
        self.gate.mark_unknown(self, reason)


_Settled = tuple[int, str, "str | None", "set[int] | None", str]
"""What a settled lease leaves: (lease id, request id, session id, versions, outcome). Not the
Lease itself, which holds its gate: the receipts need none of that."""


def _receipt(settled: _Settled) -> Receipt:
    lease_id, request_id, session_id, known, outcome = settled
    ordered = ([*known] if len(known) == 1 else sorted(known)) if known else []
    return Receipt(lease_id=lease_id, request_id=request_id, session_id=session_id, versions=ordered,
                   outcome=outcome)  # type: ignore[arg-type]


class SampleItem(msgspec.Struct, gc=False):
    """A queued ``sample`` call (``num_samples`` sequences, one future)."""

    request_id: str
    prompt: bytes
    params: SamplingParams
    num_samples: int
    version: int | None
    """The sampler version this request addresses; None follows the latest."""
    session_id: str | None
    prompt_logprobs: bool
    future: RequestFuture[Any]
    lease: Lease | None = None
    seqs: list[Any] | None = None
    remaining: int = 0
    prompt_logprobs_raw: bytes | None = None
    on_tokens: Any = None
    """``on_tokens(index, token_ids, logprobs, version)`` on the loop thread as
    sequence ``index`` produces tokens (streaming); None: report once, finished."""


class LeaseItem:
    """A queued request for an external lease; its future resolves to the Lease."""

    __slots__ = ("request_id", "session_id", "version", "future", "lease")

    def __init__(self, request_id: str, session_id: str | None, version: int | None,
                 future: RequestFuture[Any]) -> None:
        self.request_id = request_id
        self.session_id = session_id
        self.version = version
        self.future = future
        self.lease: Lease | None = None


class BlockingItem:
    """Work that runs on the compute thread with the sampler quiesced.

    ``run`` executes on the compute thread; ``before``/``after`` (optional)
    on the loop thread around it; ``noop`` (optional, loop thread) says at
    the head of the queue whether the item would do nothing, in which case
    it runs without draining.
    """

    __slots__ = ("request_id", "kind", "run", "future", "noop", "before", "after", "head_since")

    def __init__(self, request_id: str, kind: str, run: Callable[[], Any], future: RequestFuture[Any],
                 noop: Callable[[], bool] | None = None, before: Callable[[], None] | None = None,
                 after: Callable[[Any], Any] | None = None) -> None:
        self.request_id = request_id
        self.kind = kind
        self.run = run
        self.future = future
        self.noop = noop
        self.before = before
        self.after = after
        self.head_since: float | None = None


Item = SampleItem | LeaseItem | BlockingItem


class Scheduler:
    """The FIFO, the admission rule and the lease ledger (the request gate)."""

    def __init__(self, *, continuous: bool = True, version: int | None = 0, receipts_kept: int = 4096) -> None:
        self.continuous = continuous
        self.version = version
        """The policy version loaded in the sampler; None when unloaded."""
        self._pending: deque[Item] = deque()
        self._seals = 0
        self._ids = itertools.count(1)
        self._active: dict[int, Lease] = {}
        self._paused: dict[int, Lease] = {}
        self._unknown: dict[int, Lease] = {}
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.on_drained: Callable[[], None] | None = None
        """Called whenever the last running lease ends (the sampler loop wakes on it)."""
        self._settled: deque[_Settled] = deque(maxlen=receipts_kept)
        """The latest settled leases; their receipts are built when asked for (``receipts``)."""

    # -- the FIFO -------------------------------------------------------------

    def submit(self, item: Item) -> None:
        self._pending.append(item)

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> Iterable[Item]:
        return iter(self._pending)

    def remove(self, request_id: str) -> Item | None:
        """Take a not-yet-admitted item out of the FIFO (abort before start)."""
        for item in self._pending:
            if item.request_id == request_id:
                self._pending.remove(item)
                return item
        return None

    def drain_pending(self) -> list[Item]:
        items = list(self._pending)
        self._pending.clear()
        return items

    def is_stale(self, version: int | None) -> bool:
        return self.version is None or (version is not None and version != self.version)

    def admit(self) -> tuple[list[SampleItem | LeaseItem], list[SampleItem | LeaseItem]]:
        """Admit what the rule allows: ``(admitted, stale)``.

        Stale items (addressed to a version that is not loaded) are filtered
        first and returned for failing with ``ModelNotLoaded``: they never
        reach the backend and never trigger a bring-up. In wave mode
        (``continuous=False``) a new wave starts only when the previous one
        has fully finished.
        """
        if self._seals or not self._pending or isinstance(self._pending[0], BlockingItem):
            return [], []
        if not self.continuous and (self._active or self._paused):
            return [], []
        admitted: list[SampleItem | LeaseItem] = []
        stale: list[SampleItem | LeaseItem] = []
        pending, active, ids, loaded = self._pending, self._active, self._ids, self.version
        # The per-request hot path: ``is_stale`` inlined, and the only place leases are made.
        while pending and type(pending[0]) is not BlockingItem:
            item = pending.popleft()
            if loaded is None or (item.version is not None and item.version != loaded):
                stale.append(item)
                continue
            lease_id = next(ids)
            item.lease = active[lease_id] = Lease(self, lease_id, item.session_id, item.request_id)
            admitted.append(item)
        return admitted, stale

    def stale_error(self, item: SampleItem | LeaseItem) -> ModelNotLoaded:
        if self.version is None:
            return ModelNotLoaded(f"request {item.request_id}: no model is loaded (it was unloaded)")
        return ModelNotLoaded(
            f"request {item.request_id}: sampler version {item.version} is not loaded "
            f"(loaded: {self.version}); get a new sampling client")

    def head_blocking(self) -> BlockingItem | None:
        if self._pending and isinstance(self._pending[0], BlockingItem):
            head = self._pending[0]
            if head.head_since is None:
                head.head_since = time.monotonic()
            return head
        return None

    def pop_head(self) -> Item:
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
        state = lease.state
        if state is _ACTIVE:
            del self._active[lease.lease_id]
        elif state is _PAUSED:
            del self._paused[lease.lease_id]
        elif state is _UNKNOWN:
            del self._unknown[lease.lease_id]
        if not self._active:
            self._notify_drained()

    def _notify_drained(self) -> None:
        if self._active:
            return
        if self.on_drained is not None:
            self.on_drained()
        if self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def settle(self, lease: Lease, outcome: str, versions: Iterable[int] = ()) -> Receipt:
        if lease.state == _SETTLED:
            raise GateError(f"lease {lease.lease_id} ({lease.request_id}) is already settled")
        if outcome not in ("completed", "aborted", "failed", "written_off"):
            raise GateError(f"outcome={outcome!r}: must be completed, aborted, failed or written_off")
        if versions:
            lease.versions = set(versions) if lease.versions is None else lease.versions | set(versions)
        self.release(lease, outcome)
        return _receipt(self._settled[-1])

    def release(self, lease: Lease, outcome: str) -> None:
        """``settle`` without building the receipt now (the sampler's hot path; ``outcome`` unchecked)."""
        state = lease.state
        if state is _ACTIVE:  # the hot path: _forget inlined
            del self._active[lease.lease_id]
            if not self._active:
                self._notify_drained()
        elif state is _SETTLED:
            raise GateError(f"lease {lease.lease_id} ({lease.request_id}) is already settled")
        else:
            self._forget(lease)
        lease.state = _SETTLED
        self._settled.append((lease.lease_id, lease.request_id, lease.session_id, lease.versions, outcome))

    @property
    def receipts(self) -> list[Receipt]:
        """Receipts of the latest settled leases (at most ``receipts_kept``), oldest first."""
        return [_receipt(settled) for settled in self._settled]

    def mark_unknown(self, lease: Lease, reason: str) -> None:
        if lease.state == _SETTLED:
            raise GateError(f"lease {lease.lease_id} ({lease.request_id}) is already settled")
        lease.reason = reason
        self._forget(lease)
        lease.state = _UNKNOWN
        self._unknown[lease.lease_id] = lease

    def write_off(self, lease_id: int) -> Receipt:
        """Give up on a lease with an unknown outcome; un-poisons the gate for it."""
        lease = self._unknown.get(lease_id)
        if lease is None:
            raise GateError(f"lease_id={lease_id}: no lease with an unknown outcome has that id")
        return self.settle(lease, "written_off")

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

    # -- the gate -------------------------------------------------------------

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

    async def drain(self, deadline: float) -> None:
        """Wait until no lease is running, at most until ``deadline`` (monotonic)."""
        if not self._active:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DrainTimeout(
                f"{len(self._active)} lease(s) still running at the drain deadline: "
                + ", ".join(lease.request_id for lease in list(self._active.values())[:8])) from None

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
