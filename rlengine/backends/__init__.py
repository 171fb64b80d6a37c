"""Backends: the protocol, the registry, and the choice behind ``backend="auto"``.

``available()`` says, for every backend, whether it can run here and why not;
``rlengine info`` prints it. Model backends are imported lazily so that the
control plane (and the sim backend) never imports torch or vLLM.
"""

from __future__ import annotations

import importlib.util

from rlengine.backends.base import Backend, BackendRequest, Capabilities, RequestOutput
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError

__all__ = ["Backend", "BackendRequest", "Capabilities", "RequestOutput", "available", "resolve_backend"]

# Model backends in order of preference for backend="auto". Each entry names
# the modules it needs; one is offered only once it exists in this package.
_MODEL_BACKENDS: dict[str, tuple[str, ...]] = {}


def available() -> dict[str, tuple[bool, str]]:
    """``{name: (usable, reason)}`` for every backend rlengine knows."""
    out = {"sim": (True, "built in (deterministic simulator, no model)")}
    for name, modules in _MODEL_BACKENDS.items():
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        out[name] = (not missing, f"missing: {', '.join(missing)}" if missing else "importable")
    return out


def resolve_backend(config: EngineConfig) -> str:
    """The concrete backend name for ``config.backend`` (``auto`` resolved)."""
    avail = available()
    if config.backend != "auto":
        usable, why = avail.get(config.backend, (False, "not built into this version of rlengine"))
        if not usable:
            raise ConfigurationError(f"backend={config.backend!r} is not available: {why}")
        return config.backend
    for name in _MODEL_BACKENDS:
        if avail[name][0]:
            return name
    raise ConfigurationError(
        "backend='auto': no model backend is available in this version of rlengine "
        "(the torch and vLLM backends are not built yet); use backend='sim'")
