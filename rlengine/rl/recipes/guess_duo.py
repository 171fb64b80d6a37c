"""Recipe ``guess-duo``: the guessing game with two agents, a hint-giver that does not train and a guesser that does.

A two-role ``TurnTakingEnv`` (``rlengine.rl.multi_agent``). The secret is a
digit. The hint-giver (role ``hinter``) sees the secret and speaks first:
a hint, one token. The guesser (role ``guesser``) sees ``?`` and what the
hint-giver said, and guesses a digit; if it is wrong, the hint-giver
answers, and the guesser guesses again, up to ``max_turns`` guesses. A
token that is not a digit ends the game. Both roles get 1.0 when the secret
is found, else 0.0 (a cooperative game); each role's advantages are against
its own attempts only, and the hint-giver's turns are recorded, rewarded
and exported (the group ledger's ``roles``) but never trained.

``hinter`` picks the hint-giver's model slot:

* ``scripted`` (default): a ``ScriptedAgent`` that says the secret first,
  then ``<`` (the secret is smaller) or ``>`` after each wrong guess. The
  guesser learns to take the hint: a random policy finds the secret in
  about a third of the games, a trained one in nearly all of them, within
  a few dozen steps on CPU;
* ``policy``: the policy being trained speaks the hints too (two roles
  sharing one policy), trained as well with ``hinter_trains=true``.

Every game runs in the training process (no sandbox): each turn is one
engine request on the acting agent's slot. The model is the ``guess``
recipe's character model (same alphabet).

It must not depend on anything but the engine, the RL types, ``multi_agent`` and the
``guess`` recipe (its model's alphabet and its settings).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig
from rlengine.rl.multi_agent import RoleStep, ScriptedAgent, Turn, TurnTakingEnv
from rlengine.rl.recipes import DigitTasks, EveryDigit, Recipe
from rlengine.rl.recipes.guess import GuessGame
from rlengine.rl.recipes.guess_sandbox import ALPHABET, HIGHER, LOWER, START, digit
from rlengine.rl.types import POLICY, Agent, Observation, RLDataset
from rlengine.types import ModelInput
from rlengine.validation import validate

__all__ = ["RECIPE", "DuoGame", "GuessDuo", "GuessDuoOptions", "scripted_hint"]


class GuessDuoOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    hinter: Literal["scripted", "policy"] = "scripted"
    """The hint-giver's model slot: a scripted agent, or the policy trained (shared with the guesser)."""
    hinter_trains: bool = False
    """Train the hint-giver's turns too (only with ``hinter="policy"``: a script has nothing to train)."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)
        if self.hinter_trains and self.hinter != "policy":
            raise ConfigurationError(f"hinter_trains=true: needs hinter='policy' (hinter={self.hinter!r} "
                                     "samples no tokens of the policy)")


def scripted_hint(view: list[int]) -> list[int]:
    """The scripted hint-giver: its view is the secret's token, then each guess so far; it says the
    secret first, then ``<`` or ``>`` against the latest guess."""
    if len(view) == 1:
        return [view[0]]
    secret, guess = digit(view[0]), digit(view[-1])
    return [LOWER if secret is not None and guess is not None and secret < guess else HIGHER]


class DuoGame(TurnTakingEnv):
    """One game; see the module docstring. The hint-giver's view is the secret and the guesses,
    the guesser's ``?``, the hints and its own guesses, each extended token for token."""

    def __init__(self, agents: list[Agent], secret: int, max_guesses: int) -> None:
        super().__init__(agents)
        self.secret = secret
        self.max_guesses = max_guesses
        self.hinter_view = [secret + 1]  # the digit's token (``guess_sandbox.ALPHABET``)
        self.guesser_view = [START]
        self.guesses = 0

    async def initial_turn(self) -> Turn:
        return Turn(role="hinter", observation=Observation(prompt=ModelInput.from_ints(self.hinter_view)))

    async def step(self, role: str, action: list[int]) -> RoleStep:
        if role == "hinter":
            self.guesser_view += action
            return RoleStep(done=False, next_turn=Turn(
                role="guesser", observation=Observation(prompt=ModelInput.from_ints(self.guesser_view))))
        self.guesses += 1
        self.guesser_view += action
        self.hinter_view += action
        guess = digit(action[0]) if len(action) == 1 else None
        found = guess == self.secret
        if found or guess is None or self.guesses >= self.max_guesses:
            reward = 1.0 if found else 0.0
            return RoleStep(rewards={"guesser": reward, "hinter": reward}, done=True,
                            metrics={"found": float(found), "guesses": float(self.guesses),
                                     "invalid": float(guess is None)})
        return RoleStep(done=False, next_turn=Turn(
            role="hinter", observation=Observation(prompt=ModelInput.from_ints(self.hinter_view))))


class _World:
    """What makes the games: the agents (fixed for the run) and the number of guesses."""

    def __init__(self, options: GuessDuoOptions, max_guesses: int) -> None:
        hinter = (Agent(role="hinter", sampler=ScriptedAgent(scripted_hint), trainable=False)
                  if options.hinter == "scripted" else Agent(role="hinter", sampler=POLICY,
                                                             trainable=options.hinter_trains))
        self.agents = [hinter, Agent(role="guesser", sampler=POLICY)]
        self.max_guesses = max_guesses

    def env(self, secret: int, group: int) -> DuoGame:
        return DuoGame(self.agents, secret, self.max_guesses)


class GuessDuo(Recipe):
    name = "guess-duo"
    description = "guess a digit with a hint-giver's help: two agents, only the guesser trains (multi-agent)"
    # The guess recipe's training settings; taking the hint is learnt in far fewer steps.
    defaults: ClassVar[dict[str, Any]] = {**GuessGame.defaults, "steps": 40, "eval_every": 10}
    Options = GuessDuoOptions

    def engine_config(self, config: TrainConfig, options: GuessDuoOptions) -> EngineConfig:
        if config.backend == "sim":
            raise ConfigurationError("backend='sim': the guess-duo recipe needs a model backend (torch or vllm)")
        if config.model is not None:
            raise ConfigurationError(f"model={config.model!r}: the guess-duo recipe plays with its own character "
                                     "model (use the guess recipe for a model of yours)")
        if config.max_tokens != 1:
            raise ConfigurationError(f"max_tokens={config.max_tokens}: a hint and a guess are one token each "
                                     "(max_tokens=1)")
        path = prepare_char_model(ALPHABET, "$", cache_dir=config.cache_dir, seed=config.seed,
                                  max_position_embeddings=max(64, 2 * config.max_turns + 4))
        return EngineConfig(model=path, backend=config.backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: GuessDuoOptions) -> tuple[RLDataset, RLDataset | None]:
        world = _World(options, config.max_turns)
        batches = config.steps if config.steps is not None else 40
        return (DigitTasks(world, "secret", batches, config.groups_per_batch, config.group_size, config.seed),
                EveryDigit(world, "secret"))


RECIPE = GuessDuo()
