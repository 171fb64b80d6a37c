"""``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` through the official ``tinker`` SDK (0.38), unchanged.

Issue 33: the local server refused both (``400 not_supported``), so tinker-cookbook 0.6.1's
``decisions`` recipe could not run. Now the torch backend serves them from the prefill's own
logits: target logprobs equal the HF model's ``log_softmax`` at the named ids (dense and sparse
CSR requests, the layout kept in the result), and a target that is the prompt's own token has
bitwise its prompt logprob; draws are the model's, at the request's temperature, reproducible
from the seed, with the model's logprobs. The SDK reads results as protobuf; the JSON path gives
the same numbers. The recipe's own ``sample_decision`` (0.6.1, in a subprocess) returns the softmax
of the HF logprobs of its labels. Bad input is a typed 400 naming the field and value; a backend
that cannot score prompt positions (the sim; vLLM likewise) answers ``not_supported`` naming
option and backend, at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from tinker_sdk import SDK_WARNINGS

import rlengine as rle
from rlengine.tinker_api import TinkerServerConfig, start

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
types = tinker.types

pytestmark = [
    pytest.mark.model_plane,
    *SDK_WARNINGS,
]

WAIT = 120.0
KEY = "tml-key-targets"
TOL = 1e-5
"""Against HF transformers' float32 forward (the differences seen are ~1e-6)."""
PROMPT = np.random.default_rng(7).integers(3, 1000, size=24).tolist()
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decisions061_driver.py")
REFUSED_WITHIN_S = 30.0
"""Bound on a refused call's answer (typically a few ms: it is refused before anything is queued)."""


@pytest.fixture(scope="module")
def served(engine, ckpt_dir):
    """The module's torch engine with a Tinker server on its loop, and an SDK sampling client of the base model."""
    server = start(engine, TinkerServerConfig(checkpoint_dir=ckpt_dir, no_auth=True))
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        yield engine, server, client.create_sampling_client(base_model="tiny").result(WAIT)
    finally:
        client.close("success").result(WAIT)
        server.close()


@pytest.fixture(scope="module")
def reference(engine):
    """``reference(tokens)``: the HF model's log_softmax [len - 1, vocab] (float64) and its raw logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.model_path, local_files_only=True).eval()

    def run(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].double()
        return logits.log_softmax(-1).numpy(), logits.numpy()

    return run


# -- raw HTTP, the JSON path --------------------------------------------------------------


def _call(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", content=msgspec.json.encode(body), timeout=WAIT,
                      headers={"X-API-Key": KEY, "Content-Type": "application/json"})


def _sampling_session(url: str, model: str = "tiny") -> str:
    sid = _call(url, "create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    r = _call(url, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0, "base_model": model})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _sample_body(ssid: str, seq: int, prompt: list[int], **extra) -> dict:
    return {"sampling_session_id": ssid, "seq_id": seq, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": 1, "seed": 1, **extra.pop("params", {})}, **extra}


def _json_result(url: str, body: dict) -> dict:
    r = _call(url, "asample", body)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        out = _call(url, "retrieve_future", {"request_id": r.json()["request_id"]}).json()
        if out.get("type") != "try_again":
            return out
    raise AssertionError("the sample did not settle")


def _refused(response: httpx.Response, code: str, field: str, value: object) -> dict:
    """The 400 body of a refused call, checked to name ``field`` and ``value`` (a list as its repr)."""
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert (body["code"], body["field"], body["value"]) == (code, field, value if isinstance(value, (int, str))
                                                             else repr(value)), body
    return body


def _tensor_json(ids: np.ndarray) -> dict:
    return {"data": ids.ravel().tolist(), "dtype": "int64", "shape": list(ids.shape)}


# -- what is served -----------------------------------------------------------------------------


def _targets() -> np.ndarray:
    """[23, 4]: the prompt's own tokens, random ids, a few ids among -1 cells, the vocabulary's last id."""
    rng = np.random.default_rng(3)
    ids = np.full((len(PROMPT) - 1, 4), -1, dtype=np.int64)
    ids[:, 0] = PROMPT[1:]
    ids[:, 1] = rng.integers(0, 1024, size=len(PROMPT) - 1)
    ids[[2, 9, 22], 2] = [11, 500, 3]
    ids[::5, 3] = 1023
    return ids


def test_target_prompt_logprobs_are_the_models_own_dense_and_sparse(served, reference):
    """Every named cell is the HF model's logprob of that id at that position; -1 cells are 0.0; the
    prompt's own tokens get bitwise their prompt logprobs; a sparse request gets its CSR layout back."""
    import torch

    engine, _, sampler = served
    assert engine.backend.vocab_size == 1024
    ids = _targets()
    lps, _ = reference(PROMPT)
    prompt = types.ModelInput.from_ints(PROMPT)
    dense = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                           target_prompt_logprobs=types.TensorData.from_numpy(ids)).result(WAIT)
    got = dense.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [len(PROMPT) - 1, 4] and got.sparse_crow_indices is None
    got = got.to_numpy()
    named = ids >= 0
    rows, cols = np.nonzero(named)
    np.testing.assert_allclose(got[rows, cols], lps[rows, ids[rows, cols]], rtol=0, atol=TOL)
    assert np.all(got[~named] == 0.0)
    # The same logits and the same arithmetic as the prompt logprobs: the same bits.
    assert np.array_equal(got[:, 0], np.asarray(dense.prompt_logprobs[1:], dtype=np.float32))

    # Sparse, as the decisions recipe sends it: a few cells of a [23, 5] tensor of -1.
    wanted = torch.full((len(PROMPT) - 1, 5), -1, dtype=torch.int64)
    wanted[-1] = torch.tensor([35, 36, 37, 38, 39])
    wanted[7, 2] = 640
    request = types.TensorData.from_torch_sparse(wanted, pad_value=-1)
    assert request.sparse_crow_indices is not None
    sparse = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=request
                            ).result(WAIT).target_prompt_logprobs
    assert (sparse.shape, sparse.sparse_crow_indices, sparse.sparse_col_indices) == (
        [len(PROMPT) - 1, 5], request.sparse_crow_indices, request.sparse_col_indices)
    values = sparse.to_numpy()
    want = np.zeros((len(PROMPT) - 1, 5))
    want[-1] = lps[-1, [35, 36, 37, 38, 39]]
    want[7, 2] = lps[7, 640]
    np.testing.assert_allclose(values, want, rtol=0, atol=TOL)


