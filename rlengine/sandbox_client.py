"""The sandbox-side client of the engine's IPC server, synchronous and asyncio.

An agent sandbox connects to the server's unix socket, opens a session (or
attaches to one an orchestrator opened, with its id and token) and runs
turns::

    from rlengine.sandbox_client import Client
    with Client(socket_path) as client:
        session = client.open_session()
        messages = [{"role": "user", "content": "What is 2+2?"}]
        turn = session.chat(messages, max_tokens=64)
        messages.append({"role": "assistant", "content": turn.choices[0].text})
        ...
        session.reward(1.0)
        session.close()

Send the conversation as it is, every turn: the server stores what the model
sampled as exact tokens and renders only the new messages. ``generate`` is
the token-level twin: send the whole prompt as token ids.

``AsyncClient`` pipelines: many sessions' turns share one connection, in
flight together, each reply matched to its request by id. Every wait is
bounded (``timeout``); a failed request raises the ``rlengine.protocol``
error for its code (``SessionGone`` for a retired session, ...), and a lost
connection ``ConnectionLost``.

This module imports only msgspec, the standard library and rlengine's
stdlib-only ``protocol`` and ``errors``: no numpy, no torch, no engine.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import threading
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from rlengine.protocol import (
    DEFAULT_MAX_FRAME,
    Ack,
    Chat,
    CloseSession,
    ConnectionLost,
    Error,
    FrameReader,
    Generate,
    GetTrace,
    Message,
    OpenSession,
    Ping,
    Pong,
    Reply,
    Reward,
    Sampling,
    ServeError,
    SessionOpened,
    TraceReply,
    TurnReply,
    WireTrajectory,
    error_from_wire,
    frame,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncClient", "AsyncSession", "Client", "Session", "sampling", "token_bytes"]


def sampling(max_tokens: int | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
             seed: int | None = None, stop: str | Sequence[str] | Sequence[int] | None = None,
             ignore_eos: bool = False) -> Sampling:
    """The wire ``Sampling`` (the server validates the values)."""
    stop_strings: list[str] | None = None
    stop_ids: list[int] | None = None
    if isinstance(stop, str):
        stop_strings = [stop]
    elif stop:
        items = list(stop)
        if all(isinstance(x, str) for x in items):
            stop_strings = items
        else:
            stop_ids = items
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    stop=stop_strings, stop_token_ids=stop_ids, ignore_eos=ignore_eos)


def token_bytes(tokens: Iterable[int] | bytes | array) -> bytes:
    """Token ids as the raw int32 bytes the wire carries."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError(f"tokens: {len(raw)} raw bytes is not a whole number of int32 ids")
        return raw
    if isinstance(tokens, array) and tokens.typecode in "iI" and tokens.itemsize == 4:
        return tokens.tobytes()
    return array("i", tokens).tobytes()


def _messages(messages: Sequence[Any]) -> list[Message]:
    out = []
    for m in messages:
        if isinstance(m, Message):
            out.append(m)
        else:
            out.append(Message(role=m["role"], content=m["content"], name=m.get("name")))
    return out


def _check(reply: Reply, expected: type) -> Any:
    if isinstance(reply, Error):
        raise error_from_wire(reply.code, reply.message, reply.field, reply.value)
    if not isinstance(reply, expected):
        raise ServeError(f"expected a {expected.__name__} reply, got {type(reply).__name__}")
    return reply


# -- synchronous -----------------------------------------------------------------------------

