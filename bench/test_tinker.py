"""Tinker API benchmarks (pytest-benchmark); figures in bench/RESULTS_tinker.md.

Each figure is measured against its baseline in the same run, rounds
alternating, medians taken (the machine is a noisy shared 2-vCPU VM):

The server runs in its own process (``python -m rlengine.tinker_api``, as
``rlengine serve`` would run it); the baselines use an engine in the
benchmark process on the same tiny model. Calls alternate, so one side idles
while the other runs.

* forward_backward: one call on a 4-datum batch (64 tokens each) through the
  official SDK and the REST server (``forward_backward(...).result()``),
  against the in-process API (``engine.training_client().forward_backward(...)
  .result()``); both train the tiny model fully (rank 0), so the compute is
  the same and the difference is the REST path: SDK, HTTP, protobuf, futures
  table, long poll.
* sample: one call of 4 samples x 8 tokens through the SDK against the
  in-process ``SamplingClient.sample``, same weights (the base model).
* retrieving a completed future: one ``retrieve_future`` round trip on a
  persistent HTTP connection for a result that is already there (JSON and
  protobuf), against a ``healthz`` round trip (the HTTP floor).

    OMP_NUM_THREADS=1 python -m pytest bench/test_tinker.py --benchmark-only -s
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import httpx
import numpy as np
import pytest

import rlengine as rle

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

ROUNDS = 30
WAIT = 120.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The Tinker server in its own process (as ``rlengine serve`` runs it), an SDK client of it,
    and an in-process engine on the same tiny model for the baselines."""
    cache = str(tmp_path_factory.mktemp("rlengine-bench-cache"))
    config = rle.EngineConfig(model="tiny", backend="torch", cache_dir=cache)
    with rle.Engine(config) as engine:  # builds the tiny model before the server process needs it
        proc = subprocess.Popen([sys.executable, "-m", "rlengine.tinker_api", "--backend", "torch", "--port", "0",
                                 "--cache-dir", cache, "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpt"))],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            url = key = None
            for line in proc.stdout:
                if line.startswith("tinker: "):
                    url = line.split(" ", 1)[1].strip()
                if line.startswith("tinker key: "):
                    key = line.split(": ", 1)[1].strip()  # the key the server drew
                if line.startswith("ready"):
                    break
            assert url is not None and key is not None, "the server process did not start"
            client = tinker.ServiceClient(base_url=url, api_key=key)
            try:
                yield engine, url, key, client
            finally:
                client.close("success").result(WAIT)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)


def _batch(sdk: bool) -> list:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(4):
        toks = rng.integers(3, 1000, size=65)
        inputs = {"target_tokens": toks[1:].astype(np.int64)}
        if sdk:
            out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()), loss_fn_inputs=inputs))
        else:
            out.append(rle.Datum(model_input=rle.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs))
    return out


def _alternate(rest, local, rounds: int = ROUNDS) -> tuple[float, float]:
    """Median seconds of ``rest()`` and ``local()``, alternating, after a warm-up of each."""
    rest(), local()
    a, b = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        rest()
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        local()
        b.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def _record(benchmark, result: dict) -> dict:
    benchmark.extra_info.update(result)
    print({k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()})
    return result


def test_forward_backward_rest_vs_in_process(benchmark, served):
    engine, _, _, client = served
    remote = client.create_lora_training_client(base_model="tiny", rank=0).result(WAIT)
    local = engine.training_client()
    sdk_batch, local_batch = _batch(True), _batch(False)
    figures: dict = {}

    def run() -> None:
        figures["rest"], figures["local"] = _alternate(
            lambda: remote.forward_backward(sdk_batch, "cross_entropy").result(WAIT),
            lambda: local.forward_backward(local_batch, "cross_entropy").result(WAIT))

    benchmark.pedantic(run, rounds=1, iterations=1)
    _record(benchmark, {"batch": "4 x 64 tokens", "rest_ms": figures["rest"] * 1e3,
                        "in_process_ms": figures["local"] * 1e3,
                        "rest_overhead_ms": (figures["rest"] - figures["local"]) * 1e3,
                        "ratio_rest_over_in_process": figures["rest"] / figures["local"]})


def test_sample_rest_vs_in_process(benchmark, served):
    engine, _, _, client = served
    remote = client.create_sampling_client(base_model="tiny").result(WAIT)
    local = engine.sampling_client()
    prompt = list(range(5, 21))
    figures: dict = {}

    def run() -> None:
        figures["rest"], figures["local"] = _alternate(
            lambda: remote.sample(types.ModelInput.from_ints(prompt), 4,
                                  types.SamplingParams(max_tokens=8, seed=1, stop=[])).result(WAIT),
            lambda: local.sample(rle.ModelInput.from_ints(prompt), 4,
                                 rle.SamplingParams(max_tokens=8, seed=1, ignore_eos=True)).result(WAIT))

    benchmark.pedantic(run, rounds=1, iterations=1)
    _record(benchmark, {"sample": "4 x 8 tokens, 16-token prompt", "rest_ms": figures["rest"] * 1e3,
                        "in_process_ms": figures["local"] * 1e3,
                        "rest_overhead_ms": (figures["rest"] - figures["local"]) * 1e3,
                        "ratio_rest_over_in_process": figures["rest"] / figures["local"]})


def test_retrieve_completed_future(benchmark, served):
    _, url, key, _ = served
    rounds = 200
    with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=WAIT) as http:
        sid = http.post("/create_session", json={"tags": [], "sdk_version": "bench"}).json()["session_id"]
        ssid = http.post("/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                           "base_model": "tiny"}).json()["sampling_session_id"]
        rid = http.post("/asample", json={
            "sampling_session_id": ssid, "seq_id": 0, "num_samples": 4,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 21))}]},
            "sampling_params": {"max_tokens": 8, "seed": 1}}).json()["request_id"]
        assert http.post("/retrieve_future", json={"request_id": rid}).json()["type"] == "sample"
        times: dict[str, list[float]] = {"json": [], "proto": [], "healthz": []}

        def run() -> None:
            for _ in range(rounds):
                for kind, call in (
                        ("json", lambda: http.post("/retrieve_future", json={"request_id": rid})),
                        ("proto", lambda: http.post("/retrieve_future", json={"request_id": rid},
                                                    headers={"Accept": "application/x-protobuf"})),
                        ("healthz", lambda: http.get("/healthz"))):
                    t0 = time.perf_counter()
                    assert call().status_code == 200
                    times[kind].append(time.perf_counter() - t0)

        benchmark.pedantic(run, rounds=1, iterations=1)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    _record(benchmark, {"retrieve_json_us": med["json"], "retrieve_proto_us": med["proto"],
                        "healthz_us": med["healthz"], "retrieve_over_healthz": med["proto"] / med["healthz"]})
