"""The sim backend: a deterministic stand-in for an inference engine.

It implements the whole backend protocol with a model small enough to reason
about: one weight tensor ``theta`` of unigram logits. Token ``i`` of a
sequence is a hash of (seed, i), or ``argmax(theta)`` at temperature 0; its
logprob is ``log_softmax(theta)[token]`` under the weights loaded at that
step, so a weight install visibly changes logprobs and every token's version
can be checked. Generation length is fixed or drawn (seeded) per request;
each step can cost simulated time. Tokens decode to one letter each
(``a`` + id mod 26) so stop strings work.

It also polices the engine: ``step`` while asleep, or ``sleep`` with
requests unfinished, raises - a colocation bug would show up as engine
death in tests. ``events`` records sleeps, wakes, installs and steps (the latest 10,000).

It is the backend for control-plane tests and benchmarks, not a model.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from rlengine.backends.base import BackendRequest, Capabilities, RequestOutput
from rlengine.seeding import mix_array

if TYPE_CHECKING:
    from rlengine.config import SimConfig

__all__ = ["SimBackend", "decode_sim_token"]


def _draw(seqs: list[_SimSeq], vocab: int) -> None:
    """Give each sequence its sampled tokens, ``mix(seed, pos) % vocab`` for
    pos < end, in one vectorized pass over the whole batch: per token the
    sim then costs a list lookup, as a zero-cost backend should, not a
    Python big-int hash."""
    ends = np.fromiter((s.end for s in seqs), np.int64, len(seqs))
    total = int(ends.sum())
    seeds = np.fromiter((s.seed & 0xFFFFFFFFFFFFFFFF for s in seqs), np.uint64, len(seqs))
    starts = np.cumsum(ends) - ends
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, ends)
    z = mix_array(np.repeat(seeds, ends), pos)
    # One int32 buffer, a view of it per sequence: no Python int per token
    # outlives its step (thousands of those, freed on this thread and reused
    # by the engine's loop thread, measurably slowed the loop).
    flat = memoryview((z % np.uint64(vocab)).astype(np.int32).tobytes()).cast("i")
    for seq, a, n in zip(seqs, starts.tolist(), ends.tolist()):
        seq.draws = flat[a:a + n]


def decode_sim_token(token: int) -> str:
    return chr(97 + token % 26)


def _log_softmax(theta: np.ndarray) -> np.ndarray:
    t = theta.astype(np.float64)
    m = t.max()
    return (t - m - math.log(np.exp(t - m).sum())).astype(np.float32)


class _SimSeq(msgspec.Struct, gc=False):
    """One simulated sequence. Untracked, with its tokens in arrays (which the
    cyclic collector never scans): the sim should cost the collector as
    little as a real engine's C-side state does."""

    rid: str
    seed: int
    limit: int
    end: int
    greedy: bool
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    prompt: bytes
    want_prompt_lp: bool
    stream: bool
    pos: int = 0
    text: str = ""
    tokens: array | None = None
    logprobs: array | None = None
    draws: memoryview | None = None
    """The sampled tokens, drawn when the sequence starts running (``_draw``)."""
    first: int = 0
    """The step that produced (or will produce) token 0."""

    @property
    def quiet(self) -> bool:
        """Nothing to report before it finishes and nothing can end it early:
        such a sequence is not visited step by step (see ``SimBackend.step``)."""
        return not (self.stream or self.stop_ids or self.stop_strings)

    @classmethod
    def of(cls, req: BackendRequest, gen_len: int) -> _SimSeq:
        p = req.params
        return cls(req.request_id, req.seed, req.max_tokens, min(gen_len, req.max_tokens), p.temperature == 0.0,
                   frozenset(p.stop_token_ids), p.stop_strings, req.prompt, req.prompt_logprobs, req.stream,
                   tokens=array("i"), logprobs=array("f"))


