"""From trajectory groups to training data: filtering, GRPO advantages, Tinker datums.

* ``assess_group`` decides what happens to a group: failed attempts are
  filtered out; with fewer than ``min_surviving_attempts`` survivors the
  group is dropped (``too_few_survivors``); with every surviving reward equal
  it is dropped (``constant_reward``) when so configured, since its
  advantages are all zero; otherwise each survivor gets the group-centred
  advantage ``r - mean(r)``, divided by ``std(r) + eps`` when normalising
  (GRPO; population std over the survivors). With ``overlong_filtering``
  (DAPO) a survivor whose last action was cut by the token limit keeps its
  reward in those statistics but is not kept for training; a group left with
  nothing to train is dropped (``overlong``).

  A multi-agent group (trajectories with roles, ``types.MultiAgentEnv``) is
  assessed role by role: each trainable role's trajectories are a group of
  their own for all of the above (its baseline is its own attempts'
  rewards), the verdicts joined; an untrainable role's trajectories are
  never kept, and its rewards are not among the verdict's. The group is
  dropped only when every trainable role is (for the first role's reason;
  with no trainable role, ``too_few_survivors``).
* ``overlong_penalty`` is DAPO's soft overlong punishment of one answer,
  ``trajectory_overlong_penalty`` that of a trajectory (its longest
  action's); ``assess_group`` adds it to each reward before anything else.
* ``trajectory_datums`` turns one trajectory into ``Datum``s for the
  ``importance_sampling`` / ``ppo`` / ``cispo`` losses: input tokens, next-token
  targets, the sampler's logprobs, the advantage on every sampled token
  (zero on observation tokens) and, with an entropy bonus, a ``mask`` of
  sampled tokens (the bonus's weights), and, where an action's logprobs are
  processed, the ``temperature`` / ``top_k`` / ``top_p`` each of its tokens
  was sampled under (so the trainer computes the same transform); beside each datum, its mask and the
  engine policy version of each sampled target token. Consecutive turns whose observation extends the previous
  context token for token share one datum; a turn that does not (the
  environment rewrote the context) starts a new one.
* ``group_datums`` is ``trajectory_datums`` over the kept trajectories of one
  group. Its single-turn trajectories (one transition each: a GRPO group of
  plain answers) are done at once: their tokens joined into one array, the
  flags, logprobs, versions and transforms laid out over it, advantages
  broadcast, the token check made once for the group, and each datum's
  tensors cut from one buffer per input. The datums are the same, byte for
  byte, as ``trajectory_datums`` makes (``tests/rl/test_rl_group_datums.py``);
  anything else (several turns, an action whose logprobs or versions do not
  match its tokens, a negative token id, whose error the per-trajectory path
  raises) takes ``trajectory_datums``.
* ``aggregation_weights`` is how one ``forward_backward`` call aggregates the
  loss over its tokens (``TrainConfig.loss_aggregation``): a factor per
  datum, known once the call's datums are (each substep, each streamed
  minibatch is its own call), and ``weigh_datum`` puts it on the datum's
  ``advantages`` and ``mask``. The losses sum over tokens (Tinker) and the
  ratio losses (importance_sampling, ppo, cispo) are positively homogeneous
  in the advantages, while the ``mask`` weighs the entropy bonus and the
  reference KL token by token: scaling both scales every term of a token's
  objective alike, so the peers' means come out of unchanged trainers.
  ``weigh_datums`` does it for a call's datums at once.
* ``add_token_advantages`` is the per-token path: a datum's advantages
  scaled and a per-token term added (on-policy distillation's reverse KL to
  a teacher, ``rlengine.rl.distill``), over a group's datums at once. The
  scalar path above is untouched by it: the per-token term is added to the
  datums it made. ``token_baseline`` centres such a term within a group
  (leave-one-out mean at the same sampled-token index).
* ``is_stale`` is the staleness rule of ``max_steps_off_policy``.

Pure functions over values; nothing here waits, samples or trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from rlengine.errors import ConfigurationError
from rlengine.rl.types import Trajectory, TrajectoryGroup, Transition
from rlengine.types import Datum, LogprobTransform, ModelInput, SampledSequence, TensorData

__all__ = ["GroupVerdict", "SampledDatum", "add_token_advantages", "aggregation_weights", "assess_group", "group_advantages", "group_datums",
           "is_stale", "overlong_penalty", "token_baseline", "trajectory_datums", "trajectory_overlong_penalty",
           "weigh_datum", "weigh_datums"]


class GroupVerdict(NamedTuple):
    """What happens to a group: ``kept`` trajectory indices and their advantages, or why it is dropped."""

    kept: list[int]
    advantages: list[float]
    rewards: list[float]
    """Total reward of every surviving attempt, its overlong penalty included (also for dropped
    groups: they are real samples)."""
    dropped: str | None
    """None, ``too_few_survivors``, ``constant_reward`` or ``overlong``."""
    failed: int
    """Attempts filtered out as failed."""
    filtered: list[int]
    """Survivors left out of the training as truncated (``overlong_filtering``); their rewards
    are in ``rewards`` and in the advantages' statistics."""


