"""The timeline: every request, backend job, training call, gate phase, step and environment
turn of a process, as Chrome trace-event JSON that Perfetto's UI opens unchanged.

Producers (the sampler loop, the training lane, the RL loop, rollouts, sandbox pools) call a
``Timeline``'s record methods; a producer without one (``None``: the default) records nothing and
pays one attribute check. ``Engine(timeline=...)`` gives an engine one; code that knows no engine
(rollouts, sandbox pools) finds the timeline of its task with ``current()`` (a ``ContextVar``
set by ``activate``, inherited by the tasks started inside it).

**What is kept.** Two kinds of events:

* *structural* ones, never dropped: RL steps (with their breakdown, below) and their phases,
  training calls (``forward_backward``, ``optim_step``, ...), and the install gate's phases
  around every piece of blocking work (``seal``, ``drain``, the work, ``reopen``, the sampler's
  ``sleep`` and ``wake``);
* *details*, sampled: one record per request (queued, prefill for streamed requests, running,
  settled; its session, policy versions and token counts, and with speculative decoding its
  drafted and accepted tokens), one per backend job (a run of up to 64 backend steps on the
  compute thread), one per environment step and sandbox job.

The cap (``max_events``) bounds the trace's events. While the file would hold more, the
detail stride doubles: detail ``n`` of its kind (the n-th request, job, environment step) is
kept only when ``n`` is a multiple of the stride, so what stays is an even sample over the
whole run, never just its start or its end; structural events are all kept (a run with more of
them than the cap gets a file that large). ``stride`` in the file's ``otherData`` says how
thinned the details are.

**Where a step's time went.** ``step`` takes the step's bounds (those of its metrics line) and
splits them, exclusively, over what ran: weight install, then training, then sampling (backend
jobs), then waiting on environments, in that priority where they overlap; what none covers is
idle. The parts sum to the step's time. They are computed from the intervals of the step's own
work (kept apart from the sampled details, and dropped once a step has used them), so thinning
never changes them. ``rlengine timeline RUN_DIR`` prints them (``files.report``).

**Cost.** Records are plain tuples appended to lists on the loop thread (where every producer
already runs), with no lock; rendering to JSON happens only when the file is written or the
endpoint read. A record from another thread is safe (appends are atomic under the GIL); one
racing a thinning may be lost, never corrupt anything.

**A resumed run.** Each segment of a run (the first, then each resume) writes its own file, a
trace of its own: ``timeline.json``, then ``timeline-2.json``, ``timeline-3.json``... (``files.segment_path``),
each noting in ``otherData`` its ``segment`` and the checkpoint step it ``resumed_from``. ``files.load`` of a
run directory merges them (``files.merge``): each segment a process of the trace, on the first one's
clock; a step recorded by several segments (re-run after a resume) is shown once, from the later
segment, as ``metrics.jsonl`` keeps it: a resume cuts the earlier segments' steps back to its
checkpoint, and what it runs after that replaces them.

**OpenTelemetry.** With ``otel`` set (a tracer, or True for the global tracer provider's) every
event kept is also sent as a span with its own start and end; ``opentelemetry-api`` is imported
only then, and its absence is a ``ConfigurationError`` naming the setting.

Standard library, msgspec and the lower layers only: it knows no engine type.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from rlengine.errors import ConfigurationError

__all__ = ["DEFAULT_MAX_EVENTS", "PRIORITY", "TIMELINE_FILE", "Timeline", "activate", "breakdown", "category",
           "current"]

TIMELINE_FILE = "timeline.json"
"""Its name in a run directory (the first segment's; a resumed run's follow: ``segment_path``)."""

DEFAULT_MAX_EVENTS = 500_000
"""The default cap on a timeline's events (about 60 MB of JSON)."""

PRIORITY = ("install", "training", "sampling", "environment")
"""A step's parts, highest priority first, where their intervals overlap; the rest is ``idle``."""

_INSTALL_KINDS = frozenset({"install", "unload", "weights", "unload_model"})
"""Blocking work and training-lane calls counted as weight install (the rest is training)."""

# Detail kinds: their own sample counters, and the events each renders to.
_REQUEST, _JOB, _ENV = 0, 1, 2
_REQUEST_EVENTS = 8
_CURRENT: contextvars.ContextVar[Timeline | None] = contextvars.ContextVar("rlengine_timeline", default=None)
_encode = msgspec.json.Encoder().encode


