"""Exact trace capture: a turn's prompt from the stored tokens, its recording, rewards, the export.

The prompt of turn k is the stored token path of the conversation so far
(every earlier prompt and the exact sampled completion tokens) plus only the
newly rendered suffix (``rlengine.render``): earlier assistant text is never
re-tokenized. Chat sessions index their stored positions by a hash chain
over the messages before them (``Boundary`` per message prefix), so a client
that resends its history is matched message by message; a client whose
history diverges (an edited or truncated conversation) resumes from the last
matching position and branches there in the trie (at the exact token, since
the trie shares equal tokens). Token sessions (``generate``) send their
whole prompt and the trie keeps whatever prefix it already holds.

A turn is recorded when it completes, in one loop callback: a rejected or
aborted turn records nothing. (One exception: if the trace store's memory
bound is reached between storing a turn's prompt and its sampled tokens,
the prompt stays, a branch with nothing to train on; the client gets
``unavailable``.)

A turn that names a role (HTTP ``X-RLEngine-Role``) records it with its
completions; the export then splits the trace per role (``SessionTrace.by_role``)
and leaves the tokens of roles declared untrainable out of the loss mask.

Loop thread only, but for ``prepare``, which may run on the render thread.
It submits nothing and keeps no session alive (``SessionManager`` and
``SessionTable`` do).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import msgspec
import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.protocol import Choice, ToolCallOut
from rlengine.render import Boundary, ChatRenderer, assistant_tail, message_key, suffix_text
from rlengine.serve.session_types import Session, SessionTrace
from rlengine.tool_parsers import ToolCall, ToolParser
from rlengine.trace import TraceStore
from rlengine.types import SampleResponse, SamplingParams

__all__ = ["Prepared", "TraceCapture"]

_encode_message = msgspec.msgpack.Encoder().encode


def _chain(prev: bytes, message: dict[str, Any]) -> bytes:
    """The key of a message prefix: a hash chain, so equal histories get equal keys."""
    return hashlib.blake2b(prev + _encode_message(message_key(message)), digest_size=16).digest()


def _prefix_keys(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[bytes]:
    """The keys of every prefix of ``messages``; the tools are part of every one (they are
    rendered before the first message)."""
    keys = [b"" if not tools else hashlib.blake2b(msgspec.json.encode(tools, order="sorted"), digest_size=16).digest()]
    for m in messages:
        keys.append(_chain(keys[-1], m))
    return keys


class Prepared(NamedTuple):
    """A chat turn's prompt, rendered and tokenized (``TraceCapture.prepare``)."""

    full: str
    """The whole conversation rendered, with the generation prompt."""
    keys: list[bytes]
    """Its prefix keys (empty for a stateless turn)."""
    base: Boundary | None
    """The stored position it continues (None: stateless)."""
    ids: np.ndarray
    """The tokens after ``base`` (all of them when stateless)."""


