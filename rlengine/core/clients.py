"""Tinker-style clients over an ``Engine``: ``SamplingClient`` and ``TrainingClient``.

Names and shapes follow the Tinker SDK so cookbook users feel at home:
every call returns a ``RequestFuture`` at once (``.result(timeout)`` in
synchronous code, ``await`` in async code); the ``*_async`` variants are
coroutines. Inputs are validated here, on the caller's thread, so a bad
batch raises ``InvalidRequest`` before anything is queued. Training calls
run in submission order: as blocking items of the engine's FIFO with the
sampler drained, or on the training lane beside sampling
(``EngineConfig.train_concurrently``); weight installs always pass the gate.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from rlengine.core.futures import RequestFuture
from rlengine.errors import InvalidRequest
from rlengine.render import render_chat
from rlengine.trainer.losses import validate_data
from rlengine.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

__all__ = ["EngineCalls", "SamplingClient", "TrainingClient"]


class EngineCalls(Protocol):
    """What the clients call on an ``Engine`` (it satisfies this; the clients never import it, so
    the engine can hand them out without a cycle between the two modules)."""

    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def backend(self) -> Any: ...

    def sample(self, prompt: Any, num_samples: int = 1, sampling_params: SamplingParams | None = None, *,
               version: int | None = None, session_id: str | None = None,
               include_prompt_logprobs: bool = False) -> RequestFuture[SampleResponse]: ...
    def get_trainer(self) -> Any: ...
    def submit_training(self, kind: str, run: Callable[[], Any]) -> RequestFuture[Any]: ...
    def install_weights(self, weights: Callable[[], Any]) -> RequestFuture[int]: ...


class SamplingClient:
    """Samples from the engine's sampler, pinned to one policy version or following the latest."""

    def __init__(self, engine: EngineCalls, version: int | None = None) -> None:
        self.engine = engine
        self.version = version
        """The pinned version; a request for it after a newer install fails with ``ModelNotLoaded``."""

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def sample(self, prompt: ModelInput | Any, num_samples: int = 1,
               sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
               *, session_id: str | None = None) -> RequestFuture[SampleResponse]:
        return self.engine.sample(prompt, num_samples, sampling_params, version=self.version,
                                  session_id=session_id, include_prompt_logprobs=include_prompt_logprobs)

    async def sample_async(self, prompt: ModelInput | Any, num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           *, session_id: str | None = None) -> SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 session_id=session_id)

    def compute_logprobs(self, prompt: ModelInput | Any) -> RequestFuture[list[float | None]]:
        """Logprob of each prompt token under the sampler's weights (the first is None)."""
        inner = self.sample(prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return inner.then(lambda response: response.prompt_logprobs or [None])

    async def compute_logprobs_async(self, prompt: ModelInput | Any) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def render_chat_completion(self, messages: list[dict[str, Any]],
                               add_generation_prompt: bool = True) -> ModelInput:
        """The prompt tokens of ``messages`` under the model's chat template, without generating."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest("messages", "chat", f"backend {self.engine.backend.name} has no tokenizer")
        return ModelInput.from_ints(render_chat(tokenizer, messages, add_generation_prompt))


class TrainingClient:
    """Forward/backward, optimizer steps, weight installs and state, in FIFO order."""

    def __init__(self, engine: EngineCalls) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def _trainer(self) -> Any:
        return self.engine.get_trainer()

    def _validated(self, data: list[Datum], loss_fn: str,
                   loss_fn_config: dict[str, Any] | None) -> tuple[list[Datum], tuple[float, float]]:
        backend = self.engine.backend
        data = list(data) if isinstance(data, (list, tuple)) else data
        return data, validate_data(data, loss_fn, loss_fn_config, backend.vocab_size, backend.max_model_len)

    def forward(self, data: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, Any] | None = None) -> RequestFuture[ForwardBackwardOutput]:
        data, thresholds = self._validated(data, loss_fn, loss_fn_config)
        return self.engine.submit_training(
            "forward", lambda: self._trainer().forward(data, loss_fn, thresholds))

    def forward_backward(self, data: list[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, Any] | None = None) -> RequestFuture[ForwardBackwardOutput]:
        """Accumulate gradients of ``loss_fn`` over ``data`` (until ``optim_step``)."""
        data, thresholds = self._validated(data, loss_fn, loss_fn_config)
        return self.engine.submit_training(
            "forward_backward", lambda: self._trainer().forward_backward(data, loss_fn, thresholds))

    def optim_step(self, adam_params: AdamParams | None = None) -> RequestFuture[OptimStepResponse]:
        params = adam_params if adam_params is not None else AdamParams()
        if not isinstance(params, AdamParams):
            raise InvalidRequest("adam_params", type(params).__name__, "must be an AdamParams")
        return self.engine.submit_training("optim_step", lambda: self._trainer().optim_step(params))

    def save_weights_for_sampler(self, name: str | None = None) -> RequestFuture[SaveWeightsForSamplerResponse]:
        """Install the trainer's weights into the sampler in-process as version + 1."""
        inner = self.engine.install_weights(lambda: self._trainer().sampler_weights())
        return inner.then(lambda version: SaveWeightsForSamplerResponse(version=version, path=name))

    def save_weights_and_get_sampling_client(self, name: str | None = None,
                                             timeout: float | None = None) -> SamplingClient:
        """Synchronous: install, then a sampling client pinned to the new version."""
        response = self.save_weights_for_sampler(name).result(timeout)
        return SamplingClient(self.engine, response.version)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        response = await self.save_weights_for_sampler(name)
        return SamplingClient(self.engine, response.version)

    def save_state(self, path: str, include_optimizer: bool = True) -> RequestFuture[SaveWeightsResponse]:
        """Save weights (and optimizer state) to the local directory ``path``."""
        path = _check_path("path", path)
        return self.engine.submit_training(
            "save_state",
            lambda: SaveWeightsResponse(path=self._trainer().save_state(path, include_optimizer)))

    def load_state(self, path: str, include_optimizer: bool = True) -> RequestFuture[LoadWeightsResponse]:
        """Load what ``save_state`` wrote; with the optimizer the next step is bit-identical."""
        path = _check_path("path", path)
        if not os.path.isdir(path):
            raise InvalidRequest("path", path, "is not a directory")
        return self.engine.submit_training(
            "load_state",
            lambda: LoadWeightsResponse(path=self._trainer().load_state(path, include_optimizer)))

    async def forward_backward_async(self, data: list[Datum], loss_fn: str = "cross_entropy",
                                     loss_fn_config: dict[str, Any] | None = None,
                                     ) -> RequestFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def optim_step_async(self, adam_params: AdamParams | None = None) -> RequestFuture[OptimStepResponse]:
        return self.optim_step(adam_params)


def _check_path(field: str, path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise InvalidRequest(field, path, "must be a non-empty local path")
    return os.fspath(path)
