"""The loop-thread cost of checking provenance spans (pytest-benchmark); figures in bench/RESULTS.md.

A tinker-cookbook 0.6.1 step sends every datum with provenance spans, and the
Tinker server checks them against its sampled-sequence records before
queueing the call (``rlengine.tinker_api.stability``): for
``stable_reinforce`` it also writes in the recorded behaviour logprobs. This
measures that work itself, wherever it runs (a call over 4 KiB now runs it on
the server's worker threads: ``bench/test_tinker_offloop.py`` measures what
is left on the loop). The baseline is what the same batch costs the loss's
``validate_data``. One cookbook ``rl_loop`` batch: 128 prompts x 16 samples,
a 100-token prompt and 200 sampled tokens each, four spans a datum. Rounds
alternate, medians taken (a noisy shared 2-vCPU VM).

    OMP_NUM_THREADS=1 python -m pytest bench/test_provenance.py --benchmark-only -s
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import rlengine as rle
from rlengine.tinker_api.stability import ProvenancedDatum, SequenceRecords, Span
from rlengine.trainer.losses import validate_data

PROMPTS, GROUP, PROMPT_LEN, SAMPLED_LEN = 128, 16, 100, 200
ROUNDS = 7
TARGET_CHECK_OVER_VALIDATE = 4.0
"""Checking the spans costs at most this many times the loss's own validation of the batch."""


def _batch() -> tuple[SequenceRecords, list[rle.Datum]]:
    rng = np.random.default_rng(0)
    records = SequenceRecords(max_sequences=1 << 20, max_bytes=1 << 32, ttl_s=86_400.0)
    data: list[rle.Datum] = []
    for r in range(PROMPTS):
        prompt = rng.integers(3, 1000, PROMPT_LEN).astype(np.int32)
        tokens = [rng.integers(3, 1000, SAMPLED_LEN).astype(np.int32) for _ in range(GROUP)]
        records.record("owner", "session", f"r{r}", prompt.tobytes(), rle.SampleResponse(sequences=[
            rle.SampledSequence(stop_reason="length", tokens_raw=t.tobytes(),
                                logprobs_raw=np.full(SAMPLED_LEN, -1.0, np.float32).tobytes(),
                                versions_raw=np.zeros(SAMPLED_LEN, np.int32).tobytes()) for t in tokens]),
            stable=True)
        for i, t in enumerate(tokens):
            sid, n = f"r{r}:{i}", PROMPT_LEN + SAMPLED_LEN - 1
            data.append(ProvenancedDatum(
                model_input=rle.ModelInput.from_ints(np.concatenate([prompt, t[:-1]])),
                loss_fn_inputs={"target_tokens": np.concatenate([np.zeros(PROMPT_LEN - 1), t]).astype(np.int64),
                                "logprobs": np.zeros(n, np.float32), "advantages": np.ones(n, np.float32)},
                model_input_spans=(Span(False, sid, 0, PROMPT_LEN), Span(True, sid, 0, SAMPLED_LEN - 1)),
                loss_fn_input_spans=(Span(False, sid, 1, PROMPT_LEN - 1), Span(True, sid, 0, SAMPLED_LEN))))
    return records, data


def _provenance_cost() -> dict[str, float]:
    records, data = _batch()
    times: dict[str, list[float]] = {"validate": [], "check": [], "resolve": []}
    runs = {"validate": lambda: validate_data(data, "importance_sampling", None, 1000, 4096),
            "check": lambda: records.check("owner", "session", data),
            "resolve": lambda: records.resolve("owner", "session", data)}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"datums": float(len(data)), "validate_ms": ms["validate"], "check_ms": ms["check"],
            "resolve_ms": ms["resolve"], "check_over_validate": ms["check"] / ms["validate"],
            "resolve_over_validate": ms["resolve"] / ms["validate"],
            "target_check_over_validate": TARGET_CHECK_OVER_VALIDATE}


def test_provenance_check_cost_on_the_loop(record):
    r = record(_provenance_cost)
    assert r["check_over_validate"] <= TARGET_CHECK_OVER_VALIDATE, r
