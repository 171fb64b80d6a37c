"""rlengine.core.futures: settle once, wait from threads and loops, callbacks, cached encoding."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

import rlengine as rle
from rlengine.core.futures import RequestFuture


def test_settles_exactly_once():
    f: RequestFuture[int] = RequestFuture("r1")
    assert not f.done()
    assert f.set_result(1) is True
    assert f.set_result(2) is False
    assert f.set_exception(RuntimeError("late")) is False
    assert f.result(0) == 1 and f.exception(0) is None


def test_exception_raised_and_returned():
    f: RequestFuture[int] = RequestFuture("r1")
    f.set_exception(rle.ModelNotLoaded("gone"))
    with pytest.raises(rle.ModelNotLoaded):
        f.result(0)
    assert isinstance(f.exception(0), rle.ModelNotLoaded)


def test_result_timeout_is_typed_and_leaves_future_pending():
    f: RequestFuture[int] = RequestFuture("r1")
    with pytest.raises(rle.RequestTimeout, match="r1"):
        f.result(0.01)
    assert not f.done()
    f.set_result(3)
    assert f.result(0) == 3


def test_threads_waiting_all_wake():
    f: RequestFuture[str] = RequestFuture("r1")
    got = []

    def wait() -> None:
        got.append(f.result(5))

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    f.set_result("ok")
    for t in threads:
        t.join(5)
    assert got == ["ok"] * 8


def test_callbacks_run_once_before_or_after_settlement():
    f: RequestFuture[int] = RequestFuture("r1")
    calls = []
    f.add_done_callback(lambda x: calls.append(("early", x.result(0))))
    f.set_result(4)
    f.add_done_callback(lambda x: calls.append(("late", x.result(0))))
    assert calls == [("early", 4), ("late", 4)]


def test_callbacks_added_from_threads_during_settlement_all_run_once():
    for _ in range(50):
        f: RequestFuture[int] = RequestFuture("r")
        seen = []
        barrier = threading.Barrier(5)

        def add(f=f, seen=seen, barrier=barrier) -> None:
            barrier.wait()
            for _ in range(20):
                f.add_done_callback(lambda x, seen=seen: seen.append(1))

        threads = [threading.Thread(target=add) for _ in range(4)]
        for t in threads:
            t.start()
        barrier.wait()
        f.set_result(1)
        for t in threads:
            t.join(5)
        assert len(seen) == 80


def test_then_maps_result_and_propagates_errors():
    f: RequestFuture[int] = RequestFuture("r1")
    g = f.then(lambda v: v * 2)
    h = g.then(lambda v: 1 // 0)
    f.set_result(21)
    assert g.result(0) == 42
    with pytest.raises(ZeroDivisionError):
        h.result(0)
    e: RequestFuture[int] = RequestFuture("r2")
    m = e.then(lambda v: v)
    e.set_exception(rle.RequestAborted("x"))
    with pytest.raises(rle.RequestAborted):
        m.result(0)


def test_encoded_is_cached_msgpack_of_result():
    resp = rle.SampleResponse(sequences=[rle.SampledSequence(stop_reason="abort")], request_id="r9")
    f: RequestFuture[rle.SampleResponse] = RequestFuture("r9")
    f.set_result(resp)
    raw = f.encoded()
    assert raw == msgspec.msgpack.encode(resp)
    assert f.encoded() is raw


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_await_from_any_loop_and_thread(loop_kind):
    import uvloop

    f: RequestFuture[int] = RequestFuture("r1")

    async def main() -> int:
        threading.Timer(0.02, f.set_result, args=(7,)).start()
        return await f

    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(asyncio.wait_for(main(), 5)) == 7
    finally:
        loop.close()


def test_result_async_timeout():
    f: RequestFuture[int] = RequestFuture("r1")

    async def main() -> None:
        with pytest.raises(rle.RequestTimeout):
            await f.result_async(0.01)

    asyncio.run(main())


def test_abort_calls_engine_hook_only_while_pending():
    asked = []
    f: RequestFuture[int] = RequestFuture("r5", asked.append)
    f.abort()
    f.set_result(1)
    f.abort()
    assert asked == ["r5"]
