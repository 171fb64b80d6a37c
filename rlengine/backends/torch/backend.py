"""The torch backend: a local HF causal LM behind the backend protocol, continuously batched.

Iteration-level scheduling, as vLLM does it:

* ``add_request`` only queues; a request joins the running batch at the next
  step boundary (FIFO, at most ``EngineConfig.max_num_seqs`` running; the
  rest wait), where its prompt is prefilled together with the other joiners
  and its first token sampled in that same step.
* every step decodes one token for all running sequences in one batch
  (``DecoderRunner.decode``), each at its own length;
* a sequence leaves the batch in the step it finishes (a stop token, the
  model's eos, a stop string, or ``max_tokens``), freeing its slot at once.

A streaming request (``BackendRequest.stream``) reports its new token every
step; a non-streaming one reports once, when it finishes, with all its
tokens. Sampling is per request (``sampling``): temperature (0 = greedy),
top-k, top-p and draws from the request's seed (``sampling.uniforms``). The logprob of each token is the raw ``log_softmax``, what the trainer
computes; so are the prompt logprobs, the top k at each prompt position
(``BackendRequest.prompt_top_logprobs``) and the ``prompt_scoring`` scores
(``prompt_scores``: chosen tokens, draws), from the prefill's own logits.
Stop tokens are included in the output, as in vLLM and Tinker; stop strings
end generation at the token that completes them.

A request with a ``constraint`` (constrained decoding: an xgrammar
structural tag) gets its own grammar matcher at ``add_request`` (compiled
there, on the compute thread); each step its row of the logits is masked to
the tokens the grammar allows before sampling, so the token and its logprob
come from the masked distribution (``backends.grammar``).

Prefix KV reuse (``prefix_cache``, ``engine_args["prefix_cache_bytes"]``, 0
off): the KV of every prompt prefilled, and by default of every sequence that
finished normally (prompt and generated tokens), goes into a radix tree
under a byte budget with LRU eviction. A joiner whose prompt starts with a
cached prefix copies that KV into its slot and prefills only the rest (at
least its last token, whose logits it samples from); the samples of a group,
which arrive together with one prompt, are prefilled in two passes of one
step, the first sample, then the others over its KV. Reused KV gives the
tokens and logprobs of a cold prefill within rounding (1e-5 in float32), and bitwise in
batch-invariant mode, where only prefilled KV is cached (``decoder``). A
request for prompt logprobs (or their top k) runs its whole prompt: they need
every position's logits.

Speculative decoding (``engine_args["speculative"] = "ngram"``, off by default): a running
request drafts up to ``speculative_k`` tokens from its own context (prompt lookup,
``speculative``), the step feeds its last token and the drafts in one pass, and each drafted
token is kept while the token sampled before it (with that position's own draw) equals it. The
tokens and logprobs are those of plain decoding with the same seed, bitwise in batch-invariant
mode; each output reports the tokens drafted and accepted since the previous one.

``load_weights`` copies named tensors into the backend's own model copy
(validated completely before the first copy, so a bad install leaves the old
weights intact) and empties the prefix cache: KV computed by other weights is
stale, and neither it nor the KV of a request that ran across the install is
ever reused. The backend cannot sleep: it frees its KV cache whenever no
request runs, and its weights stay resident.

Compute thread only; it never touches engine state (see ``backends.base``).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from rlengine.backends.base import BackendRequest, Capabilities, RequestOutput
from rlengine.backends.grammar import Grammars, mask_logits
from rlengine.backends.torch.decoder import DecoderRunner, PrefillJob
from rlengine.backends.torch.prefix_cache import PrefixCache, common_prefix
from rlengine.backends.torch.runtime import (
    PREFIX_CACHE_BYTES,
    configure_threads,
    engine_args,
    load_causal_lm,
    pick_device,
    threads_share,
    torch_dtype,
)
from rlengine.backends.torch.sampling import processed_log_softmax, sample_tokens
from rlengine.backends.torch.sequence import BackendSequence, backend_tokenizer, eos_ids
from rlengine.backends.torch.speculative import (
    DEFAULT_K,
    SPECULATIVE_MODES,
    UNINFORMED,
    Acceptance,
    Drafter,
    StepCost,
    drafts,
)
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.types import MAX_TOP_LOGPROBS

__all__ = ["TorchBackend", "build"]

log = logging.getLogger("rlengine")

_LENGTH_HINT = 256
_MIN_SHARED = 32
"""Tokens a joiner must share with an earlier joiner of its step (beyond what the prefix cache
already holds) to wait for that one's KV: the second prefill pass this costs is worth it then."""
_MAX_QUIET_STEPS = 16
_MIN_REUSE = 16
"""The shortest cached prefix worth reusing: copying a few positions' KV in and resuming costs
more than computing them (an RL recipe's short prompts never touch the cache)."""


