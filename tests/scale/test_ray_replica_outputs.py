"""What a Ray sampler replica reports beyond tokens: speculative counts and prompt scores.

A request served by a replica (``Placement(kind="ray")``) must report what the
same request reports on the local torch backend: the tokens speculative
decoding drafted and accepted (the RL step's spec_* metrics read them; a
replica that drops them reads as "nothing drafted") and the prompt scores
(``PromptScoring``: chosen tokens' logprobs and seeded draws at prompt
positions). The replicas run the same code in batch-invariant mode, so the
comparison is exact: equal counts, and prompt scores equal bit for bit (their
raw float32 bytes), not within a tolerance.

The model copies (``tests/copying_model.py``): it continues a prompt of period
5, so n-gram drafts are found and accepted. Drafted counts are a pure function
of the tokens only while every pass fits one row tile and the backend's state
between calls is the same (``backends.torch.speculative``: the drafting policy
may follow timings across tiles): one call of 2 samples at a time on each
backend, k = 4 (10 rows, within the 16-row minimum tile), and max_tokens
1 + 5n, so that a call ends on a verified draft and leaves the backend as it
found it. The Ray cluster is the package's (``tests/scale/conftest.py``).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from copying_model import build_copier

import rlengine as rle
from rlengine.types import PromptScoring

ray = pytest.importorskip("ray")

WAIT = 120.0
PERIOD = 5
K = 4
MAX_TOKENS = 1 + (K + 1) * 4
"""Four whole verifications after the prefill's token (see the module docstring)."""


@pytest.fixture(scope="module")
def engines(tiny_model, model_cache, tmp_path_factory):
    """The same speculative, batch-invariant torch engine twice: in process, and on 2 Ray replicas."""
    copier = build_copier(tiny_model, str(tmp_path_factory.mktemp("copier")), PERIOD)
    args = {"speculative": "ngram", "speculative_k": K, "batch_invariant": True}
    base = rle.EngineConfig(model=copier, backend="torch", cache_dir=model_cache, engine_args=args)
    with rle.Engine(msgspec.structs.replace(base, placement=rle.Placement(kind="ray", sampler_replicas=2))) as rep:
        # Bits are the same whatever the batch, at a given thread count (kernels are chosen by it):
        # the local engine takes the replicas' (Ray gives an actor its own OMP_NUM_THREADS).
        threads = rep.backend.capabilities.kernel_check["threads"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RLENGINE_TORCH_THREADS", str(threads))
            with rle.Engine(base) as local:
                assert local.backend.capabilities.kernel_check["threads"] == threads
                yield local, rep


def periodic(rng: np.random.Generator, periods: int = 4) -> list[int]:
    return rng.integers(3, 1000, PERIOD).tolist() * periods


def params(i: int) -> rle.SamplingParams:
    """Greedy and seeded temperature-1 calls in turn (the copier's copied token is 30 logits
    above the rest: at temperature 1 it is still drawn, and drafts still accepted)."""
    return rle.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 1.0, seed=100 + i,
                              ignore_eos=True)


def test_replicas_report_the_local_backends_drafted_and_accepted_tokens(engines):
    local, rep = engines
    rng = np.random.default_rng(0)
    prompts = [periodic(rng) for _ in range(6)]
    before = local.stats(), rep.stats()
    # Locally one call at a time; on the replicas two at once, one each (routing takes the replica
    # with fewer requests in flight), so that each backend runs one call at a time either way.
    want = [local.sample(p, 2, params(i)).result(WAIT) for i, p in enumerate(prompts)]
    got, replicas = [], set()
    for i in range(0, len(prompts), 2):
        pair = [rep.sample(prompts[j], 2, params(j), session_id=f"spec{j}") for j in (i, i + 1)]
        got += [f.result(WAIT) for f in pair]
        replicas |= {rep.backend._pins[f"spec{j}"].index for j in (i, i + 1)}
    after = local.stats(), rep.stats()
    assert replicas == {0, 1}
    for i, (w, g) in enumerate(zip(want, got)):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences], i
        assert [s.logprobs for s in g.sequences] == [s.logprobs for s in w.sequences], i
        assert (g.drafted_tokens, g.accepted_tokens) == (w.drafted_tokens, w.accepted_tokens), i
        assert 0 < w.accepted_tokens <= w.drafted_tokens, i
    # The engine's counters (what an RL step's spec_* metrics read) agree too.
    for name in ("drafted_tokens", "accepted_tokens"):
        assert after[1][name] - before[1][name] == after[0][name] - before[0][name] > 0, name


def test_replicas_serve_the_local_backends_prompt_scores_bit_for_bit(engines):
    local, rep = engines
    rng = np.random.default_rng(1)
    calls = []
    for i in range(4):
        prompt = periodic(rng, 2) + rng.integers(3, 1000, 7).tolist()
        rows = len(prompt) - 1
        # Each position's own next token, a random one and a cell asking nothing (-1).
        targets = np.stack([np.asarray(prompt[1:]), rng.integers(0, 1000, rows), np.full(rows, -1)], axis=1)
        targets[::3, 1] = -1
        scoring = PromptScoring(target_ids_raw=targets.astype(np.int32).tobytes(), target_k=3, alt_k=2 + i % 2)
        calls.append((prompt, scoring, rle.SamplingParams(max_tokens=3, temperature=(0.0, 1.0, 0.7, 1.0)[i],
                                                          seed=7 + i)))

    def submit(engine: rle.Engine, j: int) -> rle.RequestFuture:
        prompt, scoring, sp = calls[j]
        spec = engine.validate_sample(prompt, 2, sp, include_prompt_logprobs=True)
        return engine.submit_sample(msgspec.structs.replace(spec, prompt_scoring=scoring), session_id=f"score{j}")

    want = [submit(local, j).result(WAIT) for j in range(len(calls))]
    pending = [submit(rep, j) for j in range(len(calls))]
    got = [f.result(WAIT) for f in pending]
    assert {rep.backend._pins[f"score{j}"].index for j in range(len(calls))} == {0, 1}
    for j, (w, g) in enumerate(zip(want, got)):
        assert w.prompt_scores is not None and w.prompt_scores.alt_ids_raw is not None, j
        rows = len(calls[j][0]) - 1
        assert len(w.prompt_scores.target_logprobs_raw or b"") == rows * 3 * 4, j
        assert g.prompt_scores == w.prompt_scores, j  # every field: bytes equal, so bitwise
        assert g.prompt_logprobs_raw == w.prompt_logprobs_raw, j
    # Served, so the Tinker API's check (``prompt_scoring``) lets such requests through.
    assert rep.backend.capabilities.prompt_scores
