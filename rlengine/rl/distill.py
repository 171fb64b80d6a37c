"""On-policy distillation: the student samples, a teacher scores the student's own tokens.

As tinker-cookbook's ``distillation/train_on_policy.py`` does it, in one
process: every group the student sampled is scored by a teacher
(``rlengine.rl.teacher``: a second model slot on the student's loop and
compute thread) before it trains, and the per-token reverse KL becomes the
advantage:

    adv_t = reward_weight * A_group + kl_penalty_coef * (r_t - b_t),   r_t = -(logp_student(t) - logp_teacher(t))

on every token the policy sampled (0 elsewhere: prompts, and the observation
tokens an environment or a tool put between two turns of an agent episode,
which the datums' masks already mark), where ``logp_student`` is the
sampler's recorded logprob of the sampled token and ``logp_teacher`` the
teacher's ``compute_logprobs`` on the datum's exact token ids (its model input
and last target: no re-rendering, no re-tokenizing), and ``A_group`` the
task reward's group advantage (``rlengine.rl.advantages``; ``reward_weight``
0, the default, is pure distillation). The datums are made by the scalar
path as for any run; ``advantages.add_token_advantages`` adds the per-token
term to them, a group at a time.

``b_t`` is the term's baseline (``kl_baseline``). ``"group"``, the default:
the mean of ``r_t`` over the group's other attempts at the same sampled-token
index (the k-th token each sampled; leave-one-out, so the gradient stays
unbiased; ``advantages.token_baseline``), within a role in a multi-agent
group; 0 where no other attempt has a k-th token, so a group of one is not
centred. ``None``: no baseline, tinker-cookbook's advantage exactly. Why a
baseline: ``r_t`` is a per-token reward whose expectation under the student
is minus the reverse KL at that position, large and negative while the
student is far from the teacher (a fresh student against a confident
teacher: about -6 per token, -17 against a saturated one whose wrong tokens
sit at logprob -20). Without a baseline every sampled token is pushed down,
the right ones only less than the wrong, and that common push is noise of
the size of the KL in each sample's gradient; clipped to a unit norm
(``grad_clip_norm``), the signal shrinks in proportion. The mean at the same
position over the group (the same prompt) estimates that expectation, as a
GRPO baseline does the reward's. Measured on the copy task (docs/distillation.md).

``DistillScorer`` is the ``GroupScorer`` (``rlengine.rl.batch``) that does
it, with several teachers routed by the task's tag (a group goes to the
teacher named by its first ``EnvGroupBuilder.logging_tags()`` tag that has
one, else to the default teacher). It also evaluates each teacher once before
training (its mean reward on the held-out split, or on the first training
batch), and reports per group what the step's metrics line shows:
``teacher_kl_mean`` (per teacher too with several), ``teacher_score_s`` and
``teacher_score_frac`` (the teacher's compute time as a share of the step:
each teacher's sampler time, attributed to the scorings that ran it once),
``teacher_reward_mean`` and ``teacher_bytes`` (parameters and peak KV cache
of every teacher held). The group ledger names the teacher of each group.

``distill`` is the library API of ``rlengine train distill``
(``rlengine.rl.recipes.distill``): a run of a base recipe with teachers.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlengine.errors import ConfigurationError
from rlengine.rl.advantages import add_token_advantages, token_baseline
from rlengine.rl.batch import GroupScore, GroupScorer, PreparedGroup
from rlengine.rl.rollouts import rollout_group
from rlengine.rl.teacher import TeacherSlot
from rlengine.rl.types import EnvGroupBuilder, RLDataset, TrajectoryGroup
from rlengine.seeding import mix_seed
from rlengine.types import ModelInput, SamplingParams

__all__ = ["KL_BASELINES", "DistillScorer", "distill", "parse_teachers"]

log = logging.getLogger("rlengine")

DEFAULT = "default"
"""The name of the teacher given with ``teacher=`` (groups whose tags route to no other)."""

KL_BASELINES = ("group", None)
"""The values of ``kl_baseline`` (module docstring)."""


def parse_teachers(teacher: str | None, teachers: Mapping[str, str] | str | None) -> dict[str, str]:
    """``{name: path}`` from ``teacher=`` (named ``default``) and ``teachers=`` (a mapping of tag to path,
    or on the command line ``tag:path,tag:path``); a ``ConfigurationError`` naming the bad entry."""
    out: dict[str, str] = {}
    if isinstance(teachers, str):
        parsed: dict[str, str] = {}
        for entry in filter(None, (e.strip() for e in teachers.split(","))):
            tag, sep, path = entry.partition(":")
            if not sep or not tag or not path:
                raise ConfigurationError(f"teachers={teachers!r}: entry {entry!r} is not tag:path")
            parsed[tag] = path
        teachers = parsed
    for tag, path in (teachers or {}).items():
        if not isinstance(tag, str) or not tag or tag == DEFAULT:
            raise ConfigurationError(f"teachers: tag {tag!r} is not a task tag (the teacher of untagged groups "
                                     "is teacher=)")
        if not isinstance(path, str) or not path:
            raise ConfigurationError(f"teachers[{tag!r}]={path!r}: not a teacher path")
        out[tag] = path
    if teacher is not None:
        out[DEFAULT] = teacher
    if not out:
        raise ConfigurationError("teacher=None: distillation needs teacher=PATH (or teachers=tag:PATH,...)")
    return out


class DistillScorer(GroupScorer):
    """Scores each group with its teacher; see the module docstring."""

    def __init__(self, teachers: Mapping[str, TeacherSlot], *, kl_penalty_coef: float, reward_weight: float,
                 call_timeout_s: float, kl_baseline: str | None = "group") -> None:
        if not teachers:
            raise ConfigurationError("teachers: none given")
        if kl_baseline not in KL_BASELINES:
            raise ConfigurationError(f"kl_baseline={kl_baseline!r}: not one of {list(KL_BASELINES)}")
        self.kl_baseline = kl_baseline
        self.teachers = dict(teachers)
        self.kl_penalty_coef = kl_penalty_coef
        self.reward_weight = reward_weight
        self.call_timeout_s = call_timeout_s
        self._accounted = {name: 0.0 for name in self.teachers}
        """Per teacher, its sampler time already attributed to a scoring."""

    def route(self, index: int, tags: Sequence[str]) -> TeacherSlot:
        """The teacher of group ``index`` tagged ``tags``: that of its first tag with one, else the default one."""
        for tag in tags:
            if tag in self.teachers and tag != DEFAULT:
                return self.teachers[tag]
        if DEFAULT in self.teachers:
            return self.teachers[DEFAULT]
        raise ConfigurationError(f"group {index}: its tags {list(tags)} name no teacher (teachers for "
                                 f"{sorted(self.teachers)}; teacher= takes the others)")

    async def score(self, index: int, group: TrajectoryGroup, prepared: PreparedGroup) -> PreparedGroup:
        teacher = self.route(index, group.tags)
        datums = [sd for _, _, sd in prepared.datums]
        scored = await asyncio.wait_for(asyncio.gather(*(teacher.logprobs(_sequence(sd.datum)) for sd in datums)),
                                        self.call_timeout_s)
        terms, kl_sum, tokens = [], 0.0, 0
        for sd, logprobs in zip(datums, scored):
            student = sd.datum.loss_fn_inputs["logprobs"].to_numpy()
            # Position t of the datum predicts its target t: the teacher's logprob of token t + 1.
            theirs = np.array([0.0 if lp is None else lp for lp in logprobs[1:]], dtype=np.float64)
            if theirs.shape != student.shape:
                raise RuntimeError(f"teacher {teacher.name!r}: {theirs.shape[0]} logprobs for a datum of "
                                   f"{student.shape[0]} target tokens")
            kl = np.where(sd.mask > 0, student.astype(np.float64) - theirs, 0.0)
            terms.append(-kl)
            kl_sum += float(kl.sum())
            tokens += int(np.count_nonzero(sd.mask > 0))
        if self.kl_baseline == "group":
            terms = _baselined(terms, [sd.mask for sd in datums],
                               [group.trajectories[i].role for i, _, _ in prepared.datums])
        extras = [self.kl_penalty_coef * t for t in terms]
        rewritten = add_token_advantages([sd.datum for sd in datums], self.reward_weight, extras)
        stats = teacher.stats()
        seconds = stats["busy_s"] - self._accounted[teacher.name]
        self._accounted[teacher.name] = stats["busy_s"]
        held = sum(t.stats()["bytes"] for t in self.teachers.values())
        return prepared._replace(
            datums=[(i, j, sd._replace(datum=d)) for (i, j, sd), d in zip(prepared.datums, rewritten)],
            score=GroupScore(teacher.name, kl_sum, tokens, max(0.0, seconds), teacher.reward, held))

    async def evaluate(self, dataset: RLDataset, params: SamplingParams, seed: int, *, max_turns: int,
                       episode_timeout_s: float) -> dict[str, float]:
        """Each teacher's mean reward on batch 0 of ``dataset`` (the groups routed to it), stored as its
        ``reward``; returns them by name."""
        builders: Sequence[EnvGroupBuilder] = dataset.get_batch(0)
        by_teacher: dict[str, list[float]] = {}
        for k, builder in enumerate(builders):
            teacher = self.route(k, builder.logging_tags())
            group = await rollout_group(builder, teacher.sampling_client(), params, mix_seed(seed, 0x7EAC, k),
                                        max_turns=max_turns, episode_timeout_s=episode_timeout_s)
            by_teacher.setdefault(teacher.name, []).extend(
                r for t, r in zip(group.trajectories, group.total_rewards()) if not t.failed)
        # The evaluation's sampling is no scoring: the first step's share starts after it.
        self._accounted = {name: t.stats()["busy_s"] for name, t in self.teachers.items()}
        for name, rewards in by_teacher.items():
            self.teachers[name].reward = float(np.mean(rewards)) if rewards else None
            log.info("rlengine.rl: teacher %r: mean reward %.3f on %d evaluation attempts", name,
                     self.teachers[name].reward or float("nan"), len(rewards))
        return {name: r for name, t in self.teachers.items() if (r := t.reward) is not None}


def _baselined(terms: list[np.ndarray], masks: Sequence[np.ndarray], roles: Sequence[str | None]) -> list[np.ndarray]:
    """``terms`` less their group baseline, each role's datums a group of their own."""
    out = list(terms)
    for role in dict.fromkeys(roles):
        mine = [k for k, r in enumerate(roles) if r == role]
        for k, centred in zip(mine, token_baseline([terms[k] for k in mine], [masks[k] for k in mine])):
            out[k] = centred
    return out


