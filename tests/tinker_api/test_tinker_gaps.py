"""The gaps tinker-cookbook 0.6.1 found in the local Tinker server, through the official ``tinker`` SDK (0.38).

Each was first reproduced with the SDK unchanged, then closed: a refused
``save_weights_external`` (an endpoint not served, 404) no longer burns the
model's next ``seq_id`` (the next call used to wait ``hold_timeout_s``, 300
s); ``prompt_cache_hit_tokens`` reports the prefix the backend reused;
``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` are served;
``copy_weights``, ``weights_info``, ``get_session`` and ``list_sessions``
are served with the registry's owner rules; ``dro`` and ``gspo`` run with
no ``loss_fn_config`` at the papers' defaults.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tinker_sdk import SDK_WARNINGS

import rlengine as rle

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = [
    pytest.mark.slow,
    *SDK_WARNINGS,
]

WAIT = 120.0
KEY_A, KEY_B = "tml-key-a", "tml-key-b"
NEXT_CALL_S = 20.0
"""Bound on a call that must not wait for a refused one (typically ~1 s; the stall was hold_timeout_s, 300 s)."""


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, size=n).tolist()


def _ce_datum(seed: int, n: int = 12):
    toks = _tokens(seed, n + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(toks[1:], dtype=np.int64)})


@pytest.fixture(scope="module")
def served(engine_config, tmp_path_factory):
    """An engine with a Tinker server on its loop, and an SDK client of it."""
    from rlengine.tinker_api import TinkerServerConfig, start

    with rle.Engine(engine_config("torch")) as engine:
        # no_auth: each key is its caller's identity, so another key's resources can be tried.
        server = start(engine, TinkerServerConfig(checkpoint_dir=str(tmp_path_factory.mktemp("tinker-ckpt")),
                                                  max_models=8, no_auth=True))
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            yield engine, server, client
        finally:
            client.close("success").result(WAIT)
            server.close()


def test_a_refused_save_weights_external_does_not_stall_the_next_call(served):
    """``save_weights_external`` is not served (404): the SDK's call fails, and the model's next call runs
    at once, because the refusal consumed its ``seq_id`` whatever its status."""
    _, _, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result(WAIT)
    with pytest.raises(tinker.NotFoundError, match="save_weights_external"):
        training_client.save_weights_external("export").result(WAIT)
    start = time.monotonic()
    out = training_client.forward_backward([_ce_datum(1)], "cross_entropy").result(NEXT_CALL_S)
    assert out.metrics["loss:sum"] > 0
    assert time.monotonic() - start < NEXT_CALL_S


def test_prompt_cache_hit_tokens_report_the_prefix_the_backend_reused(served):
    """A prompt sampled twice: the second call's prefill reuses the first's KV from the torch backend's prefix
    cache, every prompt token but the last (which must run for its logits); the response says exactly how many,
    as the backend counted them, once for the prompt whatever ``num_samples``."""
    engine, _, client = served
    backend = engine.backend
    sampler = client.create_sampling_client(base_model="tiny").result(WAIT)
    prompt = _tokens(77, 200)
    params = types.SamplingParams(max_tokens=4, seed=5)
    reused = backend.reused_tokens
    first = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(WAIT)
    assert first.prompt_cache_hit_tokens == backend.reused_tokens - reused == 0  # a prompt never seen
    cached = backend.prefix_cache.match(np.asarray(prompt, dtype=np.int32), len(prompt) - 1)[0]
    assert cached == len(prompt) - 1
    reused = backend.reused_tokens
    second = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(WAIT)
    assert second.prompt_cache_hit_tokens == backend.reused_tokens - reused == cached
    group = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result(WAIT)
    assert group.prompt_cache_hit_tokens == cached


def _reference(loss_fn: str, logp: np.ndarray, q: np.ndarray, adv: np.ndarray, mask: np.ndarray) -> float:
    """dro and gspo at rlengine's defaults, written out by hand in float64: dro's beta 0.05 (the value of
    Tinker's dro page), gspo's clip range 1 - 3e-4 .. 1 + 4e-4 (the GSPO paper's)."""
    logp, q, adv = (np.asarray(a, dtype=np.float64) for a in (logp, q, adv))
    if loss_fn == "dro":
        return float(-(logp * adv - 0.5 * 0.05 * (logp - q) ** 2).sum())
    s = np.exp((logp - q)[mask != 0].mean())
    return float(-np.minimum(s * adv, np.clip(s, 1.0 - 3e-4, 1.0 + 4e-4) * adv).sum())


def test_dro_and_gspo_run_without_loss_fn_config_at_the_papers_defaults(served):
    """No ``loss_fn_config``: ``loss:sum`` is the hand-written reference at the defaults, with sequence ratios
    below, inside and above GSPO's narrow clip range (so the range itself decides the value)."""
    _, _, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=6).result(WAIT)
    rng = np.random.default_rng(3)
    inputs, prompts = [], []
    for i, n in enumerate((9, 14, 11)):
        toks = _tokens(40 + i, n + 1)
        prompts.append(types.ModelInput.from_ints(toks[:-1]))
        inputs.append({"target_tokens": np.array(toks[1:], dtype=np.int64),
                       "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
                       "sequence_ratio_mask": (np.arange(n) >= 2).astype(np.float32)})
    own = training_client.forward([types.Datum(model_input=p, loss_fn_inputs={"target_tokens": x["target_tokens"]})
                                   for p, x in zip(prompts, inputs)], "cross_entropy").result(WAIT)
    # The sampler's logprobs: the model's own shifted by +1e-3, 0 and -1e-3 per datum, so the sequence
    # ratios exp(-shift) fall below, inside and above [1 - 3e-4, 1 + 4e-4].
    for x, out, shift in zip(inputs, own.loss_fn_outputs, (1e-3, 0.0, -1e-3), strict=True):
        x["logprobs"] = (out["logprobs"].to_numpy() + shift).astype(np.float32)
    for loss_fn in ("dro", "gspo"):
        keys = ("target_tokens", "logprobs", "advantages") + (("sequence_ratio_mask",) if loss_fn == "gspo" else ())
        data = [types.Datum(model_input=p, loss_fn_inputs={k: x[k] for k in keys}) for p, x in zip(prompts, inputs)]
        result = training_client.forward_backward(data, loss_fn).result(WAIT)
        want = sum(_reference(loss_fn, o["logprobs"].to_numpy(), x["logprobs"], x["advantages"],
                              x["sequence_ratio_mask"]) for o, x in zip(result.loss_fn_outputs, inputs, strict=True))
        assert result.metrics["loss:sum"] == pytest.approx(want, rel=1e-6, abs=1e-7), loss_fn


def test_weights_info_copy_weights_and_sessions_as_the_sdk_calls_them(served, monkeypatch):
    """``get_weights_info_by_tinker_path`` describes a checkpoint; ``copy_weights`` publishes it under a new
    training run sharing its files, loadable like the original; ``get_session`` names the session's runs and
    samplers, ``list_sessions`` the caller's sessions; another key gets ``Forbidden`` for each."""
    import os

    _, server, client = served
    monkeypatch.delenv("TINKER_PROJECT_ID", raising=False)
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=2,
                                                         train_unembed=False).result(WAIT)
    training_client.forward_backward([_ce_datum(2)], "cross_entropy")
    training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT)
    state = training_client.save_state("kept").result(WAIT).path
    sampler = training_client.save_weights_and_get_sampling_client().result(WAIT)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    info = rest.get_weights_info_by_tinker_path(state).result(WAIT)
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
    assert (info.train_unembed, info.train_mlp, info.train_attn) == (False, True, True)

    copy = rest.copy_weights(state, "proj-archive").result(WAIT)
    assert copy != state and copy.endswith("/weights/kept") and copy.startswith("tinker://copy-")
    assert rest.get_weights_info_by_tinker_path(copy).result(WAIT) == info
    root = server.service.root
    original, copied = (os.path.join(root, p[len("tinker://"):]) for p in (state, copy))
    shared = [f for f in os.listdir(original) if f != "tinker.json"]
    assert shared and all(os.stat(os.path.join(original, f)).st_ino == os.stat(os.path.join(copied, f)).st_ino
                          for f in shared)
    reloaded = client.create_training_client_from_state(copy).result(WAIT)
    probe = [_ce_datum(3)]
    assert reloaded.forward(probe, "cross_entropy").result(WAIT).metrics["loss:sum"] == pytest.approx(
        training_client.forward(probe, "cross_entropy").result(WAIT).metrics["loss:sum"], rel=1e-6)
    with pytest.raises(ValueError, match="destination_project_id"):
        rest.copy_weights(state)  # the SDK itself needs a project (or TINKER_PROJECT_ID)

    session_id = client.holder.get_session_id()
    got = rest.get_session(session_id).result(WAIT)
    assert training_client.model_id in got.training_run_ids and reloaded.model_id in got.training_run_ids
    assert sampler._sampling_session_id in got.sampler_ids
    assert session_id in rest.list_sessions().result(WAIT).sessions

    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    try:
        other_rest = tinker.RestClient(base_url=server.url, api_key=KEY_B)
        assert session_id not in other_rest.list_sessions().result(WAIT).sessions
        for call in (lambda: other_rest.get_session(session_id), lambda: other_rest.copy_weights(state, "p"),
                     lambda: other_rest.get_weights_info_by_tinker_path(state)):
            with pytest.raises(tinker.PermissionDeniedError):
                call().result(WAIT)
    finally:
        other.close("success").result(WAIT)