class TorchBackend:
    """Continuous-batching PyTorch backend; see the module docstring.

    Why one class: the ``Backend`` protocol over one slot table and KV cache that admission,
    prefill, decode, prefix reuse and installs all change (the computing is in other modules).
    """

    name = "torch"

    def __init__(self, model_path: str, *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 prefill_tokens: int = 8192, batch_invariant: bool = False, processed: bool = False,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES, threads_share: int = 1,
                 speculative: str | None = None, speculative_k: int = DEFAULT_K) -> None:
        self.threads = configure_threads(threads_share)
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.model_path = model_path
        model = load_causal_lm(model_path, self.device, dtype)
        model.eval().requires_grad_(False)
        self.model = model
        hf = model.config
        self.vocab_size = int(hf.vocab_size)
        limit = int(getattr(hf, "max_position_embeddings", 0) or 0) or None
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ConfigurationError(f"max_model_len={max_model_len}: exceeds the model's "
                                     f"max_position_embeddings {limit}")
        if max_model_len is None and limit is None:
            raise ConfigurationError(f"model={model_path!r}: the config has no max_position_embeddings; "
                                     "set max_model_len")
        self.max_model_len = int(max_model_len or limit)  # type: ignore[arg-type]
        self.max_num_seqs = max_num_seqs
        self.prefill_tokens = prefill_tokens
        self.eos_ids = eos_ids(model)
        self.tokenizer = backend_tokenizer(model_path)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.runner = DecoderRunner(model, self.max_model_len, batch_invariant=batch_invariant)
        kernel_check = None
        if batch_invariant:
            report = self.runner.check_kernels()
            kernel_check = {**report.describe(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "threads": self.threads}
            if not report.ok:
                log.warning("rlengine: batch-invariant mode: this machine's kernels round by place inside a "
                            "fixed-shape call (%s); a sequence's last bits may follow its batch here",
                            ", ".join(report.failed))
        self.prefix_cache = (PrefixCache(prefix_cache_bytes, self.runner.cache.bytes_per_token)
                             if prefix_cache_bytes else None)
        self.reused_tokens = 0
        """Prompt tokens whose prefill the prefix cache spared, since the backend started."""
        if speculative not in SPECULATIVE_MODES:
            raise ConfigurationError(f"engine_args['speculative']={speculative!r}: must be one of "
                                     f"{', '.join(map(repr, SPECULATIVE_MODES))}")
        self.speculative_k = speculative_k if speculative else 0
        """Most tokens a request drafts per step (0: no speculative decoding)."""
        self.drafted_tokens = self.accepted_tokens = 0
        """Tokens drafted and accepted since the backend started."""
        self.acceptance = Acceptance()
        """The recent acceptance of every request's drafts: the prior of a request's own."""
        self.step_cost = StepCost()
        """Seconds of a decode pass by its rows, fitted to this backend's passes (``speculative.choose``)."""
        self._quiet_steps = 0
        self._quiet_backoff = 1
        """After a step that verified no draft, the next ``_quiet_steps`` steps look for none (the
        pause doubles, up to ``_MAX_QUIET_STEPS``, until a draft is verified again): looking costs
        every running request a lookup per step."""
        self._epoch = 0
        """Weight installs so far (``BackendSequence.epoch``)."""
        why = ("CPU: there is no accelerator memory to release" if self.device.type == "cpu" else
               "the torch backend frees its KV cache whenever no request runs; weights stay resident")
        self.capabilities = Capabilities(sleep=False, prompt_logprobs=True, stop_strings=self.tokenizer is not None,
                                         constraints=self.tokenizer is not None, top_logprobs=MAX_TOP_LOGPROBS,
                                         prompt_top_logprobs=MAX_TOP_LOGPROBS, prompt_scores=True, why_not_sleep=why,
                                         logprobs_modes=("processed", "raw") if processed else ("raw", "processed"),
                                         batch_invariant=batch_invariant, kernel_check=kernel_check)
        # Every name a weight install may use (tied aliases included) and the
        # canonical parameter each one lands in.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._canonical = {id(p): name for name, p in model.named_parameters()}
        self.version = 0
        self.steps = 0
        self._waiting: OrderedDict[str, BackendSequence] = OrderedDict()
        self._running: list[BackendSequence] = []
        """Running sequences; ``_running[i]`` owns KV cache slot ``i``."""
        self._active: set[str] = set()
        """Ids of every waiting or running request."""

    # -- the protocol ---------------------------------------------------------------

    def add_request(self, request: BackendRequest) -> None:
        rid = request.request_id
        if rid in self._active:
            raise InvalidRequest("request_id", rid, "already in the torch backend")
        prompt = np.frombuffer(request.prompt, dtype=np.int32)
        n = len(ids := prompt.tolist())
        if n == 0:
            raise InvalidRequest("prompt", "[]", "must hold at least one token")
        top = max(ids)  # over the list the sequence keeps: cheaper than two numpy reductions of a short prompt
        if top >= self.vocab_size or min(ids) < 0:
            raise InvalidRequest("prompt", top, f"token ids must be in [0, {self.vocab_size})")
        if request.max_tokens < 1 or n + request.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", request.max_tokens,
                                 f"prompt of {n} tokens + max_tokens exceeds max_model_len {self.max_model_len}")
        if request.params.stop_strings and self.tokenizer is None:
            raise InvalidRequest("sampling_params.stop", request.params.stop, "the model directory has no tokenizer")
        p = request.params
        constrained = (self.grammars.matcher(p.constraint, budget=request.max_tokens) if p.constraint is not None
                       else None)
        # A grammar's matcher advances token by token: a constrained request never drafts.
        drafter = Drafter(ids, self.speculative_k) if self.speculative_k and constrained is None else None
        self._waiting[rid] = BackendSequence(request, prompt, ids, self.vocab_size, self.eos_ids, self.tokenizer, constrained,
                                  drafter)
        self._active.add(rid)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        for rid in ids:
            if self._waiting.pop(rid, None) is not None:
                self._active.discard(rid)
        gone = [i for i, s in enumerate(self._running) if s.rid in ids]
        if gone:
            # The cache holds inference tensors: moving slots needs inference mode.
            with torch.inference_mode():
                self._free_slots(gone)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            outputs: list[RequestOutput] = []
            finished: list[int] = []
            running = self._running
            if running:
                started = time.perf_counter()
                lengths = [s.length for s in running]
                drafts = None
                if self.speculative_k:
                    if self._quiet_steps:
                        self._quiet_steps -= 1
                    else:
                        drafts = self._draft(running)
                        self._quiet_steps = 0 if drafts else self._quiet_backoff
                        self._quiet_backoff = 1 if drafts else min(2 * self._quiet_backoff, _MAX_QUIET_STEPS)
                if drafts is None:
                    tokens = torch.as_tensor([s.tokens[-1] for s in running], device=self.device)
                    logits = self.runner.decode(tokens, lengths)
                else:  # each sequence's last token and its drafts, verified in one pass
                    tokens = torch.as_tensor([t for s, d in zip(running, drafts) for t in (s.tokens[-1], *d)],
                                             device=self.device)
                    logits = self.runner.decode(tokens, lengths, [len(d) + 1 for d in drafts])
                self._emit(running, 0, logits, [None] * len(running), outputs, finished, drafts)
                for s in running:  # the KV of every token but the last (never fed back yet)
                    s.length = len(s.prompt) + len(s.tokens) - 1
                if self.speculative_k:  # _emit read the logits back: the device is done with the pass
                    self.step_cost.observe(self._units(int(tokens.shape[0])), time.perf_counter() - started)
            joiners = self._admit()
            if joiners:
                first = len(running)
                # Room for every running sequence to reach its max_tokens, or twice its prompt (at
                # least _LENGTH_HINT) if that is far: decode then rarely regrows the cache.
                self.runner.reserve(first + len(joiners), max(
                    min(len(s.prompt) + s.max_tokens, max(2 * len(s.prompt), _LENGTH_HINT))
                    for s in itertools.chain(running, joiners)))
                joiners, logits, prompt_lps = self._prefill(joiners, first)
                self._emit(joiners, first, logits, prompt_lps, outputs, finished)
            self._free_slots(finished)
            self.steps += 1
        return outputs

    def _draft(self, running: list[BackendSequence]) -> list[list[int]] | None:
        """The drafts of each running sequence worth verifying this step (``speculative.drafts``)."""
        return drafts([(s.drafter, s.tokens, s.max_tokens) for s in running], self._units(1), self.step_cost,
                      self.acceptance)

    def _units(self, rows: int) -> int:
        """What a decode pass of ``rows`` rows costs, in rows: whole row tiles in batch-invariant mode."""
        if not self.runner.batch_invariant:
            return rows
        tile = self.runner.tiles.rows
        return -(-rows // tile) * tile

    def _admit(self) -> list[BackendSequence]:
        """FIFO joiners for this step, within the batch cap and the prefill token budget."""
        joiners: list[BackendSequence] = []
        longest = 0
        while self._waiting and len(self._running) + len(joiners) < self.max_num_seqs:
            seq = next(iter(self._waiting.values()))
            longest_if = max(longest, len(seq.prompt))
            # Prefill pads every prompt to the longest one.
            if joiners and longest_if * (len(joiners) + 1) > self.prefill_tokens:
                break
            self._waiting.popitem(last=False)
            joiners.append(seq)
            longest = longest_if
        return joiners

    def _prefill(self, joiners: list[BackendSequence], first: int) -> tuple[list[BackendSequence], torch.Tensor, list[list[float] | None]]:
        """Prefill this step's joiners into slots ``first..``, reusing cached prefixes; returns them
        in slot order with their last positions' logits and their prompt logprobs.

        A group's samples arrive together with one prompt: it is prefilled once and its KV and
        last logits copied to the others (the same numbers, computed once). Joiners that share at
        least ``_MIN_SHARED`` more tokens with an earlier one than the cache held are prefilled in
        a second pass, over its KV (cached after the first)."""
        cache = self.prefix_cache
        later: list[BackendSequence] = []
        copies: list[tuple[BackendSequence, BackendSequence]] = []
        if cache is not None:
            leaders: list[BackendSequence] = []
            originals: dict[bytes, BackendSequence] = {}
            for seq in joiners:
                key = seq.ids.tobytes()
                original = None if seq.needs_whole_prompt else originals.get(key)
                if original is not None:
                    copies.append((seq, original))
                    continue
                originals.setdefault(key, seq)
                limit = len(seq.prompt) - 1
                if seq.needs_whole_prompt or limit < _MIN_REUSE:
                    leaders.append(seq)
                    continue
                held = cache.match(seq.ids, limit)[0]
                shared = max((common_prefix(seq.ids[:limit], other.ids) for other in leaders
                              if other.ids[0] == seq.ids[0]), default=0)
                (later if shared >= held + _MIN_SHARED else leaders).append(seq)
            joiners = leaders
        self._running.extend(joiners)
        logits, prompt_lps = self._prefill_pass(joiners, first)
        if later:
            self._cache_prompts(joiners, first)
            self._running.extend(later)
            more, more_lps = self._prefill_pass(later, first + len(joiners))
            logits, prompt_lps = torch.cat([logits, more]), prompt_lps + more_lps
            self._cache_prompts(later, first + len(joiners))
            joiners = joiners + later
        else:
            self._cache_prompts(joiners, first)
        if copies:
            slot_of = {id(seq): first + i for i, seq in enumerate(joiners)}
            at = first + len(joiners)
            self.runner.cache.move([slot_of[id(original)] for _, original in copies],
                                   list(range(at, at + len(copies))), max(len(seq.prompt) for seq, _ in copies))
            for seq, _ in copies:
                seq.length, seq.epoch, seq.cached = len(seq.prompt), self._epoch, len(seq.prompt)
                self.reused_tokens += len(seq.prompt)
            self._running.extend(seq for seq, _ in copies)
            rows = torch.as_tensor([slot_of[id(original)] - first for _, original in copies], device=logits.device)
            logits = torch.cat([logits, logits.index_select(0, rows)])
            prompt_lps = prompt_lps + [None] * len(copies)
            joiners = joiners + [seq for seq, _ in copies]
        return joiners, logits, prompt_lps

    def _prefill_pass(self, seqs: list[BackendSequence], first: int) -> tuple[torch.Tensor, list[list[float] | None]]:
        cache = self.prefix_cache
        jobs = []
        for seq in seqs:
            start, pieces = 0, []
            if cache is not None and not seq.needs_whole_prompt and len(seq.prompt) > _MIN_REUSE:
                start, pieces = cache.match(seq.ids, len(seq.prompt) - 1)
                if start < _MIN_REUSE:
                    start, pieces = 0, []
            seq.epoch, seq.cached = self._epoch, start
            self.reused_tokens += start
            jobs.append(PrefillJob(seq.prompt, start, pieces, seq.want_prompt_logprobs, seq.prompt_top, seq.scorer))
        logits, prompt_lps, prompt_tops = self.runner.prefill(jobs, first)
        for seq, tops in zip(seqs, prompt_tops):
            seq.length = len(seq.prompt)
            seq.prompt_tops = tops
        return logits, prompt_lps

    def _cache_prompts(self, seqs: list[BackendSequence], first: int) -> None:
        """Put the prompts just prefilled into slots ``first..`` into the prefix cache."""
        if self.prefix_cache is None:
            return
        for i, seq in enumerate(seqs):
            self._cache_slot(first + i, seq.ids)

    def _cache_slot(self, slot: int, tokens: np.ndarray) -> None:
        if tokens.shape[0] < _MIN_REUSE:
            return  # no prefix of it would be reused
        read = self.runner.cache.read
        assert self.prefix_cache is not None
        self.prefix_cache.insert(tokens, lambda start, end: read(slot, start, end))

    def _emit(self, seqs: list[BackendSequence], first_slot: int, logits: torch.Tensor,
              prompt_lps: list[list[float] | None], outputs: list[RequestOutput], finished: list[int],
              drafts: list[list[int]] | None = None) -> None:
        """Sample each sequence's tokens, record them, and decide who finishes.

        Without ``drafts`` sequence i owns row i of ``logits`` and gets one token. With them (a
        verification pass) it owns ``1 + len(drafts[i])`` consecutive rows; row j's token is drawn
        with the draw the plain step would use for it (counter ``len(tokens) + j``), and the next
        row counts only while the token drawn equals the draft there (``speculative``)."""
        device = logits.device
        if drafts is None:
            owners, counters, firsts = seqs, [len(s.tokens) for s in seqs], range(len(seqs))
        else:
            owners = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
            counters = [len(s.tokens) + j for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
            firsts = list(itertools.accumulate((len(d) + 1 for d in drafts[:-1]), initial=0))
        constrained = [(firsts[i], s.constrained) for i, s in enumerate(seqs) if s.constrained is not None]
        if constrained:  # one row each: a constrained sequence never drafts
            mask_logits(logits, [row for row, _ in constrained], [c for _, c in constrained])
        seeds = [s.seed for s in owners]
        if any(seed is not None for seed in seeds):
            tokens, logprobs = sample_tokens(
                logits, seeds, counters, temperature=torch.as_tensor([s.temperature or 1.0 for s in owners],
                                                                     device=device),
                top_k=torch.as_tensor([s.top_k for s in owners], device=device),
                top_p=torch.as_tensor([s.top_p for s in owners], device=device),
                processed=[s.processed for s in owners])
        else:
            tokens, logprobs = sample_tokens(logits, seeds, counters)
        top = max(s.top for s in seqs)
        if top:  # the alternatives, from the distribution the token was drawn from (masked if constrained)
            dist = logits.log_softmax(-1)
            rows = [i for i, s in enumerate(owners) if s.processed and s.seed is not None]
            if rows:  # processed logprobs: their alternatives are processed too
                index = torch.as_tensor(rows, device=device)
                dist = dist.index_copy(0, index, processed_log_softmax(
                    logits[index], torch.as_tensor([owners[i].temperature for i in rows], device=device),
                    torch.as_tensor([owners[i].top_k for i in rows], device=device),
                    torch.as_tensor([owners[i].top_p for i in rows], device=device)))
            top_lps, top_ids = dist.topk(top, dim=-1)
            top_lps, top_ids = top_lps.tolist(), top_ids.tolist()
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        for i, seq in enumerate(seqs):
            if prompt_lps[i] is not None:
                seq.prompt_logprobs = prompt_lps[i]
            draft = () if drafts is None else drafts[i]
            first = firsts[i]
            error = None
            done = stop = False
            for j in range(len(draft) + 1):
                row = first + j
                token, logprob = tokens[row], logprobs[row]
                # A NaN or +inf anywhere in a row makes its log_softmax, hence this
                # logprob, non-finite: one check per token instead of a pass over the vocab.
                if not math.isfinite(logprob):
                    error = f"non-finite logits at generated token {len(seq.tokens)} (the weights hold NaN or inf)"
                elif seq.constrained is not None and not seq.constrained.accept(token):  # feeds its matcher
                    error = f"the grammar refused sampled token {token} at generated token {len(seq.tokens)}"
                if error is not None:
                    break
                seq.tokens.append(token)
                seq.logprobs.append(logprob)
                if seq.top:
                    seq.top_ids.extend(top_ids[row][:seq.top])
                    seq.top_logprobs.extend(top_lps[row][:seq.top])
                stop = token in seq.stop_ids or (seq.stop_text is not None and seq.stop_text.feed(seq.tokens))
                done = stop or len(seq.tokens) >= seq.max_tokens
                # The next row was computed after draft[j]: it counts only if that is the token drawn here.
                if done or j == len(draft) or token != draft[j]:
                    break
            if draft:
                # j: the drafts taken (the rows after the first that gave a token).
                seq.drafted += len(draft)
                seq.accepted += j
                self.drafted_tokens += len(draft)
                self.accepted_tokens += j
                # Judged: the drafts compared with a drawn token (the accepted ones and a rejected one).
                judged = j + (error is None and not done and j < len(draft))
                self.acceptance.record(j, judged)
                assert seq.drafter is not None
                seq.drafter.settle(j, judged, len(seq.tokens), self.acceptance.rate(UNINFORMED))
            if error is not None:
                out = seq.report()
                out.finished = True
                out.error = error
                outputs.append(out)
                finished.append(first_slot + i)
            elif done or seq.stream:
                out = seq.report()
                if done:
                    seq.ok = True
                    out.finished = True
                    out.stop_reason = "stop" if stop else "length"
                    finished.append(first_slot + i)
                outputs.append(out)

    def _free_slots(self, slots: list[int]) -> None:
        """Remove the sequences in ``slots``; the last live slots move into the holes below them
        (one copy for all)."""
        if not slots:
            return
        running = self._running
        # Batch-invariant mode keeps only prefilled KV: decode computes a position differently
        # from a prefill (decoder docstring).
        keep_generated = self.prefix_cache is not None and not self.runner.batch_invariant
        gone = set(slots)
        for slot in sorted(gone):
            seq = running[slot]
            self._active.discard(seq.rid)
            if keep_generated and seq.ok and seq.epoch == self._epoch:
                # Its prompt and all but its last token (never fed back) are in its slot.
                tokens = np.concatenate([seq.ids, np.asarray(seq.tokens, dtype=np.int32)])
                self._cache_slot(slot, tokens[:seq.length])
        live = len(running) - len(gone)
        holes = [slot for slot in sorted(gone) if slot < live]
        movers = [slot for slot in range(live, len(running)) if slot not in gone]
        if movers:
            self.runner.cache.move(movers, holes, max(running[slot].length for slot in movers))
            for src, dst in zip(movers, holes):
                running[dst] = running[src]
        del running[live:]
        if not running:
            self.runner.cache.release()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Install a full set of weights (every parameter, by its HF name) as ``version``."""
        staged: list[tuple[torch.nn.Parameter, Any]] = []
        covered: set[str] = set()
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"torch backend: load_weights got unknown tensor {name!r}")
            if isinstance(tensor, np.ndarray):
                tensor = torch.tensor(tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"torch backend: load_weights {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            staged.append((param, tensor))
            covered.add(self._canonical[id(param)])
        missing = sorted(set(self._canonical.values()) - covered)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"torch backend: load_weights is missing {len(missing)} tensor(s): {shown}")
        # Every cached KV was computed by the old weights, and so is the KV of every request now
        # running: none of it may be reused from here on (``BackendSequence.epoch``).
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        with torch.no_grad():
            for param, tensor in staged:
                param.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = version

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError(f"torch backend: sleep is not supported ({self.capabilities.why_not_sleep})")

    def wake_up(self) -> None:
        """Nothing to restore: the backend never sleeps."""

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
        self._active.clear()
        self.runner.cache.release()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "threads": self.threads, "running": len(self._running), "waiting": len(self._waiting),
                "kv_cache_bytes": self.runner.cache.nbytes, "version": self.version,
                "prefix_cache_bytes": 0 if self.prefix_cache is None else self.prefix_cache.nbytes,
                "prefix_cache_budget": 0 if self.prefix_cache is None else self.prefix_cache.budget,
                "prefix_reused_tokens": self.reused_tokens, "speculative_k": self.speculative_k,
                "speculative_drafted_tokens": self.drafted_tokens,
                "speculative_accepted_tokens": self.accepted_tokens}


def build(config: Any, model_path: str | None) -> TorchBackend:
    """Registry entry point (``rlengine.backends.SPECS``); runs on the compute thread."""
    if model_path is None:
        raise ConfigurationError("backend='torch' needs a model directory (model='tiny' or a local path)")
    args = engine_args(config)
    return TorchBackend(model_path, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                        dtype=torch_dtype(config), device=pick_device(config), prefill_tokens=args["prefill_tokens"],
                        batch_invariant=args["batch_invariant"], prefix_cache_bytes=args["prefix_cache_bytes"],
                        processed=getattr(config, "logprobs_mode", "raw") == "processed",
                        threads_share=threads_share(config), speculative=args["speculative"],
                        speculative_k=args["speculative_k"])