def test_prompt_alt_tokens_are_draws_at_the_requests_temperature(served, reference):
    """k draws per position after the first: their logprobs are the model's; one seed gives the same draws,
    another seed others; temperature 0 draws the most likely token; and at temperature 0.5 the most likely
    token is drawn as often as softmax(logits / 0.5) says (within 5 sigma), not as at temperature 1."""
    _, _, sampler = served
    prompt = types.ModelInput.from_ints(PROMPT)
    lps, logits = reference(PROMPT)

    def draws(k: int, **params) -> tuple[np.ndarray, np.ndarray]:
        alt = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, **params), prompt_alt_tokens_k=k
                             ).result(WAIT).prompt_alt_tokens
        assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
        assert alt.tokens.shape == alt.logprobs.shape == [len(PROMPT) - 1, k]
        return alt.tokens.to_numpy(), alt.logprobs.to_numpy()

    tokens, logprobs = draws(6, seed=5, temperature=1.0)
    np.testing.assert_allclose(logprobs, np.take_along_axis(lps, tokens, axis=1), rtol=0, atol=TOL)
    again, again_lps = draws(6, seed=5, temperature=1.0)
    assert np.array_equal(again, tokens) and np.array_equal(again_lps, logprobs)
    assert not np.array_equal(draws(6, seed=6, temperature=1.0)[0], tokens)
    greedy, _ = draws(3, temperature=0.0)
    assert np.array_equal(greedy, np.repeat(lps.argmax(-1)[:, None], 3, axis=1))
    # A one-token prompt has no position after the first: empty [0, k] tensors, not a missing field.
    lone = sampler.sample(types.ModelInput.from_ints(PROMPT[:1]), 1, types.SamplingParams(max_tokens=1),
                          prompt_alt_tokens_k=2).result(WAIT).prompt_alt_tokens
    assert lone.tokens.shape == lone.logprobs.shape == [0, 2] and lone.tokens.to_numpy().size == 0

    k = 20
    cold, _ = draws(k, seed=9, temperature=0.5)
    top = logits.argmax(-1)
    seen = int((cold == top[:, None]).sum())

    def expected(temperature: float) -> tuple[float, float]:
        scaled = logits / temperature
        p = np.exp(scaled.max(-1) - np.logaddexp.reduce(scaled, axis=-1))
        return float(k * p.sum()), float(np.sqrt(k * (p * (1 - p)).sum()))

    mean, sigma = expected(0.5)
    assert abs(seen - mean) <= 5 * sigma, (seen, mean, sigma)
    mean_at_one, sigma_at_one = expected(1.0)  # what draws that ignored the temperature would give
    assert abs(seen - mean_at_one) > 5 * sigma_at_one, (seen, mean_at_one, sigma_at_one)