def _sequence(datum: Any) -> ModelInput:
    """The datum's whole token sequence: its input and its last target (what was sampled, exactly)."""
    last = datum.loss_fn_inputs["target_tokens"].to_numpy()[-1:].astype(np.int32)
    return ModelInput(tokens_raw=datum.model_input.tokens_raw + last.tobytes())


def distill(teacher: str | None = None, *, run_dir: str, teachers: Mapping[str, str] | None = None,
            base: str = "copy", kl_penalty_coef: float = 1.0, reward_weight: float = 0.0,
            kl_baseline: str | None = "group", on_step: Callable[[dict[str, Any]], None] | None = None,
            **settings: Any) -> Any:
    """Distil ``teacher`` (or ``teachers`` by task tag) into a fresh student on recipe ``base``: what
    ``rlengine train distill teacher=PATH ...`` runs. ``settings``: the run's and the base recipe's
    settings (``steps=``, ``digits=``, ...). Returns the ``rlengine.rl.run.RunOutcome``."""
    from rlengine.rl.recipes.distill import recipe_name
    from rlengine.rl.run import train

    overrides = {**settings, "kl_penalty_coef": kl_penalty_coef, "reward_weight": reward_weight,
                 "kl_baseline": kl_baseline}
    if teacher is not None:
        overrides["teacher"] = teacher
    if teachers is not None:
        overrides["teachers"] = dict(teachers)
    return train(recipe_name(base), overrides, run_dir=run_dir, on_step=on_step)
