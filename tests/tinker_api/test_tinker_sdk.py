"""The official ``tinker`` SDK (0.38), unchanged, against a local Tinker API server.

Every result is compared with the in-process API (``engine.training_client()``
on an engine whose trainer is the same LoRA trainer, or the default full
fine-tuning trainer for rank 0) fed the same seeds and data: forward_backward
(cross_entropy and importance_sampling) outputs and metrics, optimizer steps,
sampling with several samples per prompt, prompt logprobs. Then the
server-side semantics no in-process call has: training state saved and loaded
(with and without the optimizer), named sampler weights reopened by path, an
old sampling client still sampling its own weights after training moved on,
the base model, and the ``retrieve_futures`` polling mode.
"""

from __future__ import annotations

import os

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
RANK = 8
LORA_SEED = 3


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, size=n).tolist()


def _ce_data(sdk: bool) -> list:
    out = []
    for i, n in enumerate((12, 20, 7)):
        toks = _tokens(i, n + 1)
        weights = np.linspace(0.5, 1.5, n).astype(np.float32)
        inputs = {"target_tokens": np.array(toks[1:], dtype=np.int64), "weights": weights}
        out.append(_datum(sdk, toks[:-1], inputs))
    return out


def _is_data(sdk: bool) -> list:
    out = []
    for i, n in enumerate((9, 16)):
        toks = _tokens(10 + i, n + 1)
        rng = np.random.default_rng(20 + i)
        inputs = {"target_tokens": np.array(toks[1:], dtype=np.int64),
                  "logprobs": rng.uniform(-7.0, -5.0, n).astype(np.float32),
                  "advantages": rng.normal(0.0, 1.0, n).astype(np.float32)}
        out.append(_datum(sdk, toks[:-1], inputs))
    return out


def _datum(sdk: bool, tokens: list[int], inputs: dict[str, np.ndarray]):
    if sdk:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
    return rle.Datum(model_input=rle.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


PROMPT = _tokens(99, 6)
LP_PROMPT = _tokens(98, 10)


def _outputs(result) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]


def _sdk_run(training_client):
    """The training script, through the SDK; returns every result."""
    fb_ce = training_client.forward_backward(_ce_data(True), "cross_entropy")
    step1 = training_client.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=50.0))
    fb_is = training_client.forward_backward(_is_data(True), "importance_sampling")
    step2 = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
    after = training_client.forward(_ce_data(True), "cross_entropy")
    sampler = training_client.save_weights_and_get_sampling_client().result(WAIT)
    samples = sampler.sample(types.ModelInput.from_ints(PROMPT), 4,
                             types.SamplingParams(max_tokens=12, seed=7, temperature=1.0)).result(WAIT)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(LP_PROMPT)).result(WAIT)
    return (fb_ce.result(WAIT), step1.result(WAIT), fb_is.result(WAIT), step2.result(WAIT), after.result(WAIT),
            samples, logprobs)


def _in_process_run(engine):
    trainer = engine.training_client()
    fb_ce = trainer.forward_backward(_ce_data(False), "cross_entropy")
    step1 = trainer.optim_step(rle.AdamParams(learning_rate=1e-2, grad_clip_norm=50.0))
    fb_is = trainer.forward_backward(_is_data(False), "importance_sampling")
    step2 = trainer.optim_step(rle.AdamParams(learning_rate=1e-2))
    after = trainer.forward(_ce_data(False), "cross_entropy")
    sampler = trainer.save_weights_and_get_sampling_client(timeout=WAIT)
    samples = sampler.sample(rle.ModelInput.from_ints(PROMPT), 4,
                             rle.SamplingParams(max_tokens=12, seed=7, temperature=1.0)).result(WAIT)
    logprobs = sampler.compute_logprobs(rle.ModelInput.from_ints(LP_PROMPT)).result(WAIT)
    return (fb_ce.result(WAIT), step1.result(WAIT), fb_is.result(WAIT), step2.result(WAIT), after.result(WAIT),
            samples, logprobs)


