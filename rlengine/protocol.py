"""The IPC wire protocol between agent sandboxes and the engine's server.

A connection carries *frames*: a 4-byte little-endian unsigned length, then
that many bytes of msgpack. Each frame holds one message of a tagged union
of msgspec Structs (``array_like=True``: a message is a msgpack array whose
first element is its tag, so there are no field names on the wire;
``gc=False``: messages never form reference cycles). Requests go from the
client to the server, replies back; every request carries an ``id`` that its
reply repeats, so a client may pipeline requests and match replies that come
back out of order (a short turn overtakes a long one).

Token ids, logprobs and versions travel as raw little-endian int32 / float32
/ int32 bytes (``*_raw`` fields): decoding a msgpack list of ints costs about
10x more. A failed request gets ``Error{code, message}``; ``code`` is one of
``ERROR_CODES`` and maps to an exception class here, which the server raises
and the client re-raises, so both sides share one vocabulary.

Nothing here is pickled, ever: msgpack decodes to these Structs, strings,
numbers and bytes only, so a frame cannot make the reader run code.

This module imports only msgspec, the standard library and
``rlengine.errors`` (itself stdlib-only): sandboxes import it through
``rlengine.sandbox_client`` without numpy, torch or the engine. It holds no I/O.
"""

from __future__ import annotations

import struct
from array import array

import msgspec

from rlengine.errors import RequestError, RLEngineError, own_wire

__all__ = [
    "DEFAULT_MAX_FRAME",
    "ERROR_CODES",
    "HEADER",
    "Ack",
    "BadFrame",
    "BadMessage",
    "Chat",
    "Choice",
    "CloseSession",
    "ConnectionLost",
    "ContextTooLong",
    "Error",
    "FrameReader",
    "FrameTooLarge",
    "Generate",
    "GetTrace",
    "Message",
    "OpenSession",
    "Ping",
    "Pong",
    "Reply",
    "Request",
    "Reward",
    "Sampling",
    "ServeError",
    "SessionExists",
    "SessionForbidden",
    "SessionGone",
    "SessionLimit",
    "SessionNotFound",
    "SessionOpened",
    "ToolCallOut",
    "TraceReply",
    "TurnAborted",
    "TurnReply",
    "Unavailable",
    "Unsupported",
    "WireTrajectory",
    "error_frame",
    "error_from_wire",
    "frame",
]

HEADER = struct.Struct("<I")
"""The frame header: the body's length in bytes."""

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
"""16 MiB: a conversation of about 4 M tokens as raw int32."""


# -- errors: one vocabulary for server and client ------------------------------------

class ServeError(RequestError):
    """A request to the server failed; the server keeps serving.

    ``code`` is the wire code (``Error.code``) of the class, from its row in ``rlengine.errors.WIRE``
    (a class without one fails its import); an instance made for a code no class has carries that code
    itself. ``field`` and ``value`` name what was wrong when one field's value was
    (``rlengine.errors.FieldError``; ``value`` as its repr, at most 80 characters), on every wire; None
    otherwise."""

    code: str
    field: str | None = None
    value: str | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = own_wire(cls).code


ServeError.code = own_wire(ServeError).code


class BadFrame(ServeError, ValueError):
    """A frame could not be read (a length of zero, or a broken stream)."""


class FrameTooLarge(ServeError, ValueError):
    """A frame's length exceeds the peer's limit; the connection is closed."""


class BadMessage(ServeError, ValueError):
    """A frame is not a valid message (malformed msgpack, unknown tag, wrong field types)."""


class InvalidValue(ServeError, ValueError):
    """A field holds an invalid value (the message names the field and value)."""


class Unsupported(ServeError, ValueError):
    """The request needs something this server does not have (e.g. chat without a tokenizer)."""


class SessionNotFound(ServeError, LookupError):
    """No such session (never opened, or its tombstone expired)."""


class SessionGone(ServeError, LookupError):
    """The session was closed or retired; it takes no more requests (HTTP 410)."""


class SessionForbidden(ServeError, PermissionError):
    """A missing or wrong session token (or server bearer token)."""


class SessionExists(ServeError, ValueError):
    """A session with the requested id already exists."""


class TurnAborted(ServeError):
    """The turn was aborted (server shutdown, session retired) and not recorded."""


class ContextTooLong(InvalidValue):
    """The prompt does not fit in the model's context (OpenAI's ``context_length_exceeded``)."""


