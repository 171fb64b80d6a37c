"""Rollout dumps: what ``dump_rollouts`` writes per step and ``train_from`` reads back.

A dump directory holds

* ``meta.json`` - the format version, the recipe, its options and the
  run's ``TrainConfig`` (so a ``train_from`` run builds the same model from
  the same seed);
* ``step-000001.msgpack``, one per step - a ``StepDump`` in msgspec
  msgpack: exactly the datums the step's ``forward_backward`` calls
  received, and the calls themselves in the order they were submitted
  (``forward_backward`` with the indices of its datums, its loss and loss
  config; ``optim_step`` with its ``AdamParams``), so a replay submits
  byte-identical calls; beside each datum its group, trajectory and
  segment, its loss mask and the policy version of each sampled token; the
  trained groups (index, attempt, rewards, advantages and, in a multi-agent
  group, each trained trajectory's role); and what the step's
  metrics line needs of the rollouts (rewards, group counts, staleness,
  the environments' metrics).

Arrays are ``TensorData`` (raw little-endian bytes, a dtype and a shape);
nothing is pickled. Every file is written atomically (``replace_file``), so
a killed run leaves whole step files only. A file that cannot be decoded,
or of another format version, is refused with ``RolloutDumpError`` naming
it.

Values and files only; this module must not train, sample or import torch.
"""

from __future__ import annotations

import os
import re
from typing import Any

import msgspec

from rlengine.errors import ConfigurationError
from rlengine.rl.errors import RolloutDumpError
from rlengine.rl.metrics import replace_file
from rlengine.types import AdamParams, Datum, TensorData

__all__ = ["FORMAT_VERSION", "META_FILE", "DumpedDatum", "DumpedGroup", "ForwardBackwardCall", "OptimStepCall",
           "StepDump", "read_meta", "read_step", "start_dump", "step_files", "step_path", "write_step"]

FORMAT_VERSION = 1
META_FILE = "meta.json"
_STEP_NAME = re.compile(r"step-(\d{6,})\.msgpack")


class DumpedDatum(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One datum as submitted, with where it came from and which tokens it trains."""

    group: int
    """The group's index in the dataset order."""
    trajectory: int
    """The attempt's index within its group."""
    segment: int
    """The datum's index among its trajectory's datums (a rewritten context starts a new one)."""
    datum: Datum
    mask: TensorData
    """float32, 1 on each sampled target token: the tokens the loss trains."""
    versions: TensorData
    """int64, the run's policy version that sampled each target token; -1 where none did."""


class DumpedGroup(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One trained group."""

    group: int
    attempt: int
    """How many times it was sampled before (a stale group is re-sampled)."""
    rewards: list[float]
    """Total reward of every surviving trajectory."""
    trajectories: list[int]
    """The trajectories trained, with ``advantages`` aligned to them."""
    advantages: list[float]
    roles: list[str] = msgspec.field(default_factory=list)
    """A multi-agent group: the role of each trajectory trained (aligned with ``trajectories``;
    each role's advantages are against its own baseline); empty for a single-agent group."""


class ForwardBackwardCall(msgspec.Struct, kw_only=True, frozen=True, gc=False, tag="forward_backward"):
    datums: list[int]
    """Indices into ``StepDump.datums``, in the order the call received them."""
    loss_fn: str
    loss_fn_config: dict[str, float]


class OptimStepCall(msgspec.Struct, kw_only=True, frozen=True, gc=False, tag="optim_step"):
    adam: AdamParams


class StepDump(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One step: the training calls as submitted, their datums, and the rollout figures of its metrics line."""

    format: int
    step: int
    updates: int
    """Optimizer updates applied before the step (the policy version it trained from)."""
    learning_rate: float
    calls: list[ForwardBackwardCall | OptimStepCall]
    datums: list[DumpedDatum]
    groups: list[DumpedGroup]
    rewards: list[float]
    """Every surviving attempt's reward, dropped groups' too (the step's reward columns)."""
    counts: dict[str, int]
    staleness: list[int]
    tokens_sampled: int
    env_metrics: dict[str, list[float]]
    tag_rewards: dict[str, list[float]]
    overlong_penalties: list[float] = msgspec.field(default_factory=list)
    """With ``overlong_buffer_len``: the overlong penalty in each of ``rewards`` (empty without)."""


class _Head(msgspec.Struct):
    """A step file's format version alone: read first, so that a file of another version is
    refused for its version rather than for whatever field changed."""

    format: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepDump)
_head = msgspec.msgpack.Decoder(_Head)


def step_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}.msgpack")


def start_dump(directory: str, recipe: str, train: Any, options: Any, *, resume: bool) -> None:
    """Create ``directory`` and its ``meta.json``; a fresh run refuses a directory that holds dumps."""
    if not resume and step_files(directory):
        raise ConfigurationError(f"dump_rollouts={directory!r}: holds rollout dumps already "
                                 "(choose another directory)")
    os.makedirs(directory, exist_ok=True)
    meta = {"format": FORMAT_VERSION, "recipe": recipe, "seed": train.seed, "train": msgspec.to_builtins(train),
            "options": msgspec.to_builtins(options)}
    replace_file(os.path.join(directory, META_FILE), msgspec.json.format(msgspec.json.encode(meta)))


def write_step(directory: str, dump: StepDump) -> int:
    """Write one step's file atomically; returns its size in bytes."""
    data = _encoder.encode(dump)
    replace_file(step_path(directory, dump.step), data)
    return len(data)


def step_files(directory: str) -> list[str]:
    """The step files of ``directory`` in step order (none if it does not exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = sorted(int(m.group(1)) for m in map(_STEP_NAME.fullmatch, names) if m)
    return [step_path(directory, s) for s in steps]


def read_meta(directory: str) -> dict[str, Any]:
    """``meta.json`` of a dump directory, checked: its format version and the keys a replay needs."""
    path = os.path.join(directory, META_FILE)
    try:
        with open(path, "rb") as f:
            meta = msgspec.json.decode(f.read())
    except FileNotFoundError:
        raise RolloutDumpError(path, "missing: not a rollout dump directory") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise RolloutDumpError(path, f"unreadable ({exc})") from None
    _check_format(path, meta.get("format") if isinstance(meta, dict) else None)
    missing = [k for k in ("recipe", "train", "options") if k not in meta]
    if missing:
        raise RolloutDumpError(path, f"lacks {', '.join(missing)}")
    return meta


def read_step(path: str, step: int) -> StepDump:
    """One step file, decoded and checked to be of this format and of step ``step``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise RolloutDumpError(path, f"unreadable ({exc})") from None
    try:
        head = _head.decode(data)
    except msgspec.DecodeError as exc:
        raise RolloutDumpError(path, f"not a step dump ({exc})") from None
    _check_format(path, head.format)
    try:
        dump = _decoder.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:
        raise RolloutDumpError(path, f"not a step dump ({exc})") from None
    if dump.step != step:
        raise RolloutDumpError(path, f"holds step {dump.step}, expected step {step}")
    n = len(dump.datums)
    for call in dump.calls:
        if isinstance(call, ForwardBackwardCall) and any(not 0 <= i < n for i in call.datums):
            raise RolloutDumpError(path, f"a forward_backward call names a datum outside 0..{n - 1}")
    return dump


def _check_format(path: str, version: object) -> None:
    if version != FORMAT_VERSION:
        raise RolloutDumpError(path, f"format={version!r}: this rlengine reads format {FORMAT_VERSION}")
