"""The session layer's records: a session, what a turn asks of tool calls, a turn's result, a session's trace.

``Session`` is the one mutable record: ``SessionTable`` creates and retires
it, ``TraceCapture`` extends its index of stored positions as turns are
recorded, ``TurnLeases`` marks its turns in flight. The rest are frozen
msgspec Structs handed to the servers and to training. This module holds
data only: no logic beyond construction, no I/O, no imports of the session
layer's other modules (they all import it).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from rlengine.protocol import Choice
from rlengine.render import Boundary
from rlengine.trace import Trajectory
from rlengine.types import LogprobTransform

__all__ = ["Session", "SessionTrace", "ToolUse", "TurnResult"]


class TurnResult(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A completed turn, as recorded."""

    request_id: str
    replica: int
    prompt_tokens: int
    choices: list[Choice]


class ToolUse(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What a chat request says about tool calls and the output's shape (every API's
    ``tool_choice``, ``parallel_tool_calls`` and JSON response, in one form)."""

    choice: str = "auto"
    """``auto``, ``none`` (calls are not parsed), ``required`` or ``function`` (``forced``)."""
    forced: str | None = None
    """The function ``choice="function"`` forces."""
    parallel: bool = True
    """False: at most one call is returned (and forced)."""
    schema: Any = None
    """A JSON response's schema (``constraints.json_response``), or None for text."""
    json_whitespace: Any = None
    """The request's ``json_whitespace`` (``constraints.json_whitespace``): None or ``compact``, ``any``."""


class SessionTrace(msgspec.Struct, kw_only=True, frozen=True):
    """What training gets from a session: one trajectory per branch, with its reward."""

    session_id: str
    trajectories: list[Trajectory]
    rewards: list[float | None]
    """Per trajectory: the reward sent while its leaf was the session's latest turn."""
    turns: int
    tainted: bool = False
    """A turn's client went away after output may have reached it, and the turn was not
    recorded: the client may have seen (and may continue from) tokens the trace lacks."""
    latest: int | None = None
    """The index of the trajectory that ends at the session's latest turn (None: no turn, or
    the latest turn was continued by an earlier branch)."""
    constrained: frozenset[str] = frozenset()
    """Request ids (the segments' ``request_id``) of turns sampled under a constraint
    (forced tool calls, a JSON response): their logprobs are of the masked
    distribution the constrained sampler drew from, not of the model's own."""
    stops: list[dict[int, str]] = msgspec.field(default_factory=list)
    """Per trajectory: how each sampled completion on it ended, as the engine said (``stop``: an
    end token or a stop string; ``length``: the ``max_tokens`` limit), by the position where
    its tokens end (tokens from the root)."""
    transforms: list[dict[int, LogprobTransform]] = msgspec.field(default_factory=list)
    """Per trajectory, likewise: the sampling transform of each completion on it whose logprobs
    are processed (``SampledSequence.logprobs_transform``); a completion not here has raw ones."""
    by_role: dict[str, SessionTrace] = msgspec.field(default_factory=dict)
    """A session whose turns named roles (HTTP ``X-RLEngine-Role``): per role, this trace with the
    loss mask marking that role's completions only (an untrainable role's too: its traces, apart);
    empty otherwise, and in each per-role trace."""
    untrainable: frozenset[str] = frozenset()
    """Roles the session declared untrainable: their tokens are left out of ``trajectories``' loss
    mask, so nothing built from this trace trains them (they stay in ``by_role``)."""


class Session:
    """One agent conversation (loop thread only)."""

    __slots__ = (
        "active_at",
        "boundaries",
        "completion_roles",
        "constrained",
        "in_flight",
        "leaf",
        "retired",
        "rewards",
        "roles",
        "root",
        "session_id",
        "stops",
        "tainted",
        "token",
        "transforms",
        "turns",
    )

    def __init__(self, session_id: str, token: str, root: int) -> None:
        self.session_id = session_id
        self.token = token
        self.root = root
        self.boundaries: dict[tuple[bytes, bool], Boundary] = {(b"", False): Boundary(root, 0, False, "")}
        self.leaf: int | None = None
        self.rewards: dict[int, float] = {}
        self.stops: dict[int, str] = {}
        """The handle where each sampled completion's tokens end -> its stop reason."""
        self.transforms: dict[int, LogprobTransform] = {}
        """Likewise -> the transform of its logprobs, for completions with processed ones."""
        self.in_flight: dict[str, int] = {}
        """request id -> replica, for turns not yet settled."""
        self.turns = 0
        self.retired = False
        self.constrained: set[str] = set()
        """Request ids of its turns sampled under a constraint (``SessionTrace.constrained``)."""
        self.active_at = time.monotonic()
        """When it was opened or last started or finished a turn (idle expiry; retirement time once retired)."""
        self.roles: dict[str, bool] | None = None
        """Declared roles -> trainable (``SessionManager.open``); None: any role, all trainable."""
        self.completion_roles: dict[int, tuple[str, int]] = {}
        """The handle where each completion of a turn that named a role ends -> (the role, its tokens)."""
        self.tainted = False
        """A turn's client went away after output may have reached it: what the client saw
        (and may build on) was not recorded (``SessionTrace.tainted``)."""

    def __repr__(self) -> str:
        return f"<Session {self.session_id} turns={self.turns}{' retired' if self.retired else ''}>"
