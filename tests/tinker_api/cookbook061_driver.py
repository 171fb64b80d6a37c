"""Runs a tinker-cookbook 0.6.1 RL recipe against a local Tinker server, in a subprocess of the test.

``python cookbook061_driver.py URL MODEL RECIPE:MODE:STEPS:LOG_PATH...`` with tinker-cookbook 0.6.1
first on ``PYTHONPATH`` and ``TINKER_API_KEY`` set (``test_tinker_cookbook061``): the runs one
after another in one process (the imports cost more than a short run). RECIPE is ``rl_loop`` or
``math_rl``, MODE ``sync`` or ``async`` (``math_rl`` with ``max_steps_off_policy=2``); each runs at
its default loss (``stable_reinforce`` in 0.6.1). The recipes' own loops run unchanged; only what
needs a hub is replaced: the data (``rl_loop`` loads GSM8K, ``math_rl`` builds its dataset from a
hub tokenizer's name) by prompts of the local tiny model, the renderer by ``role_colon``, and the
reward by one this model can learn in a few steps: the share of the completion's characters in
``a``-``m``.

Both recipes see the task as their own environments pose it, with the same settings (lr 1e-2,
LoRA rank 8, 4 groups of 4): a question (five random tokens of the tiny model, decoded) rendered
as a user turn, the completion sampled after the assistant's header up to the renderer's stop
sequence, and the reward read from the parsed reply. For ``math_rl`` that is the cookbook's own
``ProblemEnv`` (the base of its arithmetic and math environments) with the share as its answer
check and no format term. An earlier driver gave ``math_rl`` the bare five tokens as its whole
prompt, stopping at the end-of-text token: on the same server, whose side checked out (at every
synchronous step the trainer's logprobs of the sampled tokens were the sampler's, 2e-6 apart, so
each step sampled the weights just trained), that task hardly moved: reward 0.45-0.58 over 30
steps, sync and async alike, and one 40-step run rose only from step 26 (every sampled position
sits in another random context, where after the assistant's header the first ones share one).
Posed as a turn, ``math_rl`` learns within 30 steps (measured: 4 of 4 sync runs, 8 of 8 async).

Every ``forward_backward`` a run sends is recorded (its loss, how many datums carried
provenance spans, its ``loss:sum``, and how far off policy each datum was: the mean over its
sampled tokens of trainer minus sampler logprob) into its
``LOG_PATH/calls.json``, and the recipe's metrics stay in its ``metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from functools import partial

import chz
import numpy as np
import tinker
from tinker.lib.public_interfaces.training_client import TrainingClient
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder

RENDERER = "role_colon"
GROUP = 4
GROUPS = 4
MAX_TOKENS = 6


def reward_of(text: str) -> float:
    """The learnable reward: the share of the text's characters in the first half of the alphabet."""
    return float(np.mean([c in "abcdefghijklm" for c in text])) if text else 0.0


def _prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """``n`` questions: five random tokens of the tiny model each, decoded."""
    rng = np.random.default_rng(seed)
    return [tokenizer.decode(rng.integers(3, 1000, size=5).tolist()) for _ in range(n)]


