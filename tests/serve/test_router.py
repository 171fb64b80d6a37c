"""Session affinity over data-parallel replicas and tombstones (rlengine.serve.router).

Replicas are several sim ``Engine``s started in async mode on the server's
one loop, each with its own compute thread, as ``rlengine serve
replicas=N`` runs them. Which replica served a turn is read from each
engine's scheduler receipts (every session turn holds a lease there).
"""

from __future__ import annotations

import threading
import time

import pytest
from serving import WAIT, Served, sim_config

from rlengine import protocol as p
from rlengine.errors import ConfigurationError
from rlengine.sandbox_client import Client
from rlengine.serve import ServeConfig
from rlengine.serve.router import SessionRouter


@pytest.fixture(scope="module")
def replicas():
    s = Served([sim_config(seed=i) for i in range(3)], ServeConfig(http=False))
    yield s
    s.close()


def open_sessions(served, n):
    with Client(served.ipc_path, timeout=WAIT) as c:
        return [c.open_session() for _ in range(n)]


def served_by(served) -> list[set[str]]:
    """Per replica: the session ids whose turns its scheduler admitted."""
    return served.on_loop(lambda: [{r.session_id for r in e.scheduler.receipts if r.session_id} for e in served.engines])


def test_replicas_share_the_servers_loop_with_their_own_compute_threads(replicas):
    loops = {id(e.loop) for e in replicas.engines}
    computes = {id(e._compute) for e in replicas.engines}
    assert len(loops) == 1 and len(computes) == 3


def test_each_session_is_pinned_to_one_replica_for_life(replicas):
    sessions = open_sessions(replicas, 6)
    with Client(replicas.ipc_path, timeout=WAIT) as c:
        for turn in range(3):
            for s in sessions:
                c.session(s.session_id, s.token).generate([1, 2, turn], max_tokens=2)
    by_replica = served_by(replicas)
    ids = {s.session_id for s in sessions}
    owners = {sid: [i for i, seen in enumerate(by_replica) if sid in seen] for sid in ids}
    assert all(len(o) == 1 for o in owners.values()), owners
    counts = [sum(1 for o in owners.values() if o == [i]) for i in range(3)]
    assert counts == [2, 2, 2]  # first turns spread the sessions evenly


def test_a_new_session_goes_to_the_replica_with_the_fewest_requests_in_flight():
    s = Served([sim_config(seed=i) for i in range(2)], ServeConfig(http=False))
    try:
        a, b, c3 = open_sessions(s, 3)
        with Client(s.ipc_path, timeout=WAIT) as c:
            c.session(a.session_id, a.token).generate([1], max_tokens=1)  # a -> replica 0
            c.session(b.session_id, b.token).generate([1], max_tokens=1)  # b -> replica 1
        def busy_a():
            with Client(s.ipc_path, timeout=WAIT) as c:
                c.session(a.session_id, a.token).generate([1], max_tokens=400)

        long_turn = threading.Thread(target=busy_a)
        long_turn.start()
        deadline = time.monotonic() + WAIT
        while s.on_loop(lambda: s.sessions.router.load()[0][0]) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        with Client(s.ipc_path, timeout=WAIT) as c:
            c.session(c3.session_id, c3.token).generate([1], max_tokens=1)
        long_turn.join(WAIT)
        assert c3.session_id in served_by(s)[1]  # replica 0 was busy, though both had one session
    finally:
        s.close()


def test_installs_are_per_replica_and_a_pinned_session_keeps_its_replicas_version(replicas):
    [s] = open_sessions(replicas, 1)
    with Client(replicas.ipc_path, timeout=WAIT) as c:
        session = c.session(s.session_id, s.token)
        before = session.generate([3], max_tokens=2).choices[0].versions
        mine = replicas.on_loop(replicas.sessions.router.replica_of, s.session_id)
        other = (mine + 1) % 3
        replicas.install(replica=other, seed=7)
        assert session.generate([3], max_tokens=2).choices[0].versions == before
        new_version = replicas.install(replica=mine, seed=8)
        assert session.generate([3], max_tokens=2).choices[0].versions == [new_version] * 2


