"""``TinkerService``: the Tinker API's semantics over one ``Engine`` (everything but HTTP).

It owns the registries of a Tinker server (sessions, training models,
sampling sessions, sampler snapshots, the futures table) and turns each API
call into engine work: training calls become blocking items of the engine's
FIFO, in each model's ``seq_id`` order (``training``); samples go to the
engine's sampler, pinned to the right weights (``sampling``). A call that
returns a future registers a ``RequestFuture`` in the futures table and
answers ``{"request_id": ...}`` at once; the engine settles it later.

Ownership: a session belongs to the API key that created it (a digest of
it, never the key), and so do its models, sampling sessions, checkpoints
and futures. Another key's id answers ``Forbidden``. Sessions without a
heartbeat for ``session_ttl_s`` are finished: their models are unloaded
after the calls already queued for them.

Every method runs on the engine's loop thread; the HTTP layer
(``server``) decodes bodies, calls these methods and encodes what they
return. Trainer work (building, snapshots, checkpoints) runs on the
compute thread inside the engine's blocking items.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from rlengine.core.engine import Engine
from rlengine.core.futures import RequestFuture
from rlengine.errors import InvalidRequest
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api import wire
from rlengine.tinker_api.config import TinkerServerConfig
from rlengine.tinker_api.errors import Forbidden, Gone, LimitExceeded, NotSupported, UnknownResource, failure_category
from rlengine.tinker_api.futures import FutureEntry, FuturesTable, wait_settled
from rlengine.tinker_api.proto import FwdBwdRequest, encode_forward_backward_output, encode_sample_response
from rlengine.tinker_api.sampling import BASE, SampleCall, SamplerWeights, SamplingSession, Snapshot
from rlengine.tinker_api.training import TrainingModel, build_trainer, snapshot_weights, take_snapshot
from rlengine.trainer.losses import validate_data
from rlengine.types import ForwardBackwardOutput, SampleResponse

__all__ = ["TinkerService"]

_JSON = "application/json"
_PROTO = "application/x-protobuf"
_FORMAT = "rlengine-tinker-1"
_GONE_KEPT = 100_000
_json = msgspec.json.Encoder()


class Session:
    """A Tinker session (one ``ServiceClient``)."""

    __slots__ = ("last_seen", "models", "owner", "samplers", "session_id")

    def __init__(self, session_id: str, owner: str) -> None:
        self.session_id = session_id
        self.owner = owner
        self.last_seen = time.monotonic()
        self.models: dict[int, str] = {}
        """model_seq_id -> the request id that created it (a retried creation gets it back)."""
        self.samplers: dict[int, str] = {}
        """sampling_session_seq_id -> sampling session id."""


def _render_json(result: Any, _want_proto: bool) -> tuple[str, bytes]:
    return _JSON, _json.encode(result)


def _render_fwdbwd(result: ForwardBackwardOutput, want_proto: bool) -> tuple[str, bytes]:
    if want_proto:
        return _PROTO, encode_forward_backward_output(result)
    return _JSON, _json.encode(wire.forward_backward_json(result))


def _sample_renderer(last_n: int | None) -> Callable[[SampleResponse, bool], tuple[str, bytes]]:
    def render(result: SampleResponse, want_proto: bool) -> tuple[str, bytes]:
        if want_proto:
            return _PROTO, encode_sample_response(result, last_n)
        return _JSON, _json.encode(wire.sample_response_json(result, last_n))
    return render


def _relay(inner: RequestFuture[Any], out: RequestFuture[Any], transform: Callable[[Any], Any] | None = None) -> None:
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


class TinkerService:
    """The Tinker API over one engine; see the module docstring. Loop thread only."""

    def __init__(self, engine: Engine, config: TinkerServerConfig) -> None:
        from rlengine.backends.torch.models import cache_root

        self.engine = engine
        self.config = config
        self.root = os.path.abspath(config.checkpoint_dir or os.path.join(cache_root(engine.config),
                                                                          "tinker-checkpoints"))
        self.futures = FuturesTable(max_entries=config.max_futures, ttl_s=config.future_ttl_s)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.weights = SamplerWeights(engine, config.sampler_snapshots_kept, self._base_weights)
        self._gone: OrderedDict[str, str] = OrderedDict()
        """Ids of finished sessions, unloaded models and dropped sampling sessions -> why (bounded)."""
        self._sweeper: asyncio.TimerHandle | None = None
        self.arch = self._architecture()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self._schedule_sweep()

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _schedule_sweep(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(self.config.sweep_interval_s, self._sweep)

    def _sweep(self) -> None:
        try:
            self.futures.sweep()
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_seen > self.config.session_ttl_s:
                    self._finish(session, f"no heartbeat for session_ttl_s={self.config.session_ttl_s}")
            for model in list(self.models.values()):
                model.expire_held(self.config.hold_timeout_s)
        finally:
            self._schedule_sweep()

    # -- configuration and discovery ------------------------------------------------------

    def _architecture(self) -> str | None:
        path = self.engine.model_path
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            return None
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or [None]
        return archs[0]

    def base_model_names(self) -> list[str]:
        cfg = self.engine.config
        names = [cfg.model, self.engine.model_name]
        if self.engine.model_path is not None:
            names.append(self.engine.model_path)
        return list(dict.fromkeys(names))

    def _check_base_model(self, field: str, name: str) -> None:
        path = self.engine.model_path
        if path is not None and os.path.isdir(name) and os.path.realpath(name) == os.path.realpath(path):
            return
        if name not in self.base_model_names():
            raise UnknownResource(field, name, f"this server serves {self.base_model_names()} "
                                  "(a local model directory, or the engine's model name)")

    def client_config(self) -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False, "credential_default_source": "api_key",
            "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": 1024, "fwdbwd_max_chunk_bytes_count": self.config.max_body_bytes // 2,
            # httpx's transport: one less native dependency between the SDK and a loopback server.
            "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": self.config.sample_use_retrieve_futures,
            "sample_join_sampling_session": True, "custom_loss_server_side": False,
        }

    @staticmethod
    def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}

    def capabilities(self) -> dict[str, Any]:
        trainable = self.engine.model_path is not None
        limit = self.engine.backend.max_model_len
        return {"supported_models": [{"model_name": name, "max_context_length": limit, "trainable": trainable,
                                      "sampleable": True} for name in self.base_model_names()]}

    # -- sessions -----------------------------------------------------------------------

    def create_session(self, owner: str, _body: wire.CreateSessionRequest) -> dict[str, Any]:
        session_id = self.futures.new_id("session")
        self.sessions[session_id] = Session(session_id, owner)
        return {"type": "create_session", "session_id": session_id}

    def _session(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._gone:
                raise Gone("session_id", session_id, self._gone[session_id])
            raise UnknownResource("session_id", session_id, "no such session")
        if session.owner != owner:
            raise Forbidden("session_id", session_id, "belongs to another API key")
        session.last_seen = time.monotonic()
        return session

    def heartbeat(self, owner: str, body: wire.SessionHeartbeatRequest) -> dict[str, Any]:
        self._session(owner, body.session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, owner: str, session_id: str) -> None:
        self._finish(self._session(owner, session_id), "the session was finished by its client")

    def _finish(self, session: Session, why: str) -> None:
        self.sessions.pop(session.session_id, None)
        self._bury(session.session_id, why)
        for model in [m for m in self.models.values() if m.session_id == session.session_id]:
            self._unload(model, f"its session {session.session_id} ended: {why}")
        for sid in [s for s, ss in self.samplers.items() if ss.session_id == session.session_id]:
            del self.samplers[sid]
            self._bury(sid, f"its session ended: {why}")

    def _bury(self, resource_id: str, why: str) -> None:
        """Remember why an id is gone, so using it says so (the oldest are forgotten past a bound)."""
        self._gone[resource_id] = why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    # -- models --------------------------------------------------------------------------

    def _model(self, owner: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            if model_id in self._gone:
                raise Gone("model_id", model_id, self._gone[model_id])
            raise UnknownResource("model_id", model_id, "no such model")
        if model.owner != owner:
            raise Forbidden("model_id", model_id, "belongs to a session of another API key")
        session = self.sessions.get(model.session_id)
        if session is not None:
            session.last_seen = time.monotonic()
        return model

    def _check_trainable(self) -> None:
        # Before anything imports the trainers (and torch): the sim backend has no model to train.
        if self.engine.model_path is None:
            raise NotSupported("backend", self.engine.backend.name,
                               "the Tinker API trains Hugging Face models; use backend 'torch' or 'vllm'")

    def _new_model(self, owner: str, session: Session, model_seq_id: int, base_model: str, lora: Any,
                   user_metadata: dict[str, Any] | None) -> TrainingModel:
        if len(self.models) >= self.config.max_models:
            raise LimitExceeded("model_seq_id", model_seq_id, f"max_models={self.config.max_models} models are "
                                "alive; unload one (or finish its session) first")
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_id in self.models or model_id in self._gone:
            raise InvalidRequest("model_seq_id", model_seq_id, f"already used in this session (model {model_id})")
        model = TrainingModel(model_id, session.session_id, owner, base_model, lora, user_metadata)
        self.models[model_id] = model
        return model

    def _lora_spec(self, wire_lora: wire.LoraConfigWire | None) -> Any:
        if wire_lora is None or wire_lora.rank == 0:
            return None
        from rlengine.trainer.lora import LoraSpec

        return LoraSpec(rank=wire_lora.rank, seed=wire_lora.seed, train_attn=wire_lora.train_attn,
                        train_mlp=wire_lora.train_mlp, train_unembed=wire_lora.train_unembed)

    def create_model(self, owner: str, body: wire.CreateModelRequest) -> dict[str, Any]:
        session = self._session(owner, body.session_id)
        earlier = session.models.get(body.model_seq_id)
        if earlier is not None:
            return {"request_id": earlier}
        self._check_trainable()
        self._check_base_model("base_model", body.base_model)
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise NotSupported("optimizer_config.type", body.optimizer_config.type, "rlengine trains with AdamW")
        if body.lora_config is not None and (isinstance(body.lora_config.rank, bool) or body.lora_config.rank < 0):
            raise NotSupported("lora_config.rank", body.lora_config.rank, "must be >= 0 (0: full fine-tuning)")
        lora = self._lora_spec(body.lora_config)
        model = self._new_model(owner, session, body.model_seq_id, body.base_model, lora, body.user_metadata)
        entry = self.futures.add("create", owner, _render_json)
        session.models[body.model_seq_id] = entry.request_id
        engine = self.engine

        def after(trainer: Any) -> dict[str, Any]:
            model.trainer = trainer
            return {"model_id": model.model_id, "type": "create_model"}

        inner = engine.submit_blocking("create_model", lambda: build_trainer(engine.config, engine.model_path, lora),
                                       after=after)
        inner.add_done_callback(lambda f: setattr(model, "failure", f.exception(0)))
        _relay(inner, entry.future)
        return {"request_id": entry.request_id, "model_id": model.model_id}

    def get_info(self, owner: str, body: wire.GetInfoRequest) -> dict[str, Any]:
        model = self._model(owner, body.model_id)
        return {"type": "get_info", "model_id": model.model_id, "model_name": model.base_model,
                "is_lora": model.lora is not None, "lora_rank": model.rank,
                "model_data": {"arch": self.arch, "model_name": model.base_model,
                               "tokenizer_id": self.engine.model_path}}

    def unload_model(self, owner: str, body: wire.UnloadModelRequest) -> dict[str, Any]:
        model = self._model(owner, body.model_id)
        entry = self.futures.add("unload", owner, _render_json)
        _relay(self._unload(model, "it was unloaded by its client"), entry.future,
               lambda _: {"model_id": model.model_id, "type": "unload_model"})
        return {"request_id": entry.request_id, "model_id": model.model_id}

    def _unload(self, model: TrainingModel, why: str) -> RequestFuture[Any]:
        """Close the model; its trainer is released after the calls already queued for it."""
        model.close(Gone("model_id", model.model_id, why))
        self.models.pop(model.model_id, None)
        self._bury(model.model_id, why)
        self.weights.drop_model(model.model_id)
        for taken in model.named_snapshots:
            # Named snapshots stay usable from disk; their in-memory copies go with the model.
            taken.pop("state", None)
        return self.engine.submit_blocking("unload_model", lambda: setattr(model, "trainer", None))

    # -- training calls -------------------------------------------------------------------

    def _train_call(self, owner: str, model: TrainingModel, seq_id: int | None, kind: str, run: Callable[[], Any],
                    render: Callable[[Any, bool], tuple[str, bytes]],
                    transform: Callable[[Any], Any] | None = None,
                    submit: Callable[[Callable[[], Any]], RequestFuture[Any]] | None = None) -> dict[str, Any]:
        """Queue ``run`` (compute thread) as the model's call ``seq_id``; answer its request id now."""
        earlier = model.seen(seq_id)
        if earlier is not None:
            return {"request_id": earlier, "model_id": model.model_id}
        entry = self.futures.add("train", owner, render)
        engine = self.engine

        def start() -> None:
            inner = submit(run) if submit is not None else engine.submit_blocking(kind, run)
            _relay(inner, entry.future, transform)

        try:
            model.order(seq_id, entry.request_id, start, entry.future.set_exception)
        except Exception as exc:
            entry.future.set_exception(exc)
            raise
        return {"request_id": entry.request_id, "model_id": model.model_id}

    def forward_backward(self, owner: str, request: FwdBwdRequest) -> dict[str, Any]:
        model = self._model(owner, request.model_id)
        backend = self.engine.backend
        thresholds = validate_data(request.data, request.loss_fn, request.loss_fn_config, backend.vocab_size,
                                   backend.max_model_len)
        data, loss_fn = request.data, request.loss_fn
        if request.forward_only:
            return self._train_call(owner, model, request.seq_id, "forward",
                                    lambda: model.require().forward(data, loss_fn, thresholds), _render_fwdbwd)
        return self._train_call(owner, model, request.seq_id, "forward_backward",
                                lambda: model.require().forward_backward(data, loss_fn, thresholds), _render_fwdbwd)

    def optim_step(self, owner: str, body: wire.OptimStepRequest) -> dict[str, Any]:
        model = self._model(owner, body.model_id)
        if body.optimizer_params is not None:
            raise NotSupported("optimizer_params", body.optimizer_params.get("type"),
                               "rlengine's optimizer is AdamW (adam_params)")
        params = wire.adam_params(body.adam_params or body.optim_params or wire.AdamParamsWire())
        return self._train_call(owner, model, body.seq_id, "optim_step", lambda: model.require().optim_step(params),
                                _render_json, lambda r: {"metrics": r.metrics})

    def _meta(self, model: TrainingModel, kind: str, user_metadata: Any, ttl_seconds: int | None) -> dict[str, Any]:
        return {"format": _FORMAT, "kind": kind, "model_id": model.model_id, "owner": model.owner,
                "base_model": model.base_model, "model_path": self.engine.model_path,
                "lora": None if model.lora is None else msgspec.to_builtins(model.lora),
                "user_metadata": user_metadata or {}, "ttl_seconds": ttl_seconds}

    def save_weights(self, owner: str, body: wire.SaveWeightsRequest) -> dict[str, Any]:
        model = self._model(owner, body.model_id)
        path = ckpt.tinker_path(model.model_id, "weights", body.path or f"state-{model.next_seq}")
        if os.path.exists(path.directory(self.root)) and not body.overwrite:
            raise InvalidRequest("path", body.path, f"checkpoint {path.uri} exists; pass overwrite=True")
        root, meta = self.root, self._meta(model, "state", body.user_metadata, body.ttl_seconds)

        def run() -> str:
            trainer = model.require()
            staged = ckpt.staging_dir(root, path)
            trainer.save_state(staged, include_optimizer=True)
            ckpt.publish(root, path, staged, meta, body.overwrite)
            return path.uri

        return self._train_call(owner, model, body.seq_id, "save_state", run, _render_json,
                                lambda uri: {"path": uri, "type": "save_weights"})

    def save_weights_for_sampler(self, owner: str, body: wire.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        model = self._model(owner, body.model_id)
        session = self._session(owner, model.session_id)
        if body.kind not in ("snapshot", "inflight"):
            raise InvalidRequest("kind", body.kind, "must be 'snapshot' or 'inflight'")
        path = None if body.path is None else ckpt.tinker_path(model.model_id, "sampler_weights", body.path)
        if path is None and body.sampling_session_seq_id is None:
            raise InvalidRequest("sampling_session_seq_id", None, "is required when no path is given")
        if path is not None and os.path.exists(path.directory(self.root)):
            raise InvalidRequest("path", body.path, f"checkpoint {path.uri} exists")
        root, meta = self.root, self._meta(model, "sampler", body.user_metadata, body.ttl_seconds)
        taken: dict[str, Any] = {}
        if path is not None:
            model.named_snapshots.append(taken)

        def weights() -> list[tuple[str, Any]]:
            trainer = model.require()
            taken["state"] = take_snapshot(trainer)
            if path is not None:
                staged = ckpt.staging_dir(root, path)
                trainer.save_state(staged, include_optimizer=False)
                ckpt.publish(root, path, staged, meta, False)
            return snapshot_weights(trainer, taken["state"])

        def queue(run: Callable[[], Any]) -> RequestFuture[int]:
            # Runs in the model's seq_id order: the snapshot exists (its state filled
            # in by the install itself) before anything can ask for it.
            model.snapshots_taken += 1
            order = model.snapshots_taken
            key = path.uri if path is not None else f"{model.model_id}#{order}"
            snapshot = Snapshot(key, model.model_id, order,
                                self._snapshot_loader(model, taken, None if path is None else path.directory(root)),
                                path=None if path is None else path.uri)
            self.weights.add(snapshot)
            taken["key"], taken["order"] = key, order
            future = self.weights.queue_install(key, run)
            future.add_done_callback(lambda f: self.weights.discard(key) if f.exception(0) is not None else None)
            return future

        def installed(_version: int) -> dict[str, Any]:
            key, order = taken["key"], taken["order"]
            out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": key if path is not None else None}
            if body.sampling_session_seq_id is not None:
                ss = self._new_sampler(session, body.sampling_session_seq_id, model.base_model,
                                       key=None if body.kind == "inflight" else key,
                                       inflight_model=model.model_id if body.kind == "inflight" else None,
                                       floor=order, model_path=path.uri if path is not None else None)
                out["sampling_session_id"] = ss.sampling_session_id
            return out

        return self._train_call(owner, model, body.seq_id, "install", weights, _render_json, installed, submit=queue)

    def _snapshot_loader(self, model: TrainingModel, taken: dict[str, Any], directory: str | None
                         ) -> Callable[[], Any]:
        """Weights of a snapshot (compute thread): from memory while its model lives, else from disk."""
        def load() -> Any:
            # Read each once: the loop thread may drop them while this runs.
            state, trainer = taken.get("state"), model.trainer
            if not model.closed and trainer is not None and state is not None:
                return snapshot_weights(trainer, state)
            if directory is None:
                raise Gone("model_id", model.model_id, "the model was unloaded and this snapshot was not saved")
            return self._disk_weights(directory)
        return load

    def _disk_weights(self, directory: str) -> list[tuple[str, Any]]:
        """Full sampler weights of a checkpoint directory (compute thread)."""
        from rlengine.trainer.lora import merge_adapter, read_adapter, read_lora_spec

        if read_lora_spec(directory) is None:
            return ckpt.read_model_weights(directory)
        spec, adapter, base_dir = read_adapter(directory)
        return merge_adapter(ckpt.read_model_weights(base_dir), adapter, spec)

    def _base_weights(self) -> list[tuple[str, Any]]:
        if self.engine.model_path is None:
            raise NotSupported("base_model", self.engine.model_name, "the sim backend has no weights to reinstall")
        return ckpt.read_model_weights(self.engine.model_path)

    def _checkpoint(self, owner: str, field: str, uri: str) -> tuple[ckpt.CheckpointPath, str, dict[str, Any]]:
        path = ckpt.parse_path(field, uri)
        directory, meta = ckpt.read_meta(self.root, path)
        if meta.get("owner") != owner:
            raise Forbidden(field, uri, "the checkpoint belongs to a session of another API key")
        if meta.get("model_path") != self.engine.model_path:
            raise InvalidRequest(field, uri, f"was trained on {meta.get('model_path')!r}, this server serves "
                                 f"{self.engine.model_path!r}")
        return path, directory, meta

    def load_weights(self, owner: str, body: wire.LoadWeightsRequest) -> dict[str, Any]:
        if body.weights_access_token is not None:
            raise NotSupported("weights_access_token", "***", "a local server holds no other accounts' checkpoints")
        _, directory, meta = self._checkpoint(owner, "path", body.path)
        include_optimizer = body.optimizer
        done = {"path": body.path, "type": "load_weights"}
        if body.model_id is not None:
            model = self._model(owner, body.model_id)
            return self._train_call(owner, model, body.seq_id, "load_state",
                                    lambda: model.require().load_state(directory, include_optimizer), _render_json,
                                    lambda _: {**done, "model_id": model.model_id})
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("model_id", None, "give model_id (load into a model) or session_id and "
                                 "model_seq_id (create a model from the checkpoint)")
        session = self._session(owner, body.session_id)
        earlier = session.models.get(body.model_seq_id)
        if earlier is not None:
            return {"request_id": earlier}
        self._check_trainable()
        lora = None
        if meta.get("lora") is not None:
            from rlengine.trainer.lora import LoraSpec

            lora = msgspec.convert(meta["lora"], LoraSpec)
        model = self._new_model(owner, session, body.model_seq_id, body.base_model or meta["base_model"], lora,
                                body.user_metadata)
        entry = self.futures.add("create", owner, _render_json)
        session.models[body.model_seq_id] = entry.request_id
        engine = self.engine

        def run() -> Any:
            trainer = build_trainer(engine.config, engine.model_path, lora)
            trainer.load_state(directory, include_optimizer)
            return trainer

        def after(trainer: Any) -> dict[str, Any]:
            model.trainer = trainer
            return {**done, "model_id": model.model_id}

        inner = engine.submit_blocking("create_model", run, after=after)
        inner.add_done_callback(lambda f: setattr(model, "failure", f.exception(0)))
        _relay(inner, entry.future)
        return {"request_id": entry.request_id, "model_id": model.model_id}

    # -- sampling -------------------------------------------------------------------------

    def _new_sampler(self, session: Session, seq: int, base_model: str, **kwargs: Any) -> SamplingSession:
        sid = f"{session.session_id}:sample:{seq}"
        if sid in self.samplers or seq in session.samplers:
            raise InvalidRequest("sampling_session_seq_id", seq, f"sampling session {sid} already exists")
        ss = SamplingSession(sid, session.session_id, session.owner, base_model, **kwargs)
        self.samplers[sid] = ss
        session.samplers[seq] = sid
        return ss

    def _sampler(self, owner: str, sampling_session_id: str) -> SamplingSession:
        ss = self.samplers.get(sampling_session_id)
        if ss is None:
            if sampling_session_id in self._gone:
                raise Gone("sampling_session_id", sampling_session_id, self._gone[sampling_session_id])
            raise UnknownResource("sampling_session_id", sampling_session_id, "no such sampling session")
        if ss.owner != owner:
            raise Forbidden("sampling_session_id", sampling_session_id, "belongs to a session of another API key")
        return ss

    def create_sampling_session(self, owner: str, body: wire.CreateSamplingSessionRequest) -> dict[str, Any]:
        session = self._session(owner, body.session_id)
        earlier = session.samplers.get(body.sampling_session_seq_id)
        if earlier is not None:
            return {"type": "create_sampling_session", "sampling_session_id": earlier}
        if body.model_path is not None:
            path, directory, meta = self._checkpoint(owner, "model_path", body.model_path)
            key = path.uri
            try:
                self.weights.get(key)
            except Gone:
                self.weights.add(Snapshot(key, None, 0, lambda: self._disk_weights(directory), path=key))
            base_model = meta["base_model"]
        elif body.base_model is not None:
            self._check_base_model("base_model", body.base_model)
            key, base_model = BASE, body.base_model
        else:
            raise InvalidRequest("model_path", None, "give model_path or base_model")
        ss = self._new_sampler(session, body.sampling_session_seq_id, base_model, key=key,
                               model_path=body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": ss.sampling_session_id}

    def join_sampling_session(self, owner: str, body: wire.JoinSamplingSessionRequest) -> dict[str, Any]:
        ss = self._sampler(owner, body.sampling_session_id)
        ss.clients += 1
        return {"type": "join_sampling_session", "client_counter": ss.clients}

    def get_sampler(self, owner: str, sampling_session_id: str) -> dict[str, Any]:
        ss = self._sampler(owner, sampling_session_id)
        return {"sampler_id": ss.sampling_session_id, "base_model": ss.base_model, "model_path": ss.model_path}

    def asample(self, owner: str, body: wire.SampleRequest) -> dict[str, Any]:
        if body.sampling_session_id is None:
            raise NotSupported("sampling_session_id", None, "sampling without a sampling session is not supported "
                               "by rlengine (create_sampling_session first)")
        ss = self._sampler(owner, body.sampling_session_id)
        for field, value, off in (("topk_prompt_logprobs", body.topk_prompt_logprobs, 0),
                                  ("topk_sample_logprobs", body.topk_sample_logprobs, 0),
                                  ("prompt_alt_tokens_k", body.prompt_alt_tokens_k, 0),
                                  ("target_prompt_logprobs", body.target_prompt_logprobs, None),
                                  ("record_stability_info", bool(body.record_stability_info), False)):
            if value != off:
                raise NotSupported(field, value, "not supported by rlengine")
        n = body.num_samples
        prompt = wire.model_input(body.prompt, "prompt")
        want_lps = bool(body.prompt_logprobs)
        spec = self.engine.validate_sample(prompt, n, wire.sampling_params(body.sampling_params),
                                           include_prompt_logprobs=want_lps)
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and (not want_lps or not 1 <= last_n <= prompt.length - 1):
            raise InvalidRequest("prompt_logprobs_last_n", last_n, f"needs prompt_logprobs and must be in "
                                 f"[1, {prompt.length - 1}]")
        if body.seq_id is not None and body.seq_id in ss.seen:
            rid = ss.seen[body.seq_id]
            return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}
        entry = self.futures.add("sample", owner, _sample_renderer(last_n))
        call = SampleCall(self.weights, ss, spec, entry.future)
        entry.cancel = call.cancel
        if body.seq_id is not None:
            ss.remember(body.seq_id, entry.request_id)
        log = ss.log((body.seq_id or 0) // 1_000_000_000)
        rid = entry.request_id
        entry.future.add_done_callback(lambda f: log.record(rid, "failed" if f.exception(0) else "finished"))
        call.run()
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}

    # -- futures --------------------------------------------------------------------------

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
        ss = self._sampler(owner, body.target.sampling_session_id)
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
