"""Backends: the protocol, the registry, and the choice behind ``backend="auto"``.

Each backend is registered by a ``BackendSpec`` naming, as ``"module:function"``
strings so nothing heavy is imported until used:

* ``prepare(config) -> model_path | None`` - resolve or build the model
  directory (runs once, on the compute thread);
* ``backend(config, model_path) -> Backend``;
* ``trainer(config, model_path) -> trainer`` - built on first training use.

``available()`` says, for every backend, whether it can run here and why not;
``rlengine info`` prints it. The control plane (and the sim backend) never
imports torch or vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from rlengine.backends.base import Backend, BackendRequest, Capabilities, RequestOutput
from rlengine.errors import ConfigurationError

if TYPE_CHECKING:
    from rlengine.config import EngineConfig

__all__ = [
    "SPECS",
    "Backend",
    "BackendRequest",
    "BackendSpec",
    "Capabilities",
    "RequestOutput",
    "available",
    "load",
    "resolve_backend",
]


class BackendSpec(NamedTuple):
    modules: tuple[str, ...]
    """Top-level modules that must be importable for this backend."""
    prepare: str | None
    backend: str
    trainer: str


SPECS: dict[str, BackendSpec] = {
    "sim": BackendSpec((), None, "rlengine.backends.sim:build", "rlengine.trainer.sim:build"),
    "torch": BackendSpec(("torch", "transformers"), "rlengine.backends.torch.models:prepare",
                         "rlengine.backends.torch.backend:build", "rlengine.trainer.torch_trainer:build"),
    # Completions given as text (tests of agents and API shapes); the torch trainer trains.
    "scripted": BackendSpec(("torch", "transformers"), "rlengine.backends.torch.models:prepare",
                            "rlengine.backends.scripted:build", "rlengine.trainer.torch_trainer:build_beside_scripted"),
    # vLLM samples; the torch trainer trains (the same model directory).
    "vllm": BackendSpec(("vllm", "torch", "transformers"), "rlengine.backends.torch.models:prepare",
                        "rlengine.backends.vllm_backend:build", "rlengine.trainer.torch_trainer:build"),
}
# backend="auto" takes the first usable of these, in this order.
AUTO_ORDER: tuple[str, ...] = ("vllm", "torch")


def load(ref: str) -> Callable[..., Any]:
    """Import ``"module:function"``."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def available() -> dict[str, tuple[bool, str]]:
    """``{name: (usable, reason)}`` for every backend rlengine knows."""
    out = {}
    for name, spec in SPECS.items():
        missing = [m for m in spec.modules if importlib.util.find_spec(m) is None]
        if name == "sim":
            out[name] = (True, "built in (deterministic simulator, no model)")
        else:
            out[name] = (not missing, f"missing: {', '.join(missing)}" if missing else "importable")
    for name in AUTO_ORDER:
        out.setdefault(name, (False, "not built into this version of rlengine"))
    return out


def resolve_backend(config: EngineConfig) -> str:
    """The concrete backend name for ``config.backend`` (``auto`` resolved)."""
    avail = available()
    if config.backend != "auto":
        usable, why = avail.get(config.backend, (False, "not built into this version of rlengine"))
        if not usable:
            raise ConfigurationError(f"backend={config.backend!r} is not available: {why}")
        return config.backend
    for name in AUTO_ORDER:
        if avail[name][0]:
            return name
    raise ConfigurationError(
        "backend='auto': no model backend is available here ("
        + "; ".join(f"{n}: {avail[n][1]}" for n in AUTO_ORDER) + "); use backend='sim'")
