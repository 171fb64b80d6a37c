"""Recipe ``guess``: a multi-turn guessing game whose environments run in sandbox processes over IPC.

The secret is a digit; the model guesses, the game answers ``<`` or ``>``,
the model guesses again (``guess_sandbox`` has the rules). Each attempt is
one episode in a sandbox worker process (a ``SandboxPool`` of ``sandboxes``
of them): the worker attaches to a session the trainer opened on the
engine's IPC server, samples every turn through it with the sandbox client
and sends its reward there; the trainer trains on the session's exact
trace (tokens, logprobs and policy versions as sampled), never on
re-tokenized text. One training sequence per episode: every turn extends
the previous context token for token.

A random policy finds the secret in about one game in six (a guess that is
not a digit ends the game); finding it every time within ``max_turns`` = 4
guesses takes a binary search that uses the answers.

With ``model=`` the game is the same, token for token, in the given model's
vocabulary: the prompt ``?`` and the answers ``<`` / ``>`` are encoded with
its tokenizer, and each digit must be one token of it (a guess is one
token); the recipe refuses a model where one is not, or whose context
cannot hold ``max_turns`` guesses.

``crash_every`` > 0 is fault injection: every ``crash_every``-th attempt
(environment made) is marked in its task to exit abruptly before its second
guess, taking its sandbox worker down with the games in flight there. The
mark belongs to the game, so its replay in quarantine crashes again, alone:
that attempt alone fails (an ``AttemptFailure`` of kind ``crash``, counted in
``attempts_failed_crash``; ``min_surviving_attempts`` decides whether its
group trains), while the other games of the worker are played again and
finish (``rlengine.rl.sandbox``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec

from rlengine.backends.torch.models import prepare_char_model
from rlengine.config import EngineConfig
from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError
from rlengine.rl.config import TrainConfig
from rlengine.rl.recipes import DigitTasks, EveryDigit, GivenModel, Recipe, given_model
from rlengine.rl.recipes.guess_sandbox import ALPHABET
from rlengine.rl.sandbox import SandboxPool, SessionEnv
from rlengine.rl.types import AgentEnv, RLDataset
from rlengine.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, validate

__all__ = ["RECIPE", "GuessGame", "GuessOptions"]

SANDBOX_MODULE = "rlengine.rl.recipes.guess_sandbox"


class GuessOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    sandboxes: PositiveInt = 2
    """Sandbox worker processes (each plays many games at once)."""
    crash_every: NonNegativeInt = 0
    """Fault injection: every n-th attempt exits mid-game, with its worker (0: never)."""
    job_timeout_s: PositiveFloat = 60.0
    """Longest one game may take in its sandbox."""
    think_s: NonNegativeFloat = 0.0
    """Fault injection: before each guess the sandbox waits a random time in [0, think_s)
    (not drawn from the seed: an agent's varying latency, which reorders the engine's batches)."""

    def __post_init__(self) -> None:
        validate(self, ConfigurationError)


class _World:
    """What the environments reach at run time: the server's sessions and the sandbox pool."""

    def __init__(self, options: GuessOptions, symbols: dict[str, list[int]] | None) -> None:
        self.options = options
        self.symbols = symbols
        self.pool: SandboxPool | None = None
        self.sessions: Any = None
        self._attempts = 0

    def env(self, secret: int, group: int) -> AgentEnv:
        if self.pool is None:
            raise RuntimeError("the guess recipe's sandboxes are not running (Recipe.attach was not entered)")
        self._attempts += 1
        task: dict[str, Any] = {"secret": secret, "think_s": self.options.think_s}
        if self.symbols is not None:
            task["symbols"] = self.symbols
        every = self.options.crash_every
        if every and self._attempts % every == 0:
            task["crash_at_turn"] = 1  # in the task: every replay of this game crashes too
        return SessionEnv(self.pool, self.sessions, task, {"group_secret": secret})


def model_symbols(model: GivenModel, max_turns: int) -> dict[str, list[int]]:
    """The game's symbols in ``model``'s tokens (``guess_sandbox.symbols``), checked to fit."""
    found = {"start": model.encode("?", special=True), "lower": model.encode("<"), "higher": model.encode(">")}
    digits = []
    for d in range(10):
        ids = model.encode(str(d))
        if len(ids) != 1 or model.tokenizer.decode(ids) != str(d):
            raise model.refuse(f"the digit {d} is not one token of its tokenizer (it encodes to {ids}); a guess "
                               "is one token")
        digits.append(ids[0])
    reply = max(len(found["lower"]), len(found["higher"]))
    model.check_context(len(found["start"]) + max_turns + (max_turns - 1) * reply, f"max_turns={max_turns} guesses")
    return {**found, "digits": digits}


class GuessGame(Recipe):
    name = "guess"
    description = "guess a digit from '<' / '>' answers, multi-turn, each game in a sandbox process over IPC"
    defaults: ClassVar[dict[str, Any]] = {
        "steps": 300, "groups_per_batch": 16, "group_size": 8, "max_tokens": 1, "max_turns": 4,
        "temperature": 1.0, "loss_fn": "ppo", "entropy_coef": 0.05, "learning_rate": 2e-3, "num_substeps": 4,
        "grad_clip_norm": 1.0, "skip_constant_reward": True, "eval_every": 25, "eval_temperature": 0.0,
        "min_surviving_attempts": 2, "backend": "torch",
    }
    Options = GuessOptions

    def engine_config(self, config: TrainConfig, options: GuessOptions) -> EngineConfig:
        if config.backend == "sim":
            raise ConfigurationError("backend='sim': the guess recipe needs a model backend (torch or vllm)")
        if config.max_tokens != 1:
            raise ConfigurationError(f"max_tokens={config.max_tokens}: a guess is one token (max_tokens=1)")
        if not config.episode_timeout_s > options.job_timeout_s:
            raise ConfigurationError(f"episode_timeout_s={config.episode_timeout_s}: must exceed the sandbox's bound "
                                     f"job_timeout_s={options.job_timeout_s}")
        model = given_model(config, self.name)
        if model is not None:
            return model.engine_config(config)
        path = prepare_char_model(ALPHABET, "$", cache_dir=config.cache_dir, seed=config.seed,
                                  max_position_embeddings=max(64, 2 * config.max_turns + 4))
        return EngineConfig(model=path, backend=config.backend, cache_dir=config.cache_dir)

    def datasets(self, config: TrainConfig, options: GuessOptions) -> tuple[RLDataset, RLDataset | None]:
        model = given_model(config, self.name)
        world = _World(options, None if model is None else model_symbols(model, config.max_turns))
        batches = config.steps if config.steps is not None else 300
        return (DigitTasks(world, "secret", batches, config.groups_per_batch, config.group_size, config.seed),
                EveryDigit(world, "secret"))

    @contextlib.asynccontextmanager
    async def attach(self, engine: Engine, dataset: RLDataset, eval_dataset: RLDataset | None) -> AsyncIterator[None]:
        """The IPC server on the engine and the sandbox pool, for the run."""
        from rlengine.serve import ServeConfig, Server

        assert isinstance(dataset, DigitTasks)
        world = dataset.world
        options = world.options
        async with Server(engine, ServeConfig(http=False, max_in_flight=4096)) as server:
            pool = SandboxPool(SANDBOX_MODULE, options.sandboxes, job_timeout_s=options.job_timeout_s)
            try:
                assert server.ipc_path is not None
                await pool.start(server.ipc_path)
                world.pool, world.sessions = pool, server.sessions
                yield
            finally:
                world.pool = None
                await pool.aclose()


RECIPE = GuessGame()
