"""A distillation teacher: a second model slot in the student's process, loop and compute thread.

``TeacherSlot`` holds one teacher, sampling only: it is never trained, so no
trainer and no optimizer state are ever built for it. It is a second
``Engine`` started on the student engine's running loop with
``share_compute=student`` (``rlengine.core.engine``): its backend is built on,
and every one of its forwards runs on, the student's compute thread, so the
two models never compute at once (on two cores they would only slow each
other down) and the teacher's work queues in FIFO order with the student's
sampling and training. Why a whole ``Engine`` rather than a lighter model
object: the teacher then gets the engine's validated submission path, its
continuous batching, prompt logprobs exactly as ``SamplingClient.compute_logprobs``
computes them, its bounded close, every backend (torch, vLLM) and model form
(``tiny``, a directory, a GGUF file) the student has, at the cost of one
more sampler task on the loop; the one seam it needs in the core is the
shared compute thread.

``resolve_teacher`` turns what the user gave into a model to load:

* a model directory, a ``.gguf`` file, ``tiny`` or a hub id in the local cache:
  as ``EngineConfig.model`` takes them;
* a run directory of ``rlengine train``: its newest checkpoint's ``trainer/``
  (a checkpoint's trainer state is a loadable model directory); a checkpoint
  directory (``checkpoints/step-NNNNNN``): its ``trainer/``;
* a Tinker path ``tinker://<model_id>/sampler_weights/<name>`` (or
  ``/weights/``) as the local Tinker server writes them under its
  ``checkpoint_dir``: full weights are a model directory; a LoRA adapter is
  its base model with the merged weights installed once the slot starts.

Memory is accounted (``stats``): the parameters' bytes, measured once on the
compute thread, and the KV cache's as last seen. Sleeping while the student
trains is not applicable to the backends here: the torch backend cannot sleep
(it frees its KV cache whenever no request runs; its weights stay resident),
and an engine's sampler sleeps only around its own blocking work, so a
teacher on vLLM stays awake between its scorings.

This module must not import torch; it computes no advantages
(``rlengine.rl.distill`` does).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from typing import Any, NamedTuple

import msgspec

from rlengine.config import Placement
from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.rl.checkpoint import Checkpointer
from rlengine.rl.supervisor import awaited
from rlengine.types import ModelInput, SamplingParams

__all__ = ["TeacherSlot", "TeacherSource", "resolve_teacher"]


class TeacherSource(NamedTuple):
    """A teacher to load: ``model`` as ``EngineConfig.model`` takes it, and (a Tinker LoRA
    checkpoint) the directory whose merged weights are installed over it."""

    given: str
    model: str
    weights: str | None = None


def resolve_teacher(spec: str, *, field: str = "teacher", tinker_checkpoint_dir: str | None = None,
                    cache_dir: str | None = None) -> TeacherSource:
    """``spec`` (module docstring) as a ``TeacherSource``; a ``ConfigurationError`` naming ``field``
    and the value when it is none of the forms."""
    if not isinstance(spec, str) or not spec:
        raise ConfigurationError(f"{field}={spec!r}: must name a model directory, a .gguf file, a run or "
                                 "checkpoint directory of rlengine train, or a tinker:// path")
    if spec.startswith("tinker://"):
        return _tinker_source(spec, field, tinker_checkpoint_dir, cache_dir)
    if os.path.isdir(spec):
        checkpoints = os.path.join(spec, "checkpoints")
        if os.path.isdir(checkpoints):  # a run directory (its config.json is the run's, no model's)
            latest = Checkpointer(spec, 1).latest()
            if latest is None:
                raise ConfigurationError(f"{field}={spec!r}: the run holds no complete checkpoint yet "
                                         "(checkpoint_every=K writes one every K steps)")
            return TeacherSource(spec, _weights_only(_trainer_dir(latest[0], field, spec), cache_dir))
        if os.path.isfile(os.path.join(spec, "loop.json")):
            return TeacherSource(spec, _weights_only(_trainer_dir(spec, field, spec), cache_dir))
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ConfigurationError(f"{field}={spec!r}: the directory is no model directory (no config.json), "
                                     "no run of rlengine train (no checkpoints/) and no checkpoint (no loop.json)")
        return TeacherSource(spec, _weights_only(os.path.abspath(spec), cache_dir))
    if spec.lower().endswith(".gguf") and not os.path.isfile(spec):
        raise ConfigurationError(f"{field}={spec!r}: no such GGUF file")
    return TeacherSource(spec, spec)


def _trainer_dir(checkpoint: str, field: str, spec: str) -> str:
    trainer = os.path.join(checkpoint, "trainer")
    if not os.path.isfile(os.path.join(trainer, "config.json")):
        raise ConfigurationError(f"{field}={spec!r}: checkpoint {checkpoint} holds no full model weights "
                                 f"({trainer}/config.json is missing: a LoRA run's checkpoint holds only its "
                                 "adapter)")
    return trainer


_OPTIMIZER_FILE = "optimizer.safetensors"
"""What a trainer's saved state holds beside its weights (``TrainingClient.save_state``)."""