def _assert_same(sdk, local) -> None:
    fb_ce, step1, fb_is, step2, after, samples, logprobs = sdk
    l_ce, l_step1, l_is, l_step2, l_after, l_samples, l_logprobs = local
    for got, want in ((fb_ce, l_ce), (fb_is, l_is), (after, l_after)):
        assert got.metrics == want.metrics
        for g, w in zip(_outputs(got), _outputs(want), strict=True):
            np.testing.assert_array_equal(g, w)
    assert step1.metrics == l_step1.metrics and step2.metrics == l_step2.metrics
    # The sampler-vs-trainer diagnostics ride in the metrics, reduced by their suffixes.
    d = np.concatenate([x.loss_fn_inputs["logprobs"].to_numpy() - o for x, o in zip(_is_data(False), _outputs(fb_is))])
    assert fb_is.metrics["mismatch_k1:sum"] == pytest.approx(float(d.sum()), rel=1e-5)
    assert fb_is.metrics["mismatch_tokens:sum"] == d.size
    assert fb_is.metrics["mismatch_ratio:max"] == pytest.approx(float(np.exp(-d).max()), rel=1e-5)
    assert step1.metrics["grad_norm"] > 0
    # Training moved the model: the same batch's loss went down.
    assert after.metrics["loss:sum"] < fb_ce.metrics["loss:sum"]
    assert len(samples.sequences) == 4
    for got, want in zip(samples.sequences, l_samples.sequences, strict=True):
        assert got.stop_reason == want.stop_reason
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(np.asarray(got.logprobs, dtype=np.float32), want.logprobs_array())
    assert len({tuple(s.tokens) for s in samples.sequences}) > 1, "4 samples at temperature 1 all equal"
    assert logprobs[0] is None and l_logprobs[0] is None
    np.testing.assert_array_equal(np.asarray(logprobs[1:], dtype=np.float32),
                                  np.asarray(l_logprobs[1:], dtype=np.float32))


def test_lora_training_and_sampling_match_the_in_process_api(served, engine_config):
    from rlengine.trainer.lora import LoraSpec, LoraTrainer

    engine, _, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=RANK, seed=LORA_SEED).result(WAIT)
    info = training_client.get_info()
    assert info.is_lora and info.lora_rank == RANK and info.model_data.model_name == "tiny"
    # The tokenizer the SDK asks for loads offline from the model directory.
    tokenizer = training_client.get_tokenizer()
    assert tokenizer.encode("hello world") == engine.tokenizer.encode("hello world")
    sdk = _sdk_run(training_client)

    trainer = LoraTrainer(engine.model_path, LoraSpec(rank=RANK, seed=LORA_SEED))
    with rle.Engine(engine_config("torch"), trainer=trainer) as local:
        _assert_same(sdk, _in_process_run(local))


def test_full_fine_tuning_at_rank_0_matches_the_in_process_api(served, engine_config):
    engine, _, client = served
    training_client = client.create_lora_training_client(base_model=engine.model_path, rank=0).result(WAIT)
    assert not training_client.get_info().is_lora
    sdk = _sdk_run(training_client)
    with rle.Engine(engine_config("torch")) as local:
        _assert_same(sdk, _in_process_run(local))


def test_a_refused_call_does_not_stall_the_next(served):
    """Calls the server refuses (a token id past the vocabulary, a loss it lacks) raise in the SDK, and the
    model's next call runs: the refused calls consumed their seq_ids."""
    engine, _, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result(WAIT)
    vocab = engine.backend.vocab_size
    bad = [_datum(True, [5, vocab], {"target_tokens": np.array([9, 9], dtype=np.int64)})]
    with pytest.raises(tinker.BadRequestError, match=f"token id >= vocab size {vocab}"):
        training_client.forward_backward(bad, "cross_entropy").result(WAIT)
    with pytest.raises(tinker.BadRequestError, match="needs provenance"):
        training_client.forward_backward(_is_data(True), "stable_reinforce").result(WAIT)
    assert training_client.forward_backward(_ce_data(True), "cross_entropy").result(WAIT).metrics["loss:sum"] > 0


def _dro_gspo_reference(loss_fn: str, logp: np.ndarray, inputs: dict[str, np.ndarray], config: dict) -> float:
    """The loss on Tinker's dro / gspo pages, written out in float64 from the returned target logprobs."""
    logp, q, adv = (np.asarray(a, dtype=np.float64) for a in (logp, inputs["logprobs"], inputs["advantages"]))
    if loss_fn == "dro":
        return float(-(logp * adv - 0.5 * config["beta"] * (logp - q) ** 2).sum())
    s = np.exp((logp - q)[inputs["sequence_ratio_mask"] != 0].mean())
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    return float(-np.minimum(s * adv, np.clip(s, lo, hi) * adv).sum())


