"""Checkpoints of an RL run and the files a resumed run rewinds.

A checkpoint is a directory ``checkpoints/step-NNNNNN`` holding

* ``trainer/`` - ``TrainingClient.save_state`` (weights, optimizer state and
  pending gradients). It runs as a blocking item of the engine, so the
  sampler is drained while it is written: the checkpoint is quiescent.
* ``loop.json`` - the ``LoopState``: step, policy updates, the dataset
  cursor, the groups issued but not yet consumed (re-issued first on
  resume, so no group is trained twice or skipped; those already sampled,
  as the fixed-lag schedule samples ahead, are kept with their trajectories
  and fed to the resumed run as they are, so it trains what the
  uninterrupted run would have), and the global RNG
  states (Python, numpy, torch when loaded) for environments that draw from
  them, as plain JSON (numbers, and torch's state bytes in base64): nothing
  on a checkpoint path is pickled, and a resumed run restores them.

It is written as ``.step-NNNNNN.tmp-*`` and renamed into place; the file
``checkpoints/latest`` names the newest complete one and is replaced
atomically. A process killed at any point leaves either the previous
checkpoint or the new one, never a half-written one that ``latest`` names.

On resume the run's JSON-lines logs are cut back to the checkpoint's step
(``rewind_jsonl``), dropping any torn last line.

This module must not decide when to checkpoint; the training loop does.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import sys
from typing import Any

import msgspec
import numpy as np

from rlengine.rl.errors import CheckpointError
from rlengine.rl.metrics import replace_file
from rlengine.rl.types import TrajectoryGroup

__all__ = ["Checkpointer", "LoopState", "PendingGroup", "SampledGroup", "capture_rng", "restore_rng", "rewind_jsonl"]

_LATEST = "latest"
_FORMAT = "rlengine-rl-checkpoint-2"
_PICKLED_FORMAT = "rlengine-rl-checkpoint-1"
"""Format 1 held pickled RNG states; such checkpoints are refused, never unpickled."""


class PendingGroup(msgspec.Struct, array_like=True, frozen=True):
    """A group issued to the rollout workers and not yet consumed by the training loop."""

    index: int
    """Global builder index: ``batch * groups_per_batch + position``."""
    attempt: int
    """How many times it was re-issued (stale re-samples)."""


class SampledGroup(msgspec.Struct, kw_only=True, frozen=True):
    """A group sampled and not yet consumed at a checkpoint, with what it sampled."""

    index: int
    attempt: int
    version_shift: int
    """Added to its tokens' engine versions, the run's policy version (each process counts its
    engine's installs from 1)."""
    group: TrajectoryGroup


class LoopState(msgspec.Struct, kw_only=True, frozen=True):
    format: str = _FORMAT
    step: int
    """Training steps completed."""
    updates: int
    """Optimizer updates applied (a step whose groups were all dropped applies none)."""
    cursor: int
    """The next global builder index the dataloader will issue."""
    pending: list[PendingGroup]
    sampled: list[SampledGroup] = msgspec.field(default_factory=list)
    """Groups of ``pending`` already sampled (their results, fed to the resumed run)."""
    rng: dict[str, Any]
    """The global RNG states (``capture_rng``): JSON values."""
    elapsed_s: float
    """Training wall time before this checkpoint (the resumed run's clock continues from it)."""


def capture_rng() -> dict[str, Any]:
    """The global RNG states as JSON values: Python's and numpy's Mersenne Twister state
    (its numbers), torch's CPU generator state (its bytes, base64) when torch is loaded."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {"python": [version, list(internal), gauss],
                              "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global RNG states ``capture_rng`` returned; ``CheckpointError`` for a malformed one."""
    try:
        for name, value in states.items():
            if name == "python":
                version, internal, gauss = value
                random.setstate((version, tuple(internal), gauss))
            elif name == "numpy":
                kind, keys, pos, has_gauss, cached = value
                np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            elif name == "torch":
                import torch

                torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(value)), dtype=torch.uint8))
            else:
                raise ValueError(f"unknown generator {name!r}")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"loop.json: malformed RNG state: {exc}") from None


class Checkpointer:
    """Writes and finds checkpoints under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str, keep: int) -> None:
        self.root = os.path.join(run_dir, "checkpoints")
        self.keep = keep

    def staging_dir(self, step: int) -> str:
        """A fresh private directory for checkpoint ``step`` (the trainer state is saved into ``trainer/`` there)."""
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, f".step-{step:06d}.tmp-{os.getpid()}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def commit(self, staging: str, state: LoopState) -> str:
        """Finish a staged checkpoint: loop state, rename into place, point ``latest`` at it, prune."""
        replace_file(os.path.join(staging, "loop.json"), msgspec.json.encode(state))
        name = f"step-{state.step:06d}"
        final = os.path.join(self.root, name)
        if os.path.exists(final):
            # Left by a run killed after its rename but before ``latest`` moved on:
            # equal content by construction, replace it.
            shutil.rmtree(final)
        os.rename(staging, final)
        replace_file(os.path.join(self.root, _LATEST), name.encode())
        self._prune(name)
        return final

    def _prune(self, newest: str) -> None:
        done = sorted(d for d in os.listdir(self.root) if d.startswith("step-"))
        for name in done[:-self.keep]:
            if name != newest:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        for name in os.listdir(self.root):
            if name.startswith(".step-") and f".tmp-{os.getpid()}" not in name:
                # A staging directory of a killed run.
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def latest(self) -> tuple[str, LoopState] | None:
        """The newest complete checkpoint (its directory and loop state), or None."""
        pointer = os.path.join(self.root, _LATEST)
        if not os.path.isfile(pointer):
            return None
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        path = os.path.join(self.root, name)
        try:
            with open(os.path.join(path, "loop.json"), "rb") as f:
                state = msgspec.json.decode(f.read(), type=LoopState)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CheckpointError(f"checkpoint {path!r} (named by {pointer!r}) is unreadable: {exc}") from None
        if state.format == _PICKLED_FORMAT:
            raise CheckpointError(f"checkpoint {path!r}: format {state.format!r} holds pickled RNG states, which "
                                  "rlengine no longer loads (no pickle on checkpoint paths); start a new run")
        if state.format != _FORMAT:
            raise CheckpointError(f"checkpoint {path!r}: format {state.format!r}, expected {_FORMAT!r}")
        return path, state


def rewind_jsonl(path: str, last_step: int) -> int:
    """Keep the records of ``path`` with ``step <= last_step`` (and drop a torn line); returns how many remain."""
    if not os.path.isfile(path):
        return 0
    kept: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    replace_file(path, b"".join(kept))
    return len(kept)
