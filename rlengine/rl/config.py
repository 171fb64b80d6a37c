"""``TrainConfig``: every setting of an RL run, validated, and its ``key=value`` form.

A recipe supplies its own defaults (``Recipe.defaults``); the command line
overrides them with ``key=value`` pairs (``parse_overrides``), converted to
each field's type. A bad value raises ``ConfigurationError`` naming the
field and the value. The config is stored in the run directory, and a
resumed run takes it from there.

Values only; this module must not start anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rlengine.errors import ConfigurationError
from rlengine.timeline import DEFAULT_MAX_EVENTS
from rlengine.validation import (
    Bound,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    check_integer,
    check_number,
    convert_error,
    validate,
)

__all__ = ["RESUME_MUTABLE", "TrainConfig", "check_integer", "check_number", "convert", "parse_overrides"]


class TrainConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Settings of one RL run (defaults are a recipe's starting point, not tuned for any task).

    Why one class: it is the run's one record of its settings, stored in ``config.json``,
    compared on resume and listed by ``rlengine train --list``; its length is its fields'
    docstrings, each field's description (and what ``--list`` shows of it)."""

    seed: int = 0
    """Seeds the dataset order and every sampling seed (derived per group and attempt)."""
    backend: Literal["auto", "sim", "torch", "vllm"] = "auto"
    """The engine's backend; ``auto``: the first usable of vLLM and torch (``rlengine info`` says which)."""
    placement: Literal["local", "ray"] = "local"
    """Where the data plane runs: in this process, or Ray actors behind the one engine
    (``rlengine.Placement``): ``sampler_replicas`` backends and, with ``trainer_workers`` > 1,
    the torch trainer sharded under FSDP2 over that many workers."""
    sampler_replicas: PositiveInt = 1
    """Sampler backends (more than one with ``placement=ray``)."""
    trainer_workers: PositiveInt = 1
    """Torch trainer workers (more than one: sharded under FSDP2, with ``placement=ray``)."""
    reproducible: bool = True
    """A seed gives the same run whatever the timing: the torch backend samples batch-invariant
    (``engine_args["batch_invariant"]``), since a multi-turn or sandboxed run's batches form
    by timing. False: faster sampling, reproducible only where batches form in a fixed
    order. vLLM has no batch-invariant mode on CPU: with it, such runs agree only to the
    last bits of their logprobs, and drift apart from there."""
    speculative_k: NonNegativeInt = 0
    """Speculative rollout on the torch backend (``engine_args["speculative"] = "ngram"``): each
    sequence drafts up to this many tokens from its own context and one pass verifies them; 0: off.
    The sampled tokens and logprobs are those of plain sampling (bitwise in a reproducible run), so
    the training data does not change; only the speed does (docs/reproducibility.md)."""
    model: str | None = None
    """The model to train instead of the recipe's own (None): a Hugging Face directory, a ``.gguf`` file
    (``rlengine[gguf]``) or a hub id in the local HF cache; the recipe encodes with its tokenizer and
    refuses a model that does not fit (docs/recipes.md)."""
    cache_dir: str | None = None
    """Where models are built (and GGUF files converted); None: ``$RLENGINE_CACHE`` or ``~/.cache/rlengine``."""
    steps: PositiveInt | None = None
    """Training steps; None trains through the dataset once. More steps than the
    dataset has batches is an error (``DataExhausted``) when the data runs out."""
    groups_per_batch: PositiveInt = 32
    """Groups (a task sampled ``group_size`` times) per training step."""
    group_size: PositiveInt = 8
    """Attempts per group; the group's rewards are each attempt's baseline (GRPO)."""
    max_steps_off_policy: NonNegativeInt = 0
    """0: synchronous (sample a batch with the current weights, train, repeat).
    k > 0: rollouts for up to k steps ahead run while training (the engine trains on a thread
    of its own where the sampler is not on CUDA: ``EngineConfig.train_concurrently``). With
    ``reproducible`` each batch b samples exactly policy max(0, b - k) whatever the timing (a
    step installs its weights once the batches released before it are sampled; a checkpoint
    keeps them); without it a batch samples whatever is loaded, and a group whose oldest token
    is more than k policy versions old is re-sampled instead of trained."""
    workers: PositiveInt | None = None
    """Concurrent group rollouts; None: ``groups_per_batch * (max_steps_off_policy + 1)``."""
    num_minibatches: PositiveInt = 1
    """> 1 streams: each minibatch of groups is sent to ``forward_backward`` as soon
    as it is complete, one optimizer step per batch."""
    num_substeps: PositiveInt = 1
    """Optimizer steps per batch: K > 1 splits the batch's datums into K parts,
    each a forward_backward and an optimizer step (PPO-style reuse of the samples)."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature of the rollouts."""
    max_tokens: PositiveInt = 16
    """Most tokens sampled per action (per turn of a multi-turn episode)."""
    max_turns: PositiveInt = 16
    """Most turns per episode."""
    loss_fn: Literal["importance_sampling", "ppo", "cispo"] = "ppo"
    """The policy loss (``rlengine.trainer.losses``): ``ppo`` (clipped ratio), ``importance_sampling`` or ``cispo``."""
    clip_low_threshold: NonNegativeFloat | None = None
    """None: the loss's default (ppo 0.8, cispo 0.0)."""
    clip_high_threshold: NonNegativeFloat | None = None
    """None: the loss's default (ppo 1.2, cispo 4.0)."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus in the loss; 0: none."""
    loss_aggregation: Literal["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token",
                              "sequence"] = "sum"
    """How each ``forward_backward`` call aggregates the loss over its sampled tokens (each
    substep, each streamed minibatch is a call of its own), the entropy bonus and the reference
    KL included: ``sum``, the Tinker losses' sum over tokens; ``token_mean``, that sum over the
    call's tokens (DAPO; TRL ``dapo`` / ``bnpo``; verl ``token-mean``); ``seq_mean_token_mean``,
    each datum's token mean averaged over the call's datums (GRPO; TRL ``grpo``; verl
    ``seq-mean-token-mean``); ``seq_mean_token_sum_norm``, the sum over ``max_tokens`` times the
    call's datums (Dr. GRPO; TRL ``dr_grpo``; verl ``seq-mean-token-sum-norm``). The run weighs
    the datums it sends (``rlengine.rl.advantages.aggregation_weights``); the losses do not change.
    Old names, kept so stored runs resume as they were: ``token`` is ``sum``; ``sequence`` divides
    each trajectory's advantage by its sampled tokens (the entropy bonus and KL unweighted)."""
    dynamic_sampling_attempts: NonNegativeInt = 0
    """DAPO's dynamic sampling: a group whose rewards are all equal is sampled again, with new
    seeds, up to this many times before it counts as it is (dropped with ``skip_constant_reward``);
    its samples are logged (``resampled_constant`` in groups.jsonl), not trained. 0: off."""
    overlong_filtering: bool = False
    """DAPO's overlong filtering: a trajectory whose last action was cut by the token limit
    (stop reason ``length``: it reached ``max_tokens``, not an end token or a stop string)
    trains no token, while its reward still counts in its group's baseline (mean and std).
    Counted per step (``attempts_overlong_filtered``); a group left with nothing to train is
    dropped (``groups_dropped_overlong``)."""
    overlong_buffer_len: NonNegativeInt = 0
    """DAPO's soft overlong punishment (verl's ``overlong_buffer.len``; DAPO's L_cache): the last
    this many tokens before ``max_tokens`` (L_max) are a buffer in which an answer of n tokens
    adds ``overlong_buffer_penalty_factor * ((L_max - L_cache) - n) / L_cache`` to its
    trajectory's reward, before advantages: 0 up to ``L_max - L_cache`` tokens, falling linearly
    to ``-overlong_buffer_penalty_factor`` at L_max (and no lower). n is per action, since
    ``max_tokens`` caps each action, not the episode: a multi-turn trajectory takes the penalty
    of its longest action (a single-turn one, exactly DAPO's). 0: off."""
    overlong_buffer_penalty_factor: NonNegativeFloat = 1.0
    """verl's ``overlong_buffer.penalty_factor``: the penalty of an answer of ``max_tokens`` tokens."""
    kl_coef: NonNegativeFloat | None = None
    """A KL penalty to the reference policy (the initial weights), ``kl_coef * KL`` per sampled
    token (``rlengine.trainer.losses``); 0 measures it without penalising (``kl_ref_mean`` in
    metrics.jsonl); None: neither."""
    kl_estimator: Annotated[int, Bound(ge=1, le=3, note="k1, k2, k3")] = 3
    """The KL estimator: 1, 2 or 3 (k1, k2, k3)."""
    logprobs_mode: Literal["auto", "raw", "processed"] = "auto"
    """Which logprob the sampler records (``SamplingParams.logprobs_mode``): ``processed`` (under
    the temperature, top-k and top-p actually sampled; the datums then carry that transform, so
    the trainer computes the same one and the ratio is 1 on-policy) or ``raw``. ``auto``:
    processed on the torch and vLLM backends, raw on the sim backend (which records no other)."""
    logprobs_source: Literal["sampler", "trainer"] = "sampler"
    """The behaviour logprobs the losses use: the sampler's, or (``trainer``, the zero-mismatch
    mode) the trainer's own, recomputed by a ``forward`` pass on the finished sequences before
    the step's first update, with the same datums as its ``forward_backward`` calls, so the
    first of those sees a ratio of exactly 1 (``kl_sample_train_*`` 0.0 where the trainer's
    forward is deterministic). The sampler-vs-trainer mismatch it replaced is still measured
    (``recomputed_kl_k1`` / ``recomputed_kl_k3``)."""
    tis_cap: PositiveFloat | None = None
    """Truncated importance sampling (``rlengine.trainer.losses``): each token's loss times
    ``min(w, tis_cap)``, ``w`` the trainer-over-sampler ratio from a recompute ``forward``."""
    mis_cap: PositiveFloat | None = None
    """Masked importance sampling: tokens with ``w > mis_cap`` are left out, the rest weighted by ``w``."""
    icepop_low: PositiveFloat | None = None
    """IcePop: tokens with ``w`` outside [icepop_low, icepop_high] left out, the rest weighted by ``w``."""
    icepop_high: PositiveFloat | None = None
    """IcePop's upper bound on ``w`` (set with ``icepop_low``)."""
    geo_mask_low: PositiveFloat | None = None
    """A sequence-level mask: a datum whose geometric-mean ``w`` is outside
    [geo_mask_low, geo_mask_high] is left out."""
    geo_mask_high: PositiveFloat | None = None
    """The sequence-level mask's upper bound (set with ``geo_mask_low``)."""
    learning_rate: PositiveFloat = 1e-4
    """Adam's learning rate (at the first step; see ``lr_schedule``)."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear`` decays the learning rate from ``learning_rate`` at the first step to 0 after the last."""
    beta1: Annotated[float, Bound(ge=0, lt=1)] = 0.9
    """Adam's decay of the gradient's running mean."""
    beta2: Annotated[float, Bound(ge=0, lt=1)] = 0.95
    """Adam's decay of the squared gradient's running mean."""
    eps: PositiveFloat = 1e-8
    """Adam's epsilon (added to the denominator)."""
    weight_decay: NonNegativeFloat = 0.0
    """Adam's weight decay; 0: none."""
    grad_clip_norm: NonNegativeFloat = 1.0
    """The gradient's global norm is clipped to this before each optimizer step; 0: no clipping."""
    normalize_advantages: bool = True
    """Divide group-centred advantages by the group's reward std (GRPO)."""
    skip_constant_reward: bool = True
    """Drop groups whose surviving rewards are all equal (all advantages zero).
    Off, they still carry the entropy bonus."""
    min_surviving_attempts: PositiveInt = 2
    """Groups with fewer attempts that did not fail are dropped and counted."""
    eval_every: NonNegativeInt = 10
    """Evaluate on the held-out split every N steps and after the last; 0: never."""
    eval_temperature: NonNegativeFloat = 0.0
    """Sampling temperature of the held-out evaluations (0: greedy)."""
    checkpoint_every: NonNegativeInt = 0
    """A quiescent checkpoint every K steps and after the last; 0: never."""
    keep_checkpoints: PositiveInt = 2
    """How many of the newest checkpoints are kept (older ones are deleted)."""
    drain_policy: Literal["wait", "pause"] = "wait"
    """Before a weight install, sampling in flight finishes (``wait``) or is paused (``pause``)."""
    max_failure_share: Annotated[float, Bound(gt=0, le=1)] = 0.5
    """Stop the run (``FailureBudgetExceeded``, a non-zero exit) when more than this share of the
    attempts failed, or of the groups went untrained for too few surviving attempts, over the
    last ``failure_window_steps`` steps; 1.0: never."""
    failure_window_steps: PositiveInt = 5
    """The last steps over which ``max_failure_share`` is measured."""
    episode_timeout_s: PositiveFloat = 300.0
    """Bound on one episode, all its turns; a slower attempt fails as ``timeout``."""
    call_timeout_s: PositiveFloat = 600.0
    """Bound on every wait for one engine call of the training loop."""
    shutdown_grace_s: PositiveFloat = 3.0
    """After a failure or interrupt, how long stages get to stop before they are cancelled."""
    hang_timeout_s: NonNegativeFloat | None = None
    """With work pending and no token, settlement or training call for this long, write a hang
    dump to the run directory (``hang-*.json``; the run goes on). None: max(120 s, 10x the longest
    such quiet spell seen so far); 0: only on SIGUSR1 (``docs/debugging.md``)."""
    timeline: bool = False
    """Record every request, backend job, training call, gate phase, step and environment turn, and
    write them to ``timeline.json`` in the run directory, and a resumed run's to ``timeline-<k>.json``
    beside it (Chrome trace-event JSON: Perfetto's UI opens each; ``rlengine timeline RUN_DIR`` prints
    where each step's time went, every segment's; ``docs/debugging.md``)."""
    timeline_max_events: PositiveInt = DEFAULT_MAX_EVENTS
    """The most events ``timeline.json`` holds: beyond it requests, backend jobs and environment turns
    are sampled evenly (steps, training calls and gate phases are all kept)."""
    timeline_otel: bool = False
    """With ``timeline``, also send every event kept as an OpenTelemetry span (to the tracer provider
    the process set up; needs ``opentelemetry-api``)."""
    target_reward: FiniteFloat = 0.9
    """The summary reports the first step whose mean reward reaches it."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when wandb is installed (never unasked)."""
    dump_rollouts: str | None = None
    """Write each step's training calls, their datums and the trained groups to this directory
    (``rlengine.rl.dump``: ``meta.json`` and one ``step-NNNNNN.msgpack`` per step)."""
    rollout_only: bool = False
    """Sample and dump (needs ``dump_rollouts``) without training: no forward_backward, optimizer
    step or weight install, so every step samples the initial policy."""
    train_from: str | None = None
    """Train on the steps dumped in this directory, sampling nothing: the same training calls, in
    order, with the same datums and ``AdamParams``. Settings and recipe come from its ``meta.json``."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        # Below: what a str field's type cannot say, and the rules between fields.
        if self.model is not None:
            if not isinstance(self.model, str) or not self.model.strip():
                raise ConfigurationError(f"model={self.model!r}: must be a model directory, a .gguf file or a hub id")
            if self.backend == "sim":
                raise ConfigurationError(f"model={self.model!r}: backend='sim' runs no model (use torch or vllm)")
        if self.min_surviving_attempts > self.group_size:
            raise ConfigurationError(f"min_surviving_attempts={self.min_surviving_attempts}: exceeds "
                                     f"group_size={self.group_size}")
        if self.num_substeps > 1 and self.num_minibatches > 1:
            raise ConfigurationError(f"num_substeps={self.num_substeps}: streaming minibatches "
                                     f"(num_minibatches={self.num_minibatches}) take one optimizer step per batch")
        if self.groups_per_batch % self.num_minibatches:
            raise ConfigurationError(f"num_minibatches={self.num_minibatches}: must divide "
                                     f"groups_per_batch={self.groups_per_batch}")
        set_ = [name for name in ("tis_cap", "mis_cap", "icepop_low") if getattr(self, name) is not None]
        if len(set_) > 1:
            raise ConfigurationError(f"{set_[1]}={getattr(self, set_[1])!r}: at most one of tis_cap, mis_cap and "
                                     f"IcePop ({set_[0]} is set)")
        for low, high in (("icepop_low", "icepop_high"), ("geo_mask_low", "geo_mask_high")):
            lo, hi = getattr(self, low), getattr(self, high)
            if (lo is None) != (hi is None):
                raise ConfigurationError(f"{low}={lo!r}, {high}={hi!r}: set both or neither")
            if lo is not None and not lo <= 1.0 <= hi:
                raise ConfigurationError(f"{low}={lo!r}, {high}={hi!r}: need {low} <= 1 <= {high}")
        if self.recomputes and self.num_minibatches > 1:
            raise ConfigurationError(f"num_minibatches={self.num_minibatches}: the recompute forward pass "
                                     f"(logprobs_source='trainer' or an importance-sampling correction) needs "
                                     "the whole batch; use num_substeps")
        if self.overlong_buffer_len > self.max_tokens:
            raise ConfigurationError(f"overlong_buffer_len={self.overlong_buffer_len}: exceeds max_tokens="
                                     f"{self.max_tokens} (the buffer is the last tokens before the limit)")
        if self.rollout_only and self.train_from is not None:
            raise ConfigurationError(f"rollout_only={self.rollout_only!r}: train_from={self.train_from!r} trains "
                                     "without sampling; rollout_only samples without training")
        if self.rollout_only and self.dump_rollouts is None:
            raise ConfigurationError(f"rollout_only={self.rollout_only!r}: needs dump_rollouts=DIR for what "
                                     "it samples")
        if self.train_from is not None and self.dump_rollouts is not None:
            raise ConfigurationError(f"dump_rollouts={self.dump_rollouts!r}: train_from={self.train_from!r} "
                                     "samples nothing to dump")

    @property
    def recomputes(self) -> bool:
        """Whether each step runs a ``forward`` pass before training (zero-mismatch mode or a correction)."""
        return self.logprobs_source == "trainer" or any(getattr(self, name) is not None for name in CORRECTIONS)

    @property
    def resolved_workers(self) -> int:
        return self.workers or self.groups_per_batch * (self.max_steps_off_policy + 1)

    def loss_fn_config(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.clip_low_threshold is not None:
            out["clip_low_threshold"] = self.clip_low_threshold
        if self.clip_high_threshold is not None:
            out["clip_high_threshold"] = self.clip_high_threshold
        if self.entropy_coef:
            out["entropy_coef"] = self.entropy_coef
        if self.kl_coef is not None:
            out |= {"kl_coef": self.kl_coef, "kl_estimator": self.kl_estimator}
        return out | {name: getattr(self, name) for name in CORRECTIONS if getattr(self, name) is not None}


CORRECTIONS = ("tis_cap", "mis_cap", "icepop_low", "icepop_high", "geo_mask_low", "geo_mask_high")
"""The importance-sampling corrections, named as in ``loss_fn_config`` (``rlengine.trainer.losses``)."""


RESUME_MUTABLE = frozenset({"steps", "eval_every", "checkpoint_every", "keep_checkpoints", "call_timeout_s",
                            "episode_timeout_s", "shutdown_grace_s", "hang_timeout_s", "target_reward",
                            "timeline", "timeline_max_events", "timeline_otel", "speculative_k",
                            "wandb_project", "cache_dir", "dump_rollouts", "placement", "sampler_replicas",
                            "trainer_workers"})
"""Settings a resumed run may change: they do not change what is sampled or trained (the
placement moves the same computation: a different number of trainer workers sums each
gradient in another order, a float rounding apart)."""


_FIELDS = frozenset(TrainConfig.__struct_fields__)


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` -> ``{key: value}`` (strings; typed by ``build_config``)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigurationError(f"{pair!r}: settings are key=value")
        if key in out:
            raise ConfigurationError(f"{key}={value!r}: given twice")
        out[key] = value
    return out


def convert(target: type[Any], values: dict[str, Any], what: str) -> Any:
    """``values`` (strings from the command line, or typed) as a ``target`` Struct.

    ``none``/``null`` means None; other strings are converted to each
    field's type. Errors name the key and the value.
    """
    known = set(target.__struct_fields__)
    for key, value in values.items():
        if key not in known:
            raise ConfigurationError(f"{key}={value!r}: not a setting of {what} "
                                     f"(known: {', '.join(sorted(known))})")
    decoded = {k: (None if isinstance(v, str) and v.lower() in ("none", "null") else v) for k, v in values.items()}
    try:
        return msgspec.convert(decoded, target, strict=False)
    except msgspec.ValidationError as exc:
        # The declared constraint's message: it names the key, the value and what is accepted.
        raise ConfigurationError(f"{what}: {convert_error(target, exc, decoded)}") from None