class TraceCapture:
    """Turns recorded exactly in ``store``, rendered by ``renderer``, tool calls read by ``tool_parser``."""

    def __init__(self, store: TraceStore, renderer: ChatRenderer | None, tool_parser: ToolParser | None) -> None:
        self.store = store
        self.renderer = renderer
        self.tool_parser = tool_parser

    # -- a turn's prompt -------------------------------------------------------------------

    def prepare(self, session: Session | None, renderer: ChatRenderer, msgs: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> Prepared:
        """Render and tokenize a chat turn's prompt: from the session's longest stored match on.
        Pure but for reading ``session.boundaries``: it may run on a worker thread."""
        full = renderer.render(msgs, True, tools)
        if session is None:
            return Prepared(full, [], None, np.asarray(renderer.encode(full), dtype=np.int32))
        keys = _prefix_keys(msgs, tools)
        base, text = self._resume_point(session, renderer, msgs, keys, full, tools)
        return Prepared(full, keys, base, np.asarray(renderer.encode(text), dtype=np.int32))

    @staticmethod
    def _resume_point(session: Session, renderer: ChatRenderer, msgs: list[dict[str, Any]],
                      keys: list[bytes], full: str, tools: list[dict[str, Any]] | None) -> tuple[Boundary, str]:
        """The longest stored position ``msgs`` extends, and the text still to tokenize."""
        boundaries = session.boundaries
        for count in range(len(msgs), 0, -1):
            for generation in (True, False):
                boundary = boundaries.get((keys[count], generation))
                if boundary is None:
                    continue
                text = suffix_text(renderer, msgs, boundary, full, tools)
                if text is not None:
                    return boundary, text
        # Nothing matches: the whole conversation from the session's root (a branch there).
        return Boundary(session.root, 0, False, ""), full

    # -- recording a completed turn --------------------------------------------------------

    def replies(self, resp: SampleResponse, params: SamplingParams, parser: ToolParser | None,
                one_tool_call: bool) -> list[Choice]:
        """A stateless turn's choices: what the client sees, nothing recorded."""
        return [self._choice(seq, *self._reply(seq, params, parser, one_tool_call)[:2]) for seq in resp.sequences]

    @staticmethod
    def _choice(seq: Any, content: str | None, calls: list[ToolCall] | None) -> Choice:
        return Choice(stop_reason=seq.stop_reason, tokens_raw=seq.tokens_raw, logprobs_raw=seq.logprobs_raw,
                      versions_raw=seq.versions_raw, top_ids_raw=seq.top_ids_raw,
                      top_logprobs_raw=seq.top_logprobs_raw, text=content,
                      tool_calls=[ToolCallOut(id=c.id, name=c.name, arguments=c.arguments) for c in calls]
                      if calls else None)

    def _reply(self, seq: Any, params: SamplingParams, parser: ToolParser | None,
               one_tool_call: bool) -> tuple[str | None, list[ToolCall] | None, bool]:
        """What a client sees of a completion: its text without the final stop token and without
        a stop string it ended on (as OpenAI returns it), the tool calls parsed from it, and
        whether calls were left out (``one_tool_call``)."""
        renderer = self.renderer
        assert renderer is not None
        ids = seq.tokens
        if ids and seq.stop_reason == "stop" and ids[-1] in renderer.stop_ids:
            ids = ids[:-1]
        text = renderer.decode(ids)
        if seq.stop_reason == "stop" and params.stop_strings:
            cut = min((i for i in (text.find(s) for s in params.stop_strings) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        if parser is None:
            return text, None, False
        turn = parser.parse(text)
        calls = turn.tool_calls[:1] if one_tool_call else turn.tool_calls
        return turn.content, calls or None, len(calls) < len(turn.tool_calls)

    def record_chat(self, session: Session, base: Boundary, suffix: np.ndarray, msgs: list[dict[str, Any]],
                    keys: list[bytes], full: str, tools: list[dict[str, Any]] | None, parser: ToolParser | None,
                    one_tool_call: bool, params: SamplingParams, resp: SampleResponse,
                    request_id: str, role: str | None = None) -> list[Choice]:
        """Store a chat turn (its new prompt tokens, then each sampled completion, of ``role`` if
        it names one) and index the positions a client's next request may resume from; returns
        the choices it answers."""
        store, renderer, sid = self.store, self.renderer, session.session_id
        assert renderer is not None
        if params.constraint is not None:
            session.constrained.add(request_id)
        kind = "prompt" if session.turns == 0 else "environment"
        prompt_end = store.append_turn(sid, suffix, kind=kind, parent=base.handle).handle
        session.boundaries[(keys[-1], True)] = Boundary(prompt_end, len(msgs), True, "")
        choices = []
        for seq in resp.sequences:
            leaf = self._append_sampled(session, seq, request_id, prompt_end, role)
            content, calls, cut = self._reply(seq, params, parser, one_tool_call)
            # The assistant message as the client will send it back with its history.
            reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if calls:
                reply["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                       for c in calls]
            tail = None if cut else assistant_tail(renderer, msgs, reply, seq.tokens, before=full, tools=tools,
                                                   parser=self.tool_parser)
            if tail is not None:
                session.boundaries[(_chain(keys[-1], reply), False)] = Boundary(leaf, len(msgs) + 1, False, tail)
            session.leaf = leaf
            choices.append(self._choice(seq, content, calls))
        session.turns += 1
        return choices

    def record_tokens(self, session: Session, prompt: bytes, resp: SampleResponse,
                      request_id: str, role: str | None = None) -> list[Choice]:
        """Store a token turn: its whole prompt (the trie keeps the prefix it holds), then each
        completion (of ``role`` if it names one)."""
        store, sid = self.store, session.session_id
        kind = "prompt" if session.turns == 0 else "environment"
        prompt_end = store.append_turn(sid, prompt, kind=kind).handle
        choices = []
        for seq in resp.sequences:
            session.leaf = self._append_sampled(session, seq, request_id, prompt_end, role)
            choices.append(self._choice(seq, None, None))
        session.turns += 1
        return choices

    def _append_sampled(self, session: Session, seq: Any, request_id: str, parent: int,
                        role: str | None = None) -> int:
        if not seq.tokens_raw:
            return parent
        end = self.store.append_turn(session.session_id, seq.tokens_raw, seq.logprobs_raw, seq.versions_raw,
                                     kind="sampled", request_id=request_id, parent=parent).handle
        # The trie keeps tokens, not how their generation ended; training needs to know
        # (a completion cut at max_tokens is filtered or penalised as overlong).
        session.stops[end] = seq.stop_reason
        if seq.logprobs_transform is not None:  # and which logprob it recorded, for the trainer's transform
            session.transforms[end] = seq.logprobs_transform
        if role is not None:  # whose it is, and how far back its tokens go, for the per-role export
            session.completion_roles[end] = (role, len(seq.tokens_raw) // 4)
        return end

    # -- rewards and the export ------------------------------------------------------------

    @staticmethod
    def reward(session: Session, value: float) -> None:
        """Attach ``value`` to the session's latest turn (the leaf of its trajectory)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise InvalidRequest("value", value, "must be a finite number")
        if session.leaf is None:
            raise InvalidRequest("value", value, "the session has no turn to reward yet")
        session.rewards[session.leaf] = float(value)

    def export(self, session: Session) -> SessionTrace:
        """The session's trajectories so far (nothing is dropped), with rewards, stops and transforms."""
        trajectories = self.store.export(session.session_id)
        latest = next((i for i, t in enumerate(trajectories) if t.leaf == session.leaf), None)
        stops, transforms = [], []
        for t in trajectories:
            ends = self.store.on_path(session.session_id, t.leaf, session.stops)
            stops.append({depth: session.stops[handle] for handle, depth in ends.items()})
            transforms.append({depth: session.transforms[handle] for handle, depth in ends.items()
                               if handle in session.transforms})
        trace = SessionTrace(session_id=session.session_id, trajectories=trajectories, latest=latest,
                             rewards=[session.rewards.get(t.leaf) for t in trajectories], turns=session.turns,
                             constrained=frozenset(session.constrained), tainted=session.tainted, stops=stops,
                             transforms=transforms)
        return self._split_roles(session, trace) if session.completion_roles else trace

    def _split_roles(self, session: Session, trace: SessionTrace) -> SessionTrace:
        """``trace`` with its per-role views (``SessionTrace.by_role``) and the untrainable roles'
        tokens out of its loss mask: each token is owned by the role of the completion that sampled it."""
        owned = session.completion_roles
        names = sorted({role for role, _ in owned.values()} | set(session.roles or ()))
        untrainable = frozenset(r for r, trains in (session.roles or {}).items() if not trains)
        masks: dict[str, list[bytes]] = {role: [] for role in names}
        kept: list[bytes] = []
        for t in trace.trajectories:
            owner = np.full(t.length, -1, dtype=np.int32)
            for handle, depth in self.store.on_path(session.session_id, t.leaf, owned).items():
                role, n = owned[handle]
                owner[depth - n:depth] = names.index(role)
            mask = np.frombuffer(t.loss_mask_raw, dtype=np.uint8)
            for k, role in enumerate(names):
                masks[role].append(np.where(owner == k, mask, 0).astype(np.uint8).tobytes())
            out = np.isin(owner, [names.index(r) for r in untrainable])
            kept.append(np.where(out, 0, mask).astype(np.uint8).tobytes())
        by_role = {role: msgspec.structs.replace(trace, trajectories=[
            msgspec.structs.replace(t, loss_mask_raw=m) for t, m in zip(trace.trajectories, masks[role])])
            for role in names}
        return msgspec.structs.replace(trace, by_role=by_role, untrainable=untrainable, trajectories=[
            msgspec.structs.replace(t, loss_mask_raw=m) for t, m in zip(trace.trajectories, kept)])
