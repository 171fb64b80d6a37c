"""Checkpoints of the Tinker API on local disk: ``tinker://`` paths, directories, metadata, weights.

Tinker names a checkpoint ``tinker://<model_id>/weights/<name>`` (training
state: weights and optimizer) or ``tinker://<model_id>/sampler_weights/<name>``
(weights for sampling). Here each is a directory under the server's
``checkpoint_dir``: ``<checkpoint_dir>/<model_id>/<kind>/<name>/``, written by
the trainer's ``save_state`` (a LoRA adapter, or full weights that form a
loadable model directory) plus ``tinker.json`` (base model, LoRA settings,
user metadata, the requested TTL). A directory is written under a temporary
name and renamed into place, so a reader never sees half a checkpoint.

TTLs are recorded, not enforced: local checkpoints stay until deleted
(``delete``). ``copy`` publishes a checkpoint under another training run
sharing its files (hard links). ``scan`` finds every published checkpoint under the directory,
with its metadata, time and size, for the REST listings (``runs``); the
metadata also records the training run's own ``user_metadata``
(``run_metadata``), so a run is described from disk after its model is gone.
Names and ids are checked against a conservative alphabet so a path can
never leave ``checkpoint_dir``. It never touches the engine; the heavy I/O
functions run on the compute thread, ``scan`` and ``delete`` in a worker
thread.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, NamedTuple

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import UnknownResource

__all__ = [
    "META_FILE",
    "CheckpointPath",
    "StoredCheckpoint",
    "copy",
    "delete",
    "parse_path",
    "publish",
    "read_meta",
    "read_model_weights",
    "read_sampler_weights",
    "scan",
    "staging_dir",
    "tinker_path",
]

META_FILE = "tinker.json"
_KINDS = {"weights": "state", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")


class CheckpointPath(NamedTuple):
    model_id: str
    segment: str
    """``weights`` or ``sampler_weights``."""
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    def directory(self, root: str) -> str:
        return os.path.join(root, self.model_id, self.segment, self.name)


def check_name(field: str, name: str) -> str:
    # fullmatch: ``$`` also matches before a final newline, so ``match`` let "name\n" through.
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidRequest(field, name, "checkpoint names are 1-128 characters of A-Z a-z 0-9 . _ - "
                             "(starting with a letter or digit)")
    return name


def tinker_path(model_id: str, segment: str, name: str, field: str = "path") -> CheckpointPath:
    return CheckpointPath(model_id, segment, check_name(field, name))


def parse_path(field: str, uri: str) -> CheckpointPath:
    """``tinker://<model_id>/<weights|sampler_weights>/<name>`` -> its parts (checked)."""
    if not isinstance(uri, str) or not uri.startswith("tinker://"):
        raise InvalidRequest(field, uri, "must be a tinker:// checkpoint path")
    parts = uri[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in _KINDS or not _MODEL_ID.fullmatch(parts[0]):
        raise InvalidRequest(field, uri, "must look like tinker://<model_id>/weights/<name> or "
                             "tinker://<model_id>/sampler_weights/<name>")
    return CheckpointPath(parts[0], parts[1], check_name(field, parts[2]))


def staging_dir(root: str, path: CheckpointPath) -> str:
    """A fresh private directory next to where ``path`` will live (for ``publish``)."""
    parent = os.path.dirname(path.directory(root))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{path.name}-{uuid.uuid4().hex[:8]}-", dir=parent)


def publish(root: str, path: CheckpointPath, staged: str, meta: dict[str, Any], overwrite: bool) -> None:
    """Write ``meta`` into ``staged`` and rename it to ``path``'s directory (replacing it with ``overwrite``)."""
    final = path.directory(root)
    try:
        with open(os.path.join(staged, META_FILE), "w", encoding="utf-8") as f:
            json.dump({**meta, "path": path.uri}, f, indent=2, sort_keys=True)
        if os.path.exists(final):
            if not overwrite:
                raise InvalidRequest("path", path.name, f"checkpoint {path.uri} exists; pass overwrite=True to "
                                     "replace it")
            # Rename the old one aside first: the swap leaves no moment without a checkpoint.
            old = f"{final}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(staged, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staged, final)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def read_meta(root: str, path: CheckpointPath) -> tuple[str, dict[str, Any]]:
    """``(directory, metadata)`` of an existing checkpoint."""
    directory = path.directory(root)
    file = os.path.join(directory, META_FILE)
    if not os.path.isfile(file):
        raise UnknownResource("path", path.uri, "no such checkpoint on this server")
    with open(file, encoding="utf-8") as f:
        return directory, json.load(f)


class StoredCheckpoint(NamedTuple):
    """A published checkpoint found on disk (``scan``)."""

    path: CheckpointPath
    meta: dict[str, Any]
    time: float
    """When it was published (its metadata file's modification time, seconds since the epoch)."""
    size_bytes: int


def scan(root: str, model_id: str | None = None) -> list[StoredCheckpoint]:
    """Every published checkpoint under ``root`` (of ``model_id`` only, if given). A directory whose
    metadata names another path (an old copy set aside while ``publish`` replaces it) is skipped."""
    found: list[StoredCheckpoint] = []
    models = [model_id] if model_id is not None else sorted(os.listdir(root)) if os.path.isdir(root) else []
    for mid in models:
        if not _MODEL_ID.fullmatch(mid):
            continue
        for segment in _KINDS:
            parent = os.path.join(root, mid, segment)
            if not os.path.isdir(parent):
                continue
            for name in sorted(os.listdir(parent)):
                if not _NAME.fullmatch(name) or ".." in name:
                    continue
                path = CheckpointPath(mid, segment, name)
                directory = path.directory(root)
                file = os.path.join(directory, META_FILE)
                try:
                    with open(file, encoding="utf-8") as f:
                        meta = json.load(f)
                    published = os.stat(file).st_mtime
                    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory)
                               for f in files)
                except (OSError, ValueError):
                    continue  # not (or no longer) a published checkpoint
                if isinstance(meta, dict) and meta.get("path") == path.uri:
                    found.append(StoredCheckpoint(path, meta, published, size))
    return found


