"""The futures table: every accepted Tinker call's ``RequestFuture``, by request id, bounded and expiring.

Tinker clients submit a call, get a request id back at once, and retrieve
the result later (``retrieve_future``), long-polling: the server holds the
retrieval until the result is there or a bounded wait ends, then answers
``try_again``. There is no database behind this: the table maps request ids
to the per-request ``RequestFuture`` the engine settles, plus what the server
needs to answer for it (the owning API key, how to render the result, how to
cancel it). A settled entry lives ``future_ttl_s`` (a short grace once its
result was retrieved, so a retried retrieval still finds it); an expired id
is remembered (bounded) so its retrieval says "expired" rather than "unknown".
When the table is full of entries still in flight, new calls are refused
with ``Overloaded`` (HTTP 429, which the SDK retries after a pause).

``CompletionLog`` is the per-sampling-session queue behind
``retrieve_futures``: the ids of finished samples, in completion order, with
a cursor the client acknowledges.

Loop thread only: entries are created, settled, waited on and swept there.
This module renders nothing and knows no endpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from rlengine.core.futures import RequestFuture
from rlengine.tinker_api.errors import Forbidden, Gone, Overloaded, UnknownResource

__all__ = ["CompletionLog", "FutureEntry", "FuturesTable", "wait_settled"]

# A retrieved result stays this long for retried retrievals (lost responses).
_RETRIEVED_GRACE_S = 60.0


class FutureEntry:
    """One accepted call: its future and what answering for it needs."""

    __slots__ = ("cancel", "future", "kind", "owner", "render", "rendered", "request_id", "retrieved", "settled_at")

    def __init__(self, request_id: str, owner: str, kind: str, future: RequestFuture[Any],
                 render: Callable[[Any, bool], tuple[str, bytes]], cancel: Callable[[], None] | None) -> None:
        self.request_id = request_id
        self.owner = owner
        self.kind = kind
        self.future = future
        self.settled_at: float | None = None
        self.retrieved = False
        self.render = render
        """``render(result, want_proto) -> (content_type, body)``."""
        self.cancel = cancel
        self.rendered: dict[bool, tuple[str, bytes]] = {}


async def wait_settled(future: RequestFuture[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``future`` (settled on this loop); True once it is settled."""
    if future.done():
        return True
    if timeout <= 0:
        return False
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_f: RequestFuture[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    try:
        await asyncio.wait_for(waiter, timeout)
    except TimeoutError:
        return future.done()
    return True


class FuturesTable:
    """Request id -> ``FutureEntry``; see the module docstring."""

    def __init__(self, *, max_entries: int, ttl_s: float, max_tombstones: int = 100_000) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: dict[str, FutureEntry] = {}
        # Expiry queues, each in expiry order (a constant delay after an event
        # in time order), so a sweep stops at the first entry still alive.
        self._settled: OrderedDict[str, float] = OrderedDict()
        """Settled, not yet retrieved: expire ``ttl_s`` after settlement."""
        self._retrieved: OrderedDict[str, float] = OrderedDict()
        """Retrieved: expire a short grace after retrieval."""
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones
        self._ids = itertools.count(1)
        # A per-table random tag: ids of one server are never valid on another
        # (or on this one after a restart), and cannot be guessed in sequence.
        self._tag = secrets.token_hex(4)

    def __len__(self) -> int:
        return len(self._entries)

    def new_id(self, kind: str) -> str:
        return f"{kind}-{self._tag}-{next(self._ids)}"

    def add(self, kind: str, owner: str, render: Callable[[Any, bool], tuple[str, bytes]],
            cancel: Callable[[], None] | None = None, request_id: str | None = None) -> FutureEntry:
        """A new pending entry (its future is settled by whoever runs the call)."""
        if len(self._entries) >= self.max_entries:
            self.sweep(force=True)
            if len(self._entries) >= self.max_entries:
                raise Overloaded("futures", len(self._entries),
                                 f"the table holds max_futures={self.max_entries} requests in flight; retry later")
        rid = request_id or self.new_id(kind)
        entry = FutureEntry(rid, owner, kind, RequestFuture(rid), render, cancel)
        self._entries[rid] = entry
        entry.future.add_done_callback(lambda _f: self._on_settled(entry))
        return entry

    def _on_settled(self, entry: FutureEntry) -> None:
        entry.settled_at = time.monotonic()
        if entry.request_id in self._entries:
            self._settled[entry.request_id] = entry.settled_at + self.ttl_s

    def get(self, request_id: str, owner: str) -> FutureEntry:
        entry = self._entries.get(request_id)
        if entry is None:
            if request_id in self._tombstones:
                raise Gone("request_id", request_id, f"the result expired (future_ttl_s={self.ttl_s})")
            raise UnknownResource("request_id", request_id, "no request has this id")
        if entry.owner != owner:
            raise Forbidden("request_id", request_id, "belongs to a session of another API key")
        return entry

    def mark_retrieved(self, entry: FutureEntry) -> None:
        """The client has the result: keep it only for a short grace (retried retrievals)."""
        if entry.retrieved or entry.settled_at is None:
            return
        entry.retrieved = True
        expiry = self._settled.pop(entry.request_id, None)
        if expiry is not None:
            self._retrieved[entry.request_id] = min(expiry, time.monotonic() + _RETRIEVED_GRACE_S)

    def sweep(self, force: bool = False) -> int:
        """Drop expired entries (with ``force``, every retrieved one too); returns the count."""
        now = time.monotonic()
        dropped = 0
        for queue, drop_all in ((self._retrieved, force), (self._settled, False)):
            while queue:
                rid, expiry = next(iter(queue.items()))
                if expiry > now and not drop_all:
                    break
                self._drop(rid)
                dropped += 1
        return dropped

    def _drop(self, rid: str) -> None:
        self._entries.pop(rid, None)
        self._settled.pop(rid, None)
        self._retrieved.pop(rid, None)
        self._tombstones[rid] = None
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)


class CompletionLog:
    """Finished sample ids of one sampling session (clone), for ``retrieve_futures`` long polls."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: deque[tuple[int, str, str]] = deque()
        self._cursor = 0
        self._max = max_events
        self._changed = asyncio.Event()

    def record(self, request_id: str, state: str) -> None:
        """``state`` is ``finished`` or ``failed``."""
        self._cursor += 1
        self._events.append((self._cursor, request_id, state))
        while len(self._events) > self._max:
            self._events.popleft()
        self._changed.set()

    def acknowledge(self, cursor: int) -> None:
        while self._events and self._events[0][0] <= cursor:
            self._events.popleft()

    def after(self, cursor: int) -> tuple[list[tuple[str, str]], int]:
        """Events after ``cursor`` and the cursor to acknowledge them with."""
        events = [(rid, state) for n, rid, state in self._events if n > cursor]
        return events, max(cursor, self._cursor)

    async def wait(self, cursor: int, timeout: float) -> None:
        """Until an event after ``cursor`` exists or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self._cursor <= cursor:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return
