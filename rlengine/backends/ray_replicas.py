"""Sampler replicas as Ray actors, behind the one engine (``Placement(kind="ray")``).

The control plane stays where it is: the engine's loop, scheduler, gate and
sampler loop in the driver process, unchanged. Only the backends move.
``ReplicaSet`` is a ``Backend`` to the engine (the same protocol, called on
its compute thread) that spreads requests over ``sampler_replicas`` Ray
actors, each running the configured backend (torch, vLLM, sim) built from
the same ``EngineConfig`` and model directory:

* **Routing.** A request goes to the replica its ``affinity`` (its session,
  else its sample call: a group's samples stay together, where their shared
  prompt is cached) is pinned to; a new affinity is pinned to the live replica
  with the fewest requests in flight. Pins are kept for the most recent
  ``_PINS`` affinities.
* **Stepping.** ``add_request`` and ``abort_request`` only buffer; ``step``
  sends each idle replica its buffered work in one actor call (``run``:
  aborts, adds, then backend steps until one reports or ``_STEPS_PER_CALL``
  ran), then waits at most ``_POLL_S`` for the first replica to answer and
  returns what every answered replica produced. Replicas run concurrently;
  per-caller ordering of Ray actor calls keeps each replica's calls in order.
* **Installs.** The engine installs through its gate as always (seal, drain,
  install, reopen), so an install is one version everywhere and per-token
  versions stay right. ``load_weights`` packs the named tensors into byte
  buckets (``backends.weight_buckets``), puts them in the object store once
  and has every replica load them, within ``sync_timeout_s``. If any replica
  fails or times out, the install fails with ``WeightSyncError``, the
  replicas that loaded it go back to the previous weights, and the failed
  ones are replaced: never two versions at once.
* **Faults.** A replica whose actor dies (or whose call fails) fails its
  in-flight requests (``RequestOutput.lost``: the engine settles them with
  ``ReplicaLost``, poisoning no lease), leaves the routing, and is replaced
  by a new actor loaded with the current weights (``replace_dead``, at most
  ``max_replacements`` times). With no replica left, new requests are
  refused with ``ReplicaLost``; none waits for a replica that will not come.

What crosses to an actor is bytes: requests and outputs as msgpack
(``backends.replica_wire``: every field of an output, the speculative counts
and prompt scores included, so a replica serves what its backend serves),
weights as buckets (Ray's own transport is its business). Importing this module
imports Ray; the engine imports it only for ``placement.kind == "ray"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec
import ray

from rlengine.backends import SPECS, Capabilities, RequestOutput, load
from rlengine.backends.base import BackendRequest
from rlengine.backends.replica_wire import Answer, WireOutput, decode_answer, decode_requests, encode
from rlengine.backends.weight_buckets import pack, unpack
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError, EngineDeadError, ReplicaLost, WeightSyncError

__all__ = ["PackedWeights", "ReplicaSet", "ReplicaWorker", "actor_options"]

log = logging.getLogger("rlengine")

_POLL_S = 0.05
"""Longest ``step`` waits for a replica to answer (new work waits at most this long)."""
_STEPS_PER_CALL = 32
"""Backend steps one ``run`` call may take before it answers (with nothing to report)."""
_PINS = 65536
"""Affinities whose replica is remembered."""
_CALL_TIMEOUT_S = 60.0
"""Bound on a replica's small control calls (sleep, wake-up, close, fault injection)."""

class PackedWeights:
    """Weights already packed into buckets in the object store (the sharded trainer's
    ``sampler_weights``): ``ReplicaSet.load_weights`` hands the references on as they are."""

    def __init__(self, refs: list[Any], nbytes: int) -> None:
        self.refs = refs
        self.nbytes = nbytes


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options for a placement's ``*_resources`` (``CPU`` / ``GPU`` and custom ones):
    one call at a time, never restarted by Ray (the engine decides what a lost actor costs)."""
    rest = dict(resources)
    options: dict[str, Any] = {"num_cpus": rest.pop("CPU", 0), "num_gpus": rest.pop("GPU", 0), "max_restarts": 0,
                               "max_concurrency": 1}
    if rest:
        options["resources"] = rest
    return options


def _kill(actor: Any) -> None:
    """End ``actor``'s process (already gone is fine)."""
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


