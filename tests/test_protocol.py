"""The IPC wire protocol (rlengine.protocol): messages, framing, errors, and the client's imports.

Framing is checked against a plain reference (split a concatenation of
frames at arbitrary points; the bodies come back whole and in order), and
fuzzed: arbitrary bytes fed in arbitrary pieces either yield bodies, or raise
one of the two framing errors; decoding a body either yields a request or
raises msgspec's decode/validation errors. Nothing else, ever.

The fuzz runs ``RLENGINE_FUZZ_EXAMPLES`` inputs (1000 by default; the long
run documented in bench/RESULTS_serve.md sets 100000).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlengine import protocol as p
from rlengine.errors import RequestError, RLEngineError

FUZZ_EXAMPLES = int(os.environ.get("RLENGINE_FUZZ_EXAMPLES", "1000"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUESTS = [
    p.Ping(id=1, payload=b"\x00\xff"),
    p.OpenSession(id=2),
    p.OpenSession(id=3, session_id="agent-7"),
    p.Chat(id=4, session_id="s", token="t", messages=[p.Message("user", "hi"), p.Message("tool", "42", name="calc")],
           sampling=p.Sampling(max_tokens=8, temperature=0.0, stop=["\n"]), n=2),
    p.Generate(id=5, session_id="s", token="t", tokens_raw=array("i", [1, 2, 3]).tobytes(),
               sampling=p.Sampling(seed=3, stop_token_ids=[7])),
    p.Reward(id=6, session_id="s", token="t", value=-0.5),
    p.GetTrace(id=7, session_id="s", token="t"),
    p.CloseSession(id=8, session_id="s", token="t"),
]
REPLIES = [
    p.Pong(id=1, payload=b"x"),
    p.SessionOpened(id=2, session_id="s", token="t", model="tiny"),
    p.TurnReply(id=3, prompt_tokens=9, choices=[p.Choice(stop_reason="length", tokens_raw=array("i", [5]).tobytes(),
                                                         logprobs_raw=array("f", [-1.5]).tobytes(),
                                                         versions_raw=array("i", [2]).tobytes(), text="a")]),
    p.TraceReply(id=4, trajectories=[p.WireTrajectory(shared_prefix=0, tokens_raw=b"\x01\x00\x00\x00",
                                                      logprobs_raw=b"\x00" * 4, versions_raw=b"\xff" * 4,
                                                      loss_mask_raw=b"\x00", reward=1.0)]),
    p.Ack(id=5),
    p.Error(id=6, code="gone", message="retired"),
]


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips_through_one_frame(message):
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(p.Request)
    [body] = p.FrameReader().feed(bytes(p.frame(enc, message)))
    assert dec.decode(body) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips_through_one_frame(message):
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(p.Reply)
    [body] = p.FrameReader().feed(bytes(p.frame(enc, message)))
    assert dec.decode(body) == message


def test_messages_are_positional_arrays_tagged_first():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(p.Ping(id=9, payload=b"z")))
    assert raw == ["ping", 9, b"z"]


def test_raw_arrays_decode_to_numbers():
    choice = REPLIES[2].choices[0]
    assert (choice.tokens, choice.logprobs, choice.versions) == ([5], [-1.5], [2])
    traj = REPLIES[3].trajectories[0]
    assert (traj.tokens, traj.versions, traj.loss_mask) == ([1], [-1], [0])


def test_a_request_does_not_decode_as_a_reply_and_unknown_tags_are_rejected():
    enc = msgspec.msgpack.Encoder()
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(p.Reply).decode(enc.encode(p.Ping(id=1)))
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'shutdown'"):
        msgspec.msgpack.Decoder(p.Request).decode(enc.encode(["shutdown", 1]))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(p.Request).decode(enc.encode(["generate", 1, "s", "t", [1, 2, 3]]))


def test_frames_split_anywhere_come_back_whole_and_in_order():
    enc = msgspec.msgpack.Encoder()
    stream = b"".join(bytes(p.frame(enc, m)) for m in REQUESTS)
    bodies = [bytes(p.frame(enc, m))[4:] for m in REQUESTS]
    for step in (1, 2, 3, 5, 7, 64, len(stream)):
        reader = p.FrameReader()
        got = []
        for i in range(0, len(stream), step):
            got += [bytes(b) for b in reader.feed(stream[i:i + step])]
        assert got == bodies and reader.buffered == 0


def test_oversize_and_empty_frames_are_refused_before_buffering():
    reader = p.FrameReader(max_frame=100)
    with pytest.raises(p.FrameTooLarge, match="length=101"):
        reader.feed(p.HEADER.pack(101))
    assert reader.buffered == 0
    with pytest.raises(p.BadFrame, match="length=0"):
        p.FrameReader().feed(p.HEADER.pack(0) + b"x")
    assert p.FrameReader(max_frame=4).feed(p.HEADER.pack(4) + b"abcd") == [b"abcd"]


def test_a_large_frame_in_pieces_is_appended_not_reparsed():
    reader = p.FrameReader()
    payload = bytes(range(256)) * 4096
    data = p.HEADER.pack(len(payload)) + payload
    got = []
    for i in range(0, len(data), 4096):
        got += reader.feed(data[i:i + 4096])
    assert [bytes(b) for b in got] == [payload]


def test_error_codes_map_to_classes_that_inherit_the_stdlib_type():
    assert isinstance(p.error_from_wire("gone", "x"), p.SessionGone)
    assert isinstance(p.error_from_wire("gone", "x"), LookupError)
    assert isinstance(p.error_from_wire("forbidden", "x"), PermissionError)
    assert isinstance(p.error_from_wire("invalid", "x"), ValueError)
    assert isinstance(p.error_from_wire("unavailable", "x"), ConnectionError)
    unknown = p.error_from_wire("brand_new_code", "why")
    assert type(unknown) is p.ServeError and "[brand_new_code] why" in str(unknown)
    for code, cls in p.ERROR_CODES.items():
        assert cls.code == code and issubclass(cls, RequestError)
    assert issubclass(p.ConnectionLost, RLEngineError) and issubclass(p.ConnectionLost, ConnectionError)


def test_client_imports_only_msgspec_and_the_standard_library():
    # The baseline is what the interpreter and msgspec (with its own
    # typing_extensions) load; importing the client may add only the
    # standard library and rlengine's stdlib-only modules.
    code = (
        "import sys, msgspec\n"
        "before = set(sys.modules)\n"
        "import rlengine.sandbox_client\n"
        "new = set(sys.modules) - before\n"
        "extra = sorted({m.split('.')[0] for m in new} - set(sys.stdlib_module_names) - {'rlengine'})\n"
        "ours = sorted(m for m in sys.modules if m.startswith('rlengine'))\n"
        "assert not extra, extra\n"
        "assert ours == ['rlengine', 'rlengine.errors', 'rlengine.protocol', 'rlengine.sandbox_client'], ours\n"
        "assert 'numpy' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_pickle_on_the_wire():
    """No wire module imports a serializer that can run code on load."""
    import rlengine.sandbox_client
    import rlengine.serve

    files = [p.__file__, rlengine.sandbox_client.__file__]
    serve_dir = os.path.dirname(rlengine.serve.__file__)
    files += [os.path.join(serve_dir, f) for f in os.listdir(serve_dir) if f.endswith(".py")]
    banned = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}
    for path in files:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & banned, f"{path} imports {names & banned}"


# -- fuzz -------------------------------------------------------------------------------------

_ENC = msgspec.msgpack.Encoder()
_VALID_FRAMES = [bytes(p.frame(_ENC, m)) for m in REQUESTS]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=6),
                     st.binary(max_size=6), st.lists(st.integers(-1, 300), max_size=3))
_tags = st.sampled_from(["ping", "open", "chat", "generate", "reward", "trace", "close", "pong", "nope", ""])


def _framed(body: bytes) -> bytes:
    return p.HEADER.pack(len(body)) + body


def _mutate(frame_bytes: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(frame_bytes)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    return bytes(data[:cut])


_inputs = st.one_of(
    st.binary(max_size=96),
    st.builds(_mutate, st.sampled_from(_VALID_FRAMES), st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)),
                                                                 max_size=3), st.integers(0, 300)),
    st.builds(lambda tag, rest: _framed(_ENC.encode([tag, *rest])), _tags, st.lists(_scalars, max_size=7)),
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_inputs, cuts=st.lists(st.integers(0, 64), max_size=4))
def test_fuzz_frame_reader_and_request_decoder(data, cuts):
    reader = p.FrameReader(max_frame=1024)
    decoder = msgspec.msgpack.Decoder(p.Request)
    pieces, start = [], 0
    for cut in sorted(cuts):
        pieces.append(data[start:cut])
        start = max(start, cut)
    pieces.append(data[start:])
    for piece in pieces:
        try:
            bodies = reader.feed(piece)
        except (p.FrameTooLarge, p.BadFrame):
            return
        for body in bodies:
            assert 0 < len(body) <= 1024
            try:
                decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
    assert reader.buffered <= 1024 + 4