def test_dro_and_gspo_train_through_the_sdk_with_the_documented_loss(served):
    """``loss:sum`` is the documented formula over the target logprobs the call returns; a bad setting is a
    typed error naming it, and ``stable_reinforce`` needs provenance (test_tinker_stability)."""
    _, _, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=6).result(WAIT)
    data, raw = [], []
    for datum in _is_data(True):
        inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
        # Sampler logprobs the model's own, shifted per token: the gspo ratio lands outside the clip range.
        inputs["sequence_ratio_mask"] = (np.arange(len(inputs["advantages"])) >= 2).astype(np.float32)
        raw.append(inputs)
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    own = training_client.forward([types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": inputs["target_tokens"]}) for d, inputs in zip(data, raw)], "cross_entropy").result(WAIT)
    rng = np.random.default_rng(8)
    for inputs, out in zip(raw, own.loss_fn_outputs, strict=True):
        lp = out["logprobs"].to_numpy()
        inputs["logprobs"] = (lp + rng.normal(0.05, 0.1, lp.shape)).astype(np.float32)
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs=inputs) for d, inputs in zip(data, raw)]
    for loss_fn, config in (("dro", {"beta": 0.3}), ("gspo", {"clip_low_threshold": 0.98,
                                                              "clip_high_threshold": 1.02})):
        batch = data if loss_fn == "gspo" else [types.Datum(model_input=d.model_input, loss_fn_inputs={
            k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}) for d, inputs in zip(data, raw)]
        result = training_client.forward_backward(batch, loss_fn, config).result(WAIT)
        want = sum(_dro_gspo_reference(loss_fn, o["logprobs"].to_numpy(), inputs, config)
                   for o, inputs in zip(result.loss_fn_outputs, raw, strict=True))
        assert result.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
        assert training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT).metrics["grad_norm"] > 0
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_config\['beta'\]"):
        training_client.forward_backward(data[:1], "dro", {"beta": -1.0}).result(WAIT)
    with pytest.raises(tinker.BadRequestError, match="sequence_ratio_mask"):
        training_client.forward_backward(_is_data(True), "gspo", {"clip_low_threshold": 0.8,
                                                                  "clip_high_threshold": 1.2}).result(WAIT)
    with pytest.raises(tinker.BadRequestError, match="invalid_provenance"):
        training_client.forward_backward(data, "stable_reinforce").result(WAIT)


def test_topk_logprobs_through_the_sdk_are_the_models_own(served):
    """``topk_prompt_logprobs`` and ``topk_sample_logprobs``: the k most likely tokens of the HF model's own
    log_softmax at each prompt position and at each sampled position (a teacher-forced forward of prompt +
    sample); a greedy token is the first of its row, with its own logprob; ``prompt_logprobs_last_n`` empties
    the rows before the last n."""
    import torch
    from transformers import AutoModelForCausalLM

    engine, _, client = served
    model = AutoModelForCausalLM.from_pretrained(engine.model_path, local_files_only=True).eval()

    def top(tokens: list[int], start: int, k: int) -> list[list[tuple[int, float]]]:
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0, start:-1].double().log_softmax(-1).topk(k)
        return [list(zip(i, v)) for i, v in zip(ref.indices.tolist(), ref.values.tolist())]

    def same(got, want) -> None:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert [t for t, _ in g] == [t for t, _ in w]
            np.testing.assert_allclose([lp for _, lp in g], [lp for _, lp in w], atol=1e-4)

    sampler = client.create_sampling_client(base_model="tiny").result(WAIT)
    prompt = types.ModelInput.from_ints(LP_PROMPT)
    result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=3, temperature=1.0),
                            include_prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=3).result(WAIT)
    assert result.topk_prompt_logprobs[0] is None
    same(result.topk_prompt_logprobs[1:], top(LP_PROMPT, 0, 5))
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(LP_PROMPT)
    for seq in result.sequences:
        same(seq.topk_logprobs, top(LP_PROMPT + seq.tokens, len(LP_PROMPT) - 1, 3))
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0),
                            topk_sample_logprobs=2).result(WAIT)
    assert greedy.prompt_logprobs is None and greedy.topk_prompt_logprobs is None
    seq = greedy.sequences[0]
    for token, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
        assert row[0][0] == token and abs(row[0][1] - lp) < 1e-5 and row[1][1] <= row[0][1]
    last = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result(WAIT)
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(LP_PROMPT) - 3)
    same(last.topk_prompt_logprobs[-3:], top(LP_PROMPT, len(LP_PROMPT) - 4, 2))
    assert last.sequences[0].topk_logprobs is None
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), topk_sample_logprobs=21).result(WAIT)


