"""Multi-agent episodes (``rlengine.rl.multi_agent``): roles, per-role advantages, untrainable roles untrained.

The batch test runs the real loop on the ``guess-duo`` recipe with the
hint-giver on the policy's own slot but untrainable, and spies on the
training client's ``forward_backward``: the hint-giver's turns are sampled
by the same model, so a leak would show as datums of its view (which starts
with the secret's digit, the guesser's with ``?``). The same run with the
hint-giver trained shows that the check sees such datums when they are sent.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from rlengine.core.clients import TrainingClient
from rlengine.errors import ConfigurationError
from rlengine.rl.advantages import assess_group
from rlengine.rl.batch import prepare_group
from rlengine.rl.config import TrainConfig
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.multi_agent import RoleStep, ScriptedAgent, Turn, TurnTakingEnv
from rlengine.rl.recipes import load_recipe
from rlengine.rl.recipes.guess_duo import GuessDuoOptions, scripted_hint
from rlengine.rl.recipes.guess_sandbox import HIGHER, LOWER, START
from rlengine.rl.rollouts import rollout_group
from rlengine.rl.run import train
from rlengine.rl.types import (
    POLICY,
    Agent,
    AttemptFailure,
    EnvGroupBuilder,
    Observation,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from rlengine.types import ModelInput, SampledSequence, SamplingParams
from rlengine.validation import MAX_ROLE_CHARS

# -- hand-made groups: per-role advantages --------------------------------------------------------


def _trajectory(role: str, reward: float, trainable: bool = True, *, failed: bool = False) -> Trajectory:
    action = SampledSequence(stop_reason="stop", tokens_raw=np.array([7, 8], np.int32).tobytes(),
                             logprobs_raw=np.array([-0.5, -0.25], np.float32).tobytes(),
                             versions_raw=np.zeros(2, np.int32).tobytes())
    if failed:
        return Trajectory(transitions=[], role=role, trainable=trainable,
                          failure=AttemptFailure(stage="agent", error="X", message="x", turn=-1))
    return Trajectory(transitions=[Transition(observation=Observation(prompt=ModelInput.from_ints([1, 2])),
                                              action=action, reward=reward, done=True)],
                      role=role, trainable=trainable)


def test_per_role_advantages_equal_a_hand_computed_reference():
    # Four episodes of three roles: A and B train, C does not; episode 2 of B failed.
    rewards = {"A": [1.0, 0.0, 0.5, 0.25], "B": [2.0, 4.0, None, 0.0], "C": [9.0, -9.0, 3.0, 0.0]}
    trajectories = []
    for e in range(4):
        for role in ("A", "B", "C"):
            r = rewards[role][e]
            trajectories.append(_trajectory(role, 0.0 if r is None else r, role != "C", failed=r is None))
    group = TrajectoryGroup(trajectories=trajectories, group_rewards=[0.0] * 12)
    verdict = assess_group(group, min_surviving_attempts=2, skip_constant_reward=True, normalize=True)

    # The reference, written out: each trainable role's survivors against their own mean and std.
    a = np.array([1.0, 0.0, 0.5, 0.25])
    b = np.array([2.0, 4.0, 0.0])
    ref_a = (a - a.mean()) / (a.std() + 1e-6)
    ref_b = (b - b.mean()) / (b.std() + 1e-6)
    expected = {0: ref_a[0], 3: ref_a[1], 6: ref_a[2], 9: ref_a[3], 1: ref_b[0], 4: ref_b[1], 10: ref_b[2]}
    assert verdict.dropped is None
    assert verdict.kept == sorted(expected)  # C's indices (2, 5, 8, 11) and B's failed one (7) never kept
    np.testing.assert_allclose(verdict.advantages, [expected[i] for i in verdict.kept], rtol=0, atol=1e-12)
    assert verdict.failed == 1
    assert sorted(verdict.rewards) == sorted([*a.tolist(), *b.tolist()])  # C's rewards are not the policy's

    # The datums carry each trajectory's own role's advantage, and none is of C.
    cfg = TrainConfig(normalize_advantages=True, skip_constant_reward=True, min_surviving_attempts=2)
    prepared = prepare_group(cfg, group)
    assert sorted({i for i, _, _ in prepared.datums}) == sorted(expected)
    for i, _, d in prepared.datums:
        adv = d.datum.loss_fn_inputs["advantages"].to_numpy()
        np.testing.assert_allclose(adv[adv != 0], np.float32(expected[i]), rtol=1e-6)


def test_a_group_whose_trainable_role_is_constant_is_dropped_even_if_an_untrainable_one_varies():
    group = TrajectoryGroup(trajectories=[_trajectory("g", 1.0), _trajectory("h", 0.0, False),
                                          _trajectory("g", 1.0), _trajectory("h", 5.0, False)],
                            group_rewards=[0.0] * 4)
    verdict = assess_group(group, min_surviving_attempts=2, skip_constant_reward=True, normalize=True)
    assert (verdict.kept, verdict.dropped, verdict.rewards) == ([], "constant_reward", [1.0, 1.0])


def test_staleness_reads_only_trainable_tokens():
    old = msgspec.structs.replace(_trajectory("h", 0.0, False), transitions=[msgspec.structs.replace(
        _trajectory("h", 0.0).transitions[0], action=SampledSequence(
            stop_reason="stop", tokens_raw=np.array([3], np.int32).tobytes(),
            logprobs_raw=np.zeros(1, np.float32).tobytes(), versions_raw=np.array([-1], np.int32).tobytes()))])
    group = TrajectoryGroup(trajectories=[_trajectory("g", 1.0), old], group_rewards=[0.0, 0.0])
    assert group.versions() == (0, 0)  # the scripted agent's -1 is not a policy version


# -- turn taking through rollout_group -----------------------------------------------------------


class _Policy:
    """A stand-in policy slot: answers ``token`` to every prompt, logprob -1, version 5."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.prompts: list[list[int]] = []

    async def sample(self, prompt, num_samples=1, sampling_params=None):
        return await ScriptedAgent(self._reply).sample(prompt, num_samples, sampling_params)

    def _reply(self, prompt: list[int]) -> list[int]:
        self.prompts.append(prompt)
        return [self.token]


