"""rlengine.core.scheduler: the FIFO admission rule, the lease ledger and the install gate.

Pure state, no engine: the scheduler sees queued work only through
``Queued`` (request id, version, session, blocking), so plain tickets stand
in for the sampler's records. A hypothesis state machine drives random
interleavings and checks the rule against a plain reference of what must be
admitted.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rlengine as rle
from rlengine.core.scheduler import LeaseState, Scheduler


class Ticket:
    """What the scheduler reads of queued work, and the lease admission gave it."""

    def __init__(self, rid: str, version: int | None, session: str | None, blocking: bool) -> None:
        self.request_id, self.version, self.session_id, self.blocking = rid, version, session, blocking
        self.lease = None


def sample(rid: str, version: int | None = None, session: str | None = None) -> Ticket:
    return Ticket(rid, version, session, False)


def blocking(rid: str) -> Ticket:
    return Ticket(rid, None, None, True)


def admit(s: Scheduler) -> tuple[list[Ticket], list[Ticket]]:
    """``s.admit()`` as (admitted, stale), each admitted ticket holding its lease."""
    admission = s.admit()
    assert len(admission.admitted) == len(admission.leases)
    for ticket, lease in zip(admission.admitted, admission.leases):
        assert lease.request_id == ticket.request_id and lease.session_id == ticket.session_id
        ticket.lease = lease
    return list(admission.admitted), list(admission.stale)


def test_samples_before_blocking_admitted_after_wait():
    s = Scheduler()
    for item in (sample("a"), sample("b"), blocking("B"), sample("c")):
        s.submit(item)
    admitted, stale = admit(s)
    assert [i.request_id for i in admitted] == ["a", "b"] and stale == []
    assert s.head_blocking().request_id == "B"
    assert admit(s) == ([], [])  # c waits behind B
    assert s.in_flight == 2 and not s.quiesced
    for item in admitted:
        item.lease.settle("completed", [0])
    assert s.quiesced
    s.pop_head()
    assert [i.request_id for i in admit(s)[0]] == ["c"]


def test_seal_blocks_admission_and_counts_nesting():
    s = Scheduler()
    s.seal()
    s.seal()
    s.submit(sample("a"))
    assert admit(s) == ([], [])
    s.reopen()
    assert admit(s) == ([], [])
    s.reopen()
    assert [i.request_id for i in admit(s)[0]] == ["a"]
    with pytest.raises(rle.GateError, match="without a matching seal"):
        s.reopen()


def test_stale_requests_filtered_first():
    s = Scheduler(version=2)
    s.submit(sample("old", version=1))
    s.submit(sample("pinned", version=2))
    s.submit(sample("latest", version=None))
    admitted, stale = admit(s)
    assert [i.request_id for i in admitted] == ["pinned", "latest"]
    assert [i.request_id for i in stale] == ["old"]
    assert "version 1 is not loaded" in str(s.stale_error(stale[0]))
    assert stale[0].lease is None  # never leased, never reaches the backend
    assert s.in_flight == 2


def test_unloaded_model_makes_everything_stale():
    s = Scheduler(version=None)
    s.submit(sample("a"))
    s.submit(sample("l", session="sess"))
    admitted, stale = admit(s)
    assert admitted == [] and len(stale) == 2
    assert "unloaded" in str(s.stale_error(stale[0]))


def test_wave_mode_waits_for_whole_wave():
    s = Scheduler(continuous=False)
    s.submit(sample("a"))
    s.submit(sample("b"))
    wave, _ = admit(s)
    s.submit(sample("c"))
    assert admit(s) == ([], [])
    wave[0].lease.settle("completed")
    assert admit(s) == ([], [])  # b still running
    wave[1].lease.settle("completed")
    assert [i.request_id for i in admit(s)[0]] == ["c"]


def test_receipts_and_double_settle():
    s = Scheduler()
    s.submit(sample("a", session="s1"))
    (item,), _ = admit(s)
    receipt = item.lease.settle("completed", [3, 1])
    # The version loaded at admission (0) and those the holder reports, sorted.
    assert receipt == rle.Receipt(lease_id=item.lease.lease_id, request_id="a", session_id="s1",
                                  versions=[0, 1, 3], outcome="completed")
    assert s.receipts[-1] == receipt
    with pytest.raises(rle.GateError, match="already settled"):
        item.lease.settle("completed")
    with pytest.raises(rle.GateError, match="outcome="):
        s.submit(sample("b"))
        (b,), _ = admit(s)
        b.lease.settle("fine")


def test_poison_barrier_until_written_off():
    s = Scheduler(version=0)
    s.submit(sample("a", session="agent-7"))
    (item,), _ = admit(s)
    item.lease.mark_unknown("client went away")
    assert s.quiesced  # an unknown lease is not running...
    s.seal()
    with pytest.raises(rle.GatePoisoned) as info:
        s.install_version(1)  # ...but it blocks every install
    assert info.value.leases == [(item.lease.lease_id, "agent-7", "client went away")]
    assert s.version == 0
    with pytest.raises(rle.GateError, match="lease_id=999"):
        s.write_off(999)
    receipt = s.write_off(item.lease.lease_id)
    assert receipt.outcome == "written_off"
    s.install_version(1)
    assert s.version == 1


def test_install_needs_seal_drain_and_increasing_version():
    s = Scheduler(version=0)
    s.submit(sample("a"))
    (item,), _ = admit(s)
    with pytest.raises(rle.GateError, match="sealed"):
        s.install_version(1)
    s.seal()
    with pytest.raises(rle.GateError, match="drained"):
        s.install_version(1)
    item.lease.settle("completed")
    with pytest.raises(rle.GateError, match="greater"):
        s.install_version(0)
    s.install_version(1)
    s.install_version(None)
    assert s.version is None


def test_paused_leases_count_as_drained():
    s = Scheduler(version=0)
    s.submit(sample("a"))
    (item,), _ = admit(s)
    s.pause_active([item.lease])
    assert s.quiesced and item.lease.state is LeaseState.PAUSED
    s.seal()
    s.install_version(1)
    s.reopen()
    assert s.resume_paused() == [item.lease] and s.in_flight == 1


class FifoMachine(RuleBasedStateMachine):
    """Random interleavings of submit / admit / settle / run-blocking / seal.

    Reference: the pending list in submission order. Admission must take
    exactly the maximal prefix of non-blocking items (minus stale ones),
    and only when unsealed (and, in wave mode, with nothing running).
    """

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(continuous=True, version=0)
        self.ref: list[tuple[str, str, int | None]] = []  # (id, kind, pinned version)
        self.running: list = []
        self.n = 0
        self.order: list[str] = []

    def _id(self) -> str:
        self.n += 1
        return f"i{self.n}"

    @rule(pinned=st.sampled_from([None, None, 0, 1, 2]))
    def submit_sample(self, pinned):
        rid = self._id()
        self.s.submit(sample(rid, version=pinned))
        self.ref.append((rid, "sample", pinned))

    @rule()
    def submit_blocking(self):
        rid = self._id()
        self.s.submit(blocking(rid))
        self.ref.append((rid, "blocking", None))

    @rule()
    def admit_what_may_run(self):
        admitted, stale = admit(self.s)
        expect_admitted, expect_stale = [], []
        if not self.s.sealed:
            while self.ref and self.ref[0][1] == "sample":
                rid, _, pinned = self.ref.pop(0)
                if pinned is not None and pinned != self.s.version:
                    expect_stale.append(rid)
                else:
                    expect_admitted.append(rid)
        assert [i.request_id for i in admitted] == expect_admitted
        assert [i.request_id for i in stale] == expect_stale
        self.running.extend(admitted)
        self.order.extend(expect_admitted)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def settle_one(self, data):
        item = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        item.lease.settle("completed", [self.s.version or 0])

    @precondition(lambda self: self.ref and self.ref[0][1] == "blocking")
    @rule(install=st.booleans())
    def run_blocking_when_drained(self, install):
        head = self.s.head_blocking()
        assert head is not None and head.request_id == self.ref[0][0]
        if not self.s.quiesced:
            return  # the engine would keep stepping until drained
        self.s.pop_head()
        self.ref.pop(0)
        # Everything submitted before it has been admitted (or filtered) already.
        assert all(int(rid[1:]) < int(head.request_id[1:]) for rid in self.order)
        self.order.append(head.request_id)
        if install:
            self.s.seal()
            self.s.install_version((self.s.version or 0) + 1)
            self.s.reopen()

    @rule()
    def seal_and_reopen(self):
        self.s.seal()
        assert admit(self.s) == ([], [])
        self.s.reopen()

    @invariant()
    def ledger_matches_running(self):
        assert self.s.in_flight == len(self.running)
        assert len(self.s) == len(self.ref)

    @invariant()
    def nothing_behind_a_blocking_item_ran(self):
        # ids increase with submission: nothing admitted may be newer than a
        # blocking item still queued.
        queued_blocking = [int(rid[1:]) for rid, kind, _ in self.ref if kind == "blocking"]
        if queued_blocking:
            assert all(int(rid[1:]) < queued_blocking[0] for rid in self.order)


TestFifoMachine = FifoMachine.TestCase
TestFifoMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
