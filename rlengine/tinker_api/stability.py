"""Sampled sequences remembered by ``sequence_id``, and the provenance spans of training datums checked against them.

Every sequence the Tinker server samples gets a ``sequence_id``
(``<request id>:<index>``); tinker-cookbook 0.6.1 names, for every position
of an RL datum, the sequence behind it (``Datum.with_provenance``: runs of a
request's prompt, ``PromptProvenanceSpan``, and of a sequence's sampled
tokens, ``SampledProvenanceSpan``, tiling the datum's ``model_input`` and
its ``target_tokens``). ``SequenceRecords`` keeps, per finished sequence, its
request's prompt and its tokens, and, when the sample asked for
``record_stability_info``, what ``stable_reinforce`` trains on: the
behaviour logprob of every sampled token and the policy version (sampler
weights) that produced it.

A datum's spans are checked against those records before anything is
queued (``check``): each names a sequence sampled in the training model's
own session (Tinker's rule) and still held, at an offset and length inside
its prompt or sampled tokens, and the datum's tokens there are the recorded
ones: ``model_input`` tokens under every span, ``target_tokens`` under
sampled spans. Targets under a prompt span are not compared: those
positions carry no loss, and the cookbook's ``rl_loop`` fills them with 0.
A span that fails is ``ProvenanceError`` (400) naming the datum, the span
and the value; one naming a sequence no longer held is ``Gone`` (410).
For ``stable_reinforce`` (``resolve``) every datum must carry spans naming
sequences sampled with ``record_stability_info``; the datum's ``logprobs``
at sampled positions become the recorded behaviour logprobs and its
``mask`` the sampled positions, which the loss reads
(``rlengine.trainer.losses``).

Retention is bounded (``TinkerServerConfig.max_recorded_sequences``,
``max_recorded_bytes``, ``recorded_ttl_s``): the least recently used
record goes first, and a training request that names a sequence counts as
a use (Tinker: "each training request that uses a sequence restarts that
day"). A record holds the response's own buffers, not copies.

The records table is the loop thread's; no engine work. Checking a batch
is split so that nothing per token runs there: ``named_sequences`` (any
thread) lists the sequences a batch names, ``SequenceRecords.lookup`` (loop,
once per distinct sequence) takes their records, and ``check_spans`` /
``resolve_spans`` (any thread) do the token-level comparisons and gathers
on what it took (why that is safe: above ``named_sequences``). The wire
modules (``proto``, ``wire``) decode spans into ``Span`` and a datum
carrying them into a ``ProvenancedDatum`` (``provenanced``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple, NoReturn

import numpy as np

from rlengine.errors import InvalidRequest
from rlengine.tinker_api.errors import Gone, ProvenanceError, TinkerApiError
from rlengine.trainer.losses import concat_inputs, concat_tokens
from rlengine.types import Datum, ModelInput, SampleResponse, TensorData

__all__ = ["ProvenancedDatum", "SequenceRecord", "SequenceRecords", "Span", "check_spans", "named_sequences",
           "provenanced", "resolve_spans"]

_EVICTED_KEPT = 100_000


class Span(NamedTuple):
    """One provenance run: positions ``[offset, offset + length)`` of sequence ``sequence_id``'s sampled
    tokens (``sampled``) or of its request's prompt."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int

    def describe(self) -> str:
        return (f"{'SampledProvenanceSpan' if self.sampled else 'PromptProvenanceSpan'}(sequence_id="
                f"{self.sequence_id!r}, offset={self.offset}, length={self.length})")


class ProvenancedDatum(Datum):
    """A ``Datum`` as a Tinker client sent it, with its provenance (both lists, or it is a plain ``Datum``)."""

    model_input_spans: tuple[Span, ...] = ()
    """Runs tiling ``model_input``."""
    loss_fn_input_spans: tuple[Span, ...] = ()
    """Runs tiling ``loss_fn_inputs["target_tokens"]``."""


