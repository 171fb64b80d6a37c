"""What the trace store exports: one ``Trajectory`` per leaf of a session.

A trajectory is the exact token path from the session's root to one leaf,
with each token's logprob and policy version as stored when it was sampled,
a loss mask that is 1 over sampled tokens, and the segments (runs stored by
one call with one kind and request id) it is made of. Arrays are raw bytes
(int32 / float32 / int32 / uint8, native little-endian, as in
``rlengine.types``) so a trajectory goes over the wire as it is; the
accessors return read-only numpy views without copying.

Branches of one session share their prefix in the store; in an export each
trajectory is complete, and ``shared_prefix`` says where it leaves the
previous one, so a trainer can batch shared prefixes once.

This module holds values only: no store logic, and no torch.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

__all__ = ["KINDS", "Segment", "SegmentKind", "Trajectory"]

SegmentKind = Literal["prompt", "sampled", "environment"]
KINDS: tuple[SegmentKind, ...] = ("prompt", "sampled", "environment")


class Segment(msgspec.Struct, kw_only=True, frozen=True):
    """Tokens ``[start, end)`` of a path, stored with one kind and request id."""

    start: int
    end: int
    kind: SegmentKind
    request_id: str | None = None


class Trajectory(msgspec.Struct, kw_only=True, frozen=True):
    """One root-to-leaf path of a session, ready for training."""

    session: str
    """The session it belongs to."""
    leaf: int
    """The trie handle of its last node (valid until the session is dropped)."""
    shared_prefix: int
    """Tokens it shares with the previous trajectory of the same export (0 for the first)."""
    tokens_raw: bytes
    logprobs_raw: bytes
    """0.0 where nothing was sampled (prompt and environment tokens)."""
    versions_raw: bytes
    """The policy version that sampled each token; -1 for prompt and environment tokens."""
    loss_mask_raw: bytes
    """One byte per token: 1 for sampled tokens, 0 otherwise."""
    segments: tuple[Segment, ...] = ()

    @property
    def length(self) -> int:
        return len(self.tokens_raw) // 4

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.tokens_raw, dtype=np.int32)

    @property
    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.logprobs_raw, dtype=np.float32)

    @property
    def versions(self) -> np.ndarray:
        return np.frombuffer(self.versions_raw, dtype=np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask_raw, dtype=np.uint8)
