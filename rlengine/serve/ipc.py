"""The IPC server: msgspec frames over a unix-domain socket, on the engine's loop.

Sandboxes connect to a socket file of mode 0600 inside a directory of mode
0700 (only the engine's user can reach it). Each connection is an
``asyncio.Protocol`` with its own ``FrameReader``, msgpack ``Encoder`` and
typed ``Decoder`` (``rlengine.protocol.Request``), reused for every frame.
Requests are handled in the ``data_received`` callback itself: a ping is
answered at once, a turn is handed to the session layer and answered from
its future's done-callback (no task per request; replies may overtake each
other and are matched by ``id``).

Bad input never stops the server: a frame that is not a valid message gets
``Error(bad_message)`` and the connection goes on (frame boundaries are still
known); an oversize or zero-length frame gets ``Error`` and a clean close (the
stream cannot be resynchronised); a truncated frame at EOF is dropped.

Backpressure per connection: at most ``max_in_flight`` turns in flight (the
server stops reading until replies go out; frames already read past the bound
wait unparsed, so one large read cannot exceed it), and when the client stops
reading (the transport's write buffer passes its high-water mark) the server
stops reading its requests too; a client that stays stalled for
``write_stall_timeout_s`` is disconnected. Bounded by construction: at most
``max_connections`` connections (one more is told ``unavailable`` and closed);
incomplete frames of all connections together hold at most
``max_buffered_bytes`` (128 MiB by default: one budget for the server, not one
per connection; the connection whose bytes pass it is told ``unavailable`` and
closed, its buffer freed), a frame must arrive whole within
``frame_timeout_s`` of its first byte, and a connection with no turn in flight
that sends nothing for ``idle_timeout_s`` is closed; a closed connection's
buffer is freed at once. A connection that goes away with turns in flight
abandons them: none of their output had reached it, so they are aborted
(``SessionManager.abandon``) and the gate stays clean.

This module speaks the wire format only; what a request means is the
session layer's business.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import tempfile
import time
from collections import deque
from typing import Any

import msgspec

from rlengine.core.futures import RequestFuture
from rlengine.errors import ConfigurationError
from rlengine.protocol import (
    HEADER,
    Ack,
    BadFrame,
    BadMessage,
    Chat,
    CloseSession,
    Error,
    FrameReader,
    Generate,
    GetTrace,
    InvalidValue,
    OpenSession,
    Ping,
    Pong,
    Request,
    Reward,
    ServeError,
    SessionOpened,
    TraceReply,
    TurnReply,
    Unavailable,
    WireTrajectory,
    error_frame,
)
from rlengine.serve.errors import to_serve_error
from rlengine.serve.sessions import SessionManager, TurnResult
from rlengine.types import SamplingParams

__all__ = ["IpcServer", "sampling_params"]

log = logging.getLogger("rlengine.serve")

# Unix socket paths are limited to 108 bytes (sun_path) on Linux.
_MAX_SOCKET_PATH = 107


def sampling_params(s: Any) -> SamplingParams:
    """``SamplingParams`` from a wire ``Sampling``; invalid values raise ``InvalidRequest``."""
    if s.stop and s.stop_token_ids:
        raise InvalidValue(f"stop={s.stop!r}, stop_token_ids={s.stop_token_ids!r}: give one kind of stop, not both")
    stop = s.stop or s.stop_token_ids or None
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop=stop, ignore_eos=s.ignore_eos)


def _request_id_of(body: memoryview) -> int:
    """Best effort: the ``id`` of a frame that failed to decode as a request (0 if none)."""
    try:
        raw = msgspec.msgpack.decode(body)
    except Exception:  # noqa: BLE001 - any undecodable frame simply has no id
        return 0
    if isinstance(raw, list) and len(raw) > 1 and type(raw[1]) is int and 0 <= raw[1] < 2**63:
        return raw[1]
    return 0


class _Connection(asyncio.Protocol):
    """One client connection (loop thread only)."""

    def __init__(self, server: IpcServer) -> None:
        self.server = server
        self.sessions = server.sessions
        self.reader = FrameReader(server.max_frame)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Request)
        self.transport: asyncio.Transport | None = None
        self.turns: dict[int, RequestFuture[TurnResult]] = {}
        """In-flight turns by the client's request id."""
        self.closed = False
        self.read_at = time.monotonic()
        """When it last received bytes (idle timeout)."""
        self.partial_since: float | None = None
        """When the frame it is part-way through began (partial-frame timeout); None between frames."""
        self._reading_paused = False
        self._writing_paused = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self._held: deque[memoryview] = deque()
        """Frames read but not yet handled (past ``max_in_flight``)."""
        self._serving = False
        self._handlers = {Ping: self._ping, OpenSession: self._open, Chat: self._chat, Generate: self._generate,
                          Reward: self._reward, GetTrace: self._trace, CloseSession: self._close}

    # -- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods.
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self.server.write_high_water)
        server = self.server
        if len(server.connections) >= server.max_connections:
            self.send(Error(id=0, code=Unavailable.code, message=f"the server holds {len(server.connections)} "
                            "connections, its limit (max_connections); try again later"))
            self.closed = True
            transport.close()
            return
        server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        reader, server = self.reader, self.server
        before = reader.buffered
        try:
            bodies = reader.feed(data)
        except ServeError as exc:
            # The stream cannot be resynchronised after a bad header: say why, then close.
            self.send(error_frame(0, exc))
            self.close()
            return
        after = reader.buffered
        if after != before:
            server.buffered += after - before
            now = self.read_at = time.monotonic()
            self.partial_since = None if not after else self.partial_since or now
            if server.buffered > server.max_buffered_bytes:
                # Partial frames of all connections together hold at most this much memory.
                self.send(Error(id=0, code=Unavailable.code, message=f"incomplete frames hold {server.buffered} bytes, "
                                "more than the server keeps (max_buffered_bytes); this connection is closed"))
                self.close()
                return
        else:
            self.read_at = time.monotonic()
        self._held.extend(bodies)
        self._serve_held()

    def _serve_held(self) -> None:
        """Handle the frames read so far, in order, while fewer than ``max_in_flight`` turns run.

        One read can hold many frames: those past the bound wait here, unparsed,
        and reading stays paused until a turn finishes (``_turn_done``)."""
        if self._serving:
            return  # a turn settled inside a handler: the loop below goes on
        self._serving = True
        held, limit = self._held, self.server.max_in_flight
        try:
            while held and len(self.turns) < limit and not self.closed:
                self._serve(held.popleft())
        finally:
            self._serving = False
        if held or self._reading_paused or len(self.turns) >= limit:
            self._update_reading()

    def _serve(self, body: memoryview) -> None:
        try:
            request = self.decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.send(Error(id=_request_id_of(body), code=BadMessage.code, message=f"bad message: {exc}"))
            return
        try:
            self._handlers[type(request)](request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's Error
            self.send(error_frame(request.id, to_serve_error(exc)))

    def eof_received(self) -> bool:
        # EOF means the client is gone: a unix socket's half-close cannot be
        # told apart from a close until a write fails, which for a long turn
        # would be much later. Closing now abandons its turns in flight.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_stall_timer()
        held = self.reader.buffered
        if self in self.server.connections:
            self.server.buffered -= held
        self.reader = FrameReader(self.server.max_frame)  # its partial frame is freed now
        if held >= _TRIM_BYTES:
            _return_memory()
        self.server.connections.discard(self)
        self._held.clear()
        turns, self.turns = self.turns, {}
        for fut in turns.values():
            if not fut.done():
                # Replies go out whole, when a turn ends: none of this one reached the client.
                self.sessions.abandon(fut.request_id, "the IPC client disconnected mid-generation", output_sent=False)

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading its requests, and
        # give up on it if it stays stalled.
        self._writing_paused = True
        self._update_reading()
        if self._stall_timer is None:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self.server.write_stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._cancel_stall_timer()
        self._update_reading()

    # -- plumbing -----------------------------------------------------------------------

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        log.warning("rlengine.serve: IPC client stopped reading for %.1f s; disconnecting it",
                    self.server.write_stall_timeout_s)
        if self.transport is not None:
            self.transport.abort()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self.closed:
            return
        pause = self._writing_paused or bool(self._held) or len(self.turns) >= self.server.max_in_flight
        if pause and not self._reading_paused:
            transport.pause_reading()
            self._reading_paused = True
        elif not pause and self._reading_paused:
            transport.resume_reading()
            self._reading_paused = False

    def send(self, message: msgspec.Struct) -> None:
        if not self.closed and self.transport is not None:
            buf = bytearray(4)
            self.encoder.encode_into(message, buf, 4)
            HEADER.pack_into(buf, 0, len(buf) - 4)
            self.transport.write(buf)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    # -- requests -----------------------------------------------------------------------

    def _ping(self, req: Ping) -> None:
        self.send(Pong(id=req.id, payload=req.payload))

    def _open(self, req: OpenSession) -> None:
        session = self.sessions.open(req.session_id)
        self.send(SessionOpened(id=req.id, session_id=session.session_id, token=session.token,
                                model=self.server.model_name))

    def _chat(self, req: Chat) -> None:
        self._check_new_turn(req.id)
        session = self.sessions.authorize(req.session_id, req.token)
        self._track(req.id, self.sessions.chat(session, req.messages, sampling_params(req.sampling), req.n))

    def _generate(self, req: Generate) -> None:
        self._check_new_turn(req.id)
        session = self.sessions.authorize(req.session_id, req.token)
        self._track(req.id, self.sessions.generate(session, req.tokens_raw, sampling_params(req.sampling), req.n))

    def _reward(self, req: Reward) -> None:
        self.sessions.reward(self.sessions.authorize(req.session_id, req.token), req.value)
        self.send(Ack(id=req.id))

    def _trace(self, req: GetTrace) -> None:
        trace = self.sessions.trace(self.sessions.authorize(req.session_id, req.token))
        self.send(TraceReply(id=req.id, trajectories=[
            WireTrajectory(shared_prefix=t.shared_prefix, tokens_raw=t.tokens_raw, logprobs_raw=t.logprobs_raw,
                           versions_raw=t.versions_raw, loss_mask_raw=t.loss_mask_raw, reward=r)
            for t, r in zip(trace.trajectories, trace.rewards)]))

    def _close(self, req: CloseSession) -> None:
        self.sessions.close(self.sessions.authorize(req.session_id, req.token))
        self.send(Ack(id=req.id))

    def _check_new_turn(self, request_id: int) -> None:
        if request_id in self.turns:
            raise InvalidValue(f"id={request_id}: a request with this id is still in flight on this connection")

    def _track(self, request_id: int, fut: RequestFuture[TurnResult]) -> None:
        self.turns[request_id] = fut
        fut.add_done_callback(lambda f: self._turn_done(request_id, f))

    def _turn_done(self, request_id: int, fut: RequestFuture[TurnResult]) -> None:
        if self.turns.pop(request_id, None) is None:
            return  # the connection is gone; the turn was abandoned
        exc = fut.exception(0)
        if exc is None:
            result = fut.result(0)
            self.send(TurnReply(id=request_id, prompt_tokens=result.prompt_tokens, choices=result.choices))
        else:
            self.send(error_frame(request_id, to_serve_error(exc)))
        self._serve_held()


_DIR_PREFIX = "rlengine-ipc-"
_TRIM_BYTES = 1 << 20
"""A closed connection that held this much of a partial frame gives the memory back at once."""


def _return_memory() -> None:
    """Hand freed heap memory back to the system (glibc ``malloc_trim``). A large partial frame
    grows by reallocation; once freed, glibc keeps such memory in its arena (its mmap threshold
    rises after the first large free) unless asked. Elsewhere a no-op."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library (as sandbox.py)
    if trim is not None:
        trim(0)


def _is_dead_socket(path: str) -> bool:
    """``path`` is a unix socket nobody listens on (its server died without removing it)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False  # a live but busy server, or no permission: not ours to remove
    finally:
        probe.close()
    return False


def _sweep_dead_dirs() -> None:
    """Remove this user's private IPC directories whose server is gone (killed before ``close``)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(root, name)
        try:
            if os.lstat(directory).st_uid != os.getuid() or not stat.S_ISDIR(os.lstat(directory).st_mode):
                continue
            entries = os.listdir(directory)
            if entries not in ([], ["engine.sock"]):
                continue
            if not entries and time.time() - os.lstat(directory).st_mtime < 60:
                continue  # perhaps a server between making its directory and binding
            sock = os.path.join(directory, "engine.sock")
            if entries and not _is_dead_socket(sock):
                continue
            if entries:
                os.unlink(sock)
            os.rmdir(directory)
        except OSError:
            continue  # raced with its owner, or not ours


class IpcServer:
    """Listens on a unix socket on the running loop and serves ``SessionManager`` requests."""

    def __init__(self, sessions: SessionManager, *, model_name: str, max_frame: int, max_in_flight: int = 256,
                 write_high_water: int = 4 << 20, write_stall_timeout_s: float = 30.0, max_connections: int = 1024,
                 idle_timeout_s: float = 600.0, frame_timeout_s: float = 30.0,
                 max_buffered_bytes: int = 128 << 20) -> None:
        self.sessions = sessions
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        """A connection with no turn in flight that sends nothing for this long is closed."""
        self.frame_timeout_s = frame_timeout_s
        """A frame must arrive whole within this long of its first byte."""
        self.max_buffered_bytes = max_buffered_bytes
        """Bytes all connections' incomplete frames may hold together."""
        self.buffered = 0
        self._sweeper: asyncio.TimerHandle | None = None
        self.model_name = model_name
        self.max_frame = max_frame
        self.max_in_flight = max_in_flight
        self.write_high_water = write_high_water
        self.write_stall_timeout_s = write_stall_timeout_s
        self.connections: set[_Connection] = set()
        self.path: str | None = None
        self._made_dir: str | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str | None = None) -> str:
        """Listen at ``path`` (None: a new private directory); returns the socket path.

        A socket file left by a server that died without cleaning up (SIGKILL)
        is replaced; one a live server listens on is refused. Private
        directories of such dead servers are removed when a new one is made."""
        if path is None:
            _sweep_dead_dirs()
            self._made_dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)  # mode 0700
            path = os.path.join(self._made_dir, "engine.sock")
        else:
            path = os.path.abspath(path)
            directory = os.path.dirname(path)
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700)
                self._made_dir = directory
            mode = stat.S_IMODE(os.stat(directory).st_mode)
            if mode & 0o077:
                raise ConfigurationError(f"socket_path={path!r}: its directory has mode {mode:o}; it must be "
                                         "0700 (only the engine's user may reach the socket)")
            if os.path.lexists(path):
                if not _is_dead_socket(path):
                    raise ConfigurationError(f"socket_path={path!r}: the file exists and is not the socket of a "
                                             "dead server (another server listens on it, or it is not a socket)")
                log.warning("rlengine.serve: replacing the stale socket %s (its server is gone)", path)
                os.unlink(path)
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            raise ConfigurationError(f"socket_path={path!r}: longer than {_MAX_SOCKET_PATH} bytes (unix limit)")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path, backlog=1024)
        # The 0700 directory already keeps others out during the instant
        # between bind and chmod; the mode is defence in depth.
        os.chmod(path, 0o600)
        self.path = path
        self._schedule_sweep()
        return path

    def _schedule_sweep(self) -> None:
        period = min(max(min(self.idle_timeout_s, self.frame_timeout_s) / 4, 0.02), 5.0)
        self._sweeper = asyncio.get_running_loop().call_later(period, self._sweep)

    def _sweep(self) -> None:
        """Close connections stuck in a frame for ``frame_timeout_s`` or idle for ``idle_timeout_s``."""
        now = time.monotonic()
        for conn in list(self.connections):
            if conn.partial_since is not None and now - conn.partial_since > self.frame_timeout_s:
                conn.send(Error(id=0, code=BadFrame.code, message=f"a frame stayed incomplete for more than "
                                f"{self.frame_timeout_s} s (frame_timeout_s); the connection is closed"))
                conn.close()
            elif not conn.turns and not conn.reader.buffered and now - conn.read_at > self.idle_timeout_s:
                conn.close()
        self._schedule_sweep()

    def stop_listening(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop listening, close every connection, remove the socket (and its directory if made here)."""
        self.stop_listening()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            except TimeoutError:
                log.warning("rlengine.serve: IPC connections did not close within 5 s")
            self._server = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None
        if self._made_dir is not None:
            try:
                os.rmdir(self._made_dir)
            except OSError:
                pass
            self._made_dir = None

    @property
    def in_flight(self) -> int:
        return sum(len(c.turns) for c in self.connections)
