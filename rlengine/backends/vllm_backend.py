"""The vLLM backend: vLLM's ``LLMEngine`` in-process, stepped on the compute thread.

A thin adapter, because the backend protocol is shaped after ``LLMEngine``:
token ids in (``TokensPrompt``), token ids out, one vLLM request per
sequence (the engine fans ``num_samples`` out with a seed each), the logprob
of every sampled token (``EngineConfig.logprobs_mode``: vLLM's ``raw_logprobs``,
log-softmax of the unscaled logits, which is what a trainer forward pass
computes, or ``processed_logprobs``, after temperature, top-k and top-p; one
mode per engine, so a request for the other is refused), prompt logprobs
and the top k at each prompt position (vLLM's ``prompt_logprobs=k``), stop
strings and ids, abort. Non-streaming requests use
``FINAL_ONLY`` so the engine does no per-token work for them. A
``constraint`` (an xgrammar structural tag) goes to vLLM's own structured
outputs, which mask the logits before sampling, so its logprobs are of the
masked distribution, as in the torch backend.

Weights are installed in-process: ``collective_rpc("reload_weights",
kwargs={"weights_iterator": ...})`` then ``reset_prefix_cache()`` (cached
prefixes were computed by the old weights). Sleep mode needs CUDA; on CPU
``capabilities.sleep`` is False with the reason, never a silent no-op.

vLLM's ``AsyncLLM`` always spawns processes; we drive ``LLMEngine.step()``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so everything stays in this process.
This module must not touch engine state; it imports vLLM only when built.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from rlengine.backends.base import BackendRequest, Capabilities, RequestOutput
from rlengine.backends.grammar import json_layout
from rlengine.errors import ConfigurationError, InvalidRequest
from rlengine.types import MAX_TOP_LOGPROBS

__all__ = ["VLLMBackend", "build"]

# CPU defaults measured on a 2-vCPU machine: eager mode (no compile), no
# dynamo (a 2-14 s compile on the first logprobs request otherwise), and an
# explicit KV cache size (vLLM's default reserves a fraction of all memory).
_CPU_KV_CACHE_BYTES = 512 << 20

_live: set[int] = set()
_live_lock = threading.Lock()


def _set_process_defaults(on_cuda: bool) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ConfigurationError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: rlengine drives vLLM's engine in this process")
    if not on_cuda:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """Silence deprecation warnings that vLLM's own code raises while importing
    and building (torch API renames it has not caught up with): they are not
    the user's to fix, and under ``-W error`` they would stop the engine."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
        yield