def test_the_json_path_gives_what_the_sdk_reads(served):
    """The same request as JSON (a client that does not ask for protobuf): the same numbers, the sparse layout
    kept, the draws as int64 / float32 tensors."""
    import torch

    _, server, sampler = served
    wanted = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    wanted[-1] = torch.tensor([35, 36, 37])
    wanted[4, 0] = 99
    sparse = types.TensorData.from_torch_sparse(wanted, pad_value=-1)
    sdk = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=4),
                         target_prompt_logprobs=sparse, prompt_alt_tokens_k=2).result(WAIT)
    ssid = _sampling_session(server.url)
    body = _sample_body(ssid, 1, PROMPT, params={"seed": 4}, prompt_alt_tokens_k=2, target_prompt_logprobs={
        "data": sparse.data, "dtype": "int64", "shape": sparse.shape,
        "sparse_crow_indices": sparse.sparse_crow_indices, "sparse_col_indices": sparse.sparse_col_indices})
    out = _json_result(server.url, body)
    target = out["target_prompt_logprobs"]
    assert (target["dtype"], target["shape"], target["sparse_crow_indices"], target["sparse_col_indices"]) == (
        "float32", [len(PROMPT) - 1, 3], sparse.sparse_crow_indices, sparse.sparse_col_indices)
    assert np.array_equal(np.asarray(target["data"], dtype=np.float32), sdk.target_prompt_logprobs.to_numpy()[
        np.asarray(wanted) >= 0])
    alt = out["prompt_alt_tokens"]
    assert alt["tokens"]["dtype"] == "int64" and alt["logprobs"]["shape"] == [len(PROMPT) - 1, 2]
    assert alt["tokens"]["data"] == sdk.prompt_alt_tokens.tokens.to_numpy().ravel().tolist()
    assert np.array_equal(np.asarray(alt["logprobs"]["data"], dtype=np.float32),
                          sdk.prompt_alt_tokens.logprobs.to_numpy().ravel())