class SessionLimit(ServeError):
    """The server holds as many open sessions as it keeps; close some first."""


class Unavailable(ServeError, ConnectionError):
    """The engine is closed, closing or dead, or the trace store is full."""


class ConnectionLost(RLEngineError, ConnectionError):
    """Client side: the connection closed (or timed out) before a reply came."""


ERROR_CODES: dict[str, type[ServeError]] = {cls.code: cls for cls in (
    ServeError, BadFrame, FrameTooLarge, BadMessage, InvalidValue, Unsupported, SessionNotFound, SessionGone,
    SessionForbidden, SessionExists, SessionLimit, TurnAborted, Unavailable, ContextTooLong)}


def error_from_wire(code: str, message: str, field: str | None = None, value: str | None = None) -> ServeError:
    """The exception for a received ``Error``; a code no class has gives a plain ``ServeError`` carrying it."""
    cls = ERROR_CODES.get(code, ServeError)
    exc = cls(message if cls is not ServeError or code == "internal" else f"[{code}] {message}")
    if cls is ServeError:
        exc.code = code
    exc.field, exc.value = field, value
    return exc


def error_frame(request_id: int, exc: ServeError) -> Error:
    """The ``Error`` reply reporting ``exc`` (its field and value included)."""
    return Error(id=request_id, code=exc.code, message=str(exc), field=exc.field, value=exc.value)


def _ints(raw: bytes) -> list[int]:
    return array("i", raw).tolist()


# -- message parts --------------------------------------------------------------------