def current() -> Timeline | None:
    """The timeline of the running task (``activate``), or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def activate(timeline: Timeline | None) -> Iterator[None]:
    """Make ``timeline`` the one ``current()`` returns here and in the tasks started inside."""
    token = _CURRENT.set(timeline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def category(kind: str) -> str:
    """The step part a blocking or training call of ``kind`` counts as: ``install`` or ``training``."""
    return "install" if kind in _INSTALL_KINDS else "training"


class Timeline:
    """Records and renders the trace; see the module docstring.

    ``max_events``: the cap on the trace's events; ``otel``: a tracer (``opentelemetry.trace``'s)
    or True for the global one, to send every kept event as a span too."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, *, otel: Any = None,
                 setting: str = "timeline_max_events") -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ConfigurationError(f"{setting}={max_events!r}: must be an integer >= 1")
        self.max_events = int(max_events)
        self.origin = time.monotonic()
        """``ts`` 0 of the trace (``time.monotonic``); ``otherData.origin_unix_s`` is its wall-clock time."""
        self._origin_unix = time.time()
        self._tracks: dict[str, int] = {}
        self._labels: dict[str, int] = {}
        self._kept: list[tuple[Any, ...]] = []
        """Structural events: ("X" | "i", tid, name, cat, start, end, args)."""
        self._details: list[tuple[Any, ...]] = []
        """Sampled details: (number, kind, ...) per kind's layout (``_render_detail``)."""
        self._n_requests = self._n_jobs = self._n_environment = 0
        self._stride = 1
        self._mask = 0
        self._free = self.max_events - 1
        """Events the trace may still take under the cap (the process's metadata event is one)."""
        self._work: list[tuple[str, float, float]] | None = None
        """(part, start, end) of the work since the last step, once steps are recorded (``start_steps``)."""
        self._otel = _tracer(otel) if otel else None

    # -- tracks ---------------------------------------------------------------------------

    def track(self, name: str) -> int:
        """The track (a ``tid``) named ``name``, made on first use: one per thread or role."""
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._free -= 2  # its name and its place
        return tid

    def label(self, base: str) -> str:
        """A name for a producer unique in this timeline: ``base``, then ``base 2``, ``base 3``..."""
        n = self._labels[base] = self._labels.get(base, 0) + 1
        return base if n == 1 else f"{base} {n}"

    # -- structural events (never dropped) ------------------------------------------------

    def span(self, tid: int, name: str, start: float, end: float, cat: str = "engine",
             args: dict[str, Any] | None = None, part: str | None = None) -> None:
        """A complete event on track ``tid`` (``time.monotonic`` bounds), kept whatever the cap;
        ``part`` (one of ``PRIORITY``) counts its time in the step breakdown."""
        self._kept.append(("X", tid, name, cat, start, end, args))
        self._free -= 1
        if part is not None and self._work is not None:
            self._work.append((part, start, end))
        if self._otel is not None:
            self._send(name, start, end, {"cat": cat, **(args or {})})
        if self._free < 0:
            self._thin()

    def instant(self, tid: int, name: str, at: float, cat: str = "gate", args: dict[str, Any] | None = None) -> None:
        """A moment on track ``tid`` (a gate sealed or reopened), kept whatever the cap."""
        self._kept.append(("i", tid, name, cat, at, at, args))
        self._free -= 1
        if self._free < 0:
            self._thin()

    # -- details (sampled) ----------------------------------------------------------------

    def request(self, tid: int, record: Any, outcome: str, settled: float) -> None:
        """One sample call, settled at ``settled``, from its record (the sampler loop's hot path: one
        tuple, no dict). ``record`` is a ``rlengine.core.records.SampleRequest``: of it are kept its
        lease (an untracked Struct: its id, session and the policy versions that produced its
        tokens, read when rendered), its times (``submitted_at``, ``admitted_at``,
        ``first_token_at``: 0 when not observed, as for a request that reports its tokens only at
        the end), its prompt's and sequences' lengths, and speculative decoding's ``drafted`` and
        ``accepted`` tokens (0: none)."""
        n = self._n_requests
        self._n_requests = n + 1
        if n & self._mask:
            return
        tokens = 0
        for seq in record.seqs or ():
            if seq.tokens is not None:  # not ``Sequence.length``: a property call per sequence costs more
                tokens += len(seq.tokens)
        spec = record.spec
        self._details.append((n, _REQUEST, tid, record.lease or record.request_id, record.submitted_at,
                              record.admitted_at, record.first_token_at, settled, len(spec.prompt) >> 2, tokens,
                              spec.num_samples, outcome, record.drafted, record.accepted))
        self._free -= _REQUEST_EVENTS
        if self._free < 0:
            self._thin()
        if self._otel is not None:
            self._send("request", record.submitted_at, settled,
                       {"request_id": record.request_id, "session_id": record.session_id or "",
                        "prompt_tokens": len(spec.prompt) >> 2, "tokens": tokens, "outcome": outcome})

    def job(self, tid: int, start: float, end: float, steps: int, added: int, outputs: int, running: int) -> None:
        """One backend job of the compute thread: ``steps`` backend steps, ``added`` new sequences,
        ``outputs`` outputs returned, ``running`` sequences in flight after it. Its time counts as
        sampling in the step breakdown whether or not the event is kept."""
        if self._work is not None:
            self._work.append(("sampling", start, end))
        n = self._n_jobs
        self._n_jobs = n + 1
        if n & self._mask:
            return
        self._keep((n, _JOB, tid, start, end, steps, added, outputs, running), 1,
                   "decode", start, end, {"steps": steps, "added": added, "outputs": outputs})

    def environment(self, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        """One environment step, first observation or sandbox job (``name``), on the environments
        track (async slices: they overlap). Counts as waiting on environments in the breakdown."""
        if self._work is not None:
            self._work.append(("environment", start, end))
        n = self._n_environment
        self._n_environment = n + 1
        if n & self._mask:
            return
        self._keep((n, _ENV, self.track("environments"), name, start, end, args), 2, name, start, end, dict(args or {}))

    def _keep(self, detail: tuple[Any, ...], events: int, name: str, start: float, end: float,
              attributes: dict[str, Any]) -> None:
        """A detail that passed the stride, rendering to ``events`` events (a span too, with OpenTelemetry)."""
        self._details.append(detail)
        self._free -= events
        if self._otel is not None:
            self._send(name, start, end, attributes)
        if self._free < 0:
            self._thin()

    def _thin(self) -> None:
        """Double the detail stride until the trace fits the cap (or no detail is left)."""
        while self._free < 0 and self._details:
            self._stride *= 2
            self._mask = mask = self._stride - 1
            self._details = [d for d in self._details if not d[0] & mask]
            self._free = self.max_events - len(self)

    # -- steps ----------------------------------------------------------------------------

    def start_steps(self) -> None:
        """From now on, keep the intervals of work for ``step``'s breakdown (an RL run calls it
        where its first step starts; a server, which has no steps, never does)."""
        if self._work is None:
            self._work = []

    def step(self, step: int, start: float, end: float, args: dict[str, Any] | None = None) -> dict[str, float]:
        """An RL step from ``start`` to ``end`` (its metrics line's bounds): a structural event
        on the ``rl steps`` track carrying its breakdown (``breakdown``), which is returned."""
        work = self._work or []
        parts = breakdown(work, start, end)
        # Work that ended by ``end`` has been counted; what runs on into the next step stays.
        self._work = [w for w in work if w[2] > end] if self._work is not None else None
        self.span(self.track("rl steps"), f"step {step}", start, end, "step",
                  {"step": step, "wall_s": end - start, **{f"{k}_s": v for k, v in parts.items()}, **(args or {})})
        return parts

    # -- output -----------------------------------------------------------------------------

    @property
    def stride(self) -> int:
        """Details kept: one in ``stride`` of each kind (1: all)."""
        return self._stride

    def __len__(self) -> int:
        """Events the trace holds now, metadata included."""
        sizes = (_REQUEST_EVENTS, 1, 2)
        return 1 + 2 * len(self._tracks) + len(self._kept) + sum(sizes[d[1]] for d in list(self._details))

    def events(self) -> list[dict[str, Any]]:
        """The trace events: metadata naming the process and the tracks first, then the rest in
        time order (a track's ``ts`` never decreases; an enclosing slice comes before those it holds)."""
        pid = os.getpid()
        meta: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                       "args": {"name": "rlengine"}}]
        for name, tid in list(self._tracks.items()):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        timed: list[tuple[float, float, int, dict[str, Any]]] = []
        origin = self.origin
        for ph, tid, name, cat, start, end, args in list(self._kept):
            event = {"ph": ph, "name": name, "cat": cat, "ts": _us(start - origin), "pid": pid, "tid": tid}
            if ph == "X":
                event["dur"] = _us(end - start)
            else:
                event["s"] = "t"
            if args:
                event["args"] = args
            timed.append((event["ts"], -event.get("dur", 0.0), len(timed), event))
        for detail in list(self._details):
            for event in _render_detail(detail, pid, origin):
                timed.append((event["ts"], -event.get("dur", 0.0), len(timed), event))
        timed.sort(key=lambda t: t[:3])
        return meta + [t[3] for t in timed]

    def document(self, other: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON object a trace viewer opens (``traceEvents`` and ``otherData``, with ``other`` added
        to it: a run's ``segment`` and ``resumed_from``)."""
        return {"traceEvents": self.events(), "displayTimeUnit": "ms",
                "otherData": {"producer": "rlengine", "origin_unix_s": self._origin_unix,
                              "max_events": self.max_events, "stride": self._stride,
                              "details_seen": {"requests": self._n_requests, "jobs": self._n_jobs,
                                               "environment": self._n_environment}, **(other or {})}}

    def to_json(self, other: dict[str, Any] | None = None) -> bytes:
        return _encode(self.document(other))

    def write(self, path: str) -> str:
        """Write the trace to ``path`` (through a temporary file: a reader never sees half of it)."""
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path

    def recent(self, n: int = 100) -> list[dict[str, Any]]:
        """The last ``n`` events by time (for a hang dump: ``rlengine.core.hangs`` sources)."""
        return self.events()[-n:]

    # -- OpenTelemetry ----------------------------------------------------------------------

    def _send(self, name: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        shift = self._origin_unix - self.origin
        span = self._otel.start_span(name, start_time=int((start + shift) * 1e9),
                                     attributes={k: v for k, v in attributes.items() if _otel_value(v)})
        span.end(end_time=int((end + shift) * 1e9))


def breakdown(work: list[tuple[str, float, float]], start: float, end: float) -> dict[str, float]:
    """Split ``[start, end]`` over the parts of ``work`` ((part, start, end) intervals), each moment
    to the highest part of ``PRIORITY`` running then, ``idle`` where none is; the values sum to
    ``end - start``."""
    points: list[tuple[float, int, int]] = []
    rank = {part: i for i, part in enumerate(PRIORITY)}
    for part, s, e in work:
        s, e = max(s, start), min(e, end)
        if e > s:
            points.append((s, 1, rank[part]))
            points.append((e, -1, rank[part]))
    points.sort()
    active = [0] * len(PRIORITY)
    out = dict.fromkeys(PRIORITY, 0.0)
    covered = 0.0
    last = start
    for at, delta, r in points:
        if at > last:
            top = next((i for i, a in enumerate(active) if a), None)
            if top is not None:
                out[PRIORITY[top]] += at - last
                covered += at - last
            last = at
        active[r] += delta
    out["idle"] = max(0.0, (end - start) - covered)
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _render_detail(detail: tuple[Any, ...], pid: int, origin: float) -> list[dict[str, Any]]:
    kind = detail[1]
    if kind == _JOB:
        _, _, tid, start, end, steps, added, outputs, running = detail
        return [{"ph": "X", "name": "decode", "cat": "decode", "ts": _us(start - origin), "dur": _us(end - start),
                 "pid": pid, "tid": tid, "args": {"steps": steps, "added": added, "outputs": outputs,
                                                  "running": running}}]
    if kind == _ENV:
        number, _, tid, name, start, end, args = detail
        ident = f"env{number}"
        head = {"ph": "b", "name": name, "cat": "environment", "id": ident, "ts": _us(start - origin), "pid": pid,
                "tid": tid}
        if args:
            head["args"] = args
        return [head, {"ph": "e", "name": name, "cat": "environment", "id": ident, "ts": _us(end - origin),
                       "pid": pid, "tid": tid}]
    (_, _, tid, lease, submitted, admitted, first_token, settled, prompt_tokens, tokens, samples, outcome, drafted,
     accepted) = detail
    if isinstance(lease, str):  # settled without a lease
        rid, session, versions = lease, None, []
    else:
        rid, session, versions = lease.request_id, lease.session_id, sorted(lease.versions or ())
    admitted = admitted or settled  # never admitted (aborted in the queue): queued until settled
    args: dict[str, Any] = {"request_id": rid, "session_id": session, "versions": versions,
                            "prompt_tokens": prompt_tokens, "tokens": tokens, "samples": samples, "outcome": outcome,
                            "queued_s": admitted - submitted, "duration_s": settled - submitted}
    if drafted:
        args |= {"drafted_tokens": drafted, "accepted_tokens": accepted}

    def pair(name: str, start: float, end: float, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        head = {"ph": "b", "name": name, "cat": "request", "id": rid, "ts": _us(start - origin), "pid": pid, "tid": tid}
        if extra:
            head["args"] = extra
        return [head, {"ph": "e", "name": name, "cat": "request", "id": rid, "ts": _us(end - origin), "pid": pid,
                       "tid": tid}]

    out = pair(f"request {rid}", submitted, settled, args)
    inner = pair("queued", submitted, admitted)
    if first_token and admitted <= first_token <= settled:
        inner += pair("prefill", admitted, first_token) + pair("decode", first_token, settled)
    else:
        inner += pair("running", admitted, settled)
    # The outer slice encloses the inner ones: its begin first, its end last.
    return [out[0], *inner, out[1]]


def _tracer(otel: Any) -> Any:
    if otel is not True:
        return otel
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigurationError("timeline_otel=True: needs the OpenTelemetry API "
                                 "(pip install opentelemetry-api opentelemetry-sdk)") from None
    return trace.get_tracer("rlengine")


def _otel_value(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))