class Client:
    """A blocking connection to the IPC server (thread-safe: one request at a time)."""

    def __init__(self, path: str, *, timeout: float = 60.0, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            self._sock = None
            raise ConnectionLost(f"cannot connect to {path!r}: {exc}") from None
        # Bound every send and receive in the kernel (SO_SNDTIMEO/SO_RCVTIMEO)
        # rather than with a Python socket timeout, which polls before every
        # call: an extra system call per round trip, measured at several us.
        self._sock.settimeout(None)
        timeval = struct.pack("ll", int(timeout), int((timeout % 1) * 1_000_000))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._reader = FrameReader(max_frame)
        self.max_frame = max_frame
        """The most bytes one frame may hold, both ways (the server's ``max_frame``, 16 MiB by default)."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ready: list[memoryview] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def request(self, message: Any) -> Reply:
        """Send one request (its ``id`` is assigned here) and return its reply."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ConnectionLost(f"the connection to {self.path!r} is closed")
            message.id = next(self._ids)
            data = frame(self._encoder, message, self.max_frame)  # too large: refused, the connection kept
            try:
                sock.sendall(data)
                return self._receive(sock, message.id)
            except (OSError, ServeError) as exc:
                # After a timeout or a broken frame the stream's state is unknown:
                # a late reply would answer the next request. Start over instead.
                self.close()
                if isinstance(exc, ServeError):
                    raise
                if isinstance(exc, BlockingIOError):  # the kernel timeout ran out (EAGAIN)
                    raise ConnectionLost(f"no reply to {type(message).__name__} from {self.path!r} within "
                                         f"{self.timeout} s") from None
                raise ConnectionLost(f"request {type(message).__name__} to {self.path!r}: {exc}") from None

    def _receive(self, sock: socket.socket, request_id: int) -> Reply:
        ready, decode = self._ready, self._decoder.decode
        while True:
            while ready:
                reply = decode(ready.pop(0))
                # One request at a time: anything else is an Error the server
                # could not attribute (id 0), meant for this request.
                if reply.id == request_id or reply.id == 0:
                    return reply
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionLost(f"the server closed the connection to {self.path!r}")
            ready += self._reader.feed(data)

    def ping(self, payload: bytes = b"") -> bytes:
        return _check(self.request(Ping(id=0, payload=payload)), Pong).payload

    def open_session(self, session_id: str | None = None) -> Session:
        opened = _check(self.request(OpenSession(id=0, session_id=session_id)), SessionOpened)
        return Session(self, opened.session_id, opened.token)

    def session(self, session_id: str, token: str) -> Session:
        """Attach to a session opened elsewhere (an orchestrator hands out id and token)."""
        return Session(self, session_id, token)


class _SessionRequests:
    """The requests of one session, built once for ``Session`` and ``AsyncSession``."""

    session_id: str
    token: str

    def _chat(self, messages: Sequence[Any], n: int, params: dict[str, Any]) -> Chat:
        return Chat(id=0, session_id=self.session_id, token=self.token, messages=_messages(messages),
                    sampling=sampling(**params), n=n)

    def _generate(self, tokens: Iterable[int] | bytes, n: int, params: dict[str, Any]) -> Generate:
        return Generate(id=0, session_id=self.session_id, token=self.token, tokens_raw=token_bytes(tokens),
                        sampling=sampling(**params), n=n)

    def _reward(self, value: float) -> Reward:
        return Reward(id=0, session_id=self.session_id, token=self.token, value=value)

    def _trace(self) -> GetTrace:
        return GetTrace(id=0, session_id=self.session_id, token=self.token)

    def _close(self) -> CloseSession:
        return CloseSession(id=0, session_id=self.session_id, token=self.token)


class Session(_SessionRequests):
    """One agent session over a ``Client``."""

    def __init__(self, client: Client, session_id: str, token: str) -> None:
        self.client = client
        self.session_id = session_id
        self.token = token

    def __repr__(self) -> str:
        return f"<Session {self.session_id}>"

    def chat(self, messages: Sequence[Any], *, n: int = 1, **params: Any) -> TurnReply:
        """A chat turn: ``messages`` is the whole conversation (dicts with role and content)."""
        return _check(self.client.request(self._chat(messages, n, params)), TurnReply)

    def generate(self, tokens: Iterable[int] | bytes, *, n: int = 1, **params: Any) -> TurnReply:
        """A token turn: ``tokens`` is the whole prompt."""
        return _check(self.client.request(self._generate(tokens, n, params)), TurnReply)

    def reward(self, value: float) -> None:
        _check(self.client.request(self._reward(value)), Ack)

    def trace(self) -> list[WireTrajectory]:
        return _check(self.client.request(self._trace()), TraceReply).trajectories

    def close(self) -> None:
        _check(self.client.request(self._close()), Ack)


# -- asyncio ---------------------------------------------------------------------------------

class _ClientProtocol(asyncio.Protocol):
    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client._data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(exc)

    def pause_writing(self) -> None:
        self.client._writable.clear()

    def resume_writing(self) -> None:
        self.client._writable.set()


class AsyncClient:
    """An asyncio connection to the IPC server; requests are pipelined."""

    def __init__(self, path: str, *, timeout: float = 60.0, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.path = path
        self.timeout = timeout
        self._reader = FrameReader(max_frame)
        self.max_frame = max_frame
        """The most bytes one frame may hold, both ways (the server's ``max_frame``, 16 MiB by default)."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    @classmethod
    async def connect(cls, path: str, *, timeout: float = 60.0, max_frame: int = DEFAULT_MAX_FRAME) -> AsyncClient:
        """Connect to the server's socket at ``path``; ``"fd:N"`` uses the already connected
        socket ``N`` instead (what a confined sandbox worker is handed: it cannot reach the path)."""
        client = cls(path, timeout=timeout, max_frame=max_frame)
        loop = asyncio.get_running_loop()
        if path.startswith("fd:"):
            target: dict[str, Any] = {"sock": socket.socket(fileno=int(path[3:]))}
        else:
            target = {"path": path}
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _ClientProtocol(client), **target), timeout)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {path!r}: {exc}") from None
        client._transport = transport  # type: ignore[assignment]
        return client

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        self._fail_all(ConnectionLost(f"the connection to {self.path!r} was closed by the client"))

    def _data(self, data: bytes) -> None:
        try:
            bodies = self._reader.feed(data)
            replies = [self._decoder.decode(b) for b in bodies]
        except (ServeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._fail_all(ConnectionLost(f"unreadable reply from {self.path!r}: {exc}"))
            if self._transport is not None:
                self._transport.abort()
            return
        for reply in replies:
            if isinstance(reply, Error) and reply.id == 0:
                # The server could not tell which request this answers.
                self._fail_all(error_from_wire(reply.code, reply.message, reply.field, reply.value))
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._fail_all(ConnectionLost(f"the connection to {self.path!r} closed{f': {exc}' if exc else ''}"))

    def _fail_all(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def request(self, message: Any, timeout: float | None = None) -> Reply:
        """Send one request (its ``id`` is assigned here); await its reply, at most ``timeout`` s."""
        timeout = self.timeout if timeout is None else timeout
        if not self._writable.is_set():
            try:
                await asyncio.wait_for(self._writable.wait(), timeout)
            except TimeoutError:
                raise ConnectionLost(f"the server at {self.path!r} did not read for {timeout} s") from None
        transport = self._transport
        if transport is None:
            raise ConnectionLost(f"the connection to {self.path!r} is closed")
        message.id = request_id = next(self._ids)
        data = frame(self._encoder, message, self.max_frame)  # too large: refused, the connection kept
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        transport.write(data)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise ConnectionLost(f"no reply to {type(message).__name__} within {timeout} s") from None
        finally:
            self._pending.pop(request_id, None)

    async def ping(self, payload: bytes = b"") -> bytes:
        return _check(await self.request(Ping(id=0, payload=payload)), Pong).payload

    async def open_session(self, session_id: str | None = None) -> AsyncSession:
        opened = _check(await self.request(OpenSession(id=0, session_id=session_id)), SessionOpened)
        return AsyncSession(self, opened.session_id, opened.token)

    def session(self, session_id: str, token: str) -> AsyncSession:
        return AsyncSession(self, session_id, token)


class AsyncSession(_SessionRequests):
    """One agent session over an ``AsyncClient``."""

    def __init__(self, client: AsyncClient, session_id: str, token: str) -> None:
        self.client = client
        self.session_id = session_id
        self.token = token

    def __repr__(self) -> str:
        return f"<AsyncSession {self.session_id}>"

    async def chat(self, messages: Sequence[Any], *, n: int = 1, timeout: float | None = None,
                   **params: Any) -> TurnReply:
        return _check(await self.client.request(self._chat(messages, n, params), timeout), TurnReply)

    async def generate(self, tokens: Iterable[int] | bytes, *, n: int = 1, timeout: float | None = None,
                       **params: Any) -> TurnReply:
        return _check(await self.client.request(self._generate(tokens, n, params), timeout), TurnReply)

    async def reward(self, value: float) -> None:
        _check(await self.client.request(self._reward(value)), Ack)

    async def trace(self) -> list[WireTrajectory]:
        return _check(await self.client.request(self._trace()), TraceReply).trajectories

    async def close(self) -> None:
        _check(await self.client.request(self._close()), Ack)