def test_decisions_recipe_061_gets_the_softmax_of_its_labels_logprobs(cookbook061, served, reference, tmp_path):
    """tinker-cookbook 0.6.1's ``sample_decision``, unchanged, three decisions at once (2, 4 and 26 choices):
    each label's probability is the softmax, over the labels, of the HF logprobs at the answer position."""
    engine, server, _ = served
    out = tmp_path / "decisions.json"
    done = subprocess.run([sys.executable, "-W", "ignore", DRIVER, server.url, engine.model_path, str(out)],
                          env={**cookbook061, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"},
                          capture_output=True, text=True, timeout=300, check=False)  # ~10 s here
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(len(r["label_tokens"]) for r in results) == [2, 4, 26]
    for r in results:
        labels = list(r["label_tokens"])
        lps, _ = reference(r["tokens"])
        at = lps[r["choice_pos"] - 1, [r["label_tokens"][label] for label in labels]]
        want = np.exp(at - np.logaddexp.reduce(at))
        np.testing.assert_allclose([r["probabilities"][label] for label in labels], want, rtol=0, atol=TOL)


@pytest.mark.bitwise
def test_prompt_scores_are_batch_invariant_and_bitwise_the_prompt_logprobs(tiny_model):
    """Reproducible mode: a request's scores are the same bits alone and among neighbours of other lengths,
    and a target that is the prompt's own token has bitwise its prompt logprob."""
    from rlengine.backends.base import BackendRequest
    from rlengine.backends.torch.backend import TorchBackend
    from rlengine.types import PromptScoring, SamplingParams

    prompt = np.asarray(PROMPT, dtype=np.int32)
    ids = _targets().astype(np.int32)
    scoring = PromptScoring(target_ids_raw=ids.tobytes(), target_k=ids.shape[1], alt_k=3)
    target = BackendRequest("t", prompt.tobytes(), SamplingParams(temperature=1.0), 11, 1, True, False, 0, None,
                            scoring)

    def run(neighbours: int) -> tuple[list[float], object]:
        backend = TorchBackend(tiny_model, batch_invariant=True, prefix_cache_bytes=0)
        rng = np.random.default_rng(neighbours)
        for n in range(neighbours):
            other = rng.integers(3, 1000, size=int(rng.integers(2, 60))).astype(np.int32)
            backend.add_request(BackendRequest(f"n{n}", other.tobytes(), SamplingParams(temperature=0.7), n, 2,
                                               True, False, 0, None, PromptScoring(alt_k=2) if n % 2 else None))
        backend.add_request(target)
        found = None
        while backend.has_unfinished_requests():
            for out in backend.step():
                if out.request_id == "t" and out.prompt_scores is not None:
                    found = (out.prompt_logprobs, out.prompt_scores)
        assert found is not None
        return found

    prompt_lps, alone = run(0)
    for neighbours in (3, 6):
        assert run(neighbours)[1] == alone, neighbours  # every byte of the scores
    own = np.frombuffer(alone.target_logprobs_raw, dtype=np.float32).reshape(ids.shape)[:, 0]
    assert np.array_equal(own, np.asarray(prompt_lps, dtype=np.float32))


# -- what is refused ----------------------------------------------------------------------------


def test_bad_prompt_scoring_requests_are_typed_errors(served):
    """Each bad request is a 400 ``invalid`` naming the field and the value; the SDK raises it; the server
    keeps serving."""
    engine, server, sampler = served
    url = server.url
    ssid = _sampling_session(url)
    rows = len(PROMPT) - 1
    budget = engine.backend.capabilities.prompt_top_logprobs * engine.backend.max_model_len
    good = _targets()
    # One distinct id more than the bound allows over a prompt long enough for the vocabulary to hold them.
    long_prompt = np.random.default_rng(8).integers(3, 1000, size=100).tolist()
    distinct = budget // len(long_prompt) + 1
    wide = np.full((len(long_prompt) - 1, distinct // (len(long_prompt) - 1) + 1), -1, dtype=np.int64)
    wide.ravel()[:distinct] = np.arange(distinct)
    cases = [
        ({"target_prompt_logprobs": _tensor_json(good[:-1])}, "target_prompt_logprobs.shape", [rows - 1, 4]),
        ({"target_prompt_logprobs": _tensor_json(good.ravel())}, "target_prompt_logprobs.shape", [rows * 4]),
        ({"target_prompt_logprobs": {**_tensor_json(good), "dtype": "float32"}}, "target_prompt_logprobs.dtype",
         "float32"),
        ({"target_prompt_logprobs": _tensor_json(np.where(good == 1023, 1024, good))}, "target_prompt_logprobs",
         1024),
        ({"target_prompt_logprobs": _tensor_json(np.where(good == 1023, -2, good))}, "target_prompt_logprobs", -2),
        ({"target_prompt_logprobs": _tensor_json(np.full((rows, 2), -1))}, "target_prompt_logprobs", [rows, 2]),
        ({"target_prompt_logprobs": {**_tensor_json(good[:, :1]), "sparse_crow_indices": [0, 5],
                                     "sparse_col_indices": [0]}}, "target_prompt_logprobs.sparse_crow_indices",
         [rows, 1]),
        ({"prompt_alt_tokens_k": budget // len(PROMPT) + 1}, "prompt_alt_tokens_k", budget // len(PROMPT) + 1),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k", -1),
    ]
    for seq, (extra, field, value) in enumerate(cases, start=1):
        _refused(_call(url, "asample", _sample_body(ssid, seq, PROMPT, **extra)), "invalid", field, value)
    _refused(_call(url, "asample", _sample_body(ssid, len(cases) + 1, long_prompt,
                                                target_prompt_logprobs=_tensor_json(wide))),
             "invalid", "target_prompt_logprobs", distinct)
    with pytest.raises(tinker.BadRequestError, match=r"target_prompt_logprobs\.shape"):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                       target_prompt_logprobs=types.TensorData.from_numpy(good[:-2])).result(WAIT)
    ok = _json_result(url, _sample_body(ssid, len(cases) + 2, PROMPT, prompt_alt_tokens_k=1))
    assert ok["prompt_alt_tokens"]["tokens"]["shape"] == [rows, 1]


def test_a_backend_without_prompt_scores_refuses_them_by_name_at_once(engine_config, tmp_path):
    """The sim reports no ``Capabilities.prompt_scores`` (nor does vLLM): both options answer ``not_supported``
    naming the option and the backend, through the SDK too, before anything is queued."""
    with rle.Engine(engine_config("sim")) as sim:
        server = start(sim, TinkerServerConfig(checkpoint_dir=str(tmp_path), no_auth=True))
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        try:
            ssid = _sampling_session(server.url, sim.model_name)
            for seq, (field, extra, value) in enumerate((
                    ("target_prompt_logprobs", {"target_prompt_logprobs": _tensor_json(np.ones((2, 1), np.int64))},
                     [2, 1]),
                    ("prompt_alt_tokens_k", {"prompt_alt_tokens_k": 2}, 2)), start=1):
                body = _refused(_call(server.url, "asample", _sample_body(ssid, seq, [5, 6, 7], **extra)),
                                "not_supported", field, value)
                assert "the sim backend" in body["message"], body
            sampler = client.create_sampling_client(base_model=sim.model_name).result(WAIT)
            started = time.monotonic()
            with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k"):
                sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2),
                               prompt_alt_tokens_k=2).result(WAIT)
            assert time.monotonic() - started < REFUSED_WITHIN_S
            assert not sim.backend.capabilities.prompt_scores
        finally:
            client.close("success").result(WAIT)
            server.close()
