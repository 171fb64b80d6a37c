"""Agent sessions: authorization, exact trace capture, turns through the gate, retirement.

A session is one agent's conversation. It is opened with an unguessable
token that every later request must carry; one session can neither read nor
extend another's trace. Its turns run on the replica the ``SessionRouter``
pinned it to, each validated and submitted by the engine (``Engine.submit_sample``), so each holds
a gate lease from admission to settlement: a weight install seals, drains
(or pauses) and reopens around it, and the session's next turn waits at the
gate and runs on the new version, every sampled token recording its version.

Trace capture is exact. The prompt of turn k is the stored token path of the
conversation so far (every earlier prompt and the exact sampled completion
tokens) plus only the newly rendered suffix (``rlengine.render``):
earlier assistant text is never re-tokenized. Chat sessions index their
stored positions by a hash chain over the messages before them (``Boundary``
per message prefix), so a client that resends its history is matched
message by message; a client whose history diverges (an edited or truncated
conversation) resumes from the last matching position and branches there in
the trie (at the exact token, since the trie shares equal tokens). Token
sessions (``generate``) send their whole prompt and the trie keeps whatever
prefix it already holds. Sessions opened with a share key (the server's
default) store a prompt that other sessions sent already once, with a
reference count (``rlengine.trace.store``): a system prompt costs its tokens
once, not once per session, and no trace changes.

A turn is recorded when it completes, in one loop callback: a rejected or
aborted turn records nothing. (One exception: if the trace store's memory
bound is reached between storing a turn's prompt and its sampled tokens,
the prompt stays, a branch with nothing to train on; the client gets
``unavailable``.) A turn whose client went away mid-generation
(``abandon``) is aborted at once, on every wire alike: it records nothing,
and its lease settles as aborted in the same loop callback, so the gate is
never poisoned by it and the next weight install goes ahead. If output may
have reached the client first (a streamed turn), its session is marked
``tainted``: the client may have seen, and may build on, tokens the trace
lacks. (Nothing about that turn can still change what is recorded, which is
what a poisoned gate guards against: the backend stops generating it in the
same callback.)

Loop thread only (the engines' loop), like the trace store under it, with
one exception: a chat turn of ``_OFFLOAD_CHARS`` characters or more is
rendered and tokenized on a render thread (the tokenizer releases the GIL;
the loop keeps serving everyone else meanwhile), then submitted back on the
loop; until then its future is a placeholder that an abandon or an abort
settles as aborted, with nothing submitted. Inputs beyond what the model's
context could hold are refused before any rendering. This module does no
I/O: the IPC and HTTP servers translate wire messages into calls here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec
import numpy as np

from rlengine.constraints import json_whitespace, output_constraint
from rlengine.core.futures import RequestFuture
from rlengine.errors import ConfigurationError, ContextLengthExceeded, InvalidRequest
from rlengine.protocol import (
    Choice,
    SessionExists,
    SessionForbidden,
    SessionGone,
    SessionLimit,
    SessionNotFound,
    ToolCallOut,
    TurnAborted,
    Unsupported,
)
from rlengine.render import (
    Boundary,
    ChatRenderer,
    assistant_tail,
    check_tool_results,
    input_chars,
    message_key,
    normalize_messages,
    normalize_tools,
    suffix_text,
)
from rlengine.serve.router import SessionRouter
from rlengine.tool_parsers import ToolCall, ToolParser
from rlengine.trace import TraceStore, Trajectory
from rlengine.types import LogprobTransform, ModelInput, SampleResponse, SamplingParams

__all__ = ["MAX_SAMPLES", "Retention", "Session", "SessionManager", "SessionTrace", "ToolUse", "TurnResult"]

MAX_SAMPLES = 64
"""Most completions (``n``) one turn may ask for."""

_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_OFFLOAD_CHARS = 8192
"""A chat turn this long (characters in), or longer, is rendered and tokenized on the render
thread: on the loop it would delay every other client by more than a few milliseconds (a
26,624-character prompt took 13 ms to tokenize here)."""
_encode_message = msgspec.msgpack.Encoder().encode

OnTokens = Callable[[int, list[int], list[float], int], None]
log = logging.getLogger("rlengine.serve")


class TurnResult(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A completed turn, as recorded."""

    request_id: str
    replica: int
    prompt_tokens: int
    choices: list[Choice]