def provenanced(model_input: ModelInput, loss_fn_inputs: dict[str, TensorData], model_input_spans: tuple[Span, ...],
                loss_fn_input_spans: tuple[Span, ...], where: str) -> Datum:
    """A decoded datum: a ``ProvenancedDatum`` with both span lists, a plain ``Datum`` with neither;
    ``InvalidRequest`` naming the missing list for one alone (the SDK sends them as a pair)."""
    if not model_input_spans and not loss_fn_input_spans:
        return Datum(model_input=model_input, loss_fn_inputs=loss_fn_inputs)
    if not model_input_spans or not loss_fn_input_spans:
        missing = "model_input_spans" if not model_input_spans else "loss_fn_input_spans"
        raise InvalidRequest(f"{where}.{missing}", None, "provenance comes as a pair: both span lists or neither")
    return ProvenancedDatum(model_input=model_input, loss_fn_inputs=loss_fn_inputs,
                            model_input_spans=model_input_spans, loss_fn_input_spans=loss_fn_input_spans)


class SequenceRecord:
    """One sampled sequence as the server produced it (numpy views of the response's own buffers)."""

    __slots__ = ("logprobs", "nbytes", "owner", "prompt", "session_id", "tokens", "used", "versions", "weights")

    def __init__(self, owner: str, session_id: str, prompt: np.ndarray, tokens: np.ndarray,
                 logprobs: np.ndarray | None, versions: np.ndarray | None, weights: str | None, nbytes: int) -> None:
        self.owner = owner
        self.session_id = session_id
        self.prompt = prompt
        """The request's prompt, int32 (shared by its sequences)."""
        self.tokens = tokens
        """The sampled tokens, int32."""
        self.logprobs = logprobs
        """With ``record_stability_info``: the behaviour logprob of each sampled token, float32."""
        self.versions = versions
        """With ``record_stability_info``: the policy version that sampled each token, int32."""
        self.weights = weights
        """With ``record_stability_info``: the sampler weights the sampling session names (a snapshot key)."""
        self.nbytes = nbytes
        self.used = time.monotonic()

    @property
    def stable(self) -> bool:
        """Whether it was sampled with ``record_stability_info``."""
        return self.logprobs is not None


class _Runs:
    """The spans of a batch, gathered for one vectorized comparison (``SequenceRecords.check``)."""

    __slots__ = ("expected", "first", "starts", "where")

    def __init__(self) -> None:
        self.expected: list[np.ndarray] = []
        """The recorded tokens each compared span claims, in the batch's position order."""
        self.starts: list[int] = []
        """Each one's first position in the batch's concatenated tokens."""
        self.first: list[int] = []
        """Each one's first position in its datum."""
        self.where: list[tuple[str, Span]] = []

    def add(self, expected: np.ndarray, start: int, first: int, where: str, span: Span) -> None:
        self.expected.append(expected)
        self.starts.append(start)
        self.first.append(first)
        self.where.append((where, span))

    def compare(self, actual: np.ndarray, what: str) -> None:
        """``ProvenanceError`` at the first span whose positions in ``actual`` are not its recorded tokens."""
        if not self.expected:
            return
        lengths = np.fromiter((e.size for e in self.expected), dtype=np.int64, count=len(self.expected))
        ends = np.cumsum(lengths)
        # Every compared position of the batch at once: span k covers starts[k] .. starts[k] + lengths[k].
        index = np.arange(int(ends[-1])) + np.repeat(np.asarray(self.starts, dtype=np.int64) - (ends - lengths),
                                                      lengths)
        got, want = actual[index], np.concatenate(self.expected)
        bad = np.flatnonzero(got != want)
        if not bad.size:
            return
        k = int(np.searchsorted(ends, bad[0], side="right"))
        at = int(bad[0] - (ends[k] - lengths[k]))
        where, span = self.where[k]
        raise ProvenanceError(where, span.describe(), f"position {self.first[k] + at} of the datum's {what} is "
                              f"token {int(got[bad[0]])}; the {'sampled' if span.sampled else 'prompt'} token "
                              f"recorded there is {int(want[bad[0]])}")


