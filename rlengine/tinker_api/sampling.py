"""Sampling for the Tinker API: sampler snapshots, installing them on demand, sampling sessions.

The engine's sampler holds one set of weights at a time, as a policy
version installed through the gate. Tinker sampling clients each name the
weights they sample from: the base model, a snapshot saved by
``save_weights_for_sampler`` (with or without a name), or, for the
``inflight`` kind, "this training model's latest weights, no older than at
creation". ``SamplerWeights`` keeps the recent snapshots (a LoRA snapshot
is just the adapter; a full fine-tuning one a CPU copy of every weight;
named ones are also on disk, so they survive eviction) and knows which one
every installed version holds.

A sample whose weights are loaded (and no install is queued) goes straight
to the engine, pinned to that version. Otherwise it is queued right behind
an install of its snapshot (through the gate, as a new version: seal, drain,
install, reopen): behind the last queued install if that one holds its
weights (so concurrent requests share one install), else behind a new one.
The engine's FIFO admits it after that install and before any later one;
the per-token versions of its result confirm it, and a call that was
overtaken anyway (an install from outside this server) goes round again, a
bounded number of times. So an old sampling client keeps sampling its own
weights while training moves on (Tinker's contract, which the cookbook's
``max_steps_off_policy`` relies on), at the price of a reinstall whenever
old and new clients alternate.

Loop thread only; weights are produced on the compute thread inside the
engine's install.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from rlengine.core.engine import Engine
from rlengine.core.futures import RequestFuture
from rlengine.core.records import SampleSpec
from rlengine.errors import ModelNotLoaded, RequestAborted
from rlengine.tinker_api.errors import Gone
from rlengine.tinker_api.futures import CompletionLog
from rlengine.types import SampleResponse

__all__ = ["BASE", "SampleCall", "SamplerWeights", "SamplingSession", "Snapshot"]

BASE = "base"
"""The key of the base model's weights (the model directory's own)."""
_ATTEMPTS = 4
_SEEN_KEPT = 1024


class Snapshot:
    """Weights the sampler can be asked for: ``weights()`` makes them (compute thread)."""

    __slots__ = ("key", "model_id", "order", "path", "weights")

    def __init__(self, key: str, model_id: str | None, order: int, weights: Callable[[], Any],
                 path: str | None = None) -> None:
        self.key = key
        self.model_id = model_id
        self.order = order
        """Position among its model's snapshots (inflight sessions take any at least as new)."""
        self.weights = weights
        self.path = path
        """The ``tinker://`` path of a named snapshot (on disk)."""


class SamplingSession:
    """A Tinker sampling client's server side: which weights it samples, and its request ids."""

    __slots__ = (
        "base_model",
        "clients",
        "floor",
        "inflight_model",
        "key",
        "logs",
        "model_path",
        "owner",
        "sampling_session_id",
        "seen",
        "session_id",
    )

    def __init__(self, sampling_session_id: str, session_id: str, owner: str, base_model: str, *,
                 key: str | None = None, model_path: str | None = None, inflight_model: str | None = None,
                 floor: int = 0) -> None:
        self.sampling_session_id = sampling_session_id
        self.session_id = session_id
        self.owner = owner
        self.base_model = base_model
        self.model_path = model_path
        self.key = key
        self.inflight_model = inflight_model
        self.floor = floor
        self.clients = 0
        """Clone ids handed out by ``join_sampling_session`` (the original client is 0)."""
        self.seen: OrderedDict[int, str] = OrderedDict()
        self.logs: dict[int, CompletionLog] = {}

    def satisfied_by(self, snapshot: Snapshot | None) -> bool:
        if snapshot is None:
            return False
        if self.inflight_model is not None:
            return snapshot.model_id == self.inflight_model and snapshot.order >= self.floor
        return snapshot.key == self.key

    def remember(self, seq_id: int, request_id: str) -> None:
        self.seen[seq_id] = request_id
        while len(self.seen) > _SEEN_KEPT:
            self.seen.popitem(last=False)

    def log(self, clone: int) -> CompletionLog:
        log = self.logs.get(clone)
        if log is None:
            log = self.logs[clone] = CompletionLog()
        return log


