"""The engine's per-request records: what a request is, and what its sequences accumulate.

* ``SampleSpec``    - a validated sample call (``Engine.validate_sample``): prompt, count, parameters;
* ``SampleRequest`` - one sample call from submission to settlement, with its sequences;
* ``LeaseRequest``  - a queued external lease (``Engine.lease``);
* ``BlockingWork``  - work that runs with the sampler quiesced (training, installs, ...);
* ``Sequence``      - one sequence in flight: its tokens, logprobs and per-token versions.

They are made only by ``new_sample``, ``new_lease`` and ``new_blocking``
(thread-safe: nothing here touches loop state), and the sampler loop
(``rlengine.core.sampler``) is the one module that changes and settles them,
on the loop thread. The scheduler reads the queued ones through
``rlengine.core.scheduler.Queued`` and owns their leases.

Every record is an untracked msgspec Struct (``gc=False``): thousands are in
flight, and the sampler breaks their one cycle (a request's sequences point
back at it) when it settles them, so the cyclic collector never needs to see
them.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from rlengine.core.futures import RequestFuture
from rlengine.core.scheduler import Lease
from rlengine.types import (
    LogprobTransform,
    PromptScores,
    PromptScoring,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)

__all__ = ["BlockingWork", "Entry", "LeaseRequest", "OnTokens", "SampleRequest", "SampleSpec", "Sequence",
           "describe", "new_blocking", "new_lease", "new_sample"]

_I32 = struct.Struct("<i")

OnTokens = Callable[[int, list[int], list[float], int], None]


class SampleSpec(msgspec.Struct, frozen=True, gc=False):
    """A validated sample call (``Engine.validate_sample``): what to sample, not where.

    ``prompt`` is raw int32 token ids."""

    prompt: bytes
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    prompt_top_logprobs: int = 0
    """k > 0: the k most likely tokens at every prompt position after the first, with their logprobs."""
    prompt_scoring: PromptScoring | None = None
    """Chosen tokens' logprobs and draws at prompt positions; set by the Tinker API, which checks it
    (``SamplingCalls.asample``), on a spec ``validate_sample`` made."""


class SampleRequest(msgspec.Struct, gc=False):
    """A sample call from submission to settlement: ``num_samples`` sequences, one future."""

    blocking: ClassVar[bool] = False
    request_id: str
    spec: SampleSpec
    version: int | None
    """The sampler version this request addresses; None follows the latest."""
    session_id: str | None
    future: RequestFuture[SampleResponse]
    on_tokens: OnTokens | None = None
    """``on_tokens(index, token_ids, logprobs, version)`` on the loop thread as
    sequence ``index`` produces tokens (streaming); None: report once, finished."""
    lease: Lease | None = None
    seqs: list[Sequence] | None = None
    remaining: int = 0
    prompt_logprobs_raw: bytes | None = None
    prompt_top_ids_raw: bytes | None = None
    prompt_top_logprobs_raw: bytes | None = None
    prompt_scores: PromptScores | None = None
    prompt_cache_hit_tokens: int | None = None
    """The fewest prompt tokens any of its sequences took from the backend's prefix cache (None: none reported)."""
    submitted_at: float = 0.0
    """When it was made (``time.monotonic``): its age in a hang dump (``rlengine.core.hangs``)."""
    admitted_at: float = 0.0
    """When it was admitted; ``first_token_at``: when a streamed sequence of it first produced a
    token (both kept only while a timeline records: ``rlengine.timeline``; 0 otherwise);
    ``drafted``/``accepted``: speculative decoding's tokens (``SampleResponse.drafted_tokens``)."""
    first_token_at: float = 0.0
    drafted: int = 0
    accepted: int = 0


class LeaseRequest(msgspec.Struct, gc=False):
    """A queued external lease (a session turn driven outside the engine); its future
    resolves to the ``Lease`` at admission."""

    blocking: ClassVar[bool] = False
    request_id: str
    version: int | None
    session_id: str | None
    future: RequestFuture[Lease]
    submitted_at: float = 0.0
    """When it was made (``time.monotonic``)."""


class BlockingWork(msgspec.Struct, gc=False):
    """Work that runs on the compute thread with the sampler quiesced.

    ``run`` executes on the compute thread; ``before``/``after`` (optional)
    on the loop thread around it; ``noop`` (optional, loop thread) says at
    the head of the queue whether the work would do nothing, in which case
    it runs without draining.
    """

    blocking: ClassVar[bool] = True
    version: ClassVar[None] = None
    session_id: ClassVar[None] = None
    request_id: str
    kind: str
    run: Callable[[], Any]
    future: RequestFuture[Any]
    noop: Callable[[], bool] | None = None
    before: Callable[[], None] | None = None
    after: Callable[[Any], Any] | None = None
    submitted_at: float = 0.0
    """When it was made (``time.monotonic``)."""


Entry = SampleRequest | LeaseRequest | BlockingWork


