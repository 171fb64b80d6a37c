"""The resources of a Tinker server and who owns them: sessions, training models, sampling sessions, checkpoints.

Every id the server hands out is looked up here. A ``Session`` (one
``ServiceClient``) records the models and sampling sessions it created, by
the SDK's sequence numbers, so a retried creation gets the same one back.
Ids that are gone (a finished session, an unloaded model, a dropped
sampling session) are remembered with the reason, bounded, so using one
answers ``Gone`` saying why rather than "unknown". A training run (the REST
listings, ``runs``) is its live model while there is one, owner-checked
like the rest, and otherwise lives on in its checkpoints.

Model slots: at most ``max_models`` training models are alive. A creation
that finds them all taken evicts the model of the session silent longest,
if it has been silent (no heartbeat, no call) for ``evict_after_s``: the
SDK beats every 10 s while its process lives, and scripts commonly exit
without finishing their session. Otherwise the creation waits, first come
first served, for a slot to free (an unload, a finished or silent session)
and fails with ``LimitExceeded`` after ``evict_after_s``.

Ownership: a session belongs to the API key that created it (a digest of
it, never the key), and so do its models, sampling sessions and
checkpoints (by the owner their metadata records). Another key's id
answers ``Forbidden``. Looking up a session, or one of its models, counts
as a heartbeat. Finishing a session unloads its models after the calls
already queued for them and drops its sampling sessions.

Loop thread only. This module answers no API call itself (``service`` and
its parts do) and starts no trainer work beyond releasing an unloaded
model's trainer.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from rlengine.core.engine import Engine
from rlengine.core.futures import RequestFuture
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api.config import TinkerServerConfig
from rlengine.tinker_api.errors import Forbidden, Gone, LimitExceeded, NotSupported, UnknownResource
from rlengine.tinker_api.sampling import SamplerWeights, SamplingSession
from rlengine.tinker_api.training import TrainingModel

__all__ = ["Registry", "Session"]

_GONE_KEPT = 100_000
_MAX_WAITING = 64


class _Waiting(NamedTuple):
    """A model creation waiting for a slot: how to start or fail it, and until when it waits."""

    model: TrainingModel
    start: Callable[[], None]
    fail: Callable[[BaseException], None]
    deadline: float


class Session:
    """A Tinker session (one ``ServiceClient``)."""

    __slots__ = ("display_name", "last_seen", "models", "owner", "samplers", "session_id", "user_metadata")

    def __init__(self, session_id: str, owner: str, user_metadata: dict[str, Any] | None = None,
                 display_name: str | None = None) -> None:
        self.session_id = session_id
        self.owner = owner
        self.user_metadata = user_metadata
        self.display_name = display_name
        self.last_seen = time.monotonic()
        self.models: dict[int, str] = {}
        """model_seq_id -> the request id that created it (a retried creation gets it back)."""
        self.samplers: dict[int, str] = {}
        """sampling_session_seq_id -> sampling session id."""


class Registry:
    """The resources of one server by id, with their owners; see the module docstring. Loop thread only."""

    def __init__(self, engine: Engine, config: TinkerServerConfig, root: str, weights: SamplerWeights) -> None:
        self.engine = engine
        self.config = config
        self.root = root
        """The checkpoint directory: every ``tinker://`` path of this server lives under it."""
        self.weights = weights
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        """Ids of finished sessions, unloaded models and dropped sampling sessions -> why (bounded)."""
        self._waiting: dict[str, _Waiting] = {}
        """Model creations waiting for a slot, by model id, oldest first."""

    # -- what this server serves -----------------------------------------------------------

    def _own_names(self) -> list[str]:
        cfg = self.engine.config
        names = [cfg.model, self.engine.model_name]
        if self.engine.model_path is not None:
            names.append(self.engine.model_path)
        return list(dict.fromkeys(names))

    def base_model_names(self) -> list[str]:
        """Every name of the served model: its own, then the configured aliases."""
        return list(dict.fromkeys([*self._own_names(), *self.config.model_aliases]))

    def _is_model_dir(self, name: str) -> bool:
        path = self.engine.model_path
        return path is not None and os.path.isdir(name) and os.path.realpath(name) == os.path.realpath(path)

    def check_aliases(self) -> None:
        """Each configured alias must stand for the served model."""
        for alias, target in self.config.model_aliases.items():
            if target not in self._own_names() and not self._is_model_dir(target):
                raise ConfigurationError(f"model_aliases[{alias!r}]={target!r}: this server serves "
                                         f"{self._own_names()}; an alias must name one of them")

    def check_base_model(self, field: str, name: str) -> None:
        if self._is_model_dir(name):
            return
        if name not in self.base_model_names():
            raise UnknownResource(field, name, f"this server serves {self.base_model_names()} "
                                  "(a local model directory, the engine's model name, or an alias)")

    def check_trainable(self) -> None:
        # Before anything imports the trainers (and torch): the sim backend has no model to train.
        if self.engine.model_path is None:
            raise NotSupported("backend", self.engine.backend.name,
                               "the Tinker API trains Hugging Face models; use backend 'torch' or 'vllm'")

    # -- sessions -----------------------------------------------------------------------

    def new_session(self, session_id: str, owner: str, user_metadata: dict[str, Any] | None = None,
                    display_name: str | None = None) -> Session:
        session = self.sessions[session_id] = Session(session_id, owner, user_metadata, display_name)
        return session

    def _owned(self, table: dict[str, Any], field: str, resource_id: str, owner: str, kind: str,
               others: str) -> Any:
        """``table[resource_id]`` if it belongs to ``owner``; Gone, UnknownResource or Forbidden otherwise."""
        found = table.get(resource_id)
        if found is None:
            if resource_id in self._gone:
                raise Gone(field, resource_id, self._gone[resource_id])
            raise UnknownResource(field, resource_id, f"no such {kind}")
        if found.owner != owner:
            raise Forbidden(field, resource_id, f"belongs to {others}")
        return found

    def session(self, owner: str, session_id: str) -> Session:
        session = self._owned(self.sessions, "session_id", session_id, owner, "session", "another API key")
        session.last_seen = time.monotonic()
        return session

    def finish(self, session: Session, why: str) -> None:
        self.sessions.pop(session.session_id, None)
        self._bury(session.session_id, why)
        for model_id in [m for m, w in self._waiting.items() if w.model.session_id == session.session_id]:
            self._waiting.pop(model_id).fail(Gone("session_id", session.session_id,
                                                  f"the session ended while its model waited for a slot: {why}"))
        for model in [m for m in self.models.values() if m.session_id == session.session_id]:
            self.unload(model, f"its session {session.session_id} ended: {why}")
        for sid in [s for s, ss in self.samplers.items() if ss.session_id == session.session_id]:
            del self.samplers[sid]
            self._bury(sid, f"its session ended: {why}")

    def _bury(self, resource_id: str, why: str) -> None:
        """Remember why an id is gone, so using it says so (the oldest are forgotten past a bound)."""
        self._gone[resource_id] = why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    # -- models --------------------------------------------------------------------------

    def model(self, owner: str, model_id: str) -> TrainingModel:
        model = self._owned(self.models, "model_id", model_id, owner, "model", "a session of another API key")
        model.last_request = time.time()
        session = self.sessions.get(model.session_id)
        if session is not None:
            session.last_seen = time.monotonic()
        return model

    def new_model(self, owner: str, session: Session, model_seq_id: int, base_model: str, lora: Any,
                  user_metadata: dict[str, Any] | None) -> TrainingModel:
        """The session's model ``model_seq_id``, holding no slot yet (``admit`` gives it one)."""
        model_id = self.model_slot(session, model_seq_id)
        if self.run_in_use(model_id):
            raise InvalidRequest("model_seq_id", model_seq_id, f"already used in this session (model {model_id})")
        return TrainingModel(model_id, session.session_id, owner, base_model, lora, user_metadata)

    @staticmethod
    def model_slot(session: Session, model_seq_id: int) -> str:
        """The id of the training run in ``session``'s slot ``model_seq_id`` (a model's, or a copy's)."""
        return f"{session.session_id}:train:{model_seq_id}"

    def run_in_use(self, model_id: str) -> bool:
        """Whether a model has or had ``model_id`` on this server (live, waiting for a slot, or gone)."""
        return model_id in self.models or model_id in self._gone or model_id in self._waiting

    @property
    def waiting(self) -> int:
        """Model creations waiting for a slot."""
        return len(self._waiting)

    def admit(self, model: TrainingModel, start: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Give ``model`` one of the ``max_models`` slots and ``start()`` its creation: now if one is free
        or a silent session's model can be evicted (see the module docstring), else once one frees;
        ``fail`` it with ``LimitExceeded`` if none does within ``evict_after_s``."""
        cfg = self.config
        self._admit_waiting()
        if not self._waiting and self._make_room():
            self._place(model, start, fail)
            return
        if len(self._waiting) >= _MAX_WAITING:
            fail(LimitExceeded("model_id", model.model_id, f"{len(self._waiting)} model creations already "
                               f"wait for one of max_models={cfg.max_models} slots"))
            return
        self._waiting[model.model_id] = _Waiting(model, start, fail,
                                                 time.monotonic() + cfg.evict_after_s + cfg.sweep_interval_s)

    def sweep_waiting(self) -> None:
        """Admit waiting creations as slots free; fail those whose wait is over (every slot busy)."""
        self._admit_waiting()
        now = time.monotonic()
        cfg = self.config
        for model_id in [m for m, w in self._waiting.items() if w.deadline <= now]:
            self._waiting.pop(model_id).fail(LimitExceeded(
                "model_id", model_id, f"max_models={cfg.max_models} models are alive and their sessions active "
                f"(none silent for evict_after_s={cfg.evict_after_s}); unload one (or finish its session) first"))

    def _admit_waiting(self) -> None:
        while self._waiting and self._make_room():
            waiting = self._waiting.pop(next(iter(self._waiting)))
            self._place(waiting.model, waiting.start, waiting.fail)

    def _place(self, model: TrainingModel, start: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        self.models[model.model_id] = model
        try:
            start()
        except Exception as exc:  # noqa: BLE001 - reported to the creation's own future
            model.failure = exc
            fail(exc)

    def _make_room(self) -> bool:
        """Whether a slot is free, after evicting the model of the session silent longest if it has
        been silent for ``evict_after_s`` (its client most likely exited without finishing it)."""
        cfg = self.config
        if len(self.models) < cfg.max_models:
            return True
        now = time.monotonic()

        def silent(model: TrainingModel) -> float:
            return now - self.sessions[model.session_id].last_seen

        victim = max(self.models.values(), key=silent)
        quiet = silent(victim)
        if quiet < cfg.evict_after_s:
            return False
        self.unload(victim, f"evicted: max_models={cfg.max_models} models were alive, another needed a slot, "
                            f"and its session had sent nothing for {quiet:.0f} s (evict_after_s={cfg.evict_after_s})",
                    admit=False)
        return True

    def unload(self, model: TrainingModel, why: str, admit: bool = True) -> RequestFuture[Any]:
        """Close the model; its trainer is released after the calls already queued for it, and its slot
        goes to the first creation waiting for one (``admit``)."""
        model.close(Gone("model_id", model.model_id, why))
        self.models.pop(model.model_id, None)
        self._bury(model.model_id, why)
        self.weights.drop_model(model.model_id)
        for taken in model.named_snapshots:
            # Named snapshots stay usable from disk; their in-memory copies go with the model.
            taken.pop("state", None)
        released = self.engine.submit_blocking("unload_model", lambda: setattr(model, "trainer", None))
        if admit:
            # Queued behind the release above in the engine's FIFO: the old trainer goes first.
            self._admit_waiting()
        return released

    # -- sampling sessions ----------------------------------------------------------------

    def sampler(self, owner: str, sampling_session_id: str) -> SamplingSession:
        return self._owned(self.samplers, "sampling_session_id", sampling_session_id, owner, "sampling session",
                           "a session of another API key")

    def new_sampler(self, session: Session, seq: int, base_model: str, **kwargs: Any) -> SamplingSession:
        sid = f"{session.session_id}:sample:{seq}"
        if sid in self.samplers or seq in session.samplers:
            raise InvalidRequest("sampling_session_seq_id", seq, f"sampling session {sid} already exists")
        ss = SamplingSession(sid, session.session_id, session.owner, base_model, **kwargs)
        self.samplers[sid] = ss
        session.samplers[seq] = sid
        return ss

    # -- training runs ----------------------------------------------------------------------

    def live_run(self, owner: str, model_id: str) -> TrainingModel | None:
        """The live model of training run ``model_id`` if there is one (``Forbidden`` if it is another
        key's); None for a run that may live on only on disk. Not a call on the model: no heartbeat."""
        model = self.models.get(model_id)
        if model is not None and model.owner != owner:
            raise Forbidden("training_run_id", model_id, "belongs to a session of another API key")
        return model

    def no_run(self, model_id: str) -> Exception:
        """Why training run ``model_id`` cannot be described: ``Gone`` (why) or ``UnknownResource``."""
        if model_id in self._gone:
            return Gone("training_run_id", model_id, f"{self._gone[model_id]}, and no checkpoint of it remains")
        return UnknownResource("training_run_id", model_id, "no such training run on this server")

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint(self, owner: str, field: str, uri: str) -> tuple[ckpt.CheckpointPath, str, dict[str, Any]]:
        path = ckpt.parse_path(field, uri)
        directory, meta = ckpt.read_meta(self.root, path)
        if meta.get("owner") != owner:
            raise Forbidden(field, uri, "the checkpoint belongs to a session of another API key")
        if meta.get("model_path") != self.engine.model_path:
            raise InvalidRequest(field, uri, f"was trained on {meta.get('model_path')!r}, this server serves "
                                 f"{self.engine.model_path!r}")
        return path, directory, meta