def group_advantages(rewards: np.ndarray, normalize: bool, eps: float = 1e-6) -> np.ndarray:
    """Group-centred advantages: ``r - mean(r)``, over ``std(r) + eps`` when ``normalize``."""
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    if normalize:
        centred = centred / (r.std() + eps)
    return centred


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment of an answer of ``length`` tokens: 0 up to
    ``max_tokens - buffer_len`` tokens, then ``factor * ((max_tokens - buffer_len) - length) / buffer_len``,
    down to ``-factor`` at ``max_tokens`` and beyond; 0 without a buffer."""
    if buffer_len <= 0:
        return 0.0
    return factor * max(-1.0, min(0.0, ((max_tokens - buffer_len) - length) / buffer_len))


def trajectory_overlong_penalty(trajectory: Trajectory, max_tokens: int, buffer_len: int, factor: float) -> float:
    """The penalty of a trajectory: that of its longest action (``max_tokens`` caps each action)."""
    longest = max((t.action.length for t in trajectory.transitions), default=0)
    return overlong_penalty(longest, max_tokens, buffer_len, factor)


def assess_group(group: TrajectoryGroup, *, min_surviving_attempts: int, skip_constant_reward: bool,
                 normalize: bool, overlong_filtering: bool = False,
                 penalties: Sequence[float] | None = None) -> GroupVerdict:
    """What becomes of ``group`` (see the module docstring); ``penalties``, one per trajectory,
    are added to the rewards first."""
    if any(t.role is not None or not t.trainable for t in group.trajectories):
        return _assess_roles(group, min_surviving_attempts=min_surviving_attempts,
                             skip_constant_reward=skip_constant_reward, normalize=normalize,
                             overlong_filtering=overlong_filtering, penalties=penalties)
    totals = group.total_rewards()
    if penalties is not None:
        totals = [r + p for r, p in zip(totals, penalties, strict=True)]
    survivors = [i for i, t in enumerate(group.trajectories) if not t.failed]
    rewards = [totals[i] for i in survivors]
    failed = len(group.trajectories) - len(survivors)
    if len(survivors) < min_surviving_attempts or not survivors:
        return GroupVerdict([], [], rewards, "too_few_survivors", failed, [])
    if skip_constant_reward and max(rewards) == min(rewards):
        return GroupVerdict([], [], rewards, "constant_reward", failed, [])
    advantages = group_advantages(np.array(rewards), normalize)
    # Overlong filtering masks the loss of a truncated answer, not its place in the baseline:
    # its reward says what a cut answer earns, its tokens would be trained on a reward the cut decided.
    filtered = [i for i in survivors if overlong_filtering and group.trajectories[i].truncated]
    kept = [(i, float(a)) for i, a in zip(survivors, advantages) if i not in filtered]
    if not kept:
        return GroupVerdict([], [], rewards, "overlong", failed, filtered)
    return GroupVerdict([i for i, _ in kept], [a for _, a in kept], rewards, None, failed, filtered)


def _assess_roles(group: TrajectoryGroup, *, min_surviving_attempts: int, skip_constant_reward: bool,
                  normalize: bool, overlong_filtering: bool, penalties: Sequence[float] | None) -> GroupVerdict:
    """``assess_group`` of a multi-agent group: each trainable role assessed alone, the verdicts
    joined (indices back into ``group``); see the module docstring."""
    kept: list[tuple[int, float]] = []
    rewards: list[float] = []
    filtered: list[int] = []
    failed = 0
    dropped: list[str] = []
    for indices in group.by_role().values():
        if not group.trajectories[indices[0]].trainable:
            continue
        # The role's attempts as a single-agent group: the same rules, its own baseline.
        alone = TrajectoryGroup(trajectories=[msgspec.structs.replace(group.trajectories[i], role=None)
                                              for i in indices],
                                group_rewards=[group.group_rewards[i] for i in indices])
        verdict = assess_group(alone, min_surviving_attempts=min_surviving_attempts,
                               skip_constant_reward=skip_constant_reward, normalize=normalize,
                               overlong_filtering=overlong_filtering,
                               penalties=None if penalties is None else [penalties[i] for i in indices])
        kept += [(indices[k], a) for k, a in zip(verdict.kept, verdict.advantages)]
        rewards += verdict.rewards
        filtered += [indices[k] for k in verdict.filtered]
        failed += verdict.failed
        if verdict.dropped is not None:
            dropped.append(verdict.dropped)
    if not kept:
        return GroupVerdict([], [], rewards, dropped[0] if dropped else "too_few_survivors", failed, sorted(filtered))
    kept.sort()
    return GroupVerdict([i for i, _ in kept], [a for _, a in kept], rewards, None, failed, sorted(filtered))


def is_stale(oldest_version: int | None, current_version: int, max_steps_off_policy: int) -> bool:
    """A group is stale when its oldest token was sampled more than ``max_steps_off_policy``
    policy versions before the weights about to be trained. Versions here are
    policy versions of the run (updates applied), not the engine's install counter."""
    return oldest_version is not None and current_version - oldest_version > max_steps_off_policy