def _weights_only(directory: str, cache_dir: str | None) -> str:
    """``directory``, or where it holds a trainer's optimizer state too (a checkpoint's ``trainer/``), a
    directory of links to all its other files: vLLM loads every ``.safetensors`` file it finds."""
    if not os.path.isfile(os.path.join(directory, _OPTIMIZER_FILE)):
        return directory
    from rlengine.backends.torch.models import cache_root

    root = cache_root(None) if cache_dir is None else os.path.abspath(cache_dir)
    stamp = os.stat(os.path.join(directory, "config.json")).st_mtime_ns
    key = hashlib.sha256(f"{directory}\0{stamp}".encode()).hexdigest()[:16]
    target = os.path.join(root, "teachers", key)
    if not os.path.isdir(target):
        staging = f"{target}.tmp-{os.getpid()}"
        os.makedirs(staging, exist_ok=True)
        for name in os.listdir(directory):
            if name != _OPTIMIZER_FILE and not os.path.exists(os.path.join(staging, name)):
                os.symlink(os.path.join(directory, name), os.path.join(staging, name))
        try:
            os.rename(staging, target)
        except OSError:  # another process made it first: theirs is the same
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _tinker_source(spec: str, field: str, root: str | None, cache_dir: str | None) -> TeacherSource:
    from rlengine.backends.torch.models import cache_root
    from rlengine.tinker_api.checkpoints import META_FILE, parse_path

    try:
        path = parse_path(field, spec)
    except InvalidRequest as exc:
        raise ConfigurationError(str(exc)) from None
    base = os.path.abspath(root) if root else os.path.join(cache_root(None) if cache_dir is None
                                                           else os.path.abspath(cache_dir), "tinker-checkpoints")
    directory = path.directory(base)
    meta_file = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_file):
        raise ConfigurationError(f"{field}={spec!r}: no such checkpoint under {base} (the local Tinker server's "
                                 "checkpoint_dir; set tinker_checkpoint_dir= to another)")
    if os.path.isfile(os.path.join(directory, "config.json")):
        return TeacherSource(spec, directory)
    with open(meta_file, encoding="utf-8") as f:
        base_model = json.load(f).get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise ConfigurationError(f"{field}={spec!r}: {meta_file} names no base_model for its LoRA adapter")
    return TeacherSource(spec, base_model, weights=directory)


class TeacherSlot:
    """One teacher engine beside a running student engine; see the module docstring.

    Start it with ``await slot.start(student)`` on the student's loop, close it with
    ``await slot.close()`` before the student closes (it runs on the student's compute thread)."""

    def __init__(self, name: str, source: TeacherSource) -> None:
        self.name = name
        self.source = source
        self.engine: Engine | None = None
        self.param_bytes = 0
        self.kv_bytes_max = 0
        self.reward: float | None = None
        """Its mean reward where measured (``rlengine.rl.distill`` evaluates it before training)."""

    async def start(self, student: Engine, call_timeout_s: float) -> None:
        """Build the teacher on ``student``'s compute thread, on the running loop, and check that it reads
        the student's token ids as the student does (same vocabulary)."""
        base = student.config
        # The student's settings (backend, dtype, device, seed, batch invariance), its own model, one
        # local sampler, no training lane: nothing here trains.
        config = msgspec.structs.replace(base, model=self.source.model, model_name=self.name,
                                         train_concurrently="off", placement=Placement(),
                                         model_args=base.model_args if self.source.model == "tiny" else {})
        engine = Engine(config, share_compute=student)
        try:
            await engine.start_async()
        except ConfigurationError as exc:
            raise ConfigurationError(f"teacher {self.name!r} ({self.source.given}): {exc}") from None
        self.engine = engine
        try:
            self._check_vocabulary(student)
            if self.source.weights is not None:
                from rlengine.tinker_api.checkpoints import read_sampler_weights

                directory = self.source.weights
                await _bounded(engine.install_weights(lambda: read_sampler_weights(directory)), call_timeout_s)
            backend = engine.backend
            self.param_bytes = int(await _bounded(engine.submit_blocking("teacher_memory", lambda: _param_bytes(
                backend)), call_timeout_s))
        except BaseException:
            await self.close()
            raise

    def _check_vocabulary(self, student: Engine) -> None:
        assert self.engine is not None
        mine, theirs = self.engine.tokenizer, student.tokenizer
        if mine is not None and theirs is not None:
            same = mine.get_vocab() == theirs.get_vocab()
        else:
            same = self.engine.backend.vocab_size == student.backend.vocab_size
        if not same:
            raise ConfigurationError(f"teacher {self.name!r} ({self.source.given}): its tokenizer differs from the "
                                     "student's; the teacher scores the student's exact token ids, so both must "
                                     "share one vocabulary")

    def sampling_client(self) -> Any:
        if self.engine is None:
            raise ConfigurationError(f"teacher {self.name!r}: not started")
        return self.engine.sampling_client()

    async def logprobs(self, tokens: ModelInput) -> list[float | None]:
        """The teacher's logprob of each token of ``tokens`` given those before it (the first None)."""
        if self.engine is None:
            raise ConfigurationError(f"teacher {self.name!r}: not started")
        future = self.engine.sample(tokens, 1, _SCORE_PARAMS, include_prompt_logprobs=True)
        try:
            response = await future
        finally:
            self.kv_bytes_max = max(self.kv_bytes_max, int(self.engine.backend.describe().get("kv_cache_bytes", 0)))
        return response.prompt_logprobs or [None]

    def stats(self) -> dict[str, Any]:
        """Its memory (parameters, and the KV cache's peak as seen after each scoring) and compute time."""
        busy = self.engine.stats().get("busy_s", 0.0) if self.engine is not None else 0.0
        return {"param_bytes": self.param_bytes, "kv_bytes_max": self.kv_bytes_max,
                "bytes": self.param_bytes + self.kv_bytes_max, "busy_s": float(busy or 0.0)}

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.aclose()


_SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0)
"""Scoring samples one token nobody reads: the prompt logprobs are what it is for."""


def _param_bytes(backend: Any) -> int:
    """Compute thread: the bytes of the backend's model parameters (0 where it holds no torch model)."""
    model = getattr(backend, "model", None)
    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return 0
    return sum(p.numel() * p.element_size() for p in parameters())


async def _bounded(future: Any, timeout: float) -> Any:
    return await asyncio.wait_for(awaited(future), timeout)
