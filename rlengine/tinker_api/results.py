"""How a Tinker call's result reaches its client: renderers, relays, and retrieving and cancelling futures.

A call that returns a future registers an entry in the futures table
(``futures``) with a renderer: JSON, or protobuf when the client asks for
it (``forward_backward`` outputs and samples, see ``proto``). ``relay``
settles the entry's future from the engine's, through a transform into
the Tinker result. ``Results`` answers the calls on futures:
``retrieve_future`` (long-polling up to ``poll_timeout_s``, then
``try_again``; a failure as Tinker's failure record), ``retrieve_futures``
(a sampling session's completion log) and ``cancel_future`` (samples only).

Loop thread only. It starts no engine work and creates no entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.core.futures import RequestFuture
from rlengine.tinker_api import wire
from rlengine.tinker_api.errors import Forbidden, Gone, NotSupported, UnknownResource, failure_category
from rlengine.tinker_api.futures import FutureEntry, FuturesTable, wait_settled
from rlengine.tinker_api.prompt_scoring import TargetLayout
from rlengine.tinker_api.proto import encode_forward_backward_output, encode_sample_response
from rlengine.tinker_api.registry import Registry
from rlengine.types import ForwardBackwardOutput, SampleResponse

__all__ = ["Results", "relay", "render_forward_backward", "render_json", "sample_renderer"]

_JSON = "application/json"
_PROTO = "application/x-protobuf"
_json = msgspec.json.Encoder()


def render_json(result: Any, _want_proto: bool) -> tuple[str, bytes]:
    return _JSON, _json.encode(result)


def render_forward_backward(result: ForwardBackwardOutput, want_proto: bool) -> tuple[str, bytes]:
    if want_proto:
        return _PROTO, encode_forward_backward_output(result)
    return _JSON, _json.encode(wire.forward_backward_json(result))


def sample_renderer(last_n: int | None, target_layout: TargetLayout | None = None
                    ) -> Callable[[SampleResponse, bool], tuple[str, bytes]]:
    def render(result: SampleResponse, want_proto: bool) -> tuple[str, bytes]:
        if want_proto:
            return _PROTO, encode_sample_response(result, last_n, target_layout)
        return _JSON, _json.encode(wire.sample_response_json(result, last_n, target_layout))
    return render


def relay(inner: RequestFuture[Any], out: RequestFuture[Any], transform: Callable[[Any], Any] | None = None) -> None:
    """Settle ``out`` with ``transform(inner's result)`` or inner's exception."""

    def settle(f: RequestFuture[Any]) -> None:
        exc = f.exception(0)
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            value = f.result(0) if transform is None else transform(f.result(0))
        except Exception as err:  # noqa: BLE001 - delivered to the waiting client
            out.set_exception(err)
        else:
            out.set_result(value)

    inner.add_done_callback(settle)


class Results:
    """The calls on futures: retrieve one, retrieve a sampling session's completions, cancel. Loop thread only."""

    def __init__(self, registry: Registry, futures: FuturesTable) -> None:
        self.registry = registry
        self.futures = futures
        self.config = registry.config

    async def retrieve(self, owner: str, body: wire.FutureRetrieveRequest, want_proto: bool) -> tuple[str, bytes]:
        """The result (rendered), Tinker's failure record, or try-again after ``poll_timeout_s``."""
        entry = self.futures.get(body.request_id, owner)
        if not await wait_settled(entry.future, self.config.poll_timeout_s):
            return _JSON, _json.encode({"type": "try_again", "request_id": entry.request_id, "queue_state": "active"})
        self.futures.mark_retrieved(entry)
        return self._rendered(entry, want_proto)

    @staticmethod
    def _rendered(entry: FutureEntry, want_proto: bool) -> tuple[str, bytes]:
        exc = entry.future.exception(0)
        if exc is not None:
            return _JSON, _json.encode({"error": f"{type(exc).__name__}: {exc}", "category": failure_category(exc)})
        cached = entry.rendered.get(want_proto)
        if cached is None:
            cached = entry.rendered[want_proto] = entry.render(entry.future.result(0), want_proto)
        return cached

    async def retrieve_many(self, owner: str, body: wire.FuturesRetrieveRequest) -> dict[str, Any]:
        ss = self.registry.sampler(owner, body.target.sampling_session_id)
        log = ss.log(body.target.cloned_sampler_id)
        log.acknowledge(body.prev_cursor)
        for rid in body.retrieved_request_ids:
            try:
                self.futures.mark_retrieved(self.futures.get(rid, owner))
            except (UnknownResource, Gone, Forbidden):
                continue
        timeout = self.config.poll_timeout_s if body.timeout is None else min(max(0.0, body.timeout),
                                                                              self.config.poll_timeout_s)
        await log.wait(body.prev_cursor, timeout)
        events, cursor = log.after(body.prev_cursor)
        return {"completions": [{"state": state, "request_id": rid} for rid, state in events], "cursor": cursor}

    def cancel(self, owner: str, body: wire.CancelFutureRequest) -> None:
        entry = self.futures.get(body.request_id, owner)
        if entry.cancel is None:
            raise NotSupported("request_id", body.request_id, f"a {entry.kind} request cannot be cancelled "
                               "(only samples can)")
        if not entry.future.done():
            entry.cancel()
