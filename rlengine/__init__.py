"""rlengine: a single-process, embeddable engine for RL of language models.

The public API, with Tinker-compatible names::

    import rlengine as rle
    with rle.Engine(rle.EngineConfig(backend="sim")) as engine:
        sampler = engine.sampling_client()
        resp = sampler.sample(rle.ModelInput.from_ints([1, 2, 3]), num_samples=4,
                              sampling_params=rle.SamplingParams(max_tokens=32)).result()

Importing this package never imports torch or vLLM.
"""

from rlengine.clients import SamplingClient, TrainingClient
from rlengine.config import EngineConfig, SimConfig
from rlengine.engine import Engine
from rlengine.errors import (
    BackendRequestError,
    ConfigurationError,
    DrainTimeout,
    EngineClosed,
    EngineDeadError,
    GateError,
    GatePoisoned,
    InvalidRequest,
    ModelNotLoaded,
    RequestAborted,
    RequestError,
    RequestTimeout,
    RLEngineError,
)
from rlengine.futures import RequestFuture
from rlengine.scheduler import Lease
from rlengine.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    Receipt,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    UnloadModelResponse,
)

__version__ = "0.1.0"

__all__ = [
    "AdamParams", "BackendRequestError", "ConfigurationError", "Datum", "DrainTimeout", "Engine",
    "EngineClosed", "EngineConfig", "EngineDeadError", "ForwardBackwardOutput", "GateError", "GatePoisoned",
    "InvalidRequest", "Lease", "LoadWeightsResponse", "ModelInput", "ModelNotLoaded", "OptimStepResponse",
    "RLEngineError", "Receipt", "RequestAborted", "RequestError", "RequestFuture", "RequestTimeout",
    "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams", "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse", "SimConfig", "TensorData", "TrainingClient", "UnloadModelResponse", "__version__",
]