class _Wire(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of wire values: positional msgpack arrays, untracked by the cyclic GC."""


class Message(_Wire):
    """One chat message, as in the OpenAI API (text content only)."""

    role: str
    content: str
    name: str | None = None


class Sampling(_Wire):
    """How to sample a turn; mirrors ``rlengine.SamplingParams`` (validated by the server)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class ToolCallOut(_Wire):
    """A tool call a completion made (OpenAI's shape: ``arguments`` is a JSON object as text)."""

    id: str
    name: str
    arguments: str


class Choice(_Wire):
    """One sampled completion of a turn."""

    stop_reason: str
    tokens_raw: bytes
    logprobs_raw: bytes
    versions_raw: bytes
    """The policy version that sampled each token."""
    text: str | None = None
    """The completion's text (chat turns; None for token turns, and for a chat turn that
    only called tools); stop strings are not part of it (the tokens keep them, as sampled)."""
    tool_calls: list[ToolCallOut] | None = None
    """The tool calls the completion made (chat turns with tools), parsed from its text."""
    top_ids_raw: bytes = b""
    """With ``top_logprobs`` k > 0: k alternative token ids per token (int32), most likely first."""
    top_logprobs_raw: bytes = b""
    """Their logprobs (float32)."""

    @property
    def tokens(self) -> list[int]:
        return _ints(self.tokens_raw)

    @property
    def logprobs(self) -> list[float]:
        return array("f", self.logprobs_raw).tolist()

    @property
    def versions(self) -> list[int]:
        return _ints(self.versions_raw)


class WireTrajectory(_Wire):
    """One root-to-leaf path of a session's trace (``rlengine.trace.Trajectory``)."""

    shared_prefix: int
    tokens_raw: bytes
    logprobs_raw: bytes
    versions_raw: bytes
    loss_mask_raw: bytes
    reward: float | None = None

    @property
    def tokens(self) -> list[int]:
        return _ints(self.tokens_raw)

    @property
    def logprobs(self) -> list[float]:
        return array("f", self.logprobs_raw).tolist()

    @property
    def versions(self) -> list[int]:
        return _ints(self.versions_raw)

    @property
    def loss_mask(self) -> list[int]:
        return list(self.loss_mask_raw)


# -- requests (client -> server) ------------------------------------------------------

class Ping(_Wire, tag="ping"):
    id: int
    payload: bytes = b""


class OpenSession(_Wire, tag="open"):
    """Open a session; ``session_id`` None lets the server choose one."""

    id: int
    session_id: str | None = None


class Chat(_Wire, tag="chat"):
    """A chat turn: the conversation so far (the server renders only what it has not stored)."""

    id: int
    session_id: str
    token: str
    messages: list[Message]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    n: int = 1


class Generate(_Wire, tag="generate"):
    """A token turn: the whole prompt as raw int32 (the server keeps what it already stored)."""

    id: int
    session_id: str
    token: str
    tokens_raw: bytes
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    n: int = 1


class Reward(_Wire, tag="reward"):
    """A reward for the session's latest turn (its trajectory's leaf)."""

    id: int
    session_id: str
    token: str
    value: float


class GetTrace(_Wire, tag="trace"):
    """The session's trajectories, as stored so far."""

    id: int
    session_id: str
    token: str


class CloseSession(_Wire, tag="close"):
    """End the session: later requests get ``gone``; its trace waits for the trainer."""

    id: int
    session_id: str
    token: str


Request = Ping | OpenSession | Chat | Generate | Reward | GetTrace | CloseSession


# -- replies (server -> client) --------------------------------------------------------

class Pong(_Wire, tag="pong"):
    id: int
    payload: bytes = b""


class SessionOpened(_Wire, tag="opened"):
    id: int
    session_id: str
    token: str
    """The session's secret: every later request of the session must carry it."""
    model: str


class TurnReply(_Wire, tag="turn"):
    id: int
    prompt_tokens: int
    """Tokens in the prompt the model saw (stored prefix + newly rendered suffix)."""
    choices: list[Choice]


class TraceReply(_Wire, tag="traced"):
    id: int
    trajectories: list[WireTrajectory]


class Ack(_Wire, tag="ack"):
    id: int


class Error(_Wire, tag="error"):
    """A failed request. ``id`` is 0 when the request could not be read."""

    id: int
    code: str
    message: str
    field: str | None = None
    """The field at fault (``ServeError.field``), when one field's value was."""
    value: str | None = None
    """Its value, as its repr (at most 80 characters)."""


Reply = Pong | SessionOpened | TurnReply | TraceReply | Ack | Error


# -- framing -----------------------------------------------------------------------------

def frame(encoder: msgspec.msgpack.Encoder, message: msgspec.Struct, max_frame: int | None = None) -> bytearray:
    """``message`` encoded as one frame (header + body), in one buffer; ``FrameTooLarge`` when the
    body exceeds ``max_frame`` (the peer's limit), before a byte is sent."""
    buf = bytearray(HEADER.size)
    encoder.encode_into(message, buf, HEADER.size)
    size = len(buf) - HEADER.size
    if max_frame is not None and size > max_frame:
        raise FrameTooLarge(f"{type(message).__name__} of {size} bytes exceeds the frame limit of {max_frame} "
                            "bytes (max_frame); nothing was sent")
    HEADER.pack_into(buf, 0, size)
    return buf


class FrameReader:
    """Splits a byte stream into frame bodies, enforcing ``max_frame``.

    ``feed`` returns the bodies completed by the new data, as memoryviews
    over immutable bytes (safe to keep), and holds a partial frame for later.
    A header announcing more than ``max_frame`` bytes, or zero bytes, raises
    ``FrameTooLarge`` / ``BadFrame`` before any of that body is buffered, so
    a peer cannot make the reader hold more than one maximal frame. Bytes of
    a frame that arrives in pieces are appended, not re-parsed, until it is
    complete (no quadratic cost for a large frame).
    """

    __slots__ = ("_buf", "_need", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if not 1 <= max_frame <= 0xFFFFFFFF:
            raise ValueError(f"max_frame={max_frame}: must be in [1, 2**32)")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need = HEADER.size

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[memoryview]:
        buf = self._buf
        n = len(data)
        if not buf and n > 4 and type(data) is bytes:
            # The common case, one whole frame per read: no loop, no copy.
            (length,) = HEADER.unpack_from(data)
            if length == n - 4 and length <= self.max_frame:
                return [memoryview(data)[4:]]
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            data = bytes(buf)
            buf.clear()
        elif not isinstance(data, bytes):
            data = bytes(data)
        view = memoryview(data)
        bodies: list[memoryview] = []
        pos, end, length = 0, len(data), 0
        while end - pos >= 4:
            (length,) = HEADER.unpack_from(data, pos)
            if length > self.max_frame:
                raise FrameTooLarge(f"frame length={length}: exceeds max_frame={self.max_frame}")
            if length == 0:
                raise BadFrame("frame length=0: a frame holds at least one byte of msgpack")
            if end - pos - 4 < length:
                break
            bodies.append(view[pos + 4:pos + 4 + length])
            pos += 4 + length
        if pos < end:
            buf += view[pos:]
            self._need = 4 + length if end - pos >= 4 else 4
        return bodies