class SimBackend:
    """Deterministic simulated backend; see the module docstring."""

    name = "sim"

    def __init__(self, config: SimConfig) -> None:
        self.config = cfg = config
        self.capabilities = Capabilities(
            sleep=cfg.sleep_supported, prompt_logprobs=True, stop_strings=True,
            why_not_sleep="" if cfg.sleep_supported else "disabled by SimConfig.sleep_supported=False")
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_model_len
        self.version = 0
        self._set_theta(cfg.initial_weights())
        self._waiting: dict[str, _SimSeq] = {}
        self._running: dict[str, _SimSeq] = {}
        """Every running sequence: the ``_ticking`` ones, visited each step, and
        the quiet ones, each listed in ``_due`` under the step it ends at."""
        self._ticking: dict[str, _SimSeq] = {}
        self._due: dict[int, list[_SimSeq]] = {}
        self.asleep = False
        self.steps = 0
        self.events: deque[tuple[Any, ...]] = deque(maxlen=10_000)

    def _set_theta(self, theta: np.ndarray | None) -> None:
        self._theta = theta
        if theta is not None:
            logp = _log_softmax(theta)
            self._logp = logp.tolist()
            self._argmax = int(np.argmax(theta))

    def _gen_len(self, seed: int) -> int:
        cfg = self.config
        if cfg.gen_len_dist == "fixed":
            return cfg.gen_len
        draw = random.Random(seed ^ 0x5EED).lognormvariate(math.log(cfg.gen_len), cfg.gen_len_sigma)
        return max(1, round(draw))

    # -- the protocol ---------------------------------------------------------

    def add_request(self, request: BackendRequest) -> None:
        rid = request.request_id
        if rid in self._running or rid in self._waiting:
            raise ValueError(f"request_id={rid!r}: already in the sim backend")
        self._waiting[rid] = _SimSeq.of(request, self._gen_len(request.seed))

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._running.pop(rid, None)  # a quiet one's _due entry is skipped when its step comes
            self._ticking.pop(rid, None)
            self._waiting.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError("sim backend: step() while asleep (the engine must wake it first)")
        if self._theta is None:
            raise RuntimeError("sim backend: step() with no weights loaded")
        if self.config.fail_at_step and self.steps + 1 >= self.config.fail_at_step:
            raise RuntimeError(f"sim backend: injected failure at step {self.steps + 1} (sim.fail_at_step)")
        running, cap = self._running, self.config.max_num_seqs
        waiting, ticking, due = self._waiting, self._ticking, self._due
        now = self.steps + 1
        admitted = []
        while waiting and len(running) < cap:
            seq = waiting.pop(next(iter(waiting)))
            running[seq.rid] = seq
            seq.first = now
            if not seq.greedy:
                admitted.append(seq)
            if seq.quiet:
                due.setdefault(now + seq.end - 1, []).append(seq)
            else:
                ticking[seq.rid] = seq
        if admitted:
            _draw(admitted, self.vocab_size)
        cfg = self.config
        cost = cfg.step_time_s + cfg.token_time_s * len(running)
        if cost > 0:
            time.sleep(cost)
        self.steps = now
        logp, argmax = self._logp, self._argmax
        outs = []
        done = []
        for seq in ticking.values():
            tok = argmax if seq.greedy else seq.draws[seq.pos]
            seq.pos += 1
            seq.tokens.append(tok)
            seq.logprobs.append(logp[tok])
            stop = tok in seq.stop_ids
            if not stop and seq.stop_strings:
                seq.text += decode_sim_token(tok)
                stop = any(s in seq.text[-len(s) - 1:] for s in seq.stop_strings)
            finished = stop or seq.pos >= seq.end
            if not (seq.stream or finished):
                continue
            outs.append(self._output(seq, finished, stop))
            if finished:
                done.append(seq.rid)
        for rid in done:
            del ticking[rid]
            del running[rid]
        # Quiet sequences: each produced one token per step all along; their
        # tokens (and logprobs under the weights of each step: see
        # load_weights) are written out now, at the step they end.
        for seq in due.pop(now, ()):
            if running.get(seq.rid) is not seq:  # aborted
                continue
            self._catch_up(seq, seq.end)
            outs.append(self._output(seq, True, False))
            del running[seq.rid]
        self.events.append(("step", len(outs)))
        return outs

    def _catch_up(self, seq: _SimSeq, n: int) -> None:
        """Write a quiet sequence's tokens up to ``n`` under the current weights."""
        if n <= seq.pos:
            return
        toks = [self._argmax] * (n - seq.pos) if seq.greedy else seq.draws[seq.pos:n].tolist()
        logp = self._logp
        seq.tokens.extend(toks)
        seq.logprobs.extend([logp[t] for t in toks])
        seq.pos = n

    def _output(self, seq: _SimSeq, finished: bool, stop: bool) -> RequestOutput:
        out = RequestOutput(seq.rid, seq.tokens, seq.logprobs)
        seq.tokens, seq.logprobs = array("i"), array("f")
        if seq.want_prompt_lp:
            seq.want_prompt_lp = False
            prompt = np.frombuffer(seq.prompt, dtype=np.int32)[1:]
            logp = self._logp
            out.prompt_logprobs = [logp[t] for t in prompt.tolist()]
        if finished:
            out.finished = True
            out.stop_reason = "stop" if stop or seq.pos < seq.limit else "length"
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        tensors = dict(named_tensors)
        if set(tensors) != {"theta"}:
            raise ValueError(f"sim backend: load_weights got tensors {sorted(tensors)}, expected ['theta']")
        theta = np.asarray(tensors["theta"], dtype=np.float32)
        if theta.shape != (self.vocab_size,):
            raise ValueError(f"sim backend: theta shape {theta.shape}, expected ({self.vocab_size},)")
        # Quiet sequences have run under the old weights up to now: write
        # their tokens so far before the new weights apply.
        for seq in self._running.values():
            if seq.rid not in self._ticking:
                self._catch_up(seq, self.steps - seq.first + 1)
        self._set_theta(theta.copy())
        self.version = version
        self.events.append(("load_weights", version))

    def sleep(self, level: int = 1) -> None:
        if not self.capabilities.sleep:
            raise RuntimeError("sim backend: sleep is disabled by configuration")
        if self.has_unfinished_requests():
            raise RuntimeError("sim backend: sleep() with unfinished requests (the engine must drain first)")
        self.asleep = True
        if level >= 2:
            self._set_theta(None)
        self.events.append(("sleep", level))

    def wake_up(self) -> None:
        self.asleep = False
        self.events.append(("wake_up",))

    def close(self) -> None:
        self._running.clear()
        self._ticking.clear()
        self._due.clear()
        self._waiting.clear()
        self.events.append(("close",))


def build(config: Any, model_path: str | None = None) -> SimBackend:
    """Registry entry point (``rlengine.backends.SPECS``)."""
    return SimBackend(config.sim)
