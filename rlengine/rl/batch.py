"""One training step's batch: its groups' intake, the training calls it submits, its metrics line.

The training loop (``loop``) builds a ``StepBatch`` per step and feeds it
the rollout groups as they arrive. Every group passes one intake
(``StepBatch.intake``): the stale-group filter first
(``max_steps_off_policy``, from the per-token policy versions the engine
recorded; a stale group comes back as a retry for the dataloader to
re-issue, it is not trained), then failed attempts and
``min_surviving_attempts``, constant rewards, GRPO advantages, and the
group's datums (``overlong_filtering`` leaves out, and counts, the attempts
cut by the token limit). With ``num_minibatches > 1`` (streaming) each
minibatch goes to ``forward_backward`` as soon as it is complete; ``submit`` queues
the rest: one optimizer step, or ``num_substeps`` of them, each on a part
of the batch. Each ``forward_backward``'s datums are weighted by the
``loss_aggregation`` of that call (``advantages.aggregation_weights``) as it
is issued. Outside streaming, the datums are put in group order first:
groups arrive in the order their rollouts finish, and the training must not
depend on timing. ``train_metrics`` and ``record`` make the step's metrics
line; every group also leaves one ledger entry saying what became of it.
A multi-agent group's entry also says, per role, its trajectories, whether
it trains and its surviving rewards (``roles``); each role's mean reward
goes to the metrics line as ``reward_mean/role:<role>``.

Every training call goes through one place (``_issue``), which also
records it: ``to_dump`` turns the step into a ``dump.StepDump`` (the calls
as submitted, their datums, the trained groups), ``from_dump`` rebuilds a
step from one and ``replay`` submits its calls again. Without a training
client (``rollout_only``) the calls are recorded and not submitted.

``WorkItem`` and ``RolloutResult`` are what the pipeline's queues carry
(the dataloader's builders, the workers' groups).

This module only queues training calls: it awaits nothing, knows nothing
of the run's stages or shutdown, and must not import torch.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from rlengine.rl.advantages import (
    GroupVerdict,
    SampledDatum,
    aggregation_weights,
    assess_group,
    group_datums,
    is_stale,
    trajectory_overlong_penalty,
    weigh_datums,
)
from rlengine.rl.config import TrainConfig
from rlengine.rl.dump import FORMAT_VERSION, DumpedDatum, DumpedGroup, ForwardBackwardCall, OptimStepCall, StepDump
from rlengine.rl.metrics import reward_stats
from rlengine.rl.mismatch import mismatch_metrics, token_staleness
from rlengine.rl.types import FAILURE_KINDS, EnvGroupBuilder, TrajectoryGroup
from rlengine.types import AdamParams, Datum, TensorData

if TYPE_CHECKING:
    from rlengine.core.clients import TrainingClient

__all__ = ["GroupScore", "GroupScorer", "PreparedGroup", "RolloutResult", "StepBatch", "WorkItem"]

_FORWARD_INPUTS = ("target_tokens", "temperature", "top_k", "top_p")
"""What a recompute ``forward`` (``cross_entropy``) takes of a datum."""


class WorkItem(NamedTuple):
    index: int
    attempt: int
    builder: EnvGroupBuilder


class GroupScore(NamedTuple):
    """What a ``GroupScorer`` (a distillation teacher, ``rlengine.rl.distill``) measured on one group."""

    scorer: str
    """Who scored it (the teacher's name)."""
    kl_sum: float
    """Sum over the group's sampled tokens of ``logp_student - logp_teacher`` (reverse KL, k1)."""
    tokens: int
    """Sampled tokens scored."""
    seconds: float
    """Compute-thread time the scoring took."""
    scorer_reward: float | None = None
    """The scorer's own mean reward where measured (the teacher's evaluation)."""
    scorer_bytes: int | None = None
    """Memory the scorer holds (the teacher's parameters and KV cache)."""


class PreparedGroup(NamedTuple):
    """What a group becomes whatever the step that takes it: its verdict and its datums."""

    penalties: list[float] | None
    verdict: GroupVerdict
    datums: list[tuple[int, int, SampledDatum]]
    """(trajectory, datum of it, the datum): those of the kept trajectories."""
    score: GroupScore | None = None
    """A ``GroupScorer``'s measurements, when one rewrote the datums' advantages."""


class GroupScorer(abc.ABC):
    """Rewrites a prepared group's datums before training (per-token advantages from a teacher:
    ``rlengine.rl.distill``). A recipe whose ``attach`` yields one has every group scored by it, in
    the rollout worker that sampled the group (a group restored from a checkpoint: when the training
    loop takes it)."""

    @abc.abstractmethod
    async def score(self, index: int, group: TrajectoryGroup, prepared: PreparedGroup) -> PreparedGroup:
        """``prepared`` (of ``group``, builder index ``index``) with its datums rewritten and its ``score`` set."""


def prepare_group(cfg: TrainConfig, group: TrajectoryGroup) -> PreparedGroup:
    """The verdict (failures, survivors, advantages) and the datums of ``group``: a function of
    the group and the settings alone, so the loop computes it when the group arrives (while an
    earlier step trains), not on the next step's critical path."""
    penalties = None if not cfg.overlong_buffer_len else [
        trajectory_overlong_penalty(t, cfg.max_tokens, cfg.overlong_buffer_len, cfg.overlong_buffer_penalty_factor)
        for t in group.trajectories]
    verdict = assess_group(group, min_surviving_attempts=cfg.min_surviving_attempts,
                           skip_constant_reward=cfg.skip_constant_reward, normalize=cfg.normalize_advantages,
                           overlong_filtering=cfg.overlong_filtering, penalties=penalties)
    with_mask = cfg.entropy_coef > 0 or cfg.kl_coef is not None  # the mask weighs the bonus and the KL
    kept = [group.trajectories[i] for i in verdict.kept]
    advantages = verdict.advantages
    if cfg.loss_aggregation == "sequence":
        # The old mode, kept exactly for runs stored with it: per trajectory, not per call.
        advantages = [a / max(1, t.sampled_tokens) for a, t in zip(advantages, kept)]
    made = group_datums(kept, advantages, with_mask=with_mask)
    datums = [(i, j, d) for i, ds in zip(verdict.kept, made) for j, d in enumerate(ds)]
    return PreparedGroup(penalties, verdict, datums)


class RolloutResult(NamedTuple):
    item: WorkItem
    group: TrajectoryGroup
    seconds: float
    version_shift: int | None = None
    """Engine version -> policy version for a group sampled by an earlier process (restored from
    a checkpoint); None: this process's (``StepBatch.policy_version``)."""
    prepared: PreparedGroup | None = None
    """``prepare_group`` of it, when the loop made it on arrival."""


class StepBatch:
    """What one training step collects from its groups, and the training calls it makes of them.

    Why one class: its methods are one step's books in the order they are used (intake, the
    training calls, recompute, metrics, dump), each over the same datums and counts.
    """

    def __init__(self, cfg: TrainConfig, training: TrainingClient | None, step: int, updates: int,
                 policy_version: Callable[[int], int]) -> None:
        self.cfg = cfg
        self.training = training
        self.step = step
        self.updates = updates
        """Optimizer updates applied before this step: what a group's staleness is measured against."""
        self.policy_version = policy_version
        """The run's policy version of an engine install counter value."""
        self.consumed = 0
        self.rewards: list[float] = []
        self.overlong_penalties: list[float] = []
        """With ``overlong_buffer_len``: the penalty in each of ``rewards``, aligned with it."""
        self.counts: Counter[str] = Counter()
        self.staleness: list[int] = []
        self.tokens = 0
        self.datums: list[Datum] = []
        self.masks: list[np.ndarray] = []
        self.versions: list[np.ndarray] = []
        """Per datum (aligned with ``masks``): the policy version of each sampled target token, -1 elsewhere."""
        self.keys: list[tuple[int, int, int]] = []
        """(group index, attempt, datum) of each datum in ``datums``."""
        self.groups: list[DumpedGroup] = []
        self.calls: list[ForwardBackwardCall | OptimStepCall] = []
        """Every training call, in the order submitted."""
        self._replayed: list[ForwardBackwardCall | OptimStepCall] = []
        self.pending_datums: list[Datum] = []
        self.pending_keys: list[tuple[int, int, int]] = []
        """(group index, attempt, datum) of each pending datum: the batch's order, whatever
        order the groups arrived in."""
        self.pending_groups = 0
        self.fb: list[tuple[Any, list[int]]] = []
        """(forward_backward future, indices of its datums) per submitted forward_backward."""
        self.on_policy = 0
        """How many of ``fb`` ran before the step's first optimizer update."""
        self.ledger: list[dict[str, Any]] = []
        self.env_metrics: dict[str, list[float]] = {}
        self.tag_rewards: dict[str, list[float]] = {}
        self._parts: list[list[int]] | None = None
        self.recomputed: dict[str, float] = {}
        """The recompute pass's sampler-vs-trainer mismatch (``apply_recompute``)."""
        self.scores: list[GroupScore] = []
        """A ``GroupScorer``'s measurements of the groups taken in (``score_metrics``)."""

    def intake(self, result: RolloutResult) -> WorkItem | None:
        """One group into the step: stale filter, failures and survivors, advantages, datums.

        Returns the retry of a stale group, or (``dynamic_sampling_attempts``) of a group whose
        rewards are all equal: the dataloader re-issues it; None for any other."""
        cfg = self.cfg
        item, group = result.item, result.group
        spans = group.versions()
        # Policy versions are engine versions shifted by a constant (the sampling process's).
        shift = self.policy_version(0) if result.version_shift is None else result.version_shift
        oldest = None if spans is None else spans[0] + shift
        self.tokens += sum(t.sampled_tokens for t in group.trajectories)
        entry: dict[str, Any] = {"step": self.step, "group": item.index, "attempt": item.attempt,
                                 "versions": None if spans is None else [oldest, spans[1] + shift]}
        if is_stale(oldest, self.updates, cfg.max_steps_off_policy):
            self.counts["groups_resampled_stale"] += 1
            self.ledger.append({**entry, "disposition": "resampled_stale"})
            return WorkItem(item.index, item.attempt + 1, item.builder)
        penalties, verdict, datums, score = result.prepared or prepare_group(cfg, group)
        if (item.attempt < cfg.dynamic_sampling_attempts and verdict.dropped != "too_few_survivors"
                and verdict.rewards and max(verdict.rewards) == min(verdict.rewards)):
            # Dynamic sampling: the same task again with new seeds, in place of a group that teaches nothing.
            self.counts["groups_resampled_constant"] += 1
            self.ledger.append({**entry, "rewards": verdict.rewards, "disposition": "resampled_constant"})
            return WorkItem(item.index, item.attempt + 1, item.builder)
        self.consumed += 1
        self.rewards += verdict.rewards
        if penalties is not None:
            entry["overlong_penalties"] = [p for p, t in zip(penalties, group.trajectories) if not t.failed]
            self.overlong_penalties += entry["overlong_penalties"]
        self.counts["attempts_failed"] += verdict.failed
        self.counts["attempts_overlong_filtered"] += len(verdict.filtered)
        for tag in group.tags:
            self.tag_rewards.setdefault(tag, []).extend(verdict.rewards)
        roles = _roles_record(group)
        for role, record in roles.items():
            self.tag_rewards.setdefault(f"role:{role}", []).extend(record["rewards"])
        for t in group.trajectories:
            if not t.failed:
                for tr in t.transitions:
                    for key, value in tr.metrics.items():
                        self.env_metrics.setdefault(key, []).append(float(value))
        failures = [{"attempt": i, **_failure_record(t.failure), "metadata": t.metadata}
                    for i, t in enumerate(group.trajectories) if t.failure is not None]
        self.counts.update(f"attempts_failed_{f['kind']}" for f in failures)
        entry |= {"rewards": verdict.rewards, "tags": group.tags, "metadata": group.metadata}
        if score is not None:
            entry["scorer"] = score.scorer
            self.scores.append(score)
        if failures:
            entry["failures"] = failures
        if roles:
            entry["roles"] = roles
        if verdict.filtered:
            entry["overlong_filtered"] = verdict.filtered
        if verdict.dropped is not None:
            self.counts[f"groups_dropped_{verdict.dropped}"] += 1
            self.ledger.append({**entry, "disposition": f"dropped_{verdict.dropped}"})
            return None
        self.ledger.append({**entry, "disposition": "trained"})
        self.counts["groups_trained"] += 1
        if oldest is not None:
            self.staleness.append(self.updates - oldest)
        self.groups.append(DumpedGroup(group=item.index, attempt=item.attempt, rewards=verdict.rewards,
                                       trajectories=verdict.kept, advantages=verdict.advantages,
                                       roles=[group.trajectories[i].role or "" for i in verdict.kept]
                                       if roles else []))
        if datums:
            # Engine versions -> policy versions for the group's datums at once (-1 stays: not sampled).
            engine = np.concatenate([d.versions for _, _, d in datums])
            policy = np.where(engine >= 0, engine + shift, -1)
            at = 0
            for i, j, (datum, mask, versions) in datums:
                self.pending_datums.append(datum)
                self.pending_keys.append((item.index, i, j))
                self.masks.append(mask)
                self.versions.append(policy[at:at + versions.shape[0]])
                at += versions.shape[0]
        self.pending_groups += 1
        if cfg.num_minibatches > 1 and self.pending_groups >= cfg.groups_per_batch // cfg.num_minibatches:
            self._submit_minibatch()
        return None

    def _in_group_order(self) -> None:
        """Put the pending datums (and their masks) in group order: the groups arrive in
        whatever order their rollouts finish, and the training must not depend on it."""
        keys = self.pending_keys
        order = sorted(range(len(keys)), key=keys.__getitem__)
        first = len(self.masks) - len(keys)
        self.pending_datums = [self.pending_datums[i] for i in order]
        self.masks[first:] = [self.masks[first + i] for i in order]
        self.versions[first:] = [self.versions[first + i] for i in order]
        self.pending_keys = [keys[i] for i in order]

    def _issue(self, call: ForwardBackwardCall | OptimStepCall) -> Any:
        """Submit one training call (or, without a training client, only record it); returns its future."""
        self.calls.append(call)
        if isinstance(call, OptimStepCall):
            if len(self.calls) == len(self.fb) + 1:
                # The step's first update: the forward passes before it ran on the weights that sampled.
                self.on_policy = len(self.fb)
            return None if self.training is None else self.training.optim_step(call.adam)
        future = None if self.training is None else self.training.forward_backward(
            [self.datums[i] for i in call.datums], call.loss_fn, call.loss_fn_config)
        self.fb.append((future, call.datums))
        return future

    def _forward_backward(self, idx: list[int]) -> None:
        """One ``forward_backward`` over the datums ``idx``, weighted first by the call's
        ``loss_aggregation`` (``advantages.aggregation_weights``): only now are a call's datums known.
        The weighted datums replace the batch's, so a dump holds what the call received and a
        replay weighs nothing twice."""
        weights = aggregation_weights([self.masks[i] for i in idx], self.cfg.loss_aggregation, self.cfg.max_tokens)
        if weights is not None:
            for i, datum in zip(idx, weigh_datums([self.datums[i] for i in idx], weights)):
                self.datums[i] = datum
        self._issue(ForwardBackwardCall(datums=idx, loss_fn=self.cfg.loss_fn, loss_fn_config=self.cfg.loss_fn_config()))

    def _submit_minibatch(self) -> None:
        if self.pending_datums:
            first = len(self.datums)
            self.datums += self.pending_datums
            self.keys += self.pending_keys
            self._forward_backward(list(range(first, len(self.datums))))
        self.pending_datums, self.pending_keys, self.pending_groups = [], [], 0

    def plan(self) -> list[list[int]]:
        """Fix the step's datums and how they split into ``forward_backward`` calls (not
        streaming): in group order, then one call over all of them, or with ``num_substeps``
        K > 1 the datums shuffled (seeded by the step) into K parts. Returns the parts."""
        if self._parts is None:
            cfg = self.cfg
            self._in_group_order()
            self.datums, self.keys = self.datums + self.pending_datums, self.keys + self.pending_keys
            self.pending_datums, self.pending_keys, self.pending_groups = [], [], 0
            if cfg.num_substeps == 1:
                self._parts = [list(range(len(self.datums)))] if self.datums else []
            else:
                order = np.random.default_rng([cfg.seed, self.step]).permutation(len(self.datums))
                self._parts = [order[k::cfg.num_substeps].tolist()
                               for k in range(min(cfg.num_substeps, len(self.datums)))]
        return self._parts

    def recompute_calls(self) -> list[tuple[list[Datum], list[int]]]:
        """The ``forward`` calls of the recompute pass (``TrainConfig.recomputes``): per planned
        part, its datums reduced to what a ``cross_entropy`` forward takes (targets and sampling
        transform), so the trainer computes each target's logprob exactly as its
        ``forward_backward`` of the same part will."""
        calls = []
        for idx in self.plan():
            data = [Datum(model_input=self.datums[i].model_input,
                          loss_fn_inputs={k: v for k, v in self.datums[i].loss_fn_inputs.items()
                                          if k in _FORWARD_INPUTS}) for i in idx]
            calls.append((data, idx))
        return calls

    def apply_recompute(self, outputs: list[tuple[Any, list[int]]]) -> None:
        """The recompute pass's logprobs into the datums: as ``old_logprobs`` (the proximal policy
        of the corrections) and, with ``logprobs_source="trainer"``, as ``logprobs`` too; the
        sampler-vs-trainer mismatch they replace goes to ``recomputed_*``."""
        pairs = []
        for out, idx in outputs:
            for record, i in zip(out.loss_fn_outputs, idx):
                mask = self.masks[i] > 0
                datum = self.datums[i]
                trainer = np.where(mask, record["logprobs"].to_numpy(), 0.0).astype(np.float32)
                pairs.append((datum.loss_fn_inputs["logprobs"].to_numpy()[mask], trainer[mask]))
                inputs = dict(datum.loss_fn_inputs)
                inputs["old_logprobs"] = TensorData.from_numpy(trainer)
                if self.cfg.logprobs_source == "trainer":
                    inputs["logprobs"] = TensorData.from_numpy(trainer)
                self.datums[i] = Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
        measured = mismatch_metrics(pairs)
        self.recomputed = {f"recomputed_{key.removeprefix('kl_sample_train_')}": value
                           for key, value in measured.items()
                           if key in ("kl_sample_train_v1", "kl_sample_train_k3", "ratio_min", "ratio_max")}

    def submit(self, adam: AdamParams) -> list[Any]:
        """Queue the step's training calls; returns the optimizer steps' futures.

        One optimizer step over the batch (its minibatches already streamed),
        or with ``num_substeps`` K > 1 one per planned part (``plan``), each a
        forward_backward and an optimizer step: later parts see weights already
        updated, which is where PPO's clipping acts.
        """
        if self.cfg.num_minibatches > 1:
            self._submit_minibatch()
            return [self._issue(OptimStepCall(adam=adam))] if self.fb else []
        optims = []
        for idx in self.plan():
            self._forward_backward(idx)
            if self.cfg.num_substeps > 1:
                optims.append(self._issue(OptimStepCall(adam=adam)))
        if self.cfg.num_substeps == 1 and self.fb:
            optims.append(self._issue(OptimStepCall(adam=adam)))
        return optims

    def to_dump(self, learning_rate: float) -> StepDump:
        """The step as ``dump_rollouts`` writes it: its calls as submitted, their datums, its groups."""
        datums = [DumpedDatum(group=g, trajectory=t, segment=j, datum=d, mask=TensorData.from_numpy(m),
                              versions=TensorData.from_numpy(v))
                  for (g, t, j), d, m, v in zip(self.keys, self.datums, self.masks, self.versions)]
        return StepDump(format=FORMAT_VERSION, step=self.step, updates=self.updates, learning_rate=learning_rate,
                        calls=list(self.calls), datums=datums, groups=sorted(self.groups, key=lambda g: g.group),
                        rewards=list(self.rewards), overlong_penalties=list(self.overlong_penalties),
                        counts=dict(self.counts), staleness=list(self.staleness),
                        tokens_sampled=self.tokens, env_metrics=self.env_metrics, tag_rewards=self.tag_rewards)

    @classmethod
    def from_dump(cls, cfg: TrainConfig, training: TrainingClient, dump: StepDump) -> StepBatch:
        """A step rebuilt from its dump, ready to ``replay``: its datums, and the rollout figures of its metrics."""
        # Versions were converted when the step was dumped; a replayed step takes in no group.
        batch = cls(cfg, training, dump.step, dump.updates, policy_version=int)
        batch.rewards, batch.counts, batch.staleness = list(dump.rewards), Counter(dump.counts), list(dump.staleness)
        batch.overlong_penalties = list(dump.overlong_penalties)
        batch.tokens, batch.env_metrics, batch.tag_rewards = dump.tokens_sampled, dump.env_metrics, dump.tag_rewards
        batch.consumed = sum(v for k, v in dump.counts.items()
                             if k.startswith("groups_") and not k.startswith("groups_resampled_"))
        batch.datums = [d.datum for d in dump.datums]
        batch.masks = [d.mask.to_numpy() for d in dump.datums]
        batch.versions = [d.versions.to_numpy() for d in dump.datums]
        batch.keys = [(d.group, d.trajectory, d.segment) for d in dump.datums]
        batch.groups = list(dump.groups)
        batch.ledger = [{"step": dump.step, "group": g.group, "attempt": g.attempt, "rewards": g.rewards,
                         "disposition": "trained"} for g in dump.groups]
        batch._replayed = list(dump.calls)
        batch._parts = [call.datums for call in dump.calls if isinstance(call, ForwardBackwardCall)]
        return batch

    def unrecomputed(self) -> bool:
        """Whether the datums lack the recompute pass's ``old_logprobs`` (a ``rollout_only`` dump)."""
        return any("old_logprobs" not in d.loss_fn_inputs for d in self.datums)

    def replay(self) -> list[Any]:
        """Submit a dumped step's calls again, in order; returns the optimizer steps' futures."""
        optims = []
        for call in self._replayed:
            future = self._issue(call)
            if isinstance(call, OptimStepCall):
                optims.append(future)
        return optims

    def train_metrics(self, outputs: list[tuple[Any, list[int]]], optim_outs: list[Any]) -> dict[str, float]:
        """Loss, entropy, grad norm, and the sampler-vs-trainer mismatch over sampled tokens
        (``rlengine.rl.mismatch``: KL k1 / k2 / k3, log-perplexity difference, importance ratios,
        per-token staleness).

        ``loss_sum`` is the calls' losses as the trainer computed them, summed over the calls:
        aggregated by ``loss_aggregation``, since the calls' datums carry its weights.
        ``entropy_mean`` and ``kl_ref_mean`` are means under the same weights (their sums over
        the ``mask`` inputs sent): the plain mean over tokens with ``sum``; with the other modes
        the mean the objective takes, per call, averaged over the calls. ``grad_norm`` is the
        mean over the step's optimizer steps of the gradient norm before clipping, and
        ``grad_clipped_frac`` the share of them whose norm exceeded ``grad_clip_norm``.

        The mismatch is taken over the forward passes that ran before this
        step's first optimizer update (all of them without substeps): there,
        any difference between the two logprobs is sampler/trainer mismatch,
        not learning."""
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        loss = entropy = kl_ref = weight = 0.0
        tokens = 0
        corrected: Counter[str] = Counter()
        for n, (out, idx) in enumerate(outputs):
            loss += out.metrics.get("loss:sum", 0.0)
            entropy += out.metrics.get("entropy:sum", 0.0)
            kl_ref += out.metrics.get("kl_ref:sum", 0.0)
            corrected.update({key: out.metrics.get(f"{key}:sum", 0.0)
                              for key in ("is_tokens", "is_truncated", "is_masked")})
            for record, i in zip(out.loss_fn_outputs, idx):
                mask = self.masks[i] > 0
                tokens += int(mask.sum())
                sent = self.datums[i].loss_fn_inputs.get("mask")
                weight += float(mask.sum()) if sent is None else float(sent.to_numpy().sum())
                if n < self.on_policy:
                    pairs.append((self.datums[i].loss_fn_inputs["logprobs"].to_numpy()[mask],
                                  record["logprobs"].to_numpy()[mask]))
        out: dict[str, float] = {"loss_sum": loss, "sampled_tokens_trained": tokens, **mismatch_metrics(pairs),
                                 **token_staleness(self.versions, self.updates)}
        if self.cfg.entropy_coef and weight:
            out["entropy_mean"] = entropy / weight
        if self.cfg.kl_coef is not None and weight:
            out["kl_ref_mean"] = kl_ref / weight  # the estimator's mean over the step's trained tokens
        if corrected["is_tokens"]:
            out["is_truncated_frac"] = corrected["is_truncated"] / corrected["is_tokens"]
            out["is_masked_frac"] = corrected["is_masked"] / corrected["is_tokens"]
        out |= self.recomputed
        norms = [float(m["grad_norm"]) for m in (getattr(o, "metrics", None) or {} for o in optim_outs)
                 if "grad_norm" in m]
        if norms:
            out["grad_norm"] = float(np.mean(norms))
            clip = self.cfg.grad_clip_norm
            out["grad_clipped_frac"] = float(np.mean([norm > clip for norm in norms])) if clip > 0 else 0.0
        return out

    def record(self, version: int, train_metrics: dict[str, float], *, wall: float, train_time_s: float,
               sampler_idle_frac: float | None, time_s: float, trainer_busy_frac: float | None = None) -> dict[str, Any]:
        """The step's metrics line; ``wall`` is the step's time, since the previous step ended;
        ``trainer_busy_frac`` the share of it the engine's training lane ran (None without one)."""
        record: dict[str, Any] = {
            "step": self.step, "version": version, **reward_stats(self.rewards),
            "groups_trained": self.counts["groups_trained"],
            "groups_dropped_constant_reward": self.counts["groups_dropped_constant_reward"],
            "groups_dropped_too_few_survivors": self.counts["groups_dropped_too_few_survivors"],
            "groups_dropped_overlong": self.counts["groups_dropped_overlong"],
            "groups_resampled_stale": self.counts["groups_resampled_stale"],
            "groups_resampled_constant": self.counts["groups_resampled_constant"],
            "attempts_failed": self.counts["attempts_failed"],
            "attempts_overlong_filtered": self.counts["attempts_overlong_filtered"],
            **{f"attempts_failed_{kind}": self.counts[f"attempts_failed_{kind}"] for kind in FAILURE_KINDS},
            "datums": len(self.datums),
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else float("nan"),
            "staleness_max": max(self.staleness) if self.staleness else None,
            **train_metrics, "tokens_sampled": self.tokens, "tokens_per_s": self.tokens / wall if wall else 0.0,
            "step_time_s": wall, "train_time_s": train_time_s, "sampler_idle_frac": sampler_idle_frac,
            "trainer_busy_frac": trainer_busy_frac, "time_s": time_s,
        }
        if self.cfg.overlong_buffer_len:
            # The rewards above include it: reward_mean - overlong_penalty_mean is the mean before shaping.
            record["overlong_penalty_mean"] = (float(np.mean(self.overlong_penalties)) if self.overlong_penalties
                                               else float("nan"))
        record |= self.score_metrics(wall)
        record |= {f"env/{k}": float(np.mean(v)) for k, v in sorted(self.env_metrics.items())}
        record |= {f"reward_mean/{k}": float(np.mean(v)) for k, v in sorted(self.tag_rewards.items())}
        return record

    def score_metrics(self, wall: float) -> dict[str, float]:
        """The ``GroupScorer``'s columns (none without one): ``teacher_kl_mean``, the mean per-token
        reverse KL to the teachers over the step's sampled tokens (per teacher too, with several);
        ``teacher_score_s`` and its share of the step (``teacher_score_frac``); the teachers' own
        reward where measured (``teacher_reward_mean``, over the step's groups) and their memory."""
        if not self.scores:
            return {}
        tokens = sum(s.tokens for s in self.scores)
        seconds = sum(s.seconds for s in self.scores)
        out = {"teacher_kl_mean": sum(s.kl_sum for s in self.scores) / tokens if tokens else float("nan"),
               "teacher_tokens": tokens, "teacher_score_s": seconds,
               "teacher_score_frac": seconds / wall if wall else 0.0}
        names = sorted({s.scorer for s in self.scores})
        if len(names) > 1:
            for name in names:
                own = [s for s in self.scores if s.scorer == name]
                n = sum(s.tokens for s in own)
                out[f"teacher_kl_mean/{name}"] = sum(s.kl_sum for s in own) / n if n else float("nan")
                out[f"groups_scored/{name}"] = len(own)
        rewards = [s.scorer_reward for s in self.scores if s.scorer_reward is not None]
        if rewards:
            out["teacher_reward_mean"] = float(np.mean(rewards))
        held = [s.scorer_bytes for s in self.scores if s.scorer_bytes is not None]
        if held:
            out["teacher_bytes"] = max(held)
        return out


def _roles_record(group: TrajectoryGroup) -> dict[str, dict[str, Any]]:
    """Per role of a multi-agent group (none for a single-agent one): its trajectories, whether it
    trains, and the total rewards of its surviving ones: each role's traces, apart, for the ledger."""
    totals = group.total_rewards()
    return {str(role): {"trajectories": indices, "trainable": group.trajectories[indices[0]].trainable,
                        "rewards": [totals[i] for i in indices if not group.trajectories[i].failed]}
            for role, indices in group.by_role().items() if role is not None}


def _failure_record(failure: Any) -> dict[str, Any]:
    return {"stage": failure.stage, "kind": failure.kind, "error": failure.error, "message": failure.message,
            "turn": failure.turn}
