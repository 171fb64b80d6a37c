"""Streamed turns over HTTP: one server-sent-event loop for every API, bounded writes, abandon on disconnect.

Each API spells its events (a ``StreamDialect``: ``ChatChunks``,
``anthropic.MessageEvents``, ``responses.ResponseEvents``); ``TurnStreamer``
runs the turn under it. The headers wait for the first tokens, so a request
the backend refuses (a constraint it cannot compile) still gets its error
status. Text that may turn out to be a tool call's markup, or the stop string
the reply ends before, is held back until the turn's end settles it
(``ContentStream``). A client that disconnects, or keeps its connection but
reads nothing for ``write_stall_timeout_s``, abandons the turn
(``SessionManager.abandon``): it is aborted and its lease settled; a session
whose stream had sent output is marked tainted.

Runs on the engine's loop and must not block it; it neither parses requests
nor authenticates (``serve.http`` and ``serve.http_turns`` do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from rlengine.core.futures import RequestFuture
from rlengine.protocol import Unsupported
from rlengine.render import TextStream
from rlengine.serve.errors import to_serve_error
from rlengine.serve.session_types import Session, ToolUse, TurnResult
from rlengine.serve.sessions import OnTokens, SessionManager
from rlengine.types import SamplingParams

__all__ = ["ContentStream", "StreamDialect", "TurnStreamer"]


class StreamDialect(Protocol):
    """How one API spells a streamed turn (``TurnStreamer.stream`` runs the turn)."""

    def start(self) -> bytes: ...

    def text(self, index: int, text: str) -> bytes:
        """Content text of choice ``index``, as it is settled."""
        ...

    def error(self, err: Any) -> bytes:
        """The turn failed after the stream began (a ``ServeError``)."""
        ...

    def finish(self, result: TurnResult, rests: list[str]) -> bytes:
        """The end: ``rests[i]`` is the content choice ``i`` still owes, then its tool calls."""
        ...


class ContentStream:
    """The text deltas of one streamed choice, holding back what may not be content.

    Text from where a held string (a stop string, the start of a tool call)
    begins, or could begin, is not sent while the turn runs; ``finish``
    sends what of the final content is still owed (the content the reply
    has, without stop strings and tool-call markup).
    """

    def __init__(self, renderer: Any, held: tuple[str, ...]) -> None:
        self._text = TextStream(renderer)
        self._held = held
        self._seen = ""
        self._sent = ""
        self._stopped = False

    def push(self, ids: list[int]) -> str:
        self._seen += self._text.push(ids)
        if self._stopped:
            return ""
        safe = len(self._seen)
        for marker in self._held:
            found = self._seen.find(marker, max(0, len(self._sent) - len(marker)))
            if found >= 0:
                self._stopped = True
                safe = min(safe, found)
                continue
            for k in range(min(len(marker) - 1, len(self._seen)), 0, -1):
                if marker.startswith(self._seen[-k:]):
                    safe = min(safe, len(self._seen) - k)
                    break
        if self._held:  # a newline may be the separator before a tool call, which the content drops
            safe = len(self._seen[:safe].rstrip("\n"))
        delta = self._seen[len(self._sent):safe] if safe > len(self._sent) else ""
        self._sent += delta
        return delta

    def finish(self, content: str) -> str:
        rest = content[len(self._sent):] if content.startswith(self._sent) else ""
        self._sent = content
        return rest


class TurnStreamer:
    """Streams ``sessions``' turns to HTTP clients, cutting off one that reads nothing for
    ``write_stall_timeout_s``."""

    def __init__(self, sessions: SessionManager, write_stall_timeout_s: float) -> None:
        self.sessions = sessions
        self.write_stall_timeout_s = write_stall_timeout_s

    async def stream(self, request: web.Request, session: Session | None, affinity: str | None,
                     messages: list[dict[str, Any]], params: SamplingParams, n: int, tools: Any,
                     tool_use: ToolUse, dialect: Callable[[str], StreamDialect],
                     max_tokens_field: str | None = None, role: str | None = None) -> web.StreamResponse:
        """Stream a chat turn as server-sent events in ``dialect(request_id)``'s shape (every chat
        API's one loop; ``max_tokens_field`` and ``role`` as for ``SessionManager.chat``).

        Text that may turn out to be a tool call's markup, or the stop string the
        reply ends before, is held back until the turn's end settles it. A client
        that goes away abandons the turn, with or without output sent."""
        if self.sessions.renderer is None:
            raise Unsupported("chat: this backend has no tokenizer and chat template")

        def start(on_tokens: OnTokens) -> RequestFuture[TurnResult]:
            return self.sessions.chat(session, messages, params, n, on_tokens=on_tokens, tools=tools,
                                      tool_use=tool_use, affinity=affinity, max_tokens_field=max_tokens_field,
                                      role=role)

        return await self.stream_turn(request, start, n, self._held(params, tools, tool_use), dialect)

    async def stream_turn(self, request: web.Request, start: Callable[[OnTokens], RequestFuture[TurnResult]], n: int,
                          held: tuple[str, ...], dialect: Callable[[str], StreamDialect]) -> web.StreamResponse:
        """Stream the turn ``start(on_tokens)`` submits (a chat or a token turn of ``n`` choices),
        holding back text from where one of ``held`` may begin; see ``stream``."""
        fut, queue = self._streamed_turn(start)
        events = dialect(fut.request_id)
        streams = [ContentStream(self.sessions.renderer, held) for _ in range(n)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            item = await self._first_tokens(fut, queue)
            await response.prepare(request)
            await self._write(request, response, events.start())
            while item is not None:
                index, ids = item
                text = streams[index].push(ids)
                if text:
                    await self._write(request, response, events.text(index, text))
                item = await queue.get()
            exc = fut.exception(0)
            if exc is not None:
                await self._write(request, response, events.error(to_serve_error(exc)))
            else:
                result = fut.result(0)
                rests = [s.finish(c.text or "") for s, c in zip(streams, result.choices)]
                await self._write(request, response, events.finish(result, rests))
            await response.write_eof()
        except asyncio.CancelledError:
            self._abandon(fut, response)
            raise
        except ConnectionError:  # the client is gone (or was cut off): nothing to answer, nothing to log
            self._abandon(fut, response)
        return response

    @staticmethod
    def _streamed_turn(start: Callable[[OnTokens], RequestFuture[TurnResult]]) -> tuple[Any, asyncio.Queue]:
        """Start a turn whose tokens arrive on a queue as ``(choice index, ids)``; None once it settled."""
        queue: asyncio.Queue[tuple[int, list[int]] | None] = asyncio.Queue()

        def on_tokens(index: int, ids: list[int], _lps: list[float], _version: int) -> None:
            queue.put_nowait((index, ids))

        # Validation errors raise here, before any byte of the response is sent.
        fut = start(on_tokens)
        fut.add_done_callback(lambda _f: queue.put_nowait(None))
        return fut, queue

    @staticmethod
    async def _first_tokens(fut: Any, queue: asyncio.Queue) -> Any:
        """The first item of a streamed turn. The headers wait for it: a request the backend
        refuses (a constraint it cannot compile) still gets its error status."""
        item = await queue.get()
        if item is None and fut.exception(0) is not None:
            raise fut.exception(0)
        return item

    def _held(self, params: SamplingParams, tools: Any, tool_use: ToolUse) -> tuple[str, ...]:
        """What a stream holds back until the turn ends: the stop strings, and where a tool call may start."""
        held = tuple(params.stop_strings)
        if tools and tool_use.choice != "none" and self.sessions.tool_parser is not None:
            held += (self.sessions.tool_parser.start_marker,)
        return held

    def _abandon(self, fut: RequestFuture[Any], response: web.StreamResponse) -> None:
        if not fut.done():
            self.sessions.abandon(fut.request_id, "the HTTP client disconnected mid-stream",
                                  output_sent=response.prepared)

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """One event to a streaming client, bounded: a write waits only while the client's socket
        takes nothing, at most ``write_stall_timeout_s``; then the connection is dropped and the
        turn abandoned (``ConnectionResetError``), so a reader that stalls cannot hold its
        handler, or the output queued for it, for as long as it keeps the connection."""
        try:
            await asyncio.wait_for(response.write(data), self.write_stall_timeout_s)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(f"the HTTP client read nothing for write_stall_timeout_s="
                                       f"{self.write_stall_timeout_s} s") from None