def new_sample(request_id: str, spec: SampleSpec, version: int | None, session_id: str | None,
               on_tokens: OnTokens | None, abort: Callable[[str], None]) -> SampleRequest:
    return SampleRequest(request_id, spec, version, session_id, RequestFuture(request_id, abort), on_tokens,
                         submitted_at=time.monotonic())


def new_lease(request_id: str, session_id: str | None, version: int | None,
              abort: Callable[[str], None]) -> LeaseRequest:
    return LeaseRequest(request_id, version, session_id, RequestFuture(request_id, abort), time.monotonic())


def new_blocking(request_id: str, kind: str, run: Callable[[], Any], abort: Callable[[str], None], *,
                 noop: Callable[[], bool] | None = None, before: Callable[[], None] | None = None,
                 after: Callable[[Any], Any] | None = None) -> BlockingWork:
    return BlockingWork(request_id, kind, run, RequestFuture(request_id, abort), noop, before, after,
                        time.monotonic())


def describe(entry: Entry, now: float) -> dict[str, Any]:
    """An entry for a hang dump (``SamplerLoop.snapshot``): its id, session, kind, age, state
    (its lease's, else ``queued``) and, for a sample, its samples unfinished and tokens so far.
    Reads plain attributes only: safe from any thread."""
    lease = getattr(entry, "lease", None)
    out = {"request_id": entry.request_id, "session_id": entry.session_id, "age_s": now - entry.submitted_at,
           "kind": entry.kind if isinstance(entry, BlockingWork) else "sample" if isinstance(entry, SampleRequest)
           else "lease",
           "state": "queued" if lease is None else lease.state.value}
    if isinstance(entry, SampleRequest):
        out |= {"samples": entry.spec.num_samples, "unfinished": entry.remaining,
                "tokens": sum(seq.length for seq in entry.seqs or ())}
    return out


class Sequence(msgspec.Struct, gc=False):
    """One sequence in flight: a backend request plus what it produced so far."""

    request: SampleRequest
    index: int
    backend_id: str
    seed: int
    tokens: array | None = None
    logprobs: array | None = None
    top_ids: array | None = None
    """With ``top_logprobs`` k > 0: k alternatives per token (ids, then their logprobs)."""
    top_logprobs: array | None = None
    version: int | None = None
    """The version of the latest tokens."""
    spans: list[tuple[int, int]] | None = None
    """(first token index, version) per version, once a second version appears
    (only across a pause); None while every token has ``version``."""
    stop_reason: str | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else len(self.tokens)

    def add(self, token_ids: Any, logprobs: Any, version: int, top_ids: Any = None, top_logprobs: Any = None, *,
            adopt: bool = True) -> None:
        """Append a report. A first report of int32 / float32 arrays (what backends
        that report once, finished, hand over: ``RequestOutput.token_ids``) is
        taken over without a copy, unless ``adopt`` is False: a streaming consumer
        was handed the same arrays and may still hold them, and later reports
        extend what is taken over."""
        if top_ids is not None:
            if self.top_ids is None:
                self.top_ids, self.top_logprobs = array("i"), array("f")
            self.top_ids.extend(top_ids)
            self.top_logprobs.extend(top_logprobs)  # type: ignore[union-attr]
        if self.tokens is None:
            if adopt and type(token_ids) is array and token_ids.typecode == "i" and type(logprobs) is array \
                    and logprobs.typecode == "f":
                self.tokens, self.logprobs = token_ids, logprobs
            else:
                self.tokens, self.logprobs = array("i", token_ids), array("f", logprobs)
            self.version = version
            return
        if self.version != version:
            if self.spans is None:
                self.spans = [(0, self.version)]
            self.spans.append((len(self.tokens), version))
            self.version = version
        self.tokens.extend(token_ids)
        assert self.logprobs is not None
        self.logprobs.extend(logprobs)

    def _versions_raw(self) -> bytes:
        """The version of every token, as raw int32."""
        assert self.tokens is not None
        if self.spans is None:
            return _I32.pack(self.version) * len(self.tokens)
        ends = [start for start, _ in self.spans[1:]] + [len(self.tokens)]
        return b"".join(_I32.pack(v) * (end - start) for (start, v), end in zip(self.spans, ends))

    def to_sequence(self, transform: LogprobTransform | None = None) -> SampledSequence:
        """Its ``SampledSequence``; ``transform``: what its logprobs are under (None: raw)."""
        stop_reason = self.stop_reason or "abort"
        if self.tokens is None:
            return SampledSequence(stop_reason=stop_reason)
        assert self.logprobs is not None
        if self.top_ids is None:
            return SampledSequence(stop_reason=stop_reason, tokens_raw=self.tokens.tobytes(),
                                   logprobs_raw=self.logprobs.tobytes(), versions_raw=self._versions_raw(),
                                   logprobs_transform=transform)
        assert self.top_logprobs is not None
        return SampledSequence(stop_reason=stop_reason, tokens_raw=self.tokens.tobytes(),
                               logprobs_raw=self.logprobs.tobytes(), versions_raw=self._versions_raw(),
                               top_ids_raw=self.top_ids.tobytes(), top_logprobs_raw=self.top_logprobs.tobytes(),
                               logprobs_transform=transform)