class SequenceRecords:
    """The records of finished sampled sequences, bounded; see the module docstring. Loop thread only."""

    def __init__(self, max_sequences: int, max_bytes: int, ttl_s: float) -> None:
        self.max_sequences = max_sequences
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.nbytes = 0
        self._records: OrderedDict[str, SequenceRecord] = OrderedDict()
        """Least recently used first."""
        self._evicted: OrderedDict[str, str] = OrderedDict()
        """Sequence ids no longer held -> why."""

    def __len__(self) -> int:
        return len(self._records)

    # -- recording ------------------------------------------------------------------------

    def record(self, owner: str, session_id: str, request_id: str, prompt: bytes, response: SampleResponse,
               stable: bool, weights: str | None = None) -> None:
        """Remember the sequences of a finished sample (``<request_id>:<index>``); with ``stable``, what
        ``stable_reinforce`` needs too."""
        prompt_ids = np.frombuffer(prompt, dtype=np.int32)
        share = len(prompt) // max(1, len(response.sequences))
        for i, seq in enumerate(response.sequences):
            logprobs = seq.logprobs_array() if stable else None
            versions = seq.versions_array() if stable else None
            nbytes = share + len(seq.tokens_raw) + (len(seq.logprobs_raw) + len(seq.versions_raw) if stable else 0)
            # Request ids are unique (the futures table draws them), so no record is replaced.
            self._records[f"{request_id}:{i}"] = SequenceRecord(owner, session_id, prompt_ids, seq.tokens_array(),
                                                                logprobs, versions, weights if stable else None,
                                                                nbytes)
            self.nbytes += nbytes
        self._evict(time.monotonic())

    def _evict(self, now: float) -> None:
        """Drop the least recently used records past the caps, and the ones unused for ``ttl_s``."""
        while self._records:
            sequence_id, oldest = next(iter(self._records.items()))
            if len(self._records) > self.max_sequences:
                why = f"evicted: the server keeps the latest max_recorded_sequences={self.max_sequences}"
            elif self.nbytes > self.max_bytes:
                why = f"evicted: the server keeps at most max_recorded_bytes={self.max_bytes}"
            elif now - oldest.used > self.ttl_s:
                why = f"expired: unused for recorded_ttl_s={self.ttl_s:g}"
            else:
                return
            del self._records[sequence_id]
            self.nbytes -= oldest.nbytes
            self._evicted[sequence_id] = why
            while len(self._evicted) > _EVICTED_KEPT:
                self._evicted.popitem(last=False)

    # -- lookup ------------------------------------------------------------------------------

    def get(self, owner: str, session_id: str, sequence_id: str, field: str) -> SequenceRecord:
        """The record of ``sequence_id`` for a training request of ``session_id``, marked used now."""
        now = time.monotonic()
        self._evict(now)
        return self._use(owner, session_id, sequence_id, field, now)

    def _use(self, owner: str, session_id: str, sequence_id: str, field: str, now: float) -> SequenceRecord:
        record = self._records.get(sequence_id)
        if record is None or record.owner != owner:
            why = self._evicted.get(sequence_id)
            if why is not None and record is None:
                raise Gone(field, sequence_id, f"the sequence is no longer held ({why})")
            raise ProvenanceError(field, sequence_id, "no sequence with this id was sampled (or its sample has "
                                  "not finished)")
        if record.session_id != session_id:
            raise ProvenanceError(field, sequence_id, f"the sequence was sampled in session {record.session_id}; "
                                  f"a training request names sequences of its own session ({session_id})")
        record.used = now
        self._records.move_to_end(sequence_id)
        return record

    # -- checking datums ---------------------------------------------------------------------

    def lookup(self, owner: str, session_id: str, named: dict[str, str]) -> dict[str, SequenceRecord | TinkerApiError]:
        """The records of the sequences a batch names (``named_sequences``), each marked used now, or the
        error naming its first mention (raised by ``check_spans`` where the walk reaches it). Loop thread:
        O(distinct sequences), nothing per token."""
        now = time.monotonic()
        self._evict(now)
        found: dict[str, SequenceRecord | TinkerApiError] = {}
        for sequence_id, field in named.items():
            try:
                found[sequence_id] = self._use(owner, session_id, sequence_id, field, now)
            except (Gone, ProvenanceError) as exc:
                found[sequence_id] = exc
        return found

    def check(self, owner: str, session_id: str, data: list[Datum]) -> list[tuple[int, int, Span, SequenceRecord]]:
        """``check_spans`` of ``data`` against these records, all on the calling (loop) thread."""
        return check_spans(data, self.lookup(owner, session_id, named_sequences(data)))

    def resolve(self, owner: str, session_id: str, data: list[Datum]) -> list[Datum]:
        """``resolve_spans`` of ``data`` against these records, all on the calling (loop) thread."""
        return resolve_spans(data, self.lookup(owner, session_id, named_sequences(data)))


