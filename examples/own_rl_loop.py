"""Your own RL loop on the engine: sample a group, score it, build datums, train, install.

A GRPO-shaped loop in about sixty lines, written against the public API only
(``docs/embedding.md`` walks through it). The task is a toy one that a random
model can make progress on: the reward is the share of letters among the
characters of the answer. What matters is the shape:

* the prompt comes from the model's own chat template (``engine.tokenizer``);
* each sampled sequence becomes one ``Datum`` in the Tinker convention: the
  model reads ``prompt + sampled[:-1]`` and predicts ``prompt[1:] + sampled``,
  one target per input position, with the sampler's logprobs and the
  advantage on the sampled positions and zeros on the prompt's;
* the update is ``forward_backward`` + ``optim_step``, and the new weights
  reach the sampler through ``save_weights_and_get_sampling_client`` (the
  engine's gate: no sample mixes two versions unnoticed).

Run it: ``python examples/own_rl_loop.py --steps 3`` (the tiny model on the
PyTorch backend, built once into the cache; a few seconds a step on a CPU).
``--backend sim`` runs the same loop on the simulator, without torch (its
prompt is fixed token ids: the simulator has no tokenizer).
"""

from __future__ import annotations

import argparse

import numpy as np

import rlengine as rle

GROUP = 4
TIMEOUT_S = 120.0  # every wait has a bound; a tiny model's step takes seconds


def prompt_tokens(engine: rle.Engine) -> list[int]:
    """The prompt's token ids: rendered by the chat template, or fixed ids on the simulator."""
    if engine.tokenizer is None:
        return [1, 2, 3, 4]
    messages = [{"role": "user", "content": "Say something."}]
    return engine.sampling_client().render_chat_completion(messages).to_ints()


def reward(engine: rle.Engine, tokens: list[int]) -> float:
    """The share of letters in the decoded answer (on the simulator: of even token ids)."""
    if engine.tokenizer is None:
        return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return sum(c.isalpha() for c in text) / len(text) if text else 0.0


def to_datum(prompt: list[int], seq: rle.SampledSequence, advantage: float) -> rle.Datum:
    """One sampled sequence as a training datum (targets shifted by one, prompt positions zero)."""
    tokens = prompt + seq.tokens
    n_prompt = len(prompt) - 1  # targets that are prompt tokens: no loss on them
    logprobs = [0.0] * n_prompt + seq.logprobs
    advantages = [0.0] * n_prompt + [advantage] * seq.length
    return rle.Datum(model_input=rle.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                     "logprobs": np.array(logprobs, dtype=np.float32),
                                     "advantages": np.array(advantages, dtype=np.float32)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="RL steps to run")
    parser.add_argument("--backend", default="torch", help="torch (the tiny model), vllm, or sim")
    args = parser.parse_args()
    config = rle.EngineConfig(model="tiny", backend=args.backend)
    with rle.Engine(config) as engine:
        trainer = engine.training_client()
        sampler = trainer.save_weights_and_get_sampling_client()
        prompt = prompt_tokens(engine)
        params = rle.SamplingParams(max_tokens=16, temperature=1.0)
        for step in range(args.steps):
            response = sampler.sample(rle.ModelInput.from_ints(prompt), num_samples=GROUP,
                                      sampling_params=params).result(TIMEOUT_S)
            rewards = np.array([reward(engine, seq.tokens) for seq in response.sequences])
            advantages = rewards - rewards.mean()  # GRPO's group baseline
            data = [to_datum(prompt, seq, float(a)) for seq, a in zip(response.sequences, advantages)]
            trainer.forward_backward(data, loss_fn="importance_sampling").result(TIMEOUT_S)
            trainer.optim_step(rle.AdamParams(learning_rate=1e-3)).result(TIMEOUT_S)
            sampler = trainer.save_weights_and_get_sampling_client(timeout=TIMEOUT_S)
            print(f"step {step}: mean reward {rewards.mean():.3f}, now sampling policy version {sampler.version}")


if __name__ == "__main__":
    main()