class Retention(msgspec.Struct, kw_only=True, frozen=True):
    """How long sessions and their traces are kept (``SessionManager.sweep``); every bound resolves
    without an operator, so a long-running server's memory stays bounded."""

    max_open: int = 100_000
    """Open sessions at most; one more is refused (``SessionLimit``)."""
    idle_ttl_s: float = 3600.0
    """A live session with no turn for this long is retired (later requests: ``gone``)."""
    closed_ttl_s: float = 600.0
    """A retired session's trace is kept this long for ``collect``, then freed."""
    max_closed: int = 10_000
    """Retired sessions' traces kept at most (the oldest are freed first)."""
    store_high_water: float = 0.9
    """While the trace store holds more than this share of its bound, retired traces are freed,
    oldest first, before a new session or turn is refused for lack of room."""

    def __post_init__(self) -> None:
        for name in ("max_open", "max_closed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigurationError(f"{name}={v!r}: must be an integer >= 1")
        for name in ("idle_ttl_s", "closed_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name}={getattr(self, name)!r}: must be > 0")
        if not 0 < self.store_high_water <= 1:
            raise ConfigurationError(f"store_high_water={self.store_high_water!r}: must be in (0, 1]")


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


_FREE = ToolUse()


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


class Session:
    """One agent conversation (loop thread only)."""

    __slots__ = (
        "active_at",
        "boundaries",
        "constrained",
        "in_flight",
        "leaf",
        "retired",
        "rewards",
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
        self.tainted = False
        """A turn's client went away after output may have reached it: what the client saw
        (and may build on) was not recorded (``SessionTrace.tainted``)."""

    def __repr__(self) -> str:
        return f"<Session {self.session_id} turns={self.turns}{' retired' if self.retired else ''}>"


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


class _Prepared(NamedTuple):
    """A chat turn's prompt, rendered and tokenized (``SessionManager._prepare``)."""

    full: str
    """The whole conversation rendered, with the generation prompt."""
    keys: list[bytes]
    """Its prefix keys (empty for a stateless turn)."""
    base: Boundary | None
    """The stored position it continues (None: stateless)."""
    ids: np.ndarray
    """The tokens after ``base`` (all of them when stateless)."""


class SessionManager:
    """Sessions over the replicas of ``router``, traced in ``store``. Loop thread only."""

    def __init__(self, router: SessionRouter, store: TraceStore, renderer: ChatRenderer | None,
                 tool_parser: ToolParser | None = None, retention: Retention | None = None,
                 share: str | None = None) -> None:
        self.router = router
        self.share = share
        """The trace store's share key of every session opened here (None: each a tree of its own)."""
        self.retention = retention or Retention()
        self.store = store
        self.renderer = renderer
        self.tool_parser = tool_parser
        """How the model writes tool calls (None: its template renders none, so tools are refused)."""
        self._live: OrderedDict[str, Session] = OrderedDict()
        """Least recently active first (idle expiry takes from the front)."""
        self._retired: dict[str, Session] = {}
        """Retired sessions whose traces await ``collect``, in retirement order."""
        self._turns: dict[str, tuple[int, Session | None]] = {}
        """Every turn in flight: request id -> (replica, session or None)."""
        self.offload_chars = _OFFLOAD_CHARS
        """Chat turns of this many characters or more are rendered and tokenized off the loop."""
        self._preparing: dict[str, RequestFuture[TurnResult]] = {}
        """Turns whose prompt the render thread is preparing (not yet submitted), by placeholder id."""
        self._prepared = 0
        self._render_pool: ThreadPoolExecutor | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def open(self, session_id: str | None = None) -> Session:
        """A new session with a fresh token; ``session_id`` None picks an unguessable id."""
        if session_id is None:
            session_id = f"s-{secrets.token_hex(12)}"
        elif not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id) or not session_id.strip("."):
            # Only dots ("." and "..") would name path segments in URLs and run directories.
            raise InvalidRequest("session_id", session_id, "must be 1-128 characters of [A-Za-z0-9._:@-], "
                                 "not only dots")
        if session_id in self._retired or self.router.is_gone(session_id):
            raise SessionGone(f"session_id={session_id!r}: a session with this id was retired; ids are not reused")
        if session_id in self._live or session_id in self.store:
            raise SessionExists(f"session_id={session_id!r}: a session with this id exists")
        self.sweep()
        if len(self._live) >= self.retention.max_open:
            raise SessionLimit(f"{len(self._live)} sessions are open, the most this server keeps (max_open_sessions); "
                               "close some")
        session = Session(session_id, secrets.token_urlsafe(24), self.store.open(session_id, share=self.share))
        self._live[session_id] = session
        return session

    def authorize(self, session_id: Any, token: Any, field: str = "token") -> Session:
        """The live session ``session_id`` if ``token`` is its token; raises otherwise
        (``field``: what the wire calls the token, for the message)."""
        session = self._live.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            if isinstance(session_id, str) and (session_id in self._retired or self.router.is_gone(session_id)):
                raise SessionGone(f"session_id={session_id!r}: the session was closed or retired")
            raise SessionNotFound(f"session_id={session_id!r}: no such session")
        if not isinstance(token, str) or not token:
            raise SessionForbidden(f"{field}={token!r}: session_id={session_id!r} names a session, and a session's "
                                   "requests must carry its token")
        if not hmac.compare_digest(token.encode(), session.token.encode()):
            raise SessionForbidden(f"{field}: not the token of session_id={session_id!r}")
        return session

    def known(self, session_id: str) -> bool:
        """``session_id`` names a session opened here (live, or retired and still remembered)."""
        return session_id in self._live or session_id in self._retired or self.router.is_gone(session_id)

    def retire(self, session_id: str) -> None:
        """End a session: turns in flight are aborted (not recorded), later requests
        get ``gone``; its trace waits for ``collect``."""
        session = self._live.pop(session_id, None)
        if session is None:
            if session_id in self._retired:
                return
            raise SessionNotFound(f"session_id={session_id!r}: no such live session")
        session.retired = True
        session.active_at = time.monotonic()
        self._retired[session_id] = session
        for request_id, replica in list(session.in_flight.items()):
            self.router.engines[replica].abort(request_id)
        self.router.retire(session_id)

    def close(self, session: Session) -> None:
        """The client ends its own session (as ``retire``)."""
        self.retire(session.session_id)

    def collect(self, session_id: str) -> SessionTrace:
        """A session's trace, dropped from the store (a live session is retired first)."""
        if session_id in self._live:
            self.retire(session_id)
        session = self._retired.pop(session_id, None)
        if session is None:
            raise SessionNotFound(f"session_id={session_id!r}: no such session to collect")
        trace = self._export(session)
        self.store.drop(session_id)
        return trace

    def sweep(self, now: float | None = None) -> int:
        """Apply the retention policy (``Retention``); returns how many sessions it ended or freed.

        Live sessions idle (no turn started or finished, none in flight) for
        ``idle_ttl_s`` are retired; retired sessions' traces are freed once
        older than ``closed_ttl_s``, beyond the newest ``max_closed``, or,
        oldest first, while the trace store is over ``store_high_water`` of
        its bound. Runs when a session opens and a turn starts (O(what it frees))."""
        now = time.monotonic() if now is None else now
        policy, done = self.retention, 0
        live = self._live
        while live:
            session = next(iter(live.values()))
            if now - session.active_at < policy.idle_ttl_s:
                break
            if session.in_flight:
                live.move_to_end(session.session_id)  # busy, not idle: look again later
                session.active_at = now
                continue
            log.info("rlengine.serve: session %s idle for %.0f s; retired", session.session_id, policy.idle_ttl_s)
            self.retire(session.session_id)
            done += 1
        retired = self._retired
        limit = self.store.max_bytes * policy.store_high_water if self.store.max_bytes else None
        while retired:
            session = next(iter(retired.values()))
            if (now - session.active_at < policy.closed_ttl_s and len(retired) <= policy.max_closed
                    and (limit is None or self.store.memory_bytes <= limit)):
                break
            del retired[session.session_id]
            self.store.drop(session.session_id)
            done += 1
        return done

    def retired(self) -> list[str]:
        """Retired sessions whose traces await ``collect``."""
        return list(self._retired)

    def live(self) -> list[str]:
        return list(self._live)

    # -- turns ----------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._turns) + len(self._preparing)

    def shutdown(self) -> None:
        """Stop the render thread (after the turns it is preparing)."""
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=False)

    def chat(self, session: Session | None, messages: Any, params: SamplingParams, n: int = 1,
             on_tokens: OnTokens | None = None, tools: Any = None, tool_use: ToolUse = _FREE,
             affinity: str | None = None) -> RequestFuture[TurnResult]:
        """Sample a chat turn; ``session`` None: a stateless request (nothing traced).

        ``tools`` (OpenAI function tools) are rendered by the model's chat
        template; each completion's tool calls are parsed from its text
        (``tool_use.choice`` none: not). ``tool_use`` also says what the
        output is forced to be: a required or named call, a JSON response
        (``rlengine.constraints``, sampled under a constraint); with
        ``parallel`` False at most the first call is returned, and a
        completion that made more is not matched back when the conversation
        continues: it branches. ``affinity`` (a stateless request only) keeps
        requests that name the same key on one replica."""
        renderer = self.renderer
        if renderer is None:
            raise Unsupported("chat: this backend has no tokenizer and chat template; use token turns (generate)")
        context = self.router.engines[0].backend.max_model_len
        chars = input_chars(messages, tools)
        if chars > context * renderer.max_token_chars:
            # Refused before any rendering or tokenization: nothing on the loop grows with it.
            raise ContextLengthExceeded("messages", f"{chars} characters", context, f"{chars} characters cannot fit "
                                        f"in it (a token holds at most {renderer.max_token_chars} characters)")
        msgs = normalize_messages(messages)
        tools = normalize_tools(tools)
        check_tool_results(msgs)
        if tools and self.tool_parser is None:
            raise InvalidRequest("tools", len(tools), "the model's chat template writes no tool calls rlengine can "
                                 "read (tool_parser); serve a model whose template renders tools")
        parser = self.tool_parser if tools and tool_use.choice != "none" else None
        one_tool_call = not tool_use.parallel
        constraint = output_constraint(self.tool_parser, tools, tool_use.choice, tool_use.forced,
                                       parallel=tool_use.parallel, schema=tool_use.schema,
                                       whitespace=json_whitespace(tool_use.json_whitespace))
        if constraint is not None:
            params = msgspec.structs.replace(params, constraint=constraint)

        def launch(prep: _Prepared) -> RequestFuture[TurnResult]:
            return self._launch(session, prep, msgs, tools, parser, one_tool_call, params, n, on_tokens, affinity)

        if chars < self.offload_chars:
            return launch(self._prepare(session, renderer, msgs, tools))
        return self._prepare_off_loop(session, renderer, msgs, tools, launch)

    def _prepare(self, session: Session | None, renderer: ChatRenderer, msgs: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> _Prepared:
        """Render and tokenize a chat turn's prompt: from the session's longest stored match on.
        Pure but for reading ``session.boundaries``: it may run on a worker thread."""
        full = renderer.render(msgs, True, tools)
        if session is None:
            return _Prepared(full, [], None, np.asarray(renderer.encode(full), dtype=np.int32))
        keys = _prefix_keys(msgs, tools)
        base, text = self._resume_point(session, renderer, msgs, keys, full, tools)
        return _Prepared(full, keys, base, np.asarray(renderer.encode(text), dtype=np.int32))

    def _prepare_off_loop(self, session: Session | None, renderer: ChatRenderer, msgs: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None,
                          launch: Callable[[_Prepared], RequestFuture[TurnResult]]) -> RequestFuture[TurnResult]:
        """``_prepare`` on the render thread, then ``launch`` back on the loop; the future
        handed out at once becomes the turn's (``RequestFuture.adopt``). Abandoned or aborted
        before the turn exists, it settles as aborted and nothing is submitted."""
        self._prepared += 1
        pending_id = f"preparing-{self._prepared}"
        out: RequestFuture[TurnResult] = RequestFuture(pending_id, self._drop_preparing)
        self._preparing[pending_id] = out
        if self._render_pool is None:
            self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="rlengine-render")
        job = asyncio.get_running_loop().run_in_executor(self._render_pool, self._prepare, session, renderer,
                                                         msgs, tools)

        def ready(job: asyncio.Future[_Prepared]) -> None:
            if self._preparing.pop(pending_id, None) is None:
                return  # abandoned meanwhile: settled already
            try:
                prep = job.result()
                if session is not None and session.retired:
                    raise SessionGone(f"session_id={session.session_id!r}: retired while its prompt was rendered")
                out.adopt(launch(prep))
            except Exception as exc:  # noqa: BLE001 - the turn's outcome, settled once
                out.set_exception(exc)

        job.add_done_callback(ready)
        return out

    def _drop_preparing(self, pending_id: str) -> None:
        """Abort a turn whose prompt is still being rendered: it settles now, and is never submitted."""
        out = self._preparing.pop(pending_id, None)
        if out is not None:
            out.set_exception(TurnAborted(f"turn {pending_id} was aborted before its prompt was rendered; "
                                          "nothing was recorded"))

    def _launch(self, session: Session | None, prep: _Prepared, msgs: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, parser: ToolParser | None, one_tool_call: bool,
                params: SamplingParams, n: int, on_tokens: OnTokens | None,
                affinity: str | None) -> RequestFuture[TurnResult]:
        """Submit a prepared chat turn (loop thread)."""
        if session is None:

            def reply(resp: SampleResponse, request_id: str) -> list[Choice]:
                return [self._choice(seq, *self._reply(seq, params, parser, one_tool_call)[:2])
                        for seq in resp.sequences]

            return self._submit(None, prep.ids.tobytes(), params, n, on_tokens, reply, affinity)
        base = prep.base
        assert base is not None
        prompt = self.store.path_tokens(session.session_id, base.handle).tobytes() + prep.ids.tobytes()

        def record(resp: SampleResponse, request_id: str) -> list[Choice]:
            return self._record_chat(session, base, prep.ids, msgs, prep.keys, prep.full, tools, parser,
                                     one_tool_call, params, resp, request_id)

        return self._submit(session, prompt, params, n, on_tokens, record)

    def generate(self, session: Session, prompt: bytes, params: SamplingParams, n: int = 1,
                 on_tokens: OnTokens | None = None) -> RequestFuture[TurnResult]:
        """Sample a token turn: ``prompt`` is the whole conversation as raw int32 (the
        engine checks it, like every prompt)."""

        def record(resp: SampleResponse, request_id: str) -> list[Choice]:
            return self._record_tokens(session, prompt, resp, request_id)

        return self._submit(session, prompt, params, n, on_tokens, record)

    def _resume_point(self, session: Session, renderer: ChatRenderer, msgs: list[dict[str, Any]],
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

    def _submit(self, session: Session | None, prompt: bytes, params: SamplingParams, n: int,
                on_tokens: OnTokens | None, record: Callable[[SampleResponse, str], list[Choice]],
                affinity: str | None = None) -> RequestFuture[TurnResult]:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise InvalidRequest("n", n, f"must be an integer in [1, {MAX_SAMPLES}]")
        router = self.router
        self.sweep()
        if session is not None:
            session.active_at = time.monotonic()
            self._live.move_to_end(session.session_id)
            replica = router.pin(session.session_id)
        else:
            replica = router.least_loaded() if affinity is None else router.affine(affinity)
        engine = router.engines[replica]
        spec = engine.validate_sample(ModelInput(tokens_raw=prompt), n, params)
        sample = engine.submit_sample(spec, session_id=None if session is None else session.session_id,
                                      on_tokens=on_tokens)
        request_id = sample.request_id
        router.started(replica)
        self._turns[request_id] = (replica, session)
        if session is not None:
            session.in_flight[request_id] = replica

        def settled(_f: RequestFuture[TurnResult]) -> None:
            router.finished(replica)
            self._turns.pop(request_id, None)
            if session is not None:
                session.in_flight.pop(request_id, None)
                session.active_at = time.monotonic()

        def finish(resp: SampleResponse) -> TurnResult:
            if session is not None and session.retired:
                raise SessionGone(f"session_id={session.session_id!r}: retired while turn {request_id} ran")
            if any(seq.stop_reason == "abort" for seq in resp.sequences):
                raise TurnAborted(f"turn {request_id} was aborted (server shutdown); nothing was recorded")
            return TurnResult(request_id=request_id, replica=replica, prompt_tokens=len(prompt) // 4,
                              choices=record(resp, request_id))

        # Recording renders, tokenizes and stores in the trie: out of the
        # sampler's settlement chain, in a callback of its own (see core.futures).
        # The turn is in flight until it is recorded and its result settled.
        turn = sample.then(finish, defer=True)
        turn.add_done_callback(settled)
        return turn

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

    def _record_chat(self, session: Session, base: Boundary, suffix: np.ndarray, msgs: list[dict[str, Any]],
                     keys: list[bytes], full: str, tools: list[dict[str, Any]] | None, parser: ToolParser | None,
                     one_tool_call: bool, params: SamplingParams, resp: SampleResponse,
                     request_id: str) -> list[Choice]:
        store, renderer, sid = self.store, self.renderer, session.session_id
        assert renderer is not None
        if params.constraint is not None:
            session.constrained.add(request_id)
        kind = "prompt" if session.turns == 0 else "environment"
        prompt_end = store.append_turn(sid, suffix, kind=kind, parent=base.handle).handle
        session.boundaries[(keys[-1], True)] = Boundary(prompt_end, len(msgs), True, "")
        choices = []
        for seq in resp.sequences:
            leaf = self._append_sampled(session, seq, request_id, prompt_end)
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

    def _record_tokens(self, session: Session, prompt: bytes, resp: SampleResponse,
                       request_id: str) -> list[Choice]:
        store, sid = self.store, session.session_id
        kind = "prompt" if session.turns == 0 else "environment"
        prompt_end = store.append_turn(sid, prompt, kind=kind).handle
        choices = []
        for seq in resp.sequences:
            session.leaf = self._append_sampled(session, seq, request_id, prompt_end)
            choices.append(self._choice(seq, None, None))
        session.turns += 1
        return choices

    def _append_sampled(self, session: Session, seq: Any, request_id: str, parent: int) -> int:
        if not seq.tokens_raw:
            return parent
        end = self.store.append_turn(session.session_id, seq.tokens_raw, seq.logprobs_raw, seq.versions_raw,
                                     kind="sampled", request_id=request_id, parent=parent).handle
        # The trie keeps tokens, not how their generation ended; training needs to know
        # (a completion cut at max_tokens is filtered or penalised as overlong).
        session.stops[end] = seq.stop_reason
        if seq.logprobs_transform is not None:  # and which logprob it recorded, for the trainer's transform
            session.transforms[end] = seq.logprobs_transform
        return end

    def abandon(self, request_id: str, reason: str, *, output_sent: bool = False) -> None:
        """The client of turn ``request_id`` went away before its reply (see the module docstring):
        the turn is aborted (nothing recorded, its lease settled, the gate clean); with
        ``output_sent`` (something streamed may have reached the client) its session is tainted."""
        if request_id in self._preparing:
            self._drop_preparing(request_id)  # not submitted yet: nothing can have reached the client
            return
        entry = self._turns.get(request_id)
        if entry is None:
            return
        replica, session = entry
        if output_sent and session is not None and not session.retired:
            session.tainted = True
        log.debug("rlengine.serve: turn %s abandoned: %s", request_id, reason)
        self.router.engines[replica].abort(request_id)

    def unknown_leases(self) -> list[dict[str, Any]]:
        """Every lease with an unknown outcome, on every replica (for operators)."""
        return [{"replica": replica, "lease_id": lease.lease_id, "session_id": lease.session_id,
                 "request_id": lease.request_id, "reason": lease.reason}
                for replica, engine in enumerate(self.router.engines) for lease in engine.gate.unknown_leases()]

    def write_off_lease(self, replica: int, lease_id: int) -> RequestFuture[Any]:
        """An operator gives up on one unknown outcome now (a lease marked unknown by an embedder
        or a failing replica: client disconnects never leave one)."""
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < len(self.router.engines):
            raise InvalidRequest("replica", replica, f"must be in [0, {len(self.router.engines)})")
        return self.router.engines[replica].write_off(lease_id)

    def abort_all(self) -> None:
        """Abort every turn in flight (shutdown): each settles as aborted, nothing recorded."""
        for request_id, (replica, _session) in list(self._turns.items()):
            self.router.engines[replica].abort(request_id)
        for pending_id in list(self._preparing):
            self._drop_preparing(pending_id)
        self.shutdown()

    # -- rewards and traces -----------------------------------------------------------------

    def reward(self, session: Session, value: float) -> None:
        """Attach ``value`` to the session's latest turn (the leaf of its trajectory)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise InvalidRequest("value", value, "must be a finite number")
        if session.leaf is None:
            raise InvalidRequest("value", value, "the session has no turn to reward yet")
        session.rewards[session.leaf] = float(value)

    def trace(self, session: Session) -> SessionTrace:
        """The session's trajectories so far (nothing is dropped)."""
        return self._export(session)

    def _export(self, session: Session) -> SessionTrace:
        trajectories = self.store.export(session.session_id)
        latest = next((i for i, t in enumerate(trajectories) if t.leaf == session.leaf), None)
        stops, transforms = [], []
        for t in trajectories:
            ends = self.store.on_path(session.session_id, t.leaf, session.stops)
            stops.append({depth: session.stops[handle] for handle, depth in ends.items()})
            transforms.append({depth: session.transforms[handle] for handle, depth in ends.items()
                               if handle in session.transforms})
        return SessionTrace(session_id=session.session_id, trajectories=trajectories, latest=latest,
                            rewards=[session.rewards.get(t.leaf) for t in trajectories], turns=session.turns,
                            constrained=frozenset(session.constrained), tainted=session.tainted, stops=stops,
                            transforms=transforms)

