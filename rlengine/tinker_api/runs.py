"""The REST calls on training runs and their checkpoints: list and describe runs, list and delete checkpoints.

These are what the SDK's ``RestClient`` asks (``list_training_runs``,
``get_training_run``, ``get_training_run_by_tinker_path``,
``list_checkpoints``, ``list_user_checkpoints``, ``delete_checkpoint``) and
what the cookbook uses on resume: it reads a run's ``user_metadata`` (its
renderer) by a checkpoint's path, and deletes its rolling checkpoints.

A training run is a training model (the run's id is the model's) with the
checkpoints it saved. A live model is described from the registry; a run
whose model is gone (unloaded, its session finished, or the server
restarted) from its checkpoints' metadata, which records the run's base
model, LoRA settings and ``user_metadata``. A gone model that saved nothing
is not listed, and describing it answers ``Gone``. A run's
``last_request_time`` is its model's last call, or once gone its newest
checkpoint's time.

Owner-scoped like every call: a key lists only the runs and checkpoints of
its own sessions, and another key's run or checkpoint answers ``Forbidden``.
Runs are listed most recent first, checkpoints newest first, both paged by
``limit`` and ``offset``. ``access_scope`` ``owned`` and ``accessible`` are
the same here (a local server shares nothing with other accounts); a
``project_id`` filter is not supported (rlengine has no projects). A deleted
checkpoint is gone from disk; a sampling session already open on it keeps
its weights while they are installed.

Also the calls on one checkpoint by path: ``weights_info`` (what loading it
needs: base model and LoRA settings) and ``copy_weights``: a copy of a
checkpoint under a new training run, which shares its files (hard links,
as Tinker's copies share storage), keeps its kind and name, and is never
a live model (it cannot be trained on; ``load_weights`` reads it like any
checkpoint). The copy's run is the destination session's ``model_seq_id``
slot, or a fresh ``copy-...`` id for a ``destination_project_id`` (rlengine
has no projects: the id is recorded, and the copy is the caller's). A retry
of a copy into the same slot answers the same path.

Disk scans, copies and deletions run in a worker thread; the rest on the
loop thread. Nothing here touches the engine.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

from rlengine.errors import InvalidRequest
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api import wire
from rlengine.tinker_api.errors import Forbidden, NotSupported, UnknownResource
from rlengine.tinker_api.registry import Registry
from rlengine.tinker_api.training import TrainingModel

__all__ = ["TrainingRuns", "check_access_scope", "check_page"]

_CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}
_ACCESS_SCOPES = ("owned", "accessible")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _checkpoint(stored: ckpt.StoredCheckpoint) -> dict[str, Any]:
    """A Tinker ``Checkpoint``. TTLs are not enforced here, so none expires (``expires_at`` None)."""
    path = stored.path
    return {"checkpoint_id": f"{path.segment}/{path.name}", "checkpoint_type": _CHECKPOINT_TYPES[path.segment],
            "time": _iso(stored.time), "tinker_path": path.uri, "size_bytes": stored.size_bytes, "public": False,
            "user_metadata": stored.meta.get("user_metadata") or None, "expires_at": None}


def _newest_first(stored: list[ckpt.StoredCheckpoint]) -> list[ckpt.StoredCheckpoint]:
    return sorted(stored, key=lambda c: (c.time, c.path.uri), reverse=True)


def check_page(field: str, limit: int, offset: int) -> None:
    """A page's ``limit`` and ``offset``, each >= 0."""
    for name, value in ((f"{field}.limit", limit), (f"{field}.offset", offset)):
        if value < 0:
            raise InvalidRequest(name, value, "must be >= 0")


def check_access_scope(access_scope: str) -> None:
    if access_scope not in _ACCESS_SCOPES:
        raise InvalidRequest("access_scope", access_scope, f"must be one of {', '.join(_ACCESS_SCOPES)}")