class _Game(TurnTakingEnv):
    """hinter, guesser, hinter, guesser: rewards for both at the end; ``bad`` breaks a rule."""

    def __init__(self, agents, bad: str | None = None) -> None:
        super().__init__(agents)
        self.bad = bad
        self.turns = 0
        self.closed = False

    async def initial_turn(self) -> Turn:
        return Turn(role="hinter", observation=Observation(prompt=ModelInput.from_ints([1])))

    async def step(self, role, action):
        self.turns += 1
        if self.turns == 4:
            return RoleStep(rewards={"guesser": 1.0, "hinter": 0.5}, done=True)
        nxt = "guesser" if role == "hinter" else "hinter"
        if self.bad == "unknown role" and self.turns == 2:
            nxt = "referee"
        rewards = {"nobody": 1.0} if self.bad == "unknown reward" else {}
        return RoleStep(rewards=rewards, done=False,
                        next_turn=Turn(role=nxt, observation=Observation(prompt=ModelInput.from_ints([1] * (self.turns + 1)))))

    async def close(self) -> None:
        self.closed = True


class _Builder(EnvGroupBuilder):
    def __init__(self, envs) -> None:
        self.envs = envs

    async def make_envs(self):
        return self.envs


AGENTS = [Agent(role="hinter", sampler=ScriptedAgent(lambda p: [9]), trainable=False),
          Agent(role="guesser", sampler=POLICY)]


def test_turn_taking_gives_a_trajectory_per_agent_with_its_role_flag_and_rewards():
    policy = _Policy(4)
    envs = [_Game(AGENTS), _Game(AGENTS)]
    group = asyncio.run(rollout_group(_Builder(envs), policy, SamplingParams(max_tokens=1), 0, max_turns=2,
                                      episode_timeout_s=10))
    assert [(t.role, t.trainable) for t in group.trajectories] == [("hinter", False), ("guesser", True)] * 2
    hinter, guesser = group.trajectories[:2]
    assert [t.action.tokens for t in hinter.transitions] == [[9], [9]]  # the scripted slot's
    assert [t.action.tokens for t in guesser.transitions] == [[4], [4]]  # the policy's
    assert (hinter.step_reward, guesser.step_reward) == (0.5, 1.0)
    assert [t.done for t in guesser.transitions] == [False, True]
    assert len(policy.prompts) == 4  # only the guesser's turns reached the policy
    assert all(e.closed for e in envs)
    assert group.by_role() == {"hinter": [0, 2], "guesser": [1, 3]}


@pytest.mark.parametrize("bad", ["unknown role", "unknown reward"])
def test_an_episode_that_breaks_its_rules_fails_every_role_of_that_attempt_only(bad):
    envs = [_Game(AGENTS, bad), _Game(AGENTS)]
    group = asyncio.run(rollout_group(_Builder(envs), _Policy(4), SamplingParams(max_tokens=1), 0, max_turns=2,
                                      episode_timeout_s=10))
    first = group.trajectories[:2]
    assert [(t.role, t.failed) for t in first] == [("hinter", True), ("guesser", True)]
    assert first[0].failure.error == "EpisodeError"
    assert ("referee" if bad == "unknown role" else "nobody") in first[0].failure.message
    assert not any(t.failed for t in group.trajectories[2:])
    assert envs[0].closed


