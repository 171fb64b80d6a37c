"""Agent sessions' front: turns routed to a replica and submitted to its scheduler, and the parts that keep them.

A session is one agent's conversation. It is opened with an unguessable
token that every later request must carry; one session can neither read nor
extend another's trace. Its turns run on the replica the ``SessionRouter``
pinned it to, each validated and submitted by the engine (``Engine.submit_sample``), so each holds
a lease of the scheduler from admission to settlement: a weight install seals, drains
(or pauses) and reopens around it, and the session's next turn waits at the
gate and runs on the new version, every sampled token recording its version.
Sessions opened with a share key (the server's default) store a prompt that
other sessions sent already once, with a reference count
(``rlengine.trace.store``): a system prompt costs its tokens once, not once
per session, and no trace changes.

``SessionManager`` is what the IPC and HTTP servers call. It routes and
submits turns itself and owns one part per other job:

* ``SessionTable`` (``serve.retention``) - which sessions exist: open,
  authorize, retire, and expire them under a ``Retention`` policy;
* ``TraceCapture`` (``serve.capture``) - exact trace capture: a turn's
  prompt from the stored tokens, its recording, rewards, the export;
* ``TurnLeases`` (``serve.leases``) - the turns in flight: abandoning one
  whose client went away (aborted, its lease settled, the gate never
  poisoned; a session whose stream may have shown output is ``tainted``),
  aborting all at shutdown, the operators' unknown leases.

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
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from rlengine.constraints import json_whitespace, output_constraint
from rlengine.core.futures import RequestFuture
from rlengine.errors import ContextLengthExceeded, InvalidRequest
from rlengine.protocol import Choice, SessionGone, TurnAborted, Unsupported
from rlengine.render import ChatRenderer, check_tool_results, input_chars, normalize_messages, normalize_tools
from rlengine.serve.capture import Prepared, TraceCapture
from rlengine.serve.leases import TurnLeases
from rlengine.serve.retention import Retention, SessionTable
from rlengine.serve.router import SessionRouter
from rlengine.serve.session_types import Session, SessionTrace, ToolUse, TurnResult
from rlengine.tool_parsers import ToolParser
from rlengine.trace import TraceStore
from rlengine.types import ModelInput, SampleResponse, SamplingParams
from rlengine.validation import check_role

__all__ = ["MAX_SAMPLES", "ROLE_HEADER", "Retention", "Session", "SessionManager", "SessionTrace", "ToolUse", "TurnResult"]

MAX_SAMPLES = 64
"""Most completions (``n``) one turn may ask for."""

_OFFLOAD_CHARS = 8192
"""A chat turn this long (characters in), or longer, is rendered and tokenized on the render
thread: on the loop it would delay every other client by more than a few milliseconds (a
26,624-character prompt took 13 ms to tokenize here)."""

ROLE_HEADER = "X-RLEngine-Role"
"""The HTTP header naming the agent role of a turn in a session (``SessionManager.role_of``)."""

OnTokens = Callable[[int, list[int], list[float], int], None]

_FREE = ToolUse()


class SessionManager:
    """Sessions over the replicas of ``router``, traced in ``store``. Loop thread only.

    Why one class: it is the session layer's one front: the calls the servers and users make
    on its parts (``table``, ``capture``, ``leases``) stay its own, a line or two each."""

    def __init__(self, router: SessionRouter, store: TraceStore, renderer: ChatRenderer | None,
                 tool_parser: ToolParser | None = None, retention: Retention | None = None,
                 share: str | None = None) -> None:
        self.router = router
        self.store = store
        self.table = SessionTable(router, store, retention or Retention(), share)
        self.capture = TraceCapture(store, renderer, tool_parser)
        self.leases = TurnLeases(router)
        self.retention = self.table.retention
        """How long sessions and their traces are kept (``SessionTable`` applies it)."""
        self.share = share
        """The trace store's share key of every session opened here (``SessionTable.share``)."""
        self.offload_chars = _OFFLOAD_CHARS
        """Chat turns of this many characters or more are rendered and tokenized off the loop."""
        self._render_pool: ThreadPoolExecutor | None = None

    @property
    def renderer(self) -> ChatRenderer | None:
        """The model's chat template and tokenizer (None: token turns only); the capture's."""
        return self.capture.renderer

    @renderer.setter
    def renderer(self, renderer: ChatRenderer | None) -> None:
        self.capture.renderer = renderer

    @property
    def tool_parser(self) -> ToolParser | None:
        """How the model writes tool calls (None: its template renders none, so tools are refused)."""
        return self.capture.tool_parser

    # -- sessions (``SessionTable``) -------------------------------------------------------

    def open(self, session_id: str | None = None, roles: Mapping[str, bool] | None = None) -> Session:
        """A new session with a fresh token; ``session_id`` None picks an unguessable id. ``roles``
        declares the agent roles its turns may name (role -> trainable; see ``role_of``): an
        untrainable role's tokens are exported apart and never in the loss mask (``SessionTrace``)."""
        declared = None
        if roles is not None:
            declared = {check_role("roles", r, InvalidRequest): trains for r, trains in roles.items()}
            if not all(isinstance(trains, bool) for trains in declared.values()):
                raise InvalidRequest("roles", dict(roles), "each role maps to a bool (trainable)")
        session = self.table.open(session_id)
        session.roles = declared
        return session

    @staticmethod
    def role_of(session: Session | None, value: str | None, field: str = ROLE_HEADER) -> str | None:
        """The role a turn names (``value``, None: none), checked (``field`` names it in the error): a
        valid role name, one the session declared if it declared roles (a turn of such a session must
        name one), and never on a turn without a session (nothing would record it)."""
        if session is None:
            if value is not None:
                raise InvalidRequest(field, value, "names the role of a turn in a session; this request has none")
            return None
        if value is None:
            if session.roles is not None:
                raise InvalidRequest(field, None, f"required: session {session.session_id!r} declares the roles "
                                     f"{', '.join(sorted(session.roles))}")
            return None
        return check_role(field, value, InvalidRequest, session.roles)

    def authorize(self, session_id: Any, token: Any, field: str = "token") -> Session:
        """The live session ``session_id`` if ``token`` is its token; raises otherwise
        (``field``: what the wire calls the token, for the message)."""
        return self.table.authorize(session_id, token, field)

    def known(self, session_id: str) -> bool:
        """``session_id`` names a session opened here (live, or retired and still remembered)."""
        return self.table.known(session_id)

    def retire(self, session_id: str) -> None:
        """End a session: turns in flight are aborted (not recorded), later requests
        get ``gone``; its trace waits for ``collect``."""
        self.table.retire(session_id)

    def close(self, session: Session) -> None:
        """The client ends its own session (as ``retire``)."""
        self.table.retire(session.session_id)

    def collect(self, session_id: str) -> SessionTrace:
        """A session's trace, dropped from the store (a live session is retired first)."""
        session = self.table.take(session_id)
        trace = self.capture.export(session)
        self.store.drop(session_id)
        return trace

    def sweep(self, now: float | None = None) -> int:
        """Apply the retention policy (``Retention``, see ``SessionTable.sweep``); returns how many
        sessions it ended or freed."""
        return self.table.sweep(now)

    def retired(self) -> list[str]:
        """Retired sessions whose traces await ``collect``."""
        return self.table.retired()

    def live(self) -> list[str]:
        return self.table.live()

    # -- rewards and traces (``TraceCapture``) ---------------------------------------------

    def reward(self, session: Session, value: float) -> None:
        """Attach ``value`` to the session's latest turn (the leaf of its trajectory)."""
        self.capture.reward(session, value)

    def trace(self, session: Session) -> SessionTrace:
        """The session's trajectories so far (nothing is dropped)."""
        return self.capture.export(session)

    # -- turns in flight (``TurnLeases``) --------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    def abandon(self, request_id: str, reason: str, *, output_sent: bool = False) -> None:
        """The client of turn ``request_id`` went away before its reply: the turn is aborted
        (nothing recorded, its lease settled, the gate clean); with ``output_sent`` (something
        streamed may have reached the client) its session is tainted."""
        self.leases.abandon(request_id, reason, output_sent=output_sent)

    def unknown_leases(self) -> list[dict[str, Any]]:
        """Every lease with an unknown outcome, on every replica (for operators)."""
        return self.leases.unknown_leases()

    def write_off_lease(self, replica: int, lease_id: int) -> RequestFuture[Any]:
        """An operator gives up on one unknown outcome now (``TurnLeases.write_off_lease``)."""
        return self.leases.write_off_lease(replica, lease_id)

    def abort_all(self) -> None:
        """Abort every turn in flight (shutdown): each settles as aborted, nothing recorded."""
        self.leases.abort_all()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the render thread (after the turns it is preparing)."""
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=False)

    # -- turns: routed and submitted -------------------------------------------------------

    def chat(self, session: Session | None, messages: Any, params: SamplingParams, n: int = 1,
             on_tokens: OnTokens | None = None, tools: Any = None, tool_use: ToolUse = _FREE,
             affinity: str | None = None, max_tokens_field: str | None = None,
             role: str | None = None) -> RequestFuture[TurnResult]:
        """Sample a chat turn; ``session`` None: a stateless request (nothing traced). ``role``
        (checked by ``role_of``) is the agent role its completions are recorded under.

        ``tools`` (OpenAI function tools) are rendered by the model's chat
        template; each completion's tool calls are parsed from its text
        (``tool_use.choice`` none: not). ``tool_use`` also says what the
        output is forced to be: a required or named call, a JSON response
        (``rlengine.constraints``, sampled under a constraint); with
        ``parallel`` False at most the first call is returned, and a
        completion that made more is not matched back when the conversation
        continues: it branches. ``affinity`` (a stateless request only) keeps
        requests that name the same key on one replica. With ``max_tokens_field`` (the
        HTTP APIs' name for ``params.max_tokens``) a ``max_tokens`` the context cannot hold
        after the prompt is refused (``ContextLengthExceeded`` naming that field), as OpenAI
        and Anthropic refuse it; without, the completion ends at the context (stop reason
        ``length``), as the engine's own API and vLLM's engine end it."""
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

        def launch(prep: Prepared) -> RequestFuture[TurnResult]:
            return self._launch(session, prep, msgs, tools, parser, one_tool_call, params, n, on_tokens, affinity,
                                max_tokens_field, role)

        if chars < self.offload_chars:
            return launch(self.capture.prepare(session, renderer, msgs, tools))
        return self._prepare_off_loop(session, renderer, msgs, tools, launch)

    def _prepare_off_loop(self, session: Session | None, renderer: ChatRenderer, msgs: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None,
                          launch: Callable[[Prepared], RequestFuture[TurnResult]]) -> RequestFuture[TurnResult]:
        """``TraceCapture.prepare`` on the render thread, then ``launch`` back on the loop; the future
        handed out at once becomes the turn's (``RequestFuture.adopt``). Abandoned or aborted
        before the turn exists, it settles as aborted and nothing is submitted."""
        out = self.leases.placeholder()
        pending_id = out.request_id
        if self._render_pool is None:
            self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="rlengine-render")
        job = asyncio.get_running_loop().run_in_executor(self._render_pool, self.capture.prepare, session,
                                                         renderer, msgs, tools)

        def ready(job: asyncio.Future[Prepared]) -> None:
            if self.leases.claim(pending_id) is None:
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

    def _launch(self, session: Session | None, prep: Prepared, msgs: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, parser: ToolParser | None, one_tool_call: bool,
                params: SamplingParams, n: int, on_tokens: OnTokens | None,
                affinity: str | None, max_tokens_field: str | None,
                role: str | None = None) -> RequestFuture[TurnResult]:
        """Submit a prepared chat turn (loop thread)."""
        capture = self.capture
        if session is None:

            def reply(resp: SampleResponse, request_id: str) -> list[Choice]:
                return capture.replies(resp, params, parser, one_tool_call)

            return self._submit(None, prep.ids.tobytes(), params, n, on_tokens, reply, affinity, max_tokens_field)
        base = prep.base
        assert base is not None
        prompt = self.store.path_tokens(session.session_id, base.handle).tobytes() + prep.ids.tobytes()

        def record(resp: SampleResponse, request_id: str) -> list[Choice]:
            return capture.record_chat(session, base, prep.ids, msgs, prep.keys, prep.full, tools, parser,
                                       one_tool_call, params, resp, request_id, role)

        return self._submit(session, prompt, params, n, on_tokens, record, None, max_tokens_field)

    def generate(self, session: Session | None, prompt: bytes, params: SamplingParams, n: int = 1,
                 on_tokens: OnTokens | None = None, *, text: bool = False, affinity: str | None = None,
                 max_tokens_field: str | None = None, role: str | None = None) -> RequestFuture[TurnResult]:
        """Sample a token turn (of ``role``, as for ``chat``): ``prompt`` is the whole conversation as raw int32 (the
        engine checks it, like every prompt); ``session`` None: a stateless one (nothing
        traced; ``affinity`` as for ``chat``). With ``text`` each choice also carries its text
        as a client sees it (``TraceCapture.replies``: without the final stop token or stop
        string; the renderer's tokenizer decodes it). ``max_tokens_field`` as for ``chat``."""
        capture = self.capture
        if (text or session is None) and capture.renderer is None:
            raise Unsupported("generate: text, and stateless token turns, need a tokenizer; this backend has none")

        def record(resp: SampleResponse, request_id: str) -> list[Choice]:
            choices = None if session is None else capture.record_tokens(session, prompt, resp, request_id, role)
            return capture.replies(resp, params, None, False) if text or choices is None else choices

        return self._submit(session, prompt, params, n, on_tokens, record, affinity, max_tokens_field)

    def _submit(self, session: Session | None, prompt: bytes, params: SamplingParams, n: int,
                on_tokens: OnTokens | None, record: Callable[[SampleResponse, str], list[Choice]],
                affinity: str | None = None, max_tokens_field: str | None = None) -> RequestFuture[TurnResult]:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise InvalidRequest("n", n, f"must be an integer in [1, {MAX_SAMPLES}]")
        router, leases = self.router, self.leases
        self.table.sweep()
        if session is not None:
            self.table.touch(session)
            replica = router.pin(session.session_id)
        else:
            replica = router.least_loaded() if affinity is None else router.affine(affinity)
        engine = router.engines[replica]
        spec = engine.validate_sample(ModelInput(tokens_raw=prompt), n, params)
        if max_tokens_field is not None and params.max_tokens is not None:
            context, used = engine.backend.max_model_len, len(prompt) // 4
            if used + params.max_tokens > context:
                raise ContextLengthExceeded(max_tokens_field, params.max_tokens, context,
                                            f"you requested {used + params.max_tokens} tokens ({used} in the prompt, "
                                            f"{params.max_tokens} in the completion); reduce the prompt or "
                                            f"{max_tokens_field}")
        sample = engine.submit_sample(spec, session_id=None if session is None else session.session_id,
                                      on_tokens=on_tokens)
        request_id = sample.request_id
        router.started(replica)
        leases.hold(request_id, replica, session)

        def settled(_f: RequestFuture[TurnResult]) -> None:
            router.finished(replica)
            leases.release(request_id, session)
            if session is not None:
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
