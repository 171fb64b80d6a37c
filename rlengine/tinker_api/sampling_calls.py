"""The calls of Tinker sampling sessions: create, join and describe one, and ``asample``.

A sampling session names the weights its samples come from: the base
model, or a checkpoint's sampler weights (``model_path``: a snapshot read
from disk when first installed). Sessions on a training model's snapshot
are opened by ``save_weights_for_sampler`` (``training_calls``).

``asample`` checks a request against what rlengine supports and what the
engine accepts, registers its future with a renderer that honours
``prompt_logprobs_last_n``, and hands it to a ``SampleCall`` (``sampling``),
which pins it to its session's weights; its completion goes into the
session's log for ``retrieve_futures``, and its sequences into the
server's ``SequenceRecords`` (``stability``), with the behaviour logprobs
and policy versions ``stable_reinforce`` needs when the request sets
``record_stability_info``. ``topk_sample_logprobs`` and
``topk_prompt_logprobs`` are served up to what the backend reports
(``Capabilities.top_logprobs`` and ``prompt_top_logprobs``: 20 for torch
and vLLM) and answer ``not_supported`` on a backend that reports none (the
sim); ``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` likewise where
the backend has ``Capabilities.prompt_scores`` (torch; ``prompt_scoring``
checks them). A repeated ``seq_id`` (a retry whose first answer was lost) gets the
first request's id back.

Loop thread only; nothing here waits for a sample.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlengine.errors import InvalidRequest
from rlengine.tinker_api import checkpoints as ckpt
from rlengine.tinker_api import wire
from rlengine.tinker_api.errors import Gone, NotSupported
from rlengine.tinker_api.futures import FuturesTable
from rlengine.tinker_api.prompt_scoring import prompt_scoring
from rlengine.tinker_api.registry import Registry
from rlengine.tinker_api.results import sample_renderer
from rlengine.tinker_api.sampling import BASE, SampleCall, Snapshot
from rlengine.tinker_api.stability import SequenceRecords

__all__ = ["SamplingCalls"]


class SamplingCalls:
    """The calls of sampling sessions, over the registry's engine and sampler weights. Loop thread only."""

    def __init__(self, registry: Registry, futures: FuturesTable, records: SequenceRecords) -> None:
        self.registry = registry
        self.futures = futures
        self.records = records
        self.engine = registry.engine
        self.weights = registry.weights

    def create_sampling_session(self, owner: str, body: wire.CreateSamplingSessionRequest) -> dict[str, Any]:
        session = self.registry.session(owner, body.session_id)
        earlier = session.samplers.get(body.sampling_session_seq_id)
        if earlier is not None:
            return {"type": "create_sampling_session", "sampling_session_id": earlier}
        if body.model_path is not None:
            path, directory, meta = self.registry.checkpoint(owner, "model_path", body.model_path)
            key = path.uri
            try:
                self.weights.get(key)
            except Gone:
                self.weights.add(Snapshot(key, None, 0, lambda: ckpt.read_sampler_weights(directory), path=key))
            base_model = meta["base_model"]
        elif body.base_model is not None:
            self.registry.check_base_model("base_model", body.base_model)
            key, base_model = BASE, body.base_model
        else:
            raise InvalidRequest("model_path", None, "give model_path or base_model")
        ss = self.registry.new_sampler(session, body.sampling_session_seq_id, base_model, key=key,
                                       model_path=body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": ss.sampling_session_id}

    def join_sampling_session(self, owner: str, body: wire.JoinSamplingSessionRequest) -> dict[str, Any]:
        ss = self.registry.sampler(owner, body.sampling_session_id)
        ss.clients += 1
        return {"type": "join_sampling_session", "client_counter": ss.clients}

    def get_sampler(self, owner: str, sampling_session_id: str) -> dict[str, Any]:
        ss = self.registry.sampler(owner, sampling_session_id)
        return {"sampler_id": ss.sampling_session_id, "base_model": ss.base_model, "model_path": ss.model_path}

    def asample(self, owner: str, body: wire.SampleRequest) -> dict[str, Any]:
        if body.sampling_session_id is None:
            raise NotSupported("sampling_session_id", None, "sampling without a sampling session is not supported "
                               "by rlengine (create_sampling_session first)")
        ss = self.registry.sampler(owner, body.sampling_session_id)
        caps = self.engine.backend.capabilities
        sample_k = self._top_k("topk_sample_logprobs", body.topk_sample_logprobs, caps.top_logprobs,
                               "sampled token")
        prompt_k = self._top_k("topk_prompt_logprobs", body.topk_prompt_logprobs, caps.prompt_top_logprobs,
                               "prompt token")
        n = body.num_samples
        prompt = wire.model_input(body.prompt, "prompt")
        want_lps = bool(body.prompt_logprobs)
        spec = self.engine.validate_sample(prompt, n, wire.sampling_params(body.sampling_params, sample_k),
                                           include_prompt_logprobs=want_lps, prompt_top_logprobs=prompt_k)
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and (not want_lps or last_n > prompt.length - 1):
            raise InvalidRequest("prompt_logprobs_last_n", last_n, f"needs prompt_logprobs and must be in "
                                 f"[1, {prompt.length - 1}]")
        targets, layout = (None, None) if body.target_prompt_logprobs is None else wire.prompt_targets(
            body.target_prompt_logprobs, "target_prompt_logprobs")
        scoring = prompt_scoring(targets, body.prompt_alt_tokens_k, prompt.length, self.engine.backend)
        if scoring is not None:
            spec = msgspec.structs.replace(spec, prompt_scoring=scoring)
        if body.seq_id is not None and body.seq_id in ss.seen:
            rid = ss.seen[body.seq_id]
            return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}
        entry = self.futures.add("sample", owner, sample_renderer(last_n, layout))
        call = SampleCall(self.weights, ss, spec, entry.future)
        entry.cancel = call.cancel
        if body.seq_id is not None:
            ss.remember(body.seq_id, entry.request_id)
        log = ss.log((body.seq_id or 0) // 1_000_000_000)
        rid = entry.request_id
        records, stable = self.records, bool(body.record_stability_info)
        weights_key = ss.key if ss.key is not None else ss.inflight_model
        # Recorded before the log says finished: a client that learns of it may train on its sequence ids.
        entry.future.add_done_callback(lambda f: f.exception(0) is not None or records.record(
            owner, ss.session_id, rid, spec.prompt, f.result(0), stable, weights_key))
        entry.future.add_done_callback(lambda f: log.record(rid, "failed" if f.exception(0) else "finished"))
        call.run()
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}

    def _top_k(self, field: str, k: int, most: int, what: str) -> int:
        """A top-k width of the request (>= 0, as ``SampleRequest`` declares): at most ``most`` (what the
        backend reports; 0: not supported)."""
        if k and not most:
            raise NotSupported(field, k, f"the {self.engine.backend.name} backend reports no top-k logprobs "
                               f"of a {what}")
        if k > most:
            raise InvalidRequest(field, k, f"must be at most {most} (the most the {self.engine.backend.name} "
                                 "backend reports)")
        return k
