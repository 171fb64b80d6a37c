"""Exact speculative decoding for the torch backend: an n-gram drafter that needs no second model.

A running request proposes up to k tokens from its own context (its prompt,
which for a session's turn already holds the whole conversation, and what
it sampled so far): the tokens that followed the most recent earlier
occurrence of its last n tokens, n from ``NGRAM_MAX`` down to 1 (prompt
lookup). The backend then feeds the request's last token and the k drafted
ones in one decode pass (``DecoderRunner.decode`` with ``counts``), which
gives each of the k + 1 positions the logits a one-token step would compute
there if the drafts before it were right.

**Why the output does not change.** The backend samples a token by inverting
the CDF of the row's distribution with a uniform that is a pure function of
the request's seed and the token's index (``sampling.uniforms``). Row j's
token is drawn with the uniform of index ``len(tokens) + j``, the one the
plain step would use; the draft at j + 1 is accepted iff that token equals
it, and at the first mismatch the drawn token itself is emitted (so every
verification emits at least one token). For a point-mass proposal this is
exact rejection sampling: the draft is accepted with probability p(draft),
and on rejection the token is p's sample conditioned on not being the draft,
the residual distribution. More than equal in law, the emitted tokens are
*the* tokens of plain sampling with the same seed, provided each row's
logits are the one-token step's: in batch-invariant mode they are bitwise
(each verified position is its own attention item, one decoded position
against its block's keys, and its rows go through the same fixed tiles:
``invariant.plan_decode``), so tokens and logprobs are bitwise those of
non-speculative sampling. Without batch invariance the law is the same but
the last bits of a logit may follow the pass's shape, like any batch's.

**When it pays.** A verified draft token costs a row of the pass, as much as
a decoded token on the CPU once a batch fills its row tiles, and saves a step
only if it is accepted. So each step the backend verifies the draft tokens
that raise the expected tokens per second (``choose``): a draft's j-th token
is worth a^j expected tokens, a its request's acceptance per token (its
record, shrunk toward the backend's), and a pass of u rows (rounded up to
whole row tiles in batch-invariant mode) costs ``fixed + per_unit * u``
seconds, fitted online to the passes timed so far (``StepCost``). Drafts then
run where a step's fixed cost dominates (small batches, the tile's free rows)
and stop where rows are the cost. A request whose acceptance falls below
``MIN_RATE``, or whose draft was not worth verifying, stops looking for drafts
for a number of tokens that doubles each time (``BACKOFF_TOKENS`` up to
``MAX_BACKOFF_TOKENS``); the backend's record fades every step, so drafts are
tried again after a while where none was verified. Which
drafts are verified changes the speed, never a token: the policy may follow
timings.

This module holds the drafting state and policy only; it never touches the
model, the KV cache or engine state.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BACKOFF_TOKENS", "DEFAULT_K", "MAX_BACKOFF_TOKENS", "MAX_K", "MIN_RATE", "NGRAM_MAX",
           "SPECULATIVE_MODES", "UNINFORMED", "Acceptance", "Drafter", "StepCost", "choose", "drafts"]

SPECULATIVE_MODES = (None, "ngram")
"""``engine_args["speculative"]``: None (off) or ``ngram`` (this module's drafter)."""
NGRAM_MAX = 3
"""The longest suffix looked up; shorter ones down to a single token are tried after it."""
DEFAULT_K = 8
"""Most tokens drafted per verification (``engine_args["speculative_k"]``)."""
MAX_K = 64
UNINFORMED = 0.5
"""The acceptance rate assumed of drafts before any was verified."""
MIN_RATE = 0.2
"""Below this acceptance per drafted token a request stops looking for drafts for a while (two
rejected first tokens in a row, from the uninformed prior)."""
BACKOFF_TOKENS = 8
MAX_BACKOFF_TOKENS = 256
"""Tokens a request generates without drafting after its rate fell, doubling each time up to this."""
_DECAY = 0.9
"""Weight of the past in a request's acceptance record and in the step-cost fit, per observation."""
_PRIOR_TRIALS = 1.0
"""A request's record starts as this many draft tokens at the backend's acceptance rate."""
_MOST_LIKELY = 0.99
"""Acceptance estimates are capped here: a perfect record still leaves the j-th token worth less
than the one before."""


class Acceptance:
    """An acceptance record: draft tokens judged (``trials``) and accepted (``hits``), both decayed
    per verification; the backend's record is the prior of each request's."""

    __slots__ = ("hits", "trials")

    def __init__(self, hits: float = 0.0, trials: float = 0.0) -> None:
        self.hits = hits
        self.trials = trials

    def record(self, hits: int, trials: int) -> None:
        self.hits = _DECAY * self.hits + hits
        self.trials = _DECAY * self.trials + trials

    def fade(self) -> None:
        """Decay without a new observation: a record nothing refreshes returns to its prior (the
        backend's, faded every step, so that drafts are tried again after a while)."""
        self.hits *= _DECAY
        self.trials *= _DECAY

    def rate(self, prior: float) -> float:
        """Acceptance per judged draft token, ``_PRIOR_TRIALS`` of ``prior`` mixed in."""
        return min(_MOST_LIKELY, (self.hits + _PRIOR_TRIALS * prior) / (self.trials + _PRIOR_TRIALS))


class StepCost:
    """Seconds of a decode pass as ``fixed + per_unit * units`` (units: the pass's rows, rounded up to
    whole row tiles in batch-invariant mode), a least-squares fit over the passes observed, the
    older ones decayed. It starts as all fixed cost (drafts free: verify, and learn from the
    timings); ``frozen`` keeps the current figures (tests that want every draft verified)."""

    def __init__(self, fixed: float = 1.0, per_unit: float = 0.0, frozen: bool = False) -> None:
        self.fixed = fixed
        self.per_unit = per_unit
        self.frozen = frozen
        self._sums = np.zeros(5)
        """Decayed sums of 1, u, t, u^2 and u * t over the passes observed."""

    def observe(self, units: int, seconds: float) -> None:
        if self.frozen:
            return
        sums = self._sums
        sums *= _DECAY
        sums += (1.0, units, seconds, units * units, units * seconds)
        n, su, st, suu, sut = sums
        spread = suu / n - (su / n) ** 2
        # Units that barely varied say nothing of the slope: keep the last one.
        if n > 3 and spread > (0.05 * su / n) ** 2:
            self.per_unit = max(0.0, (sut / n - su * st / n ** 2) / spread)
        self.fixed = max(0.0, st / n - self.per_unit * su / n)

    def seconds(self, units: np.ndarray) -> np.ndarray:
        return self.fixed + self.per_unit * units


def choose(lengths: list[int], rates: list[float], rows: int, tile: int, cost: StepCost) -> list[int]:
    """How many tokens of each draft (``lengths``, acceptance per token ``rates``) to verify in a
    pass of ``rows`` other rows (one per running request): the count that maximizes expected
    tokens per second, taking draft tokens in order of their worth (token j of a draft of rate a
    is worth a^j; within a draft, worth falls, so every count takes a prefix of each draft).
    ``tile``: the rows a pass is rounded up to (1: none)."""
    owners = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    depth = np.arange(owners.shape[0]) - np.repeat(starts, lengths) + 1
    worth = np.asarray(rates)[owners] ** depth
    order = np.argsort(-worth, kind="stable")
    counts = np.arange(owners.shape[0] + 1)
    units = -(-(rows + counts) // tile) * tile
    rate = (rows + np.concatenate([[0.0], np.cumsum(worth[order])])) / np.maximum(cost.seconds(units), 1e-12)
    best = int(np.argmax(rate))
    return np.bincount(owners[order[:best]], minlength=len(lengths)).tolist()


def drafts(running: list[tuple[Drafter | None, list[int], int]], tile: int, cost: StepCost,
           acceptance: Acceptance) -> list[list[int]] | None:
    """The drafted tokens of each running sequence (its drafter, its tokens so far, its
    ``max_tokens``) worth verifying this step (``choose``, each sequence's acceptance leaning on
    the backend-wide ``acceptance``); None when there are none. A draft leaves room for the token sampled after it
    within ``max_tokens``; a sequence whose draft is not worth its rows now stops looking for a
    while (``Drafter.pause``)."""
    proposed: list[list[int]] = []
    drafting = []
    for i, (drafter, tokens, max_tokens) in enumerate(running):
        draft = [] if drafter is None else drafter.propose(tokens, max_tokens - len(tokens) - 1)
        if draft:
            drafting.append(i)
        proposed.append(draft)
    acceptance.fade()
    if not drafting:
        return None
    prior = acceptance.rate(UNINFORMED)
    rates = [running[i][0].acceptance.rate(prior) for i in drafting]  # type: ignore[union-attr]
    counts = choose([len(proposed[i]) for i in drafting], rates, len(running), tile, cost)
    for i, n in zip(drafting, counts):
        del proposed[i][n:]
        if not n:
            running[i][0].pause(len(running[i][1]))  # type: ignore[union-attr]
    return proposed if any(counts) else None


class Drafter:
    """One request's drafting state: its context, an index of where each of its n-grams last
    ended, and its acceptance record. Runs on the compute thread."""

    __slots__ = ("acceptance", "backoff", "context", "grams", "indexed", "limit", "prompt_len", "resume_at")

    def __init__(self, prompt: list[int], k: int) -> None:
        self.context = list(prompt)
        """The prompt and the tokens generated so far (appended as ``propose`` sees them)."""
        self.prompt_len = len(prompt)
        self.grams: tuple[dict[object, int], dict[object, int], dict[object, int]] = ({}, {}, {})
        """``grams[n - 1]``: an n-gram (a token for n = 1, else a tuple) -> the position of its last
        token at its most recent occurrence among the positions indexed."""
        self.indexed = 0
        """Positions ``< indexed`` are in ``grams``; the last position never is (it is the query)."""
        self.limit = k
        self.acceptance = Acceptance()
        self.resume_at = 0
        """No drafting before the request has generated this many tokens."""
        self.backoff = BACKOFF_TOKENS

    def propose(self, generated: list[int], room: int) -> list[int]:
        """At most ``room`` (and ``limit``) tokens to verify after ``generated`` (the request's
        tokens so far), or none: drafting is paused, or the last tokens never occurred before."""
        if len(generated) < self.resume_at or room < 1:
            return []
        context = self.context
        grown = self.prompt_len + len(generated) - len(context)
        if grown:
            context.extend(generated[len(generated) - grown:])
        end = len(context) - 1
        self._index(end)
        if context[end] not in self.grams[0]:
            return []  # the last token never occurred before: no longer suffix did either
        k = min(room, self.limit)
        for n in range(min(NGRAM_MAX, end), 0, -1):
            key = context[end] if n == 1 else tuple(context[end - n + 1:end + 1])
            at = self.grams[n - 1].get(key)
            if at is None:
                continue
            # The tokens after the match, continued with the draft itself past the context's end
            # (a period of end - at: "abcab" drafts "cabca...").
            period = end - at
            draft: list[int] = []
            for i in range(k):
                source = at + 1 + i
                draft.append(context[source] if source <= end else draft[i - period])
            return draft
        return []

    def _index(self, end: int) -> None:
        """Index the n-grams (n = 1..3, ``NGRAM_MAX``) ending at positions ``indexed..end-1``."""
        context, (ones, twos, threes) = self.context, self.grams
        for j in range(self.indexed, end):
            ones[context[j]] = j
            if j >= 1:
                twos[context[j - 1], context[j]] = j
                if j >= 2:
                    threes[context[j - 2], context[j - 1], context[j]] = j
        self.indexed = max(self.indexed, end)

    def settle(self, accepted: int, judged: int, generated: int, prior: float) -> None:
        """Record a verification: ``judged`` draft tokens compared with the token drawn (the
        accepted ones and the first rejected one), ``accepted`` of them kept; the request has now
        generated ``generated`` tokens; ``prior``: the backend's acceptance rate."""
        self.acceptance.record(accepted, judged)
        if judged and self.acceptance.rate(prior) < MIN_RATE:
            self.pause(generated)

    def pause(self, generated: int) -> None:
        """Look for no drafts for the next ``backoff`` tokens (a draft was rejected, or not worth
        verifying), and twice as long the next time."""
        self.resume_at = generated + self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_TOKENS)