# -- the token-level work: any thread --------------------------------------------------------------
#
# These read the request's own datums and, through ``found``, records taken by ``SequenceRecords.lookup``
# on the loop. That is safe off the loop: a record's arrays (prompt, tokens, logprobs) are set once when
# the sample finishes, over the response's immutable bytes, and never replaced; the loop mutates only
# the records table and each record's ``used``, neither of which is read here. A record evicted after
# the lookup stays alive (and unchanged) while ``found`` holds it, as if the check had run at the lookup.


def named_sequences(data: list[Datum]) -> dict[str, str]:
    """Every sequence id the spans of ``data`` name -> the field of its first mention (the order
    ``check_spans`` walks them)."""
    named: dict[str, str] = {}
    for i, datum in enumerate(data):
        if not isinstance(datum, ProvenancedDatum):
            continue
        for field, spans in (("model_input_spans", datum.model_input_spans),
                             ("loss_fn_input_spans", datum.loss_fn_input_spans)):
            for j, span in enumerate(spans):
                if span.sequence_id not in named:
                    named[span.sequence_id] = f"data[{i}].{field}[{j}].sequence_id"
    return named


def check_spans(data: list[Datum], found: dict[str, SequenceRecord | TinkerApiError]
                ) -> list[tuple[int, int, Span, SequenceRecord]]:
    """Check every ``ProvenancedDatum``'s spans (module docstring; plain datums pass) against the records
    ``found`` for them; returns the sampled runs of the targets as ``(datum index, first position in the
    datum, span, record)``. The first failure in datum and span order is raised."""
    model_runs, target_runs, sampled = _Runs(), _Runs(), []
    spanned: list[Datum] = []
    with_targets: list[Datum] = []
    position = target_position = 0
    for i, datum in enumerate(data):
        if not isinstance(datum, ProvenancedDatum):
            continue
        spanned.append(datum)
        n = datum.model_input.length
        targets = datum.loss_fn_inputs.get("target_tokens")
        # A missing or misshapen target_tokens is left to the loss's validation, which names it.
        compare_targets = targets is not None and targets.shape == [n] and targets.dtype == "int64"
        if compare_targets:
            with_targets.append(datum)
        for field, spans in (("model_input_spans", datum.model_input_spans),
                             ("loss_fn_input_spans", datum.loss_fn_input_spans)):
            total = sum(span.length for span in spans)
            if total != n:
                raise ProvenanceError(f"data[{i}].{field}", total, f"the runs cover {total} positions; they "
                                      f"must tile the datum's {n}")
            model = field == "model_input_spans"
            first = 0
            for j, span in enumerate(spans):
                record = found[span.sequence_id]
                if not isinstance(record, SequenceRecord):
                    # This span is the id's first mention (``named_sequences``): the error names it.
                    raise record
                ids = record.tokens if span.sampled else record.prompt
                end = span.offset + span.length
                if span.offset < 0 or span.length < 0 or end > ids.size:
                    _out_of_range(f"data[{i}].{field}[{j}]", span, ids.size)
                if model:
                    model_runs.add(ids[span.offset:end], position + first, first, f"data[{i}].{field}[{j}]",
                                   span)
                elif span.sampled and span.length:
                    sampled.append((i, first, span, record))
                    if compare_targets:
                        target_runs.add(ids[span.offset:end], target_position + first, first,
                                        f"data[{i}].{field}[{j}]", span)
                first += span.length
        position += n
        if compare_targets:
            target_position += n
    if spanned:
        model_runs.compare(concat_tokens(spanned), "model_input")
        target_runs.compare(concat_inputs(with_targets, "target_tokens"), "target_tokens")
    return sampled


