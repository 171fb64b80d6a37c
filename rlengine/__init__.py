"""rlengine: a single-process, embeddable engine for RL of language models.

The public API, with Tinker-compatible names::

    import rlengine as rle
    with rle.Engine(rle.EngineConfig(backend="sim")) as engine:
        sampler = engine.sampling_client()
        resp = sampler.sample(rle.ModelInput.from_ints([1, 2, 3]), num_samples=4,
                              sampling_params=rle.SamplingParams(max_tokens=32)).result()

Importing this package never imports torch or vLLM.
"""

from typing import Any

# Names load on first use (PEP 562), so that importing a light submodule
# (``rlengine.sandbox_client`` and ``rlengine.protocol`` in a sandbox, which need
# only msgspec and the standard library) does not import the engine and numpy.
_EXPORTS: dict[str, str] = {
    "SamplingClient": "rlengine.core.clients", "TrainingClient": "rlengine.core.clients",
    "EngineConfig": "rlengine.config", "Placement": "rlengine.config", "SimConfig": "rlengine.config",
    "Engine": "rlengine.core.engine",
    "RequestFuture": "rlengine.core.futures",
    "Lease": "rlengine.core.scheduler",
    **{name: "rlengine.errors" for name in (
        "BackendRequestError", "ConfigurationError", "ContextLengthExceeded", "DrainTimeout", "EngineClosed",
        "EngineDeadError",
        "GateError", "GatePoisoned", "InvalidRequest", "ModelNotLoaded", "ReplicaLost", "RequestAborted",
        "RequestError", "RequestTimeout", "RLEngineError", "TrainerLost", "WeightSyncError")},
    **{name: "rlengine.types" for name in (
        "AdamParams", "Datum", "ForwardBackwardOutput", "LoadWeightsResponse", "LogprobTransform", "ModelInput",
        "OptimStepResponse", "Receipt", "SampledSequence", "SampleResponse", "SamplingParams", "SaveWeightsForSamplerResponse",
        "SaveWeightsResponse", "TensorData", "UnloadModelResponse")},
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlengine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "AdamParams", "BackendRequestError", "ConfigurationError", "ContextLengthExceeded", "Datum", "DrainTimeout",
    "Engine",
    "EngineClosed", "EngineConfig", "EngineDeadError", "ForwardBackwardOutput", "GateError", "GatePoisoned",
    "InvalidRequest", "Lease", "LoadWeightsResponse", "LogprobTransform", "ModelInput", "ModelNotLoaded", "OptimStepResponse",
    "Placement", "RLEngineError", "Receipt", "ReplicaLost", "RequestAborted", "RequestError", "RequestFuture", "RequestTimeout",
    "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams", "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse", "SimConfig", "TensorData", "TrainerLost", "TrainingClient", "UnloadModelResponse",
    "WeightSyncError",
    "__version__",
]