class SamplerWeights:
    """Snapshots by key, which one each installed version holds, and the installs queued for them."""

    def __init__(self, engine: Engine, kept: int, base_weights: Callable[[], Any]) -> None:
        self.engine = engine
        self.kept = kept
        self._snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self._base = Snapshot(BASE, None, 0, base_weights)
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._loaded: dict[int, str] = {}
        self._queued: list[tuple[str, RequestFuture[int]]] = []
        """Installs queued in the engine's FIFO and not yet settled, oldest first."""
        self.installs = 0
        # Version 0 is what the engine started with: the model directory's weights.
        if engine.scheduler.version == 0:
            self._loaded[0] = BASE

    def get(self, key: str) -> Snapshot:
        if key == BASE:
            return self._base
        snapshot = self._snapshots.get(key)
        if snapshot is None:
            if key in self._evicted:
                raise Gone("sampling_session_id", key, f"its weights snapshot was evicted (only the latest "
                           f"sampler_snapshots_kept={self.kept} are kept; named saves stay on disk)")
            raise Gone("sampling_session_id", key, "its weights are no longer held (the model was unloaded)")
        self._snapshots.move_to_end(key)
        return snapshot

    def _find(self, key: str | None) -> Snapshot | None:
        if key is None:
            return None
        return self._base if key == BASE else self._snapshots.get(key)

    def add(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.key] = snapshot
        self._snapshots.move_to_end(snapshot.key)
        while len(self._snapshots) > self.kept:
            key, _ = self._snapshots.popitem(last=False)
            self._evicted[key] = None
            while len(self._evicted) > 100_000:
                self._evicted.popitem(last=False)

    def discard(self, key: str) -> None:
        self._snapshots.pop(key, None)

    def drop_model(self, model_id: str) -> None:
        """Forget a model's snapshots that live only in memory (named ones reload from disk)."""
        for key, snapshot in list(self._snapshots.items()):
            if snapshot.model_id == model_id and snapshot.path is None:
                del self._snapshots[key]

    def newest_of(self, model_id: str) -> Snapshot | None:
        mine = [s for s in self._snapshots.values() if s.model_id == model_id]
        return max(mine, key=lambda s: s.order) if mine else None

    def loaded(self) -> Snapshot | None:
        """The snapshot the sampler holds now (None: unknown weights, e.g. an in-process install)."""
        version = self.engine.scheduler.version
        return self._find(self._loaded.get(version) if version is not None else None)

    def upcoming(self) -> tuple[Snapshot | None, RequestFuture[int] | None]:
        """What a sample queued now will be admitted on: the last queued install (and its future), or
        the loaded snapshot when no install is queued."""
        if self._queued:
            key, future = self._queued[-1]
            return self._find(key), future
        return self.loaded(), None

    def target_of(self, session: SamplingSession) -> str:
        if session.inflight_model is None:
            assert session.key is not None
            return session.key
        newest = self.newest_of(session.inflight_model)
        if newest is None or newest.order < session.floor:
            raise Gone("sampling_session_id", session.sampling_session_id,
                       "its model's weights are no longer held (the model was unloaded)")
        return newest.key

    def queue_install(self, key: str, weights: Callable[[], Any] | None = None) -> RequestFuture[int]:
        """Queue an install of snapshot ``key`` (through the gate, as a new version)."""
        future = self.engine.install_weights(weights if weights is not None else self.get(key).weights)
        entry = (key, future)
        self._queued.append(entry)

        def settled(f: RequestFuture[int]) -> None:
            self._queued.remove(entry)
            if f.exception(0) is None:
                version = f.result(0)
                self._loaded[version] = key
                self.installs += 1
                # Only recent versions can still be loaded or asked for.
                for old in [v for v in self._loaded if v < version - 64]:
                    del self._loaded[old]

        future.add_done_callback(settled)
        return future


class SampleCall:
    """One ``asample`` call: queued behind the install of its weights if needed; settles ``out``.

    The sample is queued in the same loop callback as the install it needs (or
    behind the last install already queued for those weights), so the
    engine's FIFO admits it right after that install and before any later
    one: it follows "whatever is loaded" (version None) and then checks the
    per-token versions of its result against the install's version. With no
    install queued and its weights loaded, it is pinned to the loaded version.
    """

    __slots__ = (
        "attempts",
        "cancelled",
        "engine_rid",
        "expected",
        "out",
        "session",
        "spec",
        "weights",
    )

    def __init__(self, weights: SamplerWeights, session: SamplingSession, spec: SampleSpec,
                 out: RequestFuture[SampleResponse]) -> None:
        self.weights = weights
        self.session = session
        self.spec = spec
        """The call, validated by the engine when it arrived (``Engine.validate_sample``)."""
        self.out = out
        self.engine_rid: str | None = None
        self.cancelled = False
        self.attempts = 0
        self.expected: RequestFuture[int] | None = None

    def run(self) -> None:
        self.attempts += 1
        weights = self.weights
        try:
            snapshot, pending = weights.upcoming()
            if self.session.satisfied_by(snapshot):
                self.expected = pending
                version = None if pending is not None else weights.engine.scheduler.version
            else:
                self.expected = weights.queue_install(weights.target_of(self.session))
                version = None
            future = weights.engine.submit_sample(self.spec, version=version,
                                                  session_id=self.session.sampling_session_id)
        except Exception as exc:  # noqa: BLE001 - a refused submission fails this call
            self.out.set_exception(exc)
            return
        self.engine_rid = future.request_id
        future.add_done_callback(self._settled)

    def _retry(self) -> bool:
        if self.attempts >= _ATTEMPTS or self.cancelled:
            return False
        self.engine_rid = None
        self.run()
        return True

    def _settled(self, future: RequestFuture[SampleResponse]) -> None:
        exc = future.exception(0)
        if isinstance(exc, ModelNotLoaded) and self._retry():
            return  # another install overtook a pinned sample: go round again
        if exc is not None:
            self.out.set_exception(exc)
            return
        response = future.result(0)
        if any(s.stop_reason == "abort" for s in response.sequences):
            self.out.set_exception(RequestAborted(
                f"request {self.out.request_id} was aborted (cancelled, or the engine is closing)"))
            return
        if self.expected is not None:
            # The install ran before this sample was admitted, so it has settled.
            install_error = self.expected.exception(0)
            if install_error is not None:
                self.out.set_exception(install_error)
                return
            version = self.expected.result(0)
            if any(s.length and not np.all(s.versions_array() == version) for s in response.sequences) \
                    and self._retry():
                return  # something else installed weights in between: sample again
        self.out.set_result(response)

    def cancel(self) -> None:
        self.cancelled = True
        if self.engine_rid is not None:
            self.weights.engine.abort(self.engine_rid)
