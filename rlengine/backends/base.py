"""The backend protocol: what the engine needs from an inference engine.

It mirrors vLLM's ``LLMEngine`` so that the vLLM backend is a thin adapter
and the engine's sampler loop is the same for every backend:

* ``add_request`` / ``abort_request`` / ``step`` / ``has_unfinished_requests``:
  continuous batching lives *inside* the backend; a request joins at the
  next step and leaves the step it finishes.
* ``load_weights(named_tensors, version)``: in-process weight install.
* ``sleep`` / ``wake_up``: free accelerator memory around training work;
  only where ``capabilities.sleep`` says so.

Every method is called from the engine's single compute thread, never
concurrently, so a backend needs no locking of its own. A backend must not
touch engine state, futures or the event loop: it only turns requests into
per-step outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import msgspec

from rlengine.types import PromptScores, PromptScoring, SamplingParams

__all__ = ["Backend", "BackendRequest", "Capabilities", "RequestOutput"]


class Capabilities(msgspec.Struct, kw_only=True, frozen=True):
    """What a backend can do; the engine never fakes a missing capability."""

    sleep: bool = False
    """``sleep``/``wake_up`` really release and restore memory."""
    prompt_logprobs: bool = True
    stop_strings: bool = True
    constraints: bool = False
    """``SamplingParams.constraint`` (constrained decoding) is honoured."""
    top_logprobs: int = 0
    """The most ``SamplingParams.top_logprobs`` it reports (0: none)."""
    logprobs_modes: tuple[str, ...] = ("raw",)
    """The ``SamplingParams.logprobs_mode`` values it records; the first is its default."""
    prompt_top_logprobs: int = 0
    """The most ``BackendRequest.prompt_top_logprobs`` it reports (0: none)."""
    prompt_scores: bool = False
    """``BackendRequest.prompt_scoring`` (chosen tokens' logprobs and draws at prompt positions) is served."""
    why_not_sleep: str = ""
    """When ``sleep`` is False, why (shown by ``rlengine info``)."""
    batch_invariant: bool = False
    """A sequence's tokens and logprobs are the same bits whatever shares its batches (the torch
    backend's batch-invariant mode)."""
    kernel_check: dict[str, Any] | None = None
    """In batch-invariant mode, the start-up canary's outcome: whether this machine's kernels round
    a row the same at every place of a fixed-shape call (``backends.torch.invariant.canary``)."""


class BackendRequest(msgspec.Struct, gc=False):
    """One sequence to generate. The engine fans ``num_samples`` out into
    separate requests, each with its own concrete seed. (Positional fields:
    the engine builds one per sequence on its hot path.)"""

    request_id: str
    prompt: bytes
    """Token ids, raw int32 bytes."""
    params: SamplingParams
    seed: int
    """Concrete per-sequence seed (the engine derives it; never None here)."""
    max_tokens: int
    """Tokens still to generate (``params.max_tokens`` minus what a paused
    request already generated, capped by the context length)."""
    prompt_logprobs: bool = False
    stream: bool = True
    """True: report new tokens every step (needed to keep partial tokens of a
    paused request). False: report once, when finished, with every token -
    like vLLM's ``FINAL_ONLY``, it spares the engine per-token work."""
    prompt_top_logprobs: int = 0
    """Also report, for every prompt token after the first, the k most likely tokens at its
    position and their logprobs (``RequestOutput.prompt_top_ids``); 0: none."""
    affinity: str | None = None
    """What this sequence belongs with (its session, else its sample call): a backend that
    spreads requests over replicas keeps one affinity on one replica, where its prefix is cached."""
    prompt_scoring: PromptScoring | None = None
    """Also score the prompt's positions so (``RequestOutput.prompt_scores``); only where
    ``Capabilities.prompt_scores``."""


class RequestOutput:
    """What one ``step`` produced for one request: the *new* tokens only."""

    __slots__ = (
        "accepted_tokens",
        "cached_tokens",
        "drafted_tokens",
        "error",
        "finished",
        "logprobs",
        "lost",
        "prompt_logprobs",
        "prompt_scores",
        "prompt_top_ids",
        "prompt_top_logprobs",
        "request_id",
        "stop_reason",
        "token_ids",
        "top_ids",
        "top_logprobs",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        logprobs: list[float],
        finished: bool = False,
        stop_reason: str | None = None,
        prompt_logprobs: list[float] | None = None,
        error: str | None = None,
        top_ids: Any = None,
        top_logprobs: Any = None,
        prompt_top_ids: Any = None,
        prompt_top_logprobs: Any = None,
        lost: bool = False,
        cached_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        """New token ids: a list, or an array('i') (anything ``array('i', ...)`` takes). An
        ``array('i')`` token_ids with an ``array('f')`` logprobs is handed over: the engine
        may keep both objects, so a backend must not reuse them."""
        self.logprobs = logprobs
        self.finished = finished
        self.stop_reason = stop_reason
        """``"length"`` or ``"stop"`` once finished."""
        self.prompt_logprobs = prompt_logprobs
        """Logprob of each prompt token after the first; on the first output only."""
        self.error = error
        """Set when the backend failed this request mid-generation (it is then finished)."""
        self.top_ids = top_ids
        """With ``params.top_logprobs`` k > 0: k ids per new token, flat, most likely first (a list or
        an array('i')); ``top_logprobs`` their logprobs (a list or an array('f')). None otherwise."""
        self.top_logprobs = top_logprobs
        self.prompt_top_ids = prompt_top_ids
        """With ``BackendRequest.prompt_top_logprobs`` k > 0: k ids per prompt token after the first,
        flat, most likely first; ``prompt_top_logprobs`` their logprobs. On the first output only."""
        self.prompt_top_logprobs = prompt_top_logprobs
        self.lost = lost
        """With ``error``: the request was lost with the replica that ran it (the engine fails it
        with ``ReplicaLost``, a known outcome) rather than failed by a live backend."""
        self.cached_tokens = cached_tokens
        """Prompt tokens whose KV the request took from the backend's prefix cache (or from a sample
        of its group) instead of prefilling them; on the first output only (None: not reported)."""
        self.drafted_tokens = 0
        """Speculative decoding (torch backend): tokens drafted for this request since its previous
        output; ``accepted_tokens`` of them were verified and kept (0 and 0 without speculation)."""
        self.accepted_tokens = 0
        self.prompt_scores: PromptScores | None = None
        """What ``BackendRequest.prompt_scoring`` asked for; on the first output only."""


@runtime_checkable
class Backend(Protocol):
    """Inference backend, shaped like vLLM's ``LLMEngine``."""

    name: str
    capabilities: Capabilities
    vocab_size: int
    max_model_len: int

    def add_request(self, request: BackendRequest) -> None: ...

    def abort_request(self, request_ids: Iterable[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...