class TrainingRuns:
    """The training-run and checkpoint listings of one server; see the module docstring."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.root = registry.root

    async def _stored(self, model_id: str | None = None) -> list[ckpt.StoredCheckpoint]:
        return await asyncio.to_thread(ckpt.scan, self.root, model_id)

    def _run(self, model_id: str, live: TrainingModel | None,
             stored: list[ckpt.StoredCheckpoint]) -> tuple[float, dict[str, Any]]:
        """``(last request time, Tinker TrainingRun)`` of a run: its live model, else its newest checkpoint."""
        newest = _newest_first(stored)
        last = {kind: next((_checkpoint(c) for c in newest if c.path.segment == segment), None)
                for segment, kind in _CHECKPOINT_TYPES.items()}
        if live is not None:
            when, owner, base_model, rank = live.last_request, live.owner, live.base_model, live.rank
            metadata, corrupted = live.user_metadata, live.failure is not None
        else:
            meta = newest[0].meta
            lora = meta.get("lora") or {}
            when, owner, base_model, rank = newest[0].time, meta.get("owner"), meta.get("base_model"), \
                int(lora.get("rank", 0))
            metadata, corrupted = meta.get("run_metadata") or {}, False
        return when, {"training_run_id": model_id, "base_model": base_model, "model_owner": owner,
                      "is_lora": rank > 0, "corrupted": corrupted, "lora_rank": rank or None,
                      "last_request_time": _iso(when), "last_checkpoint": last["training"],
                      "last_sampler_checkpoint": last["sampler"], "user_metadata": metadata or None}

    async def _resolve(self, owner: str, model_id: str) -> tuple[TrainingModel | None, list[ckpt.StoredCheckpoint]]:
        """A run's live model and checkpoints: ``Forbidden`` if another key's, ``Gone`` / ``UnknownResource``
        if there is neither."""
        stored = await self._stored(model_id)
        live = self.registry.live_run(owner, model_id)  # after the scan: the registry as it is now
        if any(c.meta.get("owner") != owner for c in stored):
            raise Forbidden("training_run_id", model_id, "belongs to a session of another API key")
        if live is None and not stored:
            raise self.registry.no_run(model_id)
        return live, stored

    async def list_training_runs(self, owner: str, limit: int, offset: int, access_scope: str,
                                 project_id: str | None) -> dict[str, Any]:
        check_page("training_runs", limit, offset)
        check_access_scope(access_scope)
        if project_id is not None:
            raise NotSupported("project_id", project_id, "rlengine has no projects to filter training runs by")
        by_run: dict[str, list[ckpt.StoredCheckpoint]] = defaultdict(list)
        for stored in await self._stored():
            if stored.meta.get("owner") == owner:
                by_run[stored.path.model_id].append(stored)
        live = {m.model_id: m for m in self.registry.models.values() if m.owner == owner}
        runs = sorted((self._run(mid, live.get(mid), by_run.get(mid, [])) for mid in set(live) | set(by_run)),
                      key=lambda r: (r[0], r[1]["training_run_id"]), reverse=True)
        return {"training_runs": [run for _, run in runs[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    async def get_training_run(self, owner: str, model_id: str, access_scope: str) -> dict[str, Any]:
        check_access_scope(access_scope)
        live, stored = await self._resolve(owner, model_id)
        return self._run(model_id, live, stored)[1]

    async def list_checkpoints(self, owner: str, model_id: str) -> dict[str, Any]:
        _, stored = await self._resolve(owner, model_id)
        return {"checkpoints": [_checkpoint(c) for c in _newest_first(stored)], "cursor": None}

    async def list_user_checkpoints(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        check_page("checkpoints", limit, offset)
        mine = _newest_first([c for c in await self._stored() if c.meta.get("owner") == owner])
        return {"checkpoints": [_checkpoint(c) for c in mine[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)}}

    async def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        """Delete ``tinker://<model_id>/<checkpoint_id>`` (``checkpoint_id``: ``weights/<name>`` or
        ``sampler_weights/<name>``)."""
        path = ckpt.parse_path("checkpoint_id", f"tinker://{model_id}/{checkpoint_id}")
        _, meta = await asyncio.to_thread(ckpt.read_meta, self.root, path)
        if meta.get("owner") != owner:
            raise Forbidden("checkpoint_id", path.uri, "the checkpoint belongs to a session of another API key")
        await asyncio.to_thread(ckpt.delete, self.root, path)

    # -- one checkpoint by path ---------------------------------------------------------------

    def weights_info(self, owner: str, body: wire.WeightsInfoRequest) -> dict[str, Any]:
        """What loading ``tinker_path`` needs: its base model and LoRA settings (Tinker's ``WeightsInfoResponse``)."""
        _, _, meta = self.registry.checkpoint(owner, "tinker_path", body.tinker_path)
        lora = meta.get("lora")
        if lora is None:
            return {"base_model": meta["base_model"], "is_lora": False}
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                **{key: lora.get(key) for key in ("train_unembed", "train_mlp", "train_attn")}}

    async def copy_weights(self, owner: str, body: wire.CopyWeightsRequest) -> dict[str, Any]:
        """A copy of ``source_path`` under a new training run (module docstring); answers its path."""
        if body.weights_access_token is not None:
            raise NotSupported("weights_access_token", "***", "a local server holds no other accounts' checkpoints")
        source, _, meta = self.registry.checkpoint(owner, "source_path", body.source_path)
        if body.session_id is not None:
            if body.model_seq_id is None:
                raise InvalidRequest("model_seq_id", None, "is required with session_id")
            run_id = self.registry.model_slot(self.registry.session(owner, body.session_id), body.model_seq_id)
        elif body.destination_project_id is not None:
            run_id = f"copy-{secrets.token_hex(8)}"
        else:
            raise InvalidRequest("destination_project_id", None, "give destination_project_id, or session_id and "
                                 "model_seq_id")
        target = ckpt.CheckpointPath(run_id, source.segment, source.name)
        if self.registry.run_in_use(run_id) or os.path.isdir(os.path.join(self.root, run_id)):
            try:
                _, earlier = await asyncio.to_thread(ckpt.read_meta, self.root, target)
            except UnknownResource:
                earlier = {}
            if earlier.get("owner") == owner and earlier.get("copied_from") == source.uri:
                return {"tinker_path": target.uri}  # a retried copy
            raise InvalidRequest("model_seq_id", body.model_seq_id, f"training run {run_id} already exists")
        copied = {**meta, "model_id": run_id, "owner": owner, "copied_from": source.uri,
                  "ttl_seconds": body.ttl_seconds, "project_id": body.destination_project_id}
        await asyncio.to_thread(ckpt.copy, self.root, source, target, copied)
        return {"tinker_path": target.uri}