class ReplicaWorker:
    """The actor: one backend, built in the actor's process from the driver's config."""

    def __init__(self, config_blob: bytes, model_path: str | None, spec_name: str) -> None:
        config = msgspec.msgpack.decode(config_blob, type=EngineConfig)
        self.backend = load(SPECS[spec_name].backend)(config, model_path)
        self._faults: dict[str, str] = {}

    def inject_fault(self, method: str, kind: str) -> None:
        """Fault injection (tests, drills): the next ``method`` call raises, exits the process, or hangs."""
        self._faults[method] = kind

    def _fault(self, method: str) -> None:
        kind = self._faults.pop(method, None)
        if kind == "raise":
            raise RuntimeError(f"injected fault in {method}")
        if kind == "exit":
            os._exit(1)
        if kind == "hang":
            time.sleep(3600)

    def ready(self) -> bytes:
        """The backend's name, capabilities, vocabulary size, context length and pid (msgpack)."""
        b = self.backend
        return encode((b.name, b.capabilities, b.vocab_size, b.max_model_len, os.getpid()))

    def run(self, adds: bytes, aborts: list[str], max_steps: int) -> bytes:
        """Aborts, adds, then steps until something reports or ``max_steps`` ran."""
        self._fault("run")
        backend = self.backend
        if aborts:
            backend.abort_request(aborts)
        rejected = []
        for request in decode_requests(adds) if adds else ():
            try:
                backend.add_request(request)
            except Exception as exc:  # noqa: BLE001 - a per-request rejection, reported
                rejected.append((request.request_id, f"{type(exc).__name__}: {exc}"))
        outs: list[RequestOutput] = []
        steps = 0
        while steps < max_steps and backend.has_unfinished_requests():
            outs = backend.step()
            steps += 1
            if outs:
                break
        return encode(Answer(rejected, [WireOutput.of(o) for o in outs], steps))

    def load_weights(self, version: int, *buckets: bytes) -> int:
        self._fault("load_weights")
        self.backend.load_weights((named for blob in buckets for named in unpack(blob)), version)
        return version

    def sleep(self, level: int) -> None:
        self.backend.sleep(level)

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        self.backend.close()


class _Replica:
    """The driver's record of one replica actor."""

    __slots__ = ("aborts", "actor", "adds", "call", "index", "inflight", "load", "pid", "started", "state", "version")

    def __init__(self, index: int, actor: Any) -> None:
        self.index = index
        self.actor = actor
        self.state = "starting"
        """starting (building its backend), loading (the current weights), live, or dead."""
        self.call: Any = None
        """The outstanding ``run`` call (an ObjectRef), or None."""
        self.load: Any = None
        """The outstanding start-up call (``ready``, then ``load_weights``), or None."""
        self.adds: list[BackendRequest] = []
        self.aborts: list[str] = []
        self.inflight: set[str] = set()
        self.pid = 0
        self.version = 0
        self.started = time.monotonic()
        """When start-up began: a replica not live within ``start_timeout_s`` is lost."""