class VLLMBackend:
    """Backend protocol over an in-process ``vllm.LLMEngine``."""

    name = "vllm"

    def __init__(self, engine: Any, on_cuda: bool, logprobs_mode: str = "raw") -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._engine = engine
        self._params_cls = VSamplingParams
        self._structured_cls = StructuredOutputsParams
        self._refusals = (ValueError, VLLMValidationError)
        self._prompt_cls = TokensPrompt
        self._delta, self._final = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
        sleep_ok = on_cuda and bool(engine.vllm_config.model_config.enable_sleep_mode)
        why = "" if sleep_ok else (
            "vLLM sleep mode needs CUDA; unsupported on CPU" if not on_cuda
            else "vLLM was built without enable_sleep_mode=True")
        self.capabilities = Capabilities(sleep=sleep_ok, prompt_logprobs=True, stop_strings=True,
                                         constraints=True, top_logprobs=MAX_TOP_LOGPROBS,
                                         prompt_top_logprobs=MAX_TOP_LOGPROBS,
                                         why_not_sleep=why, logprobs_modes=(logprobs_mode,))
        self._top: dict[str, int] = {}
        """Request id -> how many alternatives per token it asked for (only those that did)."""
        self._prompt_top: dict[str, tuple[int, bool]] = {}
        """Request id -> how many alternatives per prompt position it asked for, and whether it asked
        for the prompt tokens' own logprobs too (only those that asked for alternatives)."""
        model_config = engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self._asleep = False
        self.last_sleep_s: float | None = None
        self.last_wake_s: float | None = None
        with _live_lock:
            _live.add(id(self))

    @property
    def llm_engine(self) -> Any:
        """The ``vllm.LLMEngine`` this backend steps (compute thread only), for measurements
        that drive it directly beside the backend."""
        return self._engine

    def add_request(self, request: BackendRequest) -> None:
        p = request.params
        stop_strings = list(p.stop_strings)
        params = self._params_cls(
            n=1,
            max_tokens=request.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=0 if p.top_k == -1 else p.top_k,
            seed=request.seed,
            stop=stop_strings or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos,
            logprobs=p.top_logprobs,
            # vLLM's prompt_logprobs=k: each position's top k and the prompt token itself.
            prompt_logprobs=request.prompt_top_logprobs if request.prompt_top_logprobs
            else 0 if request.prompt_logprobs else None,
            detokenize=bool(stop_strings),
            output_kind=self._delta if request.stream else self._final,
            # Compact JSON, numbers bounded (``grammar.json_layout``): vLLM applies its own
            # whitespace option to JSON schemas only, not inside a structural tag.
            structured_outputs=(None if p.constraint is None
                                else self._structured_cls(structural_tag=json_layout(p.constraint))),
        )
        prompt = self._prompt_cls(prompt_token_ids=memoryview(request.prompt).cast("i").tolist())
        if p.top_logprobs:
            self._top[request.request_id] = p.top_logprobs
        if request.prompt_top_logprobs:
            self._prompt_top[request.request_id] = (request.prompt_top_logprobs, request.prompt_logprobs)
        if p.constraint is None:
            self._engine.add_request(request.request_id, prompt, params)
            return
        try:
            self._engine.add_request(request.request_id, prompt, params)
        except self._refusals as exc:  # vLLM validates (compiles) the structural tag here
            self._top.pop(request.request_id, None)
            self._prompt_top.pop(request.request_id, None)
            causes, cause = [str(exc)], exc.__cause__ or exc.__context__
            while cause is not None and len(causes) < 4:
                causes.append(str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__)
                cause = cause.__cause__ or cause.__context__
            raise InvalidRequest("sampling_params.constraint", p.constraint[:60],
                                 f"vLLM's structured outputs refuse it: {'; '.join(causes)[:400]}") from None

    def abort_request(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for rid in ids:
            self._top.pop(rid, None)
            self._prompt_top.pop(rid, None)
        if ids:
            self._engine.abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outs = []
        for ro in self._engine.step():
            completion = ro.outputs[0]
            tokens = list(completion.token_ids)
            # One {token_id: Logprob} dict per sampled token; the sampled one is always in it.
            logprobs = [lp[t].logprob for t, lp in zip(tokens, completion.logprobs or ())]
            out = RequestOutput(ro.request_id, tokens, logprobs)
            k = self._top.get(ro.request_id)
            if k:  # the dict also holds the top k, ranked 1..k (the sampled token may be among them or not)
                ranked = [sorted((v.rank, t, v.logprob) for t, v in lp.items() if v.rank <= k)[:k]
                          for lp in completion.logprobs or ()]
                out.top_ids = [t for row in ranked for _, t, _ in row]
                out.top_logprobs = [v for row in ranked for _, _, v in row]
            if ro.prompt_logprobs is not None and ro.prompt_token_ids is not None:
                prompt_k, want_own = self._prompt_top.get(ro.request_id, (0, True))
                if want_own:
                    out.prompt_logprobs = [lp[t].logprob for t, lp in
                                           zip(ro.prompt_token_ids[1:], ro.prompt_logprobs[1:])]
                if prompt_k:
                    ranked = [sorted((v.rank, t, v.logprob) for t, v in lp.items() if v.rank <= prompt_k)[:prompt_k]
                              for lp in ro.prompt_logprobs[1:]]
                    out.prompt_top_ids = [t for row in ranked for _, t, _ in row]
                    out.prompt_top_logprobs = [v for row in ranked for _, _, v in row]
            if ro.finished:
                self._top.pop(ro.request_id, None)
                self._prompt_top.pop(ro.request_id, None)
                out.finished = True
                reason = completion.finish_reason
                if reason not in ("length", "stop"):
                    out.error = f"vLLM finished the request with finish_reason={reason!r}"
                out.stop_reason = "length" if reason == "length" else "stop"
            outs.append(out)
        return outs

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        if self._asleep:
            self._engine.wake_up(tags=["weights"])
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named_tensors))})
        # Cached prefixes hold KV computed by the old weights.
        self._engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        if not self.capabilities.sleep:
            raise RuntimeError(f"vLLM backend cannot sleep here: {self.capabilities.why_not_sleep}")
        if not self._asleep or level >= 2:
            t0 = time.perf_counter()
            self._engine.sleep(level=level)
            self.last_sleep_s = time.perf_counter() - t0
        self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            t0 = time.perf_counter()
            self._engine.wake_up()
            self.last_wake_s = time.perf_counter() - t0
            self._asleep = False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sleep": self.capabilities.sleep, "why_not_sleep": self.capabilities.why_not_sleep,
                "last_sleep_s": self.last_sleep_s, "last_wake_s": self.last_wake_s,
                "vocab_size": self.vocab_size, "max_model_len": self.max_model_len}

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        with _live_lock:
            _live.discard(id(self))
            last = not _live
        # vLLM keeps process-wide state (its distributed groups) that shutting
        # one engine down destroys for every engine in the process, and its
        # in-process client shuts down when garbage-collected: only the last
        # live in-process vLLM backend may shut down; the others detach that
        # finalizer and are freed as ordinary objects.
        if last:
            engine.engine_core.shutdown()
        else:
            finalizer = getattr(engine.engine_core, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()


def build(config: Any, model_path: str | None) -> VLLMBackend:
    """Registry entry point: an in-process ``LLMEngine`` over ``model_path``."""
    import torch

    from rlengine.backends.torch.runtime import configure_threads, threads_share

    # On the compute thread, before vLLM's CPU worker takes over torch's thread
    # setting: its model then runs with the thread count rlengine decided.
    configure_threads(threads_share(config))
    on_cuda = torch.cuda.is_available()
    _set_process_defaults(on_cuda)
    with _quiet_vllm():
        from vllm import EngineArgs, LLMEngine

    args: dict[str, Any] = {
        "model": model_path,
        "dtype": config.dtype,
        "seed": config.seed,
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": not on_cuda,
        "served_model_name": config.model_name or model_path,
    }
    if config.max_model_len is not None:
        args["max_model_len"] = config.max_model_len
    if on_cuda:
        args["enable_sleep_mode"] = True
    else:
        args["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
    if "logprobs_mode" in config.engine_args:
        raise ConfigurationError(f"engine_args['logprobs_mode']={config.engine_args['logprobs_mode']!r}: set "
                                 "EngineConfig.logprobs_mode ('raw' or 'processed') instead")
    # vLLM records one logprob mode per engine (``processed_logprobs``: after temperature,
    # top-k and top-p, as the torch backend's ``processed``).
    args["logprobs_mode"] = f"{getattr(config, 'logprobs_mode', 'raw')}_logprobs"
    # vLLM hands its weight-loading bar an explicit ``disable``, so tqdm's own TQDM_DISABLE (which
    # the rlengine commands set unless -v) never reaches it: honour it here.
    args["use_tqdm_on_load"] = not os.environ.get("TQDM_DISABLE")
    args.update(config.engine_args)
    try:
        with _quiet_vllm():
            engine = LLMEngine.from_engine_args(EngineArgs(**args))
    except TypeError as exc:
        raise ConfigurationError(f"engine_args={dict(config.engine_args)!r}: not accepted by vLLM ({exc})") from exc
    return VLLMBackend(engine, on_cuda, getattr(config, "logprobs_mode", "raw"))