def copy(root: str, source: CheckpointPath, target: CheckpointPath, meta: dict[str, Any]) -> None:
    """Publish a copy of checkpoint ``source`` as ``target`` with ``meta``: its files hard-linked (the
    bytes are shared, as Tinker's copies share storage; copied where the file system cannot link),
    never its metadata file, which is the copy's own. Worker thread."""
    staged = staging_dir(root, target)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source.directory(root), staged, dirs_exist_ok=True, copy_function=link,
                    ignore=lambda _d, names: [META_FILE] if META_FILE in names else [])
    publish(root, target, staged, meta, False)


def delete(root: str, path: CheckpointPath) -> None:
    """Remove a published checkpoint: renamed aside first, so no reader sees half of it."""
    final = path.directory(root)
    aside = f"{final}.deleted-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        raise UnknownResource("path", path.uri, "no such checkpoint on this server") from None
    shutil.rmtree(aside, ignore_errors=True)


def read_model_weights(model_dir: str) -> list[tuple[str, Any]]:
    """Every tensor of a model directory's safetensors files, by name (the base weights, from disk)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise UnknownResource("base_model", model_dir, "the model directory holds no .safetensors weights")
    out: list[tuple[str, Any]] = []
    for file in files:
        out.extend(load_file(file).items())
    return out


def read_sampler_weights(directory: str) -> list[tuple[str, Any]]:
    """Full sampler weights of a checkpoint directory (compute thread)."""
    from rlengine.trainer.lora import merge_adapter, read_adapter, read_lora_spec

    if read_lora_spec(directory) is None:
        return read_model_weights(directory)
    spec, adapter, base_dir = read_adapter(directory)
    return merge_adapter(read_model_weights(base_dir), adapter, spec)