def test_too_many_turns_fails_the_attempt():
    group = asyncio.run(rollout_group(_Builder([_Game(AGENTS)]), _Policy(4), SamplingParams(max_tokens=1), 0,
                                      max_turns=1, episode_timeout_s=10))
    assert all(t.failed and "max_turns=1" in t.failure.message for t in group.trajectories)


@pytest.mark.parametrize(("role", "why"), [("", "non-empty"), ("x" * (MAX_ROLE_CHARS + 1), "at most"),
                                           (3, "non-empty"), ("a\nb", "printable")])
def test_a_bad_role_is_a_configuration_error_naming_the_field_and_value(role, why):
    with pytest.raises(ConfigurationError, match=rf"^role=.*{why}"):
        Agent(role=role)


def test_agents_need_unique_roles_and_a_sampler_with_sample():
    with pytest.raises(ConfigurationError, match="not unique"):
        _Game([Agent(role="a"), Agent(role="a")])
    with pytest.raises(ConfigurationError, match="sampler="):
        Agent(role="a", sampler="frozen")
    with pytest.raises(ConfigurationError, match="hinter_trains"):
        GuessDuoOptions(hinter_trains=True)


def test_the_scripted_hinter_tells_the_secret_then_lower_or_higher():
    assert scripted_hint([6]) == [6]  # token 6 is the digit 5
    assert scripted_hint([6, 9]) == [LOWER]  # guessed 8: smaller
    assert scripted_hint([6, 2]) == [HIGHER]  # guessed 1: larger


# -- the real loop: what reaches forward_backward -------------------------------------------------

SHORT = {"steps": "2", "groups_per_batch": "4", "group_size": "4", "eval_every": "0", "checkpoint_every": "0",
         "num_substeps": "1", "skip_constant_reward": "false"}


def _spied_run(tmp_path, monkeypatch, **options: str) -> tuple[list[list[int]], list[dict]]:
    """A short guess-duo run; the first input token of every datum ``forward_backward`` received."""
    firsts: list[list[int]] = []
    real = TrainingClient.forward_backward

    def forward_backward(client, data, loss_fn="cross_entropy", loss_fn_config=None):
        firsts.append([d.model_input.to_ints()[0] for d in data])
        return real(client, data, loss_fn, loss_fn_config)

    monkeypatch.setattr(TrainingClient, "forward_backward", forward_backward)
    steps: list[dict] = []
    outcome = train("guess-duo", {**SHORT, **options}, run_dir=str(tmp_path / "run"), on_step=steps.append)
    assert outcome.error is None
    return firsts, steps


@pytest.mark.model_plane
def test_an_untrainable_role_never_reaches_forward_backward_even_on_the_policy_slot(tmp_path, monkeypatch):
    # Typically 10-25 s here (two runs of 2 steps on the tiny character model).
    firsts, steps = _spied_run(tmp_path / "frozen", monkeypatch, hinter="policy", hinter_trains="false")
    sent = [t for call in firsts for t in call]
    assert sent and set(sent) == {START}  # every datum is a guesser's view: "?" first
    assert all("reward_mean/role:hinter" in s and "reward_mean/role:guesser" in s for s in steps)
    # The check is not blind: the same run with the hint-giver trained sends its views (a digit first).
    firsts, _ = _spied_run(tmp_path / "trained", monkeypatch, hinter="policy", hinter_trains="true")
    assert {t for call in firsts for t in call} - {START}


@pytest.mark.slow
@pytest.mark.model_plane
def test_rlengine_train_guess_duo_runs_from_the_command_line(tmp_path):
    # Typically 10-30 s (a fresh process: imports, start-up, one step); in CI the spied run above
    # runs the same recipe in process.
    done = subprocess.run([sys.executable, "-m", "rlengine.rl.cli", "guess-duo", "steps=1", "groups_per_batch=2",
                           "group_size=4", "eval_every=0", "--run-dir", str(tmp_path / "run"), "--no-progress"],
                          check=False, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (step,) = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert {"reward_mean/role:guesser", "reward_mean/role:hinter"} <= set(step)
    assert load_recipe("guess-duo").name == "guess-duo"


@pytest.mark.slow
@pytest.mark.model_plane
def test_the_guesser_learns_to_take_the_hint(tmp_path):
    # Typically 25 s: 30 steps; seed 0 went from 0.12 to 0.77-0.80 at steps 28-30.
    steps: list[dict] = []
    outcome = train("guess-duo", {"steps": "30", "eval_every": "0", "checkpoint_every": "0"},
                    run_dir=str(tmp_path / "run"), on_step=steps.append)
    assert outcome.error is None
    first = np.mean([s["reward_mean/role:guesser"] for s in steps[:3]])
    last = np.mean([s["reward_mean/role:guesser"] for s in steps[-5:]])
    assert first < 0.35 and last > 0.6, (first, last)