def _sample(sampler, seed: int = 11) -> list[list[int]]:
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 3,
                            types.SamplingParams(max_tokens=10, seed=seed)).result(WAIT)
    return [s.tokens for s in result.sequences]


def _step(training_client) -> None:
    training_client.forward_backward(_ce_data(True), "cross_entropy")
    training_client.optim_step(types.AdamParams(learning_rate=5e-2)).result(WAIT)


def test_state_checkpoints_and_sampler_snapshots(served):
    _, _, client = served
    base = client.create_sampling_client(base_model="tiny").result(WAIT)
    base_tokens = _sample(base)
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result(WAIT)
    _step(training_client)
    saved = training_client.save_state("after-one").result(WAIT)
    assert saved.path == f"tinker://{training_client.model_id}/weights/after-one"
    named = training_client.save_weights_for_sampler("snap-one").result(WAIT)
    old = training_client.save_weights_and_get_sampling_client().result(WAIT)
    old_tokens = _sample(old)
    assert old_tokens != base_tokens

    # Resuming with the optimizer continues bit-identically; without it the next step differs.
    resumed = client.create_training_client_from_state_with_optimizer(saved.path).result(WAIT)
    fresh_optimizer = client.create_training_client_from_state(saved.path).result(WAIT)
    probe = types.ModelInput.from_ints(LP_PROMPT)
    results = []
    for tc in (training_client, resumed, fresh_optimizer):
        tc.forward_backward(_is_data(True), "importance_sampling")
        results.append(tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(WAIT).metrics["grad_norm"])
        sampler = tc.save_weights_and_get_sampling_client().result(WAIT)
        results.append(sampler.compute_logprobs(probe).result(WAIT)[1:])
    assert results[0] == results[2] == results[4]  # same gradients: the weights were restored
    assert results[1] == results[3]
    assert results[1] != results[5]

    # Old sampling clients keep sampling their own weights after training moved on.
    assert _sample(old) == old_tokens
    reopened = client.create_sampling_client(model_path=named.path).result(WAIT)
    assert _sample(reopened) == old_tokens
    assert _sample(base) == base_tokens


def test_retrieve_futures_polling_mode(served):
    """With ``sample_use_retrieve_futures`` the SDK learns of finished samples from one long poll."""
    from rlengine.tinker_api import TinkerServerConfig, start

    engine, server, client = served
    expected = _sample(client.create_sampling_client(base_model="tiny").result(WAIT), seed=5)
    polling = start(engine, TinkerServerConfig(checkpoint_dir=server.service.root, sample_use_retrieve_futures=True))
    other = tinker.ServiceClient(base_url=polling.url, api_key=polling.api_key)
    try:
        sampler = other.create_sampling_client(base_model="tiny").result(WAIT)
        futures = [sampler.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=10, seed=5))
                   for _ in range(4)]
        for future in futures:
            assert [s.tokens for s in future.result(WAIT).sequences] == expected
    finally:
        other.close("success").result(WAIT)
        polling.close()


def test_the_sdk_needs_the_key_the_server_drew(served, tmp_path, monkeypatch):
    """Without api_key the server draws one (``tml-...``) into a 0600 file: the SDK samples with it
    and is refused with any other."""
    from rlengine.tinker_api import TinkerServerConfig, start

    engine, server, _ = served
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    keyed = start(engine, TinkerServerConfig(checkpoint_dir=server.service.root))
    key_file = tmp_path / "rlengine" / f"tinker-{keyed.url.rsplit(':', 1)[1]}.key"
    try:
        assert keyed.key_file == str(key_file)
        assert os.stat(key_file.parent).st_mode & 0o777 == 0o700 and os.stat(key_file).st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert key == keyed.api_key and key.startswith("tml-")
        stranger = tinker.ServiceClient(base_url=keyed.url, api_key="tml-guess")
        with pytest.raises(tinker.AuthenticationError):
            stranger.create_sampling_client(base_model="tiny").result(WAIT)
        owner = tinker.ServiceClient(base_url=keyed.url, api_key=key)
        try:
            assert len(_sample(owner.create_sampling_client(base_model="tiny").result(WAIT))) == 3
        finally:
            owner.close("success").result(WAIT)
    finally:
        keyed.close()
    assert not key_file.exists()


