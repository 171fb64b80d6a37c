"""The calls on a Tinker training model: forward/backward, optimizer steps, saving and loading its weights.

Each call is queued as the model's call ``seq_id`` (``TrainingModel.order``
submits them to the engine strictly in that order) and runs on the
compute thread as a blocking item of the engine's FIFO; the client gets a
request id at once and retrieves the result later (``results``).

Weights and checkpoints: ``save_weights`` publishes the training state
(weights and optimizer) under a ``tinker://<model_id>/weights/`` path;
``save_weights_for_sampler`` takes a snapshot of the weights for sampling
(kept in memory while the model lives, and on disk under
``sampler_weights/`` when named), installs it through the engine's gate
and may open a sampling session on it (``inflight``: the model's latest
weights from then on); ``load_weights`` loads a checkpoint into a model, or
creates a model from one.

A call refused at submission (bad data, an unknown loss, a checkpoint
name in use) still consumes its ``seq_id`` (``refused``): otherwise the
model's next call would wait ``hold_timeout_s`` for it.

Datums with provenance spans (tinker-cookbook 0.6.1 attaches them to every
RL datum) are checked against the sampled sequences they name
(``stability``) before anything is queued, within the model's own session;
for ``stable_reinforce`` they also bring in the recorded behaviour logprobs.

Loop thread, except the checks of a large ``forward_backward`` (spans,
behaviour logprobs, the loss's validation), which run in a worker thread so
that nothing on the loop grows with one request's data (a 2,048-datum
cookbook call held the loop ~0.2 s); the closures handed to the engine run
on the compute thread. The calls of sampling sessions live in
``sampling_calls``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rlengine.core.futures import RequestFuture
from rlengine.errors import InvalidRequest
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api import wire
from rlengine.tinker_api.errors import Gone, NotSupported, Overloaded
from rlengine.tinker_api.futures import FuturesTable
from rlengine.tinker_api.proto import FwdBwdRequest
from rlengine.tinker_api.registry import Registry
from rlengine.tinker_api.results import relay, render_forward_backward, render_json
from rlengine.tinker_api.sampling import Snapshot
from rlengine.tinker_api.stability import SequenceRecords, check_spans, named_sequences, resolve_spans
from rlengine.tinker_api.training import TrainingModel, build_trainer, snapshot_weights, take_snapshot
from rlengine.trainer.losses import LossSettings, validate_data
from rlengine.types import Datum

__all__ = ["OffLoop", "TrainingCalls"]

_FORMAT = "rlengine-tinker-1"

OffLoop = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs a function in a worker thread and awaits its result (or its exception) on the loop."""