class SampledDatum(NamedTuple):
    """One datum of a trajectory, with its mask of sampled target tokens and the engine
    policy version that sampled each of them (-1 on every other position)."""

    datum: Datum
    mask: np.ndarray
    versions: np.ndarray


class _Segment:
    """One datum under construction: tokens, and per token whether it was sampled (and by which version)."""

    __slots__ = ("logprobs", "sampled", "tokens", "transforms", "versions")

    def __init__(self, prompt: np.ndarray) -> None:
        self.tokens = [prompt]
        self.sampled = [np.zeros(prompt.shape[0], dtype=bool)]
        self.logprobs = [np.zeros(prompt.shape[0], dtype=np.float32)]
        self.versions = [np.full(prompt.shape[0], -1, dtype=np.int64)]
        self.transforms: list[LogprobTransform | None] = [None]

    def extend(self, tokens: np.ndarray, sampled: bool, logprobs: np.ndarray | None = None,
               versions: np.ndarray | None = None, transform: LogprobTransform | None = None) -> None:
        self.tokens.append(tokens)
        self.sampled.append(np.full(tokens.shape[0], sampled))
        self.logprobs.append(logprobs if logprobs is not None else np.zeros(tokens.shape[0], dtype=np.float32))
        self.versions.append(versions.astype(np.int64) if versions is not None
                             else np.full(tokens.shape[0], -1, dtype=np.int64))
        self.transforms.append(transform)

    def transform_inputs(self) -> dict[str, np.ndarray]:
        """``temperature`` / ``top_k`` / ``top_p`` per token (next-token aligned) when some action's
        logprobs are processed (``SampledSequence.logprobs_transform``); empty when all are raw."""
        if all(t is None for t in self.transforms):
            return {}
        columns: dict[str, list[np.ndarray]] = {"temperature": [], "top_k": [], "top_p": []}
        for tokens, t in zip(self.tokens, self.transforms):
            n = tokens.shape[0]
            columns["temperature"].append(np.full(n, 1.0 if t is None else t.temperature, np.float32))
            columns["top_k"].append(np.full(n, 0.0 if t is None or t.top_k == -1 else t.top_k, np.float32))
            columns["top_p"].append(np.full(n, 1.0 if t is None else t.top_p, np.float32))
        return {key: np.concatenate(parts)[1:] for key, parts in columns.items()}

    def context(self) -> np.ndarray:
        return np.concatenate(self.tokens)

    def datum(self, advantage: float, with_mask: bool) -> SampledDatum | None:
        tokens = np.concatenate(self.tokens).astype(np.int64)
        if tokens.shape[0] < 2:
            return None
        # Position i predicts token i + 1: drop the first token's flags, the last input.
        sampled = np.concatenate(self.sampled)[1:]
        logprobs = np.concatenate(self.logprobs)[1:]
        mask = sampled.astype(np.float32)
        inputs = {"target_tokens": tokens[1:], "logprobs": np.where(sampled, logprobs, 0.0).astype(np.float32),
                  "advantages": (mask * advantage).astype(np.float32)}
        if with_mask:
            inputs["mask"] = mask
        inputs |= self.transform_inputs()
        return SampledDatum(Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs), mask,
                            np.concatenate(self.versions)[1:])