def resolve_spans(data: list[Datum], found: dict[str, SequenceRecord | TinkerApiError]) -> list[Datum]:
    """``stable_reinforce``'s data: each datum checked (``check_spans``) and given the recorded behaviour
    logprobs (``logprobs`` at sampled positions) and its sampled positions (``mask``)."""
    provenanced: list[ProvenancedDatum] = []
    for i, datum in enumerate(data):
        if not isinstance(datum, ProvenancedDatum):
            raise ProvenanceError(f"data[{i}].loss_fn_input_spans", None, "loss_fn='stable_reinforce' needs "
                                  "provenance on every datum (Datum.with_provenance naming the sampled "
                                  "sequences, sampled with record_stability_info=True)")
        provenanced.append(datum)
    sampled = check_spans(data, found)
    lengths = [d.model_input.length for d in data]
    offsets = np.cumsum([0, *lengths]).tolist()
    has = {i for i, _, _, _ in sampled}
    for i in range(len(data)):
        if i not in has:
            raise ProvenanceError(f"data[{i}].loss_fn_input_spans", "no SampledProvenanceSpan",
                                  "loss_fn='stable_reinforce' trains on sampled tokens: name at least one")
    # The batch's columns at once (a datum's own logprobs where it sent them, with its length),
    # then cut back into datums: one conversion, not one per datum.
    behaviour = np.concatenate([_column(d, "logprobs", n) for d, n in zip(data, lengths, strict=True)])
    mask = np.zeros(offsets[-1], dtype=np.float32)
    for i, first, span, record in sampled:
        if record.logprobs is None:
            j = provenanced[i].loss_fn_input_spans.index(span)
            raise ProvenanceError(f"data[{i}].loss_fn_input_spans[{j}].sequence_id", span.sequence_id,
                                  "was sampled without record_stability_info=True: loss_fn='stable_reinforce' "
                                  "needs its recorded behaviour logprobs")
        at = offsets[i] + first
        behaviour[at:at + span.length] = record.logprobs[span.offset:span.offset + span.length]
        mask[at:at + span.length] = 1.0
    if any("mask" in d.loss_fn_inputs for d in data):
        mask *= np.concatenate([_column(d, "mask", n, 1.0) for d, n in zip(data, lengths, strict=True)]) > 0
    columns = {"logprobs": TensorData.from_numpy_parts(behaviour, lengths),
               "mask": TensorData.from_numpy_parts(mask, lengths)}
    return [Datum(model_input=d.model_input,
                  loss_fn_inputs={**d.loss_fn_inputs, "logprobs": columns["logprobs"][i], "mask": columns["mask"][i]})
            for i, d in enumerate(data)]


def _column(datum: Datum, key: str, n: int, default: float = 0.0) -> np.ndarray:
    """Datum input ``key`` as float32 where it has ``n`` values (else ``default`` everywhere: the loss's
    validation names a misshapen input)."""
    given = datum.loss_fn_inputs.get(key)
    if given is not None and given.shape == [n]:
        return given.to_numpy().astype(np.float32, copy=False)
    return np.full(n, default, dtype=np.float32)


def _out_of_range(where: str, span: Span, size: int) -> NoReturn:
    """A span with a negative offset or length, or running past what it names."""
    if span.offset < 0 or span.length < 0:
        raise ProvenanceError(where, span.describe(), "offset and length must be >= 0")
    raise ProvenanceError(where, span.describe(), f"runs past the end of the sequence's "
                          f"{'sampled tokens' if span.sampled else 'prompt'} ({size} tokens)")