def test_retiring_leaves_a_tombstone_and_aborts_turns_in_flight(replicas):
    [s] = open_sessions(replicas, 1)
    errors = []

    def long_turn():
        try:
            with Client(replicas.ipc_path, timeout=WAIT) as c:
                c.session(s.session_id, s.token).generate([1], max_tokens=100_000)
        except Exception as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=long_turn)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not replicas.on_loop(lambda: replicas.sessions.in_flight) and time.monotonic() < deadline:
        time.sleep(0.005)
    replicas.on_loop(replicas.sessions.retire, s.session_id)
    thread.join(WAIT)
    assert len(errors) == 1 and isinstance(errors[0], p.SessionGone)
    with Client(replicas.ipc_path, timeout=WAIT) as c:
        for call in (lambda: c.session(s.session_id, s.token).generate([1], max_tokens=1),
                     lambda: c.session(s.session_id, s.token).trace(),
                     lambda: c.session(s.session_id, "any token").reward(1.0),
                     lambda: c.open_session(s.session_id)):
            with pytest.raises(p.SessionGone):
                call()
    trace = replicas.on_loop(replicas.sessions.collect, s.session_id)
    assert trace.trajectories == [] and trace.turns == 0  # the aborted turn recorded nothing
    with Client(replicas.ipc_path, timeout=WAIT) as c, pytest.raises(p.SessionGone):  # collected: still gone
        c.session(s.session_id, s.token).generate([1], max_tokens=1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tombstones_expire_by_ttl():
    clock = FakeClock()
    router = SessionRouter([object()], ttl_s=10.0, clock=clock)  # type: ignore[list-item]
    router.retire("a")
    clock.now += 5
    router.retire("b")
    assert router.is_gone("a") and router.is_gone("b")
    clock.now += 6
    assert not router.is_gone("a") and router.is_gone("b")
    clock.now += 5
    assert not router.is_gone("b") and router.tombstones == 0


def test_tombstone_memory_is_bounded():
    clock = FakeClock()
    router = SessionRouter([object()], ttl_s=1e9, max_tombstones=100, clock=clock)  # type: ignore[list-item]
    for i in range(10_000):
        router.retire(f"s{i}")
        clock.now += 0.001
    assert router.tombstones == 100
    assert router.is_gone("s9999") and not router.is_gone("s0")


def test_router_pins_least_loaded_and_counts_in_flight():
    router = SessionRouter([object(), object()])  # type: ignore[list-item]
    assert router.pin("a") == 0 and router.pin("b") == 1 and router.pin("a") == 0
    router.started(0)
    assert router.pin("c") == 1  # fewer in flight wins over fewer sessions
    router.finished(0)
    assert router.load() == [(0, 1), (0, 2)]
    router.retire("c")
    assert router.load() == [(0, 1), (0, 1)] and router.replica_of("c") is None


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"max_tombstones": 0}, {"max_tombstones": True}])
def test_router_settings_are_checked(kwargs):
    with pytest.raises(ConfigurationError):
        SessionRouter([object()], **kwargs)  # type: ignore[list-item]
    with pytest.raises(ConfigurationError):
        SessionRouter([])


def test_a_session_id_without_its_token_is_an_affinity_hint():
    """A harness that names its own session id (verifiers does) but holds no rlengine token is
    served statelessly, every request of one id on one replica, and nothing is traced."""
    import openai

    s = Served([sim_config(seed=i) for i in range(3)], ServeConfig(ipc=False))
    try:
        client = openai.OpenAI(base_url=s.http_url, api_key=s.api_key, max_retries=0, timeout=WAIT)
        before = [e.stats()["admitted"] for e in s.engines]
        for hint, turns in (("rollout-17", 4), ("rollout-18", 4)):
            for _ in range(turns):
                resp = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2, extra_headers={"X-Session-ID": hint})
                assert resp.choices[0].message.content is not None
            after = [e.stats()["admitted"] for e in s.engines]
            grew = [a - b for a, b in zip(after, before)]
            assert sorted(grew) == [0, 0, turns], grew  # one replica took all of them
            assert grew.index(turns) == s.on_loop(lambda h=hint: s.sessions.router.affine(h))
            before = after
        assert s.on_loop(s.sessions.live) == [] and s.on_loop(lambda: list(s.sessions.store.sessions())) == []
        client.close()
    finally:
        s.close()
