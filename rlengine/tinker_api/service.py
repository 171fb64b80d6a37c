"""``TinkerService``: the Tinker API's semantics over one ``Engine`` (everything but HTTP).

It turns each API call into engine work: training calls become blocking
items of the engine's FIFO, in each model's ``seq_id`` order
(``training``); samples go to the engine's sampler, pinned to the right
weights (``sampling``). A call that returns a future registers a
``RequestFuture`` in the futures table and answers ``{"request_id": ...}``
at once; the engine settles it later.

The service is assembled from parts, one role each, sharing its registry
(``registry``: the sessions, training models, sampling sessions and
checkpoints, and which API key owns each) and its futures table:
``TrainingCalls`` (``training_calls``: forward/backward, optimizer steps,
saving and loading weights), ``SamplingCalls`` (``sampling_calls``:
sampling sessions and ``asample``), ``Results`` (``results``: retrieving
and cancelling futures) and ``TrainingRuns`` (``runs``: the REST listings
of training runs and checkpoints, and deleting checkpoints). This module
holds the rest: the lifecycle, discovery and client configuration,
sessions (creating, describing and listing them), and creating,
describing and unloading models; the HTTP layer routes every other call
to its part (``service.training``, ``service.sampling``,
``service.results``, ``service.runs``).

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
from typing import Any

from rlengine.core.engine import Engine
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api import wire
from rlengine.tinker_api.config import TinkerServerConfig
from rlengine.tinker_api.errors import NotSupported
from rlengine.tinker_api.futures import FuturesTable
from rlengine.tinker_api.registry import Registry
from rlengine.tinker_api.results import Results, relay, render_json
from rlengine.tinker_api.runs import TrainingRuns, check_access_scope, check_page
from rlengine.tinker_api.sampling import SamplerWeights
from rlengine.tinker_api.sampling_calls import SamplingCalls
from rlengine.tinker_api.stability import SequenceRecords
from rlengine.tinker_api.training import build_trainer
from rlengine.tinker_api.training_calls import TrainingCalls

__all__ = ["TinkerService"]


class TinkerService:
    """The Tinker API over one engine; see the module docstring. Loop thread only."""

    def __init__(self, engine: Engine, config: TinkerServerConfig) -> None:
        from rlengine.backends.torch.models import cache_root

        self.engine = engine
        self.config = config
        self.root = os.path.abspath(config.checkpoint_dir or os.path.join(cache_root(engine.config),
                                                                          "tinker-checkpoints"))
        self.futures = FuturesTable(max_entries=config.max_futures, ttl_s=config.future_ttl_s)
        self.weights = SamplerWeights(engine, config.sampler_snapshots_kept, self._base_weights)
        self.registry = Registry(engine, config, self.root, self.weights)
        self.registry.check_aliases()
        # The sampled sequences training datums name (provenance), shared by both parts.
        self.records = SequenceRecords(config.max_recorded_sequences, config.max_recorded_bytes,
                                       config.recorded_ttl_s)
        self.training = TrainingCalls(self.registry, self.futures, self.records)
        self.sampling = SamplingCalls(self.registry, self.futures, self.records)
        self.results = Results(self.registry, self.futures)
        self.runs = TrainingRuns(self.registry)
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
            for session in list(self.registry.sessions.values()):
                if now - session.last_seen > self.config.session_ttl_s:
                    self.registry.finish(session, f"no heartbeat for session_ttl_s={self.config.session_ttl_s}")
            self.registry.sweep_waiting()
            for model in list(self.registry.models.values()):
                model.expire_held(self.config.hold_timeout_s)
        finally:
            self._schedule_sweep()

    def _base_weights(self) -> list[tuple[str, Any]]:
        if self.engine.model_path is None:
            raise NotSupported("base_model", self.engine.model_name, "the sim backend has no weights to reinstall")
        return ckpt.read_model_weights(self.engine.model_path)

    # -- configuration and discovery ------------------------------------------------------

    def _architecture(self) -> str | None:
        path = self.engine.model_path
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            return None
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or [None]
        return archs[0]

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
                                      "sampleable": True} for name in self.registry.base_model_names()]}

    # -- sessions -----------------------------------------------------------------------

    def create_session(self, owner: str, body: wire.CreateSessionRequest) -> dict[str, Any]:
        session_id = self.futures.new_id("session")
        self.registry.new_session(session_id, owner, body.user_metadata, body.display_name)
        return {"type": "create_session", "session_id": session_id}

    def get_session(self, owner: str, session_id: str, access_scope: str) -> dict[str, Any]:
        """A live session's training runs (its models, by slot) and sampling sessions (Tinker's
        ``GetSessionResponse``); ``access_scope`` ``owned`` and ``accessible`` are the same here."""
        check_access_scope(access_scope)
        session = self.registry.session(owner, session_id)
        return {"training_run_ids": [self.registry.model_slot(session, seq) for seq in session.models],
                "sampler_ids": list(session.samplers.values()), "user_metadata": session.user_metadata,
                "display_name": session.display_name}

    def list_sessions(self, owner: str, limit: int, offset: int, access_scope: str) -> dict[str, Any]:
        """The caller's live sessions, newest first, paged (Tinker's ``ListSessionsResponse``)."""
        check_page("sessions", limit, offset)
        check_access_scope(access_scope)
        mine = [sid for sid, s in reversed(self.registry.sessions.items()) if s.owner == owner]
        return {"sessions": mine[offset:offset + limit]}

    def heartbeat(self, owner: str, body: wire.SessionHeartbeatRequest) -> dict[str, Any]:
        self.registry.session(owner, body.session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, owner: str, session_id: str) -> None:
        self.registry.finish(self.registry.session(owner, session_id), "the session was finished by its client")

    # -- models --------------------------------------------------------------------------

    @staticmethod
    def _lora_spec(wire_lora: wire.LoraConfigWire | None) -> Any:
        if wire_lora is None or wire_lora.rank == 0:
            return None
        from rlengine.trainer.lora import LoraSpec

        return LoraSpec(rank=wire_lora.rank, seed=wire_lora.seed, train_attn=wire_lora.train_attn,
                        train_mlp=wire_lora.train_mlp, train_unembed=wire_lora.train_unembed)

    def create_model(self, owner: str, body: wire.CreateModelRequest) -> dict[str, Any]:
        session = self.registry.session(owner, body.session_id)
        earlier = session.models.get(body.model_seq_id)
        if earlier is not None:
            return {"request_id": earlier}
        self.registry.check_trainable()
        self.registry.check_base_model("base_model", body.base_model)
        if body.optimizer_config is not None:
            wire.check_optimizer("optimizer_config.type", body.optimizer_config.type)
        lora = self._lora_spec(body.lora_config)
        model = self.registry.new_model(owner, session, body.model_seq_id, body.base_model, lora, body.user_metadata)
        entry = self.futures.add("create", owner, render_json)
        session.models[body.model_seq_id] = entry.request_id
        engine = self.engine

        def after(trainer: Any) -> dict[str, Any]:
            model.trainer = trainer
            return {"model_id": model.model_id, "type": "create_model"}

        def start() -> None:
            inner = engine.submit_blocking("create_model",
                                           lambda: build_trainer(engine.config, engine.model_path, lora), after=after)
            inner.add_done_callback(lambda f: setattr(model, "failure", f.exception(0)))
            relay(inner, entry.future)

        self.registry.admit(model, start, entry.future.set_exception)
        return {"request_id": entry.request_id, "model_id": model.model_id}

    def get_info(self, owner: str, body: wire.GetInfoRequest) -> dict[str, Any]:
        model = self.registry.model(owner, body.model_id)
        return {"type": "get_info", "model_id": model.model_id, "model_name": model.base_model,
                "is_lora": model.lora is not None, "lora_rank": model.rank,
                "model_data": {"arch": self.arch, "model_name": model.base_model,
                               "tokenizer_id": self.engine.model_path}}

    def unload_model(self, owner: str, body: wire.UnloadModelRequest) -> dict[str, Any]:
        model = self.registry.model(owner, body.model_id)
        entry = self.futures.add("unload", owner, render_json)
        relay(self.registry.unload(model, "it was unloaded by its client"), entry.future,
              lambda _: {"model_id": model.model_id, "type": "unload_model"})
        return {"request_id": entry.request_id, "model_id": model.model_id}