def trajectory_datums(trajectory: Trajectory, advantage: float, *, with_mask: bool) -> list[SampledDatum]:
    """The datums of one trajectory, each with its mask of sampled target tokens and their
    versions; see the module docstring. ``with_mask`` also puts the mask into the datum (the
    ``mask`` input, which the trainer accepts only with an entropy bonus)."""
    segments: list[_Segment] = []
    current: _Segment | None = None
    for t in trajectory.transitions:
        prompt = t.observation.prompt.to_numpy()
        if current is not None:
            context = current.context()
            n = context.shape[0]
            if prompt.shape[0] >= n and np.array_equal(prompt[:n], context):
                current.extend(prompt[n:], sampled=False)
            else:
                current = None
        if current is None:
            current = _Segment(prompt)
            segments.append(current)
        current.extend(t.action.tokens_array(), sampled=True, logprobs=t.action.logprobs_array(),
                       versions=t.action.versions_array(), transform=t.action.logprobs_transform)
    out = []
    for segment in segments:
        datum = segment.datum(advantage, with_mask)
        if datum is not None:
            out.append(datum)
    return out


def group_datums(trajectories: Sequence[Trajectory], advantages: Sequence[float], *,
                 with_mask: bool) -> list[list[SampledDatum]]:
    """``trajectory_datums(trajectories[k], advantages[k])`` for every ``k``, the single-turn
    trajectories all at once (module docstring): the same datums, masks and versions, byte for byte."""
    out: list[list[SampledDatum]] = [[] for _ in trajectories]
    single: list[int] = []
    for k, trajectory in enumerate(trajectories):
        if len(trajectory.transitions) == 1 and _regular(trajectory.transitions[0].action):
            single.append(k)
        else:
            out[k] = trajectory_datums(trajectory, advantages[k], with_mask=with_mask)
    if single:
        joined = _single_turn_datums([trajectories[k].transitions[0] for k in single],
                                     [advantages[k] for k in single], with_mask)
        for k, datums in zip(single, joined):
            out[k] = datums
    return out


def _regular(action: SampledSequence) -> bool:
    """Its logprobs and versions are one per token (the engine's always are)."""
    n = len(action.tokens_raw)
    return len(action.logprobs_raw) == n and len(action.versions_raw) == n