class ReplicaSet:
    """The ``Backend`` of an engine whose backends are Ray actors; see the module docstring.

    Why one class: it is one ``Backend`` over many actors, each method the protocol's own routed to
    them; split, the protocol would be split with it (the actor side is ``ReplicaWorker``).
    """

    def __init__(self, config: EngineConfig, model_path: str | None, spec_name: str) -> None:
        placement = config.placement
        self.placement = placement
        if not ray.is_initialized():
            address = placement.address or os.environ.get("RAY_ADDRESS") or None
            ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
        self._config_blob = msgspec.msgpack.encode(config)
        self._model_path = model_path
        self._spec_name = spec_name
        self._actor_class = ray.remote(ReplicaWorker).options(**actor_options(placement.replica_resources))
        self._replicas: list[_Replica] = []
        self._where: dict[str, _Replica] = {}
        self._pins: OrderedDict[str, _Replica] = OrderedDict()
        self._lost: list[RequestOutput] = []
        self._weights: list[Any] = []
        """The installed weights' bucket refs (empty: the model directory's own)."""
        self.version = 0
        self.replacements = 0
        self.last_sync: dict[str, float] = {}
        """The last install's bytes, buckets, whether they were packed here (1) or where they were
        gathered (0: ``PackedWeights``) and seconds (pack, put, load)."""
        for _ in range(placement.sampler_replicas):
            self._spawn()
        first = self._start_all()
        name, caps, self.vocab_size, self.max_model_len = first
        self.name = f"ray[{placement.sampler_replicas}x{name}]"
        self.capabilities = msgspec.convert(caps, Capabilities)

    # -- replica lifecycle ------------------------------------------------------------

    def _spawn(self) -> _Replica:
        actor = self._actor_class.remote(self._config_blob, self._model_path, self._spec_name)
        replica = _Replica(len(self._replicas), actor)
        replica.load = actor.ready.remote()
        self._replicas.append(replica)
        return replica

    def _start_all(self) -> tuple[str, dict[str, Any], int, int]:
        """Wait (``start_timeout_s``) for every first replica to build its backend."""
        refs = [r.load for r in self._replicas]
        try:
            answers = ray.get(refs, timeout=self.placement.start_timeout_s)
        except Exception as exc:
            self.close()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise EngineDeadError(f"placement: {len(refs)} sampler replica(s) did not start within "
                                      f"start_timeout_s={self.placement.start_timeout_s}") from None
            raise EngineDeadError(f"placement: a sampler replica failed to start: {exc}") from exc
        first = None
        for replica, blob in zip(self._replicas, answers):
            name, caps, vocab, max_len, replica.pid = msgspec.msgpack.decode(blob)
            replica.state, replica.load = "live", None
            if first is None:
                first = (name, caps, vocab, max_len)
        assert first is not None
        return first

    def _lose(self, replica: _Replica, why: str) -> None:
        """``replica`` is gone: fail its requests (lost), drop its pins, maybe replace it."""
        if replica.state == "dead":
            return
        replica.state = "dead"
        log.warning("rlengine: sampler replica %d (pid %d) lost: %s", replica.index, replica.pid, why)
        for rid in sorted(replica.inflight):
            self._where.pop(rid, None)
            self._lost.append(RequestOutput(rid, [], [], finished=True, error=f"sampler replica {replica.index} "
                                            f"(pid {replica.pid}) was lost: {why}", lost=True))
        for request in replica.adds:
            self._where.pop(request.request_id, None)
            self._lost.append(RequestOutput(request.request_id, [], [], finished=True, lost=True,
                                            error=f"sampler replica {replica.index} was lost before it ran: {why}"))
        replica.inflight.clear()
        replica.adds.clear()
        replica.call = replica.load = None
        for key in [k for k, r in self._pins.items() if r is replica]:
            del self._pins[key]
        _kill(replica.actor)
        if self.placement.replace_dead and self.replacements < self.placement.max_replacements:
            self.replacements += 1
            self._spawn()

    def _advance_starting(self) -> None:
        """Move replicas along start-up without waiting: ready -> load the current weights -> live."""
        for replica in self._replicas:
            if replica.state not in ("starting", "loading") or replica.load is None:
                continue
            done, _ = ray.wait([replica.load], timeout=0)
            if not done:
                if time.monotonic() - replica.started > self.placement.start_timeout_s:
                    self._lose(replica, f"not live within start_timeout_s={self.placement.start_timeout_s}")
                continue
            try:
                answer = ray.get(replica.load)
            except Exception as exc:  # noqa: BLE001 - a replacement that fails to start is lost too
                self._lose(replica, f"start-up failed: {exc}")
                continue
            if replica.state == "starting":
                replica.pid = msgspec.msgpack.decode(answer)[4]
                replica.state, replica.version = "loading", 0
            else:
                replica.version = answer
            if self._weights and replica.version != self.version:
                replica.load = replica.actor.load_weights.remote(self.version, *self._weights)
            else:
                replica.state, replica.load = "live", None

    def _live(self) -> list[_Replica]:
        return [r for r in self._replicas if r.state == "live"]

    # -- the backend protocol ----------------------------------------------------------

    def _route(self, affinity: str) -> _Replica:
        pins = self._pins
        replica = pins.get(affinity)
        if replica is not None and replica.state != "dead":
            pins.move_to_end(affinity)
            return replica
        candidates = self._live() or [r for r in self._replicas if r.state != "dead"]
        if not candidates:
            raise ReplicaLost(f"request affinity {affinity!r}: no sampler replica is left "
                              f"({self.replacements} replacement(s) used of max_replacements="
                              f"{self.placement.max_replacements})")
        replica = min(candidates, key=lambda r: len(r.inflight) + len(r.adds))
        pins[affinity] = replica
        if len(pins) > _PINS:
            pins.popitem(last=False)
        return replica

    def add_request(self, request: BackendRequest) -> None:
        replica = self._route(request.affinity or request.request_id)
        replica.adds.append(request)
        self._where[request.request_id] = replica

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            replica = self._where.pop(rid, None)
            if replica is None:
                continue
            if rid in replica.inflight:
                replica.inflight.discard(rid)
                replica.aborts.append(rid)
            else:
                replica.adds = [r for r in replica.adds if r.request_id != rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self._where) or bool(self._lost)

    def _send(self, replica: _Replica, max_steps: int) -> None:
        adds = encode(replica.adds) if replica.adds else b""
        for request in replica.adds:
            replica.inflight.add(request.request_id)
        replica.call = replica.actor.run.remote(adds, replica.aborts, max_steps)
        replica.adds, replica.aborts = [], []

    def step(self) -> list[RequestOutput]:
        self._advance_starting()
        outs, self._lost = self._lost, []
        for replica in self._live():
            if replica.call is None and (replica.adds or replica.aborts or replica.inflight):
                self._send(replica, _STEPS_PER_CALL)
        calls = {r.call: r for r in self._replicas if r.call is not None}
        if not calls:
            if not outs and self._where:  # only replicas still starting hold work: wait for them a little
                starting = [r.load for r in self._replicas if r.load is not None]
                if starting:
                    ray.wait(starting, timeout=_POLL_S)
            return outs
        ready, _ = ray.wait(list(calls), num_returns=1, timeout=0 if outs else _POLL_S)
        if ready:
            ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
        for ref in ready:
            replica = calls[ref]
            replica.call = None
            try:
                answer = decode_answer(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - the actor died or its backend failed: the replica is lost
                self._lose(replica, f"{type(exc).__name__}: {exc}")
                continue
            self._collect(replica, answer, outs)
        outs.extend(self._lost)
        self._lost = []
        return outs

    def _collect(self, replica: _Replica, answer: Answer, outs: list[RequestOutput]) -> None:
        inflight, where = replica.inflight, self._where
        for rid, why in answer.rejected:
            if rid in inflight:
                inflight.discard(rid)
                where.pop(rid, None)
                outs.append(RequestOutput(rid, [], [], finished=True, error=f"rejected by replica "
                                          f"{replica.index}: {why}"))
        for wire in answer.outputs:
            rid = wire.request_id
            if rid not in inflight:  # aborted while the call ran
                continue
            if wire.finished:
                inflight.discard(rid)
                where.pop(rid, None)
            outs.append(wire.output())

    def _flush(self, replicas: list[_Replica]) -> None:
        """Send buffered aborts (and adds) before a control call, which runs after them."""
        for replica in replicas:
            if replica.call is None and (replica.adds or replica.aborts):
                self._send(replica, 0)

    def _everywhere(self, what: str, calls: dict[Any, _Replica], timeout: float) -> list[_Replica]:
        """Wait for ``calls`` (one per replica) within ``timeout``; the replicas that failed or did not answer."""
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        failed = [calls[ref] for ref in calls if ref not in ready]
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - reported as a failed replica
                log.warning("rlengine: sampler replica %d: %s failed: %s", calls[ref].index, what, exc)
                failed.append(calls[ref])
        return failed

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        started = time.perf_counter()
        if isinstance(named_tensors, PackedWeights):  # packed where they were gathered: no copy here
            refs = named_tensors.refs
            nbytes = named_tensors.nbytes
            packed = put = time.perf_counter()
        else:
            blobs = pack(named_tensors, self.placement.sync_bucket_bytes)
            nbytes = sum(map(len, blobs))
            packed = time.perf_counter()
            refs = [ray.put(blob) for blob in blobs]
            put = time.perf_counter()
        live = self._live()
        self._flush(live)
        calls = {r.actor.load_weights.remote(version, *refs): r for r in live}
        failed = self._everywhere(f"weight install of version {version}", calls, self.placement.sync_timeout_s)
        if failed:
            for replica in failed:
                self._lose(replica, f"weight sync of version {version} failed or timed out "
                                    f"(sync_timeout_s={self.placement.sync_timeout_s})")
            self._roll_back([r for r in live if r not in failed])
            raise WeightSyncError(
                f"weight install of version {version}: replica(s) {sorted(r.index for r in failed)} failed or did "
                f"not load {nbytes} bytes within sync_timeout_s={self.placement.sync_timeout_s}; "
                f"every replica is back on version {self.version} (the failed ones are replaced)")
        for replica in live:
            replica.version = version
        self._weights, self.version = refs, version
        done = time.perf_counter()
        self.last_sync = {"bytes": float(nbytes), "buckets": float(len(refs)),
                          "packed_here": float(not isinstance(named_tensors, PackedWeights)),
                          "pack_s": packed - started, "put_s": put - packed, "load_s": done - put,
                          "total_s": done - started}

    def _roll_back(self, replicas: list[_Replica]) -> None:
        """Put ``replicas`` (which loaded a failed install) back on the current weights."""
        if not replicas:
            return
        if not self._weights:  # the model directory's own weights: a fresh actor has them
            for replica in replicas:
                self._lose(replica, "rolled back after a failed install (replaced by a fresh replica)")
            return
        calls = {r.actor.load_weights.remote(self.version, *self._weights): r for r in replicas}
        for replica in self._everywhere("roll-back", calls, self.placement.sync_timeout_s):
            self._lose(replica, "roll-back after a failed install failed")

    def _control(self, method: str, *args: Any) -> None:
        live = self._live()
        self._flush(live)
        calls = {getattr(r.actor, method).remote(*args): r for r in live}
        for replica in self._everywhere(method, calls, _CALL_TIMEOUT_S):
            self._lose(replica, f"{method} failed or timed out")

    def sleep(self, level: int = 1) -> None:
        self._control("sleep", level)

    def wake_up(self) -> None:
        self._control("wake_up")

    def describe(self) -> dict[str, Any]:
        """Per replica: state, pid, version, requests in flight; the last install's timings."""
        return {"replicas": [{"index": r.index, "state": r.state, "pid": r.pid, "version": r.version,
                              "inflight": len(r.inflight) + len(r.adds)} for r in self._replicas],
                "replacements": self.replacements, "version": self.version, "last_sync": dict(self.last_sync)}

    def inject_fault(self, index: int, method: str, kind: str) -> None:
        """Make replica ``index``'s next ``method`` (``run`` or ``load_weights``) raise, exit its
        process or hang (``kind``: raise, exit, hang): fault injection for tests and drills."""
        if kind not in ("raise", "exit", "hang") or method not in ("run", "load_weights"):
            raise ValueError(f"inject_fault({method!r}, {kind!r}): method run or load_weights, kind raise, exit "
                             "or hang")
        ray.get(self._replicas[index].actor.inject_fault.remote(method, kind), timeout=_CALL_TIMEOUT_S)

    def kill_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor, as a crash would (fault injection for tests and drills);
        the loss is noticed, and handled, on its next call."""
        ray.kill(self._replicas[index].actor, no_restart=True)

    def close(self) -> None:
        """Close every replica's backend (briefly: ``_CALL_TIMEOUT_S``), then end the actors."""
        live = [r for r in self._replicas if r.state != "dead"]
        closing = [r.actor.close.remote() for r in live if r.state == "live"]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=_CALL_TIMEOUT_S)
        for replica in live:
            replica.state = "dead"
            _kill(replica.actor)


def build(config: EngineConfig, model_path: str | None, spec_name: str) -> ReplicaSet:
    """The engine's entry point for ``placement.kind == "ray"``."""
    if config.placement.kind != "ray":
        raise ConfigurationError(f"placement.kind={config.placement.kind!r}: ReplicaSet is for 'ray'")
    return ReplicaSet(config, model_path, spec_name)