def test_concurrent_old_and_new_samplers_each_get_their_own_weights(served):
    """Interleaved samples of two snapshots: each is installed as needed, none samples the other's weights."""
    _, server, client = served
    training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result(WAIT)
    _step(training_client)
    old = training_client.save_weights_and_get_sampling_client().result(WAIT)
    want_old = _sample(old, seed=3)
    _step(training_client)
    new = training_client.save_weights_and_get_sampling_client().result(WAIT)
    want_new = _sample(new, seed=3)
    assert want_old != want_new
    installs = server.service.weights.installs
    pending = [(sampler.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=10, seed=3)),
                want) for sampler, want in [(old, want_old), (new, want_new)] * 4]
    for future, want in pending:
        assert [s.tokens for s in future.result(WAIT).sequences] == want
    # Concurrent requests for the same weights share an install: at most one per request.
    assert installs < server.service.weights.installs <= installs + len(pending)


def test_a_model_alias_serves_code_that_names_a_hub_model(served):
    """``model_aliases`` maps a hub name to the served model: the SDK lists it, trains and samples by it."""
    from rlengine.errors import ConfigurationError
    from rlengine.tinker_api import TinkerServerConfig, start

    engine, server, _ = served
    hub = "Qwen/Qwen3-8B"
    aliased = start(engine, TinkerServerConfig(checkpoint_dir=server.service.root, no_auth=True,
                                               model_aliases={hub: "tiny"}))
    client = tinker.ServiceClient(base_url=aliased.url, api_key="tml-alias")
    try:
        capabilities = tinker.RestClient(base_url=aliased.url, api_key="tml-alias").get_server_capabilities()
        names = [m.model_name for m in capabilities.result(WAIT).supported_models]
        assert hub in names and "tiny" in names
        training_client = client.create_lora_training_client(base_model=hub, rank=4, seed=1).result(WAIT)
        assert training_client.get_info().model_data.model_name == hub
        _step(training_client)
        assert len(_sample(client.create_sampling_client(base_model=hub).result(WAIT))) == 3
        with pytest.raises(tinker.NotFoundError, match="Qwen/Qwen3-4B"):
            client.create_lora_training_client(base_model="Qwen/Qwen3-4B", rank=4).result(WAIT)
    finally:
        client.close("success").result(WAIT)
        aliased.close()
    with pytest.raises(ConfigurationError, match=r"model_aliases\['Qwen/Qwen3-8B'\]='Qwen/Qwen3-8B-local'"):
        start(engine, TinkerServerConfig(checkpoint_dir=server.service.root, no_auth=True,
                                         model_aliases={hub: "Qwen/Qwen3-8B-local"}))


# A recipe as the cookbook's are written: it trains, then exits without ServiceClient.close().
_PROGRAM = """
import sys
import numpy as np
import tinker
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training_client = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result(120)
tokens = [5, 9, 14, 20, 33]
datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})
training_client.forward_backward([datum], "cross_entropy").result(120)
training_client.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(120)
print(training_client.model_id)
"""


def test_back_to_back_programs_that_never_close_their_session_all_run(served, tmp_path):
    """Five SDK programs in a row, none finishing its session, on a server with two model slots: each
    new model takes the slot of a model whose session went silent, instead of being refused."""
    import subprocess
    import sys

    import httpx

    from rlengine.tinker_api import TinkerServerConfig, start

    engine, server, _ = served
    slots = start(engine, TinkerServerConfig(checkpoint_dir=server.service.root, no_auth=True, max_models=2,
                                             evict_after_s=1.0, sweep_interval_s=0.1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    try:
        model_ids = []
        for run in range(5):
            proc = subprocess.run([sys.executable, "-c", _PROGRAM, slots.url, "tml-recipe"], capture_output=True,
                                  text=True, env=env, timeout=300, check=False)
            assert proc.returncode == 0, f"program {run + 1}: {proc.stderr[-3000:]}"
            model_ids.append(proc.stdout.split()[-1])
        registry = slots.service.registry
        assert set(registry.models) == set(model_ids[-2:]) and registry.waiting == 0
        gone = httpx.post(f"{slots.url}/api/v1/get_info", json={"model_id": model_ids[0]},
                          headers={"X-API-Key": "tml-recipe"}, timeout=30)
        assert gone.status_code == 410 and "evicted" in gone.json()["error"]["message"]
    finally:
        slots.close()