class _Calls:
    """What the recipe sent to ``forward_backward``: recorded around the SDK's own method."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[tinker.Datum], object]] = []
        original = TrainingClient.forward_backward

        def recorded(client, data, loss_fn, *args, **kwargs):
            future = original(client, data, loss_fn, *args, **kwargs)
            self.sent.append((loss_fn, list(data), future))
            return future

        TrainingClient.forward_backward = recorded  # type: ignore[method-assign]

    def dump(self, path: str) -> None:
        out = []
        for loss_fn, data, future in self.sent:
            result = future.result(120)
            spans = sum(d.model_input_spans is not None and d.loss_fn_input_spans is not None for d in data)
            out.append({"loss_fn": loss_fn, "datums": len(data), "with_spans": spans,
                        "loss": result.metrics["loss:sum"],
                        "log_ratios": [_log_ratio(d, o["logprobs"].to_numpy())
                                       for d, o in zip(data, result.loss_fn_outputs, strict=True)]})
        with open(os.path.join(path, "calls.json"), "w", encoding="utf-8") as f:
            json.dump(out, f)


def _log_ratio(datum: tinker.Datum, trained: np.ndarray) -> float:
    """The mean over the datum's sampled tokens of trainer minus sampler logprob: 0 on policy, growing
    in size with the steps between sampling and training (0 without spans, which name those tokens)."""
    sampled, position = [], 0
    for span in datum.loss_fn_input_spans or ():
        if isinstance(span, tinker.SampledProvenanceSpan):
            sampled.extend(range(position, position + span.length))
        position += span.length
    if not sampled:
        return 0.0
    behaviour = datum.loss_fn_inputs["logprobs"].to_numpy()
    return float(np.mean(trained[sampled] - behaviour[sampled]))


def run_rl_loop(mode: str, url: str, model: str, log_path: str, steps: int) -> None:
    import datasets
    from tinker_cookbook.recipes import rl_loop
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    questions = _prompts(get_tokenizer(model), GROUPS * steps)
    data = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"question": questions, "answer": ["#### 0"] * len(questions)})})
    datasets.load_dataset = lambda *_a, **_k: data
    rl_loop.model_info.get_recommended_renderer_name = lambda _name: RENDERER
    rl_loop.get_reward = lambda response, _answer: reward_of(response)
    if mode != "sync":
        raise SystemExit("rl_loop has no async mode")
    rl_loop.main(rl_loop.Config(base_url=url, log_path=log_path, model_name=model, batch_size=GROUPS,
                                group_size=GROUP, learning_rate=1e-2, lora_rank=8, save_every=0,
                                max_tokens=MAX_TOKENS, max_steps=steps, ttl_seconds=None))


class _LowLetters(ProblemEnv):
    """One ``math_rl`` problem: the recipe's own single-turn environment with the learnable reward as
    its answer check (a share, not a bool: ``ProblemEnv.step`` takes it as the reward's float)."""

    def __init__(self, question: str, renderer) -> None:
        super().__init__(renderer, format_coef=0.0)
        self.question = question

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> float:  # type: ignore[override]
        return reward_of(sample_str)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "a-m"


class _Dataset(RLDataset):
    def __init__(self, model: str, batches: int) -> None:
        from tinker_cookbook import renderers
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        self.tokenizer = get_tokenizer(model)
        self.renderer = renderers.get_renderer(RENDERER, self.tokenizer)
        self.batches = batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        questions = _prompts(self.tokenizer, GROUPS, seed=index)
        return [ProblemGroupBuilder(env_thunk=partial(_LowLetters, question, self.renderer), num_envs=GROUP,
                                    dataset_name="low_letters") for question in questions]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class _DatasetBuilder(RLDatasetBuilder):
    model: str
    batches: int

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return _Dataset(self.model, self.batches), None


def run_math_rl(mode: str, url: str, model: str, log_path: str, steps: int) -> None:
    from tinker_cookbook.recipes.math_rl import train

    train.get_dataset_builder = lambda **_kw: _DatasetBuilder(model=model, batches=steps + 1)
    config = train.CLIConfig(model_name=model, lora_rank=8, renderer_name=RENDERER, group_size=GROUP,
                             groups_per_batch=GROUPS, learning_rate=1e-2, max_tokens=MAX_TOKENS, log_path=log_path,
                             eval_every=0, save_every=0, base_url=url, behavior_if_log_dir_exists="delete",
                             max_steps_off_policy=2 if mode == "async" else None, max_steps=steps)
    asyncio.run(train.cli_main(config))


def main() -> None:
    url, model, *runs = sys.argv[1:]
    calls = _Calls()
    for run in runs:
        recipe, mode, steps, log_path = run.split(":", 3)
        os.makedirs(log_path, exist_ok=True)
        calls.sent.clear()
        {"rl_loop": run_rl_loop, "math_rl": run_math_rl}[recipe](mode, url, model, log_path, int(steps))
        calls.dump(log_path)


if __name__ == "__main__":
    main()