class TrainingCalls:
    """The calls on training models, over the registry's engine and sampler weights. Loop thread only."""

    def __init__(self, registry: Registry, futures: FuturesTable, records: SequenceRecords) -> None:
        self.registry = registry
        self.futures = futures
        self.records = records
        self.engine = registry.engine
        self.weights = registry.weights
        self.root = registry.root

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
            relay(inner, entry.future, transform)

        try:
            model.order(seq_id, entry.request_id, start, entry.future.set_exception)
        except Exception as exc:
            entry.future.set_exception(exc)
            raise
        return {"request_id": entry.request_id, "model_id": model.model_id}

    def refused(self, owner: str, model_id: str | None, seq_id: int | None, error: BaseException) -> None:
        """A call on ``model_id`` was refused before it was queued (``error``): it still consumes its
        ``seq_id``, so the model's later calls do not wait for it. Not for another key's model, nor for
        a refusal the SDK retries (``Overloaded``: the retry takes the turn)."""
        model = None if model_id is None else self.registry.models.get(model_id)
        if model is None or model.owner != owner or isinstance(error, Overloaded):
            return
        model.refuse(seq_id, error)

    # -- training ---------------------------------------------------------------------------

    async def forward_backward(self, owner: str, request: FwdBwdRequest, off_loop: OffLoop | None = None
                               ) -> dict[str, Any]:
        """Check and queue a ``forward`` / ``forward_backward``. With ``off_loop`` (a large call: the
        server's), everything that grows with its data runs through it in a worker thread; only the
        record lookup (per distinct sequence) stays here.

        A refusal raised in the worker is raised here, and its ``seq_id`` is consumed by the caller
        (``refused``) as for one raised on the loop. The call takes its turn in ``_train_call``, after
        the checks: a later call whose checks finish first waits for it there (``TrainingModel.order``).
        """
        model = self.registry.model(owner, request.model_id)
        wire.check_loss_fn(request.loss_fn)
        data, loss_fn, config = request.data, request.loss_fn, request.loss_fn_config
        backend = self.engine.backend
        vocab_size, max_len = backend.vocab_size, backend.max_model_len
        named = await off_loop(lambda: named_sequences(data)) if off_loop else named_sequences(data)
        found = self.records.lookup(owner, model.session_id, named)

        def prepare() -> tuple[list[Datum], LossSettings]:
            # Any thread: reads only this request's datums and the records taken above (``stability``).
            if loss_fn == "stable_reinforce":
                ready = resolve_spans(data, found)
            else:
                check_spans(data, found)
                ready = data
            return ready, validate_data(ready, loss_fn, config, vocab_size, max_len)

        data, thresholds = await off_loop(prepare) if off_loop else prepare()
        if request.forward_only:
            return self._train_call(owner, model, request.seq_id, "forward",
                                    lambda: model.require().forward(data, loss_fn, thresholds),
                                    render_forward_backward)
        return self._train_call(owner, model, request.seq_id, "forward_backward",
                                lambda: model.require().forward_backward(data, loss_fn, thresholds),
                                render_forward_backward)

    def optim_step(self, owner: str, body: wire.OptimStepRequest) -> dict[str, Any]:
        model = self.registry.model(owner, body.model_id)
        if body.optimizer_params is not None:
            family = body.optimizer_params.get("type")
            wire.check_optimizer("optimizer_params.type", family)
            raise InvalidRequest("optimizer_params.type", family, "an AdamW step carries adam_params")
        params = wire.adam_params(body.adam_params or body.optim_params or wire.AdamParamsWire())
        return self._train_call(owner, model, body.seq_id, "optim_step", lambda: model.require().optim_step(params),
                                render_json, lambda r: {"metrics": r.metrics})

    # -- weights and checkpoints -----------------------------------------------------------

    def _meta(self, model: TrainingModel, kind: str, user_metadata: Any, ttl_seconds: int | None) -> dict[str, Any]:
        return {"format": _FORMAT, "kind": kind, "model_id": model.model_id, "owner": model.owner,
                "base_model": model.base_model, "model_path": self.engine.model_path,
                "lora": None if model.lora is None else msgspec.to_builtins(model.lora),
                "user_metadata": user_metadata or {}, "run_metadata": model.user_metadata,
                "ttl_seconds": ttl_seconds}

    def save_weights(self, owner: str, body: wire.SaveWeightsRequest) -> dict[str, Any]:
        model = self.registry.model(owner, body.model_id)
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

        return self._train_call(owner, model, body.seq_id, "save_state", run, render_json,
                                lambda uri: {"path": uri, "type": "save_weights"})

    def save_weights_for_sampler(self, owner: str, body: wire.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        model = self.registry.model(owner, body.model_id)
        session = self.registry.session(owner, model.session_id)
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
                ss = self.registry.new_sampler(session, body.sampling_session_seq_id, model.base_model,
                                               key=None if body.kind == "inflight" else key,
                                               inflight_model=model.model_id if body.kind == "inflight" else None,
                                               floor=order, model_path=path.uri if path is not None else None)
                out["sampling_session_id"] = ss.sampling_session_id
            return out

        return self._train_call(owner, model, body.seq_id, "install", weights, render_json, installed, submit=queue)

    @staticmethod
    def _snapshot_loader(model: TrainingModel, taken: dict[str, Any], directory: str | None) -> Callable[[], Any]:
        """Weights of a snapshot (compute thread): from memory while its model lives, else from disk."""
        def load() -> Any:
            # Read each once: the loop thread may drop them while this runs.
            state, trainer = taken.get("state"), model.trainer
            if not model.closed and trainer is not None and state is not None:
                return snapshot_weights(trainer, state)
            if directory is None:
                raise Gone("model_id", model.model_id, "the model was unloaded and this snapshot was not saved")
            return ckpt.read_sampler_weights(directory)
        return load

    def load_weights(self, owner: str, body: wire.LoadWeightsRequest) -> dict[str, Any]:
        if body.weights_access_token is not None:
            raise NotSupported("weights_access_token", "***", "a local server holds no other accounts' checkpoints")
        _, directory, meta = self.registry.checkpoint(owner, "path", body.path)
        include_optimizer = body.optimizer
        done = {"path": body.path, "type": "load_weights"}
        if body.model_id is not None:
            model = self.registry.model(owner, body.model_id)
            return self._train_call(owner, model, body.seq_id, "load_state",
                                    lambda: model.require().load_state(directory, include_optimizer), render_json,
                                    lambda _: {**done, "model_id": model.model_id})
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("model_id", None, "give model_id (load into a model) or session_id and "
                                 "model_seq_id (create a model from the checkpoint)")
        session = self.registry.session(owner, body.session_id)
        earlier = session.models.get(body.model_seq_id)
        if earlier is not None:
            return {"request_id": earlier}
        self.registry.check_trainable()
        if body.optimizer_config is not None:
            wire.check_optimizer("optimizer_config.type", body.optimizer_config.type)
        lora = None
        if meta.get("lora") is not None:
            from rlengine.trainer.lora import LoraSpec

            lora = msgspec.convert(meta["lora"], LoraSpec)
        model = self.registry.new_model(owner, session, body.model_seq_id, body.base_model or meta["base_model"],
                                        lora, body.user_metadata)
        entry = self.futures.add("create", owner, render_json)
        session.models[body.model_seq_id] = entry.request_id
        engine = self.engine

        def run() -> Any:
            trainer = build_trainer(engine.config, engine.model_path, lora)
            trainer.load_state(directory, include_optimizer)
            return trainer

        def after(trainer: Any) -> dict[str, Any]:
            model.trainer = trainer
            return {**done, "model_id": model.model_id}

        def start() -> None:
            inner = engine.submit_blocking("create_model", run, after=after)
            inner.add_done_callback(lambda f: setattr(model, "failure", f.exception(0)))
            relay(inner, entry.future)

        self.registry.admit(model, start, entry.future.set_exception)
        return {"request_id": entry.request_id, "model_id": model.model_id}