def _single_turn_datums(transitions: list[Transition], advantages: Sequence[float],
                        with_mask: bool) -> list[list[SampledDatum]]:
    """The datum of each single-turn trajectory (``transitions``: its one turn), computed over the
    group's tokens joined: what ``_Segment.datum`` computes sequence by sequence."""
    prompts = [t.observation.prompt.tokens_raw for t in transitions]
    actions = [t.action for t in transitions]
    # A sequence of fewer than 2 tokens has no target: it makes no datum.
    counts = [(len(p) + len(a.tokens_raw)) // 4 for p, a in zip(prompts, actions)]
    made = [i for i, n in enumerate(counts) if n >= 2]
    if not made:
        return [[] for _ in transitions]
    tokens = np.frombuffer(b"".join(raw for i in made for raw in (prompts[i], actions[i].tokens_raw)), np.int32)
    if int(tokens.min()) < 0:
        # ``ModelInput.from_ints`` refuses it: the per-trajectory path raises that error.
        return [trajectory_datums(_one_turn(t), a, with_mask=with_mask) for t, a in zip(transitions, advantages)]
    n = np.array([counts[i] for i in made])
    p = np.array([len(prompts[i]) // 4 for i in made])
    starts = np.zeros(len(made), dtype=np.int64)
    np.cumsum(n[:-1], out=starts[1:])
    # Per token of the joined sequences: sampled (an action's) or not, and the action's columns.
    sampled = np.ones(tokens.shape[0], dtype=bool)
    for start, length in zip(starts.tolist(), p.tolist()):
        sampled[start:start + length] = False
    logprobs = np.zeros(tokens.shape[0], dtype=np.float32)
    logprobs[sampled] = np.frombuffer(b"".join(actions[i].logprobs_raw for i in made), np.float32)
    versions = np.full(tokens.shape[0], -1, dtype=np.int64)
    versions[sampled] = np.frombuffer(b"".join(actions[i].versions_raw for i in made), np.int32)
    # Position t of a datum predicts its token t + 1: drop each sequence's first token's columns,
    # and its last token from the inputs.
    targets = np.delete(np.arange(tokens.shape[0]), starts)
    inputs_raw = np.delete(tokens, starts + n - 1).tobytes()
    mask = sampled[targets].astype(np.float32)
    m = (n - 1).tolist()
    # Each input's tensors for all the datums at once: one conversion and check per input.
    columns = {
        "target_tokens": tokens[targets].astype(np.int64),
        "logprobs": logprobs[targets],
        # float32(advantage) per token, times 0 or 1: -0.0 before a negative one, as a datum's own product.
        "advantages": mask * np.repeat(np.array([advantages[i] for i in made], dtype=np.float64)
                                       .astype(np.float32), m),
    }
    if with_mask:
        columns["mask"] = mask
    plain = len(columns)
    # A datum without a transform takes the first `plain` inputs: the transform's come after them.
    transforms = [actions[i].logprobs_transform for i in made]
    if any(t is not None for t in transforms):
        answers = (n - p).tolist()
        for key, default, value in _TRANSFORM_COLUMNS:
            column = np.full(tokens.shape[0], default, dtype=np.float32)
            column[sampled] = np.repeat(np.array([default if t is None else value(t) for t in transforms],
                                                 dtype=np.float32), answers)
            columns[key] = column[targets]
    keys = list(columns)
    parts = [TensorData.from_numpy_parts(column, m) for column in columns.values()]
    versions = versions[targets]
    out: list[list[SampledDatum]] = [[] for _ in transitions]
    at = 0
    for d, (i, length, transform) in enumerate(zip(made, m, transforms)):
        end = at + length
        width = len(keys) if transform is not None else plain
        inputs = {keys[c]: parts[c][d] for c in range(width)}
        datum = Datum(model_input=ModelInput(tokens_raw=inputs_raw[at * 4:end * 4]), loss_fn_inputs=inputs)
        out[i] = [SampledDatum(datum, mask[at:end], versions[at:end])]
        at = end
    return out


_TRANSFORM_COLUMNS: tuple[tuple[str, float, Callable[[LogprobTransform], float]], ...] = (
    ("temperature", 1.0, lambda t: t.temperature),
    ("top_k", 0.0, lambda t: 0.0 if t.top_k == -1 else t.top_k),
    ("top_p", 1.0, lambda t: t.top_p),
)
"""Each transform input: its value where no transform applies, and its value under one."""


def _one_turn(transition: Transition) -> Trajectory:
    return Trajectory(transitions=[transition])


def aggregation_weights(masks: Sequence[np.ndarray], aggregation: str, max_tokens: int) -> list[float] | None:
    """Per datum of one ``forward_backward`` call (``masks``: each datum's sampled target tokens),
    the factor that turns the losses' sum over tokens into ``aggregation``; None where it is the
    sum itself (``sum``, and the old names ``token`` and ``sequence``: the latter divides each
    trajectory's advantage at intake and leaves the ``mask`` alone).

    With ``n_d`` the sampled tokens of datum ``d``, ``N`` their sum over the call and ``S`` the
    call's datums that have any (a sequence: a datum with none trains nothing and is no sample):

    * ``token_mean`` (DAPO; TRL ``dapo`` / ``bnpo``; verl ``token-mean``): ``1 / N``;
    * ``seq_mean_token_mean`` (GRPO; TRL ``grpo``; verl ``seq-mean-token-mean``): ``1 / (n_d * S)``;
    * ``seq_mean_token_sum_norm`` (Dr. GRPO; TRL ``dr_grpo``; verl ``seq-mean-token-sum-norm``):
      ``1 / (max_tokens * S)``, the generation budget a constant in place of each length.
    """
    if aggregation in ("sum", "token", "sequence"):
        return None
    tokens = [int(np.count_nonzero(m > 0)) for m in masks]
    sequences = sum(1 for n in tokens if n)
    if not sequences:
        return None  # no sampled token: nothing to weigh
    if aggregation == "token_mean":
        return [1.0 / sum(tokens)] * len(tokens)
    if aggregation == "seq_mean_token_mean":
        return [1.0 / (n * sequences) if n else 0.0 for n in tokens]
    if aggregation == "seq_mean_token_sum_norm":
        return [1.0 / (max_tokens * sequences)] * len(tokens)
    raise ConfigurationError(f"loss_aggregation={aggregation!r}: not an aggregation")


def weigh_datums(datums: Sequence[Datum], weights: Sequence[float]) -> list[Datum]:
    """``weigh_datum(datums[k], weights[k])`` for every ``k``, each input's products computed over the
    call's datums at once (elementwise: the same bytes)."""
    inputs = [dict(d.loss_fn_inputs) for d in datums]
    for key in ("advantages", "mask"):
        have = [k for k, d in enumerate(inputs) if key in d]
        if not have:
            continue
        columns = [inputs[k][key].to_numpy() for k in have]
        if any(c.ndim != 1 for c in columns):
            return [weigh_datum(d, w) for d, w in zip(datums, weights)]
        lengths = [c.shape[0] for c in columns]
        scaled = (np.concatenate(columns).astype(np.float64)
                  * np.repeat(np.array([weights[k] for k in have], dtype=np.float64), lengths)).astype(np.float32)
        for k, part in zip(have, TensorData.from_numpy_parts(scaled, lengths)):
            inputs[k][key] = part
    return [Datum(model_input=d.model_input, loss_fn_inputs=i) for d, i in zip(datums, inputs)]


def add_token_advantages(datums: Sequence[Datum], scale: float, per_token: Sequence[np.ndarray]) -> list[Datum]:
    """Each datum with ``advantages`` replaced by ``scale * advantages + per_token[k]`` (one value per
    target token; zero where the datum's mask is, which the caller keeps so), in float32, computed over
    the datums at once."""
    columns = [d.loss_fn_inputs["advantages"].to_numpy() for d in datums]
    lengths = [c.shape[0] for c in columns]
    for k, (extra, n) in enumerate(zip(per_token, lengths)):
        if np.shape(extra) != (n,):
            raise ValueError(f"per_token[{k}]: shape {np.shape(extra)}, the datum has {n} target tokens")
    if not datums:
        return []
    total = (np.concatenate(columns).astype(np.float64) * scale
             + np.concatenate(per_token).astype(np.float64)).astype(np.float32)
    out = []
    for d, part in zip(datums, TensorData.from_numpy_parts(total, lengths)):
        inputs = dict(d.loss_fn_inputs)
        inputs["advantages"] = part
        out.append(Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def token_baseline(terms: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per-token terms of one group's datums, each less its leave-one-out baseline: at a datum's
    ``k``-th sampled token (``masks[d] > 0``), the mean of the other datums' terms at their ``k``-th
    sampled token; no baseline where no other datum has a ``k``-th; zero off the masks. In float64.

    The baseline of a per-token reward (distillation's reverse KL to a teacher): its group mean at
    the same position estimates the term's expectation there, and leaving the datum's own term out
    keeps the gradient unbiased (RLOO)."""
    if len(terms) != len(masks):
        raise ValueError(f"terms: {len(terms)} arrays for {len(masks)} masks")
    sampled = [np.asarray(m) > 0 for m in masks]
    index = [np.cumsum(m) - 1 for m in sampled]  # k of each sampled token (meaningful where sampled)
    values = [np.asarray(t, dtype=np.float64) for t in terms]
    if not any(m.any() for m in sampled):
        return [np.zeros_like(v) for v in values]
    at = np.concatenate([i[m] for i, m in zip(index, sampled)])
    width = int(at.max()) + 1
    sums = np.bincount(at, np.concatenate([v[m] for v, m in zip(values, sampled)]), minlength=width)
    counts = np.bincount(at, minlength=width)
    out = []
    for v, m, i in zip(values, sampled, index):
        k = np.clip(i, 0, None)
        others = counts[k] - 1
        baseline = np.where(others > 0, (sums[k] - v) / np.maximum(others, 1), 0.0)
        out.append(np.where(m, v - baseline, 0.0))
    return out


def weigh_datum(datum: Datum, weight: float) -> Datum:
    """``datum`` with its ``advantages`` and (if it has one) ``mask`` times ``weight`` (> 0, or 0
    for a datum without sampled tokens): every token's objective scaled alike."""
    inputs = dict(datum.loss_fn_inputs)
    for key in ("advantages", "mask"):
        if key in inputs:
            inputs[key] = TensorData.from_numpy((inputs[key].to_numpy().astype(np.float64) * weight)
                                                .astype(np.float32))
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
