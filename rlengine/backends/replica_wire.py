"""The sampler replicas' output wire: what one replica's ``run`` call sends back to the driver.

A replica (``backends.ray_replicas``) steps its own backend and answers with
the ``RequestOutput``s it produced. They cross the process boundary as
msgpack (no pickle), one ``WireOutput`` each: token ids and logprobs as raw
int32 / float32 bytes, and every other field of ``RequestOutput`` as it is,
the speculative counts (``drafted_tokens`` / ``accepted_tokens``), the prefix
cache's ``cached_tokens`` and the ``prompt_scores`` included. A field left
behind here would not fail anything: the driver would read its default (0
tokens drafted, no prompt cache hit) as if the replica had reported it, so
``WIRE_FIELDS`` names what crosses and a test checks that it is every field
but the driver's own ``lost``.

No Ray here (the module is importable, and its codec testable, without it);
it never touches a backend or engine state.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from rlengine.backends.base import BackendRequest, RequestOutput
from rlengine.types import PromptScores

__all__ = ["DRIVER_ONLY", "WIRE_FIELDS", "Answer", "WireOutput", "decode_answer", "decode_requests", "encode"]


def _ints(values: Any) -> bytes | None:
    return None if values is None else array("i", values).tobytes()


def _floats(values: Any) -> bytes | None:
    return None if values is None else array("f", values).tobytes()


def _array(code: str, raw: bytes | None) -> array | None:
    if raw is None:
        return None
    out = array(code)
    out.frombytes(raw)
    return out


class WireOutput(msgspec.Struct, array_like=True, gc=False):
    """One ``RequestOutput`` on the wire (its fields, by name; ids int32 and logprobs float32 bytes)."""

    request_id: str
    token_ids: bytes
    logprobs: bytes
    finished: bool = False
    stop_reason: str | None = None
    prompt_logprobs: bytes | None = None
    error: str | None = None
    top_ids: bytes | None = None
    top_logprobs: bytes | None = None
    prompt_top_ids: bytes | None = None
    prompt_top_logprobs: bytes | None = None
    cached_tokens: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prompt_scores: PromptScores | None = None

    @classmethod
    def of(cls, o: RequestOutput) -> WireOutput:
        return cls(o.request_id, _ints(o.token_ids), _floats(o.logprobs), o.finished,  # type: ignore[arg-type]
                   o.stop_reason, _floats(o.prompt_logprobs), o.error, _ints(o.top_ids), _floats(o.top_logprobs),
                   _ints(o.prompt_top_ids), _floats(o.prompt_top_logprobs), o.cached_tokens, o.drafted_tokens,
                   o.accepted_tokens, o.prompt_scores)

    def output(self) -> RequestOutput:
        """The ``RequestOutput`` the replica's backend produced (ids and logprobs as arrays)."""
        out = RequestOutput(self.request_id, _array("i", self.token_ids), _array("f", self.logprobs),  # type: ignore[arg-type]
                            self.finished, self.stop_reason, _array("f", self.prompt_logprobs),  # type: ignore[arg-type]
                            self.error, _array("i", self.top_ids), _array("f", self.top_logprobs),
                            _array("i", self.prompt_top_ids), _array("f", self.prompt_top_logprobs),
                            cached_tokens=self.cached_tokens)
        out.drafted_tokens = self.drafted_tokens
        out.accepted_tokens = self.accepted_tokens
        out.prompt_scores = self.prompt_scores
        return out


DRIVER_ONLY = ("lost",)
"""``RequestOutput`` fields the driver sets itself (a lost replica's requests), never sent."""
WIRE_FIELDS = WireOutput.__struct_fields__
"""What crosses: with ``DRIVER_ONLY``, every field of ``RequestOutput``."""


class Answer(msgspec.Struct, array_like=True, gc=False):
    """A ``run`` call's answer: requests its backend refused (id, why), the outputs of its last
    step, and how many steps it took."""

    rejected: list[tuple[str, str]]
    outputs: list[WireOutput]
    steps: int


encode = msgspec.msgpack.Encoder().encode
"""Both directions' encoder (requests are ``BackendRequest`` Structs as they are)."""
decode_requests = msgspec.msgpack.Decoder(list[BackendRequest]).decode
decode_answer = msgspec.msgpack.Decoder(Answer).decode
